"""Shared fixtures: offline hub, the tiny model built once, one local Ray for the session."""

import contextlib
import os
import sys

# Read at import time by huggingface_hub: set before anything imports it.
os.environ["HF_HUB_OFFLINE"] = "1"
# Ray's token authentication on, as for a user, with a token of the session's own: the suite never
# reads or writes the user's ~/.ray/auth_token (raycluster.ensure_ray_token creates this one).
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.pop("RAY_AUTH_TOKEN", None)
_TOKEN_DIR = __import__("tempfile").mkdtemp(prefix="dreambooth-tests-")
os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.join(_TOKEN_DIR, "auth_token")
__import__("atexit").register(__import__("shutil").rmtree, _TOKEN_DIR, True)
# W&B never goes online from the suite (workers inherit this), whatever key the machine has.
os.environ["WANDB_MODE"] = "offline"
os.environ.pop("MLFLOW_TRACKING_URI", None)
# Where the suite runs scripts side by side on the 2 cores (test_dreambooth_run's families), torch's OpenMP threads
# sleep while they wait instead of spinning: spinning threads took the CPU the other run needed.
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
# One torch thread in every process of the run (this one, the scripts, every Ray worker: job_runtime_env hands it on
# and share_cpu_threads keeps it): on the tiny models a second thread added a fifth to two fifths of the CPU of the
# steps and no speed, even alone on the 2 cores (40 steps of a tiny UNet: 3.7-4.5 CPU-seconds at 1 thread, 5.3-5.5
# at 2, the same wall time).
os.environ["OMP_NUM_THREADS"] = "1"
# Ray's log monitor looks for new log files 10 times a second until it follows 1000, then twice a second; each look
# lists the whole logs folder, which a cluster that lives the whole run fills with thousands of worker logs (the
# session's cluster's monitor: 177 CPU-seconds in a run of 2026-11-29; with 2000 logs in the folder, 3.6 CPU-seconds
# in 30 s at 10 looks a second, 0.5 at one). Twice a second from the start (as late in a run already), for every
# cluster the suite starts: a fifth of the looks.
os.environ["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] = "0"
# Ray starts its workers at nice 15; the tests' own at 0, so that the runs beside the tests (tests/beside.py, every
# process of theirs at 19) take only the CPU the tests leave idle.
os.environ["RAY_worker_niceness"] = "0"
# The test command installs without compiling (pip --no-compile: a minute less of the install); each module is
# compiled once, when a process of the run first imports it, and its bytecode kept for the others, this package's
# included, even where the machine's environment says to write none (PYTHONDONTWRITEBYTECODE).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_DIR)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (the tests' helper modules)

import cpu_share  # noqa: E402
import pytest  # noqa: E402

# Every process this run starts inherits this value (Ray's daemons and workers, scripts, servers): a process
# that still has it once the run ends was left behind (leftover_processes).
_RUN_MARK = os.environ["RAY_AUTH_TOKEN_PATH"]


def leftover_processes():
    """(pid, command line) of the processes started by this test run that are still alive, found by the
    environment they inherited (_RUN_MARK); this process and its ancestors are not counted."""
    mine = {os.getpid()}
    pid = os.getpid()
    while pid > 1:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        mine.add(pid)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) in mine or _RUN_MARK.encode() not in open(f"/proc/{pid}/environ", "rb").read():
                continue
            command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:  # (gone meanwhile, or not ours to read)
            continue
        if state != "Z":
            found.append((int(pid), command.strip()[:200]))
    return found


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """After every fixture is torn down: a process this run started and left running fails the run (it
    would slow, or hang, whatever runs next on the machine), named, then killed."""
    import signal
    import time

    deadline = time.time() + 30  # (Ray's daemons take some seconds to go after `ray stop`)
    while (left := leftover_processes()) and time.time() < deadline:
        time.sleep(1)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter:
        reporter.ensure_newline()
        reporter.write_line(f"FAILED: {len(left)} process(es) left running by this test run (killed now):", red=True)
        for pid, command in left:
            reporter.write_line(f"  {pid} {command}")
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def free_port():
    """A TCP port that nothing listens on now, never one a Ray node takes by default (raycluster.free_port)."""
    from dreambooth.cluster import raycluster

    return raycluster.free_port()


@contextlib.contextmanager
def environment(env):
    """os.environ with env set in the block, as it was after it (a variable it lacked is removed again)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Snapshot folder of the tiny SD model, written by cache_model.py --tiny."""
    from dreambooth.commands import cache_model

    return cache_model.main(["--model_dir", str(tmp_path_factory.mktemp("model-orig")), "--tiny"])


def tiny_of(tmp_path_factory, folder, arch):
    """Snapshot folder of the tiny model of a family's --arch, written by cache_model.py --tiny --arch in a folder of
    the session's own."""
    from dreambooth.commands import cache_model

    return cache_model.main(["--model_dir", str(tmp_path_factory.mktemp(folder)), "--tiny", "--arch", arch])


@pytest.fixture(scope="session")
def tiny_sd2v_model(tmp_path_factory):
    """Snapshot folder of the tiny SD 2.x v-prediction model (cache_model.py --tiny --arch sd2-v)."""
    return tiny_of(tmp_path_factory, "model-sd2v", "sd2-v")


@pytest.fixture(scope="session")
def tiny_sdxl_model(tmp_path_factory):
    """Snapshot folder of the tiny SDXL model (cache_model.py --tiny --arch sdxl)."""
    return tiny_of(tmp_path_factory, "model-sdxl", "sdxl")


@pytest.fixture(scope="session")
def tiny_sd3_model(tmp_path_factory):
    """Snapshot folder of the tiny SD 3.5 model (cache_model.py --tiny --arch sd3)."""
    return tiny_of(tmp_path_factory, "model-sd3", "sd3")


@pytest.fixture(scope="session")
def tiny_flux_model(tmp_path_factory):
    """Snapshot folder of the tiny Flux.1 dev model (cache_model.py --tiny --arch flux)."""
    return tiny_of(tmp_path_factory, "model-flux", "flux")


@pytest.fixture(scope="session")
def tiny_qwen_model(tmp_path_factory):
    """Snapshot folder of the tiny Qwen-Image model (cache_model.py --tiny --arch qwen)."""
    return tiny_of(tmp_path_factory, "model-qwen", "qwen")


@pytest.fixture(scope="session")
def tiny_flux2_model(tmp_path_factory):
    """Snapshot folder of the tiny FLUX.2 [klein] model (cache_model.py --tiny --arch flux2)."""
    return tiny_of(tmp_path_factory, "model-flux2", "flux2")


@pytest.fixture(scope="session")
def tiny_flux2dev_model(tmp_path_factory):
    """Snapshot folder of the tiny FLUX.2 [dev] model (cache_model.py --tiny --arch flux2dev)."""
    return tiny_of(tmp_path_factory, "model-flux2dev", "flux2dev")


@pytest.fixture(scope="session")
def tiny_zimage_model(tmp_path_factory):
    """Snapshot folder of the tiny Z-Image model (cache_model.py --tiny --arch zimage)."""
    return tiny_of(tmp_path_factory, "model-zimage", "zimage")


@pytest.fixture(scope="session")
def tiny_chroma_model(tmp_path_factory):
    """Snapshot folder of the tiny Chroma model (cache_model.py --tiny --arch chroma)."""
    return tiny_of(tmp_path_factory, "model-chroma", "chroma")


@pytest.fixture(scope="session")
def tiny_eval_models(tmp_path_factory):
    """(cache folder, models folder) of the tiny random scoring models (cache_model.py --eval_models --tiny): the
    cache folder is what dreambooth_run.sh's EVAL_MODELS_CACHE names, the models folder evaluate.py's
    --eval_models_dir. Read only."""
    from dreambooth.commands import cache_model

    cache = tmp_path_factory.mktemp("model-eval")
    return str(cache), cache_model.main(["--model_dir", str(cache), "--eval_models", "--tiny"])


def modes_not_as_umask(path):
    """(path, mode) of path and everything under it whose permission bits are not what open() or mkdir() give
    under this process's umask (a model or an export others must open)."""
    umask = os.umask(0o022)
    os.umask(umask)
    paths = [path] + [os.path.join(root, name) for root, dirs, files in os.walk(path) for name in dirs + files]
    wrong = []
    for name in map(str, paths):
        mode = os.stat(name).st_mode & 0o777
        if mode != (0o777 if os.path.isdir(name) else 0o666) & ~umask:
            wrong.append((name, oct(mode)))
    return wrong


def model_cache_of(snapshot):
    """The hub cache folder (ORIG_MODEL_DIR, --model_dir of cache_model.py) that holds a tiny model's snapshot."""
    return snapshot.split(os.sep + "models--")[0]


def draw_here(model_dir, folder, prompts, count, settings):
    """count images a prompt drawn into folder as generate.main draws them with model_dir and settings (a
    drawing.ImageSettings: its settings_for, top-up and checker rule), in this process by the actor pool's own class
    (drawing.make_images_of(here=True): the pool's files, byte for byte, test_generate), without a pool's start."""
    from dreambooth import families
    from dreambooth.generation import drawing
    from dreambooth.models import outputs

    model = outputs.resolve_model(model_dir)
    settings = drawing.settings_for(settings, families.family_of(model_dir), model_dir)
    job = drawing.top_up(str(folder), model, prompts, count, settings, drawing.use_safety_checker("auto", model))
    drawing.make_images_of([job], settings, 1, here=True)


@pytest.fixture(scope="session")
def shared_ray_cluster(tmp_path_factory):
    """One local Ray cluster for the session, as dreambooth_run.sh keeps one for its steps: every
    script a slow test runs, and this process (ray_session), joins it through RAY_ADDRESS instead
    of starting and stopping its own. A test that needs a cluster of its own sets RAY_ADDRESS."""
    from dreambooth.cluster import raycluster

    port = free_port()
    head, address = raycluster.start_ray_head(tmp_path_factory.mktemp("ray-head") / "ray-head.log", port)
    os.environ["RAY_ADDRESS"] = address
    yield address
    os.environ.pop("RAY_ADDRESS", None)
    raycluster.stop_ray_head(head)


@contextlib.contextmanager
def cluster_beside(folder, env=None):
    """A local cluster (its address) for script runs that go on beside the tests, as several users' runs share a
    cluster: 4 logical CPUs, so that two runs' train workers and their data pipelines fit at once (on the shared
    cluster's 2, a second run's worker would leave the first's streaming dataset no CPU). env: its processes'
    variables beyond this one's."""
    from dreambooth.cluster import raycluster

    head, address = raycluster.start_ray_head(folder / "ray-head.log", free_port(), extra=["--num-cpus=4"], env=env)
    try:
        yield address
    finally:
        raycluster.stop_ray_head(head)


def node_command(address, temp, extra):
    """The shell command of a Ray node that joins the cluster at address (temp: its own temp folder, short)."""
    import shlex

    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    return f"exec {ray} start --block --address={address} --temp-dir={temp} " + " ".join(map(shlex.quote, extra))


def start_node(command, log):
    """A node's process (command: a list, as node_command's in sh -c), once it has joined; None if it gave up (Ray
    waits 30 s for its raylet to register: a machine busy with other runs can take longer), or after 90 s."""
    import subprocess
    import time

    def joined():  # (the log is appended to: a node started again says it once more)
        return open(log).read().count("block forever") if os.path.exists(log) else 0

    before = joined()
    node = subprocess.Popen(command, stdout=open(log, "a"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # with the session's token (RAY_AUTH_TOKEN_PATH)
    deadline = time.time() + 90
    while joined() == before:
        if node.poll() is not None or time.time() > deadline:
            stop_node(node)
            return None
        time.sleep(0.5)
    return node


def stop_node(node, sig=15):
    """Stop a start_node node: SIGTERM (Ray's own stop), or SIGKILL to every process of it (a node lost)."""
    import subprocess

    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, sig)
    try:
        node.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, 9)


@pytest.fixture(scope="session")
def two_node_cluster(tmp_path_factory):
    """A Ray cluster of two nodes on this machine, as a user's head and worker node, both with token
    authentication: (address, unshared). With root and unshare, the second node runs in a mount
    namespace of its own where an empty file system is mounted over the folder unshared (as a node
    without the NFS mount sees it); else unshared is None."""
    import shutil
    import tempfile

    from dreambooth.cluster import raycluster

    port = free_port()
    folder = tmp_path_factory.mktemp("two-nodes")
    head, address = raycluster.start_ray_head(folder / "head.log", port, extra=["--num-cpus=2", "--num-gpus=0"])
    unshared = folder / "unshared"
    unshared.mkdir()
    temp = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # the second node's own (short: socket paths)
    join = node_command(address, temp, ["--num-cpus=1", "--num-gpus=0"])
    if shutil.which("unshare") and os.geteuid() == 0:
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c", f"mount -t tmpfs tmpfs {unshared} && {join}"]
    else:
        command, unshared = ["sh", "-c", join], None

    node = start_node(command, folder / "node.log") or start_node(command, folder / "node.log")  # (once more)
    if node is None:
        raycluster.stop_ray_head(head)
        shutil.rmtree(temp, ignore_errors=True)
        pytest.fail("the second node did not start, twice: " + open(folder / "node.log").read()[-2000:])
    yield address, unshared
    stop_node(node)
    raycluster.stop_ray_head(head)
    shutil.rmtree(temp, ignore_errors=True)


def ray_sessions():
    """The Ray sessions this machine has started (one folder each in Ray's temp dir): a script that
    started a local cluster of its own adds one."""
    import glob

    return set(glob.glob("/tmp/ray/session_2*"))


@pytest.fixture(autouse=True)
def _slow_tests_share_one_cluster(request):
    if request.node.get_closest_marker("slow"):
        request.getfixturevalue("shared_ray_cluster")


@pytest.fixture(scope="session")
def ray_session(shared_ray_cluster):
    """This process joined to the session's Ray cluster (workers get the code via runtime_env)."""
    from dreambooth.cluster import raycluster

    ray = raycluster.init_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def uninterrupted(ray_session, tiny_model, toy_images, tmp_path_factory):
    """(output folder, logged losses) of the run that stopped, drained and bucket runs must end like:
    test_recovery.STOP_STEPS steps of the toy photos with its STOP_OPTIONS on 2 workers (one run for them all)."""
    from test_recovery import STOP_OPTIONS
    from test_recovery import STOP_STEPS
    from test_recovery import logged_losses
    from test_recovery import train_args

    from dreambooth.commands import train

    out = tmp_path_factory.mktemp("uninterrupted") / "whole"
    result = train.main(train_args(tiny_model, toy_images, out, STOP_STEPS, *STOP_OPTIONS))
    return out, logged_losses(result)


@pytest.fixture(scope="session")
def toy_images():
    return os.path.join(REPO_DIR, "images", "toy")


@pytest.fixture()
def make_plan(tiny_model):
    """make_plan(**fields): a plan.Plan of the tiny model on CPU without files or Ray, with a
    learning rate that visibly moves its weights in a step or two."""
    from dreambooth.planning import planning

    def make(**fields):
        base = dict(model_dir=tiny_model, learning_rate=1e-3, adam_weight_decay=0.0, mixed_precision="no")
        return planning.offline_plan(**{**base, **fields})

    return make


@pytest.fixture()
def train_tiny(make_plan):
    """train_tiny(model_dir, steps_taken=3, **fields) -> (plan, steps.TrainState, losses): a few seeded training
    steps of a tiny model without Ray on one fixed batch (a photo and a class image), as a worker takes them."""
    import torch

    from dreambooth.generation import prompts
    from dreambooth.models import networks
    from dreambooth.training import conditioning
    from dreambooth.training import steps

    cpu = torch.device("cpu")

    def run(model_dir, steps_taken=3, **fields):
        plan = make_plan(model_dir=model_dir, resolution=64, **fields)
        torch.manual_seed(0)
        nets = networks.setup_models(plan, cpu, cpu, distributed=False)
        ids = prompts.prompt_ids(model_dir, ["photo of unqtkn toy"], "photo of a toy", plan.family)
        step_prompts = conditioning.step_prompts(plan.family, nets.text_encoders(), plan, ids, cpu)
        state = steps.make_train_state(nets, plan)
        pixels = torch.randint(0, 255, (1, 64, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        batch = {"instance_pixels": pixels, "class_pixels": pixels.flip(1)}
        losses = [float(steps.train_step(state, [batch], step_prompts, 1.0, 1.0)[0]) for _ in range(steps_taken)]
        return plan, state, losses

    return run


@pytest.fixture()
def step_prompts(tiny_model):
    """The conditioning.StepPrompts of an instance and a class prompt's token ids (1, L), as train_fn builds them."""
    import torch
    from transformers import CLIPTokenizer

    from dreambooth.families import family as family_lib
    from dreambooth.training import conditioning

    tokenizer = CLIPTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    ids = {k: torch.from_numpy(family_lib.tokenize_prompt(tokenizer, p)).unsqueeze(0)
           for k, p in (("instance", "photo of unqtkn toy"), ("class", "photo of a toy"))}
    return conditioning.StepPrompts(ids["instance"], ids["class"])


def pytest_collection_modifyitems(items):
    """A test that starts Ray or a subprocess says so with @pytest.mark.slow; one that takes the Ray
    fixture without it is an error at collection, not a slow unit run. The tests that keep both cores busy
    themselves (@pytest.mark.fills_cores) go first; those that read a run beside the others (@pytest.mark.beside)
    last: their runs went on meanwhile."""
    import beside

    for item in items:
        if "ray_session" in item.fixturenames and item.get_closest_marker("slow") is None:
            raise pytest.UsageError(f"{item.nodeid} uses the Ray cluster: mark it @pytest.mark.slow")
        if item.get_closest_marker("beside") and "runs_beside" not in item.fixturenames:
            raise pytest.UsageError(f"{item.nodeid} is marked beside: it reads its run with the runs_beside fixture")
    items[:] = beside.order(items)


_RUNS_BESIDE = []  # the session's beside.Runs, for the summary at the end


@pytest.fixture(scope="session", autouse=True)
def runs_beside(request, tmp_path_factory):
    """beside.Runs of the selected tests marked @pytest.mark.beside(run=spec): each spec's run, one at a time, on a
    cluster of their own (4 logical CPUs, as cluster_beside, started with the first run) while the session goes on,
    from the session's first test (_runs_beside_go). None if no selected test is marked."""
    import shutil
    import tempfile

    import beside

    specs = beside.specs_of(request.session.items)
    if not specs:
        yield None
        return
    folder = tmp_path_factory.mktemp("beside")
    ray_tmpdir = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # (short: Ray's socket paths)
    with contextlib.ExitStack() as stack, contextlib.ExitStack() as cluster:  # (the runs end before their cluster)
        stack.callback(shutil.rmtree, ray_tmpdir, True)

        def start_cluster():  # (in the runs' thread: its processes inherit the thread's priority)
            env = {**beside.RUNS_ENV, "RAY_TMPDIR": ray_tmpdir}
            return cluster.enter_context(cluster_beside(folder, env)), env

        runs = beside.Runs(start_cluster)
        stack.callback(runs.close)
        _RUNS_BESIDE.append(runs)
        for spec in specs:
            where = folder / spec.__name__
            where.mkdir()
            try:
                runs.add(spec, spec(request, where), where)
            except Exception as err:  # (said by the test that reads the run, not by whichever test is first)
                runs.failed[spec] = err
        yield runs


@pytest.fixture(autouse=True)
def _runs_beside_go(runs_beside):
    if runs_beside is not None:
        runs_beside.go()


def pytest_runtest_logstart(nodeid, location):
    cpu_share.start(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    cpu_share.finish(nodeid)


def pytest_terminal_summary(terminalreporter):
    if len(cpu_share.measured) > 1:
        terminalreporter.write_sep("=", "CPU per test (tests/cpu_share.py)")
        for line in cpu_share.summary():
            terminalreporter.write_line(line)
        if os.environ.get("DREAMBOOTH_TESTS_CPU_FILE"):
            cpu_share.write(os.environ["DREAMBOOTH_TESTS_CPU_FILE"])
    for runs in _RUNS_BESIDE:
        terminalreporter.write_sep("=", "runs beside the tests (their tests, at the end, read them)")
        for line in runs.summary():
            terminalreporter.write_line(line)


@pytest.fixture()
def lora_output(make_plan, tmp_path):
    """(folder, networks.Models): LoRA adapters (rank 4, alpha 8, UNet and text encoder) with
    random non-zero weights, written by outputs.save_pipeline as a --use_lora run writes them."""
    plan = make_plan(use_lora=True, lora_rank=4, lora_alpha=8.0, output_dir=str(tmp_path / "lora-out"))
    return plan.output_dir, adapters_saved(plan)


def adapters_saved(plan):
    """networks.Models of plan's adapters (--use_lora, --adapter) on the UNet and text encoder, made non-zero (the
    factors that start at zero drawn at random, DoRA's magnitudes scaled), written by outputs.save_pipeline as a run
    writes them."""
    import torch

    from dreambooth.models import networks
    from dreambooth.models import outputs

    nets = networks.setup_models(plan, torch.device("cpu"), torch.device("cpu"), distributed=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for model in (nets.denoiser, nets.text_encoder):
            for name, weight in model.named_parameters():
                if "magnitude" in name:
                    weight.mul_(1.5)
                elif ".lora_B." in name or ".hada_" in name or ".lokr_" in name:
                    weight.normal_(0, 0.2)
    outputs.save_pipeline(nets, plan)
    return nets


def red_is_mask_photos(folder, count=3):
    """Photos whose red channel is their mask's value (a tall one, a wide one, one with transparency
    instead of a mask file), so a view's pixels say which mask pixels it must carry."""
    import numpy as np
    from PIL import Image

    from dreambooth.generation import imagefiles

    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    photos = []
    for k, (height, width) in enumerate([(40, 24), (24, 36), (30, 30)][:count]):
        mask = (rng.random((height, width)) > 0.5).astype(np.uint8) * 255
        pixels = np.stack([mask, np.full_like(mask, 9 * k), np.full_like(mask, 7)], axis=-1)
        path = folder / f"p{k}.png"
        if k == 2:  # the mask as the photo's own alpha channel
            Image.fromarray(np.concatenate([pixels, mask[..., None]], axis=-1), "RGBA").save(path)
        else:
            Image.fromarray(pixels).save(path)
            Image.fromarray(mask).save(folder / f"p{k}{imagefiles.MASK_SUFFIX}")
        photos.append(str(path))
    return photos


@pytest.fixture()
def webhook():
    """A local webhook server (trackerfiles.Webhook): .url, .received [(path, JSON body)]."""
    from trackerfiles import Webhook

    hook = Webhook()
    yield hook
    hook.close()


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """(environment with the endpoint and credentials, bucket name): a moto S3 server on 127.0.0.1 with an
    empty bucket "runs"; the nodes' copies of its files in a cache folder of the test's (XDG_CACHE_HOME)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # (not a line per request)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://{host}:{port}", XDG_CACHE_HOME=str(tmp_path_factory.mktemp("cache")))
    with environment(env):
        boto3.client("s3").create_bucket(Bucket="runs")
        yield env, "runs"
    server.stop()


@pytest.fixture(scope="module")
def gcs_endpoint(tmp_path_factory):
    """(environment with the endpoint, bucket name): a Google Cloud Storage emulator (gcp-storage-emulator) on
    127.0.0.1 with an empty bucket "runs-gs", reached through CLOUD_STORAGE_EMULATOR_ENDPOINT as Google's own
    libraries reach one; the nodes' copies of its files in a cache folder of the test's (XDG_CACHE_HOME)."""
    import logging

    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="runs-gs")
    server.start()
    env = dict(CLOUD_STORAGE_EMULATOR_ENDPOINT=f"http://127.0.0.1:{port}",
               XDG_CACHE_HOME=str(tmp_path_factory.mktemp("gcs-cache")))
    with environment(env):
        yield env, "runs-gs"
    server.stop()

"""Shared fixtures: offline hub, the tiny models built once, one local Ray cluster for the session."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (the tests' helper modules)

import counts  # noqa: E402
import pytest  # noqa: E402
import support  # noqa: E402,F401 (before the package: the run's environment, before anything imports the hub or Ray)
from support import REPO_DIR  # noqa: E402
from support import STOP_OPTIONS  # noqa: E402
from support import STOP_STEPS  # noqa: E402
from support import adapters_saved  # noqa: E402
from support import environment  # noqa: E402
from support import free_port  # noqa: E402
from support import leftover_processes  # noqa: E402
from support import logged_losses  # noqa: E402
from support import node_command  # noqa: E402
from support import ray_temp  # noqa: E402
from support import start_node  # noqa: E402
from support import stop_node  # noqa: E402
from support import tiny_of  # noqa: E402
from support import train_args  # noqa: E402

from dreambooth import families  # noqa: E402


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Snapshot folder of the tiny SD model, written by cache_model.py --tiny (once a session: built_once)."""
    return support.built_once(tmp_path_factory, "model-orig", ["--tiny"])


@pytest.fixture(scope="session")
def tiny_model_of(tmp_path_factory, tiny_model):
    """tiny_model_of(arch) -> the snapshot folder of the tiny model of a family's --arch (cache_model.py --tiny
    --arch), built once a session, each in a folder of its own (SD 1.x's: tiny_model)."""
    built = {"sd1": tiny_model}

    def of(arch):
        if arch not in built:
            built[arch] = tiny_of(tmp_path_factory, f"model-{arch}", arch)
        return built[arch]

    return of


def _tiny_model_fixture(arch):
    @pytest.fixture(scope="session")
    def fixture(tiny_model_of):
        return tiny_model_of(arch)

    fixture.__doc__ = f"Snapshot folder of the tiny {arch} model (cache_model.py --tiny --arch {arch})."
    return fixture


# tiny_<arch>_model for every family of the table but SD 1.x's (tiny_model): tiny_sdxl_model, tiny_flux_model, ...
for _arch in sorted(set(families.ARCHS) - {"sd1"}):
    globals()[f"tiny_{_arch.replace('-', '')}_model"] = _tiny_model_fixture(_arch)


@pytest.fixture(scope="session")
def tiny_eval_models(tmp_path_factory):
    """(cache folder, models folder) of the tiny random scoring models (cache_model.py --eval_models --tiny): the
    cache folder is what dreambooth_run.sh's EVAL_MODELS_CACHE names, the models folder evaluate.py's
    --eval_models_dir. Read only (once a session: built_once)."""
    models = support.built_once(tmp_path_factory, "model-eval", ["--eval_models", "--tiny"])
    return str(support.shared_folder(tmp_path_factory, "model-eval")), models


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


@pytest.fixture(scope="session")
def two_node_cluster(tmp_path_factory):
    """A Ray cluster of two nodes on this machine, as a user's head and worker node, both with token
    authentication: (address, unshared). With root and unshare, the second node runs in a mount
    namespace of its own where an empty file system is mounted over the folder unshared (as a node
    without the NFS mount sees it); else unshared is None."""
    import shutil

    from dreambooth.cluster import raycluster

    port = free_port()
    folder = tmp_path_factory.mktemp("two-nodes")
    head, address = raycluster.start_ray_head(folder / "head.log", port, extra=["--num-cpus=2", "--num-gpus=0"])
    unshared = folder / "unshared"
    unshared.mkdir()
    temp = ray_temp("n")  # the second node's own
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


@pytest.fixture(scope="session")
def ray_session(shared_ray_cluster):
    """This process joined to the session's Ray cluster (workers get the code via runtime_env)."""
    from dreambooth.cluster import raycluster

    ray = raycluster.init_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def uninterrupted(ray_session, tiny_model, toy_images, tmp_path_factory):
    """(output folder, logged losses) of the run that the stopped (in a bucket) and elastic runs must end like:
    support.STOP_STEPS steps of the toy photos with its STOP_OPTIONS on 2 workers (one run for them all)."""
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

    from dreambooth.families.shared import family as family_lib
    from dreambooth.training import conditioning

    tokenizer = CLIPTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    ids = {k: torch.from_numpy(family_lib.tokenize_prompt(tokenizer, p)).unsqueeze(0)
           for k, p in (("instance", "photo of unqtkn toy"), ("class", "photo of a toy"))}
    return conditioning.StepPrompts(ids["instance"], ids["class"])


def pytest_configure(config):
    config.pluginmanager.register(counts, "counts")  # (its summary at the end, and the budgets' check)


@pytest.fixture()
def lora_output(make_plan, tmp_path):
    """(folder, networks.Models): LoRA adapters (rank 4, alpha 8, UNet and text encoder) with
    random non-zero weights, written by outputs.save_pipeline as a --use_lora run writes them."""
    plan = make_plan(use_lora=True, lora_rank=4, lora_alpha=8.0, output_dir=str(tmp_path / "lora-out"))
    return plan.output_dir, adapters_saved(plan)


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

"""What the tests share besides fixtures: the run's environment (set on import, before anything imports
huggingface_hub or Ray), its Ray temp folder and counter, and helpers for clusters, scripts and models."""

import atexit
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import tempfile

import counts

# Read at import time by huggingface_hub: set before anything imports it.
os.environ["HF_HUB_OFFLINE"] = "1"
# Ray's token authentication on, as for a user, with a token of the run's own: the suite never reads or writes the
# user's ~/.ray/auth_token (raycluster.ensure_ray_token creates this one).
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.pop("RAY_AUTH_TOKEN", None)
_TOKEN_DIR = tempfile.mkdtemp(prefix="dreambooth-tests-")
os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.join(_TOKEN_DIR, "auth_token")
atexit.register(shutil.rmtree, _TOKEN_DIR, True)
# W&B never goes online from the suite (workers inherit this), whatever key the machine has.
os.environ["WANDB_MODE"] = "offline"
os.environ.pop("MLFLOW_TRACKING_URI", None)
# One torch thread in every process of the run (this one, the scripts, every Ray worker: job_runtime_env hands it
# on): the tiny models gain no speed from a second thread, only CPU spent spinning.
os.environ["OMP_NUM_THREADS"] = "1"
REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_DIR)
# Every Ray cluster of the run (this process's, the scripts', the nodes') keeps its session folder under this one
# (short: Ray's socket paths must fit 107 characters), where tests/counts.py counts clusters, runs and workers.
_RAY_ROOT = tempfile.mkdtemp(prefix="r", dir="/tmp")
os.environ["RAY_TMPDIR"] = _RAY_ROOT
atexit.register(shutil.rmtree, _RAY_ROOT, True)
_COUNTER = counts.start([_RAY_ROOT], REPO_DIR)
# Every process this run starts inherits this value (Ray's daemons and workers, scripts, servers): a process that
# still has it once the run ends was left behind (leftover_processes).
_RUN_MARK = os.environ["RAY_AUTH_TOKEN_PATH"]


def ray_temp(prefix="t"):
    """A temp folder of a test's own for a Ray node or Ray's temp folder (short, for Ray's socket paths), whose
    clusters tests/counts.py counts with the run's."""
    folder = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    _COUNTER.roots.append(folder)
    return folder


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


def foreground_job():
    """preexec_fn of a process a test stops with Ctrl-C: started as a terminal's shell starts a foreground job, in a
    process group of its own, SIGINT and SIGQUIT at their defaults whatever this test run inherited (one started in
    the background by a shell without job control ignores both, and so would every process it starts)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


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


@dataclasses.dataclass
class ScriptRun:
    folder: object  # (a pathlib.Path) its outputs' folder
    returncode: int
    stdout: str
    stderr: str


def run_script(argv, folder, env=None, timeout=900):
    """A command run as a user types it, from the repository root, with this run's environment and env's changes
    (None removes a variable): its ScriptRun."""
    import subprocess

    environ = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    proc = subprocess.run(argv, cwd=REPO_DIR, env=environ, capture_output=True, text=True, timeout=timeout)
    return ScriptRun(folder, proc.returncode, proc.stdout, proc.stderr)


def shared_folder(tmp_path_factory, folder):
    """A folder the session's pytest-xdist workers share: in their base temp folder's parent (not made here)."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / folder


def built_once(tmp_path_factory, folder, argv):
    """cache_model.py's main(argv + --model_dir FOLDER) in a shared_folder, under a lock: the first worker builds it,
    the others find it built. Read only."""
    from filelock import FileLock

    from dreambooth.commands import cache_model

    path = shared_folder(tmp_path_factory, folder)
    with FileLock(f"{path}.lock"):
        return cache_model.main(["--model_dir", str(path), *argv])


def tiny_of(tmp_path_factory, folder, arch):
    """Snapshot folder of the tiny model of a family's --arch, written by cache_model.py --tiny --arch once a session."""
    return built_once(tmp_path_factory, folder, ["--tiny", "--arch", arch])


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


def ray_sessions():
    """The Ray sessions (clusters) the run has started so far, as tests/counts.py saw them: a script that started a
    cluster of its own adds one, even after it stopped it and removed its folder."""
    _COUNTER.scan()
    return set(_COUNTER.sessions)


def adapters_saved(plan, seed=0):
    """networks.Models of plan's adapters (--use_lora, --adapter) on the UNet and text encoder, made non-zero (the
    factors that start at zero drawn at random from seed, DoRA's magnitudes scaled), written by outputs.save_pipeline
    as a run writes them."""
    import torch

    from dreambooth.models import networks
    from dreambooth.models import outputs

    nets = networks.setup_models(plan, torch.device("cpu"), torch.device("cpu"), distributed=False)
    torch.manual_seed(seed)
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


def vae_of_its_own(model_dir, folder):
    """The model's VAE with every weight moved by 0.01, saved in folder (--pretrained_vae_model_name_or_path)."""
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae")
    with torch.no_grad():
        for weight in vae.parameters():
            weight.add_(0.01)
    vae.save_pretrained(folder)
    return folder


# The run that the stopped (in a bucket) and elastic runs must end like (conftest.uninterrupted): STOP_STEPS steps of
# the toy photos on 2 workers with STOP_OPTIONS.
STOP_OPTIONS = ["--checkpointing_steps", "1000", "--logging_steps", "1", "--lr", "1e-3", "--seed", "4",
                "--keep_checkpoints", "--checkpoints_total_limit", "3"]
STOP_STEPS = 24


def train_args(tiny_model, toy_images, out, steps, *extra):
    """train.py's arguments for steps steps of the toy photos on 2 workers into out, with extra."""
    return ["--model_dir", tiny_model, "--output_dir", str(out), "--instance_images_dir", toy_images,
            "--instance_prompt", "photo of unqtkn toy", "--train_batch_size", "1", "--num_workers", "2",
            "--num_epochs", "100", "--max_train_steps", str(steps), *extra]


def logged_losses(result):
    """[(step, loss)] of a finished run's metrics.jsonl (result: its Ray Train Result, or its run folder; a folder's or
    a bucket's)."""
    import json

    from dreambooth import storage
    from dreambooth.training import runlog

    rows = storage.read_bytes(storage.join(getattr(result, "path", result), runlog.METRICS_FILE)).decode().splitlines()
    return [(m["step"], m["loss"]) for m in map(json.loads, rows)]


# A family of a test's own (tests/unit/test_families.py): its module. It builds on the UNet families' base as SD 1.x
# does (a family never imports another).
NEW_FAMILY = '''
"""A family of this test only: SD 1.x conditioned on its text encoder's penultimate layer."""

from dreambooth.families.shared import unet


class Penultimate(unet.UNetFamily):
    name, label = "sd1-penultimate", "SD 1.x (penultimate layer)"  # (a folder's name is set by the table)

    def matches(self, pipeline, text_encoder_config):
        return pipeline == self.pipeline and text_encoder_config.get("conditioning_layer") == "penultimate"

    def encode_text(self, text_encoders, ids):
        return text_encoders[0](ids, output_hidden_states=True).hidden_states[-2], None


FAMILY = Penultimate()
'''


def write_subject(folder, images, info):
    """A subject folder of a sweep: copies of images, and info as its subject file (None: none)."""
    from dreambooth import files
    from dreambooth.generation import imagefiles

    os.makedirs(folder)
    for image in images:
        shutil.copy(image, folder)
    if info is not None:
        files.write_json(os.path.join(folder, imagefiles.SUBJECT_FILE), info)


def saved_subject(make_plan, root, name, adapter="lora", seed=0, **fields):
    """A subject's folder under root as dreambooth_run.sh leaves it: adapters_saved's (seed) in <name>/model-tuned, as
    a --use_lora run (--adapter) saves them; its catalog.Subject."""
    from dreambooth.serving import catalog

    plan = make_plan(use_lora=True, lora_rank=4, lora_alpha=8.0, adapter=adapter,
                     output_dir=str(root / name / catalog.MODEL_FOLDER), **fields)
    adapters_saved(plan, seed=seed)
    return catalog.find(str(root), name)

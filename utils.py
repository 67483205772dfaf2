"""Shared helpers: errors, file naming, seeding, Ray start-up, model-folder checks."""

import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

# The tiny model is stored in the hub cache layout under its own name, so it never
# shadows a real model and every script finds it exactly as it finds SD 1.4.
TINY_MODEL_NAME = "dreambooth-ray/tiny-stable-diffusion"
TINY_REVISION = hashlib.sha1(b"dreambooth-ray tiny sd v2").hexdigest()

IMAGE_SUFFIX = ".png"
GRID_DIR = "grid"
# Written into every model directory train.py produces, so a rerun can tell
# its own previous output from a folder the user cares about.
OUTPUT_MARKER = "dreambooth_training.json"


class UserError(Exception):
    """A problem with the user's input: reported as one line, no traceback."""


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_main(main_fn):
    """Run a script's main(); turn UserError, Ctrl-C and SIGTERM into one line and an exit code."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return main_fn()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


# ---------------------------------------------------------------- naming and seeds


def slugify(text, max_len=60):
    """'Photo of a dog!' -> 'photo-of-a-dog' (file-system safe, stable)."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:max_len].rstrip("-") or "prompt"


def image_file_name(prompt, index):
    """Stable file name of the index-th image of a prompt: '<slug>-<index:05d>.png'."""
    return f"{slugify(prompt)}-{index:05d}{IMAGE_SUFFIX}"


def image_seed(base_seed, prompt, index):
    """Deterministic 31-bit seed for one image, from the run seed, its prompt and index.

    Independent of batch size, actor count and which images already exist, so a rerun
    that tops up a folder draws exactly the images an uninterrupted run would.
    """
    key = f"{base_seed}:{prompt}:{index}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") & 0x7FFFFFFF


def hub_snapshot_path(cache_dir, model_name, revision):
    """Where snapshot_download puts a revision inside a hub cache folder."""
    folder = "models--" + model_name.replace("/", "--")
    return os.path.join(cache_dir, folder, "snapshots", revision)


# ---------------------------------------------------------------- files


def atomic_write_dir(final_dir, write_fn):
    """Call write_fn(tmp_dir) then move tmp_dir to final_dir, replacing it whole.

    The destination either keeps its previous content or gets the complete new one:
    a crash or a failed write leaves only a hidden temporary folder behind.
    """
    parent = os.path.dirname(os.path.abspath(final_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(final_dir) + "-", dir=parent)
    try:
        write_fn(tmp_dir)
        if os.path.exists(final_dir):
            old = tmp_dir + ".old"
            os.rename(final_dir, old)
            os.rename(tmp_dir, final_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp_dir, final_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


TEMP_MARK = ".tmp-"


def save_image_atomic(image, path):
    """Save a PIL image so that `path` never holds a truncated file."""
    tmp = f"{path}{TEMP_MARK}{os.getpid()}"
    image.save(tmp, format="PNG")
    os.replace(tmp, path)


def remove_temp_files(folder):
    """Delete what save_image_atomic left behind when its process was killed mid-write."""
    for name in os.listdir(folder):
        if TEMP_MARK in name:
            os.remove(os.path.join(folder, name))


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


# ---------------------------------------------------------------- Ray


def quiet_ray_worker():
    """Every Ray worker process of our jobs runs this first (runtime_env worker_process_setup_hook).

    Without ray[default] there is no state API, and Ray Train's placement-group cleaner
    warns that it cannot query it every second of a run; the warning is harmless.
    """
    import logging

    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)


def init_ray():
    """Start local Ray, or join the cluster in RAY_ADDRESS, shipping this code to workers.

    The project's modules travel as the runtime environment's working_dir, the same
    mechanism a multi-node cluster needs; all paths passed to workers are absolute.
    """
    import ray

    # Train's controller polls workers every 2 s by default, which adds ~1.5 s to
    # every ray.train.report; 0.2 s keeps reporting cheap.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Our excludes below name Ray's defaults (.git, .venv, ...); without this Ray warns about each.
    os.environ.setdefault("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", "")
    if ray.is_initialized():
        return ray
    runtime_env = {
        "working_dir": REPO_DIR,
        "excludes": [".venv", "venv", ".git", "tests", "images", "benchmarks", "**/__pycache__", "*.png", "*.jpg"],
        "worker_process_setup_hook": "utils.quiet_ray_worker",
        "env_vars": {
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"],
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
            "TOKENIZERS_PARALLELISM": "false",
        },
    }
    ray.init(runtime_env=runtime_env, log_to_driver=True, configure_logging=False)
    return ray


def cluster_gpus():
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def cluster_cpus():
    import ray

    return float(ray.cluster_resources().get("CPU", 0))


# ---------------------------------------------------------------- models


def quiet_hf_logging():
    """Silence per-component loading bars and the missing-accelerate notice in workers."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def torch_device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def check_model_dir(model_dir, allow_unsafe_weights=False):
    """Fail early, naming what is missing, if model_dir is not a diffusers SD folder.

    Without allow_unsafe_weights, each network must come as safetensors: pickled .bin
    weights can execute code when loaded.
    """
    if not os.path.isdir(model_dir):
        raise UserError(f"model folder not found: {model_dir}")
    index_path = os.path.join(model_dir, "model_index.json")
    if not os.path.isfile(index_path):
        raise UserError(f"{model_dir} has no model_index.json: not a diffusers pipeline folder")
    for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        if not os.path.isdir(os.path.join(model_dir, part)):
            raise UserError(f"model folder {model_dir} is missing its '{part}' component")
    for part in ("unet", "vae", "text_encoder"):
        names = os.listdir(os.path.join(model_dir, part))
        if not any(n.endswith(".safetensors") for n in names):
            if not any(n.endswith(".bin") for n in names):
                raise UserError(f"model folder {model_dir} has no weights in '{part}'")
            if not allow_unsafe_weights:
                raise UserError(f"'{part}' in {model_dir} has only pickled .bin weights; convert them to "
                                "safetensors or pass --allow_unsafe_weights if you trust their source")

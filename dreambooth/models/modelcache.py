"""The one model cache: where base models and the scoring models live (HF_HOME's hub cache, or a
bucket's copy on this node), a hub name or short name resolved to its pinned snapshot there, a download
into it, random models written into it under their own hub names. Every script resolves its model
names here (resolve_model_name); cache_model.py fills the cache."""

import hashlib
import os
import re
import sys

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import hub
from dreambooth import storage
from dreambooth.config import flags
from dreambooth.models import known_models
from dreambooth.models import outputs
from dreambooth.models import random_models

# What DiffusionPipeline.from_pretrained reads: configs, tokenizer files, safetensors
# weights of the full-precision, non-EMA-only variant.
ALLOW_PATTERNS = ["model_index.json", "*/*.json", "*/*.txt", "*/*.safetensors", "*/spiece.model"]  # (T5's vocabulary)


# (text_encoders/: SD 3.5's single-file copies of its text encoders, 15 GB, beside text_encoder*/)
IGNORE_PATTERNS = ["*.ckpt", "*.bin", "*.msgpack", "*.onnx", "*.h5", "*.fp16.*", "*non_ema*", "*.ema.*",
                   "text_encoders/*"]


# The tiny model is stored in the hub cache layout under its own name, so it never
# shadows a real model and every script finds it exactly as it finds SD 1.4.
RANDOM_MODEL_OWNER = "dreambooth-ray"  # every random model's hub name starts with it


TINY_MODEL_NAME = f"{RANDOM_MODEL_OWNER}/tiny-stable-diffusion"


# Bump when random_models.build_pipeline draws other weights for the same MODEL_SIZES entry.
RANDOM_MODEL_VERSION = 3


def hub_cache_dir():
    """The Hugging Face hub cache folder (HF_HUB_CACHE, or HF_HOME/hub, or ~/.cache/huggingface/hub)."""
    home = os.environ.get("HF_HOME", os.path.join("~", ".cache", "huggingface"))
    return os.path.expanduser(os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"))


def model_cache_dir():
    """The suite's one model cache, for dreambooth_run.sh and the scripts run by hand alike:
    ORIG_MODEL_DIR, else $DATA_PREFIX/model-orig, else data/model-orig in the repository (the script's
    default DATA_PREFIX; an installed package's: in the current folder). On a cluster it lies on DATA_PREFIX's shared storage, so every node finds
    a model where the driver found it."""
    if os.environ.get("ORIG_MODEL_DIR"):
        return flags.storage_location(os.environ["ORIG_MODEL_DIR"])
    default = os.path.join(files.REPO_DIR if files.IN_CHECKOUT else os.getcwd(), "data")
    prefix = flags.storage_location(os.environ.get("DATA_PREFIX") or default)
    return storage.join(prefix, "model-orig")


def cache_on_node(cache_dir):
    """The local folder a model cache is filled in: itself, or for a bucket's cache (s3://…) this node's copy
    of it, whose models go to the bucket (to_bucket)."""
    return storage.cache_path(cache_dir) if storage.is_remote(cache_dir) else cache_dir


def to_bucket(path, cache_dir, last="model_index.json"):
    """For a bucket's model cache cache_dir: the folder path filled in its copy on this node (cache_on_node)
    copied to the bucket once, so that every node caches it from there; returns its URI (else path itself).
    A model found elsewhere (your own hub cache) is left where it is."""
    local = cache_on_node(cache_dir)
    if local == cache_dir or not path.startswith(local + os.sep):
        return path
    uri = storage.join(cache_dir, *os.path.relpath(path, local).split(os.sep))
    if storage.mirror_up(path, uri, last):
        print(f"copied {path} to {uri} (each node caches it from there)", file=sys.stderr)
    return uri


def looks_like_hub_name(value):
    return known_models.known_model(value) is not None or re.fullmatch(r"[\w.-]+/[\w.-]+", value) is not None


def resolve_model_name(value, cache_dir=None):
    """A model folder for --pretrained_model_name_or_path: a folder as given, else a short or hub
    name, found in the suite's model cache (model_cache_dir, what Step 1 fills) or in your own hub
    cache (read, never written: a model you already have is not fetched again), else fetched once
    into the model cache as Step 1 does (pinned for the known names, safetensors only). A bucket's folder
    (s3://…, gs://…) is copied into this node's cache once (storage.cached)."""
    if storage.is_remote(value):
        return storage.cached(value)
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) or value.startswith(("/", ".", "~")) or not looks_like_hub_name(value):
        return path
    name, revision = pinned_revision(value, None)
    cache_dir = cache_dir or model_cache_dir()
    local = cache_on_node(cache_dir)  # (a bucket's model cache: this node's copy, its models copied there)
    for folder in dict.fromkeys((local, hub_cache_dir())):
        found = cached_snapshot(folder, name, revision) or cached_main(folder, name, revision)
        if found:
            to_bucket(found, cache_dir)
            return found
    print(f"{value}: not a folder here nor in the model cache {cache_dir}; fetching {name}@{revision} there "
          "(pipeline files, safetensors only; once)", file=sys.stderr)
    path = download_model(local, name, revision)
    to_bucket(path, cache_dir)
    return path


def cached_main(cache_dir, model_name, revision):
    """The cached snapshot a branch name (main) points at, if complete: an unpinned name works offline."""
    ref = os.path.join(repo_cache_path(cache_dir, model_name), "refs", revision)
    if not os.path.isfile(ref):
        return None
    with open(ref) as f:
        return cached_snapshot(cache_dir, model_name, f.read().strip())


def pinned_revision(model_name, revision):
    """(hub name, revision) of a model name: a known model's pin unless revision says otherwise; an
    unknown one's revision, or main."""
    known = known_models.known_model(model_name)
    if known:
        return known.hub_name, revision or known.revision
    return model_name, revision or "main"


def repo_cache_path(cache_dir, model_name):
    """A repository's folder inside a hub cache folder (its refs/ and snapshots/)."""
    return os.path.join(cache_dir, "models--" + model_name.replace("/", "--"))


def hub_snapshot_path(cache_dir, model_name, revision):
    """Where snapshot_download puts a revision inside a hub cache folder."""
    return os.path.join(repo_cache_path(cache_dir, model_name), "snapshots", revision)


def random_model_id(size, arch=None):
    """(hub name, revision) of a built random model: the tiny SD 1.x one keeps its historical name,
    another architecture's name says it (tiny-stable-diffusion-2-v); the revision names the
    architecture and the build, so a changed model never reuses an old folder."""
    arch = arch or families.DEFAULT.random.arch
    family = "" if arch == families.DEFAULT.random.arch else "-" + arch.replace("sd", "", 1)
    name = (TINY_MODEL_NAME + family if size == "tiny"
            else f"{RANDOM_MODEL_OWNER}/random-stable-diffusion{family}-{size}")
    build = f"{name} v{RANDOM_MODEL_VERSION} {sorted(random_models.size_spec(size, families.ARCHS[arch]).items())}"
    if arch != families.DEFAULT.random.arch:
        build += f" {arch} {sorted(families.ARCHS[arch].random.changes.items())}"
    return name, hashlib.sha1(build.encode()).hexdigest()


def has_random_weights(model_dir):
    """True for a model written by write_random_model, or tuned by train.py from one."""
    output = outputs.read_output(model_dir)
    if output is not None:
        model_dir = output.base_model
    return f"models--{RANDOM_MODEL_OWNER}--" in os.path.abspath(model_dir)


def write_random_model(cache_dir, size="tiny", arch=None):
    """Build a random model of random_models.MODEL_SIZES and a family's random.changes and save it in the hub
    layout (refs/main + snapshots/<revision>), where every script finds it as it finds SD 1.4."""
    arch = arch or families.DEFAULT.random.arch
    name, revision = random_model_id(size, arch)
    snapshot = hub_snapshot_path(cache_dir, name, revision)
    # Built from a fixed seed and renamed into place whole: one already there is this model, as a
    # cached download is (a change to MODEL_SIZES comes with a new revision).
    if os.path.isfile(os.path.join(snapshot, "model_index.json")):
        return snapshot
    random_models.check_room_for(size, arch, cache_dir)
    pipeline = random_models.build_pipeline(size, arch=arch)
    if not errors.on_terminal():  # (transformers' "Writing model shards" bar: for a person, not a log)
        import transformers

        transformers.utils.logging.disable_progress_bar()
    files.atomic_write_dir(snapshot, lambda tmp: pipeline.save_pretrained(tmp, safe_serialization=True))
    refs = os.path.join(repo_cache_path(cache_dir, name), "refs")
    os.makedirs(refs, exist_ok=True)
    # snapshot_download refuses a ref with a trailing newline.
    with open(os.path.join(refs, "main"), "w") as f:
        f.write(revision)
    return snapshot


def cached_snapshot(cache_dir, model_name, revision):
    """The cached snapshot folder of a pinned commit, or None.

    A 40-hex revision names a commit, whose files never change: once its folder holds a
    complete pipeline, there is nothing to ask the hub (offline or not, on any major
    version of huggingface_hub, whose offline behaviour differs).
    """
    if not re.fullmatch(r"[0-9a-f]{40}", revision or ""):
        return None
    path = hub_snapshot_path(cache_dir, model_name, revision)
    try:
        families.check_model_dir(path)
    except errors.UserError:
        return None
    return path


def download_model(cache_dir, model_name, revision):
    """snapshot_download of the pipeline files; a pinned commit already cached needs no hub. A gated model
    without a hub token is refused before the hub is asked (check_access)."""
    cached = cached_snapshot(cache_dir, model_name, revision)
    if cached:
        return cached
    known_models.check_access(model_name)
    return hub.hub_download(
        f"{model_name}@{revision}", "run once with network access or use --tiny",
        repo_id=model_name, revision=revision, cache_dir=cache_dir,
        allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS, refused=known_models.gated_line(model_name))


# What transformers' from_pretrained reads for a ViT or a CLIPModel and its processor.
EVAL_ALLOW_PATTERNS = ["*.json", "*.txt", "*.safetensors"]




SAFE_WEIGHTS = "model.safetensors"


def download_eval_model(cache_dir, model_name, revision, allow_unsafe_weights):
    """Snapshot folder of a transformers model, with safetensors weights. A repository that has
    only pickled weights is converted once, and only with allow_unsafe_weights."""
    snapshot = hub_snapshot_path(cache_dir, model_name, revision)
    if not (re.fullmatch(r"[0-9a-f]{40}", revision) and has_weights(snapshot)):
        snapshot = hub.hub_download(f"{model_name}@{revision}", "run once with network access or use --tiny",
                                    repo_id=model_name, revision=revision, cache_dir=cache_dir,
                                    allow_patterns=EVAL_ALLOW_PATTERNS)
    if any(n.endswith(".safetensors") for n in os.listdir(snapshot)):
        return snapshot
    if not allow_unsafe_weights:
        raise errors.UserError(f"{model_name}@{revision} has only pickled weights ({PICKLED_WEIGHTS}), which can "
                               "run code when loaded; pass --allow_unsafe_weights to fetch them once and convert "
                               "them to safetensors")
    if not os.path.isfile(os.path.join(snapshot, PICKLED_WEIGHTS)):
        snapshot = hub.hub_download(f"{model_name}@{revision}", "run once with network access",
                                    repo_id=model_name, revision=revision, cache_dir=cache_dir,
                                    allow_patterns=EVAL_ALLOW_PATTERNS + [PICKLED_WEIGHTS])
    convert_to_safetensors(os.path.join(snapshot, PICKLED_WEIGHTS), os.path.join(snapshot, SAFE_WEIGHTS))
    return snapshot


def convert_to_safetensors(pickled, target):
    """Write a pickled state dict as safetensors (tensors that share storage each get their own copy)."""
    import torch
    from safetensors.torch import save_file

    weights = torch.load(pickled, map_location="cpu", weights_only=True)
    tmp = target + files.TEMP_MARK
    save_file({k: v.contiguous().clone() for k, v in weights.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, target)
    print(f"converted {pickled} to {target}", file=sys.stderr)


def cache_eval_models(cache_dir, tiny, dino, clip, allow_unsafe_weights=False):
    """cache_dir/eval-models(-tiny): dino/ and clip/ as evaluate.py reads them (dino, clip: (hub name, revision);
    tiny: random tiny ones instead), and eval_models.json naming each model and the commit it came from. The
    downloaded ones link into the hub cache."""
    if tiny:
        folder = os.path.join(cache_dir, "eval-models-tiny")
        if not all(has_weights(os.path.join(folder, part)) for part in ("dino", "clip")):
            files.atomic_write_dir(folder, random_models.build_tiny_eval_models)
        return folder
    folder = os.path.join(cache_dir, "eval-models")
    os.makedirs(folder, exist_ok=True)
    record = {}
    for part, (name, revision) in (("dino", dino), ("clip", clip)):
        snapshot = download_eval_model(cache_dir, name, revision, allow_unsafe_weights)
        link = os.path.join(folder, part)
        tmp = link + files.TEMP_MARK
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(os.path.relpath(snapshot, folder), tmp)
        os.replace(tmp, link)
        record[part] = {"model": name, "revision": os.path.basename(snapshot)}
    files.write_json(os.path.join(folder, "eval_models.json"), record)
    return folder


EVAL_MODEL_PARTS = ("dino", "clip")  # the folders of --eval_models_dir


PICKLED_WEIGHTS = "pytorch_model.bin"


def has_weights(folder):
    """folder holds a transformers model: its config and its weights (safetensors, or pickled)."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return os.path.isfile(os.path.join(folder, "config.json")) and any(
        n.endswith(".safetensors") or n == PICKLED_WEIGHTS for n in names)


def check_eval_models_dir(folder):
    """UserError, before any image is drawn, unless folder holds dino/ and clip/ with a config and
    whole weights (what cache_model.py --eval_models prints)."""
    for part in EVAL_MODEL_PARTS:
        path = os.path.join(folder, part)
        files.check_model_files(path, "fetch them again (cache_model.py --eval_models)")  # (a broken link, ...)
        if not has_weights(path):
            raise errors.UserError(f"--eval_models_dir {folder} has no {part}/ model (config.json and weights): "
                                   "pass the folder `cache_model.py --model_dir DIR --eval_models` prints")

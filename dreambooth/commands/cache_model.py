"""Step 1: fetch a pinned Stable Diffusion revision into a hub-layout cache folder.

    python cache_model.py --model_dir=$ORIG_MODEL_DIR --model_name=$ORIG_MODEL_NAME --revision=$ORIG_MODEL_HASH
    python cache_model.py --model_dir=$ORIG_MODEL_DIR --tiny

Prints the snapshot path, the folder every other script takes as --model_dir. Only the
files a diffusers pipeline loads are fetched (the SD 1.4 repo also holds multi-GB .ckpt
files), safetensors weights only. With the files already cached it works offline.
--tiny writes a randomly initialised tiny SD 1.x model instead (no network at all), and
--random_model sd15 the full-size SD 1.x architecture with random weights (GPU checks);
--arch sd2-v makes either an SD 2.x v-prediction model (SD 2.1's layout).

    python cache_model.py --model_dir=$EVAL_CACHE_DIR --eval_models [--tiny]

caches evaluate.py's scoring models (DINO ViT-S/16 and CLIP, or tiny random ones) and prints
the folder to pass as --eval_models_dir: its dino/ and clip/ point into the cache.
"""

import os
import sys

from dreambooth import errors
from dreambooth import families
from dreambooth.config import flags
from dreambooth.models import known_models
from dreambooth.models import modelcache
from dreambooth.models import random_models


def random_model_help():
    own = ", ".join(f"{size}: the full {f.label} one" for size, f in random_models.random_sizes().items() if f)
    return (f"Write a randomly initialised model of this size instead ({', '.join(random_models.random_sizes())}; sd15: the "
            f"full SD 1.x architecture, {own}, for GPU checks without a download); --tiny is --random_model tiny.")


ARCH_HELP = ("The architecture of --tiny / --random_model, one per model family: "
             + ", ".join(f"{f.random.arch} ({f.label}, {f.random.note})" for f in families.ARCHS.values())
             + ". Its hub name says it: dreambooth-ray/tiny-stable-diffusion-2-v, -xl.")


def main(argv=None):
    parser = flags.make_parser(__doc__.splitlines()[0], [
        "cache_dir", "model_name", "revision", "tiny", "random_model", "arch", "eval_models", "dino_model", "dino_revision",
        "clip_model", "clip_revision", "allow_unsafe_weights"], helps={"arch": ARCH_HELP, "random_model": random_model_help()})
    args = parser.parse_args(argv)
    if args.arch is not None and args.arch not in families.ARCHS:
        parser.error(f"argument --arch: invalid choice: {args.arch!r} (choose from {', '.join(families.ARCHS)})")
    given = os.path.relpath(args.cache_dir) if args.cache_dir and args.cache_dir.startswith("/") else args.cache_dir
    if given and not os.path.exists(given) and (given == "tiny" or known_models.known_model(given)):  # (a known name)
        raise errors.UserError(f"--model_dir {given}: cache_model.py's --model_dir is the folder it caches models in "
                               f"(the name Ray's example gives it); the model is --model_name {given}")
    bucket = args.cache_dir or modelcache.model_cache_dir()
    args.cache_dir = modelcache.cache_on_node(bucket)  # (a bucket's: filled here, then copied there)
    args.tiny = args.tiny or args.model_name == "tiny"
    try:
        os.makedirs(args.cache_dir, exist_ok=True)
    except OSError as err:
        raise errors.UserError(f"cannot create the model cache folder {args.cache_dir}: {err.strerror or err}; "
                               "give a folder this user can write (--model_dir)") from None
    sizes = random_models.random_sizes()
    if args.random_model is not None and args.random_model not in sizes:
        parser.error(f"argument --random_model: invalid choice: {args.random_model!r} (choose from {', '.join(sizes)})")
    owner = sizes.get(args.random_model)
    if owner is not None:  # a size of its own family
        if args.arch not in (None, owner.random.arch):
            raise errors.UserError(f"--random_model {args.random_model} is {owner.label}'s architecture, "
                                   f"not --arch {args.arch}")
        args.arch = owner.random.arch
    if args.arch and (args.eval_models or not (args.tiny or args.random_model)):
        raise errors.UserError("--arch is the architecture of a model built here (--tiny, --random_model); a "
                               "downloaded model's family is read from its files")
    path, last = cache_here(args)
    path = modelcache.to_bucket(path, bucket, last)
    print(path)
    return path


def cache_here(args):
    """(the folder cache_model.py fills in args.cache_dir, the file that says it is complete)."""
    if args.eval_models:
        folder = modelcache.cache_eval_models(args.cache_dir, args.tiny, (args.dino_model, args.dino_revision),
                                              (args.clip_model, args.clip_revision), args.allow_unsafe_weights)
        return folder, "clip/config.json" if args.tiny else "eval_models.json"
    if args.tiny or args.random_model:
        path = modelcache.write_random_model(args.cache_dir, args.random_model or "tiny", args.arch)
    else:
        known_models.check_name(args.model_name, "--model_name")
        if known_models.known_model(args.model_name) is None and args.revision is None:
            print(f"note: {args.model_name} is not a short name: caching its main branch (--revision <commit> pins "
                  "it; ORIG_MODEL_HASH with dreambooth_run.sh)", file=sys.stderr)
        path = modelcache.download_model(args.cache_dir, *modelcache.pinned_revision(args.model_name, args.revision))
    families.check_model_dir(path)
    return path, "model_index.json"

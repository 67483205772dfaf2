"""Before Step 1 of dreambooth_run.sh: everything that would fail hours later, checked in seconds.

    python preflight.py --photos_dir "$PHOTOS" --photos_var INSTANCE_DIR --class_name "$CLASS_NAME" \\
        --data_prefix "$DATA_PREFIX" --model_name "$ORIG_MODEL_NAME" --num_workers "$NUM_WORKERS"

Checks the photos (present, readable), the class name, the Ray cluster's GPUs against the workers
asked for, the free disk under DATA_PREFIX (base model + one checkpoint + the tuned model), and on a
cluster of several nodes that DATA_PREFIX and the photos are the same storage on every node (a Ray
task on each node writes there; the head reads it back). Each failure is one line naming the
variable to change. Prints the resolved worker count last, as `NUM_WORKERS=<n>`, after the values of
train.py's --max_train_steps and --resolution when given there (`MAX_TRAIN_STEPS=<n>`, `RESOLUTION=<n>`). The words after
`--` are the flags the script passes on to train.py (TRAIN_ARGS and its own after `--`): a flag
train.py does not know, or a value it refuses, stops the run here instead of at Step 4.
"""

import argparse
import os
import shutil
import sys
import tempfile
import uuid

import cache_model
import flags
import planning
import utils

GB = 1e9
TINY_GB = 0.01  # the built-in tiny model, its checkpoint and its output
LORA_GB = 0.2  # a LoRA checkpoint or output (adapters and their optimizer state), rounded up
TRAINED_SHARE = 0.92  # UNet + text encoder of an SD checkpoint's weights (the VAE is frozen)


def parse_args(argv=None):
    parser = flags.OneLineErrorParser(description=__doc__.splitlines()[0], formatter_class=flags.HelpFormatter)
    parser.add_argument("--photos_dir", required=True, type=flags.abs_path, help="The subject's photos.")
    parser.add_argument("--photos_var", default="INSTANCE_DIR", help="The variable that set --photos_dir.")
    parser.add_argument("--class_name", default="", help="CLASS_NAME.")
    parser.add_argument("--data_prefix", required=True, type=flags.abs_path, help="DATA_PREFIX: where everything is written.")
    parser.add_argument("--model_name", default=cache_model.DEFAULT_MODEL, help="ORIG_MODEL_NAME.")
    parser.add_argument("--model_path", default=None, help="The model's folder, if already cached.")
    parser.add_argument("--model_cache", default=None, type=flags.abs_path,
                        help="ORIG_MODEL_DIR: the hub cache folder Step 1 fills (a model already there is not "
                             "counted again).")
    parser.add_argument("--revision", default=None, help="ORIG_MODEL_HASH.")
    parser.add_argument("--num_workers", default="", help="NUM_WORKERS ('' or 0: one per GPU).")
    parser.add_argument("--gpus_per_worker", type=int, choices=(1, 2), default=1, help="GPUS_PER_WORKER.")
    parser.add_argument("--use_lora", action="store_true", help="LoRA: small checkpoints and output.")
    parser.add_argument("--tiny", action="store_true", help="The built-in tiny model (no GPU expected).")
    args = parser.parse_args(argv)
    if args.num_workers and not args.num_workers.isdigit():
        parser.error(f"NUM_WORKERS={args.num_workers}: must be a whole number (or unset: one per GPU)")
    args.num_workers = int(args.num_workers or 0)
    return args


def check_train_flags(words):
    """The user's train.py flags (TRAIN_ARGS, the script's words after --) parse as train.py parses
    them; the flags the script itself passes are not needed here. Exits 2 with argparse's line."""
    required = [name for name in planning.TRAIN_FLAGS if flags.FLAGS[name][1].get("required")]
    parser = flags.make_parser(None, planning.TRAIN_FLAGS, refused=flags.REFUSED, config=True, optional=required)
    parser.prog = "train.py flags (TRAIN_ARGS, or after --)"
    return parser.parse_args(words)


def check_photos(folder, variable):
    """The photos are there and each one opens (a corrupt one is named)."""
    import dataset

    if not os.path.isdir(folder):
        raise utils.UserError(f"{variable}={folder}: no such folder; put 4-6 photos of your subject there")
    try:
        photos = dataset.list_images(folder, f"{variable}")
        with tempfile.TemporaryDirectory() as scratch:
            dataset.inspect_images(photos, 0, scratch)
    except utils.UserError as err:
        raise utils.UserError(f"{variable}={folder}: {err}") from None
    if len(photos) < 3:
        print(f"warning: {variable}={folder} has {len(photos)} photo(s); DreamBooth wants 3-10", file=sys.stderr)
    return photos


def disk_needed_gb(args):
    """(GB needed under DATA_PREFIX, what for): the base model unless cached, one checkpoint
    (fp32 weights + AdamW's two moments of what is trained), the tuned model."""
    if args.tiny:
        return TINY_GB, "the tiny model"
    known = cache_model.known_model(args.model_name)
    if args.model_path is None and args.model_cache:
        args.model_path = cache_model.cached_snapshot(args.model_cache,
                                                      *cache_model.pinned_revision(args.model_name, args.revision))
    cached = args.model_path and os.path.isfile(os.path.join(args.model_path, "model_index.json"))
    weights = known.weights_gb if known else 5.0
    if cached:
        weights = sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(args.model_path)
                      for n in names if n.endswith(".safetensors")) / GB
    download = 0.0 if cached else weights
    checkpoint = LORA_GB if args.use_lora else 3 * TRAINED_SHARE * weights
    tuned = LORA_GB if args.use_lora else weights
    parts = f"model {download:.1f} + a checkpoint {checkpoint:.1f} + the tuned model {tuned:.1f} GB"
    return download + checkpoint + tuned, parts


def check_disk(args):
    os.makedirs(args.data_prefix, exist_ok=True)
    needed, parts = disk_needed_gb(args)
    free = shutil.disk_usage(args.data_prefix).free / GB
    if free < needed:
        raise utils.UserError(f"DATA_PREFIX={args.data_prefix} has {free:.1f} GB free; this run needs about "
                              f"{needed:.1f} GB ({parts}): set DATA_PREFIX to a larger disk")


def check_workers(args, cpus, gpus):
    """The resolved worker count (train.py's rule, planning.worker_resources), or one line naming
    NUM_WORKERS / GPUS_PER_WORKER."""
    settings = argparse.Namespace(use_gpu=None, num_workers=args.num_workers or None,
                                  gpus_per_worker=args.gpus_per_worker)
    return planning.worker_resources(settings, cpus, gpus, spell=lambda name, value: f"{name.upper()}={value}",
                                     warn_no_gpu=not args.tiny)[1]


def check_shared(data_prefix, photos_var, photos_dir, num_photos):
    """On a cluster of several nodes: a Ray task on each node writes a file under data_prefix and
    counts the photos; the head must see every node's file, and every node the photos. One node:
    nothing to check."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    probe = os.path.join(data_prefix, f".preflight-{uuid.uuid4().hex[:8]}")

    @ray.remote(num_cpus=0)
    def visit(node_id):
        os.makedirs(probe, exist_ok=True)
        with open(os.path.join(probe, node_id), "w") as f:
            f.write(node_id)
        return len(os.listdir(photos_dir)) if os.path.isdir(photos_dir) else 0

    seen = ray.get([visit.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                    .remote(n["NodeID"]) for n in nodes])
    try:
        for node, count in zip(nodes, seen):
            address = f"{node.get('NodeManagerAddress', '?')} (node {node['NodeID'][:8]})"
            if not os.path.isfile(os.path.join(probe, node["NodeID"])):
                raise utils.UserError(
                    f"DATA_PREFIX={data_prefix} is not shared storage: what node {address} writes there "
                    "never reaches this node; set DATA_PREFIX to a folder every node mounts (NFS, a shared disk)")
            if count < num_photos:
                raise utils.UserError(f"{photos_var}={photos_dir}: node {address} sees {count} of its files; put the "
                                      "photos on storage every node mounts (e.g. under DATA_PREFIX)")
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # preflight's flags, then train.py's
    args = parse_args(argv[:cut])
    train_flags = check_train_flags(argv[cut + 1:])
    if not args.class_name.strip():
        raise utils.UserError("CLASS_NAME is not set: set it to what your subject is (CLASS_NAME=dog, backpack, "
                              "person); it makes the class prompt 'photo of a <CLASS_NAME>'")
    photos = check_photos(args.photos_dir, args.photos_var)
    check_disk(args)
    ray = utils.init_ray()
    cpus, gpus = utils.cluster_resources()
    workers = check_workers(args, cpus, gpus)
    check_shared(args.data_prefix, args.photos_var, args.photos_dir, len(photos))
    print(f"preflight: {len(photos)} photos, {gpus} GPU(s) and {cpus:g} CPUs in the Ray cluster "
          f"({len(ray.nodes())} node(s)), {workers} worker(s)", file=sys.stderr)
    # the values of train.py's flags that the script's other steps follow (given there, they win)
    for name, value in (("MAX_TRAIN_STEPS", train_flags.max_train_steps), ("RESOLUTION", train_flags.resolution)):
        if value is not None:
            print(f"{name}={value}")
    print(f"NUM_WORKERS={workers}")
    return workers


if __name__ == "__main__":
    utils.run_main(main)

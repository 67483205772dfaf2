"""Before Step 1 of dreambooth_run.sh: everything that would fail hours later, checked in seconds.

    python preflight.py --photos_dir "$PHOTOS" --photos_var INSTANCE_DIR --class_name "$CLASS_NAME" \\
        --data_prefix "$DATA_PREFIX" --model_name "$ORIG_MODEL_NAME" --num_workers "$NUM_WORKERS" \\
        [--gpu_memory GIB] -- [train.py flags]

Checks the photos (present, readable), the class name, the Ray cluster's GPUs against the workers
asked for, that torch sees every GPU Ray counts (a driver too old for torch's CUDA build leaves it
none) and that the training fits in each card's free memory (memory.py's figures; the line names
the flags that make it fit), the free disk under DATA_PREFIX (base model + the checkpoints kept + the
tuned model), and on a cluster of several nodes that DATA_PREFIX and the photos are the same storage
on every node (a Ray task on each node writes there; the head reads it back). Each failure is one line naming the
variable to change. Prints the resolved worker count last, as `NUM_WORKERS=<n>`, after the values of
train.py's --max_train_steps and --resolution when given there (`MAX_TRAIN_STEPS=<n>`, `RESOLUTION=<n>`). The words after
`--` are the flags the script passes on to train.py (TRAIN_ARGS and its own after `--`): a flag
train.py does not know, or a value it refuses, stops the run here instead of at Step 4.
"""

import contextlib
import io
import os
import shutil
import sys
import tempfile
import uuid

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import storage
from dreambooth.cluster import raycluster
from dreambooth.cluster import torch_gpus
from dreambooth.config import flags
from dreambooth.families.shared import objectives
from dreambooth.generation import imagefiles
from dreambooth.generation import prompts
from dreambooth.models import known_models
from dreambooth.models import modelcache
from dreambooth.models import outputs
from dreambooth.planning import disk
from dreambooth.planning import memory
from dreambooth.planning import planning
from dreambooth.planning import resources

GB = 1e9
TINY_GB = 0.01  # the built-in tiny model, its checkpoint and its output
TRAINED_SHARE = 0.92  # UNet + text encoder of an SD checkpoint's weights (the VAE is frozen)


def parse_args(argv=None):
    parser = flags.make_parser(
        __doc__.splitlines()[0],
        ["photos_dir", "photos_var", "preflight_class_name", "data_prefix", "model_name", "model_path", "model_cache",
         "revision", "preflight_num_workers", "gpus_per_worker", "use_lora", "tiny", "arch", "gpu_memory",
         "tuned_model_dir", "preflight_stage"],
        helps={"arch": "The tiny model's family (dreambooth_run.sh --tiny --arch).", "model_name": "ORIG_MODEL_NAME.", "revision": "ORIG_MODEL_HASH.", "gpus_per_worker": "GPUS_PER_WORKER.",
               "use_lora": "LoRA: small checkpoints and output (also taken from the train.py flags after --).",
               "tiny": "The built-in tiny model (no GPU expected)."})
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


def check_family_flags(args, train_flags):
    """The train.py flags that only some families take, checked when the family is known before Step 1 (--tiny's
    --arch, a short name, a cached model): a flow-matching flag for an SD 1.x run stops here, not at Step 4."""
    family = planned_family(args)
    if args.tiny and family is None:
        raise errors.UserError(f"--arch {args.arch}: no tiny model of that family; choose from "
                               f"{', '.join(families.ARCHS)}")
    if family is None:  # (a hub name not fetched yet: Step 4 checks the flags on its files)
        return None
    objectives.check_flags(family, train_flags.snr_gamma, train_flags.precondition_outputs,
                           train_flags.weighting_scheme, train_flags.flow_shift)
    if not args.tiny:
        family.check_folder(cached_model(args))  # (None: a short name not fetched yet, read as its released folder)
    return family


def planned_family(args):
    """The Family of the run's base model when known before Step 1 (--tiny's --arch, a short name, a cached
    model), else None."""
    if args.tiny:
        return families.ARCHS.get(args.arch or families.DEFAULT.random.arch)
    if cached_model(args):
        return families.family_of(cached_model(args))
    known = known_models.known_model(args.model_name)
    return families.FAMILIES[known.family] if known else None


def note_replaced_model(args, family):
    """One line at Step 0 when TUNED_MODEL_DIR holds a model of another family or mode: Step 4 will replace it (it
    was said only there, after Steps 1-3), and SUBJECT keeps both."""
    output = outputs.read_output(args.tuned_model_dir) if args.tuned_model_dir else None
    identity = (output.record.identity or {}) if output else {}
    if not identity:
        return
    was = (identity.get("family"), "LoRA" if identity.get("use_lora") else "full fine-tune")
    now = (family.name if family else was[0], "LoRA" if args.use_lora else "full fine-tune")
    if was != now:
        changes = ", ".join(f"{a} -> {b}" for a, b in zip(was, now) if a != b)
        subject = os.path.basename(os.path.dirname(args.tuned_model_dir.rstrip("/")))  # (subjects/<SUBJECT>/model-tuned)
        suffix = now[0] if now[0] != was[0] else ("lora" if args.use_lora else "full")  # (what tells the two apart)
        print(f"note: {args.tuned_model_dir} holds this subject's {was[1]} of the {was[0]} family ({changes}): Step 4 "
              f"replaces it; to keep both, give this run its own SUBJECT (e.g. SUBJECT={subject}-{suffix})",
              file=sys.stderr)


def check_photos(folder, variable, inspect=True):
    """The photos are there, each one opens and each caption beside one reads (a corrupt one, or a caption in
    another encoding, is named; not with inspect False: only listed); a bucket's, in this node's copy."""
    if storage.is_remote(folder):
        try:
            folder = storage.cached(folder)
        except errors.UserError as err:
            raise errors.UserError(f"{variable}={folder}: {err}; put 4-6 photos of your subject there") from None
    if not os.path.isdir(folder):
        raise errors.UserError(f"{variable}={folder}: no such folder; put 4-6 photos of your subject there")
    if not any(imagefiles.is_image(name) for name in os.listdir(folder)):  # (said once, naming the folder once)
        raise errors.UserError(f"{variable}={folder}: holds no images ({', '.join(files.IMAGE_EXTENSIONS)}); put 4-6 "
                               "photos of your subject there")
    try:
        photos = imagefiles.list_images(folder, f"{variable}", also_expected=".txt")  # (captions: train.py's)
        if inspect:
            with tempfile.TemporaryDirectory() as scratch:
                imagefiles.inspect_images(photos, 0, scratch)
            prompts.read_captions(photos, "", ".txt")  # (a caption another editor saved: named now, not at Step 4)
    except errors.UserError as err:
        raise errors.UserError(f"{variable}={folder}: {err}") from None
    if len(photos) < 3:
        print(f"warning: {variable}={folder} has {len(photos)} photo(s); DreamBooth wants 4-6 (3 at the least)",
              file=sys.stderr)
    return photos


def disk_needed_gb(args, limit=1):
    """(GB needed under DATA_PREFIX, what for): the base model unless cached, one checkpoint
    (fp32 weights + AdamW's two moments of what is trained), the tuned model."""
    if args.tiny:
        return TINY_GB, "the tiny model"
    folder = cached_model(args)
    if folder:  # its own weight files tell (the text encoder counted as trained: the larger case)
        download = 0.0
        per_checkpoint, tuned = (size / GB for size in disk.disk_bytes(folder, args.use_lora, True))
    else:
        known = known_models.known_model(args.model_name)
        download = known.weights_gb if known else 5.0
        lora = disk.LORA_BYTES / GB
        if args.use_lora:
            per_checkpoint, tuned = lora, lora
        elif known:
            per_checkpoint, tuned = known_full_gb(args, known)
        else:
            per_checkpoint, tuned = 3 * TRAINED_SHARE * download, download
    # Ray writes a checkpoint before it removes the oldest one kept; at the end the model is written
    # beside the checkpoints kept, which are removed after it (unless --keep_checkpoints)
    kept = limit * per_checkpoint + max(per_checkpoint, tuned)
    parts = (f"model {download:.1f} + {limit} checkpoint(s) kept of {per_checkpoint:.1f} + the next one or the "
             f"tuned model {max(per_checkpoint, tuned):.1f} GB")
    return download + kept, parts


def known_full_gb(args, known):
    """(a checkpoint's GB, the tuned model's GB) of a full fine-tune of a known model not fetched yet, from its
    parameter counts: 12 bytes of each trained parameter in a checkpoint (disk.TRAINED_BYTES); the tuned
    model is its download, the trained networks in fp32 (twice their bytes where the files are bf16/fp16)."""
    family, counts, _ = model_family(args)
    counts = counts or memory.RELEASED[family]
    trained = sum(counts[name] for name in disk.trained_networks(families.FAMILIES[family], counts, True))
    half_files = known.weights_gb * GB / sum(counts.values()) < 3  # (bytes per parameter: 4 fp32, 2 bf16)
    return disk.TRAINED_BYTES * trained / GB, known.weights_gb + (2 * trained / GB if half_files else 0)


def check_disk(args, limit=1):
    """Room under DATA_PREFIX; for a bucket's, in this node's copies of its files (storage.cache_home)."""
    folder, what = args.data_prefix, f"DATA_PREFIX={args.data_prefix}"
    if storage.is_remote(folder):
        folder = storage.cache_home()
        what = f"this node's copy of DATA_PREFIX's files, {folder},"
    os.makedirs(folder, exist_ok=True)
    needed, parts = disk_needed_gb(args, limit)
    free = shutil.disk_usage(folder).free / GB
    if free < needed:
        fix = "set XDG_CACHE_HOME to a larger disk" if storage.is_remote(args.data_prefix) else \
            "set DATA_PREFIX to a larger disk"
        raise errors.UserError(f"{what} has {free:.1f} GB free; this run needs about {needed:.1f} GB ({parts}): {fix}")


def check_workers(args, cpus, gpus):
    """The resolved worker count (train.py's rule, resources.worker_resources), or one line naming
    NUM_WORKERS / GPUS_PER_WORKER."""
    settings = resources.WorkerFlags(args.num_workers or None, args.gpus_per_worker)
    return resources.worker_resources(settings, cpus, gpus, spell=lambda name, value: f"{name.upper()}={value}",
                                     warn_no_gpu=not args.tiny)[1]


def cached_model(args):
    """The base model's folder when it is here before Step 1 (--model_path, or its pinned revision in
    the model cache: looked up once, then kept in args.model_path), else None."""
    if args.model_path is None and args.model_cache and not args.tiny:
        args.model_path = modelcache.cached_snapshot(modelcache.cache_on_node(args.model_cache),
                                                     *modelcache.pinned_revision(args.model_name, args.revision))
    folder = args.model_path
    return folder if folder and os.path.isfile(os.path.join(folder, "model_index.json")) else None


def model_family(args):
    """(family name, parameter counts or None, source) of the base model, before Step 1 fetched it: a cached
    folder's own counts (source: the folder), else a known name's family with the counts of its own size when
    the family builds one of that name (sd35-medium; source: that size), else the released counts (None);
    (None, None, None) if unknown. source: what memory.need counts a flow transformer's activations of."""
    folder = cached_model(args)
    if folder:
        return families.family_of(folder).name, files.safetensors_params(folder), folder
    known = known_models.known_model(args.model_name)
    if known is None:
        return None, None, None
    if known.short_name in families.FAMILIES[known.family].random.own_sizes:
        return known.family, memory.size_params(known.family, known.short_name), known.short_name
    return known.family, None, None


def memory_setup(train_flags, args, family):
    """memory.Setup of the train.py flags the run gets (the script's own and the user's)."""
    known, folder = known_models.known_model(args.model_name), cached_model(args)
    resolution = train_flags.resolution or (families.native_resolution(folder) if folder else
                                            known.resolution if known else memory.DEFAULT_RESOLUTION[family])
    return memory.Setup(
        lora=train_flags.use_lora or args.use_lora, rank=train_flags.lora_rank,
        train_text_encoder=train_flags.train_text_encoder, gradient_checkpointing=train_flags.gradient_checkpointing,
        use_8bit_adam=train_flags.use_8bit_adam, optimizer=train_flags.optimizer, use_ema=train_flags.use_ema, batch=train_flags.train_batch_size,
        prior_prediction=train_flags.prior_preservation == "prior_prediction",
        class_images=train_flags.prior_preservation != "prior_prediction", resolution=resolution,
        half=train_flags.mixed_precision != "no", gpus_per_worker=args.gpus_per_worker,
        base_precision=train_flags.base_precision, text_encoder_precision=train_flags.text_encoder_precision,
        # --fsdp: the denoiser split over the workers NUM_WORKERS (or --num_workers) names, else not counted
        shards=max(1, args.num_workers or train_flags.num_workers or 1) if train_flags.fsdp else 1,
        validation=bool(train_flags.validation_prompt))


def check_memory(args, train_flags, cards):
    """The run fits each card's free memory [(what, free GiB)]; else one line with its need and the
    flags that make it fit. Returns the need (memory.Need) or None when the model is not known yet."""
    family, params, source = model_family(args)
    if family is None:
        print(f"note: GPU memory not checked: {args.model_name} is not a known model name and not cached yet",
              file=sys.stderr)
        return None
    if family not in memory.RELEASED:
        print(f"note: GPU memory not checked: the memory table has no {families.FAMILIES[family].label} figures",
              file=sys.stderr)
        return None
    setup = memory_setup(train_flags, args, family)
    result = memory.need(family, setup, params, source)
    what, free = min(cards, key=lambda card: card[1])
    if memory.fits(result, free):
        return result
    mode = "LoRA" if setup.lora else "full fine-tune"
    drawn = families.FAMILIES[family].validation_networks if setup.validation else ()  # (--validation_prompt's own)
    drawn_too = "".join(f", its validation samples' {name.replace('_', ' ')} too" for name in drawn)
    line = (f"the {mode} of {families.FAMILIES[family].label} at {setup.resolution} px, {setup.batch} + "
            f"{setup.batch if setup.class_images else 0} images a step{drawn_too}, needs about {result.total:.1f} GiB "
            f"of GPU memory per worker ({result.static:.1f} weights and optimizer, {result.activations:.1f} "
            f"activations) and {memory.RESERVE_GIB:g} GiB more for CUDA, but {what} has {free:.1f} GiB free")
    fix = memory.fixes(family, setup, free, params, source)
    if fix:
        words, _, fixed = fix
        line += f": add {' '.join(words)} (about {fixed.total:.1f} GiB; README, Requirements)"
    else:
        line += ": use a larger card, --gpus_per_worker 2, or a lower --resolution (README, Requirements)"
    raise errors.UserError(line)


def check_gpus(args, train_flags, gpus):
    """Drivers, then memory: on the assumed card size (--gpu_memory), else each GPU torch reports."""
    if args.tiny:
        return  # (the tiny model fits any card)
    if args.gpu_memory is not None:
        check_memory(args, train_flags, [(f"a card of GPU_MEMORY={args.gpu_memory:g} GiB", args.gpu_memory)])
        return
    if not gpus:
        return
    reports = torch_gpus.probe()
    torch_gpus.check_drivers(reports)
    cards = [(f"{name} on {r['node']}", free) for r in reports for name, free, _ in r["cards"]]
    if cards:
        check_memory(args, train_flags, cards)


def check_shared(data_prefix, photos_var, photos_dir, num_photos):
    """On a cluster of several nodes: a Ray task on each node writes a file under data_prefix (an object,
    in a bucket) and counts the photos; the head must see every node's file, and every node the photos.
    One node: nothing to check."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    remote = storage.is_remote(data_prefix)
    probe = storage.join(data_prefix, f".preflight-{uuid.uuid4().hex[:8]}")

    @ray.remote(num_cpus=0)
    def visit(node_id):
        try:
            if remote:
                storage.write_bytes(storage.join(probe, node_id), node_id.encode())
            else:
                os.makedirs(probe, exist_ok=True)
                with open(os.path.join(probe, node_id), "w") as f:
                    f.write(node_id)
        except Exception as err:  # noqa: BLE001 - said as the one line below
            return errors.one_line(err), 0
        found = storage.listdir(photos_dir) if storage.is_remote(photos_dir) or os.path.isdir(photos_dir) else []
        return None, len(found)

    seen = ray.get([visit.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                    .remote(n["NodeID"]) for n in nodes])
    try:
        for node, (error, count) in zip(nodes, seen):
            address = f"{node.get('NodeManagerAddress', '?')} (node {node['NodeID'][:8]})"
            if remote and (error or not storage.isfile(storage.join(probe, node["NodeID"]))):
                raise errors.UserError(f"DATA_PREFIX={data_prefix} cannot be written from node {address}: "
                                       f"{error or 'its object never appeared'} (give every node the bucket's "
                                       "credentials and endpoint: AWS_* variables, docs/CLUSTER.md, Object storage)")
            if not remote and (error or not os.path.isfile(os.path.join(probe, node["NodeID"]))):
                raise errors.UserError(
                    f"DATA_PREFIX={data_prefix} is not shared storage: what node {address} writes there "
                    "never reaches this node; set DATA_PREFIX to a folder every node mounts (NFS, a shared disk) "
                    "or a bucket (s3://…)")
            if count < num_photos:
                raise errors.UserError(f"{photos_var}={photos_dir}: node {address} sees {count} of its files; put the "
                                       "photos on storage every node reaches (e.g. under DATA_PREFIX)")
    finally:
        if remote:
            with contextlib.suppress(Exception):
                storage.remove_tree(probe)
        else:
            shutil.rmtree(probe, ignore_errors=True)


def check_files(args, family, train_flags):
    """What needs no Ray, said before the script starts its cluster: CLASS_NAME, the photos and their captions, the
    subject's model of another family, the model's name and access, an assumed card, the disk. The photos."""
    if not (args.class_name or "").strip():
        raise errors.UserError("CLASS_NAME is not set: set it to what your subject is (CLASS_NAME=dog, backpack, "
                               "person); it makes the class prompt 'photo of a <CLASS_NAME>'")
    photos = check_photos(args.photos_dir, args.photos_var)
    note_replaced_model(args, family)
    if not args.tiny and cached_model(args) is None:  # (Step 1 will fetch it: a gated one needs a token)
        known_models.check_name(args.model_name)
        known_models.check_access(args.model_name)
    if args.gpu_memory is not None:  # an assumed card: known before Ray starts
        check_gpus(args, train_flags, 0)
    check_disk(args, train_flags.checkpoints_total_limit)
    return photos


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # preflight's flags, then train.py's
    args = parse_args(argv[:cut])
    train_flags = check_train_flags(argv[cut + 1:])
    args.use_lora = args.use_lora or train_flags.use_lora
    family = check_family_flags(args, train_flags)
    if args.stage == "cluster":  # (the files were checked, and said, before the cluster started: counted only)
        with contextlib.redirect_stderr(io.StringIO()):
            photos = check_photos(args.photos_dir, args.photos_var, inspect=False)
    else:
        photos = check_files(args, family, train_flags)
        if args.stage == "files":
            return None
    ray = raycluster.init_ray()
    cpus, gpus = raycluster.cluster_resources()
    workers = check_workers(args, cpus, gpus)
    if args.gpu_memory is None:
        check_gpus(args, train_flags, gpus)
    check_shared(args.data_prefix, args.photos_var, args.photos_dir, len(photos))
    print(f"preflight: {len(photos)} photos, {gpus} GPU(s) and {cpus:g} CPUs in the Ray cluster "
          f"({len(ray.nodes())} node(s)), {workers} worker(s)", file=sys.stderr)
    # the values of train.py's flags that the script's other steps follow (given there, they win)
    for name, value in (("MAX_TRAIN_STEPS", train_flags.max_train_steps), ("RESOLUTION", train_flags.resolution)):
        if value is not None:
            print(f"{name}={value}")
    print(f"NUM_WORKERS={workers}")
    return workers

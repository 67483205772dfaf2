"""The Ray Train workers of a run: how many (one per GPU unless --num_workers says), and the CPUs
and GPUs each reserves, checked against the cluster's, with one CPU always left to Ray Data (with
every CPU held by train workers the streaming dataset never starts and fit() waits forever); how
the rows of an epoch split over them into optimizer steps.
"""

import dataclasses
import math
import sys

from dreambooth import errors
from dreambooth.models import modelcache

DEFAULT_MAX_TRAIN_STEPS = 800


@dataclasses.dataclass(frozen=True)
class WorkerFlags:
    """The flags that decide the workers (train.py's; the preflight's NUM_WORKERS and GPUS_PER_WORKER)."""

    num_workers: int | None
    gpus_per_worker: int
    use_gpu: bool | None = None
    model_dir: str | None = None  # (a model with random weights is for CPUs: no warning without a GPU)
    min_workers: int | None = None  # train.py's --min_workers: elastic (the cluster must hold these at the start)


@dataclasses.dataclass(frozen=True)
class StepFlags:
    """The flags that decide a run's steps."""

    num_workers: int
    train_batch_size: int
    gradient_accumulation_steps: int
    max_train_steps: int | None = None
    num_train_epochs: int | None = None

def default_num_workers(gpus, gpus_per_worker):
    """Workers when --num_workers is not given: one per GPU of the cluster (per two with
    --gpus_per_worker 2), or one without GPUs."""
    return max(1, gpus // gpus_per_worker) if gpus else 1


NO_GPU_WARNING = ("warning: the Ray cluster has no GPU, so this fine-tune runs on CPUs: hours per 100 steps. "
                  "If this machine has one (nvidia-smi lists it), Ray did not see it: check torch.cuda.is_available() "
                  "in this Python; a cluster you started yourself needs `ray start --head --num-gpus=N` (stop only "
                  "that one: `ray stop` stops every Ray cluster of this machine)")


def flag_spelling(name, value):
    """How train.py's messages name a setting: '--num_workers 2'."""
    return f"--{name} {value}"


def worker_resources(flags, cpus, gpus, node_cpus=(), spell=flag_spelling, warn_no_gpu=None):
    """(use_gpu, num_workers, CPUs per worker) of WorkerFlags, or UserError if the cluster cannot hold the workers.

    At least one CPU stays free for Ray Data: with every CPU held by train workers the streaming dataset never starts
    (or, once a node is lost, stops) and the run waits. node_cpus, the CPUs of each node: the workers together hold
    at most the smallest node's CPUs less one (of the nodes with two or more), so whichever node Ray packs them on,
    first or after a lost node, keeps a CPU for the data stream. spell(name, value) names a setting
    in the messages (dreambooth_run.sh's preflight names its variables); warn_no_gpu: print
    NO_GPU_WARNING on a cluster without GPUs (default: unless the model has random weights).
    """
    use_gpu = gpus > 0 if flags.use_gpu is None else flags.use_gpu
    num_workers = flags.num_workers or default_num_workers(gpus if use_gpu else 0, flags.gpus_per_worker)
    least, name = (flags.min_workers, "min_workers") if flags.min_workers else (num_workers, "num_workers")
    if least > num_workers:
        raise errors.UserError(f"{spell('min_workers', least)}: more than {spell('num_workers', num_workers)}")
    needed = least * flags.gpus_per_worker
    if use_gpu and needed > gpus:
        fits = f": set {spell(name, max(1, gpus // flags.gpus_per_worker))} (or leave it unset: one " \
               "worker per GPU)" if gpus and name == "num_workers" else ""
        raise errors.UserError(f"{spell(name, least)} x {spell('gpus_per_worker', flags.gpus_per_worker)}"
                               f" needs {needed} GPUs; the Ray cluster has {gpus}{fits}")
    if not use_gpu and least > cpus:
        raise errors.UserError(f"{spell(name, least)}: more than the Ray cluster's {cpus:g} CPUs")
    held = gpus // flags.gpus_per_worker if use_gpu else int(cpus)  # (CPU workers share the CPUs)
    if flags.min_workers and held < num_workers:
        print(f"note: the Ray cluster holds {held} of the {num_workers} workers now: the run starts on those (at "
              f"least {least}) and grows to {num_workers} as nodes join", file=sys.stderr)
    spare = cpus - 1
    if spare <= 0:
        raise errors.UserError(f"the Ray cluster has {cpus:g} CPU(s): training needs one for its workers "
                               "and one for the data pipeline")
    if warn_no_gpu is None:
        warn_no_gpu = not modelcache.has_random_weights(flags.model_dir)  # random models are for CPUs
    if not use_gpu and warn_no_gpu:
        print(NO_GPU_WARNING, file=sys.stderr)
    share = min(1.0, spare / num_workers)
    nodes = [count for count in node_cpus if count >= 2]
    return use_gpu, num_workers, min(share, (min(nodes) - 1) / num_workers) if nodes else share


def plan_steps(num_rows, flags):
    """(steps_per_epoch, total_steps) of StepFlags: rows split evenly over workers, into batches, into
    optimizer steps of gradient_accumulation_steps batches.

    An explicit --max_train_steps wins (diffusers' rule: the epochs follow from the steps), and a
    line says so when --num_train_epochs was given too; --num_train_epochs alone sets the steps.
    """
    rows_per_worker = num_rows // flags.num_workers
    if rows_per_worker == 0:
        raise errors.UserError(f"{num_rows} training rows cannot feed {flags.num_workers} workers; "
                               "add images or lower --num_workers")
    per_epoch = math.ceil(rows_per_worker / flags.train_batch_size) // flags.gradient_accumulation_steps
    if per_epoch == 0:
        raise errors.UserError(f"an epoch has fewer batches per worker than --gradient_accumulation_steps "
                               f"{flags.gradient_accumulation_steps}; lower it or --train_batch_size")
    if flags.num_train_epochs is None:
        return per_epoch, flags.max_train_steps or DEFAULT_MAX_TRAIN_STEPS
    by_epochs = per_epoch * flags.num_train_epochs
    if flags.max_train_steps is None:
        return per_epoch, by_epochs
    if by_epochs != flags.max_train_steps:
        print(f"note: --max_train_steps {flags.max_train_steps} wins over --num_train_epochs {flags.num_train_epochs} "
              f"({by_epochs} steps): {math.ceil(flags.max_train_steps / per_epoch)} epoch(s) of {per_epoch} steps",
              file=sys.stderr)
    return per_epoch, flags.max_train_steps


def stream_epochs(num_rows, total_steps, flags):
    """Epochs of rows the training stream must hold for every worker to take total_steps
    (two spare: the split rebalances the stream's last blocks between workers)."""
    rows_per_worker = num_rows // flags.num_workers
    rows_needed = total_steps * flags.train_batch_size * flags.gradient_accumulation_steps
    return math.ceil(rows_needed / rows_per_worker) + 2

"""What a training run does when a worker fails.

A worker that dies (a lost node, a killed process, a flaky collective) is restarted from the
newest checkpoint, up to --max_failures times: that is what Ray Train's retries are for. An
error that a restart would meet again (a model whose weights do not fit its config, a checkpoint
that does not load, a first step that does not fit in memory) is raised in the worker as a
errors.UserError and stops the run at once. Either way the terminal gets one line per failure;
the worker's traceback goes to the run folder's errors.log.
"""

import contextlib
import errno
import os
import shutil

import ray.train

from dreambooth import errors
from dreambooth import files
from dreambooth.storage import runfiles

# Ray Train's own console logging (worker-group start, each failure's traceback twice, its retry
# decision): what matters reaches the terminal through FailureWatch and train.py instead.
RAY_TRAIN_LOG_LEVEL = "CRITICAL"


class RunStopped(Exception):
    """Raised in Ray Train's controller to end a run that a restart cannot fix; its message is the cause."""


@contextlib.contextmanager
def cannot_be_retried(what, remedy):
    """Errors raised inside come from the files being read (what names them), so a restart meets
    them again: they become a errors.UserError saying what to do (remedy), which stops the run. An
    OSError (a file system that hiccuped) or one of Ray's errors stays as it is and is retried."""
    try:
        yield
    except (OSError, ray.exceptions.RayError, errors.UserError):
        raise
    except Exception as err:
        raise errors.load_failure(what, err, remedy) from err


def disk_full(err):
    """True for a write that found no space (or no quota) left, however a library wrapped it: an
    OSError ENOSPC/EDQUOT, safetensors' "No space left on device (os error 28)", pyarrow's IOError."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(err) for text in ("No space left on device", "Disk quota exceeded")):
            return True
        err = err.__cause__ or err.__context__
    return False


def free_bytes(folder):
    """Free bytes on the file system that holds folder (or would, once made)."""
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free


@contextlib.contextmanager
def stops_when_disk_full(what, folder, needed_bytes, cleanup=None):
    """A full disk inside becomes a errors.UserError (a restart meets the same full disk: it stops the
    run at once) naming the folder, its free space and about what was to be written there; cleanup()
    first removes what the failed write left (the space it holds is the user's)."""
    try:
        yield
    except Exception as err:
        if not disk_full(err):
            raise
        if cleanup is not None:
            cleanup()
        raise errors.UserError(
            f"no space left on the device of {folder} while writing {what}: {files.size_text(free_bytes(folder))} "
            f"free there, about {files.size_text(needed_bytes)} needed; make room there (or choose another folder) "
            f"and rerun with --resume_from_checkpoint auto: the run continues from its newest complete "
            f"checkpoint") from err


def out_of_memory(err, step, first_step):
    """A errors.UserError for a torch.OutOfMemoryError at this attempt's first step (later ones may
    be fragmentation, which a restart can cure: those are retried), else None."""
    import torch

    if not isinstance(err, torch.OutOfMemoryError) or step != first_step:
        return None
    return errors.UserError(f"out of GPU memory at step {step + 1} ({errors.one_line(err)[:200]}); lower --train_batch_size "
                            f"or --resolution, or add --gradient_checkpointing, --use_8bit_adam, --use_lora or "
                            f"--gpus_per_worker 2 (docs/MEMORY.md: which card fits which mode)")


def preempted(err):
    """Whether a worker's error is its death in a node's preemption (Ray's RayActorError.preempted, inside the health
    check's error where that is what saw it), which Ray Train counts against max_preemption_failures."""
    err = getattr(err, "health_check_failure", err)
    return bool(getattr(err, "preempted", False))


class FailureWatch(ray.train.UserCallback):
    """Runs in Ray Train's controller. After a worker failure: a UserError from any worker stops
    the run (RunStopped, which Ray Train does not retry); anything else is announced in one line
    and left to Ray Train's restarts."""

    def __init__(self, run_dir, max_failures, storage_path=None, run_name=None, resumed=False,
                 max_preemption_failures=-1, min_workers=None):
        self.run_dir, self.resumed, self.min_workers = run_dir, resumed, min_workers
        self.max_failures, self.max_preemption_failures = max_failures, max_preemption_failures
        self.failures = self.preemptions = 0
        self.registered = False  # (a checkpoint of this run that Ray Train registered: what a restart resumes from)
        self.storage_path, self.run_name = storage_path, run_name  # (a bucket's: errors.log copied there)

    def log_event(self, text):
        errors.log_error_event(self.run_dir, text)
        if self.storage_path:
            runfiles.sync_up(self.storage_path, self.run_name)

    def after_report(self, run_context, metrics, checkpoint):
        if checkpoint is not None:
            self.registered = True

    def restart_point(self):
        """Where the restarted workers begin: the newest checkpoint Ray Train registered in this run (a checkpoint
        folder written but not yet reported is not one), else the one the run resumed from, else step 0 (and, for an
        elastic run, on how many)."""
        on = f" on the workers the cluster holds now (at least --min_workers {self.min_workers})" \
            if self.min_workers else ""
        if self.registered:
            return "the newest checkpoint" + on
        begin = "the checkpoint this run resumed from" if self.resumed else "step 0 (no checkpoint registered yet)"
        return begin + on

    def after_exception(self, run_context, worker_exceptions):
        rank, err = min(worker_exceptions.items(), key=lambda item: item[0])
        fatal = [(r, e) for r, e in sorted(worker_exceptions.items()) if isinstance(e, errors.UserError)]
        if fatal:
            rank, err = fatal[0]
            self.log_event(f"worker {rank}: {err} -- a restart cannot fix this: stopping the run")
            raise RunStopped(f"worker {rank}: {err}")
        lost = sorted(r for r, e in worker_exceptions.items() if preempted(e))
        if lost:  # (Ray Train counts it against --max_preemption_failures, whatever else failed with it)
            self.preemptions += 1
            self.log_event(f"worker(s) {', '.join(map(str, lost))} lost to a node's preemption")
            budget = self.max_preemption_failures
            if budget < 0 or self.preemptions <= budget:
                limit = "every time" if budget < 0 else f"{self.preemptions} of --max_preemption_failures {budget}"
                print(f"a node was preempted (its worker(s) {', '.join(map(str, lost))} lost): restarting the workers "
                      f"from {self.restart_point()} ({limit}; preemptions do not count against --max_failures)",
                      flush=True)
            return
        self.failures += 1
        cause = errors.one_line(err)
        self.log_event(f"worker {rank} failed ({len(worker_exceptions)} of the group): {cause}")
        if self.max_failures < 0 or self.failures <= self.max_failures:
            limit = "unlimited" if self.max_failures < 0 else f"{self.failures} of --max_failures {self.max_failures}"
            print(f"worker {rank} failed: {cause[:300]}; restarting the workers from {self.restart_point()} "
                  f"({limit}; details in {os.path.join(self.run_dir, errors.ERRORS_LOG)})", flush=True)

"""Finding a run's checkpoints: which folders are complete (every file at the size recorded when it was
saved), the newest of a run and of its identity, the checkpoint --resume_from_checkpoint names, and
removing them. In a folder or a bucket; what a checkpoint holds is training's (checkpoint.py)."""

import os
import re
import sys

from dreambooth import errors
from dreambooth import files
from dreambooth import storage
from dreambooth.models import outputs
from dreambooth.planning import run_identity
from dreambooth.storage import runfiles

STATE_FILE = "train_state.json"


def is_complete(folder):
    """True when folder (a folder, or in a bucket) holds every checkpoint file at the size recorded when it
    was saved."""
    try:
        sizes = storage.read_json(storage.join(folder, STATE_FILE))["sizes"]
        return all(storage.size(storage.join(folder, name)) == size for name, size in sizes.items())
    except (OSError, ValueError, KeyError):
        return False


def incomplete_reason(folder):
    """Why folder (given as --resume_from_checkpoint) is not a complete checkpoint, in words that name the file (its
    state file's files.model_file_problem: another encoding, empty, not whole; for every file it lists, a broken link,
    a folder of its name, no permission, or another size than recorded), or None when it is one. A bucket's is only
    told complete or not."""
    if storage.is_remote(folder):
        return None if is_complete(folder) else "a file missing or cut short"
    if not os.path.isdir(folder):
        return files.unreadable(folder, None) if os.path.lexists(folder) else "no such folder"
    state = os.path.join(folder, STATE_FILE)
    if not os.path.lexists(state):
        return f"no {STATE_FILE} in it"
    problem = files.model_file_problem(state)
    if problem:
        return problem
    saved = files.read_json(state)
    sizes = saved.get("sizes") if isinstance(saved, dict) else None
    if not isinstance(sizes, dict):
        return f"{state} lists no files (not a checkpoint of train.py)"
    for name, size in sizes.items():
        path = os.path.join(folder, name)
        problem = files.file_problem(path) if os.path.lexists(path) else f"{path}: no such file"
        if problem:
            return problem
        if os.path.getsize(path) != size:
            return f"{path} is {os.path.getsize(path)} bytes where the checkpoint recorded {size} (cut short?)"
    return None


def remove_incomplete(run_dir):
    """Delete the checkpoint folders of run_dir that a failed write left incomplete (never resumed
    from, they only hold space): call only while no checkpoint of the run is being written."""
    import shutil

    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else ():
        folder = os.path.join(run_dir, name)
        if name.startswith("checkpoint_") and os.path.isdir(folder) and not is_complete(folder):
            shutil.rmtree(folder, ignore_errors=True)


def remove_all(run_dir):
    """Delete every checkpoint folder of run_dir (a folder, or in a bucket; its model is saved; the rest of
    the run folder, metrics and samples, stays): (folders removed, bytes freed)."""
    removed, freed = 0, 0
    for name in storage.listdir(run_dir):
        folder = storage.join(run_dir, name)
        if name.startswith("checkpoint_") and storage.isdir(folder):
            freed += sum(storage.size(storage.join(folder, f)) for f in storage.listdir(folder))
            storage.remove_tree(folder)
            removed += 1
    return removed, freed


def is_run_of(run, run_prefix):
    """True when run is the name of a run of run_prefix: '<run_prefix>-<YYYYMMDD-HHMMSS>' exactly (the
    runs of 'model-tuned' are not those of 'model-tuned-bella')."""
    return re.fullmatch(re.escape(run_prefix) + r"-\d{8}-\d{6}", run) is not None


def complete_checkpoints(storage_path, run_prefix):
    """The complete checkpoint folders of every run named '<run_prefix>-<time>' under storage_path,
    runs in name order (their names end in their start time); storage_path may be a bucket's."""
    for run in storage.listdir(storage_path):
        if not is_run_of(run, run_prefix):
            continue
        yield from run_checkpoints(storage.join(storage_path, run))


def run_checkpoints(run_dir):
    """The complete checkpoint folders of one run's folder (a folder, or in a bucket), in name order."""
    for name in storage.listdir(run_dir):
        folder = storage.join(run_dir, name)
        if name.startswith("checkpoint_") and is_complete(folder):
            yield folder


def registered_steps(run_dir):
    """The steps of the checkpoints Ray Train's controller has registered for a run (its checkpoint manager's
    snapshot; a folder's or a bucket's): a restart resumes from the newest of these, not from a folder still being
    written."""
    try:
        snapshot = storage.read_json(storage.join(run_dir, "checkpoint_manager_snapshot.json"))
    except (OSError, ValueError):  # (not written yet, or being written)
        return []
    return [r["metrics"].get("step") for r in snapshot.get("checkpoint_results", [])]


def runs_of_identity(storage_path, run_prefix, identity):
    """The run folders of run_prefix whose every complete checkpoint was written by a run of identity: the earlier
    attempts of one run stopped and resumed, perhaps more than once (none for an identity of None)."""
    same = {}
    for folder in complete_checkpoints(storage_path, run_prefix):
        run = runfiles.run_of_checkpoint(folder)
        same[run] = same.get(run, True) and identity is not None and saved_identity(folder) == identity
    return [run for run, all_same in same.items() if all_same]


def newest_first(storage_path, run_prefix):
    """The complete checkpoint folders of the runs of run_prefix, the newest (last saved) first."""
    return sorted(complete_checkpoints(storage_path, run_prefix),
                  key=lambda f: storage.mtime(storage.join(f, STATE_FILE)), reverse=True)


def find_latest(storage_path, run_prefix):
    """Newest complete checkpoint folder of any run named '<run_prefix>-<time>' under storage_path, or None."""
    return next(iter(newest_first(storage_path, run_prefix)), None)


def by_step(storage_path, run_prefix):
    """{step: folder} of the complete checkpoints of runs named '<run_prefix>-*' (the newest run's, for a step in several)."""
    return {saved_step(folder): folder for folder in complete_checkpoints(storage_path, run_prefix)}


def saved_step(folder):
    return storage.read_json(storage.join(folder, STATE_FILE))["step"]


def saved_identity(folder):
    """The identity of the run that wrote the checkpoint in folder (None: written before runs recorded it)."""
    return storage.read_json(storage.join(folder, STATE_FILE)).get("identity")


def newest_of_identity(storage_path, run_prefix, identity):
    """(folder, continued): the newest complete checkpoint of the runs of run_prefix whose identity is
    identity (None: any), or that this run continues (run_identity.continuation: only its step count
    raised); (None, False) when none is. When a newer checkpoint is of another run, a line says what differs."""
    if identity is None:
        return find_latest(storage_path, run_prefix), False
    for rank, folder in enumerate(newest_first(storage_path, run_prefix)):
        saved = saved_identity(folder)
        differs = run_identity.differences(saved, identity)
        if not differs:
            return folder, False
        longer = run_identity.continuation(saved, identity)
        if longer:
            print(longer, file=sys.stderr)
            return folder, True
        if rank == 0:
            print(f"not resuming {folder}: it is of another run ({'; '.join(differs)})", file=sys.stderr)
    return None, False


def resolve_resume(resume_flag, storage_path, run_prefix, output_dir=None, identity=None):
    """--resume_from_checkpoint latest|auto|PATH -> a checkpoint folder, or None to start fresh.

    latest|auto: the newest checkpoint of a run of the same identity (run_identity.py; None: any);
    auto: only if its run did not finish, i.e. it is not the run whose model output_dir holds
    (train.py's record names the run that wrote it). PATH of another identity: a UserError naming
    what differs."""
    if resume_flag in ("latest", "auto"):
        path, continued = newest_of_identity(storage_path, run_prefix, identity)
        if path is not None and resume_flag == "auto" and not continued:
            output = outputs.read_output(output_dir) if output_dir else None
            run = os.path.basename(os.path.dirname(path))
            if output is not None and output.record.run_name == run:
                print(f"the newest run ({run}) finished: starting afresh", file=sys.stderr)
                return None
        if path is None:
            print(f"no checkpoint of this run ('{run_prefix}', these settings and files) in {storage_path}: "
                  f"starting fresh", file=sys.stderr)
        else:
            print(f"resuming from {path} (step {saved_step(path)})", file=sys.stderr)
        return path
    reason = incomplete_reason(resume_flag) if resume_flag else None
    if reason:
        raise errors.UserError(f"--resume_from_checkpoint {resume_flag} is not a complete checkpoint of train.py: {reason}")
    if resume_flag and identity is not None:
        saved = saved_identity(resume_flag)
        longer = run_identity.continuation(saved, identity)
        if longer:
            print(longer, file=sys.stderr)
        else:
            run_identity.check_same(f"checkpoint {resume_flag}", saved, identity,
                                    "resume it with the flags and files it was trained with, or start afresh "
                                    "(leave out --resume_from_checkpoint)")
    return resume_flag

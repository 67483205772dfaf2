"""The sweep's working folder (--sweep_dir) and its outputs, on a disk or in a bucket (s3://…, gs://…).

In a bucket every node reads and writes the same folder without a shared disk: the trials' checkpoints
and models (train.py writes them there itself), their images and scores (each filled through the trial
node's copy and copied up), Tune's state (its storage_filesystem), the class images, the base model's
scores and the reports. Nothing of a trial stays only on the node that ran it."""

import contextlib
import datetime
import os
import shutil
import sys
import tempfile

import tomllib

from dreambooth import files
from dreambooth import storage
from dreambooth.sweep import sweep_report

CONFIG_FILE = "sweep_config.toml"


def write_text(folder, name, text):
    """folder/name (a bucket's too) holding text, written whole; its path."""
    from dreambooth.config import flags

    path = storage.join(folder, name)
    if storage.is_remote(folder):
        storage.write_bytes(path, text.encode())
        return path
    return flags.write_config(path, text)


def tune_storage(sweep_dir):
    """(the path of Tune's state 'tune' as Tune's storage takes it, storage_path, storage_filesystem): a
    bucket's through its pyarrow filesystem (which carries AWS_ENDPOINT_URL), a disk's as it is."""
    storage_path, fs = storage.ray_storage(sweep_dir)
    return (storage_path.rstrip("/") + "/tune" if fs else os.path.join(storage_path, "tune")), storage_path, fs


def unfinished_trials(sweep_dir, expected):
    """How many of the sweep's expected trials Tune's saved state has not ended (neither terminated nor errored, or
    not started): after a Ctrl-C, Tune saves the trials it stopped as pending, to run again on a restore."""
    from ray.tune import ExperimentAnalysis

    path, _, fs = tune_storage(sweep_dir)
    trials = ExperimentAnalysis(path, storage_filesystem=fs).trials
    ended = sum(trial.status in ("TERMINATED", "ERROR") for trial in trials)
    return expected - ended


def set_aside_another_sweep(sweep_dir, settings_toml):
    """Tune restores a sweep with the search space it stored: a rerun whose settings (search space, steps,
    subjects, train.py's flags) differ from the stored sweep's starts afresh instead, saying what changed;
    the earlier sweep's Tune state is kept beside it (tune-before-<time>). Trials of the same settings
    still find their own checkpoints (train.py resumes only a run of the same identity)."""
    stored, state = storage.join(sweep_dir, CONFIG_FILE), storage.join(sweep_dir, "tune")
    if not (storage.isfile(stored) and storage.isdir(state)):
        return
    before = tomllib.loads(storage.read_bytes(stored).decode())
    now = tomllib.loads(settings_toml)
    changed = [f"{k} {before.get(k)} -> {now.get(k)}" for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    if not changed:
        return
    aside = f"{state}-before-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    move_folder(state, aside)
    print(f"the sweep in {sweep_dir} had other settings ({'; '.join(changed)}): starting it afresh (its Tune state "
          f"kept in {aside})", file=sys.stderr)


def move_folder(source, target):
    """Rename a folder; in a bucket (which has no renames), copy it whole, then delete the source."""
    if not storage.is_remote(source):
        os.rename(source, target)
        return
    import pyarrow.fs as pafs

    fs, key = storage.filesystem(source)
    pafs.copy_files(key, storage.filesystem(target)[1], source_filesystem=fs, destination_filesystem=fs)
    storage.remove_tree(source)


def trial_storage_paths(sweep_dir):
    """The storage_path (ray_results) of every trial of the sweep (in a bucket too)."""
    trials = storage.join(sweep_dir, "trials")
    found = (storage.join(trials, name, "ray_results") for name in storage.listdir(trials))
    return [path for path in found if storage.isdir(path)]


def copy_model(source, target):
    """The model folder source (a trial's; a disk's or a bucket's) copied to target (likewise), replacing
    what was there whole: on a disk through a hidden folder renamed at the end, in a bucket with train.py's
    record written last (a half-copied model is never taken for a whole one)."""
    if storage.is_remote(target):
        with storage.local_copy(source) as folder:  # (a bucket's source: copied here first)
            storage.replace_folder(folder, target, last=files.OUTPUT_MARKER)
        return
    if storage.is_remote(source):
        files.atomic_write_dir(target, lambda tmp: storage.download(source, tmp))
    else:
        files.atomic_write_dir(target, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True))


def write_reports(sweep_dir, rows, base, best, margin):
    """sweep_report.write_all into sweep_dir: a bucket's written here first, then each file copied there.
    {"table", "plot", "report": their paths}."""
    if not storage.is_remote(sweep_dir):
        return sweep_report.write_all(sweep_dir, rows, base, best, margin)
    with tempfile.TemporaryDirectory(prefix="dreambooth-sweep-") as tmp:
        written = sweep_report.write_all(tmp, rows, base, best, margin)
        for name in sorted(os.listdir(tmp)):
            storage.upload_file(os.path.join(tmp, name), storage.join(sweep_dir, name))
    return {what: storage.join(sweep_dir, os.path.basename(path)) for what, path in written.items()}


@contextlib.contextmanager
def scratch(sweep_dir, name):
    """A local folder for the sweep's own scratch files: sweep_dir/name on a disk, a temporary one for a
    bucket's sweep (removed at the end)."""
    if not storage.is_remote(sweep_dir):
        yield os.path.join(sweep_dir, name)
        return
    with tempfile.TemporaryDirectory(prefix=f"dreambooth-{name}-") as tmp:
        yield tmp

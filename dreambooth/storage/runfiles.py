"""A run's own files (metrics.jsonl, trackers, validation images, errors.log, settings) when its storage is a
bucket: written to a local folder of the node that writes them (run_folder) and copied to the run's folder in
the bucket (sync_up). On a disk they are written in the run folder itself."""

import os
import posixpath

from dreambooth import errors
from dreambooth import storage


def run_folder(storage_path, run_name):
    """The local folder of a run's own files: the run folder itself on a disk; for a bucket, a folder in this
    node's cache, copied to the bucket by sync_up."""
    if not storage.is_remote(storage_path):
        return os.path.join(storage_path, run_name)
    scheme, _, path = storage_path.partition("://")
    return os.path.join(storage.cache_home(), "runs", scheme, *path.strip("/").split("/"), run_name)


def run_of_checkpoint(checkpoint_path):
    """The run folder a checkpoint is in (a bucket's too); None for no checkpoint."""
    return posixpath.dirname(checkpoint_path.rstrip("/")) if checkpoint_path else None


_uploaded = {}  # local file -> (size, mtime) as last copied


def node_file_name(name):
    """The name a run's file that every node writes (errors.log) has in a bucket: one per node
    (errors-<host>.log), so that nodes do not replace each other's."""
    import socket

    stem, dot, suffix = name.rpartition(".")
    return f"{stem}-{socket.gethostname()}{dot}{suffix}"


PER_NODE_FILES = (errors.ERRORS_LOG,)


def sync_up(storage_path, run_name):
    """Copy the run's local files that changed since the last call to its folder in the bucket (nothing to do
    on a disk); a file every node writes (PER_NODE_FILES) goes under its node's name (node_file_name)."""
    if not storage.is_remote(storage_path):
        return
    import pyarrow.fs as pafs

    local = run_folder(storage_path, run_name)
    fs, key = storage.filesystem(storage.join(storage_path, run_name))
    for root, _, files in os.walk(local):
        for name in files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            if _uploaded.get(path) == (stat.st_size, stat.st_mtime):
                continue
            parts = os.path.relpath(path, local).split(os.sep)
            if parts[-1] in PER_NODE_FILES:
                parts[-1] = node_file_name(parts[-1])
            pafs.copy_files(path, posixpath.join(key, *parts), destination_filesystem=fs)
            _uploaded[path] = (stat.st_size, stat.st_mtime)


RECORD = "trackers.json"  # in the run folder


def read_record(folder):
    """The trackers.json of a run folder, on this node or in a bucket (a run resumed from a checkpoint
    there goes on in the same tracker runs), or {}."""
    path = storage.join(folder, RECORD) if folder else None
    return storage.read_json(path) if path and storage.isfile(path) else {}

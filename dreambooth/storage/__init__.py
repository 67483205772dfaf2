"""Paths that may be object storage: `s3://bucket/key` (AWS, or MinIO/R2/Ceph through AWS_ENDPOINT_URL) and
`gs://bucket/key`, through pyarrow's filesystems, configured the way AWS tools are (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE, AWS_REGION; AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL, which pyarrow does not read itself), and Google's tools for gs:// (their default credentials,
GOOGLE_APPLICATION_CREDENTIALS; CLOUD_STORAGE_EMULATOR_ENDPOINT for an emulator). Anything else is a local path.

A run's own files go to a bucket through runfiles.py; Ray Train writes the checkpoints there itself."""

import contextlib
import datetime
import os
import posixpath
import tempfile

from dreambooth import errors
from dreambooth import files

SCHEMES = ("s3://", "gs://")
# The AWS settings a Ray worker needs to reach the bucket as the driver does (runtime_env).
AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION",
                 "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE",
                 "AWS_SHARED_CREDENTIALS_FILE", "GOOGLE_APPLICATION_CREDENTIALS", "CLOUD_STORAGE_EMULATOR_ENDPOINT",
                 "XDG_CACHE_HOME")  # (and where each node caches a bucket's files, when set)


def is_remote(path):
    return isinstance(path, str) and path.startswith(SCHEMES)


def endpoint():
    """The S3 endpoint AWS tools would use (None: AWS itself)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def filesystem(uri):
    """(pyarrow filesystem, its path 'bucket/key') of a remote URI."""
    import pyarrow.fs as pafs

    scheme, _, path = uri.partition("://")
    if scheme == "s3":
        url = endpoint()
        options = {}
        if url:
            options["endpoint_override"] = url
            if url.startswith("http://"):
                options["scheme"] = "http"
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            options["region"] = region
        return pafs.S3FileSystem(**options), path.rstrip("/")
    # (google-cloud-cpp, under pyarrow's GCS, reads CLOUD_STORAGE_EMULATOR_ENDPOINT itself; an emulator takes
    # no credentials. Retries stop after a minute: an unreachable bucket is an error, not a long wait.)
    anonymous = bool(os.environ.get("CLOUD_STORAGE_EMULATOR_ENDPOINT"))
    return pafs.GcsFileSystem(anonymous=anonymous, retry_time_limit=datetime.timedelta(seconds=60)), path.rstrip("/")


def join(base, *parts):
    return posixpath.join(base, *parts) if is_remote(base) else os.path.join(base, *parts)


def ray_storage(storage_path):
    """(storage_path, storage_filesystem) for Ray Train's RunConfig."""
    if not is_remote(storage_path):
        return storage_path, None
    fs, path = filesystem(storage_path)
    return path, fs


def _info(uri):
    fs, path = filesystem(uri)
    return fs, path, fs.get_file_info(path)


def exists(path):
    if not is_remote(path):
        return os.path.exists(path)
    import pyarrow.fs as pafs

    return _info(path)[2].type != pafs.FileType.NotFound


def isdir(path):
    if not is_remote(path):
        return os.path.isdir(path)
    import pyarrow.fs as pafs

    return _info(path)[2].type == pafs.FileType.Directory


def isfile(path):
    if not is_remote(path):
        return os.path.isfile(path)
    import pyarrow.fs as pafs

    return _info(path)[2].type == pafs.FileType.File


def listdir(path):
    """The names in a folder ([] when there is none)."""
    if not is_remote(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    import pyarrow.fs as pafs

    fs, key = filesystem(path)
    if path.startswith("gs://"):  # pyarrow's GCS lists a sub-folder only where an object marks it: list it all
        found = fs.get_file_info(pafs.FileSelector(key, recursive=True, allow_not_found=True))
        return sorted({posixpath.relpath(f.path, key).split("/")[0] for f in found})
    found = fs.get_file_info(pafs.FileSelector(key, allow_not_found=True))
    return sorted(posixpath.basename(f.path) for f in found)


def size(path):
    return _info(path)[2].size if is_remote(path) else os.path.getsize(path)


def mtime(path):
    return _info(path)[2].mtime.timestamp() if is_remote(path) else os.path.getmtime(path)


def read_bytes(path):
    if not is_remote(path):
        with open(path, "rb") as f:
            return f.read()
    fs, key = filesystem(path)
    with fs.open_input_stream(key) as f:
        return f.read()


def read_json(path):
    import json

    return json.loads(read_bytes(path)) if is_remote(path) else files.read_json(path)


def write_bytes(path, data):
    """path (a file, or a bucket's object) holding data; a file's folder is made if missing."""
    if not is_remote(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return
    fs, key = filesystem(path)
    with fs.open_output_stream(key) as f:
        f.write(data)


def upload_file(local, uri):
    """Copy the local file to the bucket's uri (streamed: a model's file need not fit in memory)."""
    import pyarrow.fs as pafs

    fs, key = filesystem(uri)
    pafs.copy_files(local, key, destination_filesystem=fs)


def remove_tree(path):
    """Delete a folder and everything in it."""
    if is_remote(path):
        fs, key = filesystem(path)
        import pyarrow.fs as pafs

        fs.delete_dir_contents(key, missing_dir_ok=True)
        if fs.get_file_info(key).type != pafs.FileType.NotFound:  # (GCS: a folder without a marker object is gone)
            fs.delete_dir(key)
    else:
        import shutil

        shutil.rmtree(path)


def remove(path):
    """Delete a file, or a folder and everything in it."""
    if isdir(path):
        remove_tree(path)
    elif is_remote(path):
        fs, key = filesystem(path)
        fs.delete_file(key)
    else:
        os.remove(path)


def download(uri, folder):
    """Copy the remote folder uri into the local folder (made if missing); returns folder."""
    import pyarrow.fs as pafs

    fs, key = filesystem(uri)
    os.makedirs(folder, exist_ok=True)
    for info in fs.get_file_info(pafs.FileSelector(key, recursive=True)):
        if info.type == pafs.FileType.File:
            local = os.path.join(folder, *posixpath.relpath(info.path, key).split("/"))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            pafs.copy_files(info.path, local, source_filesystem=fs)
    return folder


@contextlib.contextmanager
def local_copy(path):
    """path itself when local; a remote folder downloaded into a temporary folder, removed when the block ends (a
    checkpoint of a real model is gigabytes: one left behind on each resume fills a node's /tmp)."""
    if not is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="dreambooth-download-") as scratch:
        yield download(path, scratch)


def fetch(folder, name, local_dir):
    """The local path of folder's file name: folder's own on a disk; from a bucket, copied into local_dir
    first (a missing one: the path, where nothing is)."""
    if not is_remote(folder):
        return os.path.join(folder, name)
    local = os.path.join(local_dir, name)
    if isfile(join(folder, name)):
        os.makedirs(local_dir, exist_ok=True)
        with open(local, "wb") as f:
            f.write(read_bytes(join(folder, name)))
    return local


def check_reachable(uri, what):
    """For a bucket's uri: UserError in one line unless a small object can be written to and read back from
    it, then removed (a folder: nothing to check here)."""
    if not is_remote(uri):
        return
    probe = join(uri, f".dreambooth-probe-{os.getpid()}")
    try:
        write_bytes(probe, b"ok")
        assert read_bytes(probe) == b"ok"
        fs, key = filesystem(probe)
        fs.delete_file(key)
    except Exception as err:  # noqa: BLE001 - any failure is the one line
        where = f" (AWS_ENDPOINT_URL={endpoint()})" if uri.startswith("s3://") and endpoint() else ""
        raise errors.UserError(f"{what} {uri} cannot be written from this node{where}: {errors.one_line(err)}") from None


def replace_folder(local, uri, last):
    """Make the bucket folder uri hold local's files: the file named last (the folder's completeness marker;
    None: none) is removed first and written last, so a half-copied folder is never taken for a whole one; files of the
    folder's previous content that local lacks are removed."""
    import pyarrow.fs as pafs

    fs, key = filesystem(uri)
    marker = posixpath.join(key, last or "")
    if last and fs.get_file_info(marker).type != pafs.FileType.NotFound:
        fs.delete_file(marker)
    wanted = {}
    for root, _, names in os.walk(local, followlinks=True):
        for name in names:
            path = os.path.join(root, name)
            wanted[posixpath.join(key, *os.path.relpath(path, local).split(os.sep))] = path
    folders = {posixpath.dirname(target) for target in wanted}
    for info in fs.get_file_info(pafs.FileSelector(key, recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File and info.path not in wanted:
            with contextlib.suppress(OSError):  # (gone with its folder)
                fs.delete_file(info.path)
        elif info.type == pafs.FileType.Directory and not any(
                f == info.path or f.startswith(info.path + "/") for f in folders):
            with contextlib.suppress(OSError):
                fs.delete_dir(info.path)  # (a folder of the previous content: no empty marker left)
    for target, path in sorted(wanted.items(), key=lambda item: item[0] == marker):
        pafs.copy_files(path, target, destination_filesystem=fs)


CACHE_MANIFEST = ".listing.json"  # beside a cached folder (not in it: a folder of photos holds photos only)


def cache_home():
    """This node's cache of a bucket's files (XDG_CACHE_HOME, else ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "dreambooth")


def cache_root():
    """Where bucket folders are copied (cached)."""
    return os.path.join(cache_home(), "objects")


def cache_path(uri):
    """Where this node keeps its copy of the bucket folder uri."""
    scheme, _, path = uri.partition("://")
    return os.path.join(cache_root(), scheme, *path.strip("/").split("/"))


def _listing(uri):
    """{name relative to uri: [size, mtime]} of the files under the bucket folder uri."""
    import pyarrow.fs as pafs

    fs, key = filesystem(uri)
    return {posixpath.relpath(i.path, key): [i.size, i.mtime.timestamp()]
            for i in fs.get_file_info(pafs.FileSelector(key, recursive=True, allow_not_found=True))
            if i.type == pafs.FileType.File}


def _write_manifest(local, listing):
    import json

    with open(local + CACHE_MANIFEST, "w") as f:
        json.dump(listing, f)


def cached(uri, allow_empty=False):
    """A local copy of the bucket folder uri (a model, photos) in this node's cache, fetched once: files whose
    size or time in the bucket changed are fetched again, files gone from it removed. An empty (or missing)
    folder is a UserError unless allow_empty."""
    import pyarrow.fs as pafs

    local = cache_path(uri)
    fs, key = filesystem(uri)
    listing = _listing(uri)
    if not listing and not allow_empty:
        raise errors.UserError(f"{uri} holds no files (or cannot be listed from this node)")
    manifest_path = local + CACHE_MANIFEST
    held = files.read_json(manifest_path) if os.path.isfile(manifest_path) else {}
    if held == listing and os.path.isdir(local):
        return local
    os.makedirs(local, exist_ok=True)
    for name in set(held) - set(listing):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(local, *name.split("/")))
    for name, stat in listing.items():
        target = os.path.join(local, *name.split("/"))
        if held.get(name) != stat or not os.path.isfile(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            pafs.copy_files(posixpath.join(key, name), target, source_filesystem=fs)
    _write_manifest(local, listing)
    return local


def _local_files(local):
    """{name relative to local ('/'-separated): (size, mtime)} of the files under local."""
    found = {}
    for root, _, names in os.walk(local, followlinks=True):
        for name in names:
            stat = os.stat(os.path.join(root, name))
            found[posixpath.join(*os.path.relpath(os.path.join(root, name), local).split(os.sep))] = (
                stat.st_size, stat.st_mtime)
    return found


@contextlib.contextmanager
def output_folder(path):
    """The local folder a script fills for the output folder path: path itself on a disk. For a bucket's path,
    this node's copy of the bucket folder (what is there already: a rerun tops it up), whose changes go back
    to the bucket when the block ends, however it ends: files written or changed are copied up, files
    deleted are deleted there."""
    if not is_remote(path):
        yield path
        return
    local = cached(path, allow_empty=True)
    before = _local_files(local)
    try:
        yield local
    finally:
        push(local, path, before)


def push(local, uri, before):
    """Copy to the bucket folder uri what changed in local since before (_local_files) and what the bucket
    lacks (files of a copy whose script was killed before it could push them), delete there what was deleted
    here, then record the bucket's listing as this node's copy of it."""
    import pyarrow.fs as pafs

    fs, key = filesystem(uri)
    now, held = _local_files(local), _listing(uri)
    for name in (set(before) - set(now)) & set(held):
        with contextlib.suppress(OSError):
            fs.delete_file(posixpath.join(key, name))
    for name, stat in sorted(now.items()):
        if (before.get(name) != stat or name not in held) and files.TEMP_MARK not in name:  # (not one being written)
            pafs.copy_files(os.path.join(local, *name.split("/")), posixpath.join(key, name),
                            destination_filesystem=fs)
    _write_manifest(local, _listing(uri))


def mirror_up(local, uri, last):
    """The bucket folder uri made to hold the files of local (replace_folder, last written last) unless it holds
    them already (the same names and sizes: a model is uploaded once); local is then this node's copy of it
    (local must be cache_path(uri)). Returns whether it copied."""
    sizes = {name: stat[0] for name, stat in _local_files(local).items()}
    listing = _listing(uri)
    copy = {name: stat[0] for name, stat in listing.items()} != sizes
    if copy:
        replace_folder(local, uri, last)
        listing = _listing(uri)
    _write_manifest(local, listing)
    return copy


def ensure_local(*paths):
    """Each path that is the cached copy of a bucket folder brought up to date on this node (Ray workers on
    another node get the driver's cache path); None and other paths are left as they are."""
    root = cache_root()
    for path in paths:
        if path and path.startswith(root + os.sep):
            scheme, *parts = os.path.relpath(path, root).split(os.sep)
            cached(f"{scheme}://{'/'.join(parts)}")

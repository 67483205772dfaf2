"""Files every script writes and reads: the output names, atomic writes (a reader never sees half a
file), JSON, the safetensors checks, and where an output may go."""

import contextlib
import glob
import json
import os
import re
import shutil
import tempfile
import time

from dreambooth import errors
from dreambooth import filemodes

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # the package, with its assets/ (prompts, tiny tokenizer)
ASSETS_DIR = os.path.join(PACKAGE_DIR, "assets")
# The repository around the package: its scripts and data/ (a checkout). Where the package is installed
# (pip install .) instead, there is none: the data default is data/ in the current folder, and Ray ships the
# package alone to the workers.
REPO_DIR = os.path.dirname(PACKAGE_DIR)
IN_CHECKOUT = os.path.isfile(os.path.join(REPO_DIR, "dreambooth_run.sh"))


IMAGE_SUFFIX = ".png"  # what the suite writes


IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")  # what it reads


# Written into every model directory train.py produces, so a rerun can tell
# its own previous output from a folder the user cares about.
OUTPUT_MARKER = "dreambooth_training.json"


LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"  # train.py --use_lora's output, diffusers' name


def size_text(num_bytes):
    """12345678 -> '12.3 MB' (decimal units, as df -H and disk makers count)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(num_bytes) < 1000 or unit == "TB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.3g} {unit}"
        num_bytes /= 1000


def slugify(text, max_len=60):
    """'Photo of a dog!' -> 'photo-of-a-dog' (file-system safe, stable)."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:max_len].rstrip("-") or "prompt"


def atomic_write_dir(final_dir, write_fn):
    """Call write_fn(tmp_dir) then move tmp_dir to final_dir, replacing it whole, its modes as the
    umask says (filemodes.follow_umask).

    The destination either keeps its previous content or gets the complete new one:
    a crash or a failed write leaves only a hidden temporary folder behind.
    """
    parent = os.path.dirname(os.path.abspath(final_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(final_dir) + "-", dir=parent)
    try:
        write_fn(tmp_dir)
        filemodes.follow_umask(tmp_dir)
        if os.path.exists(final_dir):
            old = tmp_dir + ".old"
            os.rename(final_dir, old)
            os.rename(tmp_dir, final_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp_dir, final_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


TEMP_MARK = ".tmp-"


def save_image_atomic(image, path):
    """Save a PIL image so that `path` never holds a truncated file."""
    write_bytes_atomic(png_bytes(image), path)


def png_bytes(image):
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_bytes_atomic(data, path):
    """Write data so that `path` never holds a truncated file."""
    tmp = f"{path}{TEMP_MARK}{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def remove_temp_files(folder):
    """Delete what save_image_atomic left behind when its process was killed mid-write."""
    for name in os.listdir(folder):
        if TEMP_MARK in name:
            os.remove(os.path.join(folder, name))


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def unreadable(path, err):
    """The one line that says why a file a user gave (path) cannot be read (err: what opening or reading it raised, or
    None where a listing found it is no file)."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"{path} is a link to {os.readlink(path)}, which does not exist"
    if isinstance(err, IsADirectoryError) or (err is None and os.path.isdir(path)):
        return f"{path} is a folder, not a file"
    if isinstance(err, PermissionError):
        return f"cannot read {path}: permission denied (as user {os.getuid()})"
    if isinstance(err, FileNotFoundError):
        return f"{path}: no such file"
    if isinstance(err, UnicodeDecodeError):
        kind = "UTF-16 (a Windows editor's 'Unicode')" if err.object[:2] in (b"\xff\xfe", b"\xfe\xff") else \
            f"byte {err.object[err.start]:#04x} at position {err.start} is not UTF-8"
        return f"{path} is not UTF-8 text ({kind}): save it as UTF-8"
    if err is None:
        return f"{path} is not a file"
    return f"cannot read {path}: {getattr(err, 'strerror', None) or err}"


# Names of the files a model folder holds (configs, weights, tokenizer files): a folder of such a name is a mistake
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".txt", ".model", ".jinja")


def file_problem(path):
    """Why a file cannot be opened, in one line naming it (unreadable's), or None: a broken link (a hub cache whose
    blob was deleted), a folder of a file's name, no permission."""
    if (os.path.islink(path) and not os.path.exists(path)) or os.path.isdir(path):
        return unreadable(path, None)
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        return unreadable(path, err)
    return None


def model_file_problem(path):
    """Why a file of a model folder cannot be read, in one line naming it, or None: file_problem's, an empty file, a
    JSON file that is not UTF-8 or not whole, a safetensors file whose header does not parse or that is cut short
    (safetensors_problem)."""
    problem = file_problem(path)
    if problem:
        return problem
    if os.path.getsize(path) == 0:
        return f"{path} is empty (0 bytes)"
    if path.endswith(".json"):
        try:
            with open(path, "rb") as f:
                json.loads(f.read().decode("utf-8"))
        except UnicodeDecodeError as err:
            return unreadable(path, err).removesuffix(": save it as UTF-8")
        except ValueError:
            return f"{path} is not valid JSON (a cut-short copy?)"
    if path.endswith(".safetensors"):
        return safetensors_problem(path)
    return None


def check_model_files(folder, remedy):
    """errors.UserError (model_file_problem's line, then remedy) for the first file of folder, or of its sub-folders,
    that cannot be read; a folder whose name is a file's (MODEL_FILE_SUFFIXES) is one. (A folder that is not there has
    no file to check: the caller says what is missing.)"""
    for root, names, found in os.walk(folder):
        names.sort()
        for name in sorted(found) + [n for n in names if n.endswith(MODEL_FILE_SUFFIXES)]:
            problem = model_file_problem(os.path.join(root, name))
            if problem:
                raise errors.UserError(f"{problem}: {remedy}")


def stamps(paths):
    """((path, size, modification time in ns), ...) of files, to tell later whether one changed (changed_since)."""
    return tuple((path, found.st_size, found.st_mtime_ns) for path, found in ((p, os.stat(p)) for p in paths))


def changed_since(taken):
    """A UserError's line naming the first file of stamps taken that changed (or went) since, or None."""
    for path, size, mtime in taken:
        try:
            now = os.stat(path)
        except OSError as err:
            return f"{unreadable(path, err)} (it was there when the run began)"
        if (now.st_size, now.st_mtime_ns) != (size, mtime):
            return (f"{path} changed while the run read it (written at "
                    f"{time.strftime('%H:%M:%S', time.localtime(now.st_mtime))}): start the run again once it is saved")
    return None


def model_files(folder, suffixes=MODEL_FILE_SUFFIXES):
    """The files of a model folder (or a checkpoint's) and of its sub-folders that a load reads: those ending in one of
    suffixes (None: every file), sorted; [] for None or a folder that is not there."""
    found = []
    for root, names, files_here in os.walk(folder) if folder else ():
        names.sort()
        found += [os.path.join(root, name) for name in sorted(files_here) if suffixes is None or name.endswith(suffixes)]
    return found


@contextlib.contextmanager
def unchanged_while(*folders, what="loading the model", suffixes=MODEL_FILE_SUFFIXES):
    """Around the loading of model folders (or of a checkpoint: suffixes None), in the process that reads them: a
    UserError naming the first of their files that was rewritten or removed while it was read (a copy or a download
    into the folder going on beside the run), instead of weights of two versions. Stamps of this node's own files,
    taken here: nodes with copies of their own never compare one another's."""
    taken = stamps(path for folder in folders for path in model_files(folder, suffixes))
    yield
    changed = changed_since(taken)
    if changed:
        raise errors.UserError(f"{what}: {changed}")


def read_user_text(path, what):
    """The text of a file a user gave (what: the words that name it, e.g. 'the prompts file'), UTF-8 with or without
    the byte-order mark a Windows editor writes; a UserError of one line naming the file when it cannot be read as
    text (a broken link, a folder, no permission, another encoding)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise errors.UserError(f"{what}: {unreadable(path, err)}") from None


def safetensors_header(path):
    """(header length, header) of a safetensors file: {tensor name: {"dtype", "shape", "data_offsets"},
    "__metadata__": ...}, read without its weights. struct.error or ValueError when it does not parse."""
    import struct

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if 8 + length > os.path.getsize(path):
            raise ValueError(f"{path}: a header longer than the file")
        return length, json.loads(f.read(length))


def safetensors_problem(path):
    """Why path is not a whole safetensors file, in one line naming it, or None: its header parses and the file is
    as long as the header says (an interrupted download or copy is cut short). Reads the header only."""
    import struct

    size = os.path.getsize(path)
    what = f"{path} is not a whole safetensors file"
    try:
        length, header = safetensors_header(path)
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        return f"{what} (its header does not parse)"
    if size != 8 + length + end:
        return f"{what}: {size} bytes where its header says {8 + length + end} (an interrupted download or copy?)"
    return None


def check_safetensors(path):
    """errors.UserError naming path unless it is a whole safetensors file (safetensors_problem)."""
    problem = safetensors_problem(path)
    if problem:
        raise errors.UserError(f"{problem}: fetch or copy the model again (cache_model.py)")


def check_output_path(path, flag, inputs=(), is_file=False):
    """errors.UserError unless path can take a script's output: a folder output that is an existing file (or a
    file output that is a folder) is refused, and so is an output inside one of inputs [(flag, folder)]
    (the photos, the base model): writing there would mix the result into what the run reads."""
    if is_file and os.path.isdir(path):
        raise errors.UserError(f"{flag} {path} is a folder; name the file to write")
    if not is_file and os.path.exists(path) and not os.path.isdir(path):
        raise errors.UserError(f"{flag} {path} is a file, not a folder; pick a folder for the output")
    for input_flag, folder in inputs:
        if not folder:
            continue
        folder = os.path.abspath(folder)
        if os.path.abspath(path) == folder or os.path.abspath(path).startswith(folder.rstrip(os.sep) + os.sep):
            raise errors.UserError(f"{flag} {path} is inside {input_flag} {folder}; write the output somewhere else")


def safetensors_params(model_dir):
    """{network: parameter count} of a cached model, from its safetensors headers (no weights read)."""
    counts = {}
    for path in glob.glob(os.path.join(model_dir, "*", "*.safetensors")):
        part = os.path.basename(os.path.dirname(path))
        header = safetensors_header(path)[1]
        total = 0
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
        counts[part] = counts.get(part, 0) + total
    return {k: v for k, v in counts.items() if k in ("unet", "transformer", "vae") or k.startswith("text_encoder")}

"""Helpers that two or more scripts share: one-line errors and the exit, file names and atomic
writes, quiet library logging, hub downloads (Ray's start-up is raycluster.py's, the model folder's
checks families.py's)."""

import json
import os
import re
import shutil
import signal
import sys
import tempfile

from dreambooth import filemodes

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: the scripts, assets/, data/

IMAGE_SUFFIX = ".png"  # what the suite writes
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")  # what it reads
# Written into every model directory train.py produces, so a rerun can tell
# its own previous output from a folder the user cares about.
OUTPUT_MARKER = "dreambooth_training.json"
LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"  # train.py --use_lora's output, diffusers' name


class UserError(Exception):
    """A problem with the user's input: reported as one line, no traceback."""


def user_error_in(err):
    """The UserError that err carries from a Ray worker or actor, as a plain UserError; else None.
    Ray wraps it (RayTaskError, Ray Data's UserCodeException) and the wrappers reach this process
    without it: only their text names it, on a line "utils.UserError: <message>"."""
    if type(err) is UserError:
        return err
    found = re.findall(r"^(?:\w+\.)*UserError: (.+)$", str(err), flags=re.MULTILINE)
    return UserError(found[-1].strip()) if found else None


def ray_failure(err):
    """For an error raised in a Ray worker or actor (a RayError): a UserError naming its cause in
    one line, its traceback written to a log file the line names. Else None."""
    ray = sys.modules.get("ray")
    if ray is None or not isinstance(err, ray.exceptions.RayError):
        return None
    import time
    import traceback

    # mkstemp: a new file of a name no one can guess, only its owner can read, never through a link
    # planted in the shared temp folder
    fd, log = tempfile.mkstemp(prefix=f"dreambooth-error-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(err)))
    # The text of a worker's error holds its chain of tracebacks; the last exception line not
    # Ray's own is the cause.
    causes = [line for line in re.findall(r"^((?:\w+\.)*\w*(?:Error|Exception)\w*: .+)$", str(err), re.MULTILINE)
              if not line.startswith("ray.")]
    cause = shorten(causes[-1].strip()) if causes else one_line(err)
    return UserError(f"a Ray worker failed: {cause} (traceback in {log})")


def shorten(line, limit=240):
    """line, cut to its first sentence when longer than limit (libraries append advice that does
    not apply here)."""
    return line.split(". ")[0][:limit] if len(line) > limit else line


_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt): ")


def one_line(err, limit=240):
    """'ValueError: cannot load ...' from an exception: in a traceback, the last line that names an exception
    (its message's first line: torch's DDP errors run on over lines of advice); else the message's first line;
    shortened."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    raised = [line for line in lines if _RAISED.match(line)]
    line = shorten(raised[-1] if raised else lines[0], limit)
    name = type(err).__name__
    return line if line.startswith(f"{name}: ") else f"{name}: {line}"


def load_failure(what, err, remedy):
    """The UserError for a model or checkpoint that did not load (what: "loading the model x"):
    its cause in one line and remedy, unless the device ran out of memory, which has its own."""
    if type(err).__name__ == "OutOfMemoryError":  # torch's: the device, not the files
        remedy = "the GPU is too small for the model or in use by another process (nvidia-smi)"
    return UserError(f"{what}: {one_line(err)}; {remedy}")


ERRORS_LOG = "errors.log"  # where a worker's or actor's traceback goes, in its output folder


def log_error_event(folder, text):
    """Append a timestamped entry to folder/errors.log (best effort: something is failing already)."""
    import datetime

    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, ERRORS_LOG), "a") as f:
            f.write(f"=== {datetime.datetime.now().isoformat(timespec='seconds')} {text.rstrip()}\n")
    except OSError:
        pass


def write_error_log(folder, who, err):
    """Append err's traceback to folder/errors.log under who ("worker 0", "loading the model")."""
    import traceback

    log_error_event(folder, f"{who}: {one_line(err)}\n{''.join(traceback.format_exception(err))}")


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_main(main_fn):
    """Run a script's main(); turn UserError, Ctrl-C and SIGTERM into one line and an exit code."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    # Read when transformers is first imported (our scripts import it late): its warnings
    # about backends we do not use (torchvision) are noise on a user's console.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # bitsandbytes (imported by diffusers' loaders where installed) warns, on a CPU with AVX-512 BF16, that an
    # optional kernel package for 4-bit CPU matmuls is missing: noise on every export and preflight
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        main_fn()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except Exception as err:
        cause = user_error_in(err)  # raised in a Ray worker or actor, which logged its traceback
        if cause is None:
            cause = ray_failure(err)
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        leave_ray()
    exit_now(0)


def exit_now(code):
    """Exit with code at once: the atexit hooks (logging's flush, multiprocessing's joins) run and
    the standard streams are flushed, but not the interpreter's teardown of every module, which
    takes 0.5-1.6 s once torch and diffusers are imported (measured), at the end of every script.
    While a thread of ours may still be writing (a non-daemon thread alive), the normal exit."""
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe (| head): nothing more can reach it
    os._exit(code)


def leave_ray():
    """Disconnect from Ray now, if this process joined it: Ray's own exit hook does the same
    0.4-0.5 s slower (measured on a running local cluster), at the end of every script."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


# ---------------------------------------------------------------- naming and seeds


def on_terminal():
    """True when what a script prints reaches a person at a terminal: its stderr is one, or it is a
    step of dreambooth_run.sh started on one (which pipes every step through tee into its log, and says
    so with DREAMBOOTH_TERMINAL=1)."""
    return sys.stderr.isatty() or os.environ.get("DREAMBOOTH_TERMINAL") == "1"


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


# ---------------------------------------------------------------- files


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


def skip_unused_imports(lora=False, eight_bit=False):
    """In a process of its own (a Ray actor or worker, a script's main), hide peft and bitsandbytes
    from diffusers and transformers when this process will not use them: both import every
    optional package they find installed (bitsandbytes pulls in torch's inductor), 1.4 s of each
    process that imports diffusers. A None entry in sys.modules is Python's own mark for "not
    importable". Call before the first import of diffusers; never in a process that may need them
    later (the test suite's own)."""
    for name, needed in (("peft", lora), ("bitsandbytes", eight_bit)):
        if not needed and name not in sys.modules:
            sys.modules[name] = None


# ---------------------------------------------------------------- hub and models


def hub_reachable():
    """Whether the hub (HF_ENDPOINT, else huggingface.co) takes a connection within 3 s."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except (OSError, ValueError):
        return False
    return True


def hub_download(what, offline_hint, refused=None, **snapshot_args):
    """huggingface_hub.snapshot_download(**snapshot_args), every failure one UserError line (refused: the line
    for a gated repository the hub refuses, else a general one).

    An uncached file with the hub out of reach raises LocalEntryNotFoundError on hub 0.x
    and OfflineModeIsEnabled on 1.x with HF_HUB_OFFLINE set; both say what to do instead.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.errors import OfflineModeIsEnabled

    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes", "on") and not hub_reachable():
        # the cache alone, at once: the hub's client would retry five times (about 20 s, a line each) first
        snapshot_args["local_files_only"] = True
    try:
        return snapshot_download(**snapshot_args)
    except GatedRepoError as err:
        if refused:
            raise UserError(f"the hub refused {what} ({type(err).__name__}): {refused}") from None
        raise UserError(f"cannot fetch {what}: the hub refused it ({type(err).__name__}): it is gated; accept its "
                        "license on its hub page and give this machine a token (`hf auth login` or HF_TOKEN)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        raise UserError(f"{what} is not in the cache {snapshot_args.get('cache_dir') or 'of the hub'} and the hub "
                        f"cannot be reached ({type(err).__name__}); "
                        f"{offline_hint}") from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(f"cannot fetch {what}: {type(err).__name__}: {first}") from None



def quiet_hf_logging():
    """Silence per-component loading bars and the missing-accelerate notice in workers."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def available_memory():
    """Bytes of memory this machine can still give a process (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def torch_device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def safetensors_header(path):
    """(header length, header) of a safetensors file: {tensor name: {"dtype", "shape", "data_offsets"},
    "__metadata__": ...}, read without its weights. struct.error or ValueError when it does not parse."""
    import struct

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if 8 + length > os.path.getsize(path):
            raise ValueError(f"{path}: a header longer than the file")
        return length, json.loads(f.read(length))


def check_safetensors(path):
    """UserError naming path unless it is a whole safetensors file: its header parses and the file is
    as long as the header says (an interrupted download or copy is cut short). Reads the header only."""
    import struct

    size = os.path.getsize(path)
    what = f"{path} is not a whole safetensors file"
    try:
        length, header = safetensors_header(path)
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        raise UserError(f"{what} (its header does not parse): fetch or copy the model again "
                        "(cache_model.py)") from None
    if size != 8 + length + end:
        raise UserError(f"{what}: {size} bytes where its header says {8 + length + end} (an interrupted download "
                        "or copy?): fetch or copy the model again (cache_model.py)")


def check_output_path(path, flag, inputs=(), is_file=False):
    """UserError unless path can take a script's output: a folder output that is an existing file (or a
    file output that is a folder) is refused, and so is an output inside one of inputs [(flag, folder)]
    (the photos, the base model): writing there would mix the result into what the run reads."""
    if is_file and os.path.isdir(path):
        raise UserError(f"{flag} {path} is a folder; name the file to write")
    if not is_file and os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file, not a folder; pick a folder for the output")
    for input_flag, folder in inputs:
        if not folder:
            continue
        folder = os.path.abspath(folder)
        if os.path.abspath(path) == folder or os.path.abspath(path).startswith(folder.rstrip(os.sep) + os.sep):
            raise UserError(f"{flag} {path} is inside {input_flag} {folder}; write the output somewhere else")

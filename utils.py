"""Helpers that two or more scripts share: one-line errors, file names and atomic writes,
Ray start-up, quiet library logging, model-folder checks."""

import json
import os
import re
import shutil
import signal
import sys
import tempfile

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

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


def one_line(err, limit=240):
    """'ValueError: cannot load ...' from an exception: its last non-empty line, shortened."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    line = shorten(lines[-1], limit)
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
    """Call write_fn(tmp_dir) then move tmp_dir to final_dir, replacing it whole.

    The destination either keeps its previous content or gets the complete new one:
    a crash or a failed write leaves only a hidden temporary folder behind.
    """
    parent = os.path.dirname(os.path.abspath(final_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(final_dir) + "-", dir=parent)
    try:
        write_fn(tmp_dir)
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
    tmp = f"{path}{TEMP_MARK}{os.getpid()}"
    image.save(tmp, format="PNG")
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


# ---------------------------------------------------------------- Ray


def quiet_ray_logs():
    """Ray Data logs an error from user code twice before raising it (an ERROR line per stage):
    the raised error is what the user gets, as one line (user_error_in) or a traceback."""
    import logging

    for name in ("ray.data.exceptions", "ray.data._internal.execution.streaming_executor_state"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # ... and warns that the progress bars we turned off (ours are tqdm's) are off.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def quiet_ray_worker():
    """Every Ray worker process of our jobs runs this first (runtime_env worker_process_setup_hook).

    Without ray[default] there is no state API, and Ray Train's placement-group cleaner
    warns that it cannot query it every second of a run; the warning is harmless.
    """
    import logging

    import ray

    quiet_ray_logs()
    # Ray's state API (Ray Train's placement-group cleaner polls it) looks for "the" local
    # cluster when it has no address, and fails with a traceback when this machine runs two
    # (a user's two scripts at once, the test suite's own beside a script's).
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)
    # Ray Train's worker context logs every report at INFO through a logger named by its file's
    # path (so its own log-level setting misses it): one line per report and rank, all noise.
    context_py = os.path.join(os.path.dirname(ray.__file__), "train", "v2", "_internal", "execution", "context.py")
    logging.getLogger(context_py).setLevel(logging.WARNING)


def ray_token_path():
    """The file Ray reads its authentication token from (RAY_AUTH_TOKEN_PATH, else Ray's documented
    ~/.ray/auth_token), or None when the token is in RAY_AUTH_TOKEN itself."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def ensure_ray_token():
    """Turn on Ray's token authentication for this process and the ones it starts, unless the user
    turned it off (RAY_AUTH_MODE=disabled), and make sure a token exists: the one already in
    RAY_AUTH_TOKEN or its file (reused, as `ray get-auth-token --generate` does), else a new random
    one in a file only its owner can read (Ray writes its own readable by every local user).

    Why a token even on one machine: Ray 2.60 cannot be bound to loopback (it replaces 127.0.0.1
    with the node's address and its servers listen on every interface, measured), so the token is
    what keeps another host, or another user of this one, from running code as you.
    Returns the token file, or None (token in RAY_AUTH_TOKEN, or authentication off)."""
    import secrets

    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray" in sys.modules:  # Ray read its settings when imported: have it read the mode again (as its
            from ray._raylet import Config  # own ray.init does when it turns token mode on by default)

            Config.initialize("")
    if os.environ["RAY_AUTH_MODE"].lower() != "token":
        return None
    path = ray_token_path()
    if path is None:
        return None
    if os.path.isfile(path):
        if os.stat(path).st_mode & 0o077:  # a token other local users can read protects nothing from them
            os.chmod(path, 0o600)
        return path
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:  # O_EXCL: never through a link planted at that name, never over a token another process just made
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, the form of Ray's own
    return path


def ray_auth_note():
    """How this process authenticates to Ray, in a few words for the line that names the cluster."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ("token authentication OFF (RAY_AUTH_MODE=" + os.environ.get("RAY_AUTH_MODE", "") +
                "): anyone who can reach this machine's Ray ports can run code as you")
    path = ray_token_path()
    return "token authentication, token in " + (path if path else "RAY_AUTH_TOKEN")


def init_ray():
    """Start a local Ray cluster of this script's own, or join the cluster RAY_ADDRESS names (and
    only then: never the one Ray's temp folder names, which any `ray start` on this node writes),
    with token authentication (ensure_ray_token); one line says which. The project's modules travel
    as the runtime environment's working_dir, the same mechanism a multi-node cluster needs; all
    paths passed to workers are absolute.
    """
    import ray

    # Train's controller polls workers every 2 s by default, which adds ~1.5 s to
    # every ray.train.report; 0.2 s keeps reporting cheap.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    # Our excludes below name Ray's defaults (.git, .venv, ...); without this Ray warns about each.
    os.environ.setdefault("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", "")
    # Ray Data's INFO lines (each dataset's start, plan and finish) are for debugging Ray Data.
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")
    if ray.is_initialized():
        return ray
    ensure_ray_token()
    quiet_ray_logs()
    runtime_env = {
        "working_dir": REPO_DIR,
        "excludes": [".venv", "venv", ".git", "tests", "images", "benchmarks", "**/__pycache__", "*.png", "*.jpg"],
        "worker_process_setup_hook": "utils.quiet_ray_worker",
        "env_vars": {
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"],
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_DATA_LOG_LEVEL": os.environ["RAY_DATA_LOG_LEVEL"],
            # Ray Train routes a worker's print() through its logger and also to the original
            # stream: every line twice on the driver's terminal. Plain print is what we want.
            "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
            # Ray Train's preemption watcher only logs node drains (a worker lost to one is recovered
            # from the newest checkpoint either way); it is one more process at every run's start, and
            # Ray 2.60 prints an error-level line about its restart arguments on every run.
            "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
            # transformers warns, in every process that imports diffusers, that torchvision is
            # missing for image processors we never use; errors still show.
            "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error"),
        },
    }
    address = os.environ.get("RAY_ADDRESS", "").strip()
    try:
        # "local": a new cluster even when Ray's temp folder names another (a script of the user's
        # running beside this one, or a cluster someone else pointed that world-writable file at)
        ray.init(address=address or "local", runtime_env=runtime_env, log_to_driver=True, configure_logging=False,
                 include_dashboard=False)
    except (ConnectionError, ray.exceptions.AuthenticationError) as err:
        raise UserError(f"could not join the Ray cluster at RAY_ADDRESS={address}: {shorten(one_line(err))} (a "
                        f"cluster with token authentication needs its token: RAY_AUTH_TOKEN, or the file "
                        f"~/.ray/auth_token copied from its head)") from err
    where = ray.get_runtime_context().gcs_address
    if address:
        print(f"Ray: joined the cluster at {where} (RAY_ADDRESS); {ray_auth_note()}", file=sys.stderr)
    else:
        print(f"Ray: started a local cluster for this script at {where} (set RAY_ADDRESS to use a running one); "
              f"{ray_auth_note()}", file=sys.stderr)
    return ray


def start_ray_head(log_path, port=None, extra=()):
    """A local Ray cluster as dreambooth_run.sh starts one (`ray start --head --block` in the
    background, token authentication, its temp folder a private one so that its address is not
    published as this node's default, no 30 s drain when stopped), for the test suite and the
    benchmarks: (process, address for RAY_ADDRESS) once it is up; stop it with stop_ray_head."""
    import subprocess
    import time

    ensure_ray_token()
    # Ray's socket paths must stay short (under 108 characters): a folder of its own under /tmp
    temp_dir = tempfile.mkdtemp(prefix="dreambooth-ray-", dir="/tmp")
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
               "--include-dashboard=false", f"--temp-dir={temp_dir}"] + ([f"--port={port}"] if port else []) + list(extra)
    with open(log_path, "w") as log:
        head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"))
    head.temp_dir = temp_dir
    deadline = time.time() + 120
    while "block forever" not in (text := open(log_path).read()):
        if head.poll() is not None or time.time() > deadline:
            head.kill()
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise RuntimeError(f"ray start failed ({log_path}): {text[-2000:]}")
        time.sleep(0.2)
    return head, re.search(r"ray start --address='([^']+)'", text)[1]


def stop_ray_head(head):
    """Stop a start_ray_head cluster and remove its temp folder."""
    head.terminate()
    head.wait(timeout=60)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


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


def share_cpu_threads(processes_per_node):
    """Give this process its share of the node's cores for torch's CPU kernels.

    Ray sets OMP_NUM_THREADS to a task's CPU reservation (a fraction becomes 1 thread);
    CPU workers and actors on one node share its cores instead.
    """
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes_per_node))


def cluster_resources():
    """(CPUs, GPUs) of the Ray cluster this process is connected to."""
    import ray

    resources = ray.cluster_resources()
    return float(resources.get("CPU", 0)), int(resources.get("GPU", 0))


# ---------------------------------------------------------------- hub and models


def hub_download(what, offline_hint, **snapshot_args):
    """huggingface_hub.snapshot_download(**snapshot_args), every failure one UserError line.

    An uncached file with the hub out of reach raises LocalEntryNotFoundError on hub 0.x
    and OfflineModeIsEnabled on 1.x with HF_HUB_OFFLINE set; both say what to do instead.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        return snapshot_download(**snapshot_args)
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


def torch_device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def check_safetensors(path):
    """UserError naming path unless it is a whole safetensors file: its header parses and the file is
    as long as the header says (an interrupted download or copy is cut short). Reads the header only."""
    import struct

    size = os.path.getsize(path)
    what = f"{path} is not a whole safetensors file"
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if 8 + length > size:
                raise ValueError
            header = json.loads(f.read(length))
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

"""One-line errors and a script's exit: UserError, what a Ray worker's failure comes down to, error logs,
run_main (Ctrl-C, SIGTERM, the exit without teardown) and what reaches the terminal."""

import os
import re
import signal
import sys
import tempfile


class UserError(Exception):
    """A problem with the user's input: reported as one line, no traceback."""


def user_error_in(err):
    """The UserError that err carries from a Ray worker or actor, as a plain UserError; else None.
    Ray wraps it (RayTaskError, Ray Data's UserCodeException) and the wrappers reach this process
    without it: only their text names it, on a line "errors.UserError: <message>"."""
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


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, after the script has said where it stopped and how to go on (main adds no line)."""


_SIGNAL_SEEN = []  # the signal main's handler turned into a KeyboardInterrupt (SIGTERM); Ctrl-C's is SIGINT


def note_stop_signal(signum):
    """The signal that stops this script, for a handler of its own (training's): main exits 128 + it."""
    _SIGNAL_SEEN.append(signum)


def _raise_keyboard_interrupt(signum, frame):
    note_stop_signal(signum)
    raise KeyboardInterrupt


def stop_on_sigterm():
    """SIGTERM stops this script as Ctrl-C does (run_main's rule), again: ray.init puts Ray's own handler in its place,
    which prints a stack and kills the process."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)


# Lines of Ray's own that read as errors and are not: Ray's core logs an ERROR-level note for each restartable
# actor whose constructor arguments are in the object store (every Ray Data actor pool, ours among them, and
# Ray Train 2.60's preemption watcher). Ray's core writes them to file descriptor 2, past Python's sys.stderr.
HARMLESS_RAY_LINES = ("has constructor arguments in the object store and max_restarts > 0",
                      # (Ray Serve's controller, stopped by serve.shutdown as it asked: said as a failed task)
                      "Task ServeController.graceful_shutdown failed",)
# Messages of several lines that Ray's own processes print and that say nothing to a user: (what its first line holds,
# how its last line starts). Ray Data's split coordinator, stopped while Ray Train restarts the workers after one
# died, can be stopped inside a finaliser: Python then prints "Exception ignored in ..." with the SystemExit's
# traceback, under the one line that says the worker failed.
HARMLESS_RAY_BLOCKS = (("Exception ignored in: <function _ClosingIterator.__del__", "SystemExit"),)
HARMLESS_BLOCK_MOST_LINES = 20  # (a block whose last line does not come ends after so many, its first counted)

# The filter process of filter_native_stderr: only the standard library, Ctrl-C and SIGTERM ignored (it ends
# when the last writer of its pipe is gone, after the script, so nothing written before a crash is lost).
_STDERR_FILTER = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
drop = [s.encode() for s in sys.argv[1:]]
for line in sys.stdin.buffer:
    if not any(s in line for s in drop):
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
"""
_stderr_filter = None


def filter_native_stderr(drop=HARMLESS_RAY_LINES):
    """Route what native code writes to file descriptor 2 through a small process that drops the lines holding
    any of drop; Python's own sys.stderr keeps writing to the original stream directly (a terminal stays a
    terminal: the progress bars and on_terminal see it). Once per process; where fd 2 cannot be copied,
    nothing changes."""
    global _stderr_filter
    import io
    import subprocess

    if _stderr_filter is not None:
        return
    try:
        sys.stderr.flush()
        original = os.dup(2)
    except (OSError, ValueError, AttributeError):
        return
    read_end, write_end = os.pipe()
    _stderr_filter = subprocess.Popen([sys.executable, "-I", "-S", "-c", _STDERR_FILTER, *drop], stdin=read_end,
                                      stdout=subprocess.DEVNULL, stderr=original)
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    sys.stderr = io.TextIOWrapper(open(original, "wb"), encoding=sys.stderr.encoding or "utf-8",
                                  errors="backslashreplace", line_buffering=True)


def run_main(main_fn):
    """Run a script's main(); turn UserError, Ctrl-C and SIGTERM into one line and an exit code. Ray's
    harmless error-looking lines (HARMLESS_RAY_LINES) are kept off the script's stderr."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    filter_native_stderr()
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
    except ModuleNotFoundError as err:  # (the packages are imported where used: a wrong Python fails here)
        if not err.name or err.name.split(".")[0] == "dreambooth":
            raise  # (ours: a bug, with its traceback)
        print(f"error: {sys.executable} has no {err.name} (requirements.txt): run with the Python they are installed "
              f"in (. .venv/bin/activate first, or .venv/bin/python {os.path.basename(sys.argv[0])})", file=sys.stderr)
        sys.exit(1)
    except Exception as err:
        cause = user_error_in(err)  # raised in a Ray worker or actor, which logged its traceback
        if cause is None:
            cause = ray_failure(err)
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as err:  # (exit 130 for Ctrl-C, 143 for SIGTERM, as a shell reports them)
        signum = _SIGNAL_SEEN[-1] if _SIGNAL_SEEN else signal.SIGINT
        if not isinstance(err, Stopped):
            print(f"stopped by {signal.Signals(signum).name}", file=sys.stderr)
        sys.exit(128 + signum)
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
    0.4-0.5 s slower (measured on a running local cluster), at the end of every script. A cluster of the
    script's own goes with it: its autoscaler monitor is killed first, which Ray's shutdown stops only after
    the cluster's GCS, when the monitor's exit handler (a message to the GCS that is gone) waits out the
    second Ray gives it before killing it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from ray._private import ray_constants

        node = ray._private.worker._global_node  # (None on a cluster this script joined: no process of its own)
        for info in node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []) if node is not None else []:
            info.process.kill()
            info.process.wait()
        ray.shutdown()


def on_terminal():
    """True when what a script prints reaches a person at a terminal: its stderr is one, or it is a
    step of dreambooth_run.sh started on one (which pipes every step through tee into its log, and says
    so with DREAMBOOTH_TERMINAL=1)."""
    return sys.stderr.isatty() or os.environ.get("DREAMBOOTH_TERMINAL") == "1"

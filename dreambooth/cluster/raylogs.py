"""Ray's output kept to what says something: its own loggers quieted in the driver and in every worker (the
runtime environment's setup hook), and the lines of Ray's processes that read as errors and are not kept from the
driver's output."""

import os

from dreambooth import errors


def quiet_ray_logs():
    """Ray Data logs an error from user code twice before raising it (an ERROR line per stage):
    the raised error is what the user gets, as one line (errors.user_error_in) or a traceback."""
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
    # (bitsandbytes' note that an optional CPU kernel package is missing: as on the driver, errors.run_main)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # Ray Train's worker context logs every report at INFO through a logger named by its file's
    # path (so its own log-level setting misses it): one line per report and rank, all noise.
    context_py = os.path.join(os.path.dirname(ray.__file__), "train", "v2", "_internal", "execution", "context.py")
    logging.getLogger(context_py).setLevel(logging.WARNING)


class HarmlessLines:
    """Which lines of Ray's processes' output to print: not errors.HARMLESS_RAY_LINES, nor the lines of a
    process's errors.HARMLESS_RAY_BLOCKS (from the line that starts one to its last, however Ray batches them)."""

    def __init__(self):
        self.inside = {}  # {pid: (how the block's last line starts, lines it may still have)}

    def keep(self, pid, line):
        if pid in self.inside:
            end, left = self.inside.pop(pid)
            if not line.lstrip().startswith(end) and left > 1:
                self.inside[pid] = (end, left - 1)
            return False
        for start, end in errors.HARMLESS_RAY_BLOCKS:
            if start in line:
                self.inside[pid] = (end, errors.HARMLESS_BLOCK_MOST_LINES - 1)
                return False
        return not any(s in line for s in errors.HARMLESS_RAY_LINES)


def hide_harmless_ray_lines():
    """Keep errors.HARMLESS_RAY_LINES and HARMLESS_RAY_BLOCKS out of the worker output Ray prints on the driver's
    terminal (they stay in Ray's log files). Through Ray's private log dispatcher: where it is not found, nothing
    changes."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return

    def filtered(handler):
        harmless = HarmlessLines()

        def handle(data):
            lines = [line for line in data.get("lines", ()) if harmless.keep(data.get("pid"), line)]
            if lines:
                handler({**data, "lines": lines})
        handle.hides_harmless = True
        return handle

    with dispatcher._lock:
        dispatcher.handlers = [(name, filtered(h) if name == "ray_print_logs" and not hasattr(h, "hides_harmless")
                                else h) for name, h in dispatcher.handlers]
    # (the errors Ray's processes publish, "(raylet) ..." lines, come through print_to_stdstream instead)
    from ray._private import worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is not None and not hasattr(printer, "hides_harmless"):
        def print_kept(data, ignore_prefix):
            filtered(lambda kept: printer(kept, ignore_prefix))(data)
        print_kept.hides_harmless = True
        ray_worker.print_to_stdstream = print_kept

"""A run that can no longer make progress ends in one line instead of waiting forever.

Each worker reads its batches through Prefetched, which fetches the next one in a thread while the current step
trains, and waits for it under a Clock: no batch within --stall_timeout seconds of the last step (by default 5 times
the slowest step so far, at least STALL_FLOOR_S) raises a UserError in the worker, which stops the run at once
(failures.FailureWatch) rather than a restart meeting the same wait. The line names what Ray reports as pending (the
data stream's tasks waiting for a CPU no node has left: a lost node, every CPU held) and says how to continue from
the newest checkpoint, which stays.
"""

import contextlib
import queue
import sys
import threading
import time

from dreambooth import errors
from dreambooth.cluster import nodes

STALL_FLOOR_S = 600.0  # the default limit's least: a slow checkpoint or validation round is not a stall
STALL_FACTOR = 5.0  # the default limit: this many times the slowest step seen
POLL_S = 1.0  # how often a wait looks at the clock


class Clock:
    """The time since the worker's last step, against the limit of --stall_timeout (None: the default, from the slowest
    step seen; 0: none)."""

    def __init__(self, timeout=None):
        self.timeout = timeout
        self.last, self.slowest, self.steps, self.step = time.monotonic(), 0.0, 0, 0

    def restart(self, step):
        """The loop begins after step (the models are loaded): the wait for the next batch counts from now."""
        self.last, self.step = time.monotonic(), step

    def stepped(self, step):
        """step has ended (its report, checkpoint and validation round included)."""
        now = time.monotonic()
        self.slowest, self.last, self.steps, self.step = max(self.slowest, now - self.last), now, self.steps + 1, step

    def limit(self):
        """The longest wait for the next batch, in seconds (None: no limit)."""
        if self.timeout == 0:
            return None
        return self.timeout if self.timeout is not None else max(STALL_FLOOR_S, STALL_FACTOR * self.slowest)

    def waited(self):
        """Seconds since the last step (or the loop's start)."""
        return time.monotonic() - self.last


def pending_line():
    """What Ray's autoscaler state says is waiting, and what the live nodes have free: 'Ray reports waiting: 3
    request(s) for {CPU: 1}; 2 node(s), 0 of 3 CPUs free'."""
    import ray

    if not ray.is_initialized():
        return "this process is not connected to Ray"
    parts = []
    with contextlib.suppress(Exception):  # (an older cluster, a GCS that does not answer: the nodes alone)
        from ray.autoscaler.v2.sdk import get_cluster_status

        demands = get_cluster_status(ray.get_runtime_context().gcs_address).resource_demands
        waiting = [f"{bundle.count} request(s) for {{{', '.join(f'{k}: {v:g}' for k, v in sorted(bundle.bundle.items()))}}}"
                   for demand in demands.ray_task_actor_demand + demands.placement_group_demand
                   for bundle in demand.bundles_by_count]
        parts.append("Ray reports waiting: " + ("; ".join(waiting) if waiting else "nothing"))
    cpus = nodes.node_cpus()
    parts.append(f"{len(cpus)} node(s), {ray.available_resources().get('CPU', 0):g} of {sum(cpus):g} CPUs free")
    return "; ".join(parts)


def stalled(clock, newest, describe=pending_line):
    """The UserError of a worker that waited past the clock's limit for the batches of the step after the clock's;
    newest: the newest checkpoint's step, or None."""
    limit = clock.limit()
    slowest = f"; the slowest step so far took {clock.slowest:.1f} s" if clock.steps else ""
    keep = (f"its newest checkpoint (step {newest}) is kept: rerun the same command with --resume_from_checkpoint latest"
            " to continue" if newest is not None else "no checkpoint was written yet")
    return errors.UserError(
        f"stalled: no data for step {clock.step + 1} in {clock.waited():.0f} s (--stall_timeout {limit:g}{slowest}); the "
        f"cluster cannot run the data stream ({describe()}): free a CPU or add a node; {keep}")


class Prefetched:
    """An iterable over iterable whose next item is fetched in a thread while the caller works on the current one: the
    data stream starts (Ray Data's split coordinator, the first blocks) while the models load, and each later batch
    while the step before trains. Each wait for an item is held to clock's limit (stalled(clock, on_stall()) is raised
    past it; on_stall() gives the newest checkpoint's step, or None). close() ends the stream where the run stops
    reading it (its last step, a failure): its thread and Ray Data's iterator end then, not with the process (in this
    process, --num_workers 0, they would outlive the run and its Ray connection). The thread is a daemon: one that a
    stalled stream holds does not hold the process at its exit."""

    def __init__(self, iterable, clock=None, on_stall=lambda: None):
        self.items, self.clock, self.on_stall, self.stalled = iter(iterable), clock, on_stall, False
        self.threads_before = set(threading.enumerate())
        self.asked, self.got = queue.SimpleQueue(), queue.SimpleQueue()
        self.thread = threading.Thread(target=self.fetch, name="dreambooth-data", daemon=True)
        self.thread.start()
        self.ask()

    def ask(self):
        self.asked.put(True)
        self.outstanding = True

    def fetch(self):
        """The thread: an item (or the stream's error) each time one is asked for, until the end or close()."""
        while self.asked.get():
            try:
                item = next(self.items, None), None
            except BaseException as err:  # (raised where the item is waited for)
                item = None, err
            self.got.put(item)
            if item[0] is None:
                return

    def wait(self):
        """The fetched item (None at the end of the stream), waited for under the clock."""
        while True:
            try:
                item, err = self.got.get(timeout=POLL_S if self.clock is not None else None)
            except queue.Empty:
                limit = self.clock.limit()
                if limit is not None and self.clock.waited() > limit:
                    self.stalled = True
                    raise stalled(self.clock, self.on_stall()) from None
                continue
            self.outstanding = False
            if err is not None:
                raise err
            return item

    def __iter__(self):
        while True:
            item = self.wait()
            if item is None:
                return
            self.ask()
            yield item

    def close(self):
        if self.outstanding and not self.stalled:
            with contextlib.suppress(Exception):  # (the stream's own error, if any, is not this run's cause)
                self.wait()
        if self.stalled:  # (its fetch is not waited for, which would stall the stop too: its stream is shut down)
            self.shut_down_stream()
            return
        self.asked.put(False)
        self.thread.join()
        close = getattr(self.items, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()

    def shut_down_stream(self):
        """A stalled stream's Ray Data executors (threads started since this one was made) shut down, so that none
        goes on touching Ray after the script has left it (in the driver's process, --num_workers 0)."""
        module = sys.modules.get("ray.data._internal.execution.streaming_executor")
        for thread in set(threading.enumerate()) - self.threads_before:
            if module is not None and isinstance(thread, module.StreamingExecutor):
                with contextlib.suppress(Exception):
                    thread.shutdown(force=True)

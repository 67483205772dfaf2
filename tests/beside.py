"""Script runs that go on beside the other tests, while the session runs.

The 2 cores are seldom both busy during one test (a script's start-up, a step that uses one core, a wait on a
process), so a few long script runs that need nothing of the other tests run one at a time in a thread of their
own, on a Ray cluster of their own, while the rest of the suite runs. A test reads one with
``@pytest.mark.beside(run=spec)`` and the ``runs_beside`` fixture: ``runs_beside.result(spec)`` waits for the run
(the session moves such tests to its end, by when it is done) and gives its Finished. spec(request, folder) -> Job
is a module-level function of the test's module: the command, built from session fixtures
(request.getfixturevalue), in folder.

The runs start with the session's first test, at the lowest priority (nice 19: their drivers, their cluster's
daemons and workers), while the tests' processes run at 0 (conftest sets Ray's worker niceness to 0, where Ray's
own is 15): they take the CPU the tests leave idle (a wait for a node, a process starting on one core) and some of
the rest (the tests marked fills_cores took about a fifth longer beside them, measured on 2026-12-04; at the same
priority, twice as long, and a second node was left no time to start). Niceness counts only within one session's
processes (the kernel's autogroups): a process a test starts in a session of its own shares the CPU with them as an
equal. Ray's timeouts for a worker's start are raised on their cluster, where a worker may wait minutes for a core.

Every process of these runs carries MARK in its environment (the cluster's daemons and workers inherit it): a test
that stops or kills "the train workers started since t" leaves theirs alone (test_recovery.worker_pids). They keep
their Ray sessions in a temp folder of their own (RAY_TMPDIR), so a test that counts the clusters started on the
machine meanwhile does not count theirs.
"""

import dataclasses
import os
import pathlib
import subprocess
import time

MARK = "DREAMBOOTH_TESTS_BESIDE"  # in the environment of every process of a run beside the tests
NICE = 19  # the runs' priority (the tests' processes: 0)
# The environment of the runs and their cluster (beyond RAY_TMPDIR and RAY_ADDRESS): their mark; Ray's niceness for
# the cluster's workers; the time a worker may take to start and register (60 s by default) and Ray Train's worker
# group to start (60 s), which a process at nice 19 can take while the tests keep both cores busy.
RUNS_ENV = {MARK: "1", "RAY_worker_niceness": str(NICE), "RAY_worker_register_timeout_seconds": "900",
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "900"}


@dataclasses.dataclass
class Job:
    argv: list
    env: dict = dataclasses.field(default_factory=dict)  # on top of the session's; None removes a variable
    timeout: float = 2400  # (at nice 19 a run takes what the tests leave idle: longer than alone)


@dataclasses.dataclass
class Finished:
    folder: pathlib.Path  # the spec's folder (its outputs)
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # its wall time, the other tests going on meanwhile


def specs_of(items):
    """The specs of the marked tests among items, once each, in order."""
    specs = []
    for item in items:
        marker = item.get_closest_marker("beside")
        if marker and marker.kwargs["run"] not in specs:
            specs.append(marker.kwargs["run"])
    return specs


def order(items):
    """items in the order the session runs them: the tests that keep both cores busy themselves (marked
    fills_cores: runs side by side, a test long by need) first; the tests that read the runs beside last; the
    others between, each group in its own order."""
    return sorted(items, key=lambda item: 0 if item.get_closest_marker("fills_cores") else
                  2 if item.get_closest_marker("beside") else 1)


def lowest_priority():
    """This thread at nice NICE (Linux's niceness is a thread's): the processes it starts inherit it."""
    import threading

    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


class Runs:
    """The runs of a session, one at a time in a thread at nice NICE, on a cluster of their own: start_cluster() ->
    (its address, the runs' environment), called in that thread before the first run."""

    def __init__(self, start_cluster):
        from concurrent.futures import ThreadPoolExecutor

        self.start_cluster, self.cluster = start_cluster, None  # (a future of start_cluster's)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="beside", initializer=lowest_priority)
        self.waiting, self.futures, self.failed = [], {}, {}  # failed: {spec: what it raised}

    def add(self, spec, job, folder):
        """A run to start with the others (go)."""
        self.waiting.append((spec, job, folder))

    def go(self):
        """The runs added so far started, one after another (again: nothing more)."""
        if self.waiting and self.cluster is None:
            self.cluster = self.pool.submit(self.start_cluster)
        for spec, job, folder in self.waiting:
            self.futures[spec] = self.pool.submit(self._run, job, folder)
        self.waiting = []

    def _run(self, job, folder):
        address, cluster_env = self.cluster.result()
        env = {**os.environ, **cluster_env, "RAY_ADDRESS": address}
        for name, value in job.env.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        started = time.time()
        proc = subprocess.run(job.argv, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env,
                              capture_output=True, text=True, timeout=job.timeout)
        return Finished(folder, proc.returncode, proc.stdout, proc.stderr, time.time() - started)

    def result(self, spec):
        """The spec's Finished, once its run has ended (a run that timed out raises here, in the test)."""
        if spec in self.failed:
            raise self.failed[spec]
        self.go()
        return self.futures[spec].result()

    def summary(self):
        """A line per finished run: its wall time."""
        return [f"{future.result().seconds:6.1f}s beside the tests: {spec.__module__}.{spec.__name__}"
                for spec, future in self.futures.items()
                if future.done() and not future.cancelled() and not future.exception()]

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)

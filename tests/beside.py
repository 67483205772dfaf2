"""Script runs that go on beside the other tests, while the session runs.

The 2 cores are seldom both busy during one test (a script's start-up, a step that uses one core, a wait on a
process), so a few long script runs that need nothing of the other tests run one at a time in a thread of their
own, on a Ray cluster of their own, while the rest of the suite runs. A test reads one with
``@pytest.mark.beside(run=spec)`` and the ``runs_beside`` fixture: ``runs_beside.result(spec)`` waits for the run
(the session moves such tests to its end, by when it is done) and gives its Finished. spec(request, folder) -> Job
is a module-level function of the test's module: the command, built from session fixtures
(request.getfixturevalue), in folder.

The runs start once the tests marked fills_cores are done (the session runs those first): a test that keeps both
cores busy itself gains nothing from a run beside it, and one beside it slowed the test twofold and left a second
node no time to start.

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


@dataclasses.dataclass
class Job:
    argv: list
    env: dict = dataclasses.field(default_factory=dict)  # on top of the session's; None removes a variable
    timeout: float = 900


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
    fills_cores: runs side by side, a test long by need) first, before the runs beside start; the tests that read
    those runs last; the others between, each group in its own order."""
    return sorted(items, key=lambda item: 0 if item.get_closest_marker("fills_cores") else
                  2 if item.get_closest_marker("beside") else 1)


class Runs:
    """The runs of a session, one at a time in a thread, on a cluster of their own: start_cluster() -> (its address,
    the Ray temp folder of the runs), called when the first run starts (not while the tests before it run)."""

    def __init__(self, start_cluster):
        from concurrent.futures import ThreadPoolExecutor

        self.start_cluster, self.env = start_cluster, None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="beside")
        self.waiting, self.futures, self.failed = [], {}, {}  # failed: {spec: what it raised}

    def add(self, spec, job, folder):
        """A run to start with the others (go)."""
        self.waiting.append((spec, job, folder))

    def go(self):
        """The runs added so far started, one after another (again: nothing more)."""
        if self.waiting and self.env is None:
            address, ray_tmpdir = self.start_cluster()
            self.env = {"RAY_ADDRESS": address, "RAY_TMPDIR": ray_tmpdir, MARK: "1"}
        for spec, job, folder in self.waiting:
            self.futures[spec] = self.pool.submit(self._run, job, folder)
        self.waiting = []

    def _run(self, job, folder):
        env = {**os.environ, **self.env}
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

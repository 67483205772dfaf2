"""stall.py: a worker's batches fetched ahead of the step that needs them, and a wait past --stall_timeout ended in
one line (the run on a cluster with no CPU left for its data: tests/integration/test_preflight_scripts.py)."""

import threading
import time

import pytest

from dreambooth import errors
from dreambooth.training import stall


def test_the_default_limit_is_five_times_the_slowest_step_and_at_least_ten_minutes():
    clock = stall.Clock()
    assert clock.limit() == stall.STALL_FLOOR_S
    clock.slowest = 300.0
    assert clock.limit() == 1500.0
    assert stall.Clock(30).limit() == 30 and stall.Clock(0).limit() is None


def test_the_next_batch_is_fetched_while_the_step_trains_and_close_ends_the_stream():
    fetched, ended = [], threading.Event()

    def stream():
        try:
            for item in range(1, 10):
                fetched.append(item)
                yield item
        finally:
            ended.set()

    batches = stall.Prefetched(stream(), stall.Clock(5))
    items = iter(batches)
    assert next(items) == 1
    deadline = time.monotonic() + 5  # (item 2 is fetched with nothing asking for it)
    while fetched != [1, 2] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fetched == [1, 2]
    assert next(items) == 2
    batches.close()
    assert ended.is_set() and fetched == [1, 2, 3]


def test_no_batch_within_the_limit_stops_the_run_in_one_line_naming_the_step_and_the_checkpoint_to_continue_from():
    release = threading.Event()

    def stream():
        yield "a"
        yield "b"
        release.wait()  # (a data stream with no CPU left to run on)
        yield "c"

    clock = stall.Clock(0.5)
    batches = stall.Prefetched(stream(), clock, on_stall=lambda: 2)
    clock.restart(0)
    taken = []
    with pytest.raises(errors.UserError) as stopped:
        for item in batches:
            taken.append(item)
            clock.stepped(len(taken))
    assert taken == ["a", "b"]
    line = str(stopped.value)
    assert "\n" not in line and line.startswith("stalled: no data for step 3 in 1 s (--stall_timeout 0.5; the slowest "
                                                "step so far took 0.0 s); the cluster cannot run the data stream (")
    assert line.endswith("its newest checkpoint (step 2) is kept: rerun the same command with --resume_from_checkpoint "
                         "latest to continue")
    began = time.monotonic()
    batches.close()  # (at once: the stalled fetch is not waited for)
    assert time.monotonic() - began < 1
    release.set()
    clock = stall.Clock(0.2)  # (none written yet)
    with pytest.raises(errors.UserError, match="no data for step 1 .* no checkpoint was written yet$"):
        next(iter(stall.Prefetched(iter(threading.Event().wait, True), clock)))

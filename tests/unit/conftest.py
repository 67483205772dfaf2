"""The unit tier: functions, the plan, the family math and the training step on tiny models, in this process. A test
here that starts a process or a Ray cluster fails: its place is tests/integration."""

import pytest
from counts import current
from support import ray_sessions


@pytest.fixture(scope="session", autouse=True)
def _fonts_listed():
    """matplotlib lists the machine's fonts (fc-list, a process) the first time it is imported for this user, then
    reads its cache: done here, before any test, so that a new machine's first plot is not taken for a test's
    process."""
    import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def _no_process_and_no_ray():
    counter = current()
    processes, sessions = len(counter.processes), ray_sessions()
    yield
    started = counter.processes[processes:]
    assert not started, f"a unit test started a process (it belongs in tests/integration): {started[0]}"
    assert ray_sessions() == sessions, "a unit test started a Ray cluster: it belongs in tests/integration"

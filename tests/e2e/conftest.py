"""Every test of this tier runs on the session's Ray cluster (conftest.shared_ray_cluster), as dreambooth_run.sh's
steps share one: each script it runs, and this process, join it through RAY_ADDRESS. A test that needs a cluster of
its own says so (RAY_ADDRESS removed or set)."""

import pytest
from readme import by_hand_run


@pytest.fixture(autouse=True)
def _the_sessions_cluster(shared_ray_cluster):
    pass


@pytest.fixture(scope="session")
def by_hand(tmp_path_factory):
    """The README's "Each step by hand" block run on the tiny model (readme.by_hand_run), once for the tests that read
    what it left (test_readme's, and test_serve's subjects)."""
    return by_hand_run(tmp_path_factory.mktemp("by-hand"))

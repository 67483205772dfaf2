"""Every test of this tier runs on the session's Ray cluster (conftest.shared_ray_cluster), as dreambooth_run.sh's
steps share one: each script it runs, and this process, join it through RAY_ADDRESS. A test that needs a cluster of
its own says so (RAY_ADDRESS removed or set)."""

import pytest


@pytest.fixture(autouse=True)
def _the_sessions_cluster(shared_ray_cluster):
    pass

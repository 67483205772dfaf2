"""Every test of this tier runs on the session's Ray cluster (conftest.shared_ray_cluster), as dreambooth_run.sh's
steps share one: each script it runs, and this process, join it through RAY_ADDRESS. A test that needs a cluster of
its own says so (RAY_ADDRESS removed or set)."""

import pytest


@pytest.fixture(autouse=True)
def _the_sessions_cluster(shared_ray_cluster):
    pass


@pytest.fixture(scope="session")
def uninterrupted(ray_session, tiny_model, toy_images, tmp_path_factory):
    """(output folder, logged losses) of the run that stopped, drained and bucket runs must end like:
    test_recovery.STOP_STEPS steps of the toy photos with its STOP_OPTIONS on 2 workers (one run for them all)."""
    from test_recovery import STOP_OPTIONS
    from test_recovery import STOP_STEPS
    from test_recovery import logged_losses
    from test_recovery import train_args

    from dreambooth.commands import train

    out = tmp_path_factory.mktemp("uninterrupted") / "whole"
    result = train.main(train_args(tiny_model, toy_images, out, STOP_STEPS, *STOP_OPTIONS))
    return out, logged_losses(result)

"""failures.py: which worker errors stop a run, which are left to Ray Train's restarts, and what the user sees."""

import pytest
import torch

from dreambooth import errors
from dreambooth.planning import planning
from dreambooth.training import driver
from dreambooth.training import failures


def test_errors_of_the_files_read_stop_the_run_and_flaky_ones_are_retried():
    with pytest.raises(errors.UserError, match=r"^loading x: ValueError: shapes differ; fetch it again$"):
        with failures.cannot_be_retried("loading x", "fetch it again"):
            raise ValueError("shapes differ")
    with pytest.raises(errors.UserError, match="loading x: OutOfMemoryError: CUDA out of memory; the GPU is too small"):
        with failures.cannot_be_retried("loading x", "fetch it again"):
            raise torch.OutOfMemoryError("CUDA out of memory")
    for flaky in (OSError("stale file handle"), TimeoutError("slow disk")):
        with pytest.raises(type(flaky)):
            with failures.cannot_be_retried("loading x", "fetch it again"):
                raise flaky


def test_a_long_library_message_is_cut_to_its_first_sentence():
    err = ValueError("Cannot load x because a.weight expected shape [64, 64], but got [64, 32]. If you want to "
                     "instead overwrite randomly initialized weights, please pass " + "y" * 300)
    assert errors.one_line(err) == "ValueError: Cannot load x because a.weight expected shape [64, 64], but got [64, 32]"
    assert errors.one_line(RuntimeError("Traceback:\n  File a\nRuntimeError: boom\n")) == "RuntimeError: boom"
    # torch's DDP error runs on over lines of advice: its first line says what happened (the last once read
    # "RuntimeError: In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG ...")
    ddp = ("Expected to have finished reduction in the prior iteration before starting a new one. This error "
           "indicates that your module has parameters that were not used in producing loss. " + "z" * 200 +
           "\nParameter indices which did not receive grad for rank 1: 196 197\n In addition, you can set the "
           "environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL")
    said = "RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one"
    assert errors.one_line(RuntimeError(ddp)) == said
    assert errors.one_line(RuntimeError(f"ray::RayTrainWorker.run (pid=7)\n  File x, line 3\nRuntimeError: {ddp}")) == said


def test_out_of_memory_at_the_first_step_stops_the_run_later_ones_are_retried():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    fatal = failures.out_of_memory(oom, step=0, first_step=0)
    assert isinstance(fatal, errors.UserError) and "out of GPU memory at step 1" in str(fatal)
    assert "--gradient_checkpointing" in str(fatal)
    assert failures.out_of_memory(oom, step=40, first_step=30) is None  # after a resume: the 11th step
    assert failures.out_of_memory(oom, step=30, first_step=30) is not None  # a resumed run's first step
    assert failures.out_of_memory(RuntimeError("boom"), step=0, first_step=0) is None


def test_the_watch_stops_on_a_user_error_and_announces_a_dead_worker(tmp_path, capsys):
    watch = failures.FailureWatch(str(tmp_path / "run"), max_failures=1)
    watch.after_exception(None, {1: RuntimeError("actor died"), 0: ConnectionError("peer reset")})
    out = capsys.readouterr().out
    assert out.startswith("worker 0 failed: ConnectionError: peer reset; restarting the workers from step 0 (no "
                          "checkpoint registered yet) (1 of --max_failures 1;")
    watch.after_exception(None, {0: RuntimeError("actor died")})  # the limit is spent: Ray Train raises, we say nothing
    assert capsys.readouterr().out == ""
    with pytest.raises(failures.RunStopped, match="^worker 1: bad weights$"):
        watch.after_exception(None, {0: RuntimeError("collective aborted"), 1: errors.UserError("bad weights")})
    log = (tmp_path / "run" / errors.ERRORS_LOG).read_text().splitlines()
    assert len(log) == 3 and "peer reset" in log[0] and "a restart cannot fix this" in log[2]


def test_a_preemption_has_its_own_budget_and_its_own_line(tmp_path, capsys):
    """A worker lost with its preempted node (Ray's RayActorError.preempted, as Ray Train's health check sees it) is
    said as a preemption, counted against --max_preemption_failures, not --max_failures; the run's FailureConfig has
    both budgets."""
    from ray.exceptions import RayActorError

    watch = failures.FailureWatch(str(tmp_path / "run"), max_failures=1, max_preemption_failures=2)
    for _ in range(2):
        watch.after_exception(None, {1: RayActorError(preempted=True), 0: ConnectionError("peer reset")})
    out = capsys.readouterr().out.splitlines()
    assert out == [f"a node was preempted (its worker(s) 1 lost): restarting the workers from step 0 (no checkpoint "
                   f"registered yet) ({n} of --max_preemption_failures 2; preemptions do not count against "
                   "--max_failures)" for n in (1, 2)]
    watch.after_exception(None, {0: RuntimeError("actor died")})  # a real failure: its own budget, untouched
    assert "(1 of --max_failures 1;" in capsys.readouterr().out
    watch.after_exception(None, {0: RayActorError(preempted=True)})  # the third preemption: spent, nothing said
    assert capsys.readouterr().out == ""
    plan = planning.offline_plan(max_failures=3, max_preemption_failures=5)
    config = driver.failure_config(plan)
    assert (config.max_failures, config.max_preemption_failures) == (3, 5)
    assert planning.parse_args(["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/p",
                                "--instance_prompt", "a"]).max_preemption_failures == -1  # (every time, as Ray's)


def test_a_stopped_run_is_reported_by_its_cause():
    from ray.train import ControllerError

    assert driver.failure_cause(ControllerError(failures.RunStopped("worker 1: bad weights"))) == "worker 1: bad weights"


def test_a_full_disk_is_recognised_however_a_library_wraps_it(tmp_path):
    import errno

    from safetensors.torch import save_file

    assert failures.disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert failures.disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not failures.disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not failures.disk_full(ValueError("size mismatch"))
    try:  # safetensors' own error, as a full disk raises it (/dev/full is a device that is always full)
        save_file({"w": __import__("torch").zeros(4096)}, "/dev/full")
    except Exception as err:  # noqa: BLE001 (whatever class safetensors raises)
        assert failures.disk_full(err), repr(err)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:
            raise RuntimeError("checkpoint upload failed") from err
    except RuntimeError as wrapped:
        assert failures.disk_full(wrapped)
    removed = []
    with pytest.raises(errors.UserError, match=rf"no space left on the device of {tmp_path} while writing a file: "
                                               rf".* free there, about 12.3 MB needed"):
        with failures.stops_when_disk_full("a file", str(tmp_path), 12_345_678, cleanup=lambda: removed.append(1)):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert removed == [1]
    with pytest.raises(ValueError):  # anything else passes through untouched
        with failures.stops_when_disk_full("a file", str(tmp_path), 1):
            raise ValueError("other")


def test_the_restart_line_names_where_the_workers_begin_again(tmp_path):
    """The newest checkpoint once Ray Train has registered one of the run (its report processed: what the restarted
    workers get), not a checkpoint folder written but not yet reported; else the one the run resumed from, else
    step 0."""
    import json

    from dreambooth.planning import checkpoints

    run = tmp_path / "runs" / "model-20261127-000000"
    run.mkdir(parents=True)
    fresh = failures.FailureWatch(str(run), 3, str(tmp_path / "runs"), run.name)
    resumed = failures.FailureWatch(str(run), 3, str(tmp_path / "runs"), run.name, resumed=True)
    elastic = failures.FailureWatch(str(run), 3, str(tmp_path / "runs"), run.name, min_workers=1)
    checkpoint = run / "checkpoint_2026-11-27_00-00-01"  # (whole, by a worker that died before reporting it)
    checkpoint.mkdir()
    (checkpoint / "unet.safetensors").write_bytes(b"w" * 4)
    (checkpoint / checkpoints.STATE_FILE).write_text(json.dumps({"step": 5, "sizes": {"unet.safetensors": 4}}))
    assert fresh.restart_point() == "step 0 (no checkpoint registered yet)"
    assert resumed.restart_point() == "the checkpoint this run resumed from"
    for watch in (fresh, resumed, elastic):
        watch.after_report(None, [{"step": 5}], None)  # (a report without a checkpoint)
    assert fresh.restart_point() == "step 0 (no checkpoint registered yet)"
    for watch in (fresh, resumed, elastic):
        watch.after_report(None, [{"step": 10}], object())
    assert fresh.restart_point() == resumed.restart_point() == "the newest checkpoint"
    assert elastic.restart_point() == ("the newest checkpoint on the workers the cluster holds now (at least "
                                       "--min_workers 1)")

"""--report_to's W&B and MLflow runs read back from their own files (their services are processes of their own), and
--notify_url's messages as a local webhook server receives them."""

import os
import subprocess
import sys
import time

import pytest
from support import modes_not_as_umask
from trackerfiles import wandb_records

from dreambooth import errors
from dreambooth import files
from dreambooth.planning import planning
from dreambooth.storage import runfiles
from dreambooth.training import trackers


def test_a_wandb_run_in_a_process_ended_without_exit_handlers_leaves_nothing_in_the_temp_folder(tmp_path):
    """A train worker is ended by Ray, not by a normal exit: the W&B run it logged (an image too) leaves nothing
    in the system's temp folder (its media and artifacts folders and its service's socket once stayed there)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    worker = (
        "import os, sys; from PIL import Image; from dreambooth.training import trackers\n"
        "for folder in sys.argv[1:]:\n"  # (two runs in one process: the second gets staging folders again)
        "    t = trackers.WandB(folder, 'p', 'r', {'a': 1})\n"
        "    t.scalars(1, {'train/loss': 1.0}); t.images(1, {'validation/x': Image.new('RGB', (8, 8))}); t.close()\n"
        "os._exit(0)\n")
    env = dict(os.environ, TMPDIR=str(temp), WANDB_MODE="offline", PYTHONPATH=files.REPO_DIR)
    runs = [tmp_path / "run", tmp_path / "run-2"]
    subprocess.run([sys.executable, "-c", worker, *map(str, runs)], env=env, check=True, timeout=120,
                   capture_output=True)
    time.sleep(1)  # (the service process's own exit)
    assert os.listdir(temp) == []
    for run in runs:  # nothing of W&B's staging left in the run folders either (folders only its owner opens)
        assert os.listdir(run) == ["wandb"]
        assert modes_not_as_umask(str(run)) == []
        assert wandb_records(str(run))["history"][0]["train/loss"] == 1.0


def test_a_run_that_fails_tells_the_webhook_its_cause(tiny_model, tmp_path, webhook):
    from dreambooth.commands import train

    missing = tmp_path / "no-photos-here"
    with pytest.raises(errors.UserError) as raised:
        train.main(["--model_dir", tiny_model, "--output_dir", str(tmp_path / "out"), "--instance_data_dir",
                    str(missing), "--instance_prompt", "photo of unqtkn toy", "--notify_url", webhook.url])
    [(_, body)] = webhook.received
    assert body["event"] == "failed" and body["cause"] == str(raised.value) and str(missing) in body["cause"]
    assert body["text"].startswith(f"DreamBooth training of {tmp_path / 'out'} failed: ")


def mlflow_run(uri, run_id):
    import mlflow

    client = mlflow.MlflowClient(uri)
    return client, client.get_run(run_id)


def test_wandb_and_mlflow_runs_get_the_settings_metrics_images_and_later_the_scores(tmp_path, monkeypatch, capsys):
    from PIL import Image

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI", "XDG_CONFIG_HOME", "MLFLOW_DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)
    settings = "model_dir = \"/m\"\nvalidation_prompt = [\"a, b\", \"c\"]\nlearning_rate = 5e-06\n"
    plan = planning.offline_plan(report_to="all", storage_path=str(tmp_path / "results"), run_name="subject-1",
                                 settings_toml=settings)
    folder = os.path.join(plan.storage_path, plan.run_name)
    os.makedirs(folder)
    opened = trackers.open_trackers(plan, folder)
    for step in (2, 4):
        for tracker in opened.values():
            tracker.scalars(step, {"train/loss": 0.1 * step, "train/lr": 5e-6})
    for tracker in opened.values():
        tracker.images(4, {"validation/dog-0": Image.new("RGB", (8, 8), "red")})
        tracker.close()
    record = runfiles.read_record(folder)
    assert set(record) == {"wandb", "mlflow"}
    uri = record["mlflow"]["tracking_uri"]  # where the MLflow run is, said (the README once named only mlruns/)
    err = capsys.readouterr().err
    assert f"MLflow run {record['mlflow']['run_id']} of experiment 'dreambooth' in {uri} (to browse it: mlflow ui " \
           f"--backend-store-uri {uri})" in err
    events = os.path.join(folder, "tensorboard")  # (and where TensorBoard's events are, said too)
    assert f"TensorBoard events in {events} (to browse them: tensorboard --logdir {events})" in err
    # A resumed run (another run folder, continuing this one's checkpoint) goes on in the same runs.
    resumed = planning.offline_plan(report_to="all", storage_path=plan.storage_path, run_name="subject-2",
                                    settings_toml=settings, resume_path=os.path.join(folder, "checkpoint_000001"))
    os.makedirs(os.path.join(plan.storage_path, "subject-2"))
    from dreambooth.training import runlog

    log = runlog.RunLog(resumed, start_step=4)
    log.write({"step": 6, "loss": 0.6, "lr": 4e-6, "images_per_s": 3.0})
    log.write_scores(4, {"dino": 0.25, "clip_i": 0.5, "clip_t": 0.125})  # (--score_steps: step 4's, arriving later)
    log.close()
    again = runfiles.read_record(os.path.join(plan.storage_path, "subject-2"))
    assert (again["wandb"]["id"], again["mlflow"]) == (record["wandb"]["id"], record["mlflow"])
    trackers.log_scores(record, 6, {"dino": 0.5, "clip_i": 0.75, "div": None}, "the tuned model")

    seen = wandb_records(folder)
    assert seen["ids"] == {record["wandb"]["id"]}
    assert seen["config"]["validation_prompt"] == "a, b, c" and seen["config"]["learning_rate"] == 5e-6
    losses = [(h["_step"], h["train/loss"]) for h in seen["history"] if "train/loss" in h]
    assert losses == [(2, pytest.approx(0.2)), (4, pytest.approx(0.4))]
    assert any(h.get("validation/dog-0/_type") == "image-file" and h["_step"] == 4 for h in seen["history"])
    later = wandb_records(os.path.join(plan.storage_path, "subject-2"))["history"]
    assert later[0]["train/loss"] == 0.6
    assert [(h["scores/step"], h["scores/dino"]) for h in later if "scores/dino" in h] == [(4, 0.25)]
    assert seen["summary"]["eval/dino"] == 0.5 and "eval/div" not in seen["summary"]

    client, run = mlflow_run(trackers.mlflow_uri(plan.storage_path), record["mlflow"]["run_id"])
    assert record["mlflow"]["tracking_uri"] == f"sqlite:///{plan.storage_path}/mlflow.db"
    assert run.info.run_name == "subject-1" and run.data.params["validation_prompt"] == "a, b, c"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        (2, pytest.approx(0.2)), (4, pytest.approx(0.4)), (6, pytest.approx(0.6))]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "scores/dino")] == [(4, 0.25)]
    assert run.data.metrics["eval/clip_i"] == 0.75 and run.info.status == "FINISHED"
    assert client.list_artifacts(run.info.run_id, "images")
    assert client.get_experiment(run.info.experiment_id).name == "dreambooth"  # (no flag, no MLFLOW_EXPERIMENT_NAME)
    assert seen["project"] == "dreambooth"
    assert not (tmp_path / ".config" / "mlflow").exists()  # no telemetry file in the user's home


def test_the_trackers_own_variables_win_over_our_defaults_and_reach_the_workers(tmp_path, monkeypatch):
    """WANDB_DIR, WANDB_PROJECT and MLFLOW_EXPERIMENT_NAME, as W&B's and MLflow's users set them: the offline W&B run
    is in WANDB_DIR under WANDB_PROJECT, the MLflow run in MLFLOW_TRACKING_URI's store under MLFLOW_EXPERIMENT_NAME;
    --tracker_project_name, given, wins over both. Every one of them travels to the workers with the job (a
    cluster started from another shell does not have the script's environment)."""
    from dreambooth.cluster import raycluster

    monkeypatch.setenv("HOME", str(tmp_path))
    variables = dict(WANDB_DIR=str(tmp_path / "wandb-here"), WANDB_PROJECT="pets", MLFLOW_EXPERIMENT_NAME="rex",
                     MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'elsewhere.db'}")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    for given, wandb_project, experiment in ((None, "pets", "rex"), ("mine", "mine", "mine")):
        plan = planning.offline_plan(report_to="all", storage_path=str(tmp_path / "results"),
                                     run_name=f"run-{given}", tracker_project_name=given)
        folder = os.path.join(plan.storage_path, plan.run_name)
        os.makedirs(folder)
        opened = trackers.open_trackers(plan, folder)
        for tracker in opened.values():
            tracker.scalars(1, {"train/loss": 0.5})
            tracker.close()
        record = runfiles.read_record(folder)  # (and TensorBoard's events in the run folder, as before)
        assert record["wandb"]["dir"] == variables["WANDB_DIR"] and not os.path.exists(os.path.join(folder, "wandb"))
        seen = wandb_records(variables["WANDB_DIR"], record["wandb"]["id"])
        assert seen["project"] == wandb_project and seen["history"][0]["train/loss"] == 0.5
        client, run = mlflow_run(variables["MLFLOW_TRACKING_URI"], record["mlflow"]["run_id"])
        assert client.get_experiment(run.info.experiment_id).name == experiment
    for name, value in (("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2"), ("RAY_DATA_LOG_LEVEL", "WARNING"),
                        ("RAY_USAGE_STATS_ENABLED", "0"),
                        ("RAY_DATA_AUTOSCALING_REQUEST_EXPIRE_TIME_S", "30")):  # (init_ray sets them before the job's)
        monkeypatch.setenv(name, value)
    env_vars = raycluster.job_runtime_env()["env_vars"]
    assert all(env_vars[name] == value for name, value in variables.items())



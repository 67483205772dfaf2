"""Sweeps on Ray Tune, one test a path: two subjects in a bucket on two nodes, each step count scored and each
subject's best kept; early stopping (ASHA stopping the trial behind); a failed trial listed and resumed from its
checkpoint by the same command. None depends on the family it runs (SD 3.5's, Flux.1's tiny models: flow matching and
T5 both); each family's LoRA loading in its pipeline is tests/unit/test_family_contract.py's."""

import csv
import io
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
from support import run_script
from support import write_subject

from dreambooth import files
from dreambooth.commands import sweep
from dreambooth.files import REPO_DIR


@pytest.fixture()
def two_subjects(tiny_model, tiny_eval_models, toy_images, tmp_path):
    """(sweep.py's command for two subjects of one class, LoRA, the tiny models; the sweep folder)."""
    eval_models = tiny_eval_models[1]
    photos = [os.path.join(toy_images, n) for n in sorted(os.listdir(toy_images))]
    write_subject(tmp_path / "s" / "red", photos[:3], {"class_name": "toy"})
    write_subject(tmp_path / "s" / "blue", photos[3:], {"class_name": "toy", "unique_token": "zwx"})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a {subject} on a beach\na {subject} in the snow\n")
    # The class's images are already there (drawing them is train.py's --num_class_images, tested in
    # test_train): the sweep tops the folder up to --num_class_images, here nothing to draw.
    class_dir = tmp_path / "best-sweep" / "class-images" / "toy"
    os.makedirs(class_dir)
    for image in photos[:3]:
        shutil.copy(image, class_dir)
    command = [sys.executable, "sweep.py", "--model_dir", tiny_model, "--output_dir", str(tmp_path / "best"),
               "--subjects_dir", str(tmp_path / "s"), "--eval_models_dir", eval_models, "--eval_prompts",
               str(prompts), "--eval_images_per_prompt", "2", "--num_inference_steps", "2", "--num_class_images", "3",
               "--sweep_learning_rate", "1e-3", "--num_workers", "1", "--use_lora"]
    return command, tmp_path / "best-sweep"


def image_change_of_adapters(pipeline, model, adapters):
    """The largest pixel change that the LoRA adapters in folder adapters make to a seeded 64 px image of
    model, drawn by diffusers' pipeline class of that name (FluxPipeline, ...)."""
    import diffusers
    import torch

    pipe = getattr(diffusers, pipeline).from_pretrained(model)
    draw = dict(prompt="a toy", num_inference_steps=2, height=64, width=64, output_type="np")
    before = pipe(**draw, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(adapters)
    after = pipe(**draw, generator=torch.Generator().manual_seed(0)).images
    return abs(after - before).max()


def run_sweep(command, log_path, kill_after_first_scores=False, env=None):
    """(output, rows of trials.csv) of a sweep.py run that must succeed; optionally SIGKILLs the
    first trial's train worker once its first step count is scored (while it trains on). The sweep folder may be a
    bucket's."""
    import glob
    import time

    from test_recovery import worker_pids

    sweep_dir = command[command.index("--output_dir") + 1] + "-sweep"
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO_DIR, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        while kill_after_first_scores and proc.poll() is None:
            if glob.glob(os.path.join(sweep_dir, "trials", "*", "ray_results", "*", "scores", "step-*", "scores.json")):
                os.kill(worker_pids(started)[0], signal.SIGKILL)
                break
            time.sleep(0.1)
        proc.wait(timeout=900)
    output = open(log_path).read()
    assert proc.returncode == 0, output[-3000:]
    return output, trials_table(sweep_dir)


def trials_table(sweep_dir):
    """The rows of a sweep's trials.csv (a folder's or a bucket's)."""
    from dreambooth import storage

    return list(csv.DictReader(io.StringIO(storage.read_bytes(storage.join(sweep_dir, "trials.csv")).decode())))


def test_random_lora_sweep_of_two_subjects_in_a_bucket_on_two_nodes_scores_each_step_count_and_keeps_each_best(
        two_subjects, tiny_sd3_model, tmp_path, request):
    """A 2-trial sweep that is also a many-subjects job, offline on CPU, of the tiny SD 3.5 model (flow matching,
    T5): two subjects of one class (one class folder), LoRA, a learning rate drawn log-uniformly for each
    subject's trial, two step counts scored per trial (the smaller one from an intermediate checkpoint). The
    subjects, the class images, the scoring models, the sweep folder and the best models are in a bucket (moto's
    S3 server), on the 2-node cluster whose second node cannot see the first node's copies of the bucket's files:
    nothing is written on this node's disk but those copies. Each subject's best adapters load in
    StableDiffusion3Pipeline, where they change the image."""
    from dreambooth import storage

    command, sweep_dir = two_subjects
    address, unshared = request.getfixturevalue("two_node_cluster")
    bucket_env, bucket = request.getfixturevalue("s3_endpoint")
    root = f"s3://{bucket}/sweep"
    storage.replace_folder(str(tmp_path / "s"), f"{root}/s", last=None)
    storage.replace_folder(str(sweep_dir), f"{root}/best-sweep", last=None)  # (the class images already drawn)
    shutil.rmtree(sweep_dir)
    sweep_dir = f"{root}/best-sweep"
    cache = (unshared or tmp_path) / "cache-sweep"  # (removed at the end: the cluster's other tests use unshared)
    request.addfinalizer(lambda: shutil.rmtree(cache, ignore_errors=True))
    env = {**os.environ, **bucket_env, "RAY_ADDRESS": address, "XDG_CACHE_HOME": str(cache)}
    command = [c for c in command if c not in ("--sweep_learning_rate", "1e-3")]
    command[command.index("--model_dir") + 1] = tiny_model = tiny_sd3_model
    command[command.index("--subjects_dir") + 1] = f"{root}/s"
    command[command.index("--output_dir") + 1] = f"{root}/best"
    eval_models = command[command.index("--eval_models_dir") + 1]  # (the scoring models in the bucket too)
    storage.replace_folder(eval_models, f"{root}/eval-models", last=None)
    command[command.index("--eval_models_dir") + 1] = f"{root}/eval-models"
    command += ["--sweep_max_train_steps", "2,4", "--search", "random", "--num_trials", "1",
                "--sweep_learning_rate", "1e-4,1e-3", "--holdout", "1",
                "--early_stopping", "off"]  # (trained once each: staged training and ASHA are the next test's)
    output, table = run_sweep(command, tmp_path / "log.txt", env=env)
    assert sorted((r["subject"], r["step"], r["status"], r["rank"]) for r in table) == [
        ("blue", "2", "ok", "4"), ("blue", "4", "ok", "4"), ("red", "2", "ok", "4"), ("red", "4", "ok", "4")]
    assert all(1e-4 <= float(r["learning_rate"]) <= 1e-3 for r in table)
    assert all(r["model"].startswith(f"{sweep_dir}/trials/") for r in table)
    assert len(storage.listdir(f"{sweep_dir}/trials")) == 2
    assert output.count("base model on") == 2 and output.count("base: 0 of") == 1  # both subjects in one pass
    assert "4 model(s) scored (a trial's at each step count), 0 failed trial(s)" in output  # 2 trials, 2 counts
    assert storage.listdir(f"{sweep_dir}/class-images") == ["toy"]  # one class folder for both subjects
    assert output.count("3 class images of your own count toward --num_class_images 3") == 1
    assert "class images of 'photo of a toy': " not in output  # nothing to draw
    for subject, token in (("red", "unqtkn"), ("blue", "zwx")):
        chosen = [r for r in table if r["subject"] == subject and r["chosen"] == "True"]
        assert len(chosen) == 1
        best = f"{root}/best/{subject}"
        marker = storage.read_json(f"{best}/{files.OUTPUT_MARKER}")
        assert marker["steps"] == int(chosen[0]["step"]) and marker["base_model"] == tiny_model
        assert marker["instance_prompt"] == f"photo of {token} toy" and marker["lora"]["rank"] == 4
        # --holdout 1: each subject's last photo kept out of every trial, and scored against apart
        assert marker["held_out"] == [sorted(n for n in os.listdir(tmp_path / "s" / subject) if n.endswith(".jpg"))[-1]]
        assert all(0 < float(r["dino_holdout"]) <= 1 for r in table if r["subject"] == subject)
        assert storage.isfile(f"{best}/{files.LORA_WEIGHTS_FILE}")
        assert storage.isfile(f"{sweep_dir}/base/{subject}/report.md")
    report = storage.read_bytes(f"{sweep_dir}/report.md").decode()
    assert "| red | base |" in report and "| blue | chosen |" in report
    assert storage.isfile(f"{sweep_dir}/sweep.png")
    assert image_change_of_adapters("StableDiffusion3Pipeline", tiny_model, storage.cached(f"{root}/best/red")) > 1e-4
    # the trials' checkpoints removed (every step count is a model), in the bucket too
    runs = [f"{sweep_dir}/trials/{t}/ray_results/{r}" for t in storage.listdir(f"{sweep_dir}/trials")
            for r in storage.listdir(f"{sweep_dir}/trials/{t}/ray_results")]
    assert len(runs) == 2 and not [n for r in runs for n in storage.listdir(r)
                                   if n.startswith("checkpoint_") and storage.isdir(f"{r}/{n}")]
    # on 2 nodes each step count was drawn and embedded on actor pools, which go where there is room (its model in the
    # bucket, which any node reads)
    for run in runs:
        log = storage.read_bytes(f"{run}/scores/step-2/scoring.log").decode()
        assert "generating on 1 actor(s)" in log and re.search(r"scoring \d+ images on 1 actor\(s\)", log), log
    assert not os.path.exists(tmp_path / "best-sweep") and not os.path.exists(tmp_path / "best")
    # the same command again: Tune's state restored from the bucket, nothing trained or scored again
    again_output, again_table = run_sweep(command, tmp_path / "log-2.txt", env=env)
    assert f"resuming the sweep in {sweep_dir}/tune" in again_output and "base model on" not in again_output
    assert "plan: " not in again_output and again_table == table
    # the settings it printed repeat it from the bucket
    assert f"sweep.py --config {sweep_dir}/sweep_config.toml repeats this sweep" in output
    again, _, _ = sweep.parse_args(["--config", f"{sweep_dir}/sweep_config.toml"])
    assert (again.sweep_dir, again.subjects_dir, again.sweep_learning_rate, again.eval_models_dir) == (
        sweep_dir, f"{root}/s", [1e-4, 1e-3], f"{root}/eval-models")  # (the bucket's paths, not this node's copies)


def test_a_flux_lora_sweep_stops_the_trial_behind_early_and_its_best_adapters_load_in_fluxpipeline(
        tiny_flux_model, toy_images, tiny_eval_models, tmp_path):
    """The sweep on the tiny Flux.1 dev model (flow matching, T5): one subject, two learning rates one after the
    other with --early_stopping on: each trial trains once, scored at steps 1 and 2 while it trains, and Tune hears
    step 1's scores as they arrive: a trial whose score there is under the first trial's is stopped (ASHA, halving
    at step 1). The seeded tiny models make the second trial the one behind; the table and the output say where it
    stopped. The best LoRA is kept with its record, loadable in FluxPipeline, where it changes the image. (SD 3.5's
    sweep: the 2-node sweep above.)"""
    model = tiny_flux_model
    class_dir = tmp_path / "best-sweep" / "class-images" / "toy"  # (drawn already: generate's own tests draw)
    write_subject(class_dir, [os.path.join(toy_images, n) for n in sorted(os.listdir(toy_images))[:2]], None)
    (tmp_path / "prompts.txt").write_text("a {subject} on a beach\n")
    run = run_script([sys.executable, "sweep.py", "--model_dir", model, "--output_dir", str(tmp_path / "best"),
                      "--instance_data_dir", toy_images, "--class_name", "toy", "--eval_models_dir", tiny_eval_models[1],
                      "--eval_prompts", str(tmp_path / "prompts.txt"), "--eval_images_per_prompt", "2",
                      "--num_inference_steps", "2", "--num_class_images", "2", "--sweep_max_train_steps", "1,2",
                      "--num_workers", "1", "--use_lora", "--sweep_learning_rate", "1e-5,1e-3", "--early_stopping", "on",
                      "--max_concurrent_trials", "1"], tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    table = trials_table(str(tmp_path / "best-sweep"))
    assert all(0 < float(r["dino"]) <= 1 and 0 < float(r["clip_i"]) <= 1 for r in table)
    trials = {}
    for r in table:
        trials.setdefault(r["learning_rate"], []).append((int(r["step"]), float(r["dino"]), r["note"], r["status"]))
    first, second = (sorted(rows) for rows in sorted(trials.values(), key=len, reverse=True))
    assert [(s, status) for s, _, _, status in first] == [(1, "ok"), (2, "ok")], output[-2000:]
    assert "trials behind at a step count stop there (ASHA)" in output
    # one training run a trial (it was one a step count), each scoring both step counts while it trains
    assert output.count(") plan: 2 steps") == 2 and output.count("scored at steps 1, 2 (DINO, CLIP-I, CLIP-T)") == 2
    assert [s for s, _, _, _ in second] == [1], output[-2000:]
    assert second[0][2] == "stopped early at step 1 (behind the others there)" and "stopped early at step 1" in output
    assert second[0][1] <= first[0][1]  # behind at step 1 (the same CLIP-T floor and base: DINO decides)
    assert "stopped early at step 1" in (tmp_path / "best-sweep" / "trials.md").read_text()
    [chosen] = [r for r in table if r["chosen"] == "True"]
    marker = files.read_json(str(tmp_path / "best" / files.OUTPUT_MARKER))
    assert marker["steps"] == int(chosen["step"]) and marker["base_model"] == model
    # (the best is the 1e-5 trial's first step: a smaller change, yet adapters loaded as zeros change nothing)
    assert image_change_of_adapters("FluxPipeline", model, str(tmp_path / "best")) > 1e-6


@pytest.mark.long
def test_a_failed_trial_is_listed_and_the_rerun_resumes_it_from_its_checkpoint(two_subjects, tmp_path):
    """(About 5 minutes: outside the default run; pytest -m long.) The first trial's train worker is
    killed once its first step count is scored, while it trains on (no restarts): the sweep goes on, lists the
    trial as failed (with the step count it scored) and keeps the other subject's best. The same command again
    restores Tune's state: the failed trial resumes from its newest checkpoint (its first step count's scores
    kept), the finished one is kept as it was."""
    command, sweep_dir = two_subjects
    command += ["--sweep_max_train_steps", "4,200", "--max_failures", "0"]  # (200: still training when 4 is scored)
    output, table = run_sweep(command, tmp_path / "log-1.txt", kill_after_first_scores=True)
    failed = [r for r in table if r["status"] != "ok"]
    assert len(failed) == 1 and failed[0]["status"].startswith("failed: ") and "1 failed trial(s)" in output
    cut = failed[0]["subject"]
    done = next(s for s in ("red", "blue") if s != cut)
    assert sorted((r["subject"], r["step"]) for r in table if r["status"] == "ok") == sorted(
        [(done, "200"), (done, "4"), (cut, "4")])
    # (the cut trial's scored step count is a candidate too: its subject has a best already)
    assert sorted(os.listdir(tmp_path / "best")) == ["blue", "red"]
    assert files.read_json(str(tmp_path / "best" / cut / files.OUTPUT_MARKER))["steps"] == 4
    weights = [os.path.join(root, n) for root, _, names in os.walk(sweep_dir / "trials") for n in names
               if n.endswith(".safetensors") and f"{os.sep}{done}-" in root]
    before = {w: os.stat(w).st_mtime_ns for w in weights}

    output, table = run_sweep(command, tmp_path / "log-2.txt")
    assert "resuming the sweep" in output and "base model on" not in output  # base scores read back
    assert "resuming from" in output  # the failed trial continues from its checkpoint
    assert output.count(") plan: ") == 1  # (the finished trial is not trained again)
    assert {w: os.stat(w).st_mtime_ns for w in weights} == before  # the finished trial is kept as it was
    assert sorted((r["subject"], r["step"], r["status"]) for r in table) == [
        ("blue", "200", "ok"), ("blue", "4", "ok"), ("red", "200", "ok"), ("red", "4", "ok")]
    assert sorted(os.listdir(tmp_path / "best")) == ["blue", "red"]



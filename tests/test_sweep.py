import csv
import io
import os
import re
import shutil
import signal
import subprocess
import sys

import beside
import pytest

from dreambooth import errors
from dreambooth import files
from dreambooth.commands import sweep
from dreambooth.files import REPO_DIR
from dreambooth.generation import imagefiles
from dreambooth.sweep import sweep_rows
from dreambooth.sweep import sweep_trial


def base_argv(model, tmp_path):
    return ["--model_dir", model, "--output_dir", str(tmp_path / "best"), "--eval_models_dir", str(tmp_path / "e")]


def test_one_subject_or_many_and_flags_the_sweep_sets_are_refused(tiny_model, toy_images, tmp_path, capsys):
    argv = base_argv(tiny_model, tmp_path)
    for extra, message in (([], "give --instance_data_dir .* or --subjects_dir"),
                           (["--instance_data_dir", toy_images], "needs --class_name"),
                           (["--subjects_dir", str(tmp_path), "--instance_data_dir", toy_images], "give --instance"),
                           (["--subjects_dir", str(tmp_path), "--lr=1e-4"], "--lr=1e-4 is set by the sweep"),
                           (["--subjects_dir", str(tmp_path), "--score_steps", "2"], "--score_steps is set by the sweep"),
                           (["--subjects_dir", str(tmp_path), "--sweep_rank", "4,8"], "--sweep_rank needs --use_lora"),
                           (["--subjects_dir", str(tmp_path), "--num_workrs", "2"], "unrecognized.*--num_workrs"),
                           (["--subjects_dir", str(tmp_path), "--search", "random", "--sweep_learning_rate",
                             "1e-6,1e-5,1e-4"], "is a range: LOW,HIGH")):
        with pytest.raises(SystemExit):
            sweep.parse_args(argv + extra)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(message, err), (message, err)
    args, train_flags, train_args = sweep.parse_args(argv + ["--subjects_dir", str(tmp_path), "--use_lora",
                                                             "--sweep_rank", "8,4,8", "--num_workers", "2"])
    assert args.sweep_rank == [8, 4] and train_flags == ["--num_workers", "1", "--use_lora", "--num_workers", "2"]
    assert train_args.num_workers == 2 and args.sweep_dir == str(tmp_path / "best") + "-sweep"
    assert args.sweep_max_train_steps == [400]


def write_subject(folder, images, info):
    os.makedirs(folder)
    for image in images:
        shutil.copy(image, folder)
    if info is not None:
        files.write_json(os.path.join(folder, imagefiles.SUBJECT_FILE), info)


def test_subjects_come_from_their_folders_with_the_flags_as_defaults(tiny_model, toy_images, tmp_path):
    photos = [os.path.join(toy_images, n) for n in sorted(os.listdir(toy_images))]
    write_subject(tmp_path / "s" / "rex", photos[:2], {"class_name": "dog", "subject_type": "live"})
    write_subject(tmp_path / "s" / "mug", photos[2:], {"class_name": "cup", "unique_token": "zwx"})
    args, _, _ = sweep.parse_args(base_argv(tiny_model, tmp_path) + ["--subjects_dir", str(tmp_path / "s"),
                                                                      "--unique_token", "sks"])
    subjects = sweep.read_subjects(args)
    assert list(subjects) == ["mug", "rex"]
    assert (subjects["rex"].unique_token, subjects["rex"].class_name, subjects["rex"].subject_type) == ("sks", "dog", "live")
    assert (subjects["mug"].unique_token, subjects["mug"].subject_type) == ("zwx", "object")
    assert len(subjects["mug"].photos()) == 3 and "a zwx cup made of glass" in subjects["mug"].prompts()

    write_subject(tmp_path / "s" / "cat", photos[:1], None)
    with pytest.raises(errors.UserError, match="cat has no subject.json"):
        sweep.read_subjects(args)
    files.write_json(tmp_path / "s" / "cat" / imagefiles.SUBJECT_FILE, {"unique_token": "x"})
    with pytest.raises(errors.UserError, match="cat/subject.json: needs a JSON object with \"class_name\""):
        sweep.read_subjects(args)


def test_the_sweep_estimates_its_disk_and_refuses_what_does_not_fit(tiny_model, toy_images, tmp_path):
    """Before any trial: the checkpoints of the trials at once (every step count's kept until scored, and
    the next one written) and a model per trial and step count, from the model's own weight files."""
    from dreambooth.planning import disk

    args, _, train_args = sweep.parse_args(base_argv(tiny_model, tmp_path) + [
        "--instance_data_dir", toy_images, "--class_name", "toy", "--sweep_max_train_steps", "2,4"])
    per_checkpoint, per_model = disk.disk_bytes(tiny_model, False, True)
    unet = sum(os.path.getsize(os.path.join(tiny_model, "unet", n)) for n in os.listdir(os.path.join(tiny_model, "unet"))
               if n.endswith(".safetensors"))
    assert per_checkpoint > 3 * unet and per_model > unet  # fp32 weights and AdamW's two moments; every network
    said = sweep.check_disk(args, train_args, num_trials=4, concurrency=1)
    assert said == (f"about {files.size_text(1 * 3 * per_checkpoint + 4 * 2 * per_model)} of disk (4 trial(s) x 2 "
                    f"step count(s) x a model of {files.size_text(per_model)}, and the checkpoints of 1 trial(s) at "
                    f"once, {files.size_text(per_checkpoint)} each)")
    with pytest.raises(errors.UserError, match=r"the sweep needs about .* under --sweep_dir .* is free there: fewer "
                                              r"trials or step counts, --use_lora, or a --sweep_dir on a larger disk"):
        sweep.check_disk(args, train_args, num_trials=10 ** 7, concurrency=1)


@pytest.mark.parametrize("arch", ["sd1", "flux2"])
def test_a_lora_sweeps_disk_is_counted_from_its_adapters_as_peft_makes_them(arch, request, toy_images, tmp_path):
    """A LoRA sweep's estimate is its adapters' (at the largest rank swept), not a fixed size: the parameters counted
    from the weight files' headers are those peft adds to the trained networks (SD 1.x: the UNet's and the text
    encoder's layers by name; FLUX.2 [klein]: the transformer's by its regular expression)."""
    from diffusers import DiffusionPipeline

    from dreambooth import families
    from dreambooth.models import networks
    from dreambooth.planning import disk

    model = request.getfixturevalue("tiny_model" if arch == "sd1" else f"tiny_{arch}_model")
    family = families.family_of(model)
    trained = disk.trained_networks(family, files.safetensors_params(model), True)
    pipe = DiffusionPipeline.from_pretrained(model)
    plan = type("Plan", (), dict(lora_rank=8, lora_alpha=8, lora_dropout=0.0, adapter="lora"))
    added = 0
    for name in trained:
        net = getattr(pipe, name)
        before = sum(p.numel() for p in net.parameters())
        targets = family.denoiser_lora_targets if name == family.denoiser else networks.TEXT_ENCODER_LORA_TARGETS
        net.add_adapter(networks.lora_config(plan, targets))
        added += sum(p.numel() for p in net.parameters()) - before
    assert added > 0 and disk.adapter_params(model, family, trained, 8) == added
    argv = base_argv(model, tmp_path) + ["--instance_data_dir", toy_images, "--class_name", "toy", "--use_lora",
                                         "--sweep_rank", "4,8", "--sweep_max_train_steps", "2,4"]
    args, _, train_args = sweep.parse_args(argv)
    said = sweep.check_disk(args, train_args, num_trials=2, concurrency=1)
    assert f"a model of {files.size_text(4 * added + disk.ADAPTER_FILE_BYTES)}" in said, said


def test_a_trial_is_the_base_flags_with_its_own_set_and_the_rest_worked_out_again(tiny_model, toy_images, tmp_path):
    """No argv per trial: the sweep's base as parsed once, the trial's settings set on it, then derived
    (LoRA's alpha from the trial's rank, not the base's); the base is never changed."""
    import argparse

    from dreambooth.evaluation import scoring
    from dreambooth.planning import planning

    args, train_flags, _ = sweep.parse_args(base_argv(tiny_model, tmp_path) + [
        "--instance_data_dir", toy_images, "--class_name", "toy", "--use_lora", "--sweep_rank", "4,16",
        "--sweep_max_train_steps", "2,6"])
    parser, given = planning.parse_given(sweep.trial_base_argv(args, train_flags))
    before = argparse.Namespace(**vars(given))
    settings = scoring.EvalSettings("/eval-models", num_samples_per_prompt=3, num_inference_steps=7, guidance_scale=5.5)
    base = {"dino": 0.5, "clip_i": 0.6, "clip_t": 0.3, "pres": 0.1, "div": None}
    job = sweep_trial.SweepJob({}, str(tmp_path / "sweep"), (2, 6), {"toy": "/classes"}, given, frozenset(parser.given),
                               frozenset(parser.typed), tiny_model, settings, base={"rex": base})
    subject = scoring.Subject("rex", toy_images, "sks", "toy", "object", "/prompts.txt")
    config = {"subject": "rex", "learning_rate": 3e-4, "rank": 16, "use_lora": True, "train_text_encoder": False}
    trial = sweep_trial.trial_args(job, config, subject, str(tmp_path / "trial"))
    assert (trial.lora_rank, trial.lora_alpha, trial.learning_rate, trial.train_text_encoder) == (16, 16.0, 3e-4, False)
    assert (trial.max_train_steps, trial.checkpointing_steps, trial.checkpoints_total_limit) == (6, 2, 3)
    assert trial.storage_path == str(tmp_path / "trial" / "ray_results") and trial.num_workers == 1
    assert trial.instance_prompt == "photo of sks toy" and trial.class_data_dir == "/classes"
    assert "lora_rank = 16" in trial.settings_toml and "# lora_alpha = 16.0" in trial.settings_toml
    assert vars(given) == vars(before)
    # Scored while it trains, at each step count (never skipped), as the sweep scored the base model, whose scores it
    # is given; each step count but the last keeps its model in the trial's folder
    assert (trial.score_steps, trial.score_at, trial.step_models, trial.base_scores) == (2, (2, 6), str(tmp_path / "trial"),
                                                                                       base)
    assert (trial.eval_models_dir, trial.class_name, trial.unique_token, trial.subject_type, trial.eval_prompts) == (
        "/eval-models", "toy", "sks", "object", "/prompts.txt")
    assert (trial.eval_images_per_prompt, trial.validation_inference_steps, trial.guidance_scale) == (3, 7, 5.5)
    plan = planning.offline_plan(score_steps=2, score_at=trial.score_at)
    assert [step for step in range(1, 7) if plan.is_score_step(step)] == [2, 6] and "scored at steps 2, 6" in plan.describe()


def test_a_sweep_without_class_images_gives_each_trial_its_class_prompt_and_draws_none(tiny_model, toy_images,
                                                                                       tmp_path, capsys):
    """--prior_preservation prior_prediction (no class images: the base model's own predictions keep the prior) is
    a flag for every trial: the sweep accepts it without the --class_prompt it sets itself (it once refused it, then
    refused the --class_prompt it asked for), draws no class images, and each trial gets 'photo of a <class>' and no
    class folder."""
    from dreambooth.evaluation import scoring
    from dreambooth.planning import planning

    args, train_flags, train_args = sweep.parse_args(base_argv(tiny_model, tmp_path) + [
        "--instance_data_dir", toy_images, "--class_name", "toy", "--use_lora", "--prior_preservation",
        "prior_prediction", "--sweep_max_train_steps", "2"])
    assert train_args.prior_prediction and not train_args.class_data_dir
    with pytest.raises(SystemExit):  # (class images it would not draw: refused, as train.py refuses them)
        sweep.parse_args(base_argv(tiny_model, tmp_path) + ["--instance_data_dir", toy_images, "--class_name", "toy",
                                                            "--prior_preservation", "prior_prediction",
                                                            "--num_class_images", "50"])
    assert "--num_class_images: --prior_preservation prior_prediction trains without class images" in \
        capsys.readouterr().err
    subject = scoring.Subject("rex", toy_images, "sks", "toy", "object", "/prompts.txt")
    assert sweep.prepare_class_images(args, {"rex": subject}, train_args) == {}  # (nothing drawn: no Ray here)
    parser, given = planning.parse_given(sweep.trial_base_argv(args, train_flags))
    settings = scoring.EvalSettings("/eval-models")
    job = sweep_trial.SweepJob({}, str(tmp_path / "sweep"), (2,), {}, given, frozenset(parser.given),
                               frozenset(parser.typed), tiny_model, settings, base={})
    config = {"subject": "rex", "learning_rate": 3e-4, "rank": 4, "use_lora": True, "train_text_encoder": False}
    trial = sweep_trial.trial_args(job, config, subject, str(tmp_path / "trial"))
    assert (trial.prior_prediction, trial.class_prompt, trial.class_data_dir) == (True, "photo of a toy", None)
    assert not trial.with_prior_preservation and 'class_prompt = "photo of a toy"' in trial.settings_toml


def test_trials_at_once_leave_a_gpu_for_their_scoring(monkeypatch):
    """A step count is scored while its trial trains on: the sweep runs as many trials at once as the cluster's GPUs
    hold with one left for the scoring, one on one GPU (its scoring waits for the training's end) and on CPUs."""
    import argparse

    from dreambooth.cluster import raycluster

    args = argparse.Namespace(max_concurrent_trials=None)
    for gpus, workers, expected in ((0, 1, 1), (1, 1, 1), (2, 1, 1), (8, 1, 7), (8, 2, 3), (9, 2, 4)):
        monkeypatch.setattr(raycluster, "cluster_resources", lambda gpus=gpus: (16, gpus))
        trials = argparse.Namespace(num_workers=workers, gpus_per_worker=1)
        assert sweep.max_concurrent(args, trials) == expected, (gpus, workers)
    assert sweep.max_concurrent(argparse.Namespace(max_concurrent_trials=5), trials) == 5  # (given: as given)


def test_search_space_is_a_grid_of_every_value_or_random_draws_with_a_log_uniform_learning_rate(
        tiny_model, tmp_path):
    from ray import tune

    argv = base_argv(tiny_model, tmp_path) + ["--subjects_dir", str(tmp_path), "--use_lora", "--sweep_rank", "4,8",
                                              "--sweep_learning_rate", "1e-5,1e-4"]
    subjects = {"rex": None, "mug": None}
    args, _, train_args = sweep.parse_args(argv + ["--sweep_train_text_encoder", "off"])
    space = sweep.param_space(args, subjects, train_args)
    assert space["learning_rate"] == tune.grid_search([1e-5, 1e-4]) and space["rank"] == tune.grid_search([4, 8])
    assert space["train_text_encoder"] is False and space["use_lora"] is True
    assert space["subject"] == tune.grid_search(["rex", "mug"])
    args, _, train_args = sweep.parse_args(argv + ["--search", "random"])
    space = sweep.param_space(args, subjects, train_args)
    assert isinstance(space["learning_rate"], tune.search.sample.Float)
    assert (space["learning_rate"].lower, space["learning_rate"].upper) == (1e-5, 1e-4)
    assert "LogUniform" in type(space["learning_rate"].get_sampler()).__name__
    assert space["rank"].categories == [4, 8] and space["train_text_encoder"].categories == [True]
    assert space["subject"] == tune.grid_search(["rex", "mug"])  # every subject gets its own draws
    assert sweep_trial.trial_label({"subject": "rex", "learning_rate": 1.23456789e-5, "train_text_encoder": True,
                              "use_lora": True, "rank": 8}) == "rex-lr1.23457e-05-te1-rank8"
    # a row's trial found again by its settings (a failed trial's checkpoints are kept for the rerun)
    assert sweep_trial.trial_label(sweep_rows.TrialRow("rex", 1.23456789e-5, True, 8).config()) == \
        "rex-lr1.23457e-05-te1-rank8"
    assert sweep_trial.trial_label(sweep_rows.TrialRow("rex", 2e-6, False).config()) == "rex-lr2e-06-te0"


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


@pytest.mark.slow
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


def flux_sweep_run(request, folder):
    """The sweep of test_a_flux_lora_sweep_stops_the_trial_behind_early_..., beside the other tests (tests/beside.py)."""
    toy_images = request.getfixturevalue("toy_images")
    class_dir = folder / "best-sweep" / "class-images" / "toy"  # (drawn already: generate's own tests draw)
    write_subject(class_dir, [os.path.join(toy_images, n) for n in sorted(os.listdir(toy_images))[:2]], None)
    (folder / "prompts.txt").write_text("a {subject} on a beach\n")
    return beside.Job([sys.executable, "sweep.py", "--model_dir", request.getfixturevalue("tiny_flux_model"),
                       "--output_dir", str(folder / "best"), "--instance_data_dir", toy_images, "--class_name", "toy",
                       "--eval_models_dir", request.getfixturevalue("tiny_eval_models")[1], "--eval_prompts",
                       str(folder / "prompts.txt"), "--eval_images_per_prompt", "2", "--num_inference_steps", "2",
                       "--num_class_images", "2", "--sweep_max_train_steps", "1,2", "--num_workers", "1", "--use_lora",
                       "--sweep_learning_rate", "1e-5,1e-3", "--early_stopping", "on", "--max_concurrent_trials", "1"])


@pytest.mark.slow
@pytest.mark.beside(run=flux_sweep_run)
def test_a_flux_lora_sweep_stops_the_trial_behind_early_and_its_best_adapters_load_in_fluxpipeline(
        tiny_flux_model, runs_beside):
    """The sweep on the tiny Flux.1 dev model (flow matching, T5): one subject, two learning rates one after the
    other with --early_stopping on: each trial trains once, scored at steps 1 and 2 while it trains, and Tune hears
    step 1's scores as they arrive: a trial whose score there is under the first trial's is stopped (ASHA, halving
    at step 1). The seeded tiny models make the second trial the one behind; the table and the output say where it
    stopped. The best LoRA is kept with its record, loadable in FluxPipeline, where it changes the image. (SD 3.5's
    sweep: the 2-node sweep above.)"""
    model = tiny_flux_model
    run = runs_beside.result(flux_sweep_run)
    tmp_path, output = run.folder, run.stdout + run.stderr
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


def family_sweep(arch, request, folder):
    """A sweep of two LoRA trials (two learning rates, 2 steps each) on the tiny model of a family, without class
    images (--prior_preservation prior_prediction, as its script runs train), beside the other tests."""
    (folder / "prompts.txt").write_text("a {subject} on a beach\n")
    return beside.Job([sys.executable, "sweep.py", "--model_dir", request.getfixturevalue(f"tiny_{arch}_model"),
                       "--output_dir", str(folder / "best"), "--instance_data_dir", request.getfixturevalue("toy_images"),
                       "--class_name", "toy", "--eval_models_dir", request.getfixturevalue("tiny_eval_models")[1],
                       "--eval_prompts", str(folder / "prompts.txt"), "--eval_images_per_prompt", "2",
                       "--num_inference_steps", "2", "--sweep_max_train_steps", "2", "--num_workers", "1", "--use_lora",
                       "--prior_preservation", "prior_prediction", "--sweep_learning_rate", "1e-5,1e-3"])


def qwen_sweep_run(request, folder):
    return family_sweep("qwen", request, folder)


def flux2_sweep_run(request, folder):
    return family_sweep("flux2", request, folder)


def zimage_sweep_run(request, folder):
    return family_sweep("zimage", request, folder)


def chroma_sweep_run(request, folder):
    return family_sweep("chroma", request, folder)


@pytest.mark.slow
@pytest.mark.parametrize("arch, pipeline, spec", [
    pytest.param(arch, pipeline, spec, marks=pytest.mark.beside(run=spec), id=arch) for arch, pipeline, spec in (
        ("qwen", "QwenImagePipeline", qwen_sweep_run), ("flux2", "Flux2KleinPipeline", flux2_sweep_run),
        ("zimage", "ZImagePipeline", zimage_sweep_run), ("chroma", "ChromaPipeline", chroma_sweep_run))])
def test_a_sweep_of_two_trials_scores_each_2026_family_and_its_best_adapters_load_in_its_pipeline(
        arch, pipeline, spec, runs_beside, request):
    """Qwen-Image, FLUX.2 [klein], Z-Image and Chroma swept as the other families are: two trials (learning rates
    1e-5 and 1e-3), each trained once and scored while it trains (DINO, CLIP-I, CLIP-T against the base model's), no
    class images drawn; the best trial's LoRA kept with its record, which the family's diffusers pipeline loads
    (load_lora_weights) and which changes its transformer."""
    import diffusers
    import familysteps

    run = runs_beside.result(spec)
    folder, output = run.folder, run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    table = trials_table(str(folder / "best-sweep"))
    assert sorted((r["learning_rate"], r["step"], r["status"]) for r in table) == [
        ("0.001", "2", "ok"), ("1e-05", "2", "ok")], table
    assert all(0 < float(r["dino"]) <= 1 and 0 < float(r["clip_i"]) <= 1 and -1 <= float(r["clip_t"]) <= 1 for r in table)
    assert "2 model(s) scored (a trial's at each step count), 0 failed trial(s)" in output
    assert not (folder / "best-sweep" / "class-images").exists() and output.count("on 5 instance and 0 class images") == 2
    [chosen] = [r for r in table if r["chosen"] == "True"]
    model = request.getfixturevalue(f"tiny_{arch}_model")
    marker = files.read_json(str(folder / "best" / files.OUTPUT_MARKER))
    assert (marker["steps"], marker["base_model"], marker["class_prompt"]) == (2, model, "photo of a toy")
    assert chosen["model"].startswith(str(folder / "best-sweep" / "trials" / f"toy-lr{chosen['learning_rate']}-"))
    assert familysteps.lora_changes_the_transformer(getattr(diffusers, pipeline), model, str(folder / "best"))


@pytest.mark.slow
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


def test_a_sweep_config_holds_its_flags_and_the_trials_train_flags(tiny_model, toy_images, tmp_path):
    argv = base_argv(tiny_model, tmp_path) + ["--instance_data_dir", toy_images, "--class_name", "toy",
                                              "--sweep_learning_rate", "1e-6,1e-5", "--use_lora",
                                              "--validation_prompt", "a toy, oil painting", "--num_workers", "2"]
    args, train_flags, train_args = sweep.parse_args(argv)
    config = tmp_path / "sweep_config.toml"
    config.write_text(args.settings_toml)
    again, again_flags, again_train = sweep.parse_args(["--config", str(config)])
    assert again.sweep_learning_rate == [1e-6, 1e-5] and again.class_name == "toy"
    assert again_train.use_lora and again_train.validation_prompts == ("a toy, oil painting",)
    assert again_train.num_workers == 2 and again.settings_toml == args.settings_toml


def test_early_stopping_is_on_for_random_search_and_big_grids_and_stops_within_a_subject():
    from types import SimpleNamespace

    from ray.tune.schedulers import TrialScheduler

    from dreambooth.sweep import sweep_scheduler

    def args(**kw):
        return SimpleNamespace(**{"early_stopping": "auto", "search": "grid", "sweep_max_train_steps": [2, 4], **kw})

    assert not sweep.wants_early_stopping(args(), 4) and sweep.wants_early_stopping(args(), 5)
    assert sweep.wants_early_stopping(args(search="random"), 2) and sweep.wants_early_stopping(args(early_stopping="on"), 2)
    assert not sweep.wants_early_stopping(args(search="random", sweep_max_train_steps=[4]), 8)
    with pytest.raises(errors.UserError, match="needs 2 or more --sweep_max_train_steps"):
        sweep.wants_early_stopping(args(early_stopping="on", sweep_max_train_steps=[4]), 8)
    # The score: DINO gain over the base (held-out DINO when there is one), less 1 below the CLIP-T floor
    assert sweep_rows.rank_score({"dino": 0.7, "clip_t": 0.3}, 0.28, 0.5) == pytest.approx(0.2)
    assert sweep_rows.rank_score({"dino": 0.7, "clip_t": 0.2}, 0.28, 0.5) == pytest.approx(-0.8)
    assert sweep_rows.rank_score({"dino": 0.9, "dino_holdout": 0.6, "clip_t": 0.3}, 0.28, 0.5) == pytest.approx(0.1)
    # ASHA within each subject: a trial behind its own subject's at step 2 stops; another subject's goes on
    scheduler = sweep_scheduler.SubjectASHA(time_attr="step", metric="score", mode="max", max_t=4, grace_period=2,
                                            reduction_factor=2)
    trials = {name: SimpleNamespace(trial_id=name, config={"subject": subject})
              for name, subject in (("a1", "a"), ("a2", "a"), ("b1", "b"))}
    for trial in trials.values():
        scheduler.on_trial_add(None, trial)
    assert scheduler.on_trial_result(None, trials["a1"], {"step": 2, "score": 0.5}) == TrialScheduler.CONTINUE
    assert scheduler.on_trial_result(None, trials["b1"], {"step": 2, "score": 0.1}) == TrialScheduler.CONTINUE
    assert scheduler.on_trial_result(None, trials["a2"], {"step": 2, "score": 0.2}) == TrialScheduler.STOP


@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_a_rerun_with_another_search_space_starts_afresh(where, tmp_path, capsys, request):
    """Tune would restore the stored search space: a rerun with other values sets the old sweep's state
    aside (saying what changed); the same settings keep it for Tune to restore. In a bucket too (which
    has no renames: the state is copied aside, then deleted)."""
    from dreambooth import storage
    from dreambooth.sweep import sweep_files

    folder = str(tmp_path)
    if where == "bucket":
        folder = f"s3://{request.getfixturevalue('s3_endpoint')[1]}/rerun"
    storage.write_bytes(storage.join(folder, "tune", "state.json"), b"{}")
    storage.write_bytes(storage.join(folder, "sweep_config.toml"),
                        b'sweep_learning_rate = [1e-06, 2e-06]\nsearch = "grid"\n')
    sweep_files.set_aside_another_sweep(folder, 'search = "grid"\nsweep_learning_rate = [1e-06, 2e-06]\n')
    assert storage.listdir(storage.join(folder, "tune")) == ["state.json"] and capsys.readouterr().err == ""
    sweep_files.set_aside_another_sweep(folder, 'sweep_learning_rate = [5e-06]\nsearch = "grid"\n')
    assert not storage.exists(storage.join(folder, "tune"))
    [aside] = [p for p in storage.listdir(folder) if p.startswith("tune-before-")]
    assert storage.listdir(storage.join(folder, aside)) == ["state.json"]
    assert storage.read_bytes(storage.join(folder, aside, "state.json")) == b"{}"
    assert "had other settings (sweep_learning_rate [1e-06, 2e-06] -> [5e-06]): starting it afresh" in \
        capsys.readouterr().err

import os
import re

import pytest
from support import write_subject

from dreambooth import errors
from dreambooth import files
from dreambooth.commands import sweep
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

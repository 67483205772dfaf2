"""planning.py: the command line and the files become one frozen Plan, without Ray."""

import dataclasses
import os
import re

import pytest
from PIL import Image

from dreambooth import errors
from dreambooth import files
from dreambooth.generation import prompts
from dreambooth.models import outputs
from dreambooth.planning import planning


def test_plan_run_decides_every_setting_once_before_ray(tiny_model, toy_images, tmp_path, capsys):
    asked = []

    def cluster():
        asked.append(1)
        return 4.0, 0

    args = planning.parse_args(["--model_dir", tiny_model, "--output_dir", str(tmp_path / "out"),
                            "--instance_data_dir", toy_images, "--instance_prompt", "photo of unqtkn toy",
                            "--num_workers", "2", "--max_train_steps", "7", "--lr", "2e-5"])
    run = planning.plan_run(args, cluster)
    assert asked == [1]
    assert run.total_steps == 7 and run.steps_per_epoch == 2  # 5 rows // 2 workers, batch 1
    assert run.resolution == 64  # the tiny model's native size, read from its configs
    assert run.use_gpu is False and run.cpus_per_worker == 1.0 and run.channels_last is False
    assert len(run.instance_images) == 5 and run.class_images == () and not run.with_prior_preservation
    ids = prompts.run_prompt_ids(run)
    assert set(ids) == {"instance"} and len(ids["instance"]) == 1
    assert len(ids["instance"][0]) == 77 and run.instance_prompts == ("photo of unqtkn toy",)
    assert run.learning_rate == 2e-5 and run.run_name.startswith("out-") and run.resume_path is None
    assert run.storage_path == str(tmp_path / "ray_results")
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.total_steps = 8
    text = run.describe()
    assert "7 steps" in text and "5 instance and 0 class images at 64 px" in text and run.run_name in text


def test_plan_run_refuses_bad_files_before_starting_ray(tiny_model, tmp_path):
    def cluster():
        raise AssertionError("Ray must not start for a bad input")

    args = planning.parse_args(["--model_dir", tiny_model, "--output_dir", str(tmp_path / "out"),
                            "--instance_data_dir", str(tmp_path / "missing"), "--instance_prompt", "p"])
    with pytest.raises(errors.UserError, match="instance folder not found"):
        planning.plan_run(args, cluster)


def test_offline_plan_has_the_flag_defaults_and_the_given_fields():
    run = planning.offline_plan(learning_rate=1e-3)
    assert run.learning_rate == 1e-3 and run.adam_beta2 == 0.999 and run.train_text_encoder
    assert run.is_checkpoint_step(run.total_steps) and not run.is_checkpoint_step(1)
    assert run.is_report_step(run.logging_steps) and not run.is_report_step(run.logging_steps + 1)


def test_scale_lr_multiplies_by_the_images_of_one_optimizer_step():
    argv = ["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/i", "--instance_prompt", "p",
            "--lr", "1e-6", "--train_batch_size", "2", "--gradient_accumulation_steps", "3", "--num_workers", "4"]
    assert planning.scaled_learning_rate(planning.parse_args(argv)) == 1e-6
    assert planning.scaled_learning_rate(planning.parse_args(argv + ["--scale_lr"])) == pytest.approx(24e-6)


def test_captions_beside_instance_images_replace_the_instance_prompt(tiny_model, toy_images, tmp_path, capsys):
    import shutil

    own = tmp_path / "own"
    shutil.copytree(toy_images, own)
    (own / "toy-1.txt").write_text("photo of unqtkn toy\n on a beach ")
    (own / "toy-3.txt").write_text("a photo of a toy")
    argv = ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "out"), "--instance_data_dir", str(own),
            "--instance_prompt", "photo of unqtkn toy", "--num_workers", "1"]
    run = planning.plan_run(planning.parse_args(argv), lambda: (2.0, 0))
    assert run.instance_prompts == ("photo of unqtkn toy", "photo of unqtkn toy on a beach", "a photo of a toy")
    assert run.image_prompt == (0, 1, 0, 2, 0)
    ids = prompts.run_prompt_ids(run)["instance"]
    assert len(ids) == 3 and ids[1] != ids[0]
    err = capsys.readouterr().err
    assert "skipping" not in err and "3 prompts from captions" in run.describe()
    no_captions = planning.plan_run(planning.parse_args(argv + ["--caption_extension", ""]), lambda: (2.0, 0))
    assert no_captions.image_prompt == (0,) * 5
    # --caption_dropout_rate: the empty prompt's ids after the captions' (train.prompt_inputs points at them)
    dropout = planning.plan_run(planning.parse_args(argv + ["--caption_dropout_rate", "0.1"]), lambda: (2.0, 0))
    dropout_ids = prompts.run_prompt_ids(dropout)["instance"]
    assert dropout_ids[:3] == ids and len(dropout_ids) == 4
    empty = dropout_ids[3]
    assert empty[0] != empty[1] and len(set(empty[2:])) == 1  # start, end, then padding: nothing in between
    assert dropout.instance_prompts == run.instance_prompts and dropout.caption_dropout_rate == 0.1
    predicted = planning.plan_run(planning.parse_args(argv + ["--prior_preservation", "prior_prediction",
                                                              "--class_prompt", "photo of a toy"]), lambda: (2.0, 0))
    assert predicted.prior_prediction and predicted.class_images == ()
    assert len(prompts.run_prompt_ids(predicted)["class"]) == 77
    assert "towards the base model's prediction" in predicted.describe()
    # --masked_loss: a mask beside one photo; without the flag it is named as unused
    Image.new("L", Image.open(own / "toy-1.jpg").size, 255).save(own / "toy-1.mask.png")
    capsys.readouterr()
    unmasked = planning.plan_run(planning.parse_args(argv), lambda: (2.0, 0))
    assert "1 mask file(s) beside the photos are not used without --masked_loss" in capsys.readouterr().err
    assert len(unmasked.instance_images) == 5 and unmasked.instance_masks == (None,) * 5
    masked = planning.plan_run(planning.parse_args(argv + ["--masked_loss"]), lambda: (2.0, 0))
    assert masked.instance_masks == (None, (str(own / "toy-1.mask.png"), str(own / "toy-1.jpg")), None, None, None)
    capsys.readouterr()
    # The identifier check applies to each caption.
    planning.plan_run(planning.parse_args(argv + ["--class_data_dir", toy_images, "--class_prompt", "photo of a toy"]),
                  lambda: (2.0, 0))
    err = capsys.readouterr().err
    assert "1 prompt(s)/caption(s) has no word that --class_prompt lacks (e.g. 'a photo of a toy')" in err
    (own / "toy-0.txt").write_text("  \n")
    with pytest.raises(errors.UserError, match="toy-0.txt is empty"):
        planning.plan_run(planning.parse_args(argv), lambda: (2.0, 0))


def test_lora_defaults_learning_rate_and_alpha_and_a_resume_must_match_its_kind(tiny_model, toy_images, tmp_path,
                                                                                 capsys):
    argv = ["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/i", "--instance_prompt", "p"]
    full, lora = planning.parse_args(argv), planning.parse_args(argv + ["--use_lora", "--rank", "8"])
    assert (full.learning_rate, lora.learning_rate) == (5e-6, 1e-4) and lora.lora_alpha == 8.0
    assert planning.parse_args(argv + ["--use_lora", "--lr", "3e-4"]).learning_rate == 3e-4
    settings = [outputs.LoraSettings.of(a.use_lora, a.lora_rank, a.lora_alpha) for a in (full, lora)]
    assert settings == [None, outputs.LoraSettings(8, 8.0)]
    with pytest.raises(SystemExit):
        planning.parse_args(argv + ["--use_lora", "--lora_dropout", "1"])
    assert "--lora_dropout: must be < 1" in capsys.readouterr().err

    run_argv = ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "out"), "--instance_data_dir", toy_images,
                "--instance_prompt", "photo of unqtkn toy"]
    full_identity = planning.plan_run(planning.parse_args(run_argv), lambda: (4.0, 0)).identity
    done = tmp_path / "ray_results" / "out-20260101-000000" / "checkpoint_0"  # a full fine-tuning checkpoint
    done.mkdir(parents=True)
    (done / "unet.safetensors").write_bytes(b"w")
    files.write_json(str(done / "train_state.json"), {"step": 2, "identity": full_identity,
                                                      "sizes": {"unet.safetensors": 1}})
    args = planning.parse_args(run_argv + ["--use_lora", "--resume_from_checkpoint", "latest"])
    capsys.readouterr()
    assert planning.plan_run(args, lambda: (4.0, 0)).resume_path is None  # a LoRA run starts afresh, and says why
    assert re.search(r"not resuming \S+checkpoint_0: it is of another run \(.*--learning_rate 5e-06 -> 0.0001; "
                     r".*--use_lora False -> True", capsys.readouterr().err)
    args = planning.parse_args(run_argv + ["--use_lora", "--resume_from_checkpoint", str(done)])
    with pytest.raises(errors.UserError, match=r"checkpoint \S+ is of another run: .*--use_lora False -> True"):
        planning.plan_run(args, lambda: (4.0, 0))
    args = planning.parse_args(run_argv + ["--resume_from_checkpoint", "latest"])
    assert planning.plan_run(args, lambda: (4.0, 0)).resume_path == str(done)  # the same run resumes


def test_8bit_adam_without_bitsandbytes_is_a_one_line_error(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes"
                        else find_spec(name, *a))
    with pytest.raises(SystemExit):
        planning.parse_args(["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/i",
                         "--instance_prompt", "p", "--use_8bit_adam"])
    err = capsys.readouterr().err
    assert "--optimizer adamw8bit needs bitsandbytes, which is not installed here: pip install bitsandbytes" in err
    assert err.count("\n") == 1


def test_each_optimizer_gets_its_defaults_and_its_flags_only_with_it(capsys):
    """Prodigy's learning rate defaults to 1.0 (a multiplier of the step size it finds); schedule-free AdamW has no
    schedule (it warms up over --lr_warmup_steps itself); --use_8bit_adam is --optimizer adamw8bit; diffusers'
    spellings (AdamW, prodigy) are accepted; what does not fit is one line."""
    base = ["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/i", "--instance_prompt", "p"]
    prodigy = planning.parse_args(base + ["--optimizer", "prodigy", "--prodigy_beta3", "0.9"])
    assert prodigy.learning_rate == 1.0 and not prodigy.fused_adamw and prodigy.prodigy_beta3 == 0.9
    assert planning.parse_args(base + ["--optimizer", "prodigy", "--lr", "0.5"]).learning_rate == 0.5
    free = planning.parse_args(base + ["--optimizer", "adamw_schedulefree", "--lr_warmup_steps", "10"])
    assert free.lr_scheduler == "constant" and free.learning_rate == 5e-6 and free.lr_warmup_steps == 10
    assert planning.parse_args(base + ["--optimizer", "AdamW"]).optimizer == "adamw"
    assert "(Prodigy, which scales it by the step size it finds, constant_with_warmup)" in planning.offline_plan(
        optimizer="prodigy", learning_rate=1.0).describe()  # (the plan line names it)
    eight = planning.parse_args(base + ["--use_8bit_adam"])
    assert eight.optimizer == "adamw8bit" and planning.parse_args(base + ["--optimizer", "adamw8bit"]).use_8bit_adam
    for flags, said in [(["--prodigy_beta3", "0.9"], "--prodigy_beta3 shape Prodigy: add --optimizer prodigy"),
                        (["--optimizer", "adamw_schedulefree", "--lr_scheduler", "cosine"],
                         "leave out --lr_scheduler cosine"),
                        (["--use_8bit_adam", "--optimizer", "prodigy"], "--use_8bit_adam is --optimizer adamw8bit"),
                        (["--optimizer", "prodigy", "--fused_adamw"], "--fused_adamw is torch's AdamW kernel"),
                        (["--fsdp", "--optimizer", "prodigy"], "leave out --optimizer prodigy")]:
        with pytest.raises(SystemExit):
            planning.parse_args(base + flags)
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, (flags, err)


def test_an_sdxl_plan_takes_both_tokenizers_its_own_vae_and_validation_epochs(tiny_sdxl_model, toy_images,
                                                                             tmp_path):
    """diffusers' SDXL LoRA flags: --pretrained_vae_model_name_or_path (a VAE folder) and
    --validation_epochs (so many epochs' steps); a folder that is no VAE is named before Ray."""
    import shutil

    vae = shutil.copytree(os.path.join(tiny_sdxl_model, "vae"), tmp_path / "fp16-fix-vae")
    argv = ["--model_dir", tiny_sdxl_model, "--output_dir", str(tmp_path / "out"), "--instance_data_dir", toy_images,
            "--instance_prompt", "photo of unqtkn toy", "--num_workers", "1", "--max_train_steps", "12",
            "--validation_prompt", "photo of unqtkn toy", "--validation_epochs", "2"]
    run = planning.plan_run(planning.parse_args(argv + ["--pretrained_vae_model_name_or_path", str(vae)]),
                            lambda: (2.0, 0))
    assert run.vae_dir == str(vae) and run.resolution == 128
    assert run.steps_per_epoch == 5 and run.validation_steps == 10
    assert [run.is_validation_step(s) for s in (5, 10, 12)] == [False, True, True]
    assert len(prompts.run_prompt_ids(run)["instance"][0]) == 2  # each prompt's ids for both tokenizers
    with pytest.raises(errors.UserError, match="no config.json there"):
        planning.plan_run(planning.parse_args(argv + ["--pretrained_vae_model_name_or_path", toy_images]),
                          lambda: (2.0, 0))


def test_holdout_keeps_the_last_photos_out_of_training(tiny_model, toy_images, tmp_path, capsys):
    argv = ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "out"), "--instance_data_dir", toy_images,
            "--instance_prompt", "photo of unqtkn toy", "--num_workers", "1"]
    run = planning.plan_run(planning.parse_args(argv + ["--holdout", "2"]), lambda: (2.0, 0))
    assert [os.path.basename(p) for p in run.instance_images] == ["toy-0.jpg", "toy-1.jpg", "toy-2.jpg"]
    assert [os.path.basename(p) for p in run.held_out] == ["toy-3.jpg", "toy-4.jpg"]
    assert "--holdout 2: training without toy-3.jpg, toy-4.jpg (evaluate.py --holdout 2" in capsys.readouterr().err
    with pytest.raises(errors.UserError, match="--holdout 5 leaves none of the 5 photos to train on"):
        planning.plan_run(planning.parse_args(argv + ["--holdout", "5"]), lambda: (2.0, 0))


def test_buckets_are_planned_from_the_resolution_and_the_models_size_step(tiny_model, toy_images, tmp_path, capsys):
    argv = ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "out"), "--instance_data_dir", toy_images,
            "--instance_prompt", "photo of unqtkn toy", "--num_workers", "1", "--train_batch_size", "2"]
    run = planning.plan_run(planning.parse_args(argv + ["--enable_bucket"]), lambda: (2.0, 0))
    assert (64, 64) in run.buckets and all(h % 8 == 0 and w % 8 == 0 and 32 <= min(h, w) for h, w in run.buckets)
    assert "buckets: 5 photos in 64x64 (5)" in capsys.readouterr().err
    assert run.steps_per_epoch == 3  # 5 photos in one bucket: 6 rows, whole batches of 2
    assert "(aspect-ratio buckets)" in run.describe()
    for extra, says in ((["--bucket_reso_steps", "6"], "must be a multiple of 4 for this model"),
                        (["--min_bucket_reso", "80"], "must enclose the resolution 64"),
                        (["--min_bucket_reso", "64", "--max_bucket_reso", "64"], "no bucket but the square")):
        with pytest.raises(errors.UserError, match=says):
            planning.plan_run(planning.parse_args(argv + ["--enable_bucket", *extra]), lambda: (2.0, 0))


def test_a_run_keeps_one_checkpoint_by_default_and_removes_it_once_its_model_is_saved():
    """diffusers keeps every checkpoint unless told; a full SD 1.x one is 12 GB, so here the newest is
    kept while the run trains (all a resume needs) and none once the model is saved (--keep_checkpoints)."""
    argv = ["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/p", "--instance_prompt", "x"]
    default = planning.parse_args(argv)
    assert (default.checkpoints_total_limit, default.keep_checkpoints) == (1, False)
    kept = planning.parse_args(argv + ["--checkpoints_total_limit", "3", "--keep_checkpoints"])
    assert (kept.checkpoints_total_limit, kept.keep_checkpoints) == (3, True)


def test_an_adapter_implies_lora_and_its_combinations_are_checked(capsys):
    """--adapter dora|loha|lokr trains adapters (--use_lora implied, LoRA's learning rate); --use_dora is --adapter
    dora; LoHa and LoKr have no quantised base layers in peft: one line each."""
    base = ["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/i", "--instance_prompt", "p"]
    for adapter in ("dora", "loha", "lokr"):
        args = planning.parse_args(base + ["--adapter", adapter])
        assert args.use_lora and args.adapter == adapter and args.learning_rate == 1e-4
    assert planning.parse_args(base + ["--use_lora"]).adapter == "lora" and planning.parse_args(base).adapter is None
    assert "training LoHa adapters (rank 4" in planning.offline_plan(use_lora=True, adapter="loha").describe()
    quantised = planning.offline_plan(use_lora=True, base_precision="nf4", text_encoder_precision="int8").describe()
    assert "adapters (rank 4, alpha 4) on the UNet + text encoder (the base nf4, the frozen text encoders int8) on" \
        in quantised
    for flags, said in [(["--use_dora", "--adapter", "loha"], "--use_dora is --adapter dora"),
                        (["--adapter", "lokr", "--base_precision", "int8"], "--adapter lokr has no quantised layers"),
                        (["--text_encoder_precision", "nf4"], "the frozen text encoders of a LoRA run: add --use_lora")]:
        with pytest.raises(SystemExit):
            planning.parse_args(base + flags)
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, (flags, err)


def test_a_model_train_py_trains_again_is_said_to_be_replaced(tmp_path, capsys):
    """train.py without --resume_from_checkpoint auto trains again into a folder holding a model (the same run's or
    another's): a line says it is replaced when the run ends (a new user's walk saw it retrain without a word)."""
    from dreambooth import files
    from dreambooth.models import outputs

    files.write_json(str(tmp_path / files.OUTPUT_MARKER),
                     outputs.TrainRecord("/base", steps=8, identity={"learning_rate": 5e-6}).to_json())
    planning.say_replaced(str(tmp_path), {"learning_rate": 5e-6})
    assert capsys.readouterr().err == (f"{tmp_path} holds the finished model of this run: this run trains again and "
                                       "replaces it when it ends (--resume_from_checkpoint auto keeps a finished model "
                                       "of the same run)\n")
    planning.say_replaced(str(tmp_path), {"learning_rate": 1e-5})
    assert "holds the model of another run (--learning_rate 5e-06 -> 1e-05)" in capsys.readouterr().err
    planning.say_replaced(str(tmp_path / "empty"), {})
    assert capsys.readouterr().err == ""


def test_num_workers_0_plans_one_worker_in_this_process_and_refuses_what_needs_workers(tiny_model, toy_images,
                                                                                       tmp_path, capsys):
    """--num_workers 0 (Ray Train's local mode): the steps, the learning rate's scaling and the data split count one
    worker; the checkpoints are written by the loop, never in the background; what needs Ray Train's workers (a
    worker group that shrinks, shards, validation tasks, an upload thread) is refused by name."""
    argv = ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "out"), "--instance_data_dir", toy_images,
            "--instance_prompt", "photo of unqtkn toy", "--num_workers", "0", "--scale_lr", "--lr", "1e-4",
            "--gradient_accumulation_steps", "2"]
    run = planning.plan_run(planning.parse_args(argv), lambda: (2.0, 0))
    assert run.in_process and run.num_workers == 1 and run.steps_per_epoch == 2  # 5 rows, batch 1, 2 accumulated
    assert run.learning_rate == pytest.approx(1e-4 * 2)
    assert "this process (--num_workers 0: Ray Train's local mode), batch 1" in run.describe()
    with_workers = planning.plan_run(planning.parse_args(argv + ["--num_workers", "1"]), lambda: (2.0, 0))
    assert not with_workers.in_process
    in_a_bucket = {"storage_path": "s3://bucket/runs", "checkpoint_upload": "auto"}
    assert not dataclasses.replace(run, **in_a_bucket).uploads_in_background()
    assert dataclasses.replace(with_workers, **in_a_bucket).uploads_in_background()
    for flags, named in ((["--min_workers", "1"], "--min_workers"), (["--fsdp"], "--fsdp"),
                         (["--checkpoint_upload", "async"], "--checkpoint_upload async")):
        with pytest.raises(SystemExit):
            planning.parse_args(argv + flags)
        assert f"--num_workers 0 trains in this process, without Ray Train's workers: leave out {named}" in \
            capsys.readouterr().err

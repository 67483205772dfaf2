"""What users get wrong, refused by the scripts' main() in one line before Ray starts (this tier starts no Ray and no
process: a check that came after Ray's start fails here). The line is what errors.run_main prints: a UserError's
text or argparse's last line, exit 2; that a script process prints it so, alone, with no traceback:
tests/integration/test_bad_inputs_scripts.py."""

import glob
import os
import shutil

import pytest

from dreambooth import errors
from dreambooth.commands import cache_model
from dreambooth.commands import evaluate
from dreambooth.commands import export
from dreambooth.commands import generate
from dreambooth.commands import sweep
from dreambooth.commands import train

MAINS = {"train.py": train.main, "generate.py": generate.main, "evaluate.py": evaluate.main, "export.py": export.main,
         "sweep.py": sweep.main, "cache_model.py": cache_model.main}


def refused(capsys, script, argv):
    """The one line script's main(argv) refuses argv with (a UserError's text, or argparse's error line)."""
    capsys.readouterr()
    try:
        MAINS[script](argv)
    except errors.UserError as err:
        line = str(err)
    except SystemExit as stop:
        assert stop.code == 2, (script, argv, stop.code)
        line = capsys.readouterr().err.strip().splitlines()[-1]
    else:
        raise AssertionError(f"{script} {argv}: not refused")
    assert "\n" not in line, line
    return line


@pytest.fixture(scope="module")
def cut_model(tiny_model, tmp_path_factory):
    """A copy of the tiny model whose UNet weights file was cut short, as an interrupted copy leaves it."""
    import shutil

    model = tmp_path_factory.mktemp("cut") / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return str(model)


def test_scripts_check_what_they_were_given_before_ray_starts(tiny_model, cut_model, toy_images, tmp_path,
                                                            tiny_eval_models, capsys):
    """Each case: one line naming the culprit, before Ray and before any image is drawn (this tier starts neither),
    and nothing of the user's moved."""
    eval_models = str(tmp_path / "no-eval-models")
    real_eval_models = tiny_eval_models[1]
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    train = ["--instance_data_dir", toy_images, "--instance_prompt", "photo of unqtkn toy", "--num_workers", "1"]
    captioned = tmp_path / "captioned"  # a caption saved by a Windows editor as 'Unicode' (UTF-16)
    shutil.copytree(toy_images, captioned)
    (captioned / "toy-0.txt").write_bytes("photo of unqtkn toy on a sofa".encode("utf-16"))
    evaluate = ["--instance_data_dir", toy_images, "--class_name", "toy", "--eval_models_dir", eval_models]
    cases = [
        ("train.py", ["--model_dir", cut_model, "--output_dir", str(tmp_path / "o1"), *train],
         "diffusion_pytorch_model.safetensors is not a whole safetensors file"),
        ("train.py", ["--model_dir", tiny_model, "--output_dir", str(a_file), *train], "is a file, not a folder"),
        ("train.py", ["--model_dir", tiny_model, "--output_dir", os.path.join(toy_images, "out"), *train],
         "is inside --instance_data_dir"),
        ("generate.py", ["--model_dir", cut_model, "--output_dir", str(tmp_path / "g"), "--prompts", "a toy"],
         "is not a whole safetensors file"),
        ("generate.py", ["--model_dir", tiny_model, "--output_dir", str(a_file), "--prompts", "a toy"],
         "is a file, not a folder"),
        ("generate.py", ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "g2")], "give the prompts"),
        ("generate.py", ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "g3"), "--prompts_file",
                         str(tmp_path)], f"the prompts file: {tmp_path} is a folder, not a file"),
        ("train.py", ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "o2"), *train[2:],
                      "--instance_data_dir", str(captioned)],
         f"caption file: {captioned / 'toy-0.txt'} is not UTF-8 text (UTF-16 (a Windows editor's 'Unicode')): save it"),
        ("evaluate.py", ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "e"), *evaluate],
         "--eval_models_dir"),
        ("evaluate.py", ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "e2"), "--class_name", "toy",
                         "--eval_models_dir", real_eval_models, "--instance_data_dir", str(tmp_path / "no-photos")],
         "not found"),
        ("export.py", ["--model_dir", cut_model, "--output_file", str(tmp_path / "x.safetensors")],
         "is not a whole safetensors file"),
        ("export.py", ["--model_dir", tiny_model, "--output_file", str(tmp_path)], "is a folder"),
        ("sweep.py", ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "s"), *evaluate], "--eval_models_dir"),
        ("sweep.py", ["--model_dir", cut_model, "--output_dir", str(tmp_path / "s2"), *evaluate],
         "is not a whole safetensors file"),
        ("cache_model.py", ["--model_dir", str(a_file / "cache"), "--eval_models", "--tiny"],
         f"cannot create the model cache folder {a_file / 'cache'}"),
    ]
    for script, args, culprit in cases:
        line = refused(capsys, script, args)
        assert culprit in line, (script, line)
    assert a_file.read_text() == "keep me"
    assert not os.path.exists(os.path.join(toy_images, "out"))


@pytest.fixture(scope="module")
def sdxl_adapters(tiny_sdxl_model, tmp_path_factory):
    """LoRA adapters of the tiny SDXL model, written as train.py --use_lora writes them (untrained)."""
    import torch

    from dreambooth.models import networks
    from dreambooth.models import outputs
    from dreambooth.planning import planning

    plan = planning.offline_plan(model_dir=tiny_sdxl_model, use_lora=True, lora_rank=4, lora_alpha=4.0,
                                 mixed_precision="no", output_dir=str(tmp_path_factory.mktemp("sdxl-lora") / "out"))
    outputs.save_pipeline(networks.setup_models(plan, torch.device("cpu"), torch.device("cpu"), distributed=False), plan)
    return plan.output_dir


def test_the_flags_added_since_are_checked_before_ray_starts(tiny_model, sdxl_adapters, toy_images, tmp_path, capsys):
    """The catalogue grown with what came since (photos cut short, buckets, holdout, config syntax, EMA,
    caption dropout, LoRA rank and family, steps, masks, checkpoints, hub names offline, export and sweep
    lists): one line each, before Ray, the user's files untouched."""
    photos = tmp_path / "photos"
    shutil.copytree(toy_images, photos)
    (photos / "toy-9.jpg").write_bytes(open(os.path.join(toy_images, "toy-0.jpg"), "rb").read()[:3000])
    masked = tmp_path / "masked"
    shutil.copytree(toy_images, masked)
    (masked / "toy-0.mask.png").write_text("not an image")
    config = tmp_path / "run.toml"
    config.write_text("max_train_steps = 4\nseed = = 1\n")
    (tmp_path / "not-a-checkpoint").mkdir()
    eval_models = str(tmp_path)  # never reached: each case fails before
    base = ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "out"), "--instance_prompt", "photo of unqtkn toy",
            "--num_workers", "1"]
    train = [*base, "--instance_data_dir", toy_images]
    cases = [
        ("train.py", [*base, "--instance_data_dir", str(photos)], "cannot read image", "toy-9.jpg"),
        ("train.py", [*base, "--instance_data_dir", str(photos), "--num_class_images", "2", "--class_data_dir",
                      str(tmp_path / "class"), "--class_prompt", "a toy"], "toy-9.jpg"),  # before class images
        ("train.py", [*train, "--holdout", "5"], "--holdout 5 leaves none of the 5 photos"),
        ("train.py", [*train, "--enable_bucket", "--min_bucket_reso", "512", "--max_bucket_reso", "256"],
         "--min_bucket_reso"),
        ("train.py", [*train, "--config", str(config)], str(config), "line 2"),
        ("train.py", [*train, "--use_ema", "--ema_decay", "1.5"], "--ema_decay", "1.5"),
        ("train.py", [*train, "--caption_dropout_rate", "2"], "--caption_dropout_rate"),
        ("train.py", [*train, "--use_lora", "--rank", "0"], "--rank", "got 0"),
        ("train.py", [*train, "--use_lora", "--text_encoder_precision", "int8"], "--text_encoder_precision int8",
         "this run trains every one of SD 1.x's: add --no-train_text_encoder"),
        ("train.py", [*train, "--max_train_steps", "-5"], "--max_train_steps", "-5"),
        ("train.py", [*base, "--instance_data_dir", str(masked), "--masked_loss"], "cannot read mask", "toy-0.mask.png"),
        ("train.py", [*train, "--resume_from_checkpoint", str(tmp_path / "not-a-checkpoint")],
         "is not a complete checkpoint"),
        ("train.py", [*train[2:], "--model_dir", "someorg/no-such-model"], "someorg/no-such-model", "cannot be reached"),
        ("generate.py", ["--model_dir", tiny_model, "--lora_dir", sdxl_adapters, "--output_dir", str(tmp_path / "g"),
                         "--prompts", "a toy"], "were trained on an SDXL model", "is an SD 1.x model"),
        ("evaluate.py", ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "e"), "--instance_data_dir",
                         toy_images, "--class_name", "toy", "--eval_models_dir", eval_models, "--holdout", "5"],
         "--holdout 5 leaves none of the 5 photos"),
        ("export.py", ["--model_dir", tiny_model, "--output_file", os.path.join(tiny_model, "unet", "x.safetensors")],
         "is inside --model_dir"),
        ("sweep.py", ["--model_dir", tiny_model, "--output_dir", str(tmp_path / "s"), "--instance_data_dir", toy_images,
                      "--class_name", "toy", "--eval_models_dir", eval_models, "--sweep_learning_rate", ""],
         "--sweep_learning_rate", "at least one value"),
    ]
    before = {p: open(p, "rb").read() for p in glob.glob(str(tmp_path / "**" / "*"), recursive=True)
              if os.path.isfile(p)}
    for script, args, *culprit in cases:
        line = refused(capsys, script, args)
        assert all(word in line for word in culprit), (script, line)
    assert {p: open(p, "rb").read() for p in before} == before
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(os.path.join(tiny_model, "unet", "x.safetensors"))

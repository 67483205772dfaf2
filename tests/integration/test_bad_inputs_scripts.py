"""What users get wrong, through the scripts: one line naming the bad input, said before Ray starts where it can
be, and on Ray (an error no restart can fix, an actor that cannot load its model, any other task error) one line and
a log. (The checks themselves: tests/unit/test_bad_inputs.py.)"""

import glob
import os
import shutil
import subprocess
import sys

import pytest
from support import ray_sessions

from dreambooth import errors
from dreambooth import families
from dreambooth.files import REPO_DIR


def run_train(args, timeout=120):
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO_DIR, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def assert_one_line_error(proc, *words):
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for word in words:
        assert word in last, proc.stderr[-2000:]


def test_train_cli_names_the_bad_input(tiny_model, toy_images, tmp_path):
    base = ["--model_dir", tiny_model, "--instance_prompt", "photo of unqtkn toy", "--num_workers", "1"]
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in os.listdir(toy_images):
        (photos / name).write_bytes((open(os.path.join(toy_images, name), "rb")).read())
    (photos / "IMG_0001.jpg").write_bytes(b"\xff\xd8\xff garbage")
    proc = run_train(base + ["--output_dir", str(tmp_path / "o1"), "--instance_images_dir", str(photos)])
    assert_one_line_error(proc, "IMG_0001.jpg")

    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_train(base + ["--output_dir", str(tmp_path / "o2"), "--instance_images_dir", str(empty)])
    assert_one_line_error(proc, "holds no images")

    proc = run_train(base + ["--output_dir", str(tmp_path / "o3"), "--instance_images_dir", toy_images,
                             "--num_workers", "64"])
    assert_one_line_error(proc, "--num_workers 64")

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    proc = run_train(base + ["--output_dir", str(tmp_path / "mine"), "--instance_images_dir", toy_images])
    assert_one_line_error(proc, "--overwrite")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"

    proc = run_train(base + ["--output_dir", str(tmp_path / "o4"), "--instance_images_dir", toy_images,
                             "--resume_from_checkpoint", str(tmp_path)])
    assert_one_line_error(proc, "not a complete checkpoint")


@pytest.fixture(scope="module")
def cut_model(tiny_model, tmp_path_factory):
    """A copy of the tiny model whose UNet weights file was cut short, as an interrupted copy leaves it."""
    import shutil

    model = tmp_path_factory.mktemp("cut") / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return str(model)


def run_script(script, args, no_ray=False):
    """(process, seconds) of a script run on the command line, as a user runs it; no_ray: with
    RAY_ADDRESS at a closed port, so a script that touches Ray fails or waits instead of joining
    the session's cluster unseen."""
    import time

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if no_ray:
        env["RAY_ADDRESS"] = "127.0.0.1:9"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, script, *args], cwd=REPO_DIR, capture_output=True, text=True, timeout=120,
                          env=env)
    return proc, time.perf_counter() - start


def test_scripts_check_what_they_were_given_before_ray_starts(tiny_model, cut_model, toy_images, tmp_path,
                                                            tiny_eval_models):
    """Each case: exit != 0, one line naming the culprit, no traceback, in seconds (before Ray, before
    any image is drawn), and nothing of the user's moved."""
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
        sessions = ray_sessions()
        proc, seconds = run_script(script, args, no_ray=True)
        assert_one_line_error(proc, culprit)
        assert seconds < 10, (script, culprit, seconds)
        assert ray_sessions() == sessions, (script, culprit)  # Ray was not started
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


def test_the_flags_added_since_are_checked_before_ray_starts(tiny_model, sdxl_adapters, toy_images, tmp_path):
    """The catalogue grown with what came since (photos cut short, buckets, holdout, config syntax, EMA,
    caption dropout, LoRA rank and family, steps, masks, checkpoints, hub names offline, export and sweep
    lists): one line each, before Ray, in seconds, the user's files untouched."""
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
        sessions = ray_sessions()
        proc, seconds = run_script(script, args, no_ray=True)
        assert_one_line_error(proc, *culprit)
        assert seconds < 15, (script, culprit, seconds)
        assert ray_sessions() == sessions, (script, culprit)  # Ray was not started
    assert {p: open(p, "rb").read() for p in before} == before
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(os.path.join(tiny_model, "unet", "x.safetensors"))


@pytest.fixture(scope="module")
def mixed_model(tiny_model, tmp_path_factory):
    """A copy of the tiny model whose UNet config does not fit its weights (a mixed-up copy): it passes
    every check that reads no weights, so only the Ray workers that load it find out."""
    import json
    import shutil

    model = shutil.copytree(tiny_model, tmp_path_factory.mktemp("mixed") / "model")
    config_path = model / "unet" / "config.json"
    config = json.loads(config_path.read_text())
    config["cross_attention_dim"] *= 2
    config_path.write_text(json.dumps(config))
    families.check_model_dir(str(model))
    return model


def test_an_error_no_restart_can_fix_stops_the_run_at_once(mixed_model, toy_images, tmp_path):
    """The run ends after the one attempt that met the bad model, not after --max_failures restarts,
    with one line and the traceback in the run's errors.log."""
    model = mixed_model
    storage = tmp_path / "runs"
    proc, _ = run_script("train.py", ["--model_dir", str(model), "--output_dir", str(tmp_path / "out"),
                                      "--instance_data_dir", toy_images, "--instance_prompt", "photo of unqtkn toy",
                                      "--num_workers", "1", "--max_failures", "3", "--storage_path", str(storage)])
    assert_one_line_error(proc, f"worker 0: loading the model {model}: ValueError: ")
    assert "fetch or copy it again" in proc.stderr.splitlines()[-1]
    assert "restarting the workers" not in proc.stdout + proc.stderr
    [run] = os.listdir(storage)
    log = (storage / run / "errors.log").read_text()
    entries = [line for line in log.splitlines() if line.startswith("=== ")]
    assert len(entries) == 2  # the one attempt's traceback, then the stop
    assert "Traceback (most recent call last)" in log and entries[1].endswith("a restart cannot fix this: "
                                                                              "stopping the run")
    assert not os.path.exists(tmp_path / "out")


def test_an_actor_that_cannot_load_its_model_fails_in_one_line(mixed_model, tiny_eval_models, toy_images, tmp_path):
    """generate.py's actor pool: the actor's error reaches the terminal as one line naming the model;
    its traceback goes to the output folder's errors.log. evaluate.py on this one-node cluster draws in one task
    instead (scoring.in_one_task): the same line, from the task."""
    out = tmp_path / "images"
    proc, _ = run_script("generate.py", ["--model_dir", str(mixed_model), "--output_dir", str(out), "--prompts", "a toy",
                                         "--num_samples_per_prompt", "2"])
    assert_one_line_error(proc, f"loading the model {mixed_model}: ValueError: ", f"traceback in {out / 'errors.log'}")
    assert "Traceback (most recent call last)" in (out / "errors.log").read_text()
    assert not [name for name in os.listdir(out) if name.endswith(".png")]
    evaluation = tmp_path / "eval"
    proc, _ = run_script("evaluate.py", ["--model_dir", str(mixed_model), "--instance_data_dir", toy_images,
                                         "--class_name", "toy", "--eval_models_dir", tiny_eval_models[1],
                                         "--output_dir", str(evaluation), "--num_samples_per_prompt", "1"])
    log = evaluation / "images" / "tuned" / "errors.log"
    assert_one_line_error(proc, f"loading the model {mixed_model}: ValueError: ", f"traceback in {log}")
    assert "generating in one task" in proc.stderr and "Traceback (most recent call last)" in log.read_text()


def test_any_other_error_in_a_ray_task_is_one_line_and_a_log(ray_session):
    @ray_session.remote
    def lookup():
        return {"a": 1}["b"]

    with pytest.raises(ray_session.exceptions.RayTaskError) as caught:
        ray_session.get(lookup.remote())
    assert errors.user_error_in(caught.value) is None
    message = str(errors.ray_failure(caught.value))
    assert message.startswith("a Ray worker failed: KeyError: 'b' (traceback in ")
    log = message.rsplit("traceback in ", 1)[1].rstrip(")")
    assert "in lookup" in open(log).read()
    os.remove(log)
    assert errors.ray_failure(ValueError("not from Ray")) is None

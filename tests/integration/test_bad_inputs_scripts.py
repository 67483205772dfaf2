"""What users get wrong, through the scripts: one line naming the bad input, said before Ray starts where it can
be, and on Ray (an error no restart can fix, an actor that cannot load its model, any other task error) one line and
a log. (The checks themselves: tests/unit/test_bad_inputs.py.)"""

import os
import shutil
import subprocess
import sys

import pytest

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


@pytest.fixture(scope="module")
def mixed_model(tiny_model, tmp_path_factory):
    """A copy of the tiny model whose UNet config does not fit its weights (a mixed-up copy): it passes
    every check that reads no weights, so only the Ray workers that load it find out."""
    import json

    model = shutil.copytree(tiny_model, tmp_path_factory.mktemp("mixed") / "model")
    config_path = model / "unet" / "config.json"
    config = json.loads(config_path.read_text())
    config["cross_attention_dim"] *= 2
    config_path.write_text(json.dumps(config))
    families.check_model_dir(str(model))
    return model


def test_a_model_whose_files_do_not_fit_stops_the_run_in_one_line_and_a_log(mixed_model, toy_images, tmp_path):
    """The training function meets the bad model: one line naming it and what to do, the traceback in the run's
    errors.log, no model written. In this process (--num_workers 0: the same worker code; that Ray Train does not
    restart workers for such an error, as FailureWatch asks: test_recovery's full disk, whose first run is on a
    worker)."""
    model = mixed_model
    storage = tmp_path / "runs"
    proc, _ = run_script("train.py", ["--model_dir", str(model), "--output_dir", str(tmp_path / "out"),
                                      "--instance_data_dir", toy_images, "--instance_prompt", "photo of unqtkn toy",
                                      "--num_workers", "0", "--storage_path", str(storage)])
    [run] = os.listdir(storage)
    assert_one_line_error(proc, f"training failed: loading the model {model}: ValueError: ",
                          f"traceback in {storage / run / 'errors.log'}")
    assert "fetch or copy it again" in proc.stderr.splitlines()[-1]
    log = (storage / run / "errors.log").read_text()
    assert [line for line in log.splitlines() if line.startswith("=== ")] and "Traceback (most recent call last)" in log
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

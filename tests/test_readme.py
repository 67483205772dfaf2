"""The README's commands run as typed: every shell block parses, every setting it gives the script is
one the script knows, and the "Each step by hand" block runs end to end on the tiny model."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import model_cache_of
from dreambooth.utils import OUTPUT_MARKER, REPO_DIR

README = open(os.path.join(REPO_DIR, "README.md")).read()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)


def script_variables():
    text = open(os.path.join(REPO_DIR, "dreambooth_run.sh")).read()
    return set(re.findall(r'^  "([A-Z_]+)\|', text, re.M))


@pytest.mark.slow
def test_every_shell_block_parses_and_sets_only_what_the_script_reads():
    assert len(BLOCKS) >= 6
    known = script_variables() | {"PATH", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "HF_HUB_OFFLINE"}
    for block in BLOCKS:
        proc = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert proc.returncode == 0, (block, proc.stderr)
        for line in block.splitlines():
            if "./dreambooth_run.sh" in line:
                given = re.findall(r"(?:^|\s)([A-Z_]+)=", line.split("./dreambooth_run.sh")[0])
                assert set(given) <= known, (line, set(given) - known)
    # no placeholder left to fill in, no variable used before any line sets it
    assert "<this repository>" not in README


def by_hand_block():
    return next(b for b in BLOCKS if "# Step 1: cache the pinned model" in b)


# The blocks no test here runs, each with the reason; every other block is run below. A new block
# must be run or listed.
NOT_RUN = {
    "python3 -m venv .venv": "the install: .ci/run runs this very line; the script's line after it is "
                             "test_dreambooth_run's `./dreambooth_run.sh --tiny`",
    "ORIG_MODEL_NAME=sdxl": "the SDXL model and its VAE are downloads; test_dreambooth_run runs the SDXL LoRA "
                            "script on the tiny SDXL model",
    "ray start --head": "needs other machines; the two_node_cluster tests run the script on a 2-node cluster",
    "python sweep.py": "test_sweep runs sweeps of every kind on the tiny model",
    "-m pytest": "the test command itself",
    "ray job submit --working-dir": "needs Ray Jobs' server (ray[default]); test_recovery submits, stops and "
                                    "resubmits train.py as a Ray Job where it is installed",
    "AWS_ENDPOINT_URL=http://minio": "needs a bucket: test_storage runs the same flags against a real S3 server on "
                                     "127.0.0.1 (moto's), test_dreambooth_run the script with DATA_PREFIX there",
}
YOUR_OWN = "INSTANCE_DIR=~/photos/rex CLASS_NAME=dog ./dreambooth_run.sh"


def test_every_block_is_run_or_says_why_not():
    for block in BLOCKS:
        run = block == by_hand_block() or YOUR_OWN in block
        skipped = [marker for marker in NOT_RUN if marker in block]
        assert run != bool(skipped), block


@pytest.mark.slow
def test_each_step_by_hand_runs_as_written_on_the_tiny_model(tmp_path):
    """Only what needs a GPU or the network is changed: the tiny model for sd14 (and for the scoring
    models), the toy photos copied for Step 2's download, fewer images and steps."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a {subject} on a beach\n")
    changes = {
        "DATA_PREFIX=$PWD/data": f"DATA_PREFIX={tmp_path / 'data'}",
        "--model_name=sd14": "--model_name=tiny",
        "python download_example_dataset.py $INSTANCE_DIR": "mkdir -p $INSTANCE_DIR && cp images/toy/*.jpg $INSTANCE_DIR",
        "--num_samples_per_prompt=200": "--num_samples_per_prompt=4",
        "--max_train_steps=200": "--max_train_steps=2",
        "--num_samples_per_prompt=5": "--num_samples_per_prompt=1",
        "--eval_models |": "--eval_models --tiny |",
        "--subject_type=live": f"--subject_type=live --eval_prompts={prompts} --num_samples_per_prompt=1",
    }
    block = by_hand_block()
    for written, run in changes.items():
        assert block.count(written) == 1, written  # the README still says it: the test runs what it shows
        block = block.replace(written, run)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("DATA_PREFIX", None)
    env.pop("ORIG_MODEL_DIR", None)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO_DIR, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = tmp_path / "data"
    subject = data / "subjects" / "example-dog"
    assert len([f for f in os.listdir(data / "images-reg" / "dog") if f.endswith(".png")]) == 4
    assert os.path.isfile(subject / "model-tuned" / OUTPUT_MARKER)
    assert len([f for f in os.listdir(subject / "images-new") if f.endswith(".png")]) == 1
    scores = json.loads((subject / "eval" / "scores.json").read_text())
    assert set(scores["models"]) == {"tuned", "base"}
    # Step 1 cached the model in the one model cache, $DATA_PREFIX/model-orig
    assert os.path.isdir(data / "model-orig") and str(data / "model-orig") in proc.stderr + str(
        json.loads((subject / "model-tuned" / "dreambooth_training.json").read_text()))


@pytest.mark.slow
def test_your_own_subject_blocks_run_as_written_with_the_tiny_model(tmp_path, toy_images, tiny_model,
                                                                    tiny_eval_models):
    """`INSTANCE_DIR=~/photos/rex CLASS_NAME=dog ./dreambooth_run.sh [-- flags]` as typed, in a home
    whose ~/photos/rex holds the photos; the only change: --tiny (no GPU, no download here). Fewer class
    and evaluation images come from the environment, as a user's own settings would, and so do the model caches:
    the session's tiny models (ORIG_MODEL_DIR, EVAL_MODELS_CACHE; Step 1 finds them built). The second block is
    the first with train.py flags after `--`: it alone runs, so the first's command line runs too. (A second
    run after a first in the same DATA_PREFIX: test_dreambooth_run's LoRA run after the full one.)"""
    import shutil

    home = tmp_path / "home"
    shutil.copytree(toy_images, home / "photos" / "rex")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a {subject} on a beach\n")
    env = dict(os.environ, HOME=str(home), DATA_PREFIX=str(tmp_path / "data"), NUM_CLASS_IMAGES="4",
               MAX_TRAIN_STEPS="2", NUM_INFERENCE_STEPS="2", EVAL_PROMPTS=str(prompts), PYTHON=sys.executable,
               ORIG_MODEL_DIR=model_cache_of(tiny_model), EVAL_MODELS_CACHE=tiny_eval_models[0])
    blocks = [b for b in BLOCKS if YOUR_OWN in b]
    assert len(blocks) == 2 and blocks[1] == blocks[0].rstrip() + " -- --gradient_checkpointing --use_8bit_adam\n"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", blocks[1].replace("./dreambooth_run.sh",
                                                                                "./dreambooth_run.sh --tiny")],
                          cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    subject = tmp_path / "data" / "subjects" / "rex"  # named after the photos' folder
    assert os.path.isfile(subject / "model-tuned" / OUTPUT_MARKER) and os.path.isfile(subject / "eval" / "report.md")
    record = json.loads((subject / "model-tuned" / OUTPUT_MARKER).read_text())
    assert record["identity"]["use_8bit_adam"] is True  # the second block's flags reached train.py

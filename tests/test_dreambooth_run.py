"""End to end: the whole Steps 0-6 script on the tiny model, as a user runs it."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from utils import LORA_WEIGHTS_FILE, OUTPUT_MARKER, REPO_DIR


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """Both runs use one DATA_PREFIX, as a user's second run does: the second finds the class images made."""
    return tmp_path_factory.mktemp("dreambooth-run")


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_dreambooth_run_tiny_end_to_end(data_prefix, mode):
    tmp_path = data_prefix
    # The LoRA run keeps the script's 2 workers (DDP of the adapters); full DDP runs in test_train.
    prompts = tmp_path / "eval-prompts.txt"  # Step 6 (full run only) on 2 of its prompts, not 25
    prompts.write_text("a {subject} on a beach\na {subject} in the snow\n")
    env = dict(os.environ, DATA_PREFIX=str(tmp_path), NUM_CLASS_IMAGES="6", MAX_TRAIN_STEPS="4",
               NUM_INFERENCE_STEPS="3", PYTHON=sys.executable, NUM_WORKERS="1" if mode == "full" else "2",
               EVAL_PROMPTS=str(prompts))
    proc = subprocess.run(["bash", "dreambooth_run.sh", "--tiny"] + (["--use_lora", "--skip_eval"] if mode == "lora"
                                                                      else []),
                          cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    # Progress and results, not library noise; one note per actor pool that drew images that they
    # are noise (Step 6 draws the tuned and the base model's images on one pool).
    assert "requires torchvision" not in output
    step6 = len(re.findall(r"(?:tuned|base): \d+ of \d+ images already in [^\n]*; generating [1-9]", output))
    pools = len(re.findall(r"; generating [1-9]", output)) - step6 + (1 if step6 else 0)
    assert output.count("this model has random weights") == pools >= 1
    assert "loss and learning rate plotted in" in output

    reg = sorted(os.listdir(tmp_path / "images-reg"))
    assert reg == sorted([f"photo-of-a-toy-{i:05d}.png" for i in range(6)] + ["grid"])
    new = sorted(f for f in os.listdir(tmp_path / "images-new") if f.endswith(".png"))
    assert len(new) == 5 and os.path.isfile(tmp_path / "images-new" / "grid" / "grid.png")
    assert sorted(os.listdir(tmp_path / "images-own")) == [f"toy-{k}.jpg" for k in range(5)]

    if mode == "lora":  # adapters only; Step 5 generated with them on the base model; no Step 6
        assert "evaluate.py" not in output and "scores of the tuned model" not in output
        assert sorted(os.listdir(tmp_path / "model-tuned")) == sorted([LORA_WEIGHTS_FILE, OUTPUT_MARKER])
        assert "LoRA adapters (rank 4, alpha 4)" in output
        from safetensors.torch import load_file

        lora = load_file(tmp_path / "model-tuned" / LORA_WEIGHTS_FILE)
        ups = [v for k, v in lora.items() if ".up." in k or "lora_B" in k]  # zero until trained
        assert {k.split(".")[0] for k in lora} == {"unet", "text_encoder"} and all(v.abs().sum() > 0 for v in ups)
        return
    # Step 6 (evaluate.py): the tuned model scored beside the base model it was trained from, over
    # 2 prompts + the class prompt, 1 image each, generated and embedded on actor pools
    evaluation = tmp_path / "eval"
    scores = json.loads((evaluation / "scores.json").read_text())
    for label in ("tuned", "base"):
        assert len([f for f in os.listdir(evaluation / "images" / label) if f.endswith(".png")]) == 3
        assert len(os.listdir(evaluation / "grids" / label)) == 3
        overall = scores["models"][label]["overall"]
        assert all(-1 <= overall[k] <= 1 for k in ("dino", "clip_i", "clip_t", "pres")) and overall["div"] is None
        per_prompt = scores["models"][label]["per_prompt"]
        assert set(per_prompt) == {"a unqtkn toy on a beach", "a unqtkn toy in the snow"}
        assert per_prompt["a unqtkn toy on a beach"]["dino"] != per_prompt["a unqtkn toy in the snow"]["dino"]
    assert scores["models"]["tuned"]["overall"] != scores["models"]["base"]["overall"]
    report = (evaluation / "report.md").read_text()
    assert "| tuned |" in report and "| base |" in report and "| a unqtkn toy in the snow |" in report
    assert "done: scores of the tuned model beside the base model in" in output
    from diffusers import DiffusionPipeline

    tuned = DiffusionPipeline.from_pretrained(str(tmp_path / "model-tuned"))
    base_dir = proc.stdout.split("base model: ")[1].splitlines()[0]
    base = DiffusionPipeline.from_pretrained(base_dir)
    for part in ("unet", "text_encoder"):
        a, b = getattr(tuned, part).state_dict(), getattr(base, part).state_dict()
        assert any(not torch.equal(a[k], b[k]) for k in a), part


def test_unknown_argument_is_refused():
    proc = subprocess.run(["bash", "dreambooth_run.sh", "--tinny"], cwd=REPO_DIR, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument '--tinny'" in proc.stderr

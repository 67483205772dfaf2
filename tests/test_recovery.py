"""Runs that are cut short: resume, a SIGKILLed worker, Ctrl-C, interrupted generation."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import torch
import pytest
from PIL import Image

import checkpoint
import generate
import runlog
import train
from utils import LORA_WEIGHTS_FILE, OUTPUT_MARKER, REPO_DIR

ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def checkpoint_steps(run_dir):
    steps = []
    for name in sorted(os.listdir(run_dir)):
        state = os.path.join(run_dir, name, checkpoint.STATE_FILE)
        if os.path.isfile(state):
            steps.append(json.load(open(state))["step"])
    return sorted(steps)


def train_args(tiny_model, toy_images, out, steps, *extra):
    return ["--model_dir", tiny_model, "--output_dir", str(out), "--instance_images_dir", toy_images,
            "--instance_prompt", "photo of unqtkn toy", "--train_batch_size", "1", "--num_workers", "2",
            "--num_epochs", "100", "--max_train_steps", str(steps), *extra]


def worker_pids(since):
    """PIDs of Ray Train worker processes started after `since` (epoch seconds)."""
    boot = time.time() - float(open("/proc/uptime").read().split()[0])
    ticks = os.sysconf("SC_CLK_TCK")
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            started = boot + int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]) / ticks
        except OSError:
            continue
        if cmd.startswith(b"ray::RayTrainWorker") and started >= since - 1:
            pids.append(int(pid))
    return pids


def wait_for(predicate, timeout, proc):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.kill()
    pytest.fail("timed out waiting")


def start_train(args):
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO_DIR, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run_dirs(storage):
    return [os.path.join(storage, d) for d in os.listdir(storage)] if os.path.isdir(storage) else []


@pytest.mark.slow
def test_killed_lora_worker_is_replaced_then_ctrl_c_says_how_to_resume_and_the_rerun_finishes(
        tiny_model, toy_images, tmp_path):
    """A LoRA run: its checkpoints hold only the adapters and their optimizer, and both the
    worker-group restart and the resume load them (full fine-tuning resumes in the tests below)."""
    out, storage = tmp_path / "model-tuned", tmp_path / "ray_results"
    args = train_args(tiny_model, toy_images, out, 45, "--checkpointing_steps", "5", "--logging_steps", "5",
                      "--max_failures", "2", "--use_lora", "--num_workers", "1")
    started = time.time()
    proc = start_train(args)
    wait_for(lambda: any(checkpoint_steps(d) for d in run_dirs(storage)), 180, proc)
    victims = worker_pids(started)
    assert victims, "no Ray Train worker process found"
    os.kill(victims[-1], signal.SIGKILL)
    # Ray restarts the worker group from the newest checkpoint and training goes on past it.
    wait_for(lambda: max([0] + [s for d in run_dirs(storage) for s in checkpoint_steps(d)]) >= 15, 240, proc)
    assert len(run_dirs(storage)) == 1
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "--resume_from_checkpoint latest" in stderr
    assert not os.path.exists(out / LORA_WEIGHTS_FILE)
    done_before = max(s for d in run_dirs(storage) for s in checkpoint_steps(d))

    rerun = subprocess.run([sys.executable, "train.py", *args, "--resume_from_checkpoint", "latest"],
                           cwd=REPO_DIR, env=ENV, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming from" in rerun.stderr and "trained 45 steps" in rerun.stderr
    new_run = max(run_dirs(storage), key=os.path.getmtime)
    steps = checkpoint_steps(new_run)
    assert steps[0] > done_before and steps[-1] == 45
    assert sorted(os.listdir(out)) == sorted([LORA_WEIGHTS_FILE, OUTPUT_MARKER])
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_killed_generation_rerun_gives_exactly_the_uninterrupted_images(ray_session, tiny_model, tmp_path):
    def flags(folder):
        return ["--model_dir", tiny_model, "--output_dir", str(folder), "--prompts", "photo of a toy",
                "--num_samples_per_prompt", "10", "--batch_size", "1", "--num_inference_steps", "20", "--seed", "3"]

    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "generate.py", *flags(cut)], cwd=REPO_DIR, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: os.path.isdir(cut) and len([f for f in os.listdir(cut) if f.endswith(".png")]) >= 2, 180, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    made = [f for f in os.listdir(cut) if f.endswith(".png")]
    assert 2 <= len(made) < 10
    (cut / (made[0] + ".tmp-99999")).write_bytes(b"half an image")  # as a kill mid-write leaves it

    for folder in (cut, tmp_path / "whole"):  # the rerun and the uninterrupted run, on this session's Ray
        generate.main(flags(folder))
    names = sorted(f for f in os.listdir(cut) if f != "grid")
    assert names == sorted(f for f in os.listdir(tmp_path / "whole") if f != "grid")
    assert len(names) == 10
    for name in names:
        a = np.asarray(Image.open(cut / name).convert("RGB"), dtype=int)
        b = np.asarray(Image.open(tmp_path / "whole" / name).convert("RGB"), dtype=int)
        np.testing.assert_allclose(a, b, atol=1)


def final_weights(folder):
    from safetensors.torch import load_file

    return {part: load_file(os.path.join(folder, part, name))
            for part, name in (("unet", "diffusion_pytorch_model.safetensors"), ("text_encoder", "model.safetensors"))}


def logged_losses(result):
    with open(os.path.join(result.path, runlog.METRICS_FILE)) as f:
        return [(m["step"], m["loss"]) for m in map(json.loads, f)]


def test_seeded_run_cut_and_resumed_with_every_gpu_option_ends_with_the_uninterrupted_weights(
        ray_session, tiny_model, toy_images, tmp_path, capsys):
    """channels-last, fused AdamW, fp16 + GradScaler, torch.compile, gradient checkpointing of
    UNet and text encoder, the two-device split and DDP over 2 workers, random flips.

    The same seed gives the same losses (validation sampling in between changes nothing);
    '--resume_from_checkpoint latest' starts fresh when there is nothing to resume, then goes on
    from step 2 with the step count and the LR warm-up where they were; the resumed run ends with
    exactly the weights of the uninterrupted one."""
    options = ["--channels_last", "--fused_adamw", "--mixed_precision", "fp16", "--torch_compile", "aot_eager",
               "--gradient_checkpointing", "--gpus_per_worker", "2", "--random_flip", "--checkpointing_steps", "2",
               "--logging_steps", "1", "--lr", "1e-3", "--lr_warmup_steps", "4", "--seed", "5"]
    sampling = ["--validation_prompt", "photo of unqtkn toy", "--validation_steps", "1", "--num_validation_images",
                "2", "--validation_inference_steps", "2"]
    whole = train.main(train_args(tiny_model, toy_images, tmp_path / "whole", 4, *options))
    capsys.readouterr()
    latest = ["--resume_from_checkpoint", "latest"]
    cut = train.main(train_args(tiny_model, toy_images, tmp_path / "cut", 2, *options, *sampling, *latest))
    assert "starting fresh" in capsys.readouterr().err  # no checkpoint yet
    assert logged_losses(cut) == logged_losses(whole)[:2]
    assert sorted(os.listdir(os.path.join(cut.path, "validation"))) == ["step-1", "step-2", "timeline.png"]
    resumed = train.main(train_args(tiny_model, toy_images, tmp_path / "cut", 4, *options, *latest))
    assert resumed.metrics["step"] == whole.metrics["step"] == 4
    assert logged_losses(resumed) == logged_losses(whole)[2:]
    # The schedule went on: 4 steps of warm-up in all, not 2 + 2 restarted ones.
    assert cut.metrics["lr"] == pytest.approx(1e-3 * 2 / 4)
    assert resumed.metrics["lr"] == pytest.approx(1e-3)
    assert checkpoint_steps(resumed.path) == [4]  # only steps 3 and 4 ran in the resumed run
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "cut")
    base = final_weights(tiny_model)
    for part in a:
        assert any(not torch.equal(v, base[part][k]) for k, v in a[part].items())  # it trained
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), (part, k)

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


def test_resume_latest_starts_fresh_then_continues_step_count_and_lr_schedule(ray_session, tiny_model, toy_images,
                                                                              tmp_path, capsys):
    out = tmp_path / "model-tuned"
    common = ["--lr_warmup_steps", "4", "--checkpointing_steps", "2", "--logging_steps", "1",
              "--resume_from_checkpoint", "latest"]
    first = train.main(train_args(tiny_model, toy_images, out, 2, *common))
    assert first.metrics["step"] == 2
    assert "starting fresh" in capsys.readouterr().err  # no checkpoint yet
    resumed = train.main(train_args(tiny_model, toy_images, out, 4, *common))
    assert resumed.metrics["step"] == 4
    # The schedule went on: 4 steps of warm-up in all, not 2 + 2 restarted ones.
    assert resumed.metrics["lr"] == pytest.approx(5e-6)
    assert first.metrics["lr"] == pytest.approx(5e-6 * 2 / 4)
    # Only steps 3 and 4 ran in the second run: its one checkpoint is the final one.
    assert checkpoint_steps(resumed.path) == [4]


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
    args = train_args(tiny_model, toy_images, out, 60, "--checkpointing_steps", "5", "--logging_steps", "5",
                      "--max_failures", "2", "--use_lora")
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
    assert "resuming from" in rerun.stderr and "trained 60 steps" in rerun.stderr
    new_run = max(run_dirs(storage), key=os.path.getmtime)
    steps = checkpoint_steps(new_run)
    assert steps[0] > done_before and steps[-1] == 60
    assert sorted(os.listdir(out)) == sorted([LORA_WEIGHTS_FILE, OUTPUT_MARKER])
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_killed_generation_rerun_gives_exactly_the_uninterrupted_images(tiny_model, tmp_path):
    def command(folder):
        return [sys.executable, "generate.py", "--model_dir", tiny_model, "--output_dir", str(folder),
                "--prompts", "photo of a toy", "--num_samples_per_prompt", "10", "--batch_size", "1",
                "--num_inference_steps", "20", "--seed", "3"]

    cut = tmp_path / "cut"
    proc = subprocess.Popen(command(cut), cwd=REPO_DIR, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: os.path.isdir(cut) and len([f for f in os.listdir(cut) if f.endswith(".png")]) >= 2, 180, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    made = [f for f in os.listdir(cut) if f.endswith(".png")]
    assert 2 <= len(made) < 10
    (cut / (made[0] + ".tmp-99999")).write_bytes(b"half an image")  # as a kill mid-write leaves it

    for folder in (cut, tmp_path / "whole"):
        subprocess.run(command(folder), cwd=REPO_DIR, env=ENV, check=True, capture_output=True, timeout=300)
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


def test_same_seed_same_losses_and_validation_samples_change_nothing(ray_session, tiny_model, toy_images,
                                                                       tmp_path):
    sampling = ["--validation_prompt", "photo of unqtkn toy", "--validation_steps", "3", "--num_validation_images",
                "1", "--validation_inference_steps", "2"]
    runs = [train.main(train_args(tiny_model, toy_images, tmp_path / f"m{k}", 6, "--num_workers", "1",
                                  "--random_flip", "--logging_steps", "2", "--seed", "3", "--lr", "1e-4",
                                  *(sampling if k else [])))
            for k in range(2)]
    assert sorted(os.listdir(os.path.join(runs[1].path, "validation"))) == ["step-3", "step-6", "timeline.png"]
    assert logged_losses(runs[0]) == logged_losses(runs[1])
    assert [s for s, _ in logged_losses(runs[0])] == [2, 4, 6]


def test_resume_with_every_gpu_option_ends_with_the_uninterrupted_weights(ray_session, tiny_model, toy_images,
                                                                          tmp_path):
    """channels-last, fused AdamW, fp16 + GradScaler, torch.compile, gradient checkpointing of
    UNet and text encoder, the two-device split and DDP over 2 workers: a run cut at step 2 and
    resumed ends exactly where the uninterrupted run does."""
    options = ["--channels_last", "--fused_adamw", "--mixed_precision", "fp16", "--torch_compile", "aot_eager",
               "--gradient_checkpointing", "--gpus_per_worker", "2", "--random_flip", "--checkpointing_steps", "2",
               "--logging_steps", "1", "--lr", "1e-3", "--seed", "5"]
    whole = train.main(train_args(tiny_model, toy_images, tmp_path / "whole", 4, *options))
    train.main(train_args(tiny_model, toy_images, tmp_path / "cut", 2, *options))
    resumed = train.main(train_args(tiny_model, toy_images, tmp_path / "cut", 4, *options,
                                    "--resume_from_checkpoint", "latest"))
    assert resumed.metrics["step"] == whole.metrics["step"] == 4
    assert logged_losses(resumed) == logged_losses(whole)[2:]
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "cut")
    base = final_weights(tiny_model)
    for part in a:
        assert any(not torch.equal(v, base[part][k]) for k, v in a[part].items())  # it trained
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), (part, k)

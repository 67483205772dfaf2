"""The preflight's memory and GPU checks as a process: a card too small for the run, and GPUs Ray counts but torch
cannot use, stop it before Ray starts."""

import os
import re
import subprocess
import sys

import pytest
import torch

from dreambooth import errors
from dreambooth.cluster import raycluster
from dreambooth.cluster import torch_gpus
from dreambooth.files import REPO_DIR


def test_the_preflight_stops_before_ray_when_the_stated_card_is_too_small(toy_images, tmp_path):
    proc = subprocess.run([sys.executable, "preflight.py", "--photos_dir", toy_images, "--class_name", "toy",
                           "--data_prefix", str(tmp_path), "--model_name", "sd21", "--gpu_memory", "24", "--",
                           "--train_batch_size", "2"], cwd=REPO_DIR, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Ray:" not in proc.stderr
    assert re.fullmatch(r"error: the full fine-tune of SD 2.x at 768 px, 2 \+ 2 images a step, needs about 26.7 GiB"
                        r" .* add --gradient_checkpointing \(about 19.1 GiB; README, Requirements\)\n",
                        proc.stderr), proc.stderr


def test_gpus_ray_counts_but_torch_cannot_use_stop_the_preflight(tmp_path, toy_images):
    """A node whose Ray counts a GPU that torch cannot open (here: a CPU machine told it has one, as a
    machine whose driver is older than torch's CUDA build looks): one line before Step 1, which names the
    cause by torch's build: a CUDA build wants a newer driver, a CPU-only build (CI's) the CUDA build."""
    head, address = raycluster.start_ray_head(tmp_path / "head.log", extra=["--num-cpus=2", "--num-gpus=1"])
    try:
        proc = subprocess.run([sys.executable, "preflight.py", "--photos_dir", toy_images, "--class_name", "toy",
                               "--data_prefix", str(tmp_path), "--model_name", "sd15", "--", "--use_lora"],
                              cwd=REPO_DIR, capture_output=True, text=True, timeout=180,
                              env=dict(os.environ, RAY_ADDRESS=address))
    finally:
        raycluster.stop_ray_head(head)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-2000:]
    driver = (r"error: node \S+: Ray counts 1 GPU\(s\) but torch \S+ sees 0 \(.*\): install an NVIDIA driver for CUDA "
              r"[\d.]+ or newer .*")
    cpu_only = (r"error: node \S+: Ray counts 1 GPU\(s\) but torch \S+ sees 0: it is a CPU-only build; install "
                r"torch's CUDA build \(https://pytorch.org/get-started/locally/\)")
    assert re.fullmatch(cpu_only if torch.version.cuda is None else driver, last), last
    # the other build's line, from the same check on a node's report
    report = {"node": "10.0.0.2", "gpus": 1, "cards": [], "torch": "2.13.0", "warning": None}
    for cuda, expected in ((None, cpu_only), ("13.0", driver)):
        with pytest.raises(errors.UserError) as err:
            torch_gpus.check_drivers([{**report, "cuda": cuda}])
        assert re.fullmatch(expected, f"error: {err.value}"), err.value

"""benchmarks/gpu_check.sh on the tiny model (the GPU acceptance sequence, dry run on CPU), and the
side-by-side table of benchmarks/bench.py that it prints."""

import os
import sys

import pytest
from support import run_script

from dreambooth.files import REPO_DIR

REPO = REPO_DIR


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory, shared_ray_cluster):
    """(its work folder, its stderr) of benchmarks/gpu_check.sh --model tiny on the session's cluster, which
    succeeded: one run for the module's tests."""
    folder = tmp_path_factory.mktemp("gpu-check")
    run = run_script(["bash", "benchmarks/gpu_check.sh", "--model", "tiny", "--work", str(folder / "work")], folder,
                     {"PYTHON": sys.executable})
    assert run.returncode == 0, run.stderr[-4000:]
    return run.folder / "work", run.stderr


def table_rows(text):
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| measure", "| ---"))]
    return {cells[0]: cells[1:] for cells in rows}


def test_gpu_check_dry_run_kills_a_worker_resumes_and_generates(gpu_check):
    work, log = gpu_check
    assert "killed the train worker after checkpoint 10" in log
    # The killed worker was replaced (training went past it), and Ctrl-C printed how to resume.
    first_run = (work / "train-1.log").read_text()
    assert "step=15" in first_run and "rerun the same command with --resume_from_checkpoint latest" in first_run
    # The death was announced in one line (no traceback) and logged in the run's errors.log.
    assert "worker 0 failed: " in first_run and "restarting the workers from the newest checkpoint (1 of " \
        "--max_failures 3" in first_run and "Traceback" not in first_run
    table = table_rows((work / "table.md").read_text())
    assert table["wall time: 4 train to step 20, worker killed at 10, Ctrl-C at 20"][2] == "exit 130"
    for row in ("wall time: 1 build random tiny model", "wall time: 5 resume from latest to step 60 + save",
                "wall time: 6 generate 4 images from the tuned model",
                "plain loop, full, gradient checkpointing: peak memory"):
        assert float(table[row][0]) > 0, row
    assert len([f for f in os.listdir(work / "new") if f.endswith(".png")]) == 4


def test_bench_prints_plain_ray_and_generation_rows(gpu_check):
    work, _ = gpu_check
    table = {name: float(cells[0]) for name, cells in table_rows((work / "bench.md").read_text()).items()}
    for variant in ("full",):  # the dry run benches only this one
        assert table[f"plain loop, {variant}"] > 0 and table[f"Ray Train 1 worker, {variant}"] > 0
        overhead = 100 * (1 - table[f"Ray Train 1 worker, {variant}"] / table[f"plain loop, {variant}"])
        assert abs(table[f"Ray overhead, {variant}"] - overhead) < 2  # from figures rounded to three digits
    assert table["generation batch 8 (2 steps, actor pool)"] > 0
    assert table["start-up: Ray start"] >= 0


def test_gpu_probe_dry_run_profiles_every_arm_on_cpu():
    """benchmarks/gpu_probe.py's CPU dry run: the same arms, timing and profile summary the GPU run prints."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import gpu_probe

    arms = ["base", "batch4", "no_channels_last", "channels_last", "cudnn_benchmark", "cached", "vae_bf16", "compiled"]
    results = dict((arm.name, r) for arm, r in gpu_probe.main(  # compiled: dynamo capture (the GPU run: inductor)
        ["--model", "tiny", "--steps", "1", "--warmup", "1", "--profile_steps", "1", "--mixed_precision", "bf16",
         "--compiled_backend", "eager", "--keep_going", "--resolution", "32",  # (bf16 convolutions are slow on a CPU)
         "--arms", ",".join(arms)]))
    assert list(results) == arms
    for name, r in results.items():
        assert r["error"] is None and r["amp"] == "bf16", name
        assert r["images_per_s"] > 0 and r["kernels"] > 0 and r["busy"] is None, name  # no GPU-busy figure on CPU
        assert abs(sum(r["kinds"].values()) - 1) < 1e-6 and r["kinds"]["conv/GEMM"] > 0, name
    assert not results["base"]["channels_last"] and results["channels_last"]["channels_last"]  # train.py's CPU rule
    assert results["cached"]["kernels"] < results["base"]["kernels"]  # no VAE encoder, no text-encoder backward
    # a failing arm (--keep_going) is its row
    failed = gpu_probe.row(gpu_probe.Arm("base"), {"error": "OutOfMemoryError: CUDA out of memory"})
    assert "failed: OutOfMemoryError" in failed
    assert gpu_probe.kind_of("sm90_xmma_gemm_bf16") == "conv/GEMM" and gpu_probe.kind_of("flash_fwd_kernel") == \
        "attention" and gpu_probe.kind_of("multi_tensor_apply_kernel") == "optimizer"


def test_vs_diffusers_dry_run_runs_ours_with_the_gpu_settings_on_one_cluster(tmp_path, shared_ray_cluster):
    """benchmarks/vs_diffusers.py's GPU flags on the tiny model: ours runs on one running cluster (--ray_cluster: the
    one RAY_ADDRESS names, the session's, else one it starts), and the reference's command line carries the same
    settings. At 32 px: bf16 convolutions are slow on a CPU (a step at 64 px took 2.9 s, at 32 px 0.8 s)."""
    run = run_script([sys.executable, "benchmarks/vs_diffusers.py", "--dry_run", "--model", "tiny", "--resolution",
                      "32", "--steps", "20", "--rounds", "1", "--mixed_precision", "bf16", "--train_batch_size", "2",
                      "--reference_dataloader_workers", "4", "--ray_cluster", "--work_dir", str(tmp_path / "work")],
                     tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert not (tmp_path / "work" / "ray-head.log").exists()  # (RAY_ADDRESS's cluster joined: no head of its own)
    out = run.stdout
    command = out.split("reference command (not run): ")[1].splitlines()[0]
    for flag in ("--mixed_precision bf16", "--train_batch_size 2", "--dataloader_num_workers 4", "--resolution 32",
                 "--with_prior_preservation", "--train_text_encoder"):
        assert flag in command, flag
    assert "batch=2+2 mixed_precision=bf16 ours on one running Ray cluster" in out
    assert "warm-up" not in out  # (a comparison's: a dry run compares nothing)
    [row] = [line for line in out.splitlines() if line.startswith("| 1 | ours |")]
    wall, per_step, fixed = (float(cell) for cell in row.strip("|").split("|")[2:5])
    assert per_step > 0 and 0 < fixed < wall
    log = (run.folder / "work" / "log-ours-1").read_text()
    assert "autocast torch.bfloat16" in log and "batch 2 instance + 2 class" in log

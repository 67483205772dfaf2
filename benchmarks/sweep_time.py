"""What a two-trial sweep costs: sweep.py's wall time and the machine's CPU-seconds, early stopping on and off.

The sweep of tests/integration/test_sweep_ray.py's Flux.1 test: the tiny Flux.1 dev model (built here, cache_model.py --tiny --arch
flux), the toy photos, two learning rates one trial at a time, LoRA, step counts 1 and 2, one evaluation prompt of two
images, the class images already there. Each sweep starts its own Ray (a temp folder of its own); the CPU-seconds are
the whole machine's (/proc/stat), so run it with nothing else on the machine. Run it from two checkouts to compare
them (--repo), one after the other.

    python benchmarks/sweep_time.py [--repo PATH] [--early_stopping on,off] [--work_dir DIR]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--repo", default=ROOT, help="the checkout whose sweep.py runs (default: this one)")
    parser.add_argument("--early_stopping", default="on,off", help="the modes to run, in order (default on,off)")
    parser.add_argument("--work_dir", default=None, help="default: a temporary folder, removed at the end")
    return parser.parse_args(argv)


def busy_seconds():
    """The CPU-seconds every core of the machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")


def sweep(repo, models, work, mode):
    """(wall s, CPU-s, training runs, the output's last line) of one sweep.py run with --early_stopping mode."""
    out = os.path.join(work, f"sweep-{mode}")
    shutil.rmtree(out, ignore_errors=True)
    classes = os.path.join(out, "best-sweep", "class-images", "toy")
    os.makedirs(classes)
    photos = os.path.join(ROOT, "images", "toy")
    for name in sorted(os.listdir(photos))[:2]:
        shutil.copy(os.path.join(photos, name), classes)
    prompts = os.path.join(out, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("a {subject} on a beach\n")
    command = [sys.executable, "sweep.py", "--model_dir", models[0], "--output_dir", os.path.join(out, "best"),
               "--instance_data_dir", photos, "--class_name", "toy", "--eval_models_dir", models[1],
               "--eval_prompts", prompts, "--eval_images_per_prompt", "2", "--num_inference_steps", "2",
               "--num_class_images", "2", "--sweep_max_train_steps", "1,2", "--num_workers", "1", "--use_lora",
               "--sweep_learning_rate", "1e-5,1e-3", "--early_stopping", mode, "--max_concurrent_trials", "1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # (short: Ray's socket paths)
    began, cpu = time.perf_counter(), busy_seconds()
    proc = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - began, busy_seconds() - cpu
    shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    output = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"sweep.py --early_stopping {mode} failed:\n{output[-3000:]}")
    return wall, cpu, output.count(") plan: "), output.strip().splitlines()[-1]


def main(argv=None):
    args = parse_args(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="sweep-time-")
    try:
        models = [subprocess.run([sys.executable, "cache_model.py", "--model_dir", os.path.join(work, folder), *flags],
                                 cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                  for folder, flags in (("model", ["--tiny", "--arch", "flux"]), ("eval", ["--eval_models", "--tiny"]))]
        print(f"| sweep.py of {args.repo} | wall s | CPU-s | training runs | outcome |\n| --- | ---: | ---: | ---: | --- |")
        for mode in args.early_stopping.split(","):
            wall, cpu, runs, last = sweep(args.repo, models, work, mode)
            print(f"| --early_stopping {mode} | {wall:.1f} | {cpu:.0f} | {runs} | {last.split(';')[0]} |", flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

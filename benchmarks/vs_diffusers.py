"""train.py against diffusers' examples/dreambooth/train_dreambooth.py, side by side on this machine.

Both tools train the same random SD 1.x model (cache_model.py --random_model small) on the toy
photos and 5 class images at 256 px, 1 instance + 1 class image per step, text encoder trained,
fp32, learning rate 5e-6, seed 0; ours with --num_workers 1.

The step is timed inside each run, so start-up never leaks into it: the time from the end of
step 10 to the end of the last step, divided by the steps between. Ours reads it from the run's
metrics.jsonl (a wall-clock time per logging window, written by the worker); the reference's
from its progress bar, each update time-stamped as it arrives on the pipe. Fixed cost is the
rest of the run's wall time. The tools alternate A B, B A, ... so that the machine's drift falls
on both; the ratio of each round's pair is reported, then the mean and median. Before the
rounds each tool runs once, not counted (its first run reads its packages from disk; ours on a new
cluster also starts the cluster's helper actors, once); a dry run goes without.

    python benchmarks/vs_diffusers.py --reference /path/to/train_dreambooth.py [--rounds 4] [--steps 70]
    # the GPU comparison (same flags to both tools):
    python benchmarks/vs_diffusers.py --reference ... --model sd15 --resolution 512 \
        --mixed_precision bf16 --train_batch_size 2 --reference_dataloader_workers 4 --ray_cluster
    # the CPU dry run the test suite takes (ours only; prints the reference's command line):
    python benchmarks/vs_diffusers.py --dry_run --model tiny --resolution 32 --steps 20 --rounds 1

The reference needs accelerate and torchvision (not in requirements.txt): --reference_python is
a Python that has them besides diffusers and transformers. Differences that remain between the
tools are the reference's own: it reads loss.item() every step (a sync), uses foreach AdamW where
ours is fused on a GPU, and keeps its VAE in the mixed-precision dtype; --reference_dataloader_workers
gives its data loading worker processes so that is not its handicap.

--ray_cluster starts one local Ray cluster before the rounds (or takes the one RAY_ADDRESS names) and every
run of ours joins it, as dreambooth_run.sh's steps and a cluster's users do; without it each run of ours starts
its own (the cold case): both fixed costs are worth reporting.
"""

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dreambooth.cluster import raycluster  # noqa: E402

FIRST_TIMED_STEP = 10
PROMPT, CLASS_PROMPT = "photo of unqtkn toy", "photo of a toy"
REFERENCE_BAR = re.compile(r"Steps:.*?\|\s*(\d+)/(\d+) \[")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--reference", help="path to diffusers' train_dreambooth.py")
    parser.add_argument("--reference_python", default=sys.executable,
                        help="Python that runs the reference (with accelerate and torchvision)")
    parser.add_argument("--rounds", type=int, default=4, help="pairs of runs (default 4)")
    parser.add_argument("--steps", type=int, default=70,
                        help=f"steps per run; the step is timed from step {FIRST_TIMED_STEP} to the last (default 70)")
    parser.add_argument("--work_dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "dreambooth-vs-diffusers"))
    parser.add_argument("--model", choices=["tiny", "small", "sd15"], default="small",
                        help="random weights of that size (cache_model.py; default small)")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    parser.add_argument("--train_batch_size", type=int, default=1, help="instance images per step (+ as many class)")
    parser.add_argument("--reference_dataloader_workers", type=int, default=0,
                        help="the reference's --dataloader_num_workers (give it 4 on a GPU machine)")
    parser.add_argument("--ray_cluster", action="store_true",
                        help="one local Ray cluster for all runs of ours (see above)")
    parser.add_argument("--dry_run", action="store_true",
                        help="run ours only; print the reference's command instead of running it")
    args = parser.parse_args(argv)
    if args.steps <= FIRST_TIMED_STEP or args.steps % 10:
        parser.error(f"--steps must be a multiple of 10 above {FIRST_TIMED_STEP}")
    if not args.dry_run and not args.reference:
        parser.error("--reference is required (or --dry_run)")
    return args


def prepare(work, size):
    """The random model and the photos, in work emptied first; returns the model folder."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "own"))
    which = ["--tiny"] if size == "tiny" else ["--random_model", size]
    out = subprocess.run([sys.executable, "cache_model.py", "--model_dir", os.path.join(work, "cache"), *which],
                         cwd=ROOT, check=True, capture_output=True, text=True)
    model = out.stdout.strip().splitlines()[-1]
    for photo in glob.glob(os.path.join(ROOT, "images", "toy", "*.jpg")):
        shutil.copy(photo, os.path.join(work, "own"))
    return model


def draw_class_images(work, model, resolution):
    """5 class images drawn by the model (on the cluster of ours when there is one: RAY_ADDRESS), and a copy of them
    for the reference."""
    subprocess.run([sys.executable, "generate.py", "--model_dir", model, "--output_dir", os.path.join(work, "class"),
                    "--prompts", CLASS_PROMPT, "--num_samples_per_prompt", "5", "--num_inference_steps", "2",
                    "--resolution", str(resolution)], cwd=ROOT, check=True, capture_output=True)
    shutil.rmtree(os.path.join(work, "class", "grid"), ignore_errors=True)
    # the same images for the reference, without generate.py's record of what drew them: the
    # reference opens every file in its class folder as an image
    os.makedirs(os.path.join(work, "class-ref"))
    for image in glob.glob(os.path.join(work, "class", "*.png")):
        shutil.copy(image, os.path.join(work, "class-ref"))


def run_ours(model, work, steps, log, args):
    storage = os.path.join(work, "ray_results")
    shutil.rmtree(storage, ignore_errors=True)
    command = [sys.executable, "train.py", "--model_dir", model, "--output_dir", os.path.join(work, "out-ours"),
               "--overwrite", "--storage_path", storage, "--instance_data_dir", os.path.join(work, "own"),
               "--instance_prompt", PROMPT, "--class_data_dir", os.path.join(work, "class"),
               "--class_prompt", CLASS_PROMPT, "--resolution", str(args.resolution),
               "--train_batch_size", str(args.train_batch_size), "--mixed_precision", args.mixed_precision,
               "--num_workers", "1", "--learning_rate", "5e-6", "--max_train_steps", str(steps),
               "--checkpointing_steps", "100000", "--logging_steps", "10", "--seed", "0"]
    start = time.time()
    with open(log, "w") as out:
        subprocess.run(command, cwd=ROOT, check=True, stdout=out, stderr=subprocess.STDOUT)
    wall = time.time() - start
    (metrics,) = glob.glob(os.path.join(storage, "*", "metrics.jsonl"))
    ends = {row["step"]: row["time"] for row in map(json.loads, open(metrics))}
    return wall, ends[FIRST_TIMED_STEP], ends[steps]


def reference_command(model, work, steps, args):
    """diffusers' train_dreambooth.py with the settings of ours (its documented flags)."""
    return [args.reference_python, os.path.abspath(args.reference or "train_dreambooth.py"),
            "--pretrained_model_name_or_path", model, "--output_dir", os.path.join(work, "out-ref"),
            "--instance_data_dir", os.path.join(work, "own"), "--instance_prompt", PROMPT,
            "--with_prior_preservation", "--class_data_dir", os.path.join(work, "class-ref"),
            "--class_prompt", CLASS_PROMPT, "--num_class_images", "5", "--resolution", str(args.resolution),
            "--train_batch_size", str(args.train_batch_size), "--mixed_precision", args.mixed_precision,
            "--dataloader_num_workers", str(args.reference_dataloader_workers), "--train_text_encoder",
            "--learning_rate", "5e-6", "--lr_scheduler", "constant", "--lr_warmup_steps", "0",
            "--max_train_steps", str(steps), "--checkpointing_steps", "100000", "--seed", "0"]


def run_reference(model, work, steps, log, args):
    command = reference_command(model, work, steps, args)
    ends, text = {}, b""
    start = time.time()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.PIPE)
        while chunk := process.stderr.read1(65536):
            now = time.time()
            out.write(chunk)
            text += chunk
            *updates, text = re.split(rb"[\r\n]", text)
            for line in updates:
                match = REFERENCE_BAR.search(line.decode(errors="replace"))
                if match:
                    ends.setdefault(int(match.group(1)), now)
        if process.wait():
            sys.exit(f"vs_diffusers: the reference failed (exit {process.returncode}); log in {log}")
    wall = time.time() - start
    return wall, ends[FIRST_TIMED_STEP], ends[steps]


def start_ray_cluster(work):
    """A local Ray head for the runs of ours (RAY_ADDRESS set for them): (process, address); None where RAY_ADDRESS
    names a running cluster already (they join that one)."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    try:
        head, address = raycluster.start_ray_head(os.path.join(work, "ray-head.log"))
    except RuntimeError as err:
        sys.exit(f"vs_diffusers: {err}")
    os.environ["RAY_ADDRESS"] = address
    return head, address


def main(argv=None):
    args = parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # Each tool's imports from bytecode, as an installed one runs: the uncounted runs write what is missing (with
    # PYTHONDONTWRITEBYTECODE set, every process of either tool compiled its imports at every run: 2026-11-30, the
    # reference's fixed cost 15-18 s instead of 8-9, ours 48 s instead of 17)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    model = prepare(args.work_dir, args.model)
    # (the cluster started before the class images are drawn: generate.py joins it rather than starting one more)
    cluster = start_ray_cluster(args.work_dir) if args.ray_cluster else None
    tools = {
        "reference": lambda log, steps=args.steps: run_reference(model, args.work_dir, steps, log, args),
        "ours": lambda log, steps=args.steps: run_ours(model, args.work_dir, steps, log, args),
    }
    if args.dry_run:
        del tools["reference"]
        print("reference command (not run): " + " ".join(reference_command(model, args.work_dir, args.steps, args)))
    try:
        draw_class_images(args.work_dir, model, args.resolution)
        compare(args, tools)
    finally:
        if cluster:
            raycluster.stop_ray_head(cluster[0])
            os.environ.pop("RAY_ADDRESS", None)


def compare(args, tools):
    timed = args.steps - FIRST_TIMED_STEP
    print(f"model={args.model} resolution={args.resolution} batch={args.train_batch_size}+{args.train_batch_size} "
          f"mixed_precision={args.mixed_precision} ours on {'one running' if args.ray_cluster else 'its own'} "
          f"Ray cluster; step timed from step {FIRST_TIMED_STEP} to {args.steps}; logs in {args.work_dir}")
    # Not counted: the first run of each tool reads its packages from disk, and the first training
    # job on a new cluster starts Ray Data's and Ray Train's cluster-wide helper actors (once per
    # cluster: dreambooth_run.sh's earlier steps have started them by Step 4). A dry run compares
    # nothing: it goes without.
    if not args.dry_run:
        warm = {tool: run(os.path.join(args.work_dir, f"log-{tool}-warm-up"), FIRST_TIMED_STEP)[0]
                for tool, run in tools.items()}
        print("warm-up runs, not counted (" + ", ".join(f"{tool} {wall:.1f} s" for tool, wall in warm.items())
              + f" for {FIRST_TIMED_STEP} steps)")
    print("| round | tool | wall s | s/step | fixed s |")
    print("| --- | --- | ---: | ---: | ---: |")
    rows = []
    for round_ in range(1, args.rounds + 1):
        order = [tool for tool in (["reference", "ours"] if round_ % 2 else ["ours", "reference"]) if tool in tools]
        row = {}
        for tool in order:
            wall, first, last = tools[tool](os.path.join(args.work_dir, f"log-{tool}-{round_}"))
            step = (last - first) / timed
            row[tool] = (step, wall - args.steps * step)
            print(f"| {round_} | {tool} | {wall:.1f} | {step:.3f} | {wall - args.steps * step:.1f} |", flush=True)
        rows.append(row)
    if "reference" not in tools:
        print(f"ours: {statistics.mean(row['ours'][0] for row in rows):.3f} s/step, "
              f"fixed {statistics.mean(row['ours'][1] for row in rows):.1f} s (dry run: no reference)")
        return
    ratios = [row["ours"][0] / row["reference"][0] for row in rows]
    mean = {tool: statistics.mean(row[tool][0] for row in rows) for tool in tools}
    fixed = {tool: statistics.mean(row[tool][1] for row in rows) for tool in tools}
    print(f"ratio ours / reference per round: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"per step: ours {mean['ours']:.3f} s, reference {mean['reference']:.3f} s; ratio of means "
          f"{mean['ours'] / mean['reference']:.3f}, median of round ratios {statistics.median(ratios):.3f}; "
          f"fixed: ours {fixed['ours']:.1f} s, reference {fixed['reference']:.1f} s")


if __name__ == "__main__":
    main()

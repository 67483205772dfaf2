"""How long each checkpoint to a bucket stops the training loop: train.py --checkpoint_upload sync against async.

Both train the same random model (cache_model.py --random_model small by default) on the toy photos, its checkpoints
going to a local S3 server (moto, as the test suite's), a checkpoint every --checkpointing_steps steps and a logged
row every step. The row after each checkpoint in metrics.jsonl says how long the step loop stopped for it
(checkpoint_s: its save, and its upload when the loop waits for it); the time from step 1's row to the last step's says what the
uploads cost the steps besides (on one machine the S3 server's work competes with them). The modes alternate
(sync, async, async, sync, ...) so that the machine's drift falls on both.

    python benchmarks/checkpoint_stall.py [--model small] [--steps 30] [--checkpointing_steps 5] [--rounds 2]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="small", help="tiny, or a --random_model size (default small)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpointing_steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (default 2)")
    parser.add_argument("--work_dir", default=None, help="default: a temporary folder, removed at the end")
    return parser.parse_args(argv)


def stall(rows, last):
    """(seconds the step loop stopped per checkpoint, the steps' wall time from step 1 to the last) from a run's
    metrics.jsonl rows: the checkpoint_s of the window after each checkpoint (its save, and its upload when the loop
    waits for it)."""
    stops = [row["checkpoint_s"] for row in rows if "checkpoint_s" in row]
    times = {row["step"]: row["time"] for row in rows if "loss" in row}
    return statistics.mean(stops), times[last] - times[1]


def run(model, bucket, name, mode, args):
    """One train.py run into the bucket; its metrics.jsonl rows."""
    from dreambooth import storage
    from dreambooth.planning import checkpoints

    output = f"s3://{bucket}/{name}"
    command = [sys.executable, "train.py", "--model_dir", model, "--output_dir", output, "--instance_data_dir",
               os.path.join(ROOT, "images", "toy"), "--instance_prompt", "photo of unqtkn toy", "--num_workers", "1",
               "--max_train_steps", str(args.steps), "--checkpointing_steps", str(args.checkpointing_steps),
               "--logging_steps", "1", "--checkpoint_upload", mode, "--keep_checkpoints"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = storage.join(f"s3://{bucket}", "ray_results")
    [run_name] = [r for r in storage.listdir(runs) if r.startswith(name + "-")]
    text = storage.read_bytes(storage.join(runs, run_name, "metrics.jsonl")).decode()
    kept = list(checkpoints.run_checkpoints(storage.join(runs, run_name)))
    if len(kept) != 1:  # (--checkpoints_total_limit 1, the default, applies to uploads in the background too)
        raise SystemExit(f"{name}: {len(kept)} checkpoints kept in the bucket, not 1")
    size = sum(storage.size(storage.join(kept[0], f)) for f in storage.listdir(kept[0]))
    return [json.loads(line) for line in text.splitlines()], size


def main(argv=None):
    args = parse_args(argv)
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # (not a line per request)

    work = args.work_dir or tempfile.mkdtemp(prefix="checkpoint-stall-")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        measure(args, work, server)
    finally:
        server.stop()
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def measure(args, work, server):
    """The rounds of runs against the started S3 server, their table printed."""
    import boto3

    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}", XDG_CACHE_HOME=os.path.join(work, "cache"))
    boto3.client("s3").create_bucket(Bucket="bench")
    which = ["--tiny"] if args.model == "tiny" else ["--random_model", args.model]
    model = subprocess.run([sys.executable, "cache_model.py", "--model_dir", os.path.join(work, "model"), *which],
                           cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    rows = ["| round | upload | loop stopped per checkpoint s | steps 1 to last s | checkpoint MB |",
            "| ---: | --- | ---: | ---: | ---: |"]
    stalls = {"sync": [], "async": []}
    for k in range(args.rounds):
        for mode in (("sync", "async") if k % 2 == 0 else ("async", "sync")):
            metrics, size = run(model, "bench", f"{mode}-{k}", mode, args)
            lost, span = stall(metrics, args.steps)
            stalls[mode].append((lost, span))
            rows.append(f"| {k + 1} | {mode} | {lost:.3f} | {span:.1f} | {size / 2**20:.1f} |")
            print(rows[-1], flush=True)
    means = {mode: [statistics.mean(values) for values in zip(*runs)] for mode, runs in stalls.items()}
    rows.append(f"| **mean** | sync / async | **{means['sync'][0]:.3f} / {means['async'][0]:.3f}** | "
                f"{means['sync'][1]:.1f} / {means['async'][1]:.1f} | |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""A run whose checkpoints go to a bucket (a local S3 server), stopped and resumed from there, ends like the
uninterrupted run."""

import glob
import os
import subprocess
import sys
import tempfile

import pytest

from dreambooth import errors
from dreambooth import storage
from dreambooth.files import REPO_DIR
from dreambooth.generation import image_records
from dreambooth.models import outputs


def test_a_run_in_a_bucket_checkpoints_resumes_from_it_and_ends_like_an_uninterrupted_run(
        s3_endpoint, uninterrupted, tiny_model, toy_images, tmp_path):
    """--storage_path s3://…: Ray Train writes the checkpoints to the bucket, the run's own files follow
    (metrics, settings, validation images, TensorBoard events, the plot); a rerun finds the newest checkpoint
    there and ends on exactly the weights of a run that was never cut (test_recovery's, shared); its
    checkpoints are removed from the bucket once the model is saved."""
    from support import STOP_OPTIONS
    from support import STOP_STEPS
    from support import train_args
    from test_recovery import same_weights

    env, bucket = s3_endpoint
    whole, _ = uninterrupted
    # The base model in the bucket too: each node caches it once.
    storage.replace_folder(tiny_model, f"s3://{bucket}/base", last="model_index.json")
    args_in_bucket = train_args(tiny_model, toy_images, f"s3://{bucket}/models/cut", 2, *STOP_OPTIONS,
                                "--checkpointing_steps", "2", "--report_to", "tensorboard",
                                "--validation_prompt", "photo of unqtkn toy", "--num_validation_images", "1",
                                "--validation_inference_steps", "2")
    args_in_bucket[args_in_bucket.index(tiny_model)] = f"s3://{bucket}/base"
    storage.replace_folder(toy_images, f"s3://{bucket}/photos", last=sorted(os.listdir(toy_images))[-1])
    args_in_bucket[args_in_bucket.index(toy_images)] = f"s3://{bucket}/photos"  # (and the photos)
    remote = f"s3://{bucket}/models/ray_results"  # (the default: beside --output_dir)
    run_env = dict(os.environ, **env, PYTHONUNBUFFERED="1")  # (a new driver: its workers get these too)
    cut = subprocess.run([sys.executable, "train.py", *args_in_bucket], cwd=REPO_DIR, env=run_env,
                         capture_output=True, text=True, timeout=600)
    assert cut.returncode == 0, cut.stderr[-3000:]
    [run] = storage.listdir(remote)
    files = storage.listdir(storage.join(remote, run))
    assert {"metrics.jsonl", "train_config.toml", "loss.png", "tensorboard", "validation"} <= set(files), files
    assert [storage.isdir(storage.join(remote, run, f)) for f in files if f.startswith("checkpoint_2")] == [True]
    assert storage.listdir(storage.join(remote, run, "validation", "step-2")) == ["photo-of-unqtkn-toy-00000.png"]
    assert f"checkpoints and metrics.jsonl in {remote}/{run}" in cut.stderr
    # (uploaded in Ray Train's thread while the steps go on: --checkpoint_upload auto, to a bucket)
    assert f"checkpoints every 2 steps in {remote} (uploaded while training goes on)" in cut.stdout + cut.stderr
    args_in_bucket[args_in_bucket.index("--max_train_steps") + 1] = str(STOP_STEPS)
    # (the last value of a flag wins: a checkpoint on the way, in the bucket; fewer reports, each copied there)
    args_in_bucket += ["--checkpointing_steps", "12", "--logging_steps", "11"]
    args_in_bucket.remove("--keep_checkpoints")  # (once its model is saved, the resumed run's are removed)
    copies = os.path.join(tempfile.gettempdir(), "dreambooth-download-*")  # (the workers' copies of the checkpoint)
    before = set(glob.glob(copies))
    resumed = subprocess.run([sys.executable, "train.py", *args_in_bucket, "--resume_from_checkpoint", "latest"],
                             cwd=REPO_DIR, env=run_env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {remote}/{run}/checkpoint_" in resumed.stderr
    # (a finished 2-step run, continued to more steps under a schedule that does not depend on the length)
    assert f"--max_train_steps 2 -> {STOP_STEPS}: continuing that run" in resumed.stderr
    assert set(glob.glob(copies)) <= before  # each worker's copy of the bucket's checkpoint removed once loaded
    # The model in the bucket, its record last; read back through the cache, it is the uninterrupted run's.
    model = storage.cached(f"s3://{bucket}/models/cut")
    assert outputs.read_output(f"s3://{bucket}/models/cut").record.steps == STOP_STEPS
    same_weights(whole, model)
    # export.py writes its single file into the bucket too (and does not replace one there unasked).
    from dreambooth.commands import export

    exported = f"s3://{bucket}/exports/cut.safetensors"
    assert export.main(["--model_dir", f"s3://{bucket}/models/cut", "--output_file", exported]) == exported
    assert storage.size(exported) > 2**20
    with pytest.raises(errors.UserError, match="exists: pass --overwrite"):
        export.main(["--model_dir", f"s3://{bucket}/models/cut", "--output_file", exported])
    runs = storage.listdir(remote)
    assert len(runs) == 2 and not [f for f in storage.listdir(storage.join(remote, runs[1])) if f.startswith("checkpoint_2")]
    # the resumed run's record (and loss.png) in the bucket starts with the rows of the run it went on from
    cut_rows, resumed_rows = (storage.read_bytes(storage.join(remote, r, "metrics.jsonl")).decode().splitlines()
                              for r in runs)
    assert cut_rows and resumed_rows[:len(cut_rows)] == cut_rows and len(resumed_rows) > len(cut_rows)
    # generate.py draws with the model in the bucket (cached on this node once), into the bucket.
    drawn = subprocess.run([sys.executable, "generate.py", "--model_dir", f"s3://{bucket}/models/cut", "--output_dir",
                            f"s3://{bucket}/new", "--prompts", "photo of unqtkn toy, in a bucket",
                            "--num_samples_per_prompt", "1", "--num_inference_steps", "2"],
                           cwd=REPO_DIR, env=run_env, capture_output=True, text=True, timeout=600)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert storage.listdir(f"s3://{bucket}/new") == sorted(["grid", image_records.IMAGES_CONFIG, image_records.IMAGES_RECORD,
                                                            "photo-of-unqtkn-toy-in-a-bucket-00000.png"])
    assert f"1 images in s3://{bucket}/new; contact sheet s3://{bucket}/new/grid/grid.png" in drawn.stderr



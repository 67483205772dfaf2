"""A run whose base model, photos, checkpoints and model are in a bucket (a local S3 server), cut twice as a cluster
cuts it (a SIGKILLed worker, then SIGTERM), resumed from the bucket, ends like the uninterrupted run."""

import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from support import STOP_OPTIONS
from support import STOP_STEPS
from support import logged_losses
from support import train_args
from test_recovery import checkpoint_steps
from test_recovery import finish
from test_recovery import logged_steps
from test_recovery import registered_steps_under
from test_recovery import run_dirs
from test_recovery import same_weights
from test_recovery import wait_for
from test_recovery import worker_pids

from dreambooth import errors
from dreambooth import storage
from dreambooth.files import REPO_DIR
from dreambooth.generation import image_records
from dreambooth.models import outputs


def test_a_killed_worker_is_restarted_then_sigterm_checkpoints_the_step_in_a_bucket_and_the_resume_ends_on_the_uninterrupted_weights(
        s3_endpoint, uninterrupted, tiny_model, toy_images, tmp_path):
    """--output_dir s3://… (Ray Train's checkpoints beside it): the base model and the photos read from the bucket
    too. A train worker SIGKILLed after the checkpoint of step 3: Ray Train restarts the worker group from that
    checkpoint and training goes on. Then SIGTERM to the driver (ray job stop, a deleted pod) once the restarted
    workers have logged steps: both workers checkpoint the step they are on, long before the next periodic
    checkpoint, and the run ends with exit 143 and how to continue; the run's own files followed its checkpoints to
    the bucket (metrics, settings, validation images, TensorBoard events; the resumed run's plot of the whole run).
    Resumed from the bucket's newest checkpoint, it ends on exactly the uninterrupted run's weights (test_recovery's,
    shared: so the restart lost and repeated nothing), its model in the bucket; the checkpoints are removed from the
    bucket once the model is saved. (The checkpoint a restart reads holds every network a family trains and the moving average: the SDXL
    resume in test_seeded_run_cut_and_resumed_with_every_gpu_option, through the same loading code.) Then export.py
    and generate.py with the model in the bucket, into the bucket."""
    env, bucket = s3_endpoint
    whole, whole_losses = uninterrupted
    # The base model and the photos in the bucket too: each node caches them once.
    storage.replace_folder(tiny_model, f"s3://{bucket}/base", last="model_index.json")
    storage.replace_folder(toy_images, f"s3://{bucket}/photos", last=sorted(os.listdir(toy_images))[-1])
    out, remote = f"s3://{bucket}/models/cut", f"s3://{bucket}/models/ray_results"  # (the default: beside the output)
    cut = train_args(f"s3://{bucket}/base", f"s3://{bucket}/photos", out, STOP_STEPS, *STOP_OPTIONS,
                     "--report_to", "tensorboard", "--validation_prompt", "photo of unqtkn toy",
                     "--num_validation_images", "1", "--validation_inference_steps", "2", "--validation_steps", "3")
    since, run_env = time.time(), dict(os.environ, **env, PYTHONUNBUFFERED="1")  # (a new driver: its workers get these too)
    proc = subprocess.Popen([sys.executable, "train.py", *cut, "--checkpointing_steps", "3", "--max_failures", "2"],
                            cwd=REPO_DIR, env=run_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # (killed once the controller has registered it: a checkpoint folder appears before its files are all copied)
    wait_for(lambda: 3 in registered_steps_under(remote), 240, proc)
    victims = worker_pids(since)
    assert victims
    os.kill(victims[0], signal.SIGKILL)
    # The old group may have logged steps 4 and 5 before the kill: count only what the restarted group logs, once
    # the old workers are gone and new ones are up (it resumed from step 3, so it logs step 4 again).
    wait_for(lambda: (now := worker_pids(since)) and not set(now) & set(victims), 240, proc)
    logged_at_restart = len(logged_steps(remote))
    wait_for(lambda: len(logged_steps(remote)) >= logged_at_restart + 2, 240, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, err = finish(proc, 300)
    assert proc.returncode == 143, err[-3000:]  # (128 + SIGTERM, as a shell reports it)
    assert "restarting the workers from the newest checkpoint" in stdout + err, (stdout + err)[-3000:]
    # (uploaded in Ray Train's thread while the steps go on: --checkpoint_upload auto, to a bucket)
    assert f"checkpoints every 3 steps in {remote} (uploaded while training goes on)" in stdout + err
    [run] = run_dirs(remote)
    step = checkpoint_steps(run)[-1]
    assert 3 < step < STOP_STEPS and f"stopped at step {step} of {STOP_STEPS} (SIGTERM): the checkpoint took " in stdout + err
    assert "SIGTERM: every worker checkpoints the step it is on" in err
    assert "PreemptionWatcher" not in stdout + err  # (Ray's harmless ERROR line about it, kept off the terminal)
    assert "rerun the same command with --resume_from_checkpoint latest to continue" in err
    # ... and the command itself: the run's settings file, which names this run's output and storage
    from dreambooth.planning import planning

    config = re.search(r", that is: python train\.py --config (\S+) --resume_from_checkpoint latest\n", err)[1]
    again = planning.parse_args(["--config", config, "--resume_from_checkpoint", "latest"])
    assert (again.output_dir, again.storage_path, again.max_train_steps) == (out, remote, STOP_STEPS)
    assert "stopped by SIGTERM" not in err  # (one line says where it stopped: no second one after it)
    assert not storage.exists(f"{out}/model_index.json")  # no model of a stopped run
    assert logged_steps(remote) == list(range(1, step + 1))  # each step once: the dead group's repeats gone
    files = storage.listdir(run)
    assert {"metrics.jsonl", "train_config.toml", "tensorboard", "validation"} <= set(files), files
    assert storage.listdir(storage.join(run, "validation", "step-3")) == ["photo-of-unqtkn-toy-00000.png"]
    # Resumed without --keep_checkpoints (which does not change the run): once its model is saved, the stopped
    # run's checkpoints go too (they once stayed: a full SD 1.x fine-tune's 12 GB each). Its record: the stopped
    # run's rows until its checkpoint (the restarted group's repeats gone), then its own, each step once, as the
    # uninterrupted run logged them (loss.png plots the whole run).
    copies = os.path.join(tempfile.gettempdir(), "dreambooth-download-*")  # (the workers' copies of the checkpoint)
    before = set(glob.glob(copies))
    resumed = subprocess.run([sys.executable, "train.py", *[a for a in cut if a != "--keep_checkpoints"],
                              "--resume_from_checkpoint", "latest"], cwd=REPO_DIR, env=run_env, capture_output=True,
                             text=True, timeout=600)  # (a new driver, whose workers get the bucket's settings)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stderr
    [resumed_run] = [r for r in run_dirs(remote) if r != run]
    assert f"resuming from {run}/checkpoint_" in said and f"checkpoints and metrics.jsonl in {resumed_run}" in said
    assert storage.isfile(f"{resumed_run}/loss.png")
    assert set(glob.glob(copies)) <= before  # each worker's copy of the bucket's checkpoint removed once loaded
    assert logged_losses(resumed_run) == whole_losses
    # The model in the bucket, its record last; read back through the cache, it is the uninterrupted run's.
    assert outputs.read_output(out).record.steps == STOP_STEPS
    same_weights(whole, storage.cached(out))
    runs = run_dirs(remote)
    assert len(runs) == 2 and [r for r in runs if checkpoint_steps(r)] == []
    # export.py writes its single file into the bucket too (and does not replace one there unasked).
    from dreambooth.commands import export

    exported = f"s3://{bucket}/exports/cut.safetensors"
    assert export.main(["--model_dir", out, "--output_file", exported]) == exported
    assert storage.size(exported) > 2**20
    with pytest.raises(errors.UserError, match="exists: pass --overwrite"):
        export.main(["--model_dir", out, "--output_file", exported])
    # generate.py draws with the model in the bucket (cached on this node once), into the bucket.
    drawn = subprocess.run([sys.executable, "generate.py", "--model_dir", out, "--output_dir", f"s3://{bucket}/new",
                            "--prompts", "photo of unqtkn toy, in a bucket", "--num_samples_per_prompt", "1",
                            "--num_inference_steps", "2"], cwd=REPO_DIR, env=run_env,
                           capture_output=True, text=True, timeout=600)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert storage.listdir(f"s3://{bucket}/new") == sorted(["grid", image_records.IMAGES_CONFIG, image_records.IMAGES_RECORD,
                                                            "photo-of-unqtkn-toy-in-a-bucket-00000.png"])
    assert f"1 images in s3://{bucket}/new; contact sheet s3://{bucket}/new/grid/grid.png" in drawn.stderr

"""Runs whose storage is a bucket: a real S3 endpoint on 127.0.0.1 (moto's server), reached the way AWS
tools reach MinIO or R2 (AWS_ENDPOINT_URL and the AWS_* credentials)."""

import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest

from dreambooth import errors
from dreambooth import files
from dreambooth import storage
from dreambooth.files import REPO_DIR
from dreambooth.generation import image_records
from dreambooth.models import outputs
from dreambooth.storage import runfiles


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_storage_reads_lists_and_writes_a_bucket_like_a_folder(scheme, request, tmp_path):
    """The same calls on S3 (moto's server) and on Google Cloud Storage (its emulator): one code path,
    pyarrow's filesystem of each."""
    root = f"{scheme}://{request.getfixturevalue('s3_endpoint' if scheme == 's3' else 'gcs_endpoint')[1]}/t"
    storage.write_bytes(f"{root}/a/one.json", b'{"step": 3}')
    storage.write_bytes(f"{root}/a/sub/two.txt", b"x" * 5)
    assert storage.listdir(f"{root}/a") == ["one.json", "sub"] and storage.listdir(f"{root}/none") == []
    assert storage.isdir(f"{root}/a/sub") and storage.isfile(f"{root}/a/one.json")
    assert storage.read_json(f"{root}/a/one.json") == {"step": 3} and storage.size(f"{root}/a/sub/two.txt") == 5
    with storage.local_copy(f"{root}/a") as local:  # (a resumed run's checkpoint in a bucket: this node's copy)
        assert open(os.path.join(local, "sub", "two.txt")).read() == "xxxxx"
    assert not os.path.exists(local)  # (gone with the block: a real model's checkpoint is gigabytes)
    (tmp_path / "new" / "sub").mkdir(parents=True)
    (tmp_path / "new" / "sub" / "three.txt").write_text("3")
    storage.replace_folder(str(tmp_path / "new"), f"{root}/a", last=None)  # (the old content goes, folders too)
    assert storage.listdir(f"{root}/a") == ["sub"] and storage.listdir(f"{root}/a/sub") == ["three.txt"]
    storage.write_bytes(f"{root}/a/gone/deep/x.txt", b"x")
    storage.replace_folder(str(tmp_path / "new"), f"{root}/a", last="sub/three.txt")
    assert storage.listdir(f"{root}/a") == ["sub"]
    storage.remove_tree(f"{root}/a")
    assert not storage.exists(f"{root}/a/one.json")
    storage.check_reachable(root, "--storage_path")
    where = r" \(AWS_ENDPOINT_URL=http://127\.0\.0\.1:\d+\)" if scheme == "s3" else ""
    with pytest.raises(errors.UserError, match=rf"^--storage_path {scheme}://no-such-bucket/x cannot be written from "
                                              rf"this node{where}: "):
        storage.check_reachable(f"{scheme}://no-such-bucket/x", "--storage_path")


def test_a_runs_files_reach_its_bucket_folder_and_each_nodes_errors_log_keeps_a_name_of_its_own(s3_endpoint):
    import socket

    local = runfiles.run_folder("s3://runs/t/results", "run-1")
    os.makedirs(os.path.join(local, "validation"))
    open(os.path.join(local, "metrics.jsonl"), "w").write('{"step": 1}\n')
    open(os.path.join(local, "validation", "a.png"), "wb").write(b"png")
    errors.log_error_event(local, "worker 1 failed")
    runfiles.sync_up("s3://runs/t/results", "run-1")
    errors_log = f"errors-{socket.gethostname()}.log"  # (another node's errors.log would not replace this one)
    assert storage.listdir("s3://runs/t/results/run-1") == sorted([errors_log, "metrics.jsonl", "validation"])
    assert b"worker 1 failed" in storage.read_bytes(f"s3://runs/t/results/run-1/{errors_log}")
    storage.remove_tree("s3://runs/t/results")


def test_a_checkpoint_whose_upload_was_cut_is_not_resumed_from(s3_endpoint):
    """A checkpoint uploading in the background (--checkpoint_upload) when the run died: its record in the bucket and
    part of its weights. The resume takes the checkpoint before it, whose every file arrived at its recorded size."""
    from dreambooth.planning import checkpoints

    run = "s3://runs/cut/ray_results/model-20260101-000001"
    for name, step, weights in (("checkpoint_a", 2, b"w" * 20), ("checkpoint_b", 4, b"w" * 7)):
        storage.write_bytes(f"{run}/{name}/{checkpoints.STATE_FILE}",
                            json.dumps({"step": step, "sizes": {"unet.safetensors": 20}}).encode())
        storage.write_bytes(f"{run}/{name}/unet.safetensors", weights)  # (step 4's: 7 of its 20 bytes arrived)
    assert checkpoints.find_latest("s3://runs/cut/ray_results", "model") == f"{run}/checkpoint_a"
    storage.remove_tree("s3://runs/cut")


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_output_folder_in_a_bucket_is_filled_here_and_its_changes_reach_the_bucket_however_the_block_ends(
        scheme, request):
    out = f"{scheme}://{request.getfixturevalue('s3_endpoint' if scheme == 's3' else 'gcs_endpoint')[1]}/t/out"
    storage.write_bytes(f"{out}/old.png", b"old")
    storage.write_bytes(f"{out}/gone.png", b"gone")
    with storage.output_folder(out) as local:  # what is there already, to top up
        assert sorted(os.listdir(local)) == ["gone.png", "old.png"] and not storage.is_remote(local)
        os.remove(os.path.join(local, "gone.png"))
        files.write_bytes_atomic(b"new", os.path.join(local, "new.png"))
        os.makedirs(os.path.join(local, "grid"))
        open(os.path.join(local, "grid", "grid.png"), "wb").write(b"grid")
        open(os.path.join(local, f"half.png{files.TEMP_MARK}1"), "wb").write(b"ha")  # (still being written)
    assert storage.listdir(out) == ["grid", "new.png", "old.png"]
    assert storage.read_bytes(f"{out}/grid/grid.png") == b"grid"
    with pytest.raises(KeyboardInterrupt), storage.output_folder(out) as local:
        open(os.path.join(local, "new.png"), "wb").write(b"newer")
        raise KeyboardInterrupt  # (a stopped run keeps what it wrote)
    assert storage.read_bytes(f"{out}/new.png") == b"newer"
    # a copy whose script was killed (SIGKILL: no push) holds a file the bucket lacks: the next block sends it
    open(os.path.join(storage.cache_path(out), "killed.png"), "wb").write(b"k")
    with storage.output_folder(out) as local:
        assert "killed.png" in os.listdir(local)  # (kept here: a top-up counts it)
    assert storage.read_bytes(f"{out}/killed.png") == b"k"
    storage.remove_tree(out)
    with storage.output_folder(out) as local:  # (emptied in the bucket: emptied here)
        assert [name for _, _, names in os.walk(local) for name in names] == [f"half.png{files.TEMP_MARK}1"]
    with storage.output_folder("/a/folder") as local:
        assert local == "/a/folder"


def test_a_run_resumed_from_a_bucket_finds_its_tracker_runs_there(s3_endpoint, tmp_path):

    record = {"mlflow": {"run_id": "abc", "experiment": "dreambooth"}}
    storage.write_bytes(f"s3://runs/t/run/{runfiles.RECORD}", json.dumps(record).encode())
    assert runfiles.read_record("s3://runs/t/run") == record
    assert runfiles.read_record("s3://runs/t/other") == {} and runfiles.read_record(str(tmp_path)) == {}


def test_photos_of_a_bucket_are_read_from_this_nodes_copy_and_class_images_may_be_drawn_into_one(
        s3_endpoint, toy_images, capsys):
    import argparse

    from dreambooth.planning import inputs

    storage.replace_folder(toy_images, "s3://runs/t/photos", last="toy-0.jpg")
    args = argparse.Namespace(instance_data_dir="s3://runs/t/photos", class_data_dir=None)
    fetched = inputs.fetch_from_buckets(args)
    assert list(fetched) == ["instance_data_dir"]  # (no class folder: nothing to fetch)
    assert sorted(os.listdir(fetched["instance_data_dir"])) == sorted(os.listdir(toy_images))
    assert args.instance_data_dir == "s3://runs/t/photos"  # (the caller's flags stay as given)
    assert f"--instance_data_dir s3://runs/t/photos: read from this node's copy {fetched['instance_data_dir']}" in \
        capsys.readouterr().err
    storage.remove_tree("s3://runs/t/photos/")
    storage.write_bytes("s3://runs/t/photos/toy-0.jpg", open(os.path.join(toy_images, "toy-0.jpg"), "rb").read())
    assert os.listdir(inputs.fetch_from_buckets(args)["instance_data_dir"]) == ["toy-0.jpg"]  # (brought up to date)
    # class images to be drawn: an empty class folder in the bucket is this node's empty copy, to draw into
    drawing = argparse.Namespace(instance_data_dir="/p", class_data_dir="s3://runs/reg")
    assert os.listdir(inputs.fetch_from_buckets(drawing, draw_class_images=lambda: None)["class_data_dir"]) == []
    with pytest.raises(errors.UserError, match="^s3://runs/reg holds no files"):  # (to be read only: said)
        inputs.fetch_from_buckets(drawing)


@pytest.mark.slow
def test_a_run_in_a_bucket_checkpoints_resumes_from_it_and_ends_like_an_uninterrupted_run(
        s3_endpoint, uninterrupted, tiny_model, toy_images, tmp_path):
    """--storage_path s3://…: Ray Train writes the checkpoints to the bucket, the run's own files follow
    (metrics, settings, validation images, TensorBoard events, the plot); a rerun finds the newest checkpoint
    there and ends on exactly the weights of a run that was never cut (test_recovery's, shared); its
    checkpoints are removed from the bucket once the model is saved."""
    from test_recovery import STOP_OPTIONS
    from test_recovery import STOP_STEPS
    from test_recovery import same_weights
    from test_recovery import train_args

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


def test_a_model_found_in_a_buckets_model_cache_on_this_node_is_put_in_the_bucket_for_the_other_nodes(
        s3_endpoint, monkeypatch):
    """A short or hub name resolved with ORIG_MODEL_DIR (or DATA_PREFIX) in a bucket: the model is looked up and
    fetched in this node's copy of that cache, and copied to the bucket, where the workers of every node
    (storage.ensure_local) find it."""
    from dreambooth.commands import cache_model
    from dreambooth.models import modelcache

    monkeypatch.setenv("ORIG_MODEL_DIR", "s3://runs/t/models")
    uri = cache_model.main(["--tiny"])
    storage.remove_tree("s3://runs/t/models")  # (only this node's copy holds it now)
    path = modelcache.resolve_model_name(modelcache.TINY_MODEL_NAME)
    assert path == storage.cache_path(uri) and storage.isfile(f"{uri}/model_index.json")
    storage.ensure_local(path)  # (what a worker does: its files are in the bucket)
    storage.remove_tree("s3://runs/t/models")


def test_a_model_in_a_bucket_resolves_to_this_nodes_copy_that_the_scripts_checks_accept(s3_endpoint, tiny_model):
    """A trained model read from a bucket (a sweep trial's, in its bucket folder): outputs.resolve_model names this
    node's copy of it, which is a whole model folder (families.check_model_dir, run before Ray by evaluate.py and
    generate.py), and a Ray actor on another node fetches its own copy of the same path (storage.ensure_local)."""
    from dreambooth import families

    storage.replace_folder(tiny_model, "s3://runs/t/trial-model", last="model_index.json")
    ref = outputs.resolve_model("s3://runs/t/trial-model")
    assert ref.model_dir == storage.cache_path("s3://runs/t/trial-model") and ref.lora_dir is None
    families.check_model_dir(ref.model_dir)
    storage.remove_tree("s3://runs/t/trial-model")

"""Runs whose storage is a bucket: a real S3 endpoint on 127.0.0.1 (moto's server), reached the way AWS
tools reach MinIO or R2 (AWS_ENDPOINT_URL and the AWS_* credentials)."""

import json
import os

import pytest

from dreambooth import errors
from dreambooth import files
from dreambooth import storage
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

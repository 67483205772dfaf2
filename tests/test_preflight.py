"""preflight.py: what dreambooth_run.sh checks before Step 1 (the script's own failures are in
test_dreambooth_run; here the worker arithmetic, the disk estimate and a real 2-node cluster whose
second node has its own DATA_PREFIX)."""

import os
import shutil
import subprocess
import sys

import pytest

from dreambooth import errors
from dreambooth.commands import preflight
from dreambooth.files import REPO_DIR


def args(**given):
    return preflight.parse_args(["--photos_dir", "/p", "--data_prefix", "/d", *[
        f"--{k}={v}" if v is not True else f"--{k}" for k, v in given.items()]])


def test_workers_default_to_one_per_gpu_and_too_many_name_the_variable(capsys):
    assert preflight.check_workers(args(), cpus=16, gpus=1) == 1
    assert preflight.check_workers(args(), cpus=16, gpus=8) == 8
    assert preflight.check_workers(args(gpus_per_worker=2), cpus=16, gpus=8) == 4
    with pytest.raises(errors.UserError, match=r"NUM_WORKERS=2 x GPUS_PER_WORKER=1 needs 2 GPUs; the Ray cluster "
                                              r"has 1: set NUM_WORKERS=1"):
        preflight.check_workers(args(num_workers=2), cpus=16, gpus=1)
    assert capsys.readouterr().err == ""
    assert preflight.check_workers(args(), cpus=2, gpus=0) == 1
    err = capsys.readouterr().err
    assert "no GPU" in err and "Stable Diffusion" not in err  # on CPUs: said before Step 1 (any family: no SD name)
    assert "`ray stop` stops every Ray cluster of this machine" in err  # (not advised as the fix)
    assert preflight.check_workers(args(tiny=True), cpus=2, gpus=0) == 1 and capsys.readouterr().err == ""
    with pytest.raises(errors.UserError, match="NUM_WORKERS=3: .* 2 CPUs"):
        preflight.check_workers(args(num_workers=3, tiny=True), cpus=2, gpus=0)


def test_disk_estimate_is_model_checkpoint_and_output(tiny_model, tmp_path):
    from dreambooth.models import known_models

    full, parts = preflight.disk_needed_gb(args(model_name="sd15"))
    # the checkpoint kept (--checkpoints_total_limit 1) and the next one Ray writes before removing it: 12 bytes
    # (fp32 weight, AdamW's two moments) of each trained parameter, UNet 860M + text encoder 123M
    checkpoint_gb = 12 * (859.5e6 + 123.1e6) / 1e9
    assert full == pytest.approx(4.3 + 2 * checkpoint_gb, rel=1e-3) and "1 checkpoint(s) kept of 11.8" in parts
    three, _ = preflight.disk_needed_gb(args(model_name="sd15"), limit=3)
    assert three == pytest.approx(4.3 + 4 * checkpoint_gb, rel=1e-3)
    # Flux.1 dev's files are bf16 and T5 is never trained: its checkpoint is 12 bytes of the transformer and
    # CLIP-L's parameters (11.9B + 0.12B), not three times the 33.8 GB download
    # (the tuned model: the download with the transformer and CLIP-L in fp32, 24 GB more)
    flux, parts = preflight.disk_needed_gb(args(model_name="flux-dev"))
    assert "1 checkpoint(s) kept of 144." in parts and flux == pytest.approx(33.8 + 2 * 12 * 12.02e9 / 1e9, rel=2e-3)
    assert preflight.known_full_gb(args(model_name="flux-dev"), known_models.known_model("flux-dev"))[1] == \
        pytest.approx(33.8 + 2 * 12.02, rel=2e-3)
    assert preflight.known_full_gb(args(model_name="sd15"), known_models.known_model("sd15"))[1] == 4.3
    # a 2026 family's short name is counted at its own size (Chroma1-HD: its 8.90B transformer trained, T5 frozen)
    assert preflight.known_full_gb(args(model_name="chroma"), known_models.known_model("chroma")) == \
        pytest.approx((12 * 8.90, 27.5 + 2 * 8.90), rel=2e-3)
    lora, _ = preflight.disk_needed_gb(args(model_name="sd15", use_lora=True))
    assert lora == pytest.approx(4.3 + 2 * preflight.disk.LORA_BYTES / preflight.GB)
    cached, parts = preflight.disk_needed_gb(args(model_name="sd15", model_path=tiny_model))
    assert cached < 0.1 and parts.startswith("model 0.0")  # cached already: nothing to download
    # the script knows only ORIG_MODEL_DIR before Step 1: a pinned model already cached there is found
    from dreambooth.models import modelcache

    known = known_models.known_model("sd15")
    shutil.copytree(tiny_model, modelcache.hub_snapshot_path(str(tmp_path / "cache"), known.hub_name, known.revision))
    _, parts = preflight.disk_needed_gb(args(model_name="sd15", model_cache=str(tmp_path / "cache")))
    assert parts.startswith("model 0.0")


def test_a_flag_of_another_family_and_an_unknown_tiny_arch_stop_before_step_1(tmp_path):
    """A family is known before Step 1 from --tiny's --arch or a short name: a loss flag of the other objective
    stops the run at Step 0 (it stopped at Step 4, after the class images), as does an --arch typo (at Step 1)."""
    def check(words, **given):
        preflight.check_family_flags(args(model_cache=str(tmp_path), **given), preflight.check_train_flags(words))

    with pytest.raises(errors.UserError, match="--snr_gamma weighs the timesteps of a denoising model; Flux.1"):
        check(["--snr_gamma", "5"], tiny=True, arch="flux")
    with pytest.raises(errors.UserError, match="--snr_gamma .* SD 3.5"):
        check(["--snr_gamma", "5"], model_name="sd35-medium")
    with pytest.raises(errors.UserError, match="--flow_shift .* SD 1.x"):
        check(["--flow_shift", "3"], tiny=True)
    with pytest.raises(errors.UserError, match=r"--arch fluxx: no tiny model of that family; choose from sd1, .*qwen"):
        check([], tiny=True, arch="fluxx")
    check(["--snr_gamma", "5"], tiny=True, arch="sdxl")
    check(["--flow_shift", "3"], model_name="flux-dev")
    check(["--snr_gamma", "5"], model_name="someone/some-model")  # (its family is read from its files at Step 4)
    with pytest.raises(errors.UserError, match="--arch fluxx"):  # (main checks them first: before the photos)
        preflight.main(["--photos_dir", "/p", "--data_prefix", str(tmp_path), "--tiny", "--arch", "fluxx"])


def test_a_misspelt_short_name_stops_before_step_1_naming_the_nearest(tmp_path, toy_images):
    """ORIG_MODEL_NAME=sd-14 is no short name and no hub name (owner/name): one line naming sd14 at Step 0 (it was a
    note, then Step 1 failing to find 'sd-14@main' in the cache)."""
    given = ["--photos_dir", toy_images, "--class_name", "dog", "--data_prefix", str(tmp_path), "--model_cache",
             str(tmp_path / "cache")]
    with pytest.raises(errors.UserError, match=r"ORIG_MODEL_NAME=sd-14 is not a short name .* did you mean sd14"):
        preflight.main(given + ["--model_name", "sd-14"])
    with pytest.raises(errors.UserError, match="did you mean qwen-image"):
        preflight.main(given + ["--model_name", "qwen"])


def test_a_subject_model_of_another_family_or_mode_is_said_at_step_0(tmp_path, capsys):
    """TUNED_MODEL_DIR with the subject's LoRA of SD 1.x: a Flux.1 run, or a full fine-tune, says at Step 0 that Step 4
    replaces it and how to keep both (it was said only at Step 4, after the download and the class images); the
    same family and mode say nothing (Step 4 continues or keeps it)."""
    import json

    from dreambooth import files

    tuned = tmp_path / "subjects" / "rex" / "model-tuned"
    tuned.mkdir(parents=True)
    (tuned / files.OUTPUT_MARKER).write_text(json.dumps({"base_model": "/m", "identity": {"family": "sd1",
                                                                                          "use_lora": True}}))
    for given, said in (({"arch": "flux", "use_lora": True}, "(sd1 -> flux)"),
                        ({}, "(LoRA -> full fine-tune)"), ({"use_lora": True}, None)):
        run = args(tiny=True, tuned_model_dir=str(tuned), **given)
        preflight.note_replaced_model(run, preflight.planned_family(run))
        err = capsys.readouterr().err
        assert (f"holds this subject's LoRA of the sd1 family {said}: Step 4 replaces it" in err) if said else not err


def test_photos_and_class_name_are_checked_first(tmp_path, toy_images, capsys):
    captioned = shutil.copytree(toy_images, tmp_path / "captioned")
    (captioned / "toy-0.txt").write_text("photo of unqtkn toy on a table")  # a caption, as the README places it
    (captioned / "notes.doc").write_text("")
    (captioned / "notes.txt").write_text("where the photos were taken")  # no notes.jpg: it captions nothing
    assert len(preflight.check_photos(str(captioned), "INSTANCE_DIR")) == 5
    err = capsys.readouterr().err
    assert "skipping 1 non-image file(s) in " in err  # notes.doc, not the caption train.py reads
    assert f"skipping 1 .txt file(s) in {captioned} with no photo of the same name to caption: notes.txt" in err
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.UserError, match=r"INSTANCE_DIR=\S+empty: .*holds no images"):
        preflight.check_photos(str(tmp_path / "empty"), "INSTANCE_DIR")
    broken = shutil.copytree(toy_images, tmp_path / "photos")
    (broken / "IMG_1.jpg").write_bytes(b"\xff\xd8\xff not a photo")
    with pytest.raises(errors.UserError, match="IMG_1.jpg"):
        preflight.check_photos(str(broken), "INSTANCE_DIR")
    with pytest.raises(errors.UserError, match="CLASS_NAME is not set"):
        preflight.main(["--photos_dir", toy_images, "--data_prefix", str(tmp_path), "--class_name", " "])


@pytest.mark.slow
def test_a_data_prefix_that_one_node_of_two_does_not_share_fails_before_step_1(two_node_cluster, toy_images):
    """A real 2-node Ray cluster on this machine with token authentication: its second node runs in its
    own mount namespace, where an empty filesystem is mounted over DATA_PREFIX, as a node without the
    NFS mount sees it."""
    address, prefix = two_node_cluster
    if prefix is None:
        pytest.skip("needs unshare (root) for a node with a mount of its own")
    proc = subprocess.run([sys.executable, "preflight.py", "--photos_dir", toy_images, "--class_name", "toy",
                           "--data_prefix", str(prefix), "--tiny"], cwd=REPO_DIR, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, RAY_ADDRESS=address))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"Ray: joined the cluster at {address} (RAY_ADDRESS); token authentication" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: DATA_PREFIX=") and "is not shared storage" in last and "Traceback" not in \
        proc.stderr
    assert not [n for n in os.listdir(prefix) if n.startswith(".preflight-")]  # the probe cleaned up after itself


@pytest.mark.slow
def test_train_flags_for_the_script_are_checked_first_and_their_sizes_passed_on(ray_session, toy_images, tmp_path,
                                                                               capsys):
    """The words dreambooth_run.sh passes on to train.py (TRAIN_ARGS, after --) parse as train.py's flags
    at Step 0; the step count and resolution given there reach the script (its banners and Step 3)."""
    given = ["--photos_dir", toy_images, "--class_name", "toy", "--data_prefix", str(tmp_path), "--tiny"]
    assert preflight.main(given + ["--", "--resolution", "32", "--max_train_steps", "3", "--seed", "1"]) == 1
    assert capsys.readouterr().out.splitlines() == ["MAX_TRAIN_STEPS=3", "RESOLUTION=32", "NUM_WORKERS=1"]
    assert preflight.main(given) == 1 and capsys.readouterr().out.splitlines() == ["NUM_WORKERS=1"]
    with pytest.raises(SystemExit):
        preflight.main(given + ["--", "--seed", "1", "*.md"])
    assert "unrecognized arguments: *.md" in capsys.readouterr().err

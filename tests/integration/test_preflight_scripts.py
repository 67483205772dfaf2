"""preflight.py and dreambooth_run.sh's checks before Step 1, as processes: photos and class name first, a flag of
another family, a misspelt short name, a data prefix one node does not share, train flags checked and their sizes
passed on."""

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
    # (said once: the variable, its folder and what to put there; it once named the folder twice)
    with pytest.raises(errors.UserError, match=r"^INSTANCE_DIR=\S+empty: holds no images \(\.png, .*\); put 4-6 "
                                               r"photos of your subject there$"):
        preflight.check_photos(str(tmp_path / "empty"), "INSTANCE_DIR")
    broken = shutil.copytree(toy_images, tmp_path / "photos")
    (broken / "IMG_1.jpg").write_bytes(b"\xff\xd8\xff not a photo")
    with pytest.raises(errors.UserError, match="IMG_1.jpg"):
        preflight.check_photos(str(broken), "INSTANCE_DIR")
    (captioned / "toy-0.txt").write_bytes("photo of unqtkn toy on a sofa".encode("utf-16"))  # Windows' 'Unicode'
    with pytest.raises(errors.UserError, match=r"INSTANCE_DIR=\S+captioned: caption file: \S+toy-0.txt is not UTF-8 "
                                               r"text \(UTF-16"):
        preflight.check_photos(str(captioned), "INSTANCE_DIR")  # (it was named only at Step 4)
    with pytest.raises(errors.UserError, match="CLASS_NAME is not set"):
        preflight.main(["--photos_dir", toy_images, "--data_prefix", str(tmp_path), "--class_name", " "])


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

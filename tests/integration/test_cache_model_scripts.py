"""cache_model.py as a process: a pinned model found offline in an existing cache, and a gated model refused before
the hub is asked."""

import os
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from dreambooth import errors
from dreambooth.commands import cache_model
from dreambooth.commands import preflight
from dreambooth.files import REPO_DIR
from dreambooth.models import known_models
from dreambooth.models import modelcache

SD14 = "CompVis/stable-diffusion-v1-4"
SD14_REV = "b95be7d6f134c3a9e62ee616f310733567f069ce"


def test_pinned_model_resolves_offline_from_an_existing_cache(tiny_model, tmp_path):
    """The default SD 1.4 revision, found in a hub-layout cache with the hub unreachable."""
    cache = tmp_path / "model-orig"
    snapshot = modelcache.hub_snapshot_path(str(cache), SD14, SD14_REV)
    shutil.copytree(tiny_model, snapshot)
    os.makedirs(cache / "models--CompVis--stable-diffusion-v1-4" / "refs")
    (cache / "models--CompVis--stable-diffusion-v1-4" / "refs" / "main").write_text(SD14_REV)
    proc = subprocess.run([sys.executable, "cache_model.py", "--model_dir", str(cache)], cwd=REPO_DIR,
                          capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == snapshot


def test_a_gated_model_without_a_hub_token_is_refused_before_the_hub_is_asked(tiny_model, tmp_path, monkeypatch,
                                                                             capsys):
    """flux-dev, the SD 3.5 names, flux2-klein-9b and flux2-dev are gated: with no token (HF_TOKEN unset, no token file) Step 1 and the
    preflight say what to do in one line; with one, the token is never part of a line; flux-schnell is open;
    a gated model already cached at its pin needs no token (offline)."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # (no token file there)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("flux-dev", "sd35-medium", "sd35-large", "flux2-klein-9b", "flux2-dev"):
        with pytest.raises(errors.UserError, match=r"^no Hugging Face token on this machine: \S+ \(\S+\) is gated: "
                                                  r"accept its license at https://huggingface.co/.* `hf auth login`"):
            cache_model.main(["--model_dir", str(tmp_path / "cache"), "--model_name", name])
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.new("RGB", (64, 64), "red").save(photos / "a.jpg")
    with pytest.raises(errors.UserError, match="FLUX.1-dev.* is gated"):  # (before Ray: none is running here)
        preflight.main(["--photos_dir", str(photos), "--data_prefix", str(tmp_path), "--class_name", "dog",
                        "--model_name", "flux-dev"])
    for name in ("flux-schnell", "qwen-image", "flux2-klein-4b", "z-image", "chroma"):
        known_models.check_access(name)  # open: no token needed
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_123")
    known_models.check_access("flux-dev")
    assert "hf_not_a_real_token_123" not in known_models.gated_line("black-forest-labs/FLUX.1-dev")
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    flux = known_models.known_model("flux-dev")
    pinned = modelcache.hub_snapshot_path(str(tmp_path / "cache"), flux.hub_name, flux.revision)
    shutil.copytree(tiny_model, pinned)  # (any pipeline folder: the lookup is what is tested)
    assert cache_model.main(["--model_dir", str(tmp_path / "cache"), "--model_name", "black-forest-labs/FLUX.1-dev"]) \
        == pinned
    assert capsys.readouterr().out.strip().splitlines()[-1] == pinned
    assert modelcache.resolve_model_name("flux-dev", str(tmp_path / "cache")) == pinned



import os

from PIL import Image

from dreambooth.commands import download_example_dataset


def test_dataset_is_copied_from_an_offline_hub_cache(tmp_path):
    revision = "a" * 40
    repo = tmp_path / "cache" / "datasets--diffusers--dog-example"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for k in range(3):
        Image.new("RGB", (8, 8)).save(snapshot / f"alvan-{k}.jpeg")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    out = tmp_path / "dog"
    copied = download_example_dataset.main([str(out), "--cache_dir", str(tmp_path / "cache")])
    assert sorted(os.listdir(out)) == [f"alvan-{k}.jpeg" for k in range(3)]
    assert len(copied) == 3


def test_the_dataset_out_of_reach_says_how_to_go_on_without_it(tmp_path, monkeypatch):
    """No network and nothing cached: one line that also names the way around it (your own photos, --tiny's)."""
    import pytest

    from dreambooth import errors

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(errors.UserError, match=r"^dataset diffusers/dog-example is not in the cache .* run once with "
                                               r"network access, or use photos of your own \(dreambooth_run.sh: "
                                               r"INSTANCE_DIR=their folder; --tiny: images/toy\)$"):
        download_example_dataset.main([str(tmp_path / "dog"), "--cache_dir", str(tmp_path / "empty-cache")])

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

import os

import numpy as np
import pytest
from PIL import Image

import generate
import utils


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def test_plan_images_tops_up_and_refuses_colliding_prompts(tmp_path):
    (tmp_path / utils.image_file_name("a dog", 1)).write_bytes(b"x")
    rows, files = generate.plan_images(["a dog", "a cat"], 2, 0, str(tmp_path))
    assert files == ["a-dog-00000.png", "a-dog-00001.png", "a-cat-00000.png", "a-cat-00001.png"]
    assert [r["file"] for r in rows] == ["a-dog-00000.png", "a-cat-00000.png", "a-cat-00001.png"]
    assert rows[0]["seed"] == utils.image_seed(0, "a dog", 0)
    with pytest.raises(utils.UserError, match="share file names"):
        generate.plan_images(["a dog", "A dog!"], 1, 0, str(tmp_path))


def test_make_grid_is_near_square():
    sheet = generate.make_grid([Image.new("RGB", (64, 64))] * 5, thumb_size=16)
    assert sheet.size == (48, 32)


def test_generate_on_actor_pool_is_deterministic_and_tops_up(ray_session, tiny_model, tmp_path):
    out = tmp_path / "images"
    common = ["--model_dir", tiny_model, "--output_dir", str(out), "--num_inference_steps", "3", "--seed", "7"]
    files = generate.main(common + ["--prompts", "photo of a dog,photo of a cat", "--num_samples_per_prompt", "3",
                                    "--batch_size", "2", "--use_ray_data"])
    assert len(files) == 6
    assert sorted(os.listdir(out)) == sorted(files + [utils.GRID_DIR])
    assert os.path.isfile(out / utils.GRID_DIR / "grid.png")
    first = {f: pixels(out / f) for f in files}
    assert first[files[0]].shape == (64, 64, 3)
    assert not np.array_equal(first[files[0]], first[files[1]])  # each image its own seed

    # A rerun after losing two images makes exactly those two again, pixel for pixel,
    # with another batch size; the rest are left untouched.
    os.remove(out / files[1])
    os.remove(out / files[4])
    kept_mtime = os.path.getmtime(out / files[0])
    again = generate.main(common + ["--prompts", "photo of a dog", "--prompts", "photo of a cat",
                                    "--num_samples_per_prompt", "3", "--batch_size", "1", "--num_actors", "1"])
    assert again == files
    assert os.path.getmtime(out / files[0]) == kept_mtime
    for f in files:
        np.testing.assert_allclose(pixels(out / f).astype(int), first[f].astype(int), atol=1)
    assert not [f for f in os.listdir(out) if ".tmp" in f]

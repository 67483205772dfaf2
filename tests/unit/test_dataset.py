"""dataset.py: images to a deterministic training stream: views, latents, the Ray Data graph."""

import numpy as np
from PIL import Image
from support import red_is_mask_photos

from dreambooth.families.shared import family as family_lib
from dreambooth.generation import imagefiles
from dreambooth.generation import imaging
from dreambooth.training import dataset


def asymmetric_image(height=6, width=9):
    return np.arange(height * width * 3, dtype=np.uint8).reshape(height, width, 3)


def tall_photo_marked_at_the_top(path, height=240, width=96):
    """A portrait photo: gray, with a red band across its top tenth."""
    pixels = np.full((height, width, 3), 128, np.uint8)
    pixels[:height // 10] = (255, 0, 0)
    Image.fromarray(pixels).save(path)
    return str(path)


def test_make_views_follow_the_row_seed_not_the_batch():
    images = [asymmetric_image(12, 16) + k for k in range(3)]
    batch = {"instance": np.array([0, 2, 1]), "class": np.array([1, 1, 0]), "seed": np.array([5, 6, 7])}
    out = dataset.make_views(batch, images, images, 8, False, True)
    assert out["instance_pixels"].shape == (3, 8, 8, 3) and out["instance_pixels"].dtype == np.uint8
    one = dataset.make_views({k: v[1:2] for k, v in batch.items()}, images, images, 8, False, True)
    np.testing.assert_array_equal(one["class_pixels"][0], out["class_pixels"][1])
    np.testing.assert_array_equal(out["instance_image"], batch["instance"])  # picks each row's caption
    alone = dataset.make_views({"instance": batch["instance"], "seed": batch["seed"]}, images, None, 8, True, False)
    assert set(alone) == {"instance_pixels", "instance_image"}


def test_tokenize_prompt_pads_to_model_max_length(tiny_model):
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    ids = family_lib.tokenize_prompt(tokenizer, "photo of unqtkn dog")
    assert ids.shape == (tokenizer.model_max_length,) and ids.dtype == np.int64
    assert ids[0] == tokenizer.bos_token_id and ids[5] == tokenizer.eos_token_id


def test_each_view_carries_its_own_crop_and_flip_of_the_mask(tmp_path):
    photos = red_is_mask_photos(tmp_path / "own")
    masks = dict(zip(photos, imagefiles.find_masks(photos)))
    instances, _ = dataset.decode_images(photos, None, 16, masks=masks)
    images = [np.concatenate([x, masks[p][..., None]], axis=-1) for x, p in zip(instances, photos)]
    rows = imaging.plan_rows(3, 0, 4, seed=1)
    batch = {k: np.array([r[k] for r in rows]) for k in ("instance", "seed")}
    out = dataset.make_views(batch, images, None, 16, center_crop=False, random_flip=True)
    assert out["instance_pixels"].shape == (12, 16, 16, 3) and out["instance_mask"].shape == (12, 16, 16)
    np.testing.assert_array_equal(out["instance_mask"], out["instance_pixels"][..., 0])
    assert len({m.tobytes() for m in out["instance_mask"]}) > 3  # crops and flips vary
    # Cached latents' views: the center crop and its mirror, the one picked with the latents.
    views = np.stack([dataset.stored_mask_views(masks[p], 16, 2) for p in photos])
    latents = np.stack([np.stack([np.full((8, 2, 2), 0.0), np.full((8, 2, 2), 1.0)]) for _ in photos])
    picked = dataset.pick_latents(batch, latents, None, instance_masks=views)
    for index, lat, mask in zip(batch["instance"], picked["instance_latents"], picked["instance_mask"], strict=True):
        np.testing.assert_array_equal(mask, views[index][int(lat[0, 0, 0])])


def test_a_portrait_photos_top_is_never_cropped_away_in_its_bucket(tmp_path):
    """Square crops of a tall photo lose its top in some views; its bucket keeps all of it, class
    images are fitted to the same bucket, and SDXL's time ids hold the true sizes and crops."""
    photo = tall_photo_marked_at_the_top(tmp_path / "tall.png")
    buckets = imaging.bucket_sizes(64, 32, 128, 8)
    bucket = imaging.bucket_for(*imagefiles.upright_size(photo), buckets)
    height, width = buckets[bucket]
    assert height > width
    class_image = np.full((64, 64, 3), 7, np.uint8)
    instances, _ = dataset.decode_images([photo], None, 64, buckets=(buckets, [bucket]))
    rows = imaging.plan_bucket_rows([bucket], 1, num_epochs=8, seed=0, batch_size=1)
    batch = {k: np.array([r[k] for r in rows]) for k in ("instance", "class", "seed", "bucket")}
    out = dataset.make_views(batch, instances, [class_image], 64, center_crop=False, random_flip=True,
                             sizes={"instance": [(240, 96)], "class": [(64, 64)]}, buckets=buckets)
    assert out["instance_pixels"].shape == (8, height, width, 3) and out["class_pixels"].shape == (8, height, width, 3)
    assert all((view[0] == (255, 0, 0)).all(axis=-1).all() for view in out["instance_pixels"])  # the mark, every time
    assert (out["instance_time_ids"][:, [0, 1, 4, 5]] == [240, 96, height, width]).all()
    assert (out["class_time_ids"][:, [0, 1, 4, 5]] == [64, 64, height, width]).all()
    square = dataset.make_views({k: batch[k] for k in ("instance", "seed")},
                                dataset.decode_images([photo], None, 64)[0], None, 64, False, True)
    assert not all((view[0] == (255, 0, 0)).all() for view in square["instance_pixels"])  # squares lose it

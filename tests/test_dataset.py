"""dataset.py: images to a deterministic training stream: views, latents, the Ray Data graph."""

import numpy as np
import pytest
from conftest import red_is_mask_photos
from PIL import Image

from dreambooth.families import family as family_lib
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


@pytest.mark.slow
def test_train_dataset_on_ray_pairs_every_class_image(ray_session, toy_images, tmp_path):
    class_dir = tmp_path / "class"
    class_dir.mkdir()
    for k in range(7):  # non-square, distinct solid colours so rows can be told apart
        Image.new("RGB", (48, 32), (30 * k, 0, 0)).save(class_dir / f"c{k}.png")
    instance_paths = imagefiles.list_images(toy_images, "instance")
    class_paths = imagefiles.list_images(str(class_dir), "class")
    ds = dataset.build_train_dataset(instance_paths, class_paths, 16, center_crop=True, random_flip=False,
                                     num_epochs=2, seed=3)
    rows = ds.take_all()
    assert len(rows) == 14
    assert all(r["instance_pixels"].shape == (16, 16, 3) and r["class_pixels"].shape == (16, 16, 3) for r in rows)
    for epoch in (rows[:7], rows[7:]):
        assert sorted(int(r["class_pixels"][0, 0, 0]) for r in epoch) == [30 * k for k in range(7)]
        assert len({r["instance_pixels"].tobytes() for r in epoch}) == 5
    again = dataset.build_train_dataset(instance_paths, class_paths, 16, center_crop=True, random_flip=False,
                                        num_epochs=2, seed=3).take_all()
    assert [r["class_pixels"].tobytes() for r in again] == [r["class_pixels"].tobytes() for r in rows]
    alone = dataset.build_train_dataset(instance_paths, None, 16, center_crop=False, random_flip=True).take_all()
    assert len(alone) == 5 and set(alone[0]) == {"instance_pixels", "instance_image"}
    assert sorted(r["instance_image"] for r in alone) == list(range(5))
    # --masked_loss: each row's mask travels with its pixels (the photos' red channel is their mask)
    photos = red_is_mask_photos(tmp_path / "masked")
    masked = dataset.build_train_dataset(photos, None, 16, center_crop=False, random_flip=True, num_epochs=3,
                                         mask_sources=imagefiles.find_masks(photos)).take_all()
    assert len(masked) == 9 and all(np.array_equal(r["instance_mask"], r["instance_pixels"][..., 0]) for r in masked)
    # --enable_bucket: photos of three shapes; each batch (a block) is one bucket, class rows fitted to it
    shaped = photos + [tall_photo_marked_at_the_top(tmp_path / "tall.png")]
    buckets = imaging.bucket_sizes(16, 8, 32, 4)
    bucketed = dataset.build_train_dataset(shaped, class_paths, 16, center_crop=False, random_flip=True,
                                           num_epochs=2, batch_size=2, buckets=buckets)
    batches = list(bucketed.iter_batches(batch_size=2))
    shapes = {b["instance_pixels"].shape[1:3] for b in batches}
    assert len(shapes) >= 3 and all(b["class_pixels"].shape == b["instance_pixels"].shape for b in batches)
    assert sum(len(b["instance_image"]) for b in batches) == 2 * imaging.bucket_epoch_rows(
        [imaging.bucket_for(*imagefiles.upright_size(p), buckets) for p in shaped], len(class_paths), 2)


@pytest.mark.slow
def test_latent_cache_stores_posteriors_of_both_flip_views(ray_session, tiny_model, toy_images, tmp_path):
    """--cache_latents with --enable_bucket: one encoding pass on the actor pool; each photo's latents (8 channels)
    at its bucket, the class images' at every bucket the photos use. (Without buckets: test_train's
    cached-latents run trains on them.)"""
    paths = imagefiles.list_images(toy_images, "instance")
    cache = dataset.LatentCache(tiny_model, num_gpus=0)
    tall = tall_photo_marked_at_the_top(tmp_path / "tall.png")
    buckets = imaging.bucket_sizes(16, 8, 32, 4)
    bucketed = dataset.build_train_dataset(paths + [tall], paths[:3], 16, center_crop=True, random_flip=True,
                                           latent_cache=cache, batch_size=2, buckets=buckets)
    batches = list(bucketed.iter_batches(batch_size=2))
    tall_bucket = buckets[imaging.bucket_for(240, 96, buckets)]
    assert {b["instance_latents"].shape[1:] for b in batches} == {(8, 8, 8), (8, tall_bucket[0] // 2, tall_bucket[1] // 2)}
    assert all(b["class_latents"].shape == b["instance_latents"].shape for b in batches)
    encoder = dataset.LatentEncoder(tiny_model, True, False)
    images = [np.asarray(Image.open(p).convert("RGB")) for p in paths[:1]]
    views = encoder.encode([imaging.resize_shorter_side(x, 16) for x in images], 16)
    assert views.shape == (1, 2, 8, 8, 8) and not np.allclose(views[0, 0], views[0, 1])


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

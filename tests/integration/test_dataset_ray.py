"""The training stream on Ray Data: every class image paired, and the latent cache's posteriors of both flip views."""

import numpy as np
from PIL import Image
from support import red_is_mask_photos

from dreambooth.generation import imagefiles
from dreambooth.generation import imaging
from dreambooth.training import dataset


def tall_photo_marked_at_the_top(path, height=240, width=96):
    """A portrait photo: gray, with a red band across its top tenth."""
    pixels = np.full((height, width, 3), 128, np.uint8)
    pixels[:height // 10] = (255, 0, 0)
    Image.fromarray(pixels).save(path)
    return str(path)


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



"""dataset.py: images to a deterministic training stream: files, views, rows, the Ray Data graph."""

import numpy as np
import pytest
from PIL import Image, ImageOps

from dreambooth import dataset
from dreambooth import imagefiles
from dreambooth import imaging
from dreambooth import utils


def asymmetric_image(height=6, width=9):
    return np.arange(height * width * 3, dtype=np.uint8).reshape(height, width, 3)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_apply_orientation_matches_pillow_exif_transpose(orientation, tmp_path):
    array = asymmetric_image()
    image = Image.fromarray(array)
    exif = image.getexif()
    exif[0x0112] = orientation
    path = tmp_path / "x.png"
    image.save(path, exif=exif)
    assert imagefiles.exif_orientation(str(path)) == orientation
    with Image.open(path) as opened:
        expected = np.asarray(ImageOps.exif_transpose(opened).convert("RGB"))
    np.testing.assert_array_equal(imagefiles.apply_orientation(array, orientation), expected)


def test_resize_shorter_side_keeps_aspect_and_upscales_small():
    out = imaging.resize_shorter_side(np.zeros((20, 40, 3), np.uint8), 64)
    assert out.shape == (64, 128, 3) and out.dtype == np.uint8
    out = imaging.resize_shorter_side(np.zeros((300, 200, 3), np.uint8), 64)
    assert out.shape == (96, 64, 3)


def test_crop_square_center_and_random_stay_inside():
    image = asymmetric_image(10, 30)
    center = imaging.crop_square(image, 10, True, None)
    np.testing.assert_array_equal(center, image[:, 10:20])
    rng = np.random.default_rng(0)
    lefts = set()
    for _ in range(50):
        crop = imaging.crop_square(image, 10, False, rng)
        assert crop.shape == (10, 10, 3)
        lefts.add(int(crop[0, 0, 0]) // 3)
    assert len(lefts) > 5


def test_view_flip_mirrors_and_center_crop_is_deterministic():
    image = asymmetric_image(8, 8)
    plain = imaging.view(image, 8, True, False, np.random.default_rng(0))
    assert plain.dtype == np.uint8 and plain.shape == (8, 8, 3)
    views = {imaging.view(image, 8, True, True, np.random.default_rng(s)).tobytes() for s in range(20)}
    assert views == {plain.tobytes(), plain[:, ::-1].tobytes()}


@pytest.mark.parametrize("num_instance, num_class", [(5, 200), (5, 6), (6, 4), (3, 3), (1, 7), (5, 0)])
def test_plan_rows_pairs_every_image_each_epoch_and_drops_none(num_instance, num_class):
    rows = imaging.plan_rows(num_instance, num_class, 3, seed=0)
    per_epoch = max(num_instance, num_class)
    assert len(rows) == 3 * per_epoch and [r["epoch"] for r in rows] == sorted(r["epoch"] for r in rows)
    for epoch in range(3):
        epoch_rows = [r for r in rows if r["epoch"] == epoch]
        assert {r["instance"] for r in epoch_rows} == set(range(num_instance))
        counts = np.bincount([r["instance"] for r in epoch_rows])
        assert counts.max() - counts.min() <= 1  # instances repeat evenly
        if num_class:
            assert sorted(r["class"] for r in epoch_rows) == sorted(k % num_class for k in range(per_epoch))
        else:
            assert all("class" not in r for r in epoch_rows)


def test_plan_rows_come_from_the_seed_and_differ_between_epochs():
    a, b = imaging.plan_rows(4, 50, 2, seed=1), imaging.plan_rows(4, 50, 2, seed=1)
    assert a == b
    assert a != imaging.plan_rows(4, 50, 2, seed=2)
    first, second = a[:50], a[50:]
    assert [r["class"] for r in first] != [r["class"] for r in second]  # reshuffled each epoch
    assert len({r["seed"] for r in a}) == len(a)


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


def test_list_images_skips_non_images_and_refuses_empty(tmp_path, capsys):
    Image.new("RGB", (8, 8)).save(tmp_path / "b.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.jpg")
    (tmp_path / ".DS_Store").write_bytes(b"\0")
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "sub").mkdir()
    assert imagefiles.list_images(str(tmp_path), "instance") == [str(tmp_path / "a.jpg"), str(tmp_path / "b.png")]
    err = capsys.readouterr().err
    assert ".DS_Store" in err and "notes.txt" in err
    imagefiles.list_images(str(tmp_path), "instance", also_expected=".txt")
    err = capsys.readouterr().err
    assert ".DS_Store" in err and "notes.txt" not in err  # captions beside the images are expected
    empty = tmp_path / "sub"
    with pytest.raises(utils.UserError, match="holds no images"):
        imagefiles.list_images(str(empty), "class")
    with pytest.raises(utils.UserError, match="not found"):
        imagefiles.list_images(str(tmp_path / "missing"), "instance")


def test_tokenize_prompt_pads_to_model_max_length(tiny_model):
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    ids = dataset.tokenize_prompt(tokenizer, "photo of unqtkn dog")
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
    paths = imagefiles.list_images(toy_images, "instance")
    cache = dataset.LatentCache(tiny_model, num_gpus=0)
    ds = dataset.build_train_dataset(paths, paths[:3], 16, center_crop=True, random_flip=True, latent_cache=cache)
    rows = ds.take_all()
    assert len(rows) == 5
    assert all(r["instance_latents"].shape == (8, 8, 8) and r["class_latents"].shape == (8, 8, 8) for r in rows)
    # --enable_bucket: each photo's latents at its bucket, the class images' at every bucket the photos use
    tall = tall_photo_marked_at_the_top(tmp_path / "tall.png")
    buckets = imaging.bucket_sizes(16, 8, 32, 4)
    bucketed = dataset.build_train_dataset(paths + [tall], paths[:3], 16, center_crop=True, random_flip=True,
                                           latent_cache=cache, batch_size=2, buckets=buckets)
    batches = list(bucketed.iter_batches(batch_size=2))
    tall_bucket = buckets[imaging.bucket_for(240, 96, buckets)]
    assert {b["instance_latents"].shape[2:] for b in batches} == {(8, 8), (tall_bucket[0] // 2, tall_bucket[1] // 2)}
    assert all(b["class_latents"].shape == b["instance_latents"].shape for b in batches)
    encoder = dataset.LatentEncoder(tiny_model, True, False)
    images = [np.asarray(Image.open(p).convert("RGB")) for p in paths[:1]]
    views = encoder.encode([imaging.resize_shorter_side(x, 16) for x in images], 16)
    assert views.shape == (1, 2, 8, 8, 8) and not np.allclose(views[0, 0], views[0, 1])


def red_is_mask_photos(folder, count=3):
    """Photos whose red channel is their mask's value (a tall one, a wide one, one with transparency
    instead of a mask file), so a view's pixels say which mask pixels it must carry."""
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    photos = []
    for k, (height, width) in enumerate([(40, 24), (24, 36), (30, 30)][:count]):
        mask = (rng.random((height, width)) > 0.5).astype(np.uint8) * 255
        pixels = np.stack([mask, np.full_like(mask, 9 * k), np.full_like(mask, 7)], axis=-1)
        path = folder / f"p{k}.png"
        if k == 2:  # the mask as the photo's own alpha channel
            Image.fromarray(np.concatenate([pixels, mask[..., None]], axis=-1), "RGBA").save(path)
        else:
            Image.fromarray(pixels).save(path)
            Image.fromarray(mask).save(folder / f"p{k}{imagefiles.MASK_SUFFIX}")
        photos.append(str(path))
    return photos


def test_masks_come_from_a_file_beside_the_photo_or_its_transparency_and_are_never_photos(tmp_path):
    photos = red_is_mask_photos(tmp_path / "own")
    assert imagefiles.list_images(str(tmp_path / "own"), "instance") == photos  # the .mask.png files are not photos
    found = imagefiles.find_masks(photos)
    sources = [photos[0][:-4] + imagefiles.MASK_SUFFIX, photos[1][:-4] + imagefiles.MASK_SUFFIX, photos[2]]
    assert found == list(zip(sources, photos))
    for photo, source in zip(photos, sources):
        with Image.open(photo) as image:
            red = np.asarray(image.convert("RGB"))[..., 0]
        np.testing.assert_array_equal(imagefiles.read_mask(source, photo), red)
    assert imagefiles.masks_beside(photos) == sources[:2]
    # A photo stored sideways (EXIF 6) and its mask drawn on it as stored: both turned upright.
    mask = np.zeros((10, 20), np.uint8)
    mask[:, :5] = 255
    sideways = Image.fromarray(np.zeros((10, 20, 3), np.uint8))
    exif = sideways.getexif()
    exif[0x0112] = 6
    sideways.save(tmp_path / "s.jpg", exif=exif)
    Image.fromarray(mask).save(tmp_path / f"s{imagefiles.MASK_SUFFIX}")
    upright = imagefiles.read_mask(str(tmp_path / f"s{imagefiles.MASK_SUFFIX}"), str(tmp_path / "s.jpg"))
    np.testing.assert_array_equal(upright, imagefiles.apply_orientation(mask, 6))
    Image.fromarray(np.zeros((7, 7), np.uint8)).save(tmp_path / f"s{imagefiles.MASK_SUFFIX}")
    with pytest.raises(utils.UserError, match="is 7x7 px but its photo .* is 10x20: draw the mask"):
        imagefiles.find_masks([str(tmp_path / "s.jpg")])


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
    for row, index, lat, mask in zip(range(12), batch["instance"], picked["instance_latents"], picked["instance_mask"]):
        np.testing.assert_array_equal(mask, views[index][int(lat[0, 0, 0])])


def test_buckets_hold_about_the_resolutions_pixels_in_steps_of_every_shape():
    buckets = imaging.bucket_sizes(512, 256, 1024, 64)
    assert (512, 512) in buckets and (576, 448) in buckets and (448, 576) in buckets
    assert all(h % 64 == 0 and w % 64 == 0 and 256 <= min(h, w) and max(h, w) <= 1024 for h, w in buckets)
    assert all(h * w <= 512 * 512 and h * w > 512 * 512 * 0.75 for h, w in buckets)
    assert set(buckets) == {(w, h) for h, w in buckets}  # both orientations
    tall, wide, square = (imaging.bucket_for(h, w, buckets) for h, w in ((1000, 500), (300, 400), (700, 701)))
    assert buckets[square] == (512, 512)
    assert buckets[tall][0] / buckets[tall][1] == pytest.approx(2, rel=0.25)
    assert buckets[wide] == (448, 576)


def test_bucket_rows_put_one_bucket_in_each_block_and_every_photo_in_each_epoch():
    assigned = [0, 2, 2, 1, 2]  # the buckets of five photos
    rows = imaging.plan_bucket_rows(assigned, 7, num_epochs=2, seed=4, batch_size=2)
    per_epoch = imaging.bucket_epoch_rows(assigned, 7, 2)
    assert len(rows) == 2 * per_epoch and per_epoch % 2 == 0
    blocks = [rows[k:k + 2] for k in range(0, len(rows), 2)]
    assert all(len({r["bucket"] for r in b}) == 1 and all(r["bucket"] == assigned[r["instance"]] for r in b)
               for b in blocks)
    for epoch in (0, 1):
        mine = [r for r in rows if r["epoch"] == epoch]
        assert {r["instance"] for r in mine} == set(range(5)) and {r["class"] for r in mine} == set(range(7))
    assert rows == imaging.plan_bucket_rows(assigned, 7, num_epochs=2, seed=4, batch_size=2)  # seeded
    assert [r["bucket"] for r in rows] != [r["bucket"] for r in imaging.plan_bucket_rows(assigned, 7, 2, 5, 2)]


def tall_photo_marked_at_the_top(path, height=240, width=96):
    """A portrait photo: gray, with a red band across its top tenth."""
    pixels = np.full((height, width, 3), 128, np.uint8)
    pixels[:height // 10] = (255, 0, 0)
    Image.fromarray(pixels).save(path)
    return str(path)


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

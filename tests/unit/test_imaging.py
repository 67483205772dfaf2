"""imaging.py: resizes, crops and flips, the rows of a run and the aspect-ratio buckets, without Ray."""

import numpy as np
import pytest
from PIL import Image

from dreambooth.generation import imaging


def asymmetric_image(height=6, width=9):
    return np.arange(height * width * 3, dtype=np.uint8).reshape(height, width, 3)


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


def test_make_grid_is_near_square():
    sheet = imaging.make_grid([Image.new("RGB", (64, 64))] * 5, thumb_size=16)
    assert sheet.size == (48, 32)

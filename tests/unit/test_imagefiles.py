"""imagefiles.py: the photos on disk: listing, EXIF orientation, masks."""

import numpy as np
import pytest
from PIL import Image
from PIL import ImageOps
from support import red_is_mask_photos

from dreambooth import errors
from dreambooth.generation import imagefiles


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


def test_list_images_skips_non_images_and_refuses_empty(tmp_path, capsys):
    Image.new("RGB", (8, 8)).save(tmp_path / "b.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.jpg")
    (tmp_path / ".DS_Store").write_bytes(b"\0")
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "sub").mkdir()
    assert imagefiles.list_images(str(tmp_path), "instance") == [str(tmp_path / "a.jpg"), str(tmp_path / "b.png")]
    err = capsys.readouterr().err
    assert ".DS_Store" in err and "notes.txt" in err
    (tmp_path / "a.txt").write_text("a caption")
    imagefiles.list_images(str(tmp_path), "instance", also_expected=".txt")
    err = capsys.readouterr().err
    assert ".DS_Store" in err and "a.txt" not in err  # captions beside the images are expected
    assert "with no photo of the same name to caption: notes.txt" in err  # (a .txt that captions nothing)
    empty = tmp_path / "sub"
    with pytest.raises(errors.UserError, match="holds no images"):
        imagefiles.list_images(str(empty), "class")
    with pytest.raises(errors.UserError, match="not found"):
        imagefiles.list_images(str(tmp_path / "missing"), "instance")


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
    with pytest.raises(errors.UserError, match="is 7x7 px but its photo .* is 10x20: draw the mask"):
        imagefiles.find_masks([str(tmp_path / "s.jpg")])

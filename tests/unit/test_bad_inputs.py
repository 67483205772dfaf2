"""The bad-input catalogue: every odd photo is converted or named, never a traceback."""

import io
import shutil

import numpy as np
import pytest
from PIL import Image

from dreambooth import errors
from dreambooth import families
from dreambooth.generation import imagefiles
from dreambooth.generation import imaging
from dreambooth.generation import prompts


def read_rgb(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def inspect_one(tmp_path, image, name, resolution=16, **save):
    path = tmp_path / name
    image.save(path, **save)
    [out] = imagefiles.inspect_images([str(path)], resolution, str(tmp_path / "converted"))
    return out, str(path)


def test_plain_rgb_and_gray_are_read_in_place(tmp_path):
    for mode, name in (("RGB", "a.jpg"), ("L", "b.png")):
        out, path = inspect_one(tmp_path, Image.new(mode, (32, 24)), name)
        assert out == path


def test_transparent_pixels_become_white(tmp_path):
    image = Image.new("RGBA", (32, 32), (255, 0, 0, 0))
    image.putpixel((0, 0), (0, 0, 255, 255))
    out, path = inspect_one(tmp_path, image, "t.png")
    assert out != path and out.startswith(str(tmp_path / "converted"))
    rgb = read_rgb(out)
    assert tuple(rgb[5, 5]) == (255, 255, 255) and tuple(rgb[0, 0]) == (0, 0, 255)


def test_sixteen_bit_png_keeps_its_tones(tmp_path):
    array = np.full((32, 32), 32768, np.uint16)
    out, _ = inspect_one(tmp_path, Image.fromarray(array), "deep.png")
    assert abs(int(read_rgb(out)[0, 0, 0]) - 128) <= 1


def test_same_named_files_in_different_folders_convert_apart(tmp_path):
    paths = []
    for folder, color in (("a", (255, 0, 0, 255)), ("b", (0, 255, 0, 255))):
        (tmp_path / folder).mkdir()
        paths.append(str(tmp_path / folder / "x.png"))
        Image.new("RGBA", (16, 16), color).save(paths[-1])
    outs = imagefiles.inspect_images(paths, 16, str(tmp_path / "converted"))
    assert len(set(outs)) == 2
    assert tuple(read_rgb(outs[0])[0, 0]) == (255, 0, 0) and tuple(read_rgb(outs[1])[0, 0]) == (0, 255, 0)


def test_cmyk_and_palette_become_rgb(tmp_path):
    out, _ = inspect_one(tmp_path, Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "c.jpg")
    assert read_rgb(out)[0, 0, 0] > 200 and read_rgb(out)[0, 0, 1] < 60  # red
    palette = Image.new("P", (32, 32), 3)
    palette.putpalette([0, 0, 0] * 3 + [0, 200, 0] + [0, 0, 0] * 252)
    out, _ = inspect_one(tmp_path, palette, "p.png")
    assert tuple(read_rgb(out)[0, 0]) == (0, 200, 0)


def test_exif_rotated_photo_that_needs_conversion_is_stored_upright(tmp_path):
    image = Image.new("RGBA", (40, 20), (0, 0, 0, 255))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    out, _ = inspect_one(tmp_path, image, "r.png", exif=exif)
    assert read_rgb(out).shape == (40, 20, 3)
    assert imagefiles.exif_orientation(out) == 1


def test_corrupt_and_truncated_images_are_named(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg at all")
    with pytest.raises(errors.UserError, match="broken.jpg"):
        imagefiles.inspect_images([str(tmp_path / "broken.jpg")], 16, str(tmp_path))
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG")
    (tmp_path / "cut.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    with pytest.raises(errors.UserError, match="cut.jpg"):
        imagefiles.inspect_images([str(tmp_path / "cut.jpg")], 16, str(tmp_path))


def test_small_images_are_warned_and_large_ones_accepted(tmp_path, capsys):
    small, _ = inspect_one(tmp_path, Image.new("RGB", (8, 12)), "tiny.png", resolution=64)
    assert "tiny.png" in capsys.readouterr().err
    big, path = inspect_one(tmp_path, Image.new("RGB", (6000, 4000)), "huge.jpg", resolution=64)
    assert big == path
    assert imaging.resize_shorter_side(read_rgb(big), 64).shape == (64, 96, 3)


def test_pickled_weights_need_an_explicit_opt_in(tiny_model, tmp_path):

    import torch
    from safetensors.torch import load_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(weights), model / "unet" / "diffusion_pytorch_model.bin")
    weights.unlink()
    with pytest.raises(errors.UserError, match="'unet' .* only pickled .bin weights"):
        families.check_model_dir(str(model))
    families.check_model_dir(str(model), allow_unsafe_weights=True)
    from dreambooth.models import networks

    nets = networks.load_models(str(model), torch.device("cpu"), torch.device("cpu"), True, allow_unsafe_weights=True)
    assert nets.denoiser.config.sample_size == 32
    with pytest.raises(OSError, match="safetensors"):  # (diffusers refuses the pickled weights it was not allowed)
        networks.load_models(str(model), torch.device("cpu"), torch.device("cpu"), True)


def test_instance_prompt_without_identifier_is_detected():
    assert prompts.lacks_identifier("a photo of a dog", "photo of a dog")
    assert not prompts.lacks_identifier("photo of unqtkn dog", "photo of a dog")
    assert not prompts.lacks_identifier("photo of a dog", None)


def test_prompts_that_lack_the_tuned_models_identifier_are_warned_about():
    """generate.py on a tuned model: a prompt of a tutorial's ('sks') draws the class, not the subject."""
    trained = ("photo of unqtkn toy", "photo of a toy")
    warning = prompts.without_the_subject(["photo of sks dog, on a beach", "a toy"], *trained)
    assert warning == ("warning: no prompt names the subject: the model was trained on 'photo of unqtkn toy', whose "
                       "unqtkn the prompts lack (e.g. 'photo of sks dog, on a beach'): they draw the class, not your "
                       "subject")
    for named in (["a unqtkn toy, on a beach"], ["a toy", "UNQTKN,in the snow"]):
        assert prompts.without_the_subject(named, *trained) is None, named
    assert prompts.without_the_subject(["a unqtkn toy"], "photo of unqtkn, toy", "photo of a toy") is None
    # no identifier known: no class prompt, or an instance prompt that adds nothing to it
    assert prompts.without_the_subject(["a dog"], "photo of unqtkn toy", None) is None
    assert prompts.without_the_subject(["a dog"], "photo of a toy", "photo of a toy") is None


def test_a_model_config_cut_short_is_named(tiny_model, tmp_path):

    model = shutil.copytree(tiny_model, tmp_path / "model")
    config = model / "text_encoder" / "config.json"
    config.write_text(config.read_text()[:40])
    with pytest.raises(errors.UserError, match="text_encoder/config.json is not valid JSON"):
        families.check_model_dir(str(model))



import os

import numpy as np
import pytest
from PIL import Image

from dreambooth import errors
from dreambooth.generation import drawing
from dreambooth.generation import image_records
from dreambooth.models import outputs


def test_plan_images_tops_up_and_refuses_colliding_prompts(tmp_path):
    (tmp_path / drawing.image_file_name("a dog", 1)).write_bytes(b"x")
    rows, files = drawing.plan_images(["a dog", "a cat"], 2, 0, str(tmp_path))
    assert files == ["a-dog-00000.png", "a-dog-00001.png", "a-cat-00000.png", "a-cat-00001.png"]
    assert [r["file"] for r in rows] == ["a-dog-00000.png", "a-cat-00000.png", "a-cat-00001.png"]
    assert rows[0]["seed"] == drawing.image_seed(0, "a dog", 0)
    with pytest.raises(errors.UserError, match="share file names"):
        drawing.plan_images(["a dog", "A dog!"], 1, 0, str(tmp_path))


def test_image_file_name_sorts_by_index():
    names = [drawing.image_file_name("photo of a dog", i) for i in (0, 2, 10)]
    assert names == sorted(names)
    assert names[0] == "photo-of-a-dog-00000.png"


def test_image_seed_depends_on_seed_prompt_and_index_only():
    a = drawing.image_seed(0, "photo of a dog", 3)
    assert a == drawing.image_seed(0, "photo of a dog", 3)
    others = {drawing.image_seed(1, "photo of a dog", 3), drawing.image_seed(0, "photo of a cat", 3),
              drawing.image_seed(0, "photo of a dog", 4)}
    assert a not in others
    assert 0 <= a < 2**31


def test_lora_dir_applies_the_adapters_at_their_scale(lora_output, tiny_model):
    import torch

    folder, _ = lora_output
    assert outputs.resolve_model(folder, None) == outputs.ModelRef(tiny_model, folder)  # a LoRA output as --model_dir
    assert outputs.resolve_model(tiny_model, folder) == outputs.ModelRef(tiny_model, folder)
    with pytest.raises(errors.UserError, match="has no pytorch_lora_weights.safetensors"):
        outputs.resolve_model(tiny_model, tiny_model)
    assert drawing.use_safety_checker("auto", outputs.ModelRef(tiny_model, folder))
    assert not drawing.use_safety_checker("auto", outputs.ModelRef(tiny_model))

    def images(**lora):
        pipe = drawing.load_pipeline(tiny_model, torch.device("cpu"), **lora)
        out, _ = drawing.generate_batch(pipe, ["photo of unqtkn toy"], [3],
                                        drawing.ImageSettings(num_inference_steps=2))
        return np.asarray(out[0], dtype=int)

    base = images()
    assert np.abs(images(lora_dir=folder, lora_scale=0.0) - base).max() <= 1
    assert np.abs(images(lora_dir=folder) - base).max() > 10


def test_class_images_are_kept_when_only_what_training_does_not_read_differs(tiny_model, tmp_path, capsys):
    """Class images (generate.py --class_images, train.py's top-up) drawn with other steps, guidance or
    seed are kept with a line; another size, prompt or model is still refused, naming IMAGES_REG_DIR."""
    folder = str(tmp_path / "class")
    model = outputs.ModelRef(tiny_model)
    drawn = drawing.ImageSettings(num_inference_steps=3, seed=1)
    drawing.top_up(folder, model, ["photo of a dog"], 2, drawn, False)
    for name in ("photo-of-a-dog-00000.png", "photo-of-a-dog-00001.png"):
        Image.new("RGB", (64, 64)).save(os.path.join(folder, name))
    again = drawing.ImageSettings(num_inference_steps=50, seed=0, guidance_scale=5.0)
    job = drawing.top_up(folder, model, ["photo of a dog"], 3, again, False, class_images=True)
    err = capsys.readouterr().err
    assert "keeping the 2 class images" in err and "3 steps" in err and "50 steps" in err
    assert len(job.rows) == 1 and len(image_records.drawn_images(folder)) == 2  # only the missing one is drawn
    with pytest.raises(errors.UserError, match="images were drawn with"):  # not class images: refused as before
        drawing.top_up(folder, model, ["photo of a dog"], 3, again, False)
    with pytest.raises(errors.UserError, match="32 px.*IMAGES_REG_DIR"):
        drawing.top_up(folder, model, ["photo of a dog"], 3, drawing.ImageSettings(resolution=32), False,
                       remedy="set IMAGES_REG_DIR to another folder", class_images=True)
    assert len(image_records.drawn_images(folder)) == 2  # nothing deleted


def test_images_beyond_a_smaller_count_are_removed_with_a_line_but_class_images_stay(tiny_model, tmp_path, capsys):
    """A rerun asking for fewer images of the same model and settings (NUM_NEW_IMAGES 5 -> 3) leaves the folder
    holding what it names (it once kept the two beyond, while saying "3 images in" the folder); a class-image
    folder keeps them (training reads the first --num_class_images)."""
    model, settings = outputs.ModelRef(tiny_model), drawing.ImageSettings(num_inference_steps=2)
    for folder, class_images in ((tmp_path / "new", False), (tmp_path / "class", True)):
        drawing.top_up(str(folder), model, ["a toy, on a beach"], 5, settings, False, class_images=class_images)
        for k in range(5):
            Image.new("RGB", (8, 8)).save(folder / drawing.image_file_name("a toy, on a beach", k))
        os.rename(folder / drawing.image_file_name("a toy, on a beach", 4),
                  folder / (drawing.image_file_name("a toy, on a beach", 4) + drawing.FLAGGED_SUFFIX))
        capsys.readouterr()
        job = drawing.top_up(str(folder), model, ["a toy, on a beach"], 3, settings, False, class_images=class_images)
        err = capsys.readouterr().err
        assert job.rows == () and "3 of 3 images already there; generating 0" in err
        left = image_records.drawn_images(str(folder))
        if class_images:
            assert len(left) == 5 and "removed" not in err
        else:
            assert left == [drawing.image_file_name("a toy, on a beach", k) for k in range(3)]
            assert f"{folder}: removed 2 image(s) beyond the 3 per prompt asked now (drawn by an earlier run" in err


def test_the_progress_bar_counts_its_rate_over_the_whole_drawing(tiny_model, tmp_path, capsys):
    """A batch's images land together: the rate counted from the first of them (or smoothed over the last few)
    said hundreds of images a second of a model that draws a few. The bar's last rate is the images over its time."""
    import re
    import time

    from dreambooth.generation import drawing
    from dreambooth.models import outputs

    settings = drawing.ImageSettings(num_inference_steps=2)
    job = drawing.top_up(str(tmp_path), outputs.ModelRef(tiny_model), ["photo of a toy"], 4, settings, False)
    began = time.perf_counter()
    drawing.make_images_of([job], settings, batch_size=4, here=True)
    seconds = time.perf_counter() - began
    number, unit = re.findall(r"([\d.]+)(img/s|s/img)", capsys.readouterr().err)[-1]
    rate = float(number) if unit == "img/s" else 1 / float(number)
    assert 0 < rate <= 1.1 * 4 / seconds, (rate, seconds)

"""inputs.py: the files a run trains on, read and checked before anything starts."""

import shutil

import pytest

from dreambooth import errors
from dreambooth.generation import drawing
from dreambooth.models import outputs
from dreambooth.planning import inputs

SETTINGS = drawing.ImageSettings(num_inference_steps=3, seed=1)


def test_class_images_of_another_model_prompt_or_size_are_refused_for_training(tiny_model, tmp_path):
    folder = str(tmp_path / "class")
    drawing.top_up(folder, outputs.ModelRef(tiny_model), ["photo of a dog"], 1, SETTINGS, False)
    inputs.check_class_images(folder, tiny_model, "photo of a dog", 64)  # the same: fine
    with pytest.raises(errors.UserError, match="drawn with prompt 'photo of a dog'.*not with this run's"):
        inputs.check_class_images(folder, tiny_model, "photo of a cat", 64)
    with pytest.raises(errors.UserError, match="drawn with 64 px"):
        inputs.check_class_images(folder, tiny_model, "photo of a dog", 128)
    copy = shutil.copytree(tiny_model, tmp_path / "other-model")
    (copy / "unet" / "config.json").write_text((copy / "unet" / "config.json").read_text() + " ")
    with pytest.raises(errors.UserError, match="drawn with base model"):
        inputs.check_class_images(folder, str(copy), "photo of a dog", 64)
    inputs.check_class_images(str(tmp_path), tiny_model, "anything", 512)  # no record: the user's own images

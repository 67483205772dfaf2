"""FLUX.2 [dev]'s released tokenizer without torchvision: refused in one line by a new process."""

import json

import pytest
from PIL import Image

from dreambooth import errors
from dreambooth import families
from dreambooth.commands import preflight
from dreambooth.families import flux2dev as family_flux2_dev


def test_the_released_tokenizer_without_torchvision_is_refused_in_one_line(tiny_flux2dev_model, tmp_path):
    """The released folder's tokenizer is a PixtralProcessor, which transformers builds only with torchvision (not a
    requirement of ours, so not on this machine): a machine without it gets the line that says what to install,
    not a traceback."""
    import importlib.util
    import shutil

    assert importlib.util.find_spec("torchvision") is None
    folder = tmp_path / "model"
    shutil.copytree(tiny_flux2dev_model, folder)
    (folder / "tokenizer" / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2}))
    (folder / "tokenizer" / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor", "patch_size": 14}))
    line = r"^FLUX.2 \[dev\]'s tokenizer .* needs torchvision: pip install torchvision==0.28.0"
    for check in (families.check_model_dir, family_flux2_dev.FAMILY.load_tokenizers):  # (before Ray; a worker's)
        with pytest.raises(errors.UserError, match=line):
            check(str(folder))
    families.check_model_dir(tiny_flux2dev_model)  # (the tiny one's plain tokenizer needs none)
    # dreambooth_run.sh's Step 0 for the short name, before Step 1 fetches its 112.6 GB
    (tmp_path / "photos").mkdir()
    Image.new("RGB", (64, 64), "red").save(tmp_path / "photos" / "a.jpg")
    with pytest.raises(errors.UserError, match=line):
        preflight.main(["--photos_dir", str(tmp_path / "photos"), "--data_prefix", str(tmp_path / "data"),
                        "--class_name", "dog", "--model_name", "flux2-dev"])



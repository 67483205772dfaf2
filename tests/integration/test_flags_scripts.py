"""The scripts' command lines as processes: every --help explains itself and states each default once, a missing model
is one line, not a traceback."""

import os
import subprocess
import sys

import pytest

from dreambooth.files import REPO_DIR


def test_missing_model_is_one_line_error_not_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "--model_dir", str(tmp_path / "nope"), "--output_dir",
                           str(tmp_path / "o"), "--instance_images_dir", str(tmp_path), "--instance_prompt", "p"],
                          cwd=REPO_DIR, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: model folder not found: {tmp_path / 'nope'}"


# Every option of diffusers' examples/dreambooth/train_dreambooth.py (at 58eb52c).

# The Stable Diffusion commands of diffusers' examples/dreambooth/README.md, paths changed;
# --push_to_hub, which every one of them ends with, is checked apart.


# Every option of diffusers' examples/dreambooth/train_dreambooth_lora_sdxl.py (at 58eb52c).


# Every option of diffusers' examples/dreambooth/train_dreambooth_lora_flux.py and _lora_sd3.py (at 58eb52c).


# Every option of diffusers' examples/dreambooth/train_dreambooth_lora_flux2.py and _flux2_klein.py (at 58eb52c; the
# klein script has --caption_dropout, not --remote_text_encoder).


# The SDXL LoRA command of diffusers' examples/dreambooth/README_sdxl.md, paths changed, with the
# --use_lora this suite asks for (the LoRA scripts always train LoRA); --report_to="wandb" and
# --push_to_hub are checked apart.


@pytest.mark.parametrize("script", ["train.py", "generate.py", "evaluate.py", "sweep.py", "export.py",
                                    "cache_model.py", "download_example_dataset.py"])
def test_help_explains_every_script_and_states_each_default_once(script):
    import importlib
    import re

    module = importlib.import_module(script[:-3])
    out = subprocess.run([sys.executable, script, "--help"], cwd=REPO_DIR, capture_output=True, text=True, check=True,
                         env=dict(os.environ, COLUMNS="10000")).stdout
    assert module.__name__ and "usage:" in out and len(out.splitlines()) > 5
    for line in out.splitlines():
        if line.lstrip().startswith("-"):
            assert len(re.findall(r"default", line, re.I)) <= 1, line
    assert "(default: None)" not in out and "(default: False)" not in out


def test_evaluate_does_not_take_num_class_images_which_means_class_images_elsewhere():
    from dreambooth.commands import evaluate

    with pytest.raises(SystemExit):
        evaluate.main(["--model_dir", "m", "--instance_data_dir", "p", "--class_name", "dog", "--eval_models_dir", "e",
                       "--output_dir", "o", "--num_class_images", "3"])

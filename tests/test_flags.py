import os
import subprocess
import sys

import pytest

import flags
import plan
from utils import REPO_DIR

BASE = ["--model_dir", "/m", "--output_dir", "/o", "--instance_images_dir", "/i", "--instance_prompt", "p"]


def parse_train(argv):
    return plan.parse_args(argv)


def test_ray_example_names_are_aliases_of_diffusers_names():
    seeds = parse_train(BASE + ["--class_images_dir", "/c", "--class_prompt", "q", "--lr", "1e-4",
                                "--num_epochs", "7", "--num_workers", "3"])
    diffusers_style = parse_train(["--pretrained_model_name_or_path", "/m", "--output_dir", "/o",
                                   "--instance_data_dir", "/i", "--instance_prompt", "p",
                                   "--class_data_dir", "/c", "--class_prompt", "q", "--learning_rate", "1e-4",
                                   "--num_train_epochs", "7", "--num_workers", "3"])
    assert vars(seeds) == vars(diffusers_style)
    assert seeds.model_dir == "/m" and seeds.learning_rate == 1e-4 and seeds.num_train_epochs == 7


def test_class_dir_turns_on_prior_preservation_and_storage_defaults_beside_output():
    args = parse_train(BASE + ["--class_images_dir", "/c", "--class_prompt", "q"])
    assert args.with_prior_preservation
    assert args.storage_path == "/ray_results"
    assert not parse_train(BASE).with_prior_preservation


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parse_train(["--model_dir", "m", "--output_dir", "o", "--instance_images_dir", "i",
                        "--instance_prompt", "p"])
    assert args.model_dir == str(tmp_path / "m") and args.instance_data_dir == str(tmp_path / "i")


@pytest.mark.parametrize("extra, message", [
    (["--lr", "-1"], "must be > 0"),
    (["--max_train_steps", "0"], "positive integer"),
    (["--resolution", "100"], "multiple of 8"),
    (["--with_prior_preservation"], "needs --class_data_dir"),
    (["--class_images_dir", "/c"], "needs --class_prompt"),
    (["--num_workers", "0"], "positive integer"),
    (["--prior_loss_weight", "-0.5"], "must be >= 0"),
])
def test_bad_flags_exit_2_with_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_train(BASE + extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("script", ["train.py", "generate.py", "cache_model.py", "download_example_dataset.py"])
def test_help_explains_every_script(script):
    out = subprocess.run([sys.executable, script, "--help"], cwd=REPO_DIR, capture_output=True, text=True,
                         check=True).stdout
    assert "usage:" in out and len(out.splitlines()) > 5


def test_missing_model_is_one_line_error_not_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "--model_dir", str(tmp_path / "nope"), "--output_dir",
                           str(tmp_path / "o"), "--instance_images_dir", str(tmp_path), "--instance_prompt", "p"],
                          cwd=REPO_DIR, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: model folder not found: {tmp_path / 'nope'}"


def test_every_flag_answers_to_its_hyphenated_spelling():
    underscored = parse_train(BASE + ["--class_images_dir", "/c", "--class_prompt", "q", "--num_workers", "4",
                                      "--max_train_steps=9"])
    hyphenated = parse_train(["--model-dir", "/m", "--output-dir=/o", "--instance-images-dir", "/i",
                              "--instance-prompt", "p", "--class-images-dir", "/c", "--class-prompt", "q",
                              "--num-workers=4", "--max-train-steps", "9"])
    assert vars(hyphenated) == vars(underscored)
    assert flags.normalize_option("--no-train-text-encoder") == "--no-train_text_encoder"
    assert flags.normalize_option("--negative_prompt=a-b --c") == "--negative_prompt=a-b --c"
    assert flags.normalize_option("-h") == "-h" and flags.normalize_option("photo-of") == "photo-of"


def test_readme_compatibility_claims_hold():
    """The README's lists of train_dreambooth.py flags that train.py accepts and refuses (defect 7:
    it once said every train_dreambooth.py command ran unchanged, and two of them were refused)."""
    import re

    with open(os.path.join(REPO_DIR, "README.md")) as f:
        text = f.read()
    paragraph = text[text.index("The diffusers names of the flags"):text.index("naming the unknown flag")]
    shared, rest = paragraph.split("), and every", 1)
    accepted = re.findall(r"`(--[a-z0-9_]+)`", shared)
    refused = re.findall(r"`(--[a-z0-9_]+)`", rest.split("run unchanged yet:", 1)[1])
    options = flags.make_parser("t", plan.TRAIN_FLAGS)._option_string_actions
    assert len(accepted) >= 8 and all(o in options for o in accepted), accepted
    assert len(refused) >= 3 and not any(o in options for o in refused), refused
    assert "--num_class_images" in flags.FLAGS["num_samples_per_prompt"][0] and "--num_class_images" not in options

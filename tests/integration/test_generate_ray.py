"""generate.py's actor pool: several models on one pool, each with its weights, adapters and safety checker; a tuned
model's flagged images withheld unless the checker is off; run_model.py is generate.py under Ray's example name."""

import os

import numpy as np
import pytest
from PIL import Image

from dreambooth import files
from dreambooth.commands import generate
from dreambooth.generation import drawing
from dreambooth.generation import image_records
from dreambooth.models import outputs


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


@pytest.fixture(scope="module")
def checked_model(tmp_path_factory):
    """A tiny model with a safety checker that flags every image, as a base model and as a tuned one."""
    import torch

    from dreambooth.models import random_models

    pipe = random_models.build_pipeline("tiny", safety_checker=True)
    with torch.no_grad():
        pipe.safety_checker.concept_embeds_weights.fill_(-1.0)
    base = tmp_path_factory.mktemp("checked-base")
    pipe.save_pretrained(base, safe_serialization=True)
    tuned = tmp_path_factory.mktemp("checked-tuned")
    pipe.save_pretrained(tuned, safe_serialization=True)
    files.write_json(os.path.join(tuned, files.OUTPUT_MARKER), {"base_model": str(base)})
    return str(base), str(tuned)


def test_a_tuned_models_flagged_images_are_not_saved_unless_the_checker_is_off(ray_session, checked_model, tmp_path,
                                                                              capsys):
    """generate.py on a tuned model whose checker flags every image: none saved, a line says so, a rerun draws none
    again. (With --safety_checker off they are saved, and the same checker's model as a base model, whose class images
    are drawn without it: test_one_pool_draws_several_models_each_with_its_weights_adapters_and_checker.)"""
    _, tuned = checked_model
    common = ["--prompts", "photo of a dog", "--num_samples_per_prompt", "2", "--num_inference_steps", "2"]
    new = tmp_path / "new"
    generate.main(["--model_dir", tuned, "--output_dir", str(new)] + common)
    err = capsys.readouterr().err
    assert "2 image(s) flagged by the safety checker were not saved" in err
    assert sorted(os.listdir(new)) == sorted([drawing.image_file_name("photo of a dog", i) + drawing.FLAGGED_SUFFIX
                                              for i in range(2)] + [drawing.GRID_DIR, image_records.IMAGES_RECORD,
                                                                    image_records.IMAGES_CONFIG])
    generate.main(["--model_dir", tuned, "--output_dir", str(new)] + common)  # done: nothing made again
    assert "generating 0" in capsys.readouterr().err


def test_run_model_is_generate_under_the_air_example_name():
    import subprocess
    import sys

    def options(script):
        out = subprocess.run([sys.executable, script, "--help"], cwd=files.REPO_DIR,
                             capture_output=True, text=True, check=True).stdout
        return sorted(w for w in out.split() if w.startswith("--"))

    assert options("run_model.py") == options("generate.py") and "--num_samples_per_prompt" in options("generate.py")


def test_one_pool_draws_several_models_each_with_its_weights_adapters_and_checker(
        ray_session, tiny_model, lora_output, checked_model, tmp_path, capsys):
    """scoring.run (evaluate.py) and the sweep draw every model's images on one pool: batches that mix models
    must give each row its own model's image, as that model alone would draw it."""
    import torch

    lora_dir, _ = lora_output
    settings = drawing.ImageSettings(num_inference_steps=2, seed=5)
    prompts = ["photo of a dog", "photo of a cat"]
    checked_base = outputs.ModelRef(checked_model[0])  # (class images: a base model's, drawn without its checker)
    checked_tuned = outputs.ModelRef(checked_model[1])
    models = {"base": (outputs.ModelRef(tiny_model), False), "lora": (outputs.ModelRef(tiny_model, lora_dir), False),
              "checked": (checked_tuned, True),
              "base-with-checker": (checked_base, drawing.use_safety_checker("auto", checked_base)),
              "checked-off": (checked_tuned, drawing.use_safety_checker("off", checked_tuned))}
    count = {"checked": 1, "base-with-checker": 1, "checked-off": 1}  # (images per prompt; 2 for the others)
    jobs = [drawing.top_up(str(tmp_path / name), model, prompts, count.get(name, 2), settings, checker)
            for name, (model, checker) in models.items()]
    drawing.make_images_of(jobs, settings, batch_size=3, num_actors=1)  # batches 2 and 3 mix models

    for name in ("base", "lora"):
        pipe = drawing.load_pipeline(tiny_model, torch.device("cpu"), lora_dir=models[name][0].lora_dir)
        for row in jobs[0].rows:
            alone, _ = drawing.generate_batch(pipe, [row["prompt"]], [row["seed"]], settings)
            np.testing.assert_allclose(pixels(tmp_path / name / row["file"]).astype(int),
                                       np.asarray(alone[0], dtype=int), atol=1)
    dog = drawing.image_file_name("photo of a dog", 0)
    assert np.abs(pixels(tmp_path / "lora" / dog).astype(int) - pixels(tmp_path / "base" / dog).astype(int)).max() > 10
    assert sorted(os.listdir(tmp_path / "checked")) == sorted(
        [drawing.image_file_name(p, 0) + drawing.FLAGGED_SUFFIX for p in prompts] + [image_records.IMAGES_RECORD])
    for prompt in prompts:  # the base model's, and the tuned one's with --safety_checker off: saved, not black
        for name in ("base-with-checker", "checked-off"):
            assert pixels(tmp_path / name / drawing.image_file_name(prompt, 0)).max() > 0
    err = capsys.readouterr().err
    assert "generating for 5 models on 1 actor(s)" in err
    assert "2 image(s) flagged by the safety checker were not saved" in err and str(tmp_path / "checked") in err
    # a scoring task draws them in its own process (here=True) with the actor's class: the same files, byte for byte
    here = [drawing.top_up(str(tmp_path / "here" / name), model, prompts, count.get(name, 2), settings, checker)
            for name, (model, checker) in models.items()]
    drawing.make_images_of(here, settings, batch_size=3, num_actors=1, here=True)
    assert "generating for 5 models in this process" in capsys.readouterr().err
    for name in models:
        names = sorted(os.listdir(tmp_path / name))
        assert sorted(os.listdir(tmp_path / "here" / name)) == names
        for file in names:
            if file.endswith(".png"):
                assert (tmp_path / "here" / name / file).read_bytes() == (tmp_path / name / file).read_bytes(), file



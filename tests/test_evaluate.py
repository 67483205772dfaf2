import json
import os

import pytest
import torch

import evaluate
import scores
import utils


def test_prompt_sets_have_25_prompts_each_with_the_subject():
    for subject_type in ("object", "live"):
        templates = evaluate.prompt_templates(subject_type)
        assert len(templates) == len(set(templates)) == 25
        assert all(t.count("{subject}") == 1 for t in templates)


def test_own_prompt_file_without_the_subject_is_refused(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("# mine\na {subject} on a beach\na dog in the snow\n")
    with pytest.raises(utils.UserError, match="every prompt needs '{subject}'.*a dog in the snow"):
        evaluate.prompt_templates("object", str(path))


@pytest.fixture()
def tuned_from_tiny(tiny_model, tmp_path):
    """A 'tuned' model: the tiny model with shifted weights and train.py's record of its base."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    with torch.no_grad():
        for weight in pipe.unet.parameters():
            weight.add_(0.01)
    folder = tmp_path / "tuned"
    pipe.save_pretrained(folder)
    utils.write_json(folder / utils.OUTPUT_MARKER, {"base_model": tiny_model})
    return str(folder)


def test_evaluate_scores_the_tuned_and_the_base_model_and_writes_the_report(ray_session, tuned_from_tiny,
                                                                            toy_images, tmp_path):
    models_dir = tmp_path / "eval-models"
    scores.build_tiny_eval_models(str(models_dir))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a {subject} on a beach\na {subject} in the snow\n")
    out = tmp_path / "eval"
    argv = ["--model_dir", tuned_from_tiny, "--instance_data_dir", toy_images, "--class_name", "toy",
            "--eval_prompts", str(prompts), "--eval_models_dir", str(models_dir), "--output_dir", str(out),
            "--num_samples_per_prompt", "2", "--num_inference_steps", "2", "--num_actors", "1"]
    result = evaluate.main(argv)

    assert set(result["models"]) == {"tuned", "base"}  # the base model from train.py's record
    for label in ("tuned", "base"):
        # 2 subject prompts + the class prompt, 2 images each, and a grid per prompt
        assert len([f for f in os.listdir(out / "images" / label) if f.endswith(".png")]) == 6
        assert len(os.listdir(out / "grids" / label)) == 3
        overall = result["models"][label]["overall"]
        assert set(overall) == {"dino", "clip_i", "clip_t", "div", "pres"}
        assert all(-1 <= overall[k] <= 1 for k in ("dino", "clip_i", "clip_t", "pres")) and overall["div"] >= 0
        assert set(result["models"][label]["per_prompt"]) == {"a unqtkn toy on a beach", "a unqtkn toy in the snow"}
    tuned, base = result["models"]["tuned"]["overall"], result["models"]["base"]["overall"]
    assert tuned["dino"] != base["dino"]  # different weights drew different images
    assert json.loads((out / "scores.json").read_text())["models"]["tuned"]["overall"] == pytest.approx(tuned)
    report = (out / "report.md").read_text()
    assert "| tuned |" in report and "| base |" in report and "| paper, SD DreamBooth | 0.668 | 0.803 | 0.305" in report


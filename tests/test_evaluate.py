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
    """A 'tuned' model: the tiny model with shifted weights (no record of its base: scored alone)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    with torch.no_grad():
        for weight in pipe.unet.parameters():
            weight.add_(0.01)
    folder = tmp_path / "tuned"
    pipe.save_pretrained(folder)
    return str(folder)


def test_the_base_model_is_the_recorded_one_or_the_one_a_lora_applies_to(tiny_model, lora_output, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    utils.write_json(full / utils.OUTPUT_MARKER, {"base_model": tiny_model})
    assert evaluate.models_to_score(str(full), None, None) == [("tuned", str(full), None), ("base", tiny_model, None)]
    lora_dir, _ = lora_output
    assert evaluate.models_to_score(lora_dir, None, None) == [("tuned", tiny_model, lora_dir),
                                                                ("base", tiny_model, None)]
    assert evaluate.models_to_score(tiny_model, None, str(full))[1] == ("base", str(full), None)


def test_report_puts_each_model_beside_the_papers_values(tmp_path):
    s = {"dino": 0.5, "clip_i": 0.6, "clip_t": 0.25, "div": None, "pres": 0.4}
    result = {"subject": "unqtkn dog", "num_prompts": 1, "num_samples_per_prompt": 1, "num_photos": 5,
              "prompts": ["a unqtkn dog"], "models": {label: {"overall": s, "per_prompt": {"a unqtkn dog": s}}
                                                       for label in ("tuned", "base")}}
    evaluate.write_report(str(tmp_path / "report.md"), result)
    report = (tmp_path / "report.md").read_text()
    assert "| tuned | 0.500 | 0.600 | 0.250 |  | 0.400 |" in report and "| base |" in report
    assert "| paper, SD DreamBooth | 0.668 | 0.803 | 0.305" in report
    assert "| a unqtkn dog | 0.500 | 0.250 | 0.500 | 0.250 |" in report


def test_evaluate_generates_embeds_and_scores_on_actor_pools(ray_session, tuned_from_tiny, toy_images, tmp_path):
    models_dir = tmp_path / "eval-models"
    scores.build_tiny_eval_models(str(models_dir))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a {subject} on a beach\na {subject} in the snow\n")
    out = tmp_path / "eval"
    result = evaluate.main(["--model_dir", tuned_from_tiny, "--instance_data_dir", toy_images, "--class_name", "toy",
                            "--eval_prompts", str(prompts), "--eval_models_dir", str(models_dir),
                            "--output_dir", str(out), "--num_samples_per_prompt", "2", "--num_inference_steps", "2",
                            "--num_actors", "1"])

    assert set(result["models"]) == {"tuned"}  # no recorded base model, none given
    # 2 subject prompts + the class prompt, 2 images each, and a grid per prompt
    assert len([f for f in os.listdir(out / "images" / "tuned") if f.endswith(".png")]) == 6
    assert len(os.listdir(out / "grids" / "tuned")) == 3
    overall = result["models"]["tuned"]["overall"]
    assert set(overall) == {"dino", "clip_i", "clip_t", "div", "pres"}
    assert all(-1 <= overall[k] <= 1 for k in ("dino", "clip_i", "clip_t", "pres")) and overall["div"] > 0
    per_prompt = result["models"]["tuned"]["per_prompt"]
    assert set(per_prompt) == {"a unqtkn toy on a beach", "a unqtkn toy in the snow"}
    assert per_prompt["a unqtkn toy on a beach"]["dino"] != per_prompt["a unqtkn toy in the snow"]["dino"]
    assert json.loads((out / "scores.json").read_text())["models"]["tuned"]["overall"] == pytest.approx(overall)
    assert "| tuned |" in (out / "report.md").read_text()

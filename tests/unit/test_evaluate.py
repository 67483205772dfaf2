"""evaluate.py's prompt sets, base-model choice and report (its end-to-end run is Step 6 of test_dreambooth_run)."""

import os

import pytest

from dreambooth import errors
from dreambooth import files
from dreambooth.commands import evaluate
from dreambooth.config import flags
from dreambooth.evaluation import eval_report
from dreambooth.evaluation import scoring
from dreambooth.generation import image_records
from dreambooth.models import outputs


def test_prompt_sets_have_25_prompts_each_with_the_subject():
    for subject_type in ("object", "live"):
        templates = scoring.prompt_templates(subject_type)
        assert len(templates) == len(set(templates)) == 25
        assert all(t.count("{subject}") == 1 for t in templates)


def test_the_prompt_set_defaults_to_the_classs_as_the_script_says():
    """evaluate.py and sweep.py without --subject_type score a dog with the live set, as dreambooth_run.sh's
    Step 6 does (they used 'object' for every class: another score than the script's for the same model)."""
    def subject(class_name, subject_type=None):
        return scoring.Subject("rex", "/p", "unqtkn", class_name, subject_type)

    assert subject("dog").subject_type == subject("Guinea pig").subject_type == "live"
    assert subject("backpack").subject_type == subject("dog toy").subject_type == "object"
    assert subject("dog", "object").subject_type == "object"  # (given: it wins)
    assert "a unqtkn dog running on a beach" in subject("dog").prompts()  # (the live set's first prompt)
    assert flags.FLAGS["subject_type"][1]["default"] is None


def test_own_prompt_file_without_the_subject_is_refused(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("# mine\na {subject} on a beach\na dog in the snow\n")
    with pytest.raises(errors.UserError, match="every prompt needs '{subject}'.*a dog in the snow"):
        scoring.prompt_templates("object", str(path))


def test_the_base_model_is_the_recorded_one_or_the_one_a_lora_applies_to(tiny_model, lora_output, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    files.write_json(full / files.OUTPUT_MARKER, {"base_model": tiny_model})
    ref = outputs.ModelRef
    assert scoring.models_to_score(str(full), None, None) == [("tuned", ref(str(full))), ("base", ref(tiny_model))]
    lora_dir, _ = lora_output
    assert scoring.models_to_score(lora_dir, None, None) == [("tuned", ref(tiny_model, lora_dir)),
                                                                ("base", ref(tiny_model))]
    assert scoring.models_to_score(tiny_model, None, str(full))[1] == ("base", ref(str(full)))


def test_held_out_photos_are_scored_apart_and_must_be_the_ones_training_left_out(tmp_path, tiny_model):
    import torch

    def unit(*values):
        v = torch.tensor(values, dtype=torch.float32)
        return v / v.norm()

    emb = {"gen": {"dino": unit(1, 0), "clip": unit(1, 0), "text_clip": unit(1, 0)},
           "seen": {"dino": unit(1, 0), "clip": unit(1, 0)}, "unseen": {"dino": unit(0, 1), "clip": unit(1, 1)}}
    s = scoring.score_set(emb, {"p": ["gen"]}, ["seen"], ["unseen"])
    assert s["dino"] == pytest.approx(1.0) and s["dino_holdout"] == pytest.approx(0.0)
    assert s["clip_i_holdout"] == pytest.approx(2 ** -0.5) and "dino_holdout" not in scoring.score_set(
        emb, {"p": ["gen"]}, ["seen"])
    line = eval_report.summary({**s, "pres": None})
    assert "DINO held out 0.000, CLIP-I held out 0.707" in line
    assert "DIV n/a (one image per prompt: diversity needs two)" in line  # (was "DIV ," with no reason)
    result = scoring.EvalResult("unqtkn dog", 1, 1, 4, ("p",), {"tuned": scoring.ModelScores({**s, "pres": 0.4}, {})},
                                held_out=("e.jpg",),
                                scored=eval_report.scored_models([("tuned", outputs.ModelRef(tiny_model, "/a/lora"))]))
    eval_report.write_report(str(tmp_path / "report.md"), result)
    report = (tmp_path / "report.md").read_text()
    # which model, of which family, the scores are of: in the report and in scores.json
    assert f"- tuned: `{tiny_model} + LoRA /a/lora` (SD 1.x)" in report
    assert scoring.EvalResult.from_json(result.to_json()).scored == {"tuned": {"model": f"{tiny_model} + LoRA /a/lora",
                                                                               "family": "SD 1.x"}}
    assert "(+ 1 held out of training: e.jpg)" in report and "| tuned | 1.000 | 1.000 | 1.000 |  | 0.400 | 0.000 | 0.707 |" in report
    # The model's record must name the same photos as the split
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in "abcde":
        (photos / f"{name}.jpg").write_bytes(b"")
    subject = scoring.Subject("photos", str(photos), "unqtkn", "dog", holdout=1)
    assert [os.path.basename(p) for p in subject.split()[1]] == ["e.jpg"]
    model = tmp_path / "model"
    model.mkdir()
    files.write_json(str(model / files.OUTPUT_MARKER), {"held_out": ["e.jpg"]})
    evaluate.check_holdout(str(model), subject)
    files.write_json(str(model / files.OUTPUT_MARKER), {"held_out": []})
    with pytest.raises(errors.UserError, match="was trained on every photo; --holdout 1 holds out e.jpg"):
        evaluate.check_holdout(str(model), subject)


def test_report_puts_each_model_beside_the_papers_values(tmp_path):
    s = {"dino": 0.5, "clip_i": 0.6, "clip_t": 0.25, "div": None, "pres": 0.4}
    result = scoring.EvalResult.from_json({
        "subject": "unqtkn dog", "num_prompts": 1, "num_samples_per_prompt": 1, "num_photos": 5,
        "prompts": ["a unqtkn dog"], "models": {label: {"overall": s, "per_prompt": {"a unqtkn dog": s}}
                                                for label in ("tuned", "base")}})
    assert scoring.EvalResult.from_json(result.to_json()) == result  # scores.json reads back as it was written
    eval_report.write_report(str(tmp_path / "report.md"), result)
    report = (tmp_path / "report.md").read_text()
    assert "| tuned | 0.500 | 0.600 | 0.250 |  | 0.400 |" in report and "| base |" in report
    assert "DIV is blank: one image per prompt" in report  # (a blank said, under the table)
    for model in result.models.values():
        model.overall["div"] = 0.2
    eval_report.write_report(str(tmp_path / "report.md"), result)
    assert "DIV is blank" not in (tmp_path / "report.md").read_text()
    assert "Random weights" not in report  # (said only of models with random weights: --tiny, below)
    assert "| paper, SD DreamBooth | 0.668 | 0.803 | 0.305" in report
    assert "| a unqtkn dog | 0.500 | 0.250 | 0.500 | 0.250 |" in report
    # each score said under the table, before the prompts' rows (a scored step's report.md too: the same writer)
    legend = report.split("| paper, SD DreamBooth |")[1].split("## Per prompt")[0]
    assert all(f"- {name}: " in legend or f" {name}: " in legend for name in ("DINO", "CLIP-I", "CLIP-T", "DIV", "PRES"))
    assert 'the README\'s "Reading the scores"' in legend


def test_scores_of_a_model_the_run_replaced_are_removed_and_the_current_models_kept(tmp_path, capsys):
    """Step 4 trained a new model for the subject (LoRA after a full fine-tune): the subject's eval folder, whose
    images and scores another model drew, goes at once (Step 6 may never run: a stop, --skip_eval); scores of
    the model there (a full model's, or its adapters' on the base) stay."""
    model, eval_dir = tmp_path / "model-tuned", tmp_path / "eval"
    (eval_dir / "images" / "tuned").mkdir(parents=True)
    (eval_dir / "images" / "base").mkdir()
    (eval_dir / "images" / "base" / "a.png").write_bytes(b"png")
    (eval_dir / "grids" / "tuned").mkdir(parents=True)
    (eval_dir / "report.md").write_text("scores")
    model.mkdir()
    for drew in ("trained:aaa", "dreambooth-ray/tiny@1+lora:trained:aaa@1"):  # full model, LoRA on its base
        files.write_json(str(eval_dir / "images" / "tuned" / image_records.IMAGES_RECORD), {"model": drew})
        files.write_json(str(model / files.OUTPUT_MARKER), {"model_id": "aaa"})
        assert not eval_report.forget_stale_scores(str(eval_dir), str(model)) and (eval_dir / "report.md").is_file()
    files.write_json(str(model / files.OUTPUT_MARKER), {"model_id": "bbb"})  # retrained
    (eval_dir / "report.md").write_text("scores")
    assert eval_report.forget_stale_scores(str(eval_dir), str(model), "0")  # (--skip_eval: said so, not Step 6)
    assert capsys.readouterr().err.endswith("(the base model's images there stay: evaluate.py draws them again if "
                                            "this run's base model is another); --skip_eval: no Step 6; evaluate.py "
                                            "scores the new one when you want its scores\n")
    (eval_dir / "images" / "tuned").mkdir()
    files.write_json(str(eval_dir / "images" / "tuned" / image_records.IMAGES_RECORD), {"model": "trained:aaa"})
    (eval_dir / "report.md").write_text("scores")
    assert eval_report.forget_stale_scores(str(eval_dir), str(model))
    # the base model's images stay (Step 6 scores them again without drawing them)
    assert [str(p.relative_to(eval_dir)) for p in sorted(eval_dir.rglob("*"))] == ["images", "images/base",
                                                                                   "images/base/a.png"]
    assert f"removed the scores in {eval_dir} and its images of the model this run replaced (the base model's images " \
           "there stay: Step 6 draws them again if this run's base model is another); Step 6 scores the new one" \
        in capsys.readouterr().err
    assert not eval_report.forget_stale_scores(str(eval_dir), str(model))  # nothing of another model: nothing to do
    # Step 5 skipped (NUM_NEW_IMAGES=0): its folder's images of the model replaced go too, this model's stay
    new = tmp_path / "images-new"
    (new / "grid").mkdir(parents=True)
    (new / "photo-00000.png").write_bytes(b"png")
    files.write_json(str(new / image_records.IMAGES_RECORD), {"model": "dreambooth-ray/tiny@1+lora:trained:bbb@1"})
    assert not eval_report.forget_stale_images(str(new), str(model)) and (new / "photo-00000.png").is_file()
    files.write_json(str(new / image_records.IMAGES_RECORD), {"model": "trained:aaa"})
    assert eval_report.forget_stale_images(str(new), str(model)) and os.listdir(new) == []
    assert f"removed the images in {new}: they were of the model this run replaced" in capsys.readouterr().err


def test_a_scoring_stopped_in_the_middle_leaves_no_earlier_report(tiny_model, toy_images, tmp_path, monkeypatch):
    """Step 6 again after new photos or a retrained model, stopped by Ctrl-C as its Ray starts: the report and
    scores.json of the run before are gone (a rerun writes them anew), never left to pass for this model's; the
    images stay, for the rerun to keep."""
    from dreambooth.cluster import raycluster

    out = tmp_path / "eval"
    (out / "images" / "base").mkdir(parents=True)
    (out / "images" / "base" / "a.png").write_bytes(b"png")
    for name in ("report.md", "scores.json"):
        (out / name).write_text("the scores of the run before")

    def interrupted():
        raise KeyboardInterrupt  # (what a terminal's Ctrl-C raises in the script)

    monkeypatch.setattr(raycluster, "init_ray", interrupted)
    subject = scoring.Subject("toy", toy_images, "unqtkn", "toy")
    settings = scoring.EvalSettings(eval_models_dir=str(tmp_path / "unused"), num_samples_per_prompt=1)
    with pytest.raises(KeyboardInterrupt):
        scoring.run([("base", outputs.ModelRef(tiny_model))], [subject], settings, str(out))
    assert sorted(p.name for p in out.rglob("*")) == ["a.png", "base", "images"]

"""Scores while training on Ray (--score_steps): each checkpoint scored by a validation task of its own while the
workers go on, as evaluate.py scores it. (The scores' bookkeeping: tests/unit/test_checkpoint_scores.py.)"""

import glob
import json
import os
import re

import pytest

from dreambooth import files


def test_a_run_scores_its_checkpoints_while_it_trains_as_evaluate_scores_them(ray_session, tiny_model, toy_images,
                                                                              tiny_eval_models, tmp_path, capsys):
    """--score_steps 2 of 12 steps, the checkpoints uploaded in the background (--checkpoint_upload async, to a
    folder): step 2 and the last scored from their checkpoints by Ray Train's validation
    tasks, each step's scores those evaluate.py gives that step's model (its images and scores.json in the run
    folder's scores/step-N). The training did not wait: the steps after 2 were logged while step 2 was scored, and
    rank 0 logged its scores (metrics.jsonl, a line) as they came, mid-run; step 4, due while step 2 was still being
    scored, was not (one scoring at a time, a line says so); step 12's scores, which came after the last step, the
    driver added at the end. The base model was scored beside them (evaluate.py's base scores); with
    --keep_best the saved model is the best-scored step's by the sweep's rule, as the last lines and its record
    say, and no other step's model is left."""
    from dreambooth.commands import evaluate
    from dreambooth.commands import train
    from dreambooth.training import checkpoint_scores
    from dreambooth.training import score_record

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a {subject} on a beach\n")
    out = tmp_path / "out"
    result = train.main(["--model_dir", tiny_model, "--instance_images_dir", toy_images, "--instance_prompt",
                         "photo of unqtkn toy", "--output_dir", str(out), "--storage_path", str(tmp_path / "runs"),
                         "--num_workers", "1", "--use_lora", "--max_train_steps", "12", "--logging_steps", "1",
                         # (steps of seconds, at 128 px and 5 batches each, while the base model is scored beside
                         # them: a score arrives mid-run)
                         "--resolution", "128", "--gradient_accumulation_steps", "5",
                         "--score_steps", "2", "--eval_models_dir", tiny_eval_models[1], "--class_name", "toy",
                         "--eval_prompts", str(prompts), "--eval_images_per_prompt", "1",
                         "--validation_inference_steps", "2", "--keep_best",
                         "--checkpoint_upload", "async"])  # (each checkpoint committed after its report returns)
    captured = capsys.readouterr()
    run_dir = result.path
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    scored = {row["step"]: row for row in rows if "dino" in row}
    # (a scoring takes tens of seconds here, a step seconds: the due steps after 4 are scored once step 2's has ended)
    assert {2, 12} <= set(scored) and 4 not in scored, rows
    assert "step 4 is not scored: step 2's scoring has not finished" in captured.out
    assert all(0 < scored[s][k] <= 1 for s in scored for k in ("dino", "clip_i")), scored
    said = {step: checkpoint_scores.describe(step, {k: scored[step][k] for k in score_record.SCORE_KEYS})
            for step in scored}
    loss_logged = {row["step"]: row["time"] for row in rows if "loss" in row}
    # each checkpoint (every scored step's: 2, 4, ...) said how long the steps stopped for it, in the next window's row
    assert {row["step"] for row in rows if "checkpoint_s" in row} == set(range(3, 12, 2)), rows
    # the steps went on while step 2 was scored, and its scores were logged by rank 0 before the last step
    assert loss_logged[3] < os.path.getmtime(os.path.join(run_dir, "scores", "step-2", "scores.json"))
    assert scored[2]["time"] < loss_logged[12] and said[2] in captured.out
    assert said[12] in captured.err and "scored steps: 2, " in captured.err  # (the driver's, at the end)
    assert os.path.isfile(os.path.join(run_dir, "scores.png"))
    # the best step by the sweep's rule: the highest DINO among the steps whose CLIP-T is at most 0.02 (the default
    # margin) below the base model's, the earliest of equals; its model saved, and no step's model left behind
    base = json.load(open(os.path.join(run_dir, "scores", "base.json")))
    kept = [s for s in sorted(scored) if scored[s]["clip_t"] >= base["clip_t"] - 0.02]
    best = max(kept or sorted(scored), key=lambda s: scored[s]["dino"])
    # (its DINO at 3 decimals, or at more beside a runner-up's that reads the same at 3)
    line = re.search(rf"best scored step: {best} \(DINO (-?[\d.]+)(, step \d+'s -?[\d.]+)?, CLIP-T "
                     rf"{scored[best]['clip_t']:.3f}; ", captured.err)
    assert line and float(line[1]) == pytest.approx(scored[best]["dino"], abs=5e-4), captured.err[-2000:]
    assert (f"saved: step {best}'s model, the best scored, in {out} instead of step 12's (--keep_best)" if best != 12
            else f"saved: the last step's model, the best scored, in {out} (--keep_best)") in captured.err
    record = json.load(open(out / files.OUTPUT_MARKER))
    assert record["steps"] == best and record["kept"]["step"] == best and record["kept"]["of_steps"] == 12
    assert record["kept"]["why"].startswith(f"best scored step: {best} ") and record["kept"]["scores"]["dino"] == \
        pytest.approx(scored[best]["dino"])
    assert not glob.glob(os.path.join(run_dir, "scores", "step-*", "model"))
    # what scoring said as it went is in the step's log, not among the training's lines
    # (the base model scored as a step is, by a task of its own from the run's start: 2 images and the 5 photos each;
    # on this one-node cluster, drawn and embedded in the task's own process, no actor pool started)
    for scored_model in ("step-2", "base"):
        log = open(os.path.join(run_dir, "scores", scored_model, "scoring.log")).read()
        assert "scoring 7 images in this process" in log and "generating in this process" in log, log
    assert "images already there" not in captured.out + captured.err
    # the best step's scores are evaluate.py's of the saved model, and the base model's those evaluate.py gives it: it
    # takes the images their scoring drew (the same model by its id, the same seed and settings; the saved adapters
    # of the last step are those it scored, byte for byte) instead of drawing them again
    evaluate.main(["--model_dir", str(out), "--instance_images_dir", toy_images, "--class_name", "toy",
                   "--eval_prompts", str(prompts), "--eval_models_dir", tiny_eval_models[1], "--output_dir",
                   str(tmp_path / "eval"), "--num_samples_per_prompt", "1", "--num_inference_steps", "2",
                   "--resolution", "128"])
    err = capsys.readouterr().err
    for label, scored_model in (("tuned", f"step-{best}"), ("base", "base")):
        assert f"{label}: 2 images taken from {run_dir}/scores/{scored_model}/images/{scored_model}, where the same " \
               f"model drew them with the same settings" in err and f"{label}: 2 of 2 images already there; " \
               "generating 0" in err, err
    theirs = json.load(open(tmp_path / "eval" / "scores.json"))["models"]
    tuned = next(m for label, m in theirs.items() if label != "base")["overall"]
    assert {k: round(tuned[k], 4) for k in score_record.SCORE_KEYS} == \
        {k: round(scored[best][k], 4) for k in score_record.SCORE_KEYS}
    assert {k: round(theirs["base"]["overall"][k], 4) for k in score_record.SCORE_KEYS} == \
        {k: round(base[k], 4) for k in score_record.SCORE_KEYS}



"""Scores while training (train.py --score_steps): the flags' rules, and a tiny run whose checkpoints Ray Train's
validation scores as evaluate.py does while the steps go on. Ray Train's validation API is alpha (Ray 2.60): these
tests pin what checkpoint_scores relies on (ValidationConfig's task per reported checkpoint, its metrics merged into
the checkpoint's, get_all_reported_checkpoints' statuses, fit waiting for the tasks before it returns)."""

import dataclasses
import glob
import json
import os
import shutil

import pytest

from dreambooth import files
from dreambooth.planning import planning

BASE = ["--model_dir", "/m", "--output_dir", "/o", "--instance_images_dir", "/p", "--instance_prompt", "photo of unqtkn toy"]


def refusal(argv, capsys):
    with pytest.raises(SystemExit):
        planning.parse_args(BASE + argv)
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_scoring_needs_its_models_and_class_and_a_prompt_that_names_the_subject(capsys):
    assert "add --eval_models_dir and --class_name" in refusal(["--score_steps", "2"], capsys)
    assert refusal(["--score_steps", "2", "--eval_models_dir", "/e"], capsys).endswith("add --class_name")
    # the evaluation prompts say '<token> <class>': the instance prompt must say the same, or the scores are of
    # another subject than the one trained
    line = refusal(["--score_steps", "2", "--eval_models_dir", "/e", "--class_name", "dog"], capsys)
    assert "'photo of unqtkn toy' does not name the subject as the evaluation prompts will, 'unqtkn dog'" in line
    assert "add --score_steps N" in refusal(["--eval_models_dir", "/e"], capsys)  # (a scoring flag alone: refused)
    assert refusal(["--keep_best"], capsys).endswith("--keep_best: these say how checkpoints are scored while "
                                                     "training: add --score_steps N")
    scored = ["--score_steps", "2", "--eval_models_dir", "/e", "--class_name", "toy", "--keep_best"]
    assert planning.parse_args(BASE + scored + ["--output_dir", "s3://b/o"]).keep_best  # (a bucket's model too)
    args = planning.parse_args(BASE + ["--score_steps", "3", "--eval_models_dir", "/e", "--class_name", "toy"])
    assert (args.score_steps, args.eval_models_dir, args.unique_token, args.eval_images_per_prompt) == (3, "/e",
                                                                                                       "unqtkn", 4)


def test_scored_steps_are_checkpointed_and_the_last_is_scored():
    plan = planning.offline_plan(score_steps=3, checkpointing_steps=4, total_steps=7, class_name="toy")
    assert [s for s in range(1, 8) if plan.is_score_step(s)] == [3, 6, 7]
    assert [s for s in range(1, 8) if plan.is_checkpoint_step(s)] == [3, 4, 6, 7]
    assert "scored every 3 steps (DINO, CLIP-I, CLIP-T) while it trains" in plan.describe()
    assert not any(planning.offline_plan().is_score_step(s) for s in range(1, 8))


def test_the_end_of_a_run_adds_the_scores_that_came_late_and_says_a_failed_step(tmp_path):
    """checkpoint_scores.finish, once the scoring tasks are over: a step scored after rank 0's last report (its
    scores.json there, no row yet) gets its metrics.jsonl row and line; the last step without scores (its task
    failed or timed out) is said in one line; a run stopped early says nothing of the steps it did not reach."""
    from dreambooth import files
    from dreambooth.evaluation import scoring
    from dreambooth.training import checkpoint_scores

    plan = planning.offline_plan(score_steps=2, total_steps=6, storage_path=str(tmp_path), run_name="run",
                                 class_name="toy")
    # stopped before any step was due: said so, not "each scored step's scoring.log says why" (there is none)
    assert checkpoint_scores.finish(plan, last_step=1) == [
        "no step was scored: the run stopped at step 1, before step 2, the first due to be scored (--score_steps 2)"]
    values = {"dino": 0.5, "clip_i": 0.75, "clip_t": 0.25}
    for step in (2, 4):  # 2: logged by rank 0 during the run; 4: came after its last report; 6: failed
        result = scoring.EvalResult("unqtkn toy", 1, 1, 5, ("a unqtkn toy",),
                                    {f"step-{step}": scoring.ModelScores(values, {})})
        os.makedirs(tmp_path / "run" / "scores" / f"step-{step}")
        files.write_json(str(tmp_path / "run" / "scores" / f"step-{step}" / "scores.json"), result.to_json())
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 2, **values, "time": 1.0}) + "\n")
    assert checkpoint_scores.finish(plan, last_step=5)[0] == "scores of step 4: DINO 0.500, CLIP-I 0.750, CLIP-T 0.250"
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 2, **values, "time": 1.0}) + "\n")
    lines = checkpoint_scores.finish(plan)
    assert lines == ["scores of step 4: DINO 0.500, CLIP-I 0.750, CLIP-T 0.250",
                     "scores of step 6: its scoring task failed (its error: the run folder's scores/step-6/scoring.log, "
                     "and Ray's log)",
                     f"scored steps: 2, 4, plotted in {tmp_path / 'run' / 'scores.png'} (images and report.md of "
                     f"each in {tmp_path / 'run' / 'scores'})"]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(r["step"], r["dino"]) for r in rows] == [(2, 0.5), (4, 0.5)]
    from PIL import Image

    from dreambooth.training import runlog

    plot = Image.open(tmp_path / "run" / "scores.png").convert("RGB")
    assert plot.size == (800, 450)
    colours = {colour for _, colour in plot.getcolors(800 * 450)}
    assert all(colour in colours for _, _, colour in runlog.SCORE_LINES)  # a line (and its label) of each score
    # with the base model's CLIP-T (a --keep_best run's): dashed lines at it and at the margin below, the rule's floor
    runlog.plot_scores(str(tmp_path / "run" / "metrics.jsonl"), 0.9, 0.1)
    plot = Image.open(tmp_path / "run" / "scores.png").convert("RGB")
    marks = runlog.ticks([0.5, 0.75, 0.25, 0.9, 0.8], from_zero=False)
    left, top, right, bottom = runlog.AREA
    for level in (0.9, 0.8):
        y = int(runlog.scale(level, marks, bottom, top))
        dashed = max(sum(plot.getpixel((x, row)) == runlog.SCORE_LINES[2][2] for x in range(left, right))
                     for row in (y - 1, y, y + 1))
        assert 0.4 < dashed / (right - left) < 0.7, level
    # the best-scored step (the kept one, with --keep_best): a dashed upright line at it (here the last, on the frame)
    runlog.plot_scores(str(tmp_path / "run" / "metrics.jsonl"), 0.9, 0.1, (4, "kept"))
    plot = Image.open(tmp_path / "run" / "scores.png").convert("RGB")
    steps = runlog.ticks([2, 4], from_zero=False)
    x = int(runlog.scale(4, steps, left, right))
    upright = max(sum(plot.getpixel((col, y)) == runlog.PURPLE for y in range(top + 20, bottom)) for col in (x - 1, x, x + 1))
    assert 0.3 < upright / (bottom - top - 20) < 0.7
    # their labels, the base's above its line and the floor's below its own (close lines' labels once overlapped)
    for level, rows in ((0.9, range(-12, -4)), (0.8, range(5, 13))):
        y = int(runlog.scale(level, marks, bottom, top))
        orange = runlog.SCORE_LINES[2][2]  # (the text's pixels are smoothed: near the colour)
        assert any(sum(abs(a - b) for a, b in zip(plot.getpixel((x, y + d)), orange)) < 120
                   for x in range(right - 120, right - 4) for d in rows), level


def test_the_late_scores_of_a_run_in_a_bucket_join_rank_0s_metrics_written_on_another_node(request):
    """A bucket's run whose rank 0 trained on another node: its metrics.jsonl (the loss rows, step 2's scores) is in
    the bucket only; the driver's node has the scoring tasks' scores (steps 2 and 4). finish adds step 4's row to rank
    0's file, and the driver's sync_up keeps the loss rows (it once wrote a file of the late scores alone over them)."""
    from dreambooth import storage
    from dreambooth.storage import runfiles
    from dreambooth.training import checkpoint_scores

    request.getfixturevalue("s3_endpoint")
    plan = planning.offline_plan(score_steps=2, total_steps=4, storage_path="s3://runs/late-scores", run_name="run",
                                 class_name="toy")
    values = {"dino": 0.5, "clip_i": 0.75, "clip_t": 0.25}
    rank0 = [{"step": 1, "loss": 0.3, "time": 1.0}, {"step": 2, **values, "time": 2.0}, {"step": 4, "loss": 0.2, "time": 3.0}]
    storage.write_bytes("s3://runs/late-scores/run/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rank0).encode())
    shutil.rmtree(plan.run_dir, ignore_errors=True)
    for step in (2, 4):
        write_step_scores(os.path.join(plan.run_dir, "scores", f"step-{step}"), step, values)
    assert checkpoint_scores.finish(plan)[0] == "scores of step 4: DINO 0.500, CLIP-I 0.750, CLIP-T 0.250"
    runfiles.sync_up(plan.storage_path, plan.run_name)
    rows = [json.loads(line) for line in storage.read_bytes("s3://runs/late-scores/run/metrics.jsonl").splitlines()]
    assert [(r["step"], "loss" in r, "dino" in r) for r in rows] == [(1, True, False), (2, False, True),
                                                                     (4, True, False), (4, False, True)]
    shutil.rmtree(plan.run_dir)


def storage_of(where, request, tmp_path):
    """A run's storage path: tmp_path, or a folder of its own in the test's S3 bucket ("runs", a moto server)."""
    if where == "disk":
        return str(tmp_path)
    request.getfixturevalue("s3_endpoint")
    return f"s3://runs/{request.node.name.replace('[', '-').rstrip(']')}"


def write_step_scores(folder, step, values):
    from dreambooth.evaluation import scoring

    result = scoring.EvalResult("unqtkn toy", 1, 1, 5, ("a unqtkn toy",), {f"step-{step}": scoring.ModelScores(values, {})})
    os.makedirs(folder, exist_ok=True)
    files.write_json(os.path.join(folder, "scores.json"), result.to_json())


def test_the_saved_model_is_the_scored_one_when_its_files_hold_the_same_tensors(tmp_path):
    """score_record.same_weights, which lets the last step's saved model keep the id of the model its scoring drew
    with: the same files besides the records, each the same bytes or (safetensors, whose header's order varies with the
    process that wrote it) the same metadata and tensors."""
    import torch
    from safetensors.torch import save_file

    from dreambooth.training import score_record

    def model(name, weight, metadata=None, record="{}"):
        folder = tmp_path / name
        (folder / "unet").mkdir(parents=True)
        save_file({"a": torch.ones(2), "b": torch.tensor([1.0, weight])}, folder / "unet" / "w.safetensors",
                  metadata={"format": "pt", **(metadata or {})})
        (folder / files.OUTPUT_MARKER).write_text(record)
        return str(folder)

    scored = model("scored", 2.0)
    assert score_record.same_weights(scored, model("saved", 2.0, record='{"kept": 1}'))
    assert not score_record.same_weights(scored, model("changed", 2.5))
    assert not score_record.same_weights(scored, model("other-metadata", 2.0, {"rank": "4"}))
    extra = model("extra", 2.0)
    (tmp_path / "extra" / "notes.txt").write_text("a file the scored model lacks")
    assert not score_record.same_weights(scored, extra)
    broken = model("broken", 2.0)
    (tmp_path / "broken" / "unet" / "w.safetensors").write_bytes(b"not a safetensors file")
    assert not score_record.same_weights(scored, broken)


@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_keep_best_saves_the_best_step_by_the_sweeps_rule_and_its_record_says_why(where, request, tmp_path):
    """checkpoint_scores.finish of a --keep_best run: the best step is the highest DINO among the steps whose CLIP-T is
    within --clip_t_margin of the base model's (step 4's higher DINO does not count: its CLIP-T fell below), its kept
    model replaces the last step's in --output_dir (on a disk or in a bucket), whose record says which step, its scores
    and why; when the best is the last step, its weights stay and the record says so."""
    from dreambooth import storage
    from dreambooth.models import outputs
    from dreambooth.training import checkpoint_scores
    from dreambooth.training import score_record

    out = storage.join(storage_of(where, request, tmp_path), "out")
    plan = planning.offline_plan(score_steps=2, total_steps=6, storage_path=storage_of(where, request, tmp_path),
                                 run_name="run", class_name="toy", keep_best=True, clip_t_margin=0.02, output_dir=out)
    scores = {2: {"dino": 0.5, "clip_i": 0.7, "clip_t": 0.25}, 4: {"dino": 0.6, "clip_i": 0.8, "clip_t": 0.2},
              6: {"dino": 0.4, "clip_i": 0.6, "clip_t": 0.3}}

    def prepare():
        for step, values in scores.items():
            folder = os.path.join(plan.run_dir, "scores", f"step-{step}")
            write_step_scores(folder, step, values)
            storage.write_bytes(os.path.join(folder, "model", files.LORA_WEIGHTS_FILE), f"step {step}'s weights".encode())
            files.write_json(os.path.join(folder, "model", files.OUTPUT_MARKER),  # (its scoring's model, as saved)
                             outputs.TrainRecord("/base", steps=step, model_id=f"scored-{step}").to_json())
        files.write_json(os.path.join(plan.run_dir, "scores", "base.json"), {"dino": 0.1, "clip_i": 0.2, "clip_t": 0.26})
        storage.write_bytes(storage.join(out, files.LORA_WEIGHTS_FILE), b"step 6's weights")
        storage.write_bytes(storage.join(out, "train_config.toml"), b"max_train_steps = 6\n")
        storage.write_bytes(storage.join(out, files.OUTPUT_MARKER), json.dumps(
            outputs.TrainRecord("/base", steps=6, run_name="run").to_json()).encode())

    prepare()
    lines = checkpoint_scores.finish(plan)
    assert lines[-2:] == [
        "best scored step: 2 (DINO 0.500, CLIP-T 0.250; the highest DINO among the scored steps whose CLIP-T is at "
        "most 0.02 below the base model's 0.260)",
        f"saved: step 2's model, the best scored, in {out} instead of step 6's (--keep_best)"]
    assert storage.read_bytes(storage.join(out, files.LORA_WEIGHTS_FILE)) == b"step 2's weights"
    assert storage.read_bytes(storage.join(out, "train_config.toml")) == b"max_train_steps = 6\n"
    record = outputs.read_output(out).record
    scores_dir = storage.join(plan.storage_path, "run", "scores")  # (a bucket's run: there)
    assert record.steps == 2 and record.run_name == "run" and record.kept == {
        "step": 2, "of_steps": 6, "scores": scores[2], "why": lines[-2], "scores_dir": scores_dir}
    # the weights its scoring drew with, under their id: evaluate.py takes the images it drew
    assert record.model_id == "scored-2"
    assert not glob.glob(os.path.join(plan.run_dir, "scores", "step-*", "model"))
    # the best is the last step: its model stays, its record says why
    scores[6] = {"dino": 0.7, "clip_i": 0.6, "clip_t": 0.3}
    prepare()
    lines = checkpoint_scores.finish(plan)
    assert lines[-1] == f"saved: the last step's model, the best scored, in {out} (--keep_best)"
    record = outputs.read_output(out).record
    assert record.steps == 6 and record.kept == {"step": 6, "of_steps": 6, "scores": scores[6], "why": lines[-2],
                                                 "scores_dir": scores_dir}
    assert storage.read_bytes(storage.join(out, files.LORA_WEIGHTS_FILE)) == b"step 6's weights"
    assert not glob.glob(os.path.join(plan.run_dir, "scores", "step-*", "model"))
    # the scored model's id where the saved files are its, byte for byte (compared on a disk only)
    assert (record.model_id == "scored-6") == (where == "disk")
    prepare()
    storage.write_bytes(storage.join(out, files.LORA_WEIGHTS_FILE), b"step 6's weights, saved otherwise")
    checkpoint_scores.finish(plan)
    assert outputs.read_output(out).record.model_id not in ("scored-6", None)
    # a runner-up that reads the same at 3 decimals: both at as many as tell them apart
    write_step_scores(os.path.join(plan.run_dir, "scores", "step-2"), 2, {"dino": 0.69996, "clip_i": 0.7, "clip_t": 0.25})
    assert score_record.best_line(plan, *score_record.best_step(plan.run_dir, 0.02)).startswith(
        "best scored step: 6 (DINO 0.70000, step 2's 0.69996, CLIP-T 0.300; ")
    # no step within the margin: the highest DINO of all, said so
    files.write_json(os.path.join(plan.run_dir, "scores", "base.json"), {"dino": 0.1, "clip_i": 0.2, "clip_t": 0.9})
    assert score_record.best_line(plan, *score_record.best_step(plan.run_dir, 0.02)) == (
        "best scored step: 6 (DINO 0.70000, step 2's 0.69996, CLIP-T 0.300; no step kept CLIP-T within 0.02 of the base "
        "model's 0.900: "
        "the highest DINO of all)")


@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_a_resumed_run_chooses_its_best_step_among_the_steps_scored_before_it_too(where, request, tmp_path):
    """score_record.carry_over: the run a resume goes on from (on a disk or in a bucket) scored step 2 (its model
    kept: the best so far) and step 6, after the checkpoint of step 4 it is resumed from; the resumed run gets step
    2's scores and kept model (moved from a disk, copied from a bucket) and the base model's scores, not step 6's (it
    trains step 6 again)."""
    from dreambooth import storage
    from dreambooth.planning import checkpoints
    from dreambooth.training import score_record

    storage_path = storage_of(where, request, tmp_path)
    earlier = storage.join(storage_path, "out-1")
    local = tmp_path / "earlier"  # (written here, then moved to the disk's run folder or copied into the bucket)
    for step in (2, 6):
        write_step_scores(str(local / "scores" / f"step-{step}"), step, {"dino": 0.1 * step, "clip_i": 0.5, "clip_t": 0.3})
    (local / "scores" / "step-2" / "model").mkdir()
    (local / "scores" / "step-2" / "model" / files.LORA_WEIGHTS_FILE).write_text("step 2's weights")
    for label in ("step-2", "step-6", "base"):  # (the images each scoring drew)
        (local / "scores" / label / "images" / label).mkdir(parents=True)
        (local / "scores" / label / "images" / label / "a-toy-00000.png").write_text(f"{label}'s image")
    files.write_json(str(local / "scores" / "base.json"), {"dino": 0.1, "clip_i": 0.2, "clip_t": 0.3})
    (local / "checkpoint_000001").mkdir()
    files.write_json(str(local / "checkpoint_000001" / checkpoints.STATE_FILE), {"step": 4})
    if where == "disk":
        local.rename(earlier)
    else:
        storage.replace_folder(str(local), earlier, last=None)
    plan = planning.offline_plan(score_steps=2, total_steps=8, storage_path=storage_path, run_name="out-2",
                                 class_name="toy", keep_best=True, resume_path=storage.join(earlier, "checkpoint_000001"))
    os.makedirs(plan.run_dir, exist_ok=True)
    score_record.carry_over(plan)
    assert set(score_record.scores_on_disk(plan.run_dir)) == {2}
    assert score_record.base_scores(plan.run_dir)["clip_t"] == 0.3
    with open(os.path.join(plan.run_dir, "scores", "step-2", "model", files.LORA_WEIGHTS_FILE)) as f:
        assert f.read() == "step 2's weights"
    assert storage.exists(storage.join(earlier, "scores", "step-2", "model")) == (where == "bucket")
    assert score_record.best_step(plan.run_dir, 0.02)[0] == 2
    assert set(score_record.scores_on_disk(earlier)) == {2, 6}  # (the earlier run's, read where it is)
    # the images of step 2's and the base model's scoring, which evaluate.py takes, not step 6's
    for label in ("step-2", "base"):
        with open(os.path.join(plan.run_dir, "scores", label, "images", label, "a-toy-00000.png")) as f:
            assert f.read() == f"{label}'s image"
    assert not os.path.exists(os.path.join(plan.run_dir, "scores", "step-6"))


def test_ctrl_c_after_the_training_cuts_its_scoring_short_names_the_unscored_steps_and_keeps_the_best_scored(
        tmp_path, capsys):
    """Once the workers have saved the model, the run only waits for its steps' scoring (one at a time, each slower than
    many steps): the first Ctrl-C ends that wait at once, saying so (not "every worker checkpoints the step it is on":
    there are none); the end of the run names the steps whose scoring was cut short and chooses among those scored."""
    import signal

    from dreambooth import files
    from dreambooth.evaluation import scoring
    from dreambooth.training import checkpoint_scores
    from dreambooth.training import stopping

    aborted = []
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        stopping.install_handlers("run-x", lambda *args: aborted.append(args[0]), trained=lambda: True)
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    assert aborted == [signal.SIGINT]
    assert capsys.readouterr().err == ("SIGINT: the training has ended and its model is saved: its steps' scoring is "
                                       "cut short now (the steps left unscored are named)\n")
    plan = planning.offline_plan(score_steps=2, total_steps=8, storage_path=str(tmp_path), run_name="run",
                                 class_name="toy")
    # (what rank 0 said when the training ended: 4 images of each of the 25 prompts and the class prompt; a prompt
    # file its node cannot read leaves the count out, never failing the worker before it saves the model)
    assert checkpoint_scores.waiting_line([2, 8], plan) == (
        "trained to step 8; the run ends once the scoring of step(s) 2, 8 has ended (one at a time, 104 images each: "
        "--eval_images_per_prompt, --eval_prompts)")
    unread = dataclasses.replace(plan, eval_prompts=str(tmp_path / "absent.txt"))
    assert "(one at a time: --eval_images_per_prompt" in checkpoint_scores.waiting_line([8], unread)
    values = {"dino": 0.5, "clip_i": 0.75, "clip_t": 0.25}
    result = scoring.EvalResult("unqtkn toy", 1, 1, 5, ("a unqtkn toy",), {"step-2": scoring.ModelScores(values, {})})
    os.makedirs(tmp_path / "run" / "scores" / "step-2")
    files.write_json(str(tmp_path / "run" / "scores" / "step-2" / "scores.json"), result.to_json())
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 2, **values, "time": 1.0}) + "\n")
    os.makedirs(tmp_path / "run" / "scores" / "step-6")  # (begun, cut short; step 4 was skipped during the run)
    lines = checkpoint_scores.finish(plan, cut=[8])
    assert lines[:2] == ["step 6 not scored: its scoring was cut short (evaluate.py scores a saved model)",
                         "step 8 not scored: its scoring was cut short (evaluate.py scores a saved model)"]
    assert lines[2].startswith("scored steps: 2, plotted in ")
    # a step rank 0 sent for scoring whose task had not begun (no folder yet): named too, from what rank 0 was waiting on
    os.rmdir(tmp_path / "run" / "scores" / "step-6")
    assert checkpoint_scores.finish(plan, cut=[8])[0].startswith("step 8 not scored")
    lines = checkpoint_scores.finish(plan, cut=[6, 8])
    assert lines[:2] == ["step 6 not scored: its scoring was cut short (evaluate.py scores a saved model)",
                         "step 8 not scored: its scoring was cut short (evaluate.py scores a saved model)"]
    shutil.rmtree(tmp_path / "run")  # (cut short before any step's scores: the last step's model stands, said so)
    plan = planning.offline_plan(score_steps=2, total_steps=8, storage_path=str(tmp_path), run_name="run",
                                 class_name="toy", keep_best=True, output_dir=str(tmp_path / "out"))
    assert checkpoint_scores.finish(plan, cut=[]) == [
        "step 8 not scored: its scoring was cut short (evaluate.py scores a saved model)",
        "no step was scored: their scoring was cut short",
        f"saved: the last step's model in {tmp_path / 'out'} (--keep_best had no scores to choose by)"]


def test_one_scoring_at_a_time_a_due_step_passed_over_is_said_and_the_last_is_queued(capsys):
    """Rank 0's choice at each due step (worker.scores_arrived): while a step is still being scored, the next due step
    is passed over with a line naming the one still going, but an always-scored step (the last) is queued behind it;
    scores that arrived are logged and said first. (Which steps a real run passes over depends on the machine's speed:
    the end-to-end run accepts either.)"""
    from dreambooth.training import checkpoint_scores
    from dreambooth.training import worker

    class Arrivals(checkpoint_scores.ScoreWatch):  # (Ray's part, what new_rows reads from its store, given here)
        def __init__(self):
            super().__init__("run")
            self.arrived = []

        def new_rows(self):
            rows, self.arrived = self.arrived, []
            return rows

    class Log:
        def __init__(self):
            self.rows = []

        def write_scores(self, step, scores):
            self.rows.append((step, scores))

    watch, log = Arrivals(), Log()
    assert worker.scores_arrived(watch, log, 2, due=True, always=False) and watch.sent == {2}
    watch.pending = 2
    assert not worker.scores_arrived(watch, log, 3, due=False, always=False)  # (not due: nothing said)
    assert not worker.scores_arrived(watch, log, 4, due=True, always=False) and watch.sent == {2}
    said = capsys.readouterr().out.splitlines()
    assert said == [checkpoint_scores.skip_line(4, 2)] and said[0].startswith(
        "step 4 is not scored: step 2's scoring has not finished")
    scores = dict.fromkeys(("dino", "clip_i", "clip_t"), 0.5)
    watch.arrived = [(2, scores)]
    assert worker.scores_arrived(watch, log, 6, due=True, always=True) and watch.sent == {2, 6}  # (queued)
    assert log.rows == [(2, scores)]
    assert capsys.readouterr().out.splitlines() == [checkpoint_scores.describe(2, scores, during_run=True)]

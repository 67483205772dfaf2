"""Scores while training (train.py --score_steps): each checkpoint of a scored step is handed to Ray Train's
validation (ray.train.ValidationConfig), which runs score_checkpoint as a task of its own while the workers go on
training. There the checkpoint becomes a model in the run folder's scores/step-N/ and is scored as evaluate.py scores
a model (scoring.run: the same drawing, embedding and scores, evaluate.py's seed; the held-out photos apart); its
scores go back to Ray Train with the checkpoint, and rank 0 logs them as they arrive (ScoreWatch).

Ray Train's validation API is alpha in Ray 2.60: tests/test_checkpoint_scores.py pins what this module relies on.
"""

import functools
import os
import shutil

from dreambooth import files
from dreambooth.evaluation import scoring
from dreambooth.models import outputs
from dreambooth.planning import checkpoints
from dreambooth.storage import runfiles
from dreambooth.training import checkpoint

SCORES_FOLDER = "scores"  # in the run folder: step-N/ of each scored step (images, scores.json, report.md)
SCORE_KEYS = ("dino", "clip_i", "clip_t")  # what a scored step reports (the paper's subject and prompt fidelity)
SUBJECT = "subject"  # the one subject a run is scored against
# evaluate.py's seed of the images it scores (its --seed default): a step's images are those evaluate.py would draw
EVAL_SEED = scoring.EvalSettings.seed


def subject_of(plan):
    """The scoring.Subject of a run: its photos (the held-out ones apart), token, class and prompt set."""
    return scoring.Subject(SUBJECT, plan.instance_data_dir, plan.unique_token, plan.class_name, plan.subject_type,
                           plan.eval_prompts, holdout=len(plan.held_out))


def settings_of(plan):
    """How a scored step's images are drawn: evaluate.py's way at the run's resolution and guidance, with
    --eval_images_per_prompt images of each prompt and --validation_inference_steps steps."""
    return scoring.EvalSettings(plan.eval_models_dir, num_samples_per_prompt=plan.eval_images_per_prompt,
                                seed=EVAL_SEED, num_inference_steps=plan.validation_inference_steps,
                                guidance_scale=plan.guidance_scale, resolution=plan.resolution,
                                allow_unsafe_weights=plan.allow_unsafe_weights)


def validation_config(plan):
    """Ray Train's validation of the scored checkpoints: score_checkpoint as a task that reserves no CPU of its own
    (it only waits on the actor pools it starts, which reserve theirs)."""
    import ray.train

    return ray.train.ValidationConfig(functools.partial(score_checkpoint, plan=plan), ray_remote_kwargs={"num_cpus": 0})


def score_checkpoint(checkpoint_ref, plan):
    """A scored step's checkpoint as a model in scores/step-N/model, scored there; the model goes afterwards (the
    images, scores.json and report.md stay). Returns its scores ({SCORE_KEYS: value}) for Ray Train's record."""
    with checkpoint_ref.as_directory() as folder:
        step = files.read_json(os.path.join(folder, checkpoints.STATE_FILE))["step"]
        where = os.path.join(plan.run_dir, SCORES_FOLDER, f"step-{step}")
        model = os.path.join(where, "model")
        checkpoint.save_as_model(folder, checkpoint.step_model_plan(plan, model, step, plan.held_out))
    label = f"step-{step}"
    try:
        result = scoring.run([(label, outputs.resolve_model(model))], [subject_of(plan)], settings_of(plan), where)
    finally:
        shutil.rmtree(model, ignore_errors=True)
    runfiles.sync_up(plan.storage_path, plan.run_name)  # (a bucket's run: its scores there too)
    overall = result[SUBJECT].overall(label)
    return {key: float(overall[key]) for key in SCORE_KEYS}


class ScoreWatch:
    """Rank 0's view of the scores Ray Train has received so far: each new one once (new_rows)."""

    def __init__(self):
        self.said = set()  # the steps whose scores (or failure) were logged

    def new_rows(self):
        """[(step, {SCORE_KEYS: value}) or (step, None) for a scoring task that failed or timed out], in step order,
        for the scored checkpoints Ray Train has finished with since the last call."""
        import ray.train

        status = ray.train.ReportedCheckpointStatus
        done = (status.VALIDATED, status.VALIDATION_FAILED, status.VALIDATION_TIMEOUT)
        rows = []
        for reported in ray.train.get_all_reported_checkpoints(
                consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED):
            step = reported.metrics.get("step")
            if reported.status not in done or step in self.said:
                continue
            self.said.add(step)
            scores = {key: reported.metrics[key] for key in SCORE_KEYS} if reported.status is status.VALIDATED \
                else None
            rows.append((step, scores))
        return sorted(rows, key=lambda row: row[0])


def describe(step, scores, during_run=False):
    """The output's line of a scored step (during_run: said by rank 0 while the run goes on)."""
    if scores is None:
        return (f"scores of step {step}: its scoring task failed (its error is in Ray's log)"
                + ("; the training goes on" if during_run else ""))
    return f"scores of step {step}: " + ", ".join(f"{key.upper().replace('_', '-')} {scores[key]:.3f}"
                                                  for key in SCORE_KEYS)


def scores_on_disk(run_dir):
    """{step: {SCORE_KEYS: value}} of the scored steps whose scores.json is in run_dir's scores folder."""
    found = {}
    folder = os.path.join(run_dir, SCORES_FOLDER)
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        path = os.path.join(folder, name, "scores.json")
        if name.startswith("step-") and os.path.isfile(path):
            overall = scoring.EvalResult.from_json(files.read_json(path)).overall(name)
            found[int(name[len("step-"):])] = {key: float(overall[key]) for key in SCORE_KEYS}
    return found


def finish(plan):
    """At the end of a run (its scoring tasks over): the scores rank 0 had not seen yet, which arrived after its
    last report, added to metrics.jsonl; the lines that say them, then every scored step's, in step order."""
    from dreambooth.training import runlog

    metrics_file = os.path.join(plan.run_dir, runlog.METRICS_FILE)
    logged, found = runlog.scored_steps(metrics_file), scores_on_disk(plan.run_dir)
    first = checkpoints.saved_step(plan.resume_path) + 1 if plan.resume_path else 1
    lines = []
    for step in range(first, plan.end_step + 1):
        if not plan.is_score_step(step) or step in logged:
            continue
        if step in found:
            runlog.append_scores(metrics_file, step, found[step])
        lines.append(describe(step, found.get(step)))  # (none: its task failed or timed out)
    if found:
        plot = runlog.plot_scores(metrics_file)
        lines.append(f"scored steps: {', '.join(map(str, sorted(found)))}, plotted in {plot} (images and report.md "
                     f"of each in {os.path.join(plan.run_dir, SCORES_FOLDER)})")
    else:
        lines.append(f"no step was scored (--score_steps {plan.score_steps}): its errors are in Ray's log")
    return lines

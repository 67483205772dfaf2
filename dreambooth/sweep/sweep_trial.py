"""One trial of the sweep, in a Tune actor: one train.py run with the trial's settings (a Plan derived from the
sweep's base flags, never a command line), scored at each step count while it trains (train.py's scores at
checkpoints: Ray Train's validation, evaluate.py's scores), each step count's scores reported to Tune as they arrive.
"""

import argparse
import dataclasses
import math
import os
import sys
import threading

from dreambooth import errors
from dreambooth import storage
from dreambooth.evaluation import scoring
from dreambooth.models import outputs
from dreambooth.planning import checkpoints
from dreambooth.planning import planning
from dreambooth.sweep import sweep_rows
from dreambooth.training import checkpoint_scores
from dreambooth.training import driver
from dreambooth.training import score_record

POLL_SECONDS = 1.0  # how often the trial looks for a step count's scores while it trains


@dataclasses.dataclass(frozen=True)
class SweepJob:
    """What every trial reads (Tune hands it to trial_fn with each trial's config)."""

    subjects: dict  # {name: scoring.Subject}
    sweep_dir: str
    steps: tuple  # the step counts scored, ascending; the last is trained to
    class_dirs: dict  # {class name: folder of its class images}; none with prior_prediction
    train_given: object  # argparse.Namespace: train.py's flags for every trial as given (planning.parse_given)
    given: frozenset  # the names of those the user set (a trial adds its own, then derives the rest)
    typed: frozenset  # ... of those typed rather than read from a config file
    model_dir: str
    eval_settings: object  # scoring.EvalSettings: how the base model was scored, and each step count is
    early_stopping: bool = False  # ASHA may stop a trial at a step count (the scheduler's: sweep.scheduler)
    base: dict = dataclasses.field(default_factory=dict)  # {subject: the base model's overall scores}
    rank_against: dict = dataclasses.field(default_factory=dict)  # {subject: (base CLIP-T - margin, base DINO)}
    keep_checkpoints: bool = False  # train.py's --keep_checkpoints given: the trials' checkpoints stay


def trial_label(config):
    """'dog-lr5e-06-te1(-rank4)': a trial's settings, its folder's name. (Random draws that repeat a
    trial's settings share its folder: the same settings and seed train the same model.)"""
    label = f"{config['subject']}-lr{config['learning_rate']:.6g}-te{int(config['train_text_encoder'])}"
    return label + (f"-rank{config['rank']}" if config.get("use_lora") else "")


def trial_fn(config, job):
    """One trial, in a Tune actor: train.py's run to the largest step count, each step count scored while it trains
    (its checkpoint made a model, model-step-N, and scored by Ray Train's validation); a thread beside the training
    reports each step count's scores to Tune in order as they arrive, the last once the run has ended.
    With early stopping, ASHA may stop the trial at a step count: Tune then ends the trial's actor, and the training
    with it. job: SweepJob."""
    subject = job.subjects[config["subject"]]
    # Named by its settings, not Tune's trial id (a retried trial gets a new id): a trial run again
    # after a failure or a crash finds its own checkpoints and scores, and resumes from them.
    folder = storage.join(job.sweep_dir, "trials", trial_label(config))  # (a bucket's: every node reads it)
    train_args = trial_args(job, config, subject, folder)
    scores = TrialScores(job, subject, folder, train_args)
    train_args = resume_point(train_args, scores)
    watcher = threading.Thread(target=scores.report_while_training, name="trial-scores", daemon=True)
    watcher.start()
    try:
        driver.run(train_args)  # (after a restart: from resume_point's checkpoint)
    finally:
        scores.trained.set()
        watcher.join()
    scores.report_the_rest()
    if not job.keep_checkpoints:  # every step count is a model now: the checkpoints' disk is freed
        remove_checkpoints(train_args.storage_path)
    remove_output(folder)


def remove_output(folder):
    """The trial's own train.py output removed: each step count's model-step-N holds its weights, the last's too (made
    from its checkpoint); a trial stopped early may have trained on past its step count."""
    output = storage.join(folder, "model")
    if storage.exists(output):
        storage.remove_tree(output)


def resume_point(train_args, scores):
    """The trial's flags resuming from its newest checkpoint before its first step count without scores (a run cut
    before a step count's scoring ended goes on from before that step count, which is scored as it trains again), or
    afresh when it has none; from its newest checkpoint ("latest") once every step count is scored."""
    unscored = [step for step in scores.job.steps if scores.overall(step) is None]
    if not unscored:
        return train_args
    found = checkpoints.by_step(train_args.storage_path, "model") if storage.isdir(train_args.storage_path) else {}
    before = [step for step in found if step < unscored[0]]
    if any(step >= unscored[0] for step in found):  # (a run cut before that step count's scores were made)
        start = f"from its checkpoint of step {max(before)}" if before else "from the start"
        print(f"trial {os.path.basename(scores.folder)}: step {unscored[0]} was not scored: trained again {start}, "
              f"scored as it goes", file=sys.stderr)
    remove_output(scores.folder)  # (a model of the cut run: this one writes it again)
    return argparse.Namespace(**{**vars(train_args), "resume_from_checkpoint": found[max(before)] if before else None})


class TrialScores:
    """A trial's step counts as Tune hears of them: each one's scores (its run's, or an earlier run's of the same
    trial: scores/step-N/scores.json under the trial's storage) once its model is there, in step order."""

    def __init__(self, job, subject, folder, train_args):
        self.job, self.subject, self.folder, self.train_args = job, subject, folder, train_args
        self.reported = []  # the step counts reported so far
        self.trained = threading.Event()  # set when the training has ended (or failed)

    def model(self, step):
        """The trial's model at a step count (a bucket's too), made from its checkpoint by its scoring task."""
        return checkpoint_scores.kept_model(self.train_args, step)

    def overall(self, step):
        """The overall scores of the trial's model at step (scoring.EvalResult.overall), or None before they and
        the model are both there."""
        runs = self.train_args.storage_path
        for run in storage.listdir(runs) if storage.isdir(runs) else ():
            path = storage.join(runs, run, score_record.SCORES_FOLDER, f"step-{step}", "scores.json")
            if storage.isfile(path) and outputs.read_output(self.model(step)) is not None:
                return scoring.EvalResult.from_json(storage.read_json(path)).overall(f"step-{step}")
        return None

    def report(self, step, overall):
        import ray.tune

        self.reported.append(step)
        ray.tune.report({"step": step, "model": self.model(step), **overall, "score": sweep_rows.rank_score(
            overall, *self.job.rank_against.get(self.subject.name, (None, 0.0)))})  # (ASHA decides here)

    def report_while_training(self):
        """Every step count but the last, in order, as its scores arrive, until the training ends."""
        for step in self.job.steps[:-1]:
            while (overall := self.overall(step)) is None:
                if self.trained.wait(POLL_SECONDS):
                    return
            self.report(step, overall)

    def report_the_rest(self):
        """The step counts not reported yet, the last among them; a UserError for one whose scoring failed."""
        for step in self.job.steps[len(self.reported):]:
            overall = self.overall(step)
            if overall is None:
                raise errors.UserError(f"the scoring of step {step} failed: see scores/step-{step}/"
                                       f"{checkpoint_scores.SCORING_LOG} in the run folders under "
                                       f"{self.train_args.storage_path}")
            self.report(step, overall)


def trial_args(job, config, subject, folder):
    """A trial's train.py flags: the sweep's base as given, with the trial's own set on it, then
    everything worked out from them (planning.derive), as a train.py command line of them would be."""
    steps = job.steps
    own = dict(
        model_dir=job.model_dir, output_dir=storage.join(folder, "model"), instance_data_dir=subject.photos_dir,
        instance_prompt=f"photo of {subject.unique_token} {subject.class_name}",
        class_data_dir=job.class_dirs.get(subject.class_name), class_prompt=f"photo of a {subject.class_name}",
        learning_rate=config["learning_rate"], max_train_steps=steps[-1],
        train_text_encoder=config["train_text_encoder"], checkpointing_steps=math.gcd(*steps),
        checkpoints_total_limit=checkpoints_kept(steps), keep_checkpoints=True,
        storage_path=storage.join(folder, "ray_results"), resume_from_checkpoint="latest", overwrite=True,
        **scoring_flags(job, subject), **({"lora_rank": config["rank"]} if config["use_lora"] else {}))
    parser = planning.train_parser()
    parser.given, parser.typed = set(job.given) | set(own), set(job.typed) | set(own)
    args = planning.derive(argparse.Namespace(**{**vars(job.train_given), **own}), parser)
    # (beside the flags: what only a sweep's trial is, plan.Plan's score_at, step_models and base_scores)
    return argparse.Namespace(**vars(args), score_at=tuple(steps), step_models=folder,
                              base_scores=job.base.get(subject.name))


def scoring_flags(job, subject):
    """train.py's flags that score a trial's checkpoints as the sweep scored the base model (--score_steps: the step
    counts' greatest common divisor; plan.Plan's score_at says which steps)."""
    settings = job.eval_settings
    return dict(score_steps=math.gcd(*job.steps), eval_models_dir=settings.eval_models_dir,
                class_name=subject.class_name, unique_token=subject.unique_token, subject_type=subject.subject_type,
                eval_prompts=subject.eval_prompts, eval_images_per_prompt=settings.num_samples_per_prompt,
                validation_inference_steps=settings.num_inference_steps, guidance_scale=settings.guidance_scale)


def checkpoints_kept(steps):
    """The checkpoints a trial keeps (one every gcd of the step counts, up to the last): every step
    count's is kept until it is scored, then all are removed."""
    return steps[-1] // math.gcd(*steps)


def remove_checkpoints(storage_path):
    """Every checkpoint of a trial's runs removed (storage_path: a folder, or a bucket's)."""
    for run in storage.listdir(storage_path):
        checkpoints.remove_all(storage.join(storage_path, run))

"""One trial of the sweep, in a Tune actor: train.py's run with the trial's settings (a Plan derived
from the sweep's base flags, never a command line), then evaluate.py's scores at each step count.
"""

import argparse
import dataclasses
import math
import tempfile

from dreambooth import storage
from dreambooth.evaluation import scoring
from dreambooth.models import outputs
from dreambooth.planning import checkpoints
from dreambooth.planning import planning
from dreambooth.sweep import sweep_rows
from dreambooth.training import checkpoint
from dreambooth.training import driver


@dataclasses.dataclass(frozen=True)
class SweepJob:
    """What every trial reads (Tune hands it to trial_fn with each trial's config)."""

    subjects: dict  # {name: scoring.Subject}
    sweep_dir: str
    steps: tuple  # the step counts scored, ascending; the last is trained to
    class_dirs: dict  # {class name: folder of its class images}
    train_given: object  # argparse.Namespace: train.py's flags for every trial as given (planning.parse_given)
    given: frozenset  # the names of those the user set (a trial adds its own, then derives the rest)
    typed: frozenset  # ... of those typed rather than read from a config file
    model_dir: str
    eval_settings: object  # scoring.EvalSettings
    early_stopping: bool = False  # train and score one step count at a time; ASHA may stop the trial between
    rank_against: dict = dataclasses.field(default_factory=dict)  # {subject: (base CLIP-T - margin, base DINO)}
    keep_checkpoints: bool = False  # train.py's --keep_checkpoints given: the trials' checkpoints stay


def trial_label(config):
    """'dog-lr5e-06-te1(-rank4)': a trial's settings, its folder's name. (Random draws that repeat a
    trial's settings share its folder: the same settings and seed train the same model.)"""
    label = f"{config['subject']}-lr{config['learning_rate']:.6g}-te{int(config['train_text_encoder'])}"
    return label + (f"-rank{config['rank']}" if config.get("use_lora") else "")


def trial_fn(config, job):
    """One trial, in a Tune actor: train.py, then evaluate.py; one result reported per step count.
    job: SweepJob.

    Without early stopping the trial trains once, to the largest step count, and then scores each
    step count (the smaller ones from their checkpoints). With it, the trial trains to each step
    count in turn (each run resumes the one before; the LR schedule always spans the largest) and
    scores it before going on: ASHA can stop the trial at any step count, and the weights at each
    step count are those of one uninterrupted run either way."""
    import ray.tune

    subject = job.subjects[config["subject"]]
    # Named by its settings, not Tune's trial id (a retried trial gets a new id): a trial run again
    # after a failure or a crash finds its own checkpoints and resumes from them.
    folder = storage.join(job.sweep_dir, "trials", trial_label(config))  # (a bucket's: every node reads it)
    steps = job.steps
    train_args = trial_args(job, config, subject, folder)

    def model_at(step):
        """The trial's model folder at a step count (a bucket's too): train.py's output at the last, else made
        from its checkpoint."""
        model = train_args.output_dir
        if step != steps[-1]:
            model = storage.join(folder, f"model-step-{step}")
            if outputs.read_output(model) is None:
                found = checkpoints.by_step(train_args.storage_path, "model")
                with tempfile.TemporaryDirectory(prefix="dreambooth-") as scratch:  # (a bucket's: read from a copy)
                    save_step_model(storage.local_folder(found[step], scratch), train_args, model, step, subject)
        return model

    def score(step_counts):
        folders = [model_at(step) for step in step_counts]  # (what the table names: not this node's copy)
        entries = [(f"step-{step}", outputs.resolve_model(model)) for step, model in zip(step_counts, folders)]
        with storage.output_folder(storage.join(folder, "eval")) as local:  # (a bucket's: filled here, copied there)
            result = scoring.run(entries, [subject], job.eval_settings, local)[subject.name]
        for step, (label, _), model in zip(step_counts, entries, folders):
            overall = result.overall(label)
            ray.tune.report({"step": step, "model": model, **overall,
                             "score": sweep_rows.rank_score(overall, *job.rank_against.get(subject.name, (None, 0.0)))})

    if not job.early_stopping:
        driver.run(train_args)  # after a restart: resumes from the trial's newest checkpoint
        score(steps)
    else:
        for step in steps:
            driver.run(train_args, stop_step=step)  # ends at this step count; the next run resumes from it
            score([step])  # ASHA decides here whether the trial goes on
    if not job.keep_checkpoints:  # every step count is a model now: the checkpoints' disk is freed
        remove_checkpoints(train_args.storage_path)


def save_step_model(checkpoint_dir, train_args, model, step, subject):
    """The trial's checkpoint at step (a local folder) written as train.py's output model (a bucket's too)."""
    checkpoint.save_as_model(checkpoint_dir, checkpoint.step_model_plan(train_args, model, step, subject.held_out_names()))


def trial_args(job, config, subject, folder):
    """A trial's train.py flags: the sweep's base as given, with the trial's own set on it, then
    everything worked out from them (planning.derive), as a train.py command line of them would be."""
    steps = job.steps
    own = dict(
        model_dir=job.model_dir, output_dir=storage.join(folder, "model"), instance_data_dir=subject.photos_dir,
        instance_prompt=f"photo of {subject.unique_token} {subject.class_name}",
        class_data_dir=job.class_dirs[subject.class_name], class_prompt=f"photo of a {subject.class_name}",
        learning_rate=config["learning_rate"], max_train_steps=steps[-1],
        train_text_encoder=config["train_text_encoder"], checkpointing_steps=math.gcd(*steps),
        checkpoints_total_limit=checkpoints_kept(steps), keep_checkpoints=True,
        storage_path=storage.join(folder, "ray_results"), resume_from_checkpoint="latest", overwrite=True,
        **({"lora_rank": config["rank"]} if config["use_lora"] else {}))
    parser = planning.train_parser()
    parser.given, parser.typed = set(job.given) | set(own), set(job.typed) | set(own)
    return planning.derive(argparse.Namespace(**{**vars(job.train_given), **own}), parser)


def checkpoints_kept(steps):
    """The checkpoints a trial keeps (one every gcd of the step counts, up to the last): every step
    count's is kept until it is scored, then all are removed."""
    return steps[-1] // math.gcd(*steps)


def remove_checkpoints(storage_path):
    """Every checkpoint of a trial's runs removed (storage_path: a folder, or a bucket's)."""
    for run in storage.listdir(storage_path):
        checkpoints.remove_all(storage.join(storage_path, run))

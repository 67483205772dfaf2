"""The record of a run's scored steps in its run folder (scores/step-N/scores.json, scores/base.json, the kept model
of the best step so far), and the best step by the sweep's rule: what checkpoint_scores writes while the run trains
and reads at its end, and what a resumed run takes over; whether a saved model is the scored one (same_weights)."""

import os
import shutil

from dreambooth import files
from dreambooth import storage
from dreambooth.evaluation import scores
from dreambooth.evaluation import scoring
from dreambooth.models import outputs
from dreambooth.planning import checkpoints
from dreambooth.storage import runfiles

SCORES_FOLDER = "scores"  # in the run folder: step-N/ of each scored step (images, scores.json, report.md)
BASE = "base"  # the base model's label, and its folder in the scores folder (images, scores.json, report.md)
BASE_SCORES = "base.json"  # in the scores folder: the base model's scores (score_base's, as the run starts)
SCORE_KEYS = ("dino", "clip_i", "clip_t")  # what a scored step reports (the paper's subject and prompt fidelity)


def score_values(overall):
    """{SCORE_KEYS: value} of a model's overall scores (scoring.EvalResult.overall), and its DINO and CLIP-I against the
    held-out photos with --holdout (the best step is ranked by that DINO, as the sweep ranks)."""
    return {key: float(overall[key]) for key in SCORE_KEYS + scores.HOLDOUT_NAMES if overall.get(key) is not None}


def scores_on_disk(run_dir):
    """{step: {SCORE_KEYS: value}} of the scored steps whose scores.json is in run_dir's scores folder (a bucket's
    too)."""
    found = {}
    folder = storage.join(run_dir, SCORES_FOLDER)
    for name in storage.listdir(folder) if storage.isdir(folder) else ():
        path = storage.join(folder, name, "scores.json")
        if name.startswith("step-") and storage.isfile(path):
            result = scoring.EvalResult.from_json(storage.read_json(path))
            found[int(name[len("step-"):])] = score_values(result.overall(name))
    return found


def base_scores(run_dir):
    """{SCORE_KEYS: value} of the run's base model (its first scoring task's), or None before it has them."""
    path = os.path.join(run_dir, SCORES_FOLDER, BASE_SCORES)
    return files.read_json(path) if os.path.isfile(path) else None


def best_step(run_dir, margin):
    """(step, within_margin, ranked_by) of the best-scored step of run_dir by the sweep's rule (scores.best_of: the
    highest DINO among the steps whose CLIP-T is at most margin below the base model's), the earliest of equals;
    (None, None, None) before a step and the base model are scored."""
    found, base = scores_on_disk(run_dir), base_scores(run_dir)
    if not found or base is None:
        return None, None, None
    return scores.best_of(dict(sorted(found.items())), base["clip_t"] - margin)


def model_of(run_dir, step):
    """The folder a scored step's model is kept in while it is the best (--keep_best)."""
    return os.path.join(run_dir, SCORES_FOLDER, f"step-{step}", "model")


def keep_models(run_dir, best):
    """Every scored step's model removed but step best's (None: all of them)."""
    folder = os.path.join(run_dir, SCORES_FOLDER)
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.startswith("step-") and name != f"step-{best}":
            shutil.rmtree(os.path.join(folder, name, "model"), ignore_errors=True)


def best_line(plan, step, within, ranked_by):
    """The output's line of the best-scored step, and the rule that chose it."""
    scored, base = scores_on_disk(plan.run_dir), base_scores(plan.run_dir)
    found = scored[step]
    dino = "DINO against the held-out photos" if ranked_by == "dino_holdout" else "DINO"
    rule = (f"the highest {dino} among the scored steps whose CLIP-T is at most {plan.clip_t_margin:g} below the base "
            f"model's {base['clip_t']:.3f}" if within else
            f"no step kept CLIP-T within {plan.clip_t_margin:g} of the base model's {base['clip_t']:.3f}: the highest "
            f"{dino} of all")
    # a runner-up that reads the same at 3 decimals (the best of the others by the same rule): shown beside it, at as
    # many as tell them apart
    others = {other: values for other, values in scored.items() if other != step}
    runner, runner_within, _ = scores.best_of(others, base["clip_t"] - plan.clip_t_margin) if others else (None,) * 3
    value = f"{found[ranked_by]:.3f}"
    if runner is not None and runner_within == within and f"{others[runner][ranked_by]:.3f}" == value:
        a, b = found[ranked_by], others[runner][ranked_by]
        digits = next((d for d in range(4, 9) if f"{a:.{d}f}" != f"{b:.{d}f}"), None)
        value = (f"{a:.{digits}f}, step {runner}'s {b:.{digits}f}" if digits else
                 f"{a:.3f}, equal to step {runner}'s: the earlier step kept")
    return f"best scored step: {step} ({dino} {value}, CLIP-T {found['clip_t']:.3f}; {rule})"


def same_weights(scored, output_dir):
    """Whether output_dir (a folder on this node) holds the files of the scored step's model folder besides the records
    of each: byte for byte, or a safetensors file with the same metadata and tensors (the order of its header's
    metadata varies with the process that wrote it)."""
    import filecmp

    if storage.is_remote(output_dir):
        return False
    records = {files.OUTPUT_MARKER, outputs.TRAIN_CONFIG}

    def listing(folder):
        names = (os.path.relpath(path, folder) for path in files.model_files(folder, suffixes=None))
        return [name for name in names if name not in records]

    def same(a, b):
        return filecmp.cmp(a, b, shallow=False) or (a.endswith(".safetensors") and same_tensors(a, b))

    names = listing(scored)
    return names == listing(output_dir) and all(same(os.path.join(scored, name), os.path.join(output_dir, name))
                                                for name in names)


def same_tensors(a, b):
    """Whether safetensors files a and b hold the same metadata and tensors (read one tensor at a time)."""
    import torch
    from safetensors import SafetensorError
    from safetensors import safe_open

    try:
        with safe_open(a, "pt") as first, safe_open(b, "pt") as second:
            return first.metadata() == second.metadata() and sorted(first.keys()) == sorted(second.keys()) and all(
                torch.equal(first.get_tensor(key), second.get_tensor(key)) for key in first.keys())
    except SafetensorError:  # (not a safetensors file: its bytes differ, so it is not the same)
        return False


def carry_over(plan):
    """A resumed run's scored steps so far, from the run folder whose checkpoint it goes on from (a bucket's too) into
    its own: each step's scores.json and report.md up to that checkpoint's step, the base model's scores and
    (--keep_best) the best step's kept model (moved on a disk, copied from a bucket): the best step is chosen among
    all the steps scored since the first run began. Their images and the base model's go with them: evaluate.py takes
    those of the saved model (scoring.scored_image_folders)."""
    earlier = runfiles.run_of_checkpoint(plan.resume_path)
    if earlier is None or (earlier.rstrip("/") == storage.join(plan.storage_path, plan.run_name) if
                           storage.is_remote(earlier) else os.path.abspath(earlier) == os.path.abspath(plan.run_dir)):
        return
    folder = storage.join(earlier, SCORES_FOLDER)
    if not storage.isdir(folder):
        return
    upto, into = checkpoints.saved_step(plan.resume_path), os.path.join(plan.run_dir, SCORES_FOLDER)
    os.makedirs(into, exist_ok=True)

    def copy(source, target):
        if storage.isfile(source):
            files.write_bytes_atomic(storage.read_bytes(source), target)

    def copy_images(name):
        images = storage.join(folder, name, "images")
        if storage.is_remote(images) and storage.isdir(images):
            storage.download(images, os.path.join(into, name, "images"))
        elif os.path.isdir(images):
            shutil.copytree(images, os.path.join(into, name, "images"), dirs_exist_ok=True)

    copy(storage.join(folder, BASE_SCORES), os.path.join(into, BASE_SCORES))
    copy_images(BASE)
    for step in (step for step in scores_on_disk(earlier) if step <= upto):
        name = f"step-{step}"
        os.makedirs(os.path.join(into, name), exist_ok=True)
        for kept in ("scores.json", "report.md"):
            copy(storage.join(folder, name, kept), os.path.join(into, name, kept))
        copy_images(name)
        model = storage.join(folder, name, "model")
        if storage.is_remote(model) and storage.isdir(model):
            storage.download(model, model_of(plan.run_dir, step))
        elif os.path.isdir(model):
            shutil.move(model, model_of(plan.run_dir, step))

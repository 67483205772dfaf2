"""Step 6's report: report.md of an evaluate.EvalResult (overall scores of each model beside the paper's for
SD, then one row per prompt), and a model's overall scores on one line."""

import os
import shutil
import sys

from dreambooth import families
from dreambooth import storage
from dreambooth.evaluation import scores
from dreambooth.generation import image_records
from dreambooth.models import outputs

RANDOM_NOTE = "Random weights (--tiny): every model here draws noise; the scores show the pipeline runs, not likeness."
DIV_NOTE = ("DIV is blank: one image per prompt (NUM_EVAL_IMAGES=1, evaluate.py --num_samples_per_prompt 1); "
            "diversity needs two.")
# What each score says, under the table (how to read them together: the README's "Reading the scores")
LEGEND = ("- DINO: your photos against the images drawn (DINO ViT-S/16): is it your subject, not just one of its "
          "class? CLIP-I: the same with CLIP's image embeddings.",
          "- CLIP-T: each image against its prompt, the token left out: does the image follow the prompt? A little "
          "under the base model's is fine; well under it, the model repeats your photos.",
          "- DIV: how far apart one prompt's images are (near 0: every image the same picture). PRES: images of the "
          "class prompt alone ('a dog' for a dog) against your photos: near the base model's, the class has not "
          "drifted to your subject.",
          "- How to read them together: the README's \"Reading the scores\".")


def cell(value):
    return "" if value is None else f"{value:.3f}"


def scored_models(entries):
    """{label: {"model": what drew its images, "family": its family}} of entries [(label, outputs.ModelRef)], as
    scores.json and report.md name them."""
    return {label: {"model": model.describe(), "family": families.family_of(model.model_dir).label}
            for label, model in entries}


def write_report(path, result, random_weights=False):
    """report.md of an EvalResult: overall scores of each model beside the paper's for SD, then one row per prompt."""
    labels = list(result.models)
    held = result.held_out
    kept_out = f" (+ {len(held)} held out of training: {', '.join(held)})" if held else ""
    lines = ["# DreamBooth evaluation", "",
             f"Subject: `{result.subject}`, {result.num_prompts} prompt(s) x {result.num_samples_per_prompt} "
             f"image(s), subject photos: {result.num_photos}{kept_out}. Higher is better except PRES (language "
             "drift).", "",
             *([RANDOM_NOTE, ""] if random_weights else []),
             *[f"- {label}: `{m['model']}` ({m['family']})" for label, m in result.scored.items()],
             *([""] if result.scored else []),
             "| model | DINO | CLIP-I | CLIP-T | DIV | PRES |" + (" DINO held out | CLIP-I held out |" if held else ""),
             "| --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if held else "")]
    for label in labels:
        s = result.overall(label)
        names = (*scores.SCORE_NAMES, "pres", *(scores.HOLDOUT_NAMES if held else ()))
        lines.append(f"| {label} | " + " | ".join(cell(s.get(k)) for k in names) + " |")
    paper = scores.PAPER_SD
    lines += [f"| paper, SD DreamBooth | {paper['dino']:.3f} | {paper['clip_i']:.3f} | {paper['clip_t']:.3f} | | |"
              + (" | |" if held else ""), "",
              *([DIV_NOTE, ""] if any(result.overall(label).get("div") is None for label in labels) else []), *LEGEND,
              "", "## Per prompt", "", "| prompt | " + " | ".join(f"{label} DINO | {label} CLIP-T" for label in labels)
              + " |", "| --- |" + " ---: | ---: |" * len(labels)]
    for prompt in result.prompts:
        cells = []
        for label in labels:
            s = result.models[label].per_prompt.get(prompt)
            cells += [cell(s["dino"]), cell(s["clip_t"])] if s else ["", ""]
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def summary(overall):
    """'DINO 0.512, CLIP-I …': one model's overall scores on one line."""
    names = (*scores.SCORE_NAMES, "pres", *(k for k in scores.HOLDOUT_NAMES if k in overall))
    missing = {"div": "n/a (one image per prompt: diversity needs two)", "pres": "n/a (no image of the class prompt)"}
    return ", ".join(f"{k.upper().replace('_HOLDOUT', ' held out').replace('_', '-')} "
                     f"{cell(overall[k]) or missing.get(k, 'n/a')}" for k in names)


def drop_node_copy(folder):
    """A bucket's folder: this node's copy of it removed (fetched again when needed)."""
    if storage.is_remote(folder) and os.path.isdir(storage.cache_path(folder)):
        shutil.rmtree(storage.cache_path(folder))


def of_another_model(images_dir, model_dir):
    """Whether the images in images_dir (a folder or a bucket's) were drawn by another model than model_dir's (train.py's
    output), by their record; False without a record or an output of train.py."""
    record = storage.join(images_dir, image_records.IMAGES_RECORD)
    output = outputs.read_output(model_dir)
    if output is None or not storage.isfile(record):
        return False
    # (a LoRA's images: '<base>+lora:trained:<id>@<scale>')
    return not (output.model_id and outputs.trained_fingerprint(output.model_id) in
                str(storage.read_json(record).get("model")))


def forget_stale_images(images_dir, model_dir):
    """Remove what images_dir (Step 5's folder, or a bucket's) holds when another model than model_dir's drew it, for a
    run that draws none there (NUM_NEW_IMAGES=0): images of a model this run replaced never stay beside it. True when
    removed."""
    if not of_another_model(images_dir, model_dir):
        return False
    for name in storage.listdir(images_dir):
        storage.remove(storage.join(images_dir, name))
    drop_node_copy(images_dir)
    print(f"removed the images in {images_dir}: they were of the model this run replaced (NUM_NEW_IMAGES=0: none "
          f"drawn of the new one)", file=sys.stderr)
    return True


def forget_stale_scores(eval_dir, model_dir, scored_next="1"):
    """Remove what eval_dir (a folder or a bucket's) holds of another model than model_dir's, when Step 4
    replaced the subject's model (another mode, base model or settings, RETRAIN=1): its scores, report, grids
    and images (the base model's images stay, for Step 6 to score again): scores never stay beside a model they
    are not of, even when Step 6 does not run (scored_next "0": --skip_eval, the line says so). True when removed."""
    if not of_another_model(storage.join(eval_dir, "images", "tuned"), model_dir):
        return False
    for name in storage.listdir(eval_dir):
        if name != "images":
            storage.remove(storage.join(eval_dir, name))
    images = storage.join(eval_dir, "images")
    for name in storage.listdir(images) if storage.isdir(images) else []:
        if name != "base":
            storage.remove(storage.join(images, name))
    drop_node_copy(eval_dir)
    scorer = "Step 6" if scored_next != "0" else "evaluate.py"
    kept = f" (the base model's images there stay: {scorer} draws them again if this run's base model is another)" \
        if storage.isdir(storage.join(images, "base")) else ""
    after = "Step 6 scores the new one" if scored_next != "0" else \
        "--skip_eval: no Step 6; evaluate.py scores the new one when you want its scores"
    print(f"removed the scores in {eval_dir} and its images of the model this run replaced{kept}; {after}",
          file=sys.stderr)
    return True

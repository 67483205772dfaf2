"""Step 6: does it look like the subject? Score a tuned model the way the DreamBooth paper does.

    python evaluate.py --model_dir=$TUNED_MODEL_DIR --instance_data_dir=$IMAGES_OWN_DIR \
        --unique_token=$UNIQUE_TOKEN --class_name=$CLASS_NAME --subject_type=live \
        --eval_models_dir=$EVAL_MODELS_DIR --output_dir=$EVAL_DIR

Generates --num_samples_per_prompt images for each prompt of a prompt set (25 per subject type,
assets/eval_prompts/, or --eval_prompts FILE) and of the class prompt, from the tuned model and
from the base model it was trained on, on the Ray Data actor pool; embeds them and the subject
photos with DINO and CLIP on an actor pool too (with one actor on a cluster of one node, both in one Ray
task on this node: one process loads the models); writes scores.json, report.md (a table per prompt
and overall, tuned beside base, and the paper's values for SD) and a grid per prompt. Images
already there are kept: a rerun only scores again. Scores: see scores.py.
"""

import os
import sys
import tempfile

from dreambooth import errors
from dreambooth import files
from dreambooth import storage
from dreambooth.config import flags
from dreambooth.evaluation import eval_report
from dreambooth.evaluation import scoring
from dreambooth.generation import imagefiles
from dreambooth.models import modelcache
from dreambooth.models import outputs
from dreambooth.planning import model_flags
from dreambooth.storage import notify
from dreambooth.training import trackers


def main(argv=None):
    parser = flags.make_parser(__doc__.splitlines()[0], [
        "model_dir", "lora_dir", "base_model_dir", "instance_data_dir", "unique_token", "class_name",
        "subject_type", "eval_prompts", "eval_models_dir", "output_dir", "num_samples_per_prompt", "batch_size",
        "num_inference_steps", "guidance_scale", "seed", "resolution", "num_actors", "allow_unsafe_weights",
        "holdout", "notify_url"],
        helps={"model_dir": "The tuned model: train.py's output folder (full, or --use_lora adapters on their base).",
               "num_samples_per_prompt": "Images per prompt and model (the paper: 4).",
               "holdout": "The last N photos (in name order) were kept out of training (train.py --holdout N): "
                          "score DINO and CLIP-I against them too, and against the others only.",
               "output_dir": "Where the images, scores.json, report.md and the grids go: a folder, or a bucket's "
                             "(s3://bucket/prefix, gs://…), filled through this node's copy of it."},
        types=dict.fromkeys(("instance_data_dir", "output_dir", "eval_models_dir"), flags.storage_location),
        without=("--num_class_images",))  # (diffusers' name for class images: sweep.py's meaning, not this)
    parser.set_defaults(num_samples_per_prompt=4)
    args = model_flags.resolve_models(parser.parse_args(argv))
    for name in ("instance_data_dir", "eval_models_dir"):  # (a bucket's photos and scoring models: this node's copy)
        if storage.is_remote(getattr(args, name)):
            setattr(args, name, storage.cached(getattr(args, name)))
    try:
        with storage.output_folder(args.output_dir) as folder:  # (a bucket's: filled here, copied there)
            result = evaluate(args, folder)
    except (Exception, KeyboardInterrupt) as err:
        notify.send(args.notify_url, "failed", f"DreamBooth scores of {args.model_dir} failed: {notify.cause_of(err)}",
                    model_dir=args.model_dir, cause=notify.cause_of(err))
        raise
    tuned = result.overall("tuned")
    notify.send(args.notify_url, "finished", f"DreamBooth scores of {args.lora_dir or args.model_dir}: {eval_report.summary(tuned)}",
                model_dir=args.lora_dir or args.model_dir, scores={k: v for k, v in tuned.items() if v is not None})
    return result


def evaluate(args, folder=None):
    """The scoring.EvalResult of evaluate.py's parsed flags; the tuned model's scores also go to the W&B/MLflow runs
    its training was logged to. folder: the local folder written for --output_dir (default: itself)."""
    folder = folder or args.output_dir
    subject = scoring.Subject(os.path.basename(args.instance_data_dir), args.instance_data_dir, args.unique_token,
                              args.class_name, args.subject_type, args.eval_prompts, args.holdout)
    check_holdout(args.lora_dir or args.model_dir, subject)
    # Everything the end of the run needs, checked before its first image: the prompt file, the scoring
    # models, the photos (each one opened), the models and where the results go.
    subject.prompts()
    files.check_output_path(args.output_dir, "--output_dir", [("--model_dir", args.model_dir),
                                                              ("--instance_data_dir", args.instance_data_dir)])
    modelcache.check_eval_models_dir(args.eval_models_dir)
    with tempfile.TemporaryDirectory() as scratch:  # each photo opened (odd ones converted there, then dropped)
        imagefiles.inspect_images(subject.photos(), 0, scratch)
    result = scoring.run(scoring.models_to_score(args.model_dir, args.lora_dir, args.base_model_dir), [subject],
                         scoring.EvalSettings.from_args(args), folder)[subject.name]
    for label in result.models:  # (the tuned model's line first, the base model's beside it)
        print(f"{label}: {eval_report.summary(result.overall(label))}", file=sys.stderr)
    print(f"report: {storage.join(args.output_dir, 'report.md')}", file=sys.stderr)
    output = outputs.read_output(args.lora_dir or args.model_dir)
    if output is not None and output.record.trackers:
        trackers.log_scores(output.record.trackers, output.record.steps or 0, result.overall("tuned"),
                            "the tuned model")
    return result


def check_holdout(model_dir, subject):
    """UserError unless the tuned model was trained without exactly the photos subject.split() holds
    out (train.py records them): held-out scores of photos it saw would flatter it."""
    held = list(subject.held_out_names())  # (too few photos for --holdout: said here)
    output = outputs.read_output(model_dir)
    if output is None:
        return  # not train.py's output: nothing recorded to check against
    trained_without = list(output.record.held_out)
    if trained_without != held:
        said = f"held out {', '.join(trained_without)}" if trained_without else "trained on every photo"
        raise errors.UserError(f"the model in {model_dir} was {said}; --holdout {subject.holdout} holds out "
                               f"{', '.join(held) or 'none'}: give train.py and evaluate.py the same --holdout")

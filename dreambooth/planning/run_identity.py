"""A training run's identity: everything that decides its weights, recorded in every checkpoint and
in the saved model's record. A checkpoint is resumed, and a finished model kept, only when its
identity is this run's; otherwise one line names what differs.

What is left out changes how a run goes, not the weights it ends with: workers and GPUs, logging,
validation samples, checkpoint interval and storage, memory and speed options (gradient
checkpointing, channels-last, compile, TF32, fused AdamW).
"""

import hashlib
import json
import os

from dreambooth import errors
from dreambooth.models import outputs

# train.py's flags (as parsed) that change the trained weights; the files and the resolved sizes are
# added by of_run. The learning rate is the flag's (with --scale_lr also a flag), not the product with
# the worker count: workers are not part of a run's identity.
WEIGHT_FLAGS = (
    "instance_prompt", "class_prompt", "with_prior_preservation", "prior_preservation", "prior_loss_weight",
    "train_text_encoder", "use_lora", "lora_rank", "lora_alpha", "lora_dropout", "center_crop", "random_flip",
    "enable_bucket", "train_batch_size", "gradient_accumulation_steps", "learning_rate", "scale_lr",
    "lr_scheduler", "lr_warmup_steps", "lr_num_cycles", "lr_power", "offset_noise", "snr_gamma",
    "caption_dropout_rate", "masked_loss", "use_ema", "ema_decay", "ema_update_after_step", "use_8bit_adam",
    "adam_beta1", "adam_beta2", "adam_weight_decay", "adam_epsilon", "max_grad_norm", "mixed_precision", "seed",
    "max_train_steps", "num_train_epochs", "cache_latents",
)
# ... of a flow-matching family
FLOW_FLAGS = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "precondition_outputs", "flow_shift")
# Every flag of_run reads: planning hands their values over ({name: value})
# ... of an optimizer other than AdamW (an identity without them: AdamW's, as before they were offered)
OPTIMIZER_FLAGS = {"prodigy": ("optimizer", "prodigy_beta3", "prodigy_decouple", "prodigy_use_bias_correction",
                               "prodigy_safeguard_warmup"),
                   "adamw_schedulefree": ("optimizer",)}
# ... that choose which step's weights the model is (--keep_best: the best-scored step's, by these scores)
KEEP_BEST_FLAGS = ("score_steps", "clip_t_margin", "eval_prompts", "eval_images_per_prompt", "validation_inference_steps")
FLAGS = WEIGHT_FLAGS + FLOW_FLAGS + ("model_dir", "vae_dir", "base_precision", "text_encoder_precision", "guidance_scale", "adapter", "keep_best") + \
    KEEP_BEST_FLAGS + \
    tuple(dict.fromkeys(name for names in OPTIMIZER_FLAGS.values() for name in names))
OPTIMIZER_OWN = {name for names in OPTIMIZER_FLAGS.values() for name in names} - {"optimizer"}
# What a flag recorded only when it is not its default was, where a run's identity lacks it.
ABSENT_MEANS = {"optimizer": "adamw", "adapter": "lora", "base_precision": "none", "text_encoder_precision": "none"}
# The parts of an identity that are files, as the line that names a difference says them.
FILE_PARTS = {"base_model": "the base model", "vae": "the VAE", "photos": "the photos (their content)",
              "class_images": "the class images (their content)"}


def files_digest(paths):
    """A digest of the files' names and bytes, in the order given (None for no files)."""
    if not paths:
        return None
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:20]


def of_run(flags, family, photos, masks, held_out, captions, class_images, resolution, buckets):
    """The identity of a run of flags ({name: value} of FLAGS), as JSON-able values: photos are the photos trained on
    (paths as given), masks their mask sources (inputs.masks_of), captions each photo's prompt."""
    mask_files = sorted({source[0] for source in masks if source and os.path.isfile(str(source[0]))})
    identity = {
        "base_model": outputs.model_fingerprint(flags["model_dir"]),
        "vae": outputs.model_fingerprint(flags["vae_dir"]) if flags["vae_dir"] else None,
        "family": family.name,
        "photos": files_digest(list(photos) + mask_files),
        "held_out": list(held_out),
        "captions": list(captions),
        "class_images": files_digest(list(class_images)),
        "resolution": resolution,
        "buckets": [list(b) for b in buckets],
        **{name: flags[name] for name in WEIGHT_FLAGS + (FLOW_FLAGS if family.flow_matching else ())},
        **({"logit_std": family.default_logit_std if flags["logit_std"] is None else flags["logit_std"]}
           if family.flow_matching else {}),  # (the family's default, as a run recorded it before it was one)
        **({"base_precision": flags["base_precision"]} if flags["base_precision"] else {}),
        **({"text_encoder_precision": flags["text_encoder_precision"]} if flags["text_encoder_precision"] else {}),
        **{name: flags[name] for name in OPTIMIZER_FLAGS.get(flags["optimizer"], ())},
        **({"adapter": flags["adapter"]} if flags["adapter"] not in (None, "lora") else {}),
        **({"guidance_scale": family.guidance(flags["guidance_scale"])} if family.guided_training else {}),
        **({"keep_best": {name: flags[name] for name in KEEP_BEST_FLAGS}} if flags["keep_best"] else {}),
    }
    return json.loads(json.dumps(identity))  # tuples as lists: as it reads back from a file


def differences(saved, current):
    """What differs between two identities, each as a few words ('--learning_rate 5e-06 -> 1e-05',
    'the photos (their content)'); [] when they are the same."""
    if saved is None:
        return ["its settings (it was written before runs recorded them)"]
    said = []
    changed = [k for k in sorted(set(saved) | set(current), key=lambda k: (k not in FILE_PARTS, k))
               if saved.get(k) != current.get(k)]
    # (why a length alone does or does not continue a run: no news when something else differs as well)
    length_only = set(changed) <= {"max_train_steps", "num_train_epochs"}
    for key in changed:
        before, now = saved.get(key, ABSENT_MEANS.get(key)), current.get(key, ABSENT_MEANS.get(key))
        one_sided = (key not in saved or key not in current) and key not in ABSENT_MEANS
        if one_sided and ("family" in changed or "optimizer" in changed and key in OPTIMIZER_OWN):
            continue  # a setting only one of the families (Flux.1's guidance) or optimizers has: its change says it
        if key == "keep_best" and not (isinstance(before, dict) and isinstance(now, dict)):
            said.append(f"--keep_best {'on' if before else 'off'} -> {'on' if now else 'off'}")
        elif key in FILE_PARTS:
            said.append(FILE_PARTS[key])
        elif key == "captions":  # one per photo: only a change of the prompts themselves is news
            if set(before or ()) != set(now or ()):
                said.append(f"captions {short(sorted(set(before or ())))} -> {short(sorted(set(now or ())))}")
        elif key in ("held_out", "buckets", "family", "resolution"):
            said.append(f"{key.replace('_', '-')} {short(before)} -> {short(now)}")
        elif key in ("max_train_steps", "num_train_epochs") and length_only:  # why this run does not continue that one
            if current.get("lr_scheduler") not in LENGTH_FREE_SCHEDULES:
                why = f"--lr_scheduler {current.get('lr_scheduler')} is planned over the whole run"
            elif isinstance(before, int) and isinstance(now, int) and now > before:
                why = "a longer run: continued from that run's newest checkpoint"
            else:
                why = "a run is continued only to more steps"
            said.append(f"--{key} {short(before)} -> {short(now)} ({why})")
        elif isinstance(before, dict) and isinstance(now, dict):  # a group of flags (--keep_best's scoring): each one
            said += [f"--{name} {short(before.get(name))} -> {short(now.get(name))}" for name in sorted(set(before) | set(now))
                     if before.get(name) != now.get(name)]
        else:
            said.append(f"--{key} {short(before)} -> {short(now)}")
    return said


# Schedules whose learning rate at a step does not depend on the run's length: a run stopped or ended at
# N steps, continued to more, trains exactly as the longer run would have (the data stream is drawn
# the same way whatever its length).
LENGTH_FREE_SCHEDULES = ("constant", "constant_with_warmup")


def continuation(saved, current):
    """A line when a checkpoint of saved may be continued by a run of current that differs only by a
    higher --max_train_steps under a schedule that does not depend on the length; else None."""
    if saved is None or current is None:
        return None
    others = {k for k in set(saved) | set(current) if saved.get(k) != current.get(k)}
    if others != {"max_train_steps"} or current.get("lr_scheduler") not in LENGTH_FREE_SCHEDULES:
        return None
    before, now = saved.get("max_train_steps"), current.get("max_train_steps")
    if before is None or now is None or now <= before:
        return None
    return (f"--max_train_steps {before} -> {now}: continuing that run (--lr_scheduler {current['lr_scheduler']} "
            f"does not depend on the run's length: the result is the {now}-step run's)")


def short(value, limit=60):
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_same(what, saved, current, remedy):
    """UserError naming what differs unless the identities are the same."""
    diff = differences(saved, current)
    if diff:
        raise errors.UserError(f"{what} is of another run: {'; '.join(diff)}; {remedy}")

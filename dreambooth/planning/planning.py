"""The plan of a training run: every setting of train.py, decided once on the driver.

`parse_args` reads the command line and checks flag combinations; `plan_run` checks the inputs against the
files and the Ray cluster and returns one frozen `Plan` (plan.py). The driver prints it, builds the data stream from
it and hands it to every worker (worker.train_fn); nothing is added to it afterwards."""

import argparse
import dataclasses
import importlib.util
import os
import sys
from datetime import datetime

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import storage
from dreambooth.config import flags
from dreambooth.families.shared import objectives
from dreambooth.models import outputs
from dreambooth.planning import checkpoints
from dreambooth.planning import inputs
from dreambooth.planning import model_flags
from dreambooth.planning import plan
from dreambooth.planning import resources
from dreambooth.planning import run_identity
from dreambooth.planning import vae_cache

TRAIN_FLAGS = [
    "model_dir", "output_dir", "instance_data_dir", "instance_prompt", "caption_extension", "holdout",
    "class_data_dir", "class_prompt", "with_prior_preservation", "prior_preservation", "prior_loss_weight",
    "resolution", "center_crop", "random_flip", "enable_bucket", "min_bucket_reso", "max_bucket_reso",
    "bucket_reso_steps", "train_text_encoder", "use_lora", "adapter", "use_dora", "lora_rank", "lora_alpha", "lora_dropout",
    "train_batch_size", "learning_rate", "scale_lr", "lr_scheduler", "lr_warmup_steps", "lr_num_cycles", "lr_power",
    "offset_noise", "snr_gamma", "base_precision", "text_encoder_precision", "weighting_scheme", "flow_shift", "logit_mean", "logit_std", "mode_scale",
    "precondition_outputs", "guidance_scale", "caption_dropout_rate", "masked_loss", "use_ema", "ema_decay",
    "ema_update_after_step", "optimizer", "use_8bit_adam", "prodigy_beta3", "prodigy_decouple",
    "prodigy_use_bias_correction", "prodigy_safeguard_warmup", "adam_beta1", "adam_beta2", "adam_weight_decay", "adam_epsilon",
    "max_grad_norm", "max_train_steps", "num_train_epochs", "mixed_precision", "seed", "num_workers", "min_workers",
    "elastic_resize_interval", "resources_per_worker",
    "gpus_per_worker", "use_gpu", "storage_path", "logging_steps", "report_to", "tracker_project_name", "notify_url",
    "validation_prompt", "num_validation_images", "validation_steps", "validation_epochs",
    "validation_inference_steps", "score_steps", "keep_best", "clip_t_margin", "eval_models_dir", "class_name", "unique_token", "subject_type",
    "eval_prompts", "eval_images_per_prompt", "vae_dir", "checkpointing_steps", "checkpoints_total_limit", "checkpoint_upload",
    "keep_checkpoints", "resume_from_checkpoint", "max_failures", "max_preemption_failures", "stall_timeout", "overwrite", "allow_unsafe_weights", "gradient_accumulation_steps",
    "gradient_checkpointing", "cache_latents", "precompute_text_embeddings", "channels_last", "fused_adamw",
    "torch_compile", "fsdp", "allow_tf32", "num_class_images", "set_grads_to_none",
    "enable_xformers_memory_efficient_attention"]


def train_parser(description=None):  # (train.py's output, photos and class images may be a bucket's)
    return flags.make_parser(description, TRAIN_FLAGS, refused=flags.REFUSED, config=True, types=dict.fromkeys(
        ("output_dir", "instance_data_dir", "class_data_dir", "eval_models_dir"), flags.storage_location),
                             optional=("eval_models_dir", "class_name"))


class FlagError(ValueError):
    """A combination of train.py's flags that it refuses (parse_args says it as argparse's line)."""


def parse_args(argv=None, description=None):
    """train.py's command line, with its flag combinations checked before anything starts."""
    parser, given = parse_given(argv, description)
    try:
        return derive(given, parser)
    except FlagError as err:
        parser.error(str(err))


def parse_given(argv=None, description=None):
    """(parser, the flags as given): model names made folders, nothing worked out yet; parser.given
    names the flags the user set."""
    parser = train_parser(description)
    return parser, model_flags.resolve_models(parser.parse_args(argv))


def derive(given, parser):
    """A new namespace: given (the flags set by the user, or by the sweep for a trial: parser.given names them,
    parser.typed those typed rather than read from a config file) and every value worked out from them, in
    this one order; FlagError for a combination train.py refuses. given itself is left as it is."""
    args = argparse.Namespace(**vars(given))
    args.prior_prediction = args.prior_preservation == "prior_prediction"
    if args.prior_prediction:
        if args.class_data_dir or args.num_class_images or args.with_prior_preservation:
            raise FlagError("--prior_preservation prior_prediction trains without class images: leave out "
                         "--class_data_dir, --num_class_images and --with_prior_preservation")
        if not args.class_prompt:
            raise FlagError("--prior_preservation prior_prediction needs --class_prompt (e.g. 'photo of a dog')")
    elif args.class_data_dir:
        args.with_prior_preservation = True
    if args.with_prior_preservation:
        if not args.class_data_dir:
            raise FlagError("--with_prior_preservation needs --class_data_dir")
        if not args.class_prompt:
            raise FlagError("--class_data_dir/--with_prior_preservation needs --class_prompt")
    elif args.num_class_images:
        raise FlagError("--num_class_images needs --class_data_dir and --class_prompt")
    elif args.class_prompt and not args.prior_prediction:
        print("warning: --class_prompt is ignored without --class_data_dir", file=sys.stderr)
    args.validation_prompts = tuple(dict.fromkeys(args.validation_prompt or ()))
    derive_adapter(args)
    check_lora_flags(args, parser.typed)
    derive_optimizer(args, parser)
    check_fsdp(args, parser.given)
    check_elastic(args, parser.typed)
    if not args.use_ema and parser.typed & {"ema_decay", "ema_update_after_step"}:
        raise FlagError("--ema_decay/--ema_update_after_step shape the moving average of the weights: add --use_ema")
    if args.validation_epochs and args.validation_steps:
        raise FlagError("give --validation_steps or --validation_epochs, not both")
    if args.validation_steps is None and not args.validation_epochs:
        args.validation_steps = args.checkpointing_steps
    check_scoring(args, parser.typed)
    check_in_process(args)
    if args.learning_rate is None:  # (Prodigy's is a multiplier of the step size it finds: 1.0)
        args.learning_rate = 1.0 if args.optimizer == "prodigy" else 1e-4 if args.use_lora else 5e-6
    if args.lora_alpha is None:
        args.lora_alpha = float(args.lora_rank)
    if args.lora_dropout >= 1:
        raise FlagError(f"argument --lora_dropout: must be < 1, got {args.lora_dropout:g}")
    if args.resume_from_checkpoint not in (None, "latest", "auto"):
        args.resume_from_checkpoint = flags.storage_location(args.resume_from_checkpoint)
    if args.output_dir == args.model_dir:
        raise FlagError("--output_dir must differ from --pretrained_model_name_or_path")
    if args.storage_path is None:
        args.storage_path = os.path.join(os.path.dirname(args.output_dir), "ray_results")
    args.settings_toml = flags.config_text(parser, args)
    return args


def derive_adapter(args):
    """--adapter (with --use_dora as its dora) implies --use_lora; args.adapter is "lora" for --use_lora alone and None
    without adapters."""
    if args.use_dora:
        if args.adapter not in (None, "dora"):
            raise FlagError(f"--use_dora is --adapter dora: give one of them, not --adapter {args.adapter} too")
        args.adapter = "dora"
    args.use_lora = args.use_lora or args.adapter is not None
    args.adapter = (args.adapter or "lora") if args.use_lora else None


# The package each optimizer of --optimizer comes from (torch's own AdamW needs none)
OPTIMIZER_PACKAGES = {"adamw8bit": "bitsandbytes", "prodigy": "prodigyopt", "adamw_schedulefree": "schedulefree"}


def derive_optimizer(args, parser):
    """--optimizer with --use_8bit_adam as its adamw8bit (args.use_8bit_adam then says which it is), its package
    there, its own flags only with it; schedule-free AdamW without a schedule (it warms up itself)."""
    if args.use_8bit_adam:
        if "optimizer" in parser.given and args.optimizer != "adamw8bit":
            raise FlagError(f"--use_8bit_adam is --optimizer adamw8bit: give one of them, not --optimizer "
                            f"{args.optimizer} too")
        args.optimizer = "adamw8bit"
    args.use_8bit_adam = args.optimizer == "adamw8bit"
    package = OPTIMIZER_PACKAGES.get(args.optimizer)
    if package and importlib.util.find_spec(package) is None:
        raise FlagError(f"--optimizer {args.optimizer} needs {package}, which is not installed here: "
                        f"pip install {package}")
    prodigy = {"prodigy_beta3", "prodigy_decouple", "prodigy_use_bias_correction", "prodigy_safeguard_warmup"}
    if args.optimizer != "prodigy" and parser.typed & prodigy:
        raise FlagError(f"{', '.join('--' + f for f in sorted(parser.typed & prodigy))} shape Prodigy: "
                        "add --optimizer prodigy")
    if args.optimizer in ("prodigy", "adamw_schedulefree"):
        if args.fused_adamw and "fused_adamw" in parser.typed:
            raise FlagError(f"--fused_adamw is torch's AdamW kernel: --optimizer {args.optimizer} has none")
        args.fused_adamw = False
    if args.optimizer == "adamw_schedulefree":
        if "lr_scheduler" in parser.given and args.lr_scheduler != "constant":
            raise FlagError(f"--optimizer adamw_schedulefree replaces the schedule (it warms up over "
                            f"--lr_warmup_steps itself): leave out --lr_scheduler {args.lr_scheduler}")
        args.lr_scheduler = "constant"


def check_elastic(args, typed):
    """FlagError for --min_workers above --num_workers, or --elastic_resize_interval without --min_workers."""
    if "elastic_resize_interval" in typed and not args.min_workers:
        raise FlagError("--elastic_resize_interval says how often an elastic run looks for nodes: add --min_workers")
    if args.min_workers and args.num_workers and args.min_workers > args.num_workers:
        raise FlagError(f"--min_workers {args.min_workers} is more than --num_workers {args.num_workers}")


def check_in_process(args):
    """FlagError for what --num_workers 0 (train_fn in this process: Ray Train's local mode) cannot do, each named."""
    if args.num_workers != 0:
        return
    clash = [flag for flag, on in (("--min_workers", args.min_workers), ("--fsdp", args.fsdp),
                                   ("--score_steps (scored by Ray Train's validation tasks)", args.score_steps),
                                   ("--checkpoint_upload async", args.checkpoint_upload == "async")) if on]
    if clash:
        raise FlagError(f"--num_workers 0 trains in this process, without Ray Train's workers: leave out "
                        f"{', '.join(clash)}")


def check_fsdp(args, given):
    """FlagError for what --fsdp does not shard or was not tested with, each named; the text encoders, trained by
    default, are frozen under it unless --train_text_encoder is in given (the flags the user set)."""
    if not args.fsdp:
        return
    if "train_text_encoder" not in given:
        args.train_text_encoder = False
    clash = [flag for flag, on in (("--use_lora", args.use_lora), ("--train_text_encoder", args.train_text_encoder),
                                   ("--use_ema", args.use_ema), ("--torch_compile", args.torch_compile),
                                   (f"--optimizer {args.optimizer}", args.optimizer != "adamw"),
                                   ("--mixed_precision fp16", args.mixed_precision == "fp16"),
                                   ("--min_workers (each shard is sized for --num_workers)", args.min_workers)) if on]
    if clash:
        raise FlagError(f"--fsdp shards a full fine-tune of the denoiser alone, in bf16 or fp32: leave out "
                        f"{', '.join(clash)}")


def flags_of(record, args):
    """The record (a dataclass of flag names: inputs.InputFlags, resources.StepFlags, ...) of parsed flags: what
    planning hands the modules below it, which never read the command line themselves."""
    return record(**{field.name: getattr(args, field.name) for field in dataclasses.fields(record)})


def checked_files(args, draw_class_images):
    """(the model's family, args with the VAE and a bucket's photos and class images as this node's folders: a copy,
    the caller's flags stay as given): the model, the output and the storage checked first."""
    families.check_model_dir(args.model_dir, args.allow_unsafe_weights)
    family = families.require(args.model_dir, "train")
    objectives.check_flags(family, args.snr_gamma, args.precondition_outputs, args.weighting_scheme, args.flow_shift)
    if args.text_encoder_precision and family.trains_text_encoder(args.train_text_encoder) and \
            set(family.text_encoders) <= set(family.trainable_text_encoders):
        raise errors.UserError(f"--text_encoder_precision {args.text_encoder_precision} quantises the frozen text "
                               f"encoders; this run trains every one of {family.label}'s: add --no-train_text_encoder")
    if args.vae_dir:
        args = argparse.Namespace(**{**vars(args), "vae_dir": vae_cache.resolve_vae(args.vae_dir,
                                                                                   args.allow_unsafe_weights)})
        vae_class = files.read_json(os.path.join(args.vae_dir, "config.json")).get("_class_name")
        if vae_class != family.vae_class().__name__:
            raise errors.UserError(f"--pretrained_vae_model_name_or_path {args.vae_dir} is an {vae_class}; "
                                   f"{family.label}'s VAE is an {family.vae_class().__name__}: leave the flag out "
                                   "(the model's own VAE) or give one made for this model")
    files.check_output_path(args.output_dir, "--output_dir", [
        ("--pretrained_model_name_or_path", args.model_dir), ("--instance_data_dir", args.instance_data_dir),
        ("--class_data_dir", args.class_data_dir)])
    outputs.check_output_dir(args.output_dir, args.overwrite)
    storage.check_reachable(args.storage_path, "--storage_path")  # (a bucket's, before anything is drawn)
    fetched = inputs.fetch_from_buckets(flags_of(inputs.InputFlags, args), draw_class_images)
    return family, argparse.Namespace(**{**vars(args), **fetched}) if fetched else args


def plan_run(args, cluster_resources, draw_class_images=None):
    """The plan.Plan of a run of derived flags args (left as they are), or UserError naming the first problem.

    cluster_resources() -> (CPUs, GPUs[, each node's CPUs]) of the Ray cluster; it is called after the checks that need
    only the files, so that a typo or a bad photo costs no Ray start. draw_class_images(): tops up the class folder
    (--num_class_images, on Ray), after the photos are checked."""
    family, args = checked_files(args, draw_class_images)
    # (a family whose text encoders are all frozen, Qwen-Image's, trains none of them whatever the flag says: the
    # flag changes neither the plan nor the run's identity)
    args = argparse.Namespace(**{**vars(args), "train_text_encoder": family.trains_text_encoder(args.train_text_encoder)})
    found = inputs.read_inputs(flags_of(inputs.InputFlags, args), family, draw_class_images)
    identity = run_identity.of_run({name: getattr(args, name) for name in run_identity.FLAGS}, family, found.photos,
                                   found.masks, found.held_out, found.captions, found.class_files, found.resolution,
                                   found.buckets)
    if args.resume_from_checkpoint == "auto":
        keep_finished(args.output_dir, identity)
    elif args.resume_from_checkpoint is None:  # (a fresh start: a resumed run goes on, it does not train again)
        say_replaced(args.output_dir, identity)
    resume_path = checkpoints.resolve_resume(args.resume_from_checkpoint, args.storage_path,
                                             os.path.basename(args.output_dir), args.output_dir, identity)
    in_process = args.num_workers == 0  # (as one worker: the LR scaling and the steps count one)
    args = argparse.Namespace(**{**vars(args), "num_workers": 1 if in_process else args.num_workers})
    cpus, gpus, nodes, *_ = (*cluster_resources(), ())
    use_gpu, num_workers, cpus_per_worker = resources.worker_resources(flags_of(resources.WorkerFlags, args), cpus, gpus,
                                                                       nodes)
    args = argparse.Namespace(**{**vars(args), "num_workers": num_workers})  # (the LR scaling counts them)
    step_flags = flags_of(resources.StepFlags, args)
    steps_per_epoch, total_steps = resources.plan_steps(found.num_rows, step_flags)
    from_flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(plan.Plan) if hasattr(args, f.name)}
    return plan.Plan(**{
        **from_flags,
        "family": family,
        "instance_prompts": found.instance_prompts,
        "image_prompt": tuple(found.instance_prompts.index(c) for c in found.captions),
        "learning_rate": scaled_learning_rate(args),
        "instance_images": found.instance_images,
        "instance_masks": found.masks,
        "input_stamps": found.stamps,
        "held_out": found.held_out,
        "class_images": found.class_images,
        "resolution": found.resolution,
        "buckets": found.buckets,
        "channels_last": use_gpu if args.channels_last is None else args.channels_last,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
        "validation_steps": (args.validation_epochs * steps_per_epoch if args.validation_epochs
                             else args.validation_steps),
        "stream_epochs": resources.stream_epochs(found.num_rows, total_steps, step_flags),
        "use_gpu": use_gpu,
        "in_process": in_process,
        "cpus_per_worker": cpus_per_worker,
        "run_name": f"{os.path.basename(args.output_dir)}-{datetime.now().strftime('%Y%m%d-%H%M%S')}",
        "identity": identity,
        "resume_path": resume_path,
        # Redrawn by the driver at every update, a bar fills a log file with copies of itself;
        # there, the line printed every --logging_steps is the progress.
        "progress_bar": errors.on_terminal(),
    })


SCORING_FLAGS = ("eval_models_dir", "class_name", "unique_token", "subject_type", "eval_prompts", "eval_images_per_prompt",
                 "keep_best", "clip_t_margin")


def check_lora_flags(args, typed):
    """The flags that shape LoRA's adapters or quantise the frozen model under them need --use_lora (and its
    quantised base, an adapter peft quantises under)."""
    if not args.use_lora and typed & {"lora_rank", "lora_alpha", "lora_dropout"}:
        raise FlagError("--rank/--lora_alpha/--lora_dropout shape LoRA adapters: add --use_lora (diffusers' "
                        "train_dreambooth_lora*.py scripts always train LoRA; without it every weight is trained)")
    if args.base_precision and args.adapter in ("loha", "lokr"):
        raise FlagError(f"--base_precision {args.base_precision} quantises the frozen model under LoRA or DoRA "
                        f"adapters; peft's --adapter {args.adapter} has no quantised layers: leave one out")
    if args.base_precision and not args.use_lora:
        raise FlagError(f"--base_precision {args.base_precision} quantises the frozen model under LoRA's adapters: "
                        "add --use_lora (a full fine-tune trains every weight in fp32)")
    if args.text_encoder_precision and not args.use_lora:
        raise FlagError(f"--text_encoder_precision {args.text_encoder_precision} quantises the frozen text encoders "
                        "of a LoRA run: add --use_lora (a full fine-tune saves them whole)")


def check_scoring(args, typed):
    """--score_steps needs the scoring models and the subject's class, and the instance prompt must name the
    subject as the evaluation prompts will ('<token> <class>'); the scoring flags without it score nothing."""
    if not args.score_steps:
        if typed & set(SCORING_FLAGS):
            raise FlagError(f"--{' --'.join(sorted(typed & set(SCORING_FLAGS)))}: these say how checkpoints are scored "
                            "while training: add --score_steps N")
        return
    missing = [f"--{name}" for name in ("eval_models_dir", "class_name") if not getattr(args, name)]
    if missing:
        fetch = " (cache_model.py --eval_models fetches the models)" if not args.eval_models_dir else ""
        raise FlagError(f"--score_steps scores each checkpoint against your photos with the scoring models: add "
                        f"{' and '.join(missing)}{fetch}")
    subject = f"{args.unique_token} {args.class_name}"
    if subject not in args.instance_prompt:
        raise FlagError(f"--score_steps: the instance prompt {args.instance_prompt!r} does not name the subject as "
                        f"the evaluation prompts will, {subject!r}: give --unique_token and --class_name as in it")


def offline_plan(**fields):
    """A plan.Plan from train.py's flag defaults without files or Ray, for the benchmark and the
    unit tests: fields override any setting; the decided ones default to a 1-worker CPU run."""
    args = parse_args(["--model_dir", "/unused", "--output_dir", "/unused-out",
                       "--instance_data_dir", "/unused", "--instance_prompt", "unused"])
    from_flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(plan.Plan) if hasattr(args, f.name)}
    decided = dict(instance_prompts=(args.instance_prompt,), image_prompt=(), instance_images=(), instance_masks=(),
                   held_out=(), class_images=(), resolution=64, buckets=(), channels_last=False, steps_per_epoch=1,
                   total_steps=resources.DEFAULT_MAX_TRAIN_STEPS, stream_epochs=1, use_gpu=False, cpus_per_worker=1.0,
                   num_workers=1, in_process=False, run_name="offline", resume_path=None, progress_bar=False,
                   settings_toml="", identity=None, input_stamps=())
    if "family" not in fields:  # the model's own when it is there, else SD 1.x's
        model_dir = fields.get("model_dir", args.model_dir)
        has_model = os.path.isfile(os.path.join(model_dir, "model_index.json"))
        fields = dict(fields, family=families.family_of(model_dir) if has_model else families.DEFAULT)
    fields = {"train_text_encoder": fields["family"].trains_text_encoder(from_flags["train_text_encoder"]), **fields}
    return plan.Plan(**{**from_flags, **decided, **fields})


def scaled_learning_rate(args):
    """--learning_rate, or with --scale_lr, times the instance images of one optimizer step
    over all workers (diffusers' rule: the rate was tuned for one image a step)."""
    if not args.scale_lr:
        return args.learning_rate
    return args.learning_rate * args.train_batch_size * args.gradient_accumulation_steps * args.num_workers


class AlreadyTrained(Exception):
    """--resume_from_checkpoint auto found the run finished: output_dir holds its model (the message says so)."""


def say_replaced(output_dir, identity):
    """The line that says a model already in output_dir is trained again and replaced at the end of this run (train.py
    without --resume_from_checkpoint auto: it was replaced without a word)."""
    output = outputs.read_output(output_dir)
    if output is None:
        return
    differs = run_identity.differences(output.record.identity, identity)
    what = f"the model of another run ({'; '.join(differs)})" if differs else "the finished model of this run"
    print(f"{output_dir} holds {what}: this run trains again and replaces it when it ends "
          f"(--resume_from_checkpoint auto keeps a finished model of the same run)", file=sys.stderr)


def keep_finished(output_dir, identity):
    """AlreadyTrained when output_dir holds the model of a finished run of this identity (nothing is
    redone); a model of another run is replaced, with a line naming what differs."""
    output = outputs.read_output(output_dir)
    if output is None:
        return
    differs = run_identity.differences(output.record.identity, identity)
    if not differs:
        raise AlreadyTrained(f"{output_dir} holds the finished model of this run (same settings and files): "
                             f"keeping it (to train it again: RETRAIN=1 with dreambooth_run.sh; train.py without "
                             f"--resume_from_checkpoint auto)")
    print(f"{output_dir} holds the model of another run ({'; '.join(differs)}): training this one replaces it",
          file=sys.stderr)

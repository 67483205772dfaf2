"""Step 4: DreamBooth fine-tuning of UNet + text encoder on Ray Train workers.

    python train.py --model_dir=$ORIG_MODEL_PATH --output_dir=$TUNED_MODEL_DIR \\
        --instance_images_dir=$IMAGES_OWN_DIR --instance_prompt="photo of unqtkn dog" \\
        --class_images_dir=$IMAGES_REG_DIR --class_prompt="photo of a dog" \\
        --train_batch_size=2 --lr=5e-6 --max_train_steps=200 --num_workers=2

The math (target, loss, one optimizer step) is in plain functions at the top; `train_fn`
wires them to Ray Train, `main` to the command line. fp32 master weights with autocast
(bf16 by default on GPU): 5e-6 AdamW updates vanish when the weights themselves are bf16.
"""

import json
import math
import os
import sys
import tempfile
import time
from datetime import datetime

import flags
import utils

CHECKPOINT_STATE = "train_state.json"
CHECKPOINT_FILES = ("unet.safetensors", "text_encoder.safetensors", "optimizer.pt")
METRICS_FILE = "metrics.jsonl"  # in the run's folder under --storage_path


# ---------------------------------------------------------------- the math


def diffusion_target(scheduler, latents, noise, timesteps):
    """What the UNet learns to predict, by the scheduler's prediction_type. All (B, 4, h, w)."""
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unsupported prediction_type {kind!r}")


def dreambooth_loss(pred, target, num_instance, prior_loss_weight):
    """MSE on the instance half plus prior_loss_weight x MSE on the class half.

    pred, target: (B, C, h, w), instance rows first, then class rows (B = num_instance
    without prior preservation). Returns (total, instance_loss, prior_loss or None).
    """
    import torch.nn.functional as F

    pred, target = pred.float(), target.float()
    instance_loss = F.mse_loss(pred[:num_instance], target[:num_instance])
    if pred.shape[0] == num_instance:
        return instance_loss, instance_loss, None
    prior_loss = F.mse_loss(pred[num_instance:], target[num_instance:])
    return instance_loss + prior_loss_weight * prior_loss, instance_loss, prior_loss


def encode_latents(vae, pixels):
    """(B, 3, H, W) in [-1, 1] -> (B, 4, H/f, W/f) scaled latents, f from the VAE config."""
    import torch

    with torch.no_grad():
        latents = vae.encode(pixels.to(vae.dtype)).latent_dist.sample()
    return latents * vae.config.scaling_factor


def lr_factor(step, warmup_steps):
    """Linear warm-up over warmup_steps, then constant."""
    return min(1.0, (step + 1) / (warmup_steps + 1)) if warmup_steps else 1.0


def batch_latents(vae, batch):
    """Scaled latents (B, 4, h, w) of a batch, instance rows first, then class rows.

    From pixels ("instance_pixels"/"class_pixels": (B, 3, R, R)) through the VAE, or from
    cached VAE posteriors ("instance_latents"/"class_latents": (B, 8, h, w), mean and
    log-variance) with a fresh sample each step, as encoding every step would draw.
    """
    import torch
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    kind = "latents" if "instance_latents" in batch else "pixels"
    parts = [batch[f"instance_{kind}"]] + ([batch[f"class_{kind}"]] if f"class_{kind}" in batch else [])
    stacked = torch.cat(parts)
    if kind == "pixels":
        return encode_latents(vae, stacked)
    return DiagonalGaussianDistribution(stacked.float()).sample() * vae.config.scaling_factor


def prompt_conditioning(text_encoder, prompts, num_instance, num_class):
    """(num_instance + num_class, L, D) text-encoder states for a batch.

    prompts: {"instance": (1, L) ids, "class": (1, L) ids} run through the text encoder, or
    {"instance": (1, L, D), "class": (1, L, D)} states computed once (frozen text encoder).
    """
    import torch

    def states(key, count):
        value = prompts[key]
        if value.dim() == 2:
            return text_encoder(value.expand(count, -1))[0]
        return value.expand(count, -1, -1)

    if not num_class:
        return states("instance", num_instance)
    if prompts["instance"].dim() == 2:  # one text-encoder call for both prompts
        ids = torch.cat([prompts["instance"].expand(num_instance, -1), prompts["class"].expand(num_class, -1)])
        return text_encoder(ids)[0]
    return torch.cat([states("instance", num_instance), states("class", num_class)])


def batch_loss(models, batch, prompts, prior_loss_weight):
    """Forward pass for one batch (see batch_latents and prompt_conditioning for the inputs).

    Returns dreambooth_loss's tuple (total, instance_loss, prior_loss or None).
    """
    import torch

    unet, scheduler = models["unet"], models["scheduler"]
    latents = batch_latents(models["vae"], batch)
    num_instance = next(v for k, v in batch.items() if k.startswith("instance_")).shape[0]
    hidden = prompt_conditioning(models["text_encoder"], prompts, num_instance, latents.shape[0] - num_instance)
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    pred = unet(noisy, timesteps, hidden).sample
    return dreambooth_loss(pred, diffusion_target(scheduler, latents, noise, timesteps),
                           num_instance, prior_loss_weight)


def train_step(state, micro_batches, prompts, config):
    """One optimizer step over gradient-accumulation micro-batches: autocast forward,
    backward, clip, AdamW, LR schedule. DDP all-reduces only on the last micro-batch.

    Returns (loss, instance_loss, prior_loss) averaged over micro-batches, as floats
    (the .item() is a device sync point).
    """
    import contextlib

    import torch

    device_type = state["device"].type
    count = len(micro_batches)
    totals = []
    for k, batch in enumerate(micro_batches):
        last = k == count - 1
        sync = contextlib.ExitStack()
        if not last:
            for model in state["ddp_models"]:
                sync.enter_context(model.no_sync())
        with sync:
            with torch.autocast(device_type, dtype=state["amp_dtype"], enabled=state["amp_dtype"] is not None):
                losses = batch_loss(state["models"], batch, prompts, config["prior_loss_weight"])
            state["scaler"].scale(losses[0] / count).backward()
        totals.append(losses)
    scaler = state["scaler"]
    scaler.unscale_(state["optimizer"])
    torch.nn.utils.clip_grad_norm_(state["params"], config["max_grad_norm"])
    scaler.step(state["optimizer"])
    scaler.update()
    state["optimizer"].zero_grad(set_to_none=True)
    state["lr_scheduler"].step()

    def mean(i):
        values = [t[i].item() for t in totals if t[i] is not None]
        return sum(values) / len(values) if values else None

    return mean(0), mean(1), mean(2)


# ---------------------------------------------------------------- models and state


def amp_dtype(mixed_precision):
    import torch

    return {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]


def load_models(model_dir, device, train_text_encoder, allow_unsafe_weights=False):
    """UNet and text encoder in fp32 (trainable), frozen VAE; safetensors only unless allowed."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    utils.quiet_hf_logging()
    safe = utils.safetensors_only(allow_unsafe_weights)
    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet", use_safetensors=safe)
    text_encoder = CLIPTextModel.from_pretrained(model_dir, subfolder="text_encoder", use_safetensors=safe)
    vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae", use_safetensors=safe)
    scheduler = DDPMScheduler.from_pretrained(model_dir, subfolder="scheduler")
    vae.requires_grad_(False).eval()
    text_encoder.requires_grad_(train_text_encoder)
    if not train_text_encoder:
        text_encoder.eval()
    return {"unet": unet.to(device), "text_encoder": text_encoder.to(device), "vae": vae.to(device),
            "scheduler": scheduler}


def make_train_state(models, config, device):
    """Optimizer, LR schedule and grad scaler over the trainable parameters."""
    import torch

    params = list(models["unet"].parameters())
    if config["train_text_encoder"]:
        params += list(models["text_encoder"].parameters())
    optimizer = torch.optim.AdamW(
        params, lr=config["learning_rate"], betas=(config["adam_beta1"], config["adam_beta2"]),
        weight_decay=config["adam_weight_decay"], eps=config["adam_epsilon"],
        fused=device.type == "cuda",
    )
    warmup = config["lr_warmup_steps"]
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup))
    dtype = amp_dtype(config["mixed_precision"])
    # Loss scaling only matters for fp16's narrow exponent range.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ddp_models = [m for m in (models["unet"], models["text_encoder"]) if hasattr(m, "no_sync")]
    return {"models": models, "params": params, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
            "scaler": scaler, "amp_dtype": dtype, "device": device, "step": 0, "ddp_models": ddp_models}


def unwrap(model):
    """The plain module under torch.compile's and DDP's wrappers (DDP only wraps with >1 worker)."""
    while hasattr(model, "_orig_mod") or hasattr(model, "module"):
        model = getattr(model, "_orig_mod", None) or model.module
    return model


def save_checkpoint(state, folder, epoch):
    """Full training state into folder: weights (safetensors), optimizer, schedule, RNG, position."""
    import torch
    from safetensors.torch import save_file

    models = state["models"]
    save_file(unwrap(models["unet"]).state_dict(), os.path.join(folder, "unet.safetensors"))
    save_file(unwrap(models["text_encoder"]).state_dict(), os.path.join(folder, "text_encoder.safetensors"))
    torch.save({"optimizer": state["optimizer"].state_dict(), "lr_scheduler": state["lr_scheduler"].state_dict(),
                "scaler": state["scaler"].state_dict(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
               os.path.join(folder, "optimizer.pt"))
    # Written last, with the size of every other file: a checkpoint copied or written
    # only in part is recognised as incomplete and never resumed from.
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in CHECKPOINT_FILES}
    utils.write_json(os.path.join(folder, CHECKPOINT_STATE), {"step": state["step"], "epoch": epoch, "sizes": sizes})


def load_checkpoint(state, folder):
    """Restore what save_checkpoint wrote; returns the saved epoch."""
    import torch
    from safetensors.torch import load_file

    models = state["models"]
    unwrap(models["unet"]).load_state_dict(load_file(os.path.join(folder, "unet.safetensors")))
    unwrap(models["text_encoder"]).load_state_dict(load_file(os.path.join(folder, "text_encoder.safetensors")))
    # weights_only: a checkpoint cannot execute code when it is loaded.
    extra = torch.load(os.path.join(folder, "optimizer.pt"), map_location=state["device"], weights_only=True)
    state["optimizer"].load_state_dict(extra["optimizer"])
    state["lr_scheduler"].load_state_dict(extra["lr_scheduler"])
    state["scaler"].load_state_dict(extra["scaler"])
    torch.set_rng_state(extra["torch_rng"].cpu())
    if extra.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["cuda_rng"].cpu())
    with open(os.path.join(folder, CHECKPOINT_STATE)) as f:
        info = json.load(f)
    state["step"] = info["step"]
    return info["epoch"]


def save_pipeline(models, model_dir, output_dir, config):
    """Write the fine-tuned pipeline (safetensors) to output_dir, whole or not at all."""
    from diffusers import StableDiffusionPipeline

    utils.quiet_hf_logging()
    pipe = StableDiffusionPipeline.from_pretrained(
        model_dir, unet=unwrap(models["unet"]), text_encoder=unwrap(models["text_encoder"]),
        use_safetensors=utils.safetensors_only(config["allow_unsafe_weights"]))

    def write(tmp):
        pipe.save_pretrained(tmp, safe_serialization=True)
        utils.write_json(os.path.join(tmp, utils.OUTPUT_MARKER), {
            "base_model": model_dir, "steps": config["total_steps"],
            "instance_prompt": config["instance_prompt"], "class_prompt": config["class_prompt"]})

    utils.atomic_write_dir(output_dir, write)


# ---------------------------------------------------------------- Ray Train worker


def is_checkpoint_step(step, config):
    """Checkpoints every checkpointing_steps and at the last step."""
    return step % config["checkpointing_steps"] == 0 or step == config["total_steps"]


def should_report(step, config):
    """Every rank reports on the same steps: Ray Train requires matching report calls."""
    return step % config["logging_steps"] == 0 or is_checkpoint_step(step, config)


def train_fn(config):
    """Per-worker loop. Reads only `config`; data comes from the "train" dataset shard."""
    import ray.train
    import ray.train.torch
    import torch
    from ray.experimental import tqdm_ray

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        # Ray sets OMP_NUM_THREADS to the worker's CPU reservation (a fraction -> 1 thread);
        # CPU workers on a node share its cores instead.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.get_local_world_size()))
    torch.manual_seed(config["seed"] + rank)
    models = setup_models(config, device, ray.train.torch.prepare_model)
    state = make_train_state(models, config, device)
    # Ray's own checkpoint (a restarted worker group) wins over the one the run started from.
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            load_checkpoint(state, folder)
    elif config.get("resume_path"):
        load_checkpoint(state, config["resume_path"])
    prompts = prompt_inputs(models["text_encoder"], config, device)
    shard = ray.train.get_dataset_shard("train")
    total, per_epoch, accum = config["total_steps"], config["steps_per_epoch"], config["gradient_accumulation_steps"]
    bar = tqdm_ray.tqdm(total=total, desc="training") if rank == 0 else None
    if bar and state["step"]:
        bar.update(state["step"])
    window_loss, window_images, window_start = [], 0, time.perf_counter()
    while state["step"] < total:
        # Resuming mid-epoch finishes that epoch's remaining steps, so a resumed run
        # takes exactly as many optimizer steps as an uninterrupted one.
        epoch = state["step"] // per_epoch
        steps_left = min(per_epoch - state["step"] % per_epoch, total - state["step"])
        batches = shard.iter_torch_batches(batch_size=config["train_batch_size"], device=device)
        for micro_batches in accumulate(batches, accum, steps_left):
            loss, _, _ = train_step(state, micro_batches, prompts, config)
            state["step"] += 1
            window_loss.append(loss)
            window_images += sum(v.shape[0] for b in micro_batches for v in b.values())
            if bar:
                bar.update(1)
            if should_report(state["step"], config):
                elapsed = time.perf_counter() - window_start
                metrics = {"step": state["step"], "epoch": epoch, "loss": sum(window_loss) / len(window_loss),
                           "lr": state["lr_scheduler"].get_last_lr()[0],
                           "images_per_s": window_images * world / max(elapsed, 1e-9)}
                if rank == 0:
                    append_metrics(config, metrics)
                report(state, metrics, rank, config)
                if rank == 0:
                    print(" ".join(f"{name}={v:.4g}" if isinstance(v, float) else f"{name}={v}"
                                   for name, v in metrics.items()), flush=True)
                window_loss, window_images, window_start = [], 0, time.perf_counter()
    if bar:
        bar.close()
    if rank == 0:
        save_pipeline(state["models"], config["model_dir"], config["output_dir"], config)


def accumulate(batches, accum, max_steps):
    """Group an epoch's batches into lists of `accum` micro-batches, at most max_steps groups."""
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == accum:
            yield group
            group = []
            max_steps -= 1
            if max_steps == 0:
                return


def setup_models(config, device, prepare_model):
    """Load the models and apply the memory/speed options; prepare_model wraps for DDP."""
    import torch

    models = load_models(config["model_dir"], device, config["train_text_encoder"], config["allow_unsafe_weights"])
    if config["gradient_checkpointing"]:
        models["unet"].enable_gradient_checkpointing()
        if config["train_text_encoder"]:
            models["text_encoder"].gradient_checkpointing_enable()
    if device.type == "cuda":
        # NHWC convolutions run on tensor cores without layout transposes.
        models["unet"].to(memory_format=torch.channels_last)
    models["unet"] = prepare_model(models["unet"])
    if config["train_text_encoder"]:
        models["text_encoder"] = prepare_model(models["text_encoder"])
    if config["torch_compile"]:
        models["unet"] = torch.compile(models["unet"])
    return models


def prompt_inputs(text_encoder, config, device):
    """Token ids (1, L) per prompt, or, with a frozen text encoder, its states (1, L, D) computed once."""
    import torch

    ids = {k: torch.tensor(v, device=device).unsqueeze(0) for k, v in config["prompt_ids"].items()}
    if config["train_text_encoder"] or not config["precompute_text_embeddings"]:
        return ids
    with torch.no_grad():
        return {k: text_encoder(v)[0] for k, v in ids.items()}


def metrics_path(config):
    return os.path.join(config["storage_path"], config["run_name"], METRICS_FILE)


def append_metrics(config, metrics):
    """One JSON line per logging window (with the wall-clock time it ended) for loss curves."""
    path = metrics_path(config)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({**metrics, "time": time.time()}) + "\n")


def report(state, metrics, rank, config):
    """ray.train.report from every rank; rank 0 attaches a checkpoint on checkpointing steps."""
    import ray.train

    if rank != 0 or not is_checkpoint_step(state["step"], config):
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(state, folder, metrics["epoch"])
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


# ---------------------------------------------------------------- driver


def check_output_dir(output_dir, overwrite):
    """Refuse to replace a non-empty folder that is not a previous output of ours."""
    if not os.path.isdir(output_dir) or not os.listdir(output_dir) or overwrite:
        return
    if not os.path.isfile(os.path.join(output_dir, utils.OUTPUT_MARKER)):
        raise utils.UserError(f"--output_dir {output_dir} is not empty and was not written by train.py; "
                              "pass --overwrite to replace it")


def is_complete_checkpoint(folder):
    """True when folder holds every checkpoint file at the size recorded when it was saved."""
    try:
        with open(os.path.join(folder, CHECKPOINT_STATE)) as f:
            sizes = json.load(f)["sizes"]
        return all(os.path.getsize(os.path.join(folder, name)) == size for name, size in sizes.items())
    except (OSError, ValueError, KeyError):
        return False


def find_latest_checkpoint(storage_path, run_prefix):
    """Newest checkpoint folder of any run named '<run_prefix>-*' under storage_path, or None."""
    if not os.path.isdir(storage_path):
        return None
    found = []
    for run in os.listdir(storage_path):
        run_dir = os.path.join(storage_path, run)
        if not run.startswith(run_prefix + "-") or not os.path.isdir(run_dir):
            continue
        for name in os.listdir(run_dir):
            folder = os.path.join(run_dir, name)
            if name.startswith("checkpoint_") and is_complete_checkpoint(folder):
                found.append(folder)
    return max(found, key=lambda f: os.path.getmtime(os.path.join(f, CHECKPOINT_STATE)), default=None)


def worker_resources(args, cpus, gpus):
    """(use_gpu, CPUs per worker), or UserError if the cluster cannot hold the workers.

    At least one CPU stays free for Ray Data: with every CPU held by train workers the
    streaming dataset never starts and fit() waits forever.
    """
    use_gpu = gpus > 0 if args.use_gpu is None else args.use_gpu
    if use_gpu and args.num_workers > gpus:
        raise utils.UserError(f"--num_workers {args.num_workers} needs {args.num_workers} GPUs; "
                              f"the Ray cluster has {gpus}")
    if not use_gpu and args.num_workers > cpus:
        raise utils.UserError(f"--num_workers {args.num_workers} is more than the Ray cluster's {cpus:g} CPUs")
    spare = cpus - 1
    if spare <= 0:
        raise utils.UserError(f"the Ray cluster has {cpus:g} CPU(s): training needs one for its workers "
                              "and one for the data pipeline")
    return use_gpu, min(1.0, spare / args.num_workers)


def plan_steps(num_rows, args):
    """(steps_per_epoch, total_steps): rows split evenly over workers, into batches, into
    optimizer steps of gradient_accumulation_steps batches (a remainder is dropped)."""
    rows_per_worker = num_rows // args.num_workers
    if rows_per_worker == 0:
        raise utils.UserError(f"{num_rows} training rows cannot feed {args.num_workers} workers; "
                              "add images or lower --num_workers")
    per_epoch = math.ceil(rows_per_worker / args.train_batch_size) // args.gradient_accumulation_steps
    if per_epoch == 0:
        raise utils.UserError(f"an epoch has fewer batches per worker than --gradient_accumulation_steps "
                              f"{args.gradient_accumulation_steps}; lower it or --train_batch_size")
    return per_epoch, min(args.max_train_steps, per_epoch * args.num_train_epochs)


def lacks_identifier(instance_prompt, class_prompt):
    """True when the instance prompt adds no word to the class prompt (no 'unqtkn' to learn)."""
    return bool(class_prompt) and set(instance_prompt.lower().split()) <= set(class_prompt.lower().split())


def build_config(args):
    """Everything a worker needs, computed once on the driver (prompts tokenised here)."""
    from transformers import CLIPTokenizer

    import dataset

    tokenizer = CLIPTokenizer.from_pretrained(args.model_dir, subfolder="tokenizer")
    if lacks_identifier(args.instance_prompt, args.class_prompt):
        print("warning: --instance_prompt has no word that --class_prompt lacks: "
              "the subject has no unique identifier", file=sys.stderr)
    config = vars(args).copy()
    config["prompt_ids"] = {"instance": dataset.tokenize_prompt(tokenizer, args.instance_prompt).tolist()}
    if args.with_prior_preservation:
        config["prompt_ids"]["class"] = dataset.tokenize_prompt(tokenizer, args.class_prompt).tolist()
    if args.resolution is None:
        from diffusers import AutoencoderKL, UNet2DConditionModel

        unet_cfg = UNet2DConditionModel.load_config(args.model_dir, subfolder="unet")
        vae_cfg = AutoencoderKL.load_config(args.model_dir, subfolder="vae")
        config["resolution"] = unet_cfg["sample_size"] * 2 ** (len(vae_cfg["block_out_channels"]) - 1)
    if config["mixed_precision"] is None:
        config["mixed_precision"] = "bf16" if config["use_gpu"] else "no"
    return config


def main(argv=None):
    parser = flags.make_parser(__doc__.splitlines()[0], [
        "model_dir", "output_dir", "instance_data_dir", "instance_prompt", "class_data_dir", "class_prompt",
        "with_prior_preservation", "prior_loss_weight", "resolution", "center_crop", "random_flip",
        "train_text_encoder", "train_batch_size", "learning_rate", "lr_warmup_steps", "adam_beta1",
        "adam_beta2", "adam_weight_decay", "adam_epsilon", "max_grad_norm", "max_train_steps",
        "num_train_epochs", "mixed_precision", "seed", "num_workers", "use_gpu", "storage_path",
        "logging_steps", "checkpointing_steps", "checkpoints_total_limit", "resume_from_checkpoint",
        "max_failures", "overwrite", "allow_unsafe_weights", "gradient_accumulation_steps",
        "gradient_checkpointing", "cache_latents", "precompute_text_embeddings", "torch_compile"])
    args = flags.check_train_args(parser, parser.parse_args(argv))
    import dataset

    utils.check_model_dir(args.model_dir, args.allow_unsafe_weights)
    check_output_dir(args.output_dir, args.overwrite)
    instance_paths = dataset.list_images(args.instance_data_dir, "instance")
    class_paths = dataset.list_images(args.class_data_dir, "class") if args.with_prior_preservation else None
    run_prefix = os.path.basename(args.output_dir)
    resume_path = resolve_resume(args.resume_from_checkpoint, args.storage_path, run_prefix)

    ray = utils.init_ray()
    args.use_gpu, cpus_per_worker = worker_resources(args, utils.cluster_cpus(), utils.cluster_gpus())
    config = build_config(args)
    config["resume_path"] = resume_path
    convert_dir = os.path.join(args.storage_path, "converted-images")
    instance_paths = dataset.inspect_images(instance_paths, config["resolution"], convert_dir)
    if class_paths:
        class_paths = dataset.inspect_images(class_paths, config["resolution"], convert_dir)
    num_rows = max(len(instance_paths), len(class_paths or []))
    config["steps_per_epoch"], config["total_steps"] = plan_steps(num_rows, args)
    ray.data.DataContext.get_current().enable_progress_bars = False
    latent_cache = None
    if args.cache_latents:
        latent_cache = {"model_dir": args.model_dir, "num_gpus": utils.cluster_gpus(),
                        "allow_unsafe_weights": args.allow_unsafe_weights}
    train_ds = dataset.build_train_dataset(instance_paths, class_paths, config["resolution"],
                                           args.center_crop, args.random_flip, latent_cache)
    try:
        result = run_trainer(config, train_ds, cpus_per_worker, run_prefix)
    except KeyboardInterrupt:
        latest = find_latest_checkpoint(args.storage_path, run_prefix)
        where = f" (newest checkpoint: {latest})" if latest else " (no checkpoint was written yet)"
        print(f"stopped; rerun the same command with --resume_from_checkpoint latest to continue{where}",
              file=sys.stderr)
        raise
    print(f"trained {config['total_steps']} steps; final loss {result.metrics.get('loss', float('nan')):.4f}; "
          f"model saved to {args.output_dir}; checkpoints and {METRICS_FILE} in {result.path}", file=sys.stderr)
    return result


def resolve_resume(resume_flag, storage_path, run_prefix):
    """--resume_from_checkpoint latest|PATH -> a checkpoint folder, or None to start fresh."""
    if resume_flag == "latest":
        path = find_latest_checkpoint(storage_path, run_prefix)
        if path is None:
            print(f"no checkpoint of '{run_prefix}' in {storage_path}: starting fresh", file=sys.stderr)
        else:
            print(f"resuming from {path}", file=sys.stderr)
        return path
    if resume_flag and not is_complete_checkpoint(resume_flag):
        raise utils.UserError(f"{resume_flag} is not a complete checkpoint of train.py")
    return resume_flag


def run_trainer(config, train_ds, cpus_per_worker, run_prefix):
    import ray.train
    from ray.train.torch import TorchTrainer

    resources = {"CPU": cpus_per_worker}
    if config["use_gpu"]:
        resources["GPU"] = 1
    run_name = f"{run_prefix}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    config = {**config, "run_name": run_name}
    trainer = TorchTrainer(
        train_fn,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=config["num_workers"], use_gpu=config["use_gpu"],
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=config["storage_path"],
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config["checkpoints_total_limit"]),
            failure_config=ray.train.FailureConfig(max_failures=config["max_failures"]),
        ),
        datasets={"train": train_ds},
    )
    try:
        result = trainer.fit()
    except (ray.train.ControllerError, ray.train.WorkerGroupError) as err:
        raise utils.UserError(f"training failed: {str(err).splitlines()[0]}") from None
    except SystemExit:
        # fit() installs its own Ctrl-C handler: it aborts the run, then exits.
        raise KeyboardInterrupt from None
    if (result.metrics or {}).get("step", 0) < config["total_steps"] and not os.path.isfile(
            os.path.join(config["output_dir"], utils.OUTPUT_MARKER)):
        raise KeyboardInterrupt  # an aborted run returns a partial result
    return result


if __name__ == "__main__":
    utils.run_main(main)

"""Step 4: DreamBooth fine-tuning of UNet + text encoder on Ray Train workers.

    python train.py --model_dir=$ORIG_MODEL_PATH --output_dir=$TUNED_MODEL_DIR \\
        --instance_images_dir=$IMAGES_OWN_DIR --instance_prompt="photo of unqtkn dog" \\
        --class_images_dir=$IMAGES_REG_DIR --class_prompt="photo of a dog" \\
        --train_batch_size=2 --lr=5e-6 --max_train_steps=200 --num_workers=2

`main` (the driver) checks the inputs, plans the steps, builds the Ray Data pipeline and
runs `train_fn` on a TorchTrainer; `train_fn` (each worker) wires the step math of
steps.py to Ray Train. Models and their options are in models.py, the checkpoint format
in checkpoint.py. fp32 master weights with autocast (bf16 by default on GPUs that have
it): 5e-6 AdamW updates vanish when the weights themselves are bf16.
"""

import itertools
import json
import math
import os
import sys
import tempfile
import time
from datetime import datetime

import checkpoint
import flags
import utils

METRICS_FILE = "metrics.jsonl"  # in the run's folder under --storage_path
DEFAULT_MAX_TRAIN_STEPS = 800

TRAIN_FLAGS = [
    "model_dir", "output_dir", "instance_data_dir", "instance_prompt", "class_data_dir", "class_prompt",
    "with_prior_preservation", "prior_loss_weight", "resolution", "center_crop", "random_flip",
    "train_text_encoder", "train_batch_size", "learning_rate", "lr_warmup_steps", "adam_beta1",
    "adam_beta2", "adam_weight_decay", "adam_epsilon", "max_grad_norm", "max_train_steps",
    "num_train_epochs", "mixed_precision", "seed", "num_workers", "gpus_per_worker", "use_gpu",
    "storage_path", "logging_steps", "checkpointing_steps", "checkpoints_total_limit",
    "resume_from_checkpoint", "max_failures", "overwrite", "allow_unsafe_weights",
    "gradient_accumulation_steps", "gradient_checkpointing", "cache_latents", "precompute_text_embeddings",
    "channels_last", "fused_adamw", "torch_compile"]


# ---------------------------------------------------------------- driver


def main(argv=None):
    parser = flags.make_parser(__doc__.splitlines()[0], TRAIN_FLAGS)
    args = flags.check_train_args(parser, parser.parse_args(argv))
    import dataset

    utils.check_model_dir(args.model_dir, args.allow_unsafe_weights)
    check_output_dir(args.output_dir, args.overwrite)
    instance_paths = dataset.list_images(args.instance_data_dir, "instance")
    class_paths = dataset.list_images(args.class_data_dir, "class") if args.with_prior_preservation else None
    run_prefix = os.path.basename(args.output_dir)
    resume_path = checkpoint.resolve_resume(args.resume_from_checkpoint, args.storage_path, run_prefix)

    ray = utils.init_ray()
    use_gpu, cpus_per_worker = worker_resources(args, utils.cluster_cpus(), utils.cluster_gpus())
    config = build_config(args, use_gpu)
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
    train_ds = dataset.build_train_dataset(
        instance_paths, class_paths, config["resolution"], args.center_crop, args.random_flip, latent_cache,
        num_epochs=stream_epochs(num_rows, config["total_steps"], args), seed=args.seed,
        batch_size=args.train_batch_size)
    try:
        result = run_trainer(config, train_ds, cpus_per_worker, run_prefix)
    except KeyboardInterrupt:
        latest = checkpoint.find_latest(args.storage_path, run_prefix)
        where = f" (newest checkpoint: {latest})" if latest else " (no checkpoint was written yet)"
        print(f"stopped; rerun the same command with --resume_from_checkpoint latest to continue{where}",
              file=sys.stderr)
        raise
    print(f"trained {config['total_steps']} steps; final loss {result.metrics.get('loss', float('nan')):.4f}; "
          f"model saved to {args.output_dir}; checkpoints and {METRICS_FILE} in {result.path}", file=sys.stderr)
    return result


def check_output_dir(output_dir, overwrite):
    """Refuse to replace a non-empty folder that is not a previous output of ours."""
    if not os.path.isdir(output_dir) or not os.listdir(output_dir) or overwrite:
        return
    if not os.path.isfile(os.path.join(output_dir, utils.OUTPUT_MARKER)):
        raise utils.UserError(f"--output_dir {output_dir} is not empty and was not written by train.py; "
                              "pass --overwrite to replace it")


def worker_resources(args, cpus, gpus):
    """(use_gpu, CPUs per worker), or UserError if the cluster cannot hold the workers.

    At least one CPU stays free for Ray Data: with every CPU held by train workers the
    streaming dataset never starts and fit() waits forever.
    """
    use_gpu = gpus > 0 if args.use_gpu is None else args.use_gpu
    needed = args.num_workers * args.gpus_per_worker
    if use_gpu and needed > gpus:
        raise utils.UserError(f"--num_workers {args.num_workers} x --gpus_per_worker {args.gpus_per_worker} "
                              f"needs {needed} GPUs; the Ray cluster has {gpus}")
    if not use_gpu and args.num_workers > cpus:
        raise utils.UserError(f"--num_workers {args.num_workers} is more than the Ray cluster's {cpus:g} CPUs")
    spare = cpus - 1
    if spare <= 0:
        raise utils.UserError(f"the Ray cluster has {cpus:g} CPU(s): training needs one for its workers "
                              "and one for the data pipeline")
    return use_gpu, min(1.0, spare / args.num_workers)


def plan_steps(num_rows, args):
    """(steps_per_epoch, total_steps): rows split evenly over workers, into batches, into
    optimizer steps of gradient_accumulation_steps batches.

    An explicit --max_train_steps wins (diffusers' rule); --num_train_epochs caps the run
    only when given, and then a line says that the run stops early and why.
    """
    rows_per_worker = num_rows // args.num_workers
    if rows_per_worker == 0:
        raise utils.UserError(f"{num_rows} training rows cannot feed {args.num_workers} workers; "
                              "add images or lower --num_workers")
    per_epoch = math.ceil(rows_per_worker / args.train_batch_size) // args.gradient_accumulation_steps
    if per_epoch == 0:
        raise utils.UserError(f"an epoch has fewer batches per worker than --gradient_accumulation_steps "
                              f"{args.gradient_accumulation_steps}; lower it or --train_batch_size")
    if args.num_train_epochs is None:
        return per_epoch, args.max_train_steps or DEFAULT_MAX_TRAIN_STEPS
    by_epochs = per_epoch * args.num_train_epochs
    if args.max_train_steps is None or by_epochs >= args.max_train_steps:
        return per_epoch, args.max_train_steps or by_epochs
    print(f"note: stopping after {by_epochs} steps, before --max_train_steps {args.max_train_steps}: "
          f"--num_train_epochs {args.num_train_epochs} x {per_epoch} steps per epoch", file=sys.stderr)
    return per_epoch, by_epochs


def stream_epochs(num_rows, total_steps, args):
    """Epochs of rows the training stream must hold for every worker to take total_steps
    (two spare: the split rebalances the stream's last blocks between workers)."""
    rows_per_worker = num_rows // args.num_workers
    rows_needed = total_steps * args.train_batch_size * args.gradient_accumulation_steps
    return math.ceil(rows_needed / rows_per_worker) + 2


def lacks_identifier(instance_prompt, class_prompt):
    """True when the instance prompt adds no word to the class prompt (no 'unqtkn' to learn)."""
    return bool(class_prompt) and set(instance_prompt.lower().split()) <= set(class_prompt.lower().split())


def build_config(args, use_gpu):
    """Everything a worker needs, computed once on the driver (prompts tokenised here)."""
    from transformers import CLIPTokenizer

    import dataset

    tokenizer = CLIPTokenizer.from_pretrained(args.model_dir, subfolder="tokenizer")
    if lacks_identifier(args.instance_prompt, args.class_prompt):
        print("warning: --instance_prompt has no word that --class_prompt lacks: "
              "the subject has no unique identifier", file=sys.stderr)
    config = vars(args).copy()
    config["use_gpu"] = use_gpu
    config["prompt_ids"] = {"instance": dataset.tokenize_prompt(tokenizer, args.instance_prompt).tolist()}
    if args.with_prior_preservation:
        config["prompt_ids"]["class"] = dataset.tokenize_prompt(tokenizer, args.class_prompt).tolist()
    if args.resolution is None:
        from diffusers import AutoencoderKL, UNet2DConditionModel

        unet_cfg = UNet2DConditionModel.load_config(args.model_dir, subfolder="unet")
        vae_cfg = AutoencoderKL.load_config(args.model_dir, subfolder="vae")
        config["resolution"] = unet_cfg["sample_size"] * 2 ** (len(vae_cfg["block_out_channels"]) - 1)
    if config["channels_last"] is None:
        config["channels_last"] = use_gpu
    return config


def run_trainer(config, train_ds, cpus_per_worker, run_prefix):
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    resources = {"CPU": cpus_per_worker}
    if config["use_gpu"]:
        resources["GPU"] = config["gpus_per_worker"]
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
        # Ordered execution makes the streaming split deterministic: each worker gets the same
        # rows on every run of the same command, which resuming mid-run relies on. (Set here:
        # the split is configured in Train's controller, which does not see our DataContext.)
        dataset_config=ray.train.DataConfig(execution_options=ray.data.ExecutionOptions(preserve_order=True)),
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


# ---------------------------------------------------------------- Ray Train worker


def train_fn(config):
    """Per-worker loop. Reads only `config`; data comes from the "train" dataset shard."""
    import ray.train
    import torch
    from ray.experimental import tqdm_ray

    import models as models_lib
    import steps

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    unet_device, aux_device = worker_devices(config["gpus_per_worker"], ctx.get_local_world_size())
    torch.manual_seed(config["seed"] + rank)  # every rank its own noise stream (CPU and GPUs)
    models = models_lib.setup_models(config, unet_device, aux_device, distributed=world > 1)
    state = steps.make_train_state(models, config)
    # Ray's own checkpoint (a restarted worker group) wins over the one the run started from.
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as folder:
            checkpoint.load(state, folder, rank)
    elif config.get("resume_path"):
        checkpoint.load(state, config["resume_path"], rank)
    if rank == 0:
        print(f"worker devices: UNet on {unet_device}, text encoder and VAE on {aux_device}; "
              f"autocast {state.amp_dtype or 'off (fp32)'}", flush=True)
    prompts = prompt_inputs(models.text_encoder, config, aux_device)
    total, accum = config["total_steps"], config["gradient_accumulation_steps"]
    batches = ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=config["train_batch_size"])
    # The stream is the same on every run: a resumed worker skips what it had trained on.
    batches = itertools.islice(batches, state.step * accum, None)
    bar = tqdm_ray.tqdm(total=total, desc="training") if rank == 0 else None
    if bar and state.step:
        bar.update(state.step)
    window_loss, window_images, window_start = [], 0, time.perf_counter()
    for micro_batches in steps.accumulate(batches, accum, total - state.step):
        loss, _, _ = steps.train_step(state, micro_batches, prompts, config["prior_loss_weight"],
                                      config["max_grad_norm"])
        state.step += 1
        window_loss.append(loss)
        window_images += sum(v.shape[0] for b in micro_batches for v in b.values())
        if bar:
            bar.update(1)
        if should_report(state.step, config):
            elapsed = time.perf_counter() - window_start
            metrics = {"step": state.step, "epoch": (state.step - 1) // config["steps_per_epoch"],
                       "loss": torch.stack(window_loss).mean().item(),  # the window's one sync point
                       "lr": state.lr_scheduler.get_last_lr()[0],
                       "images_per_s": window_images * world / max(elapsed, 1e-9)}
            if state.skipped_steps:
                metrics["skipped_steps"] = state.skipped_steps
            if rank == 0:
                append_metrics(config, metrics)
            report(state, metrics, rank, config)
            if rank == 0:
                print(" ".join(f"{name}={v:.4g}" if isinstance(v, float) else f"{name}={v}"
                               for name, v in metrics.items()), flush=True)
            window_loss, window_images, window_start = [], 0, time.perf_counter()
    if bar:
        bar.close()
    if state.step < total:
        raise RuntimeError(f"the data stream ended at step {state.step} of {total}")
    if rank == 0:
        save_pipeline(models, config)


def worker_devices(gpus_per_worker, local_world_size):
    """(UNet device, text-encoder + VAE device) of this worker.

    With --gpus_per_worker 2 the text encoder and VAE go to the worker's second GPU, so
    the UNet's fp32 weights, gradients and AdamW state have the first to themselves. On
    CPU both are the CPU, and the same code path runs.
    """
    import ray.train.torch
    import torch

    devices = ray.train.torch.get_devices()
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])
        return devices[0], devices[min(gpus_per_worker, len(devices)) - 1]
    # Ray sets OMP_NUM_THREADS to the worker's CPU reservation (a fraction -> 1 thread);
    # CPU workers on a node share its cores instead.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    cpu = torch.device("cpu")
    return cpu, cpu


def prompt_inputs(text_encoder, config, device):
    """Token ids (1, L) per prompt, or, with a frozen text encoder, its states (1, L, D) computed once."""
    import torch

    ids = {k: torch.tensor(v, device=device).unsqueeze(0) for k, v in config["prompt_ids"].items()}
    if config["train_text_encoder"] or not config["precompute_text_embeddings"]:
        return ids
    with torch.no_grad():
        return {k: text_encoder(v)[0] for k, v in ids.items()}


def is_checkpoint_step(step, config):
    """Checkpoints every checkpointing_steps and at the last step."""
    return step % config["checkpointing_steps"] == 0 or step == config["total_steps"]


def should_report(step, config):
    """Every rank reports on the same steps: Ray Train requires matching report calls."""
    return step % config["logging_steps"] == 0 or is_checkpoint_step(step, config)


def metrics_path(config):
    return os.path.join(config["storage_path"], config["run_name"], METRICS_FILE)


def append_metrics(config, metrics):
    """One JSON line per logging window (with the wall-clock time it ended) for loss curves."""
    path = metrics_path(config)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({**metrics, "time": time.time()}) + "\n")


def report(state, metrics, rank, config):
    """ray.train.report from every rank; rank 0 attaches a checkpoint on checkpointing steps,
    with every rank's RNG streams (gathered from all ranks, a collective)."""
    import ray.train

    if not is_checkpoint_step(state.step, config):
        ray.train.report(metrics)
        return
    rng_states = checkpoint.gather_rng_states()
    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as folder:
        checkpoint.save(state, folder, metrics["epoch"], rng_states, config["train_text_encoder"])
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def save_pipeline(models, config):
    """Write the fine-tuned pipeline (safetensors) to output_dir, whole or not at all."""
    from diffusers import StableDiffusionPipeline

    import models as models_lib

    pipe = models_lib.from_pretrained(
        StableDiffusionPipeline, config["model_dir"], config["allow_unsafe_weights"],
        unet=models_lib.unwrap(models.unet), text_encoder=models_lib.unwrap(models.text_encoder))

    def write(tmp):
        pipe.save_pretrained(tmp, safe_serialization=True)
        utils.write_json(os.path.join(tmp, utils.OUTPUT_MARKER), {
            "base_model": config["model_dir"], "steps": config["total_steps"],
            "instance_prompt": config["instance_prompt"], "class_prompt": config["class_prompt"]})

    utils.atomic_write_dir(config["output_dir"], write)


if __name__ == "__main__":
    utils.run_main(main)

"""The training math: target, loss, latents, conditioning and one optimizer step.

Plain functions on plain tensors, run and tested without Ray; `worker.train_fn` and
`benchmarks/bench.py` call the same `train_step`. Nothing here reads a tensor's value
back to the host (`.item()` is a CPU-GPU sync point): losses come back as detached
device tensors, read only on logging steps. The one exception is fp16's skipped-step
check, which needs the loss scale.
"""

import contextlib
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from dreambooth import machine
from dreambooth.families.shared import objectives
from dreambooth.generation import imaging
from dreambooth.training import conditioning


@dataclasses.dataclass
class TrainState:
    """Everything one worker's training loop changes, and the step it has reached."""

    models: "object"  # models.Models
    params: list
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    amp_dtype: "torch.dtype | None"
    step: int = 0
    skipped_steps: int = 0  # fp16 steps whose gradients overflowed (weights and LR unchanged)
    loss: objectives.LossOptions = objectives.LossOptions()  # --offset_noise, --snr_gamma, --weighting_scheme, ...
    ema: "EMA | None" = None  # --use_ema


class EMA:
    """An exponential moving average of the trained parameters (--use_ema): one copy of each,
    in its dtype on its device, updated after every optimizer step.

    After update_after_step steps in which it just follows the weights, the n-th averaged step
    keeps min(decay, (1 + n) / (10 + n)) of the average (diffusers' EMAModel warm-up): a run of
    a few hundred steps averages its recent steps, not its start. decay 0 makes the average the
    weights themselves, exactly (lerp with weight 1 returns its end point)."""

    def __init__(self, params, decay, update_after_step=0):
        self.decay, self.update_after_step = decay, update_after_step
        self.restart(params)

    def restart(self, params):
        """The average from these weights on (a copy of each)."""
        self.shadow = [p.detach().clone() for p in params]

    def decay_at(self, step):
        """The share of the average kept at optimizer step `step` (1-based): 0 while following."""
        averaged = step - self.update_after_step
        if averaged <= 0:
            return 0.0
        return min(self.decay, (1 + averaged) / (10 + averaged))

    @torch.no_grad()
    def update(self, params, step):
        """Fold the weights after optimizer step `step` into the average."""
        torch._foreach_lerp_(self.shadow, [p.detach() for p in params], 1.0 - self.decay_at(step))

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self, params):
        """The averaged weights in params for the duration (sampling, saving), the trained ones back
        after: swapped one tensor at a time, so no second copy of every weight is needed."""
        def swap():
            for p, s in zip(params, self.shadow):
                kept = p.detach().clone()
                p.detach().copy_(s)
                s.copy_(kept)
        swap()
        try:
            yield
        finally:
            swap()

    def state_dict(self):
        """{"0": tensor, ...}: the average of each trained parameter, in their order (safetensors)."""
        return {str(i): s.detach().contiguous().cpu() for i, s in enumerate(self.shadow)}


@torch.no_grad()
def load_average(targets, tensors):
    """Copy a saved moving average (EMA.state_dict's tensors) into targets, tensor by tensor: the
    average of a resumed run, or the weights of a model made from a checkpoint."""
    if len(tensors) != len(targets):
        raise ValueError(f"the moving average holds {len(tensors)} tensors; this run trains {len(targets)}")
    for i, target in enumerate(targets):
        target.copy_(tensors[str(i)])


def trained_parameters(models, train_text_encoder):
    """The parameters a run trains, in one fixed order (the optimizer's and the EMA's): the denoiser's,
    then the text encoders' the family trains when trained; with LoRA only the adapters."""
    trained = [models.denoiser] + (models.trained_text_encoders() if train_text_encoder else [])
    return [p for model in trained for p in model.parameters() if p.requires_grad]


def dreambooth_loss(pred, target, num_instance, prior_loss_weight, weights=None, masks=None):
    """MSE on the instance rows plus prior_loss_weight x MSE on the class rows.

    pred, target: (B, C, h, w), instance rows first, then class rows (B = num_instance
    without prior preservation). weights: (B,) per-row loss weights (objectives.Draw's), or None.
    masks: (num_instance, 1, h, w) weights in [0, 1] of each instance row's latent pixels
    (--masked_loss), or None: an instance row's error is then its mask-weighted mean.
    Returns (total, instance_loss, prior_loss or None).
    """
    pred, target = pred.float(), target.float()
    if weights is None and masks is None:
        def mse(rows):
            return F.mse_loss(pred[rows], target[rows])
    else:
        squared = F.mse_loss(pred, target, reduction="none")
        per_row = squared.mean(dim=(1, 2, 3))
        if masks is not None:
            masked = squared[:num_instance] * masks
            covered = masks.expand_as(masked).sum(dim=(1, 2, 3)).clamp(min=1e-6)
            per_row = torch.cat([masked.sum(dim=(1, 2, 3)) / covered, per_row[num_instance:]])
        if weights is not None:
            per_row = per_row * weights

        def mse(rows):
            return per_row[rows].mean()
    instance_loss = mse(slice(None, num_instance))
    if pred.shape[0] == num_instance:
        return instance_loss, instance_loss, None
    prior_loss = mse(slice(num_instance, None))
    return instance_loss + prior_loss_weight * prior_loss, instance_loss, prior_loss


def latent_masks(masks, size, device):
    """(B, R, R) uint8 masks of the photos' views -> (B, 1, h, w) float weights in [0, 1] on
    device: each latent pixel's share of mask over the image pixels it covers."""
    weights = masks.to(device, non_blocking=True).float().unsqueeze(1) / 255.0
    return F.interpolate(weights, size=tuple(size), mode="area")


def encode_latents(family, vae, pixels):
    """(B, 3, H, W) in [-1, 1] -> (B, C, H/f, W/f) scaled latents, f from the VAE config."""
    with torch.no_grad():
        latents = family.latent_posterior(vae, pixels).sample()
    return family.scale_latents(vae, latents)


def batch_latents(models, batch):
    """Scaled latents (B, C, h, w) of a batch on the denoiser's device, instance rows first.

    From pixels ("instance_pixels"/"class_pixels": (B, R, R, 3) uint8) through the VAE on
    its device, or from cached VAE posteriors ("instance_latents"/"class_latents":
    (B, 8, h, w), mean and log-variance) with a fresh sample each step, as encoding
    every step would draw.
    """
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    kind = "latents" if "instance_latents" in batch else "pixels"
    parts = [batch[f"instance_{kind}"]] + ([batch[f"class_{kind}"]] if f"class_{kind}" in batch else [])
    if kind == "pixels":
        pixels = torch.cat([p.to(models.aux_device, non_blocking=True) for p in parts])
        return encode_latents(models.family, models.vae, imaging.to_model_input(pixels)).to(models.denoiser_device)
    stacked = torch.cat([p.to(models.denoiser_device, non_blocking=True) for p in parts]).float()
    return models.family.scale_latents(models.vae, DiagonalGaussianDistribution(stacked).sample())


def batch_loss(models, batch, prompts, prior_loss_weight, loss_options=objectives.LossOptions()):
    """Forward pass for one batch (see batch_latents), conditioned on prompts (a
    conditioning.StepPrompts), towards the family's objective (objectives.py) with loss_options.

    With prompts.class_base (--prior_preservation prior_prediction: the class prompt's states
    from the base text encoders, and its pooled embedding for SDXL), the batch's photos are used
    twice: as instance rows, and under the class prompt as class rows whose target is the base
    model's own prediction for the same noisy latents (models.base_denoiser).

    With batch["instance_mask"] ((B, R, R) uint8, --masked_loss) each instance row's loss is
    weighted by its photo's mask (latent_masks).

    Returns dreambooth_loss's tuple (total, instance_loss, prior_loss or None).
    """
    latents = batch_latents(models, batch)
    num_instance = next(v for k, v in batch.items() if k.startswith("instance_")).shape[0]
    predicted_prior = prompts.class_base is not None
    if predicted_prior:
        latents = torch.cat([latents, latents])
    num_class = latents.shape[0] - num_instance
    hidden, pooled = conditioning.batch_states(models, prompts, conditioning.row_prompts(prompts, batch, num_instance),
                                               num_class)
    hidden = hidden.to(models.denoiser_device)
    # The family's extra inputs (SDXL: the pooled text and each image's size and crop); the predicted
    # prior's class rows are the instance photos again, with their sizes.
    resolution = latents.shape[-1] * models.family.vae_downscale(models.vae.config)
    sized = {**batch, "class_time_ids": batch["instance_time_ids"]} \
        if predicted_prior and "instance_time_ids" in batch else batch
    time_ids = models.family.size_conditioning(sized, latents.shape[0], resolution, models.denoiser_device, hidden.dtype)
    pooled = pooled.to(models.denoiser_device) if pooled is not None else None
    draw = models.family.draw(models.scheduler, latents, loss_options)
    guidance = loss_options.guidance_scale
    pred = models.family.denoise(models.denoiser, draw.noisy, draw.timesteps, hidden, pooled, time_ids, guidance)
    target = draw.target
    if predicted_prior:
        base_pooled = prompts.class_base_pooled
        base_pooled = base_pooled.to(models.denoiser_device).expand(num_class, -1) if base_pooled is not None else None
        base = prompts.class_base.to(models.denoiser_device).expand(num_class, -1, -1)
        with torch.no_grad(), models.base_denoiser() as base_denoiser:
            prior_target = models.family.denoise(base_denoiser, draw.noisy[num_instance:], draw.timesteps[num_instance:], base,
                                                 base_pooled, time_ids[num_instance:] if time_ids is not None else None,
                                                 guidance)
        target = torch.cat([target[:num_instance], prior_target.to(target.dtype)])
    masks = latent_masks(batch["instance_mask"], latents.shape[-2:], pred.device) if "instance_mask" in batch else None
    return dreambooth_loss(pred, target, num_instance, prior_loss_weight, draw.weights, masks)


def train_step(state, micro_batches, prompts, prior_loss_weight, max_grad_norm, seeds=None, share=None):
    """One optimizer step over gradient-accumulation micro-batches: autocast forward,
    backward, clip, AdamW, LR schedule. DDP all-reduces only on the last micro-batch.
    seeds: torch's seed before each micro-batch (block_seed), else its stream goes on. share: the weight of each
    micro-batch's loss in the step's gradient after DDP averages the workers' (world / per_step of step_batches;
    default 1 / the micro-batches), so that every block of the step weighs the same.

    With fp16 a step whose gradients overflow is skipped by the GradScaler: the weights
    stay, the loss scale halves, and the LR schedule does not advance either.
    Returns (loss, instance_loss, prior_loss or None), each a detached 0-d device tensor
    averaged over the micro-batches.
    """
    models = state.models
    count = len(micro_batches)
    totals = []
    share = 1 / count if share is None else share
    for k, batch in enumerate(micro_batches):
        if seeds is not None:
            torch.manual_seed(seeds[k])
        sync = contextlib.ExitStack()
        if k < count - 1:
            for model in models.ddp_wrapped():
                sync.enter_context(model.no_sync())
        with sync:
            with torch.autocast(models.denoiser_device.type, dtype=state.amp_dtype, enabled=state.amp_dtype is not None):
                losses = batch_loss(models, batch, prompts, prior_loss_weight, state.loss)
            state.scaler.scale(losses[0] * share).backward()
        totals.append([t.detach() if t is not None else None for t in losses])
    scaler = state.scaler
    scaler.unscale_(state.optimizer)
    torch.nn.utils.clip_grad_norm_(state.params, max_grad_norm)
    scaler.step(state.optimizer)
    skipped = False
    if scaler.is_enabled():
        scale = scaler.get_scale()  # a sync point, paid only with fp16
        scaler.update()
        skipped = scaler.get_scale() < scale
    state.optimizer.zero_grad(set_to_none=True)
    if skipped:
        state.skipped_steps += 1
    else:
        state.lr_scheduler.step()
    if state.ema is not None:
        state.ema.update(state.params, state.step + 1)

    def mean(i):
        values = [t[i] for t in totals if t[i] is not None]
        return torch.stack(values).mean() if values else None

    return mean(0), mean(1), mean(2)


def step_batches(batches, rank, world, per_step, start, end):
    """This worker's micro-batches of each optimizer step from step start to end: a list of (block, batch) per step.

    The run's stream is a sequence of blocks of rows (dataset.index_dataset), and the streaming split gives worker
    rank of world its k-th batch from block k x world + rank. Optimizer step s trains blocks [s x per_step,
    (s + 1) x per_step): per_step is --gradient_accumulation_steps x the run's number of workers (the most, with a
    range), fixed for the run. So a step trains the same rows however many workers share it: each takes the
    step's blocks that reach it, per_step / world of them (one more or one fewer when that is not whole). The
    batches of the steps before start (a resumed run's) are read and skipped. Stops early when the stream ends."""
    def before(step):  # this worker's batches of the steps before step
        return max(0, -(-(step * per_step - rank) // world))

    batches, k = iter(batches), 0
    for step in range(start, end):
        group = []
        while k < before(step + 1):
            batch = next(batches, None)
            if batch is None:
                return
            if k >= before(step):
                group.append((k * world + rank, batch))
            k += 1
        yield group


def block_seed(seed, block):
    """The seed of torch's stream for one block's micro-batch (its noise, timesteps, dropped captions): the same on
    any worker, in any run of --seed, so the result does not depend on which worker trained the block."""
    return int(np.random.SeedSequence([seed, block]).generate_state(1)[0])


def mixed_precision_name(dtype):
    """The --mixed_precision value of an autocast dtype (None: 'no')."""
    import torch

    return {None: "no", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def loss_options(plan):
    """The objectives.LossOptions of a plan.Plan."""
    return objectives.LossOptions(plan.offset_noise, plan.snr_gamma,
                                  plan.weighting_scheme or plan.family.default_weighting_scheme, plan.logit_mean,
                                  plan.family.default_logit_std if plan.logit_std is None else plan.logit_std,
                                  plan.mode_scale,
                                  plan.family.precondition_outputs if plan.precondition_outputs is None
                                  else bool(plan.precondition_outputs),
                                  plan.family.guidance(plan.guidance_scale), plan.flow_shift)


def make_optimizer(params, plan):
    """plan.optimizer over params with the plan's settings: torch's AdamW (fused or not), bitsandbytes' 8-bit
    AdamW, prodigyopt's Prodigy or schedulefree's AdamW (in its train mode, warming up over lr_warmup_steps)."""
    settings = dict(lr=plan.learning_rate, betas=(plan.adam_beta1, plan.adam_beta2),
                    weight_decay=plan.adam_weight_decay, eps=plan.adam_epsilon)
    name = "adamw8bit" if plan.use_8bit_adam else plan.optimizer
    if name == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **settings)
    if name == "prodigy":
        from prodigyopt import Prodigy

        return Prodigy(params, beta3=plan.prodigy_beta3, decouple=plan.prodigy_decouple,
                       use_bias_correction=plan.prodigy_use_bias_correction,
                       safeguard_warmup=plan.prodigy_safeguard_warmup, **settings)
    if name == "adamw_schedulefree":
        import schedulefree

        optimizer = schedulefree.AdamWScheduleFree(params, warmup_steps=plan.lr_warmup_steps, **settings)
        optimizer.train()
        return optimizer
    return torch.optim.AdamW(params, fused=plan.fused_adamw, **settings)


def schedule_free(optimizer):
    """Whether optimizer keeps a training point apart from the weights it averages (schedule-free AdamW's modes)."""
    return callable(getattr(optimizer, "eval", None)) and all("train_mode" in g for g in optimizer.param_groups)


@contextlib.contextmanager
def evaluation_weights(optimizer):
    """For the duration, a schedule-free optimizer's averaged weights in its parameters (what validation samples
    and the saved model get); after it, the training weights again bit for bit (kept on the CPU meanwhile), so a
    sample drawn changes nothing of the training. Any other optimizer's parameters stay as they are."""
    if not schedule_free(optimizer):
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kept = [p.detach().to("cpu", copy=True) for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, training in zip(params, kept):
                p.copy_(training)
        for group in optimizer.param_groups:
            group["train_mode"] = True


def make_train_state(models, plan):
    """Optimizer, LR schedule and grad scaler over the trainable parameters of models,
    as a plan.Plan sets them (learning_rate, adam_*, lr_scheduler and its options over
    total_steps, fused_adamw or use_8bit_adam, mixed_precision, train_text_encoder, the loss options,
    use_ema).
    fp32 master weights: 5e-6 AdamW updates vanish in bf16 weights.
    """
    from diffusers.optimization import get_scheduler

    dtype = machine.amp_dtype(plan.mixed_precision, models.denoiser_device)
    if plan.fsdp and dtype == torch.float16:  # (the default on GPUs without bf16; loss scaling of shards untested)
        raise ValueError("--fsdp trains in bf16 or fp32 and this GPU has no bf16: pass --mixed_precision no")
    params = trained_parameters(models, plan.train_text_encoder)
    optimizer = make_optimizer(params, plan)
    lr_scheduler = get_scheduler(plan.lr_scheduler, optimizer, num_warmup_steps=plan.lr_warmup_steps,
                                 num_training_steps=plan.total_steps, num_cycles=plan.lr_num_cycles,
                                 power=plan.lr_power)
    # Loss scaling only matters for fp16's narrow exponent range.
    scaler = torch.amp.GradScaler(models.denoiser_device.type, enabled=dtype == torch.float16)
    ema = EMA(params, plan.ema_decay, plan.ema_update_after_step) if plan.use_ema else None
    return TrainState(models, params, optimizer, lr_scheduler, scaler, dtype,
                      loss=loss_options(plan), ema=ema)

"""What the denoiser learns: a family's training objective, as plain functions of tensors.

Denoising (SD 1.x, 2.x, SDXL): a timestep drawn uniformly from the DDPM schedule, the scheduler's
noisy latents, the noise or v as the target (the model's prediction_type), min-SNR weights with
--snr_gamma. Flow matching (SD 3.5, Flux.1): a point of the schedule drawn by --weighting_scheme
(logit_normal, mode or uniform), the straight path between the latents and the noise at its sigma,
the velocity (noise - latents) as the target, and the scheme's loss weights (cosmap, sigma_sqrt).

torch is imported inside the functions: a family names its objective on the driver, where a
`--help` or a one-line error never waits for torch.
"""

import dataclasses

from dreambooth import errors

WEIGHTING_SCHEMES = ("logit_normal", "mode", "cosmap", "sigma_sqrt", "none")  # diffusers' reference scripts' names


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The loss flags of a run (one record for every family; each objective reads its own)."""

    offset_noise: float = 0.0  # --offset_noise
    snr_gamma: float = None  # --snr_gamma: min-SNR weights (denoising)
    weighting_scheme: str = "none"  # --weighting_scheme (flow matching)
    logit_mean: float = 0.0  # --logit_mean
    logit_std: float = 1.0  # --logit_std
    mode_scale: float = 1.29  # --mode_scale
    precondition_outputs: bool = False  # --precondition_outputs resolved (flow matching): rows weigh sigma^2
    guidance_scale: float = None  # --guidance_scale resolved: the denoiser's guidance input (family.guided_training)
    flow_shift: float = None  # --flow_shift (flow matching): the drawn sigmas' shift; None: the scheduler's own


def check_flags(family, snr_gamma, precondition_outputs, weighting_scheme, flow_shift=None):
    """UserError for a loss flag of the other objective: --snr_gamma weighs DDPM timesteps,
    --weighting_scheme (and its --logit_*/--mode_scale) draws flow-matching ones."""
    if family.flow_matching and snr_gamma:
        raise errors.UserError(f"--snr_gamma weighs the timesteps of a denoising model; {family.label} is trained by "
                               "flow matching: use --weighting_scheme (logit_normal, mode, cosmap) instead")
    if not family.flow_matching and precondition_outputs is not None:
        raise errors.UserError(f"--precondition_outputs is for the flow-matching models (SD 3.5, Flux.1 and later); {family.label} "
                               "predicts its scheduler's target directly")
    if not family.flow_matching and flow_shift is not None:
        raise errors.UserError(f"--flow_shift shifts a flow-matching model's noise levels; {family.label} is trained "
                               "to denoise: leave it out")
    if not family.flow_matching and weighting_scheme:
        raise errors.UserError(f"--weighting_scheme is for the flow-matching models (SD 3.5, Flux.1 and later); {family.label} is "
                               "trained to denoise: use --snr_gamma to weigh its timesteps")


@dataclasses.dataclass(frozen=True)
class Draw:
    """One step's draw for a batch of latents: what the denoiser gets and what it must predict."""

    noisy: object  # (B, C, h, w) latents with noise
    timesteps: object  # (B,) the denoiser's timestep input
    target: object  # (B, C, h, w)
    weights: object = None  # (B,) per-row loss weights, or None


def training_noise(latents, offset_noise):
    """Gaussian noise like latents (B, C, h, w), plus offset_noise x one normal draw per
    row and channel (offset noise: shifts of a channel's mean become learnable)."""
    import torch

    noise = torch.randn_like(latents)
    if offset_noise:
        noise = noise + offset_noise * torch.randn(*latents.shape[:2], 1, 1, device=latents.device,
                                                   dtype=latents.dtype)
    return noise


def diffusion_target(scheduler, latents, noise, timesteps):
    """What a denoising model learns to predict, by the scheduler's prediction_type."""
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unsupported prediction_type {kind!r}")


def min_snr_weights(scheduler, timesteps, gamma):
    """(B,) min-SNR-gamma loss weights of Hang et al. 2023: min(SNR, gamma) / SNR for
    epsilon prediction, min(SNR, gamma) / (SNR + 1) for v-prediction. Steps whose SNR is
    under gamma keep weight 1; nearly noise-free ones, easy to predict, weigh less."""
    from diffusers.training_utils import compute_snr

    snr = compute_snr(scheduler, timesteps)
    clipped = snr.clamp(max=gamma)
    return clipped / (snr + 1) if scheduler.config.prediction_type == "v_prediction" else clipped / snr


def denoising(scheduler, latents, options):
    """The Draw of a DDPM-trained model (SD 1.x, 2.x, SDXL)."""
    import torch

    noise = training_noise(latents, options.offset_noise)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
    weights = min_snr_weights(scheduler, timesteps, options.snr_gamma) if options.snr_gamma else None
    return Draw(scheduler.add_noise(latents, noise, timesteps), timesteps,
                diffusion_target(scheduler, latents, noise, timesteps), weights)


def flow_matching(scheduler, latents, options):
    """The Draw of a flow-matching model (SD 3.5, Flux.1) on its scheduler's sigmas: a point
    of the schedule drawn by options.weighting_scheme, noisy = (1 - sigma) x + sigma noise, the target
    noise - x, and the scheme's weights (none for logit_normal, mode and none: their draw is the weighting),
    times sigma^2 with options.precondition_outputs."""
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    noise = training_noise(latents, options.offset_noise)
    u = compute_density_for_timestep_sampling(options.weighting_scheme, latents.shape[0], options.logit_mean,
                                              options.logit_std, options.mode_scale)
    schedule = scheduler.config.num_train_timesteps
    index = (u * schedule).long().clamp(max=schedule - 1)
    if options.flow_shift is None:
        sigmas = scheduler.sigmas[index].to(latents.device, latents.dtype)
        timesteps = scheduler.timesteps[index].to(latents.device)
    else:  # the same point of the unshifted schedule (1 ... 1/N), shifted as the scheduler shifts: timestep = N sigma
        plain = (schedule - index).float() / schedule
        shifted = options.flow_shift * plain / (1 + (options.flow_shift - 1) * plain)
        sigmas, timesteps = shifted.to(latents.device, latents.dtype), (shifted * schedule).to(latents.device)
    expanded = sigmas.view(-1, *[1] * (latents.dim() - 1))
    weights = compute_loss_weighting_for_sd3(options.weighting_scheme, sigmas).float() \
        if options.weighting_scheme in ("cosmap", "sigma_sqrt") else None
    if options.precondition_outputs:
        # The error of the implied clean latents, noisy - sigma x prediction against x, is sigma x the
        # velocity error (diffusers' SD 3 scripts' --precondition_outputs 1): a weight of sigma^2 per row.
        weights = (sigmas.float() ** 2) * (weights if weights is not None else 1.0)
    return Draw((1.0 - expanded) * latents + expanded * noise, timesteps, noise - latents, weights)

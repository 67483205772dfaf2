"""What diffusers' DreamBooth scripts compute the same way for every family, written from their steps for the
families' contracts (each family folder's contract.py: the loss its script computes on a batch, which the tests hold
ours to). Not used by a run."""


def uniform_schedule_draw(scheduler, rows):
    """(timesteps, sigmas) of rows draws as the flow-matching scripts draw them with no weighting: a uniform index
    into the scheduler's training schedule (diffusers' compute_density_for_timestep_sampling with "none")."""
    import torch
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling("none", rows, 0.0, 1.0, 1.29)
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    sigmas = torch.stack([scheduler.sigmas[(scheduler.timesteps == t).nonzero().item()] for t in timesteps])
    return timesteps, sigmas


def one_frame_flow_draw(vae, scheduler, frames):
    """(latents, noise, timesteps, noisy latents) as the Qwen-Image scripts draw them on one-frame videos
    (B, C, 1, H, W): the VAE's sample normalised per channel by its config's means and deviations (times the
    deviations' inverse), noise, uniform_schedule_draw's timesteps, the straight path at their sigmas."""
    import torch

    latents = vae.encode(frames).latent_dist.sample()
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    std_inverse = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    latents = (latents - mean) * std_inverse
    noise = torch.randn_like(latents)
    timesteps, sigmas = uniform_schedule_draw(scheduler, latents.shape[0])
    sigmas = sigmas.view(-1, 1, 1, 1, 1)
    return latents, noise, timesteps, (1.0 - sigmas) * latents + sigmas * noise


def prior_preserving_mse(pred, target, prior_loss_weight):
    """The scripts' loss with prior preservation and no weighting: the instance half's mean squared error, plus
    prior_loss_weight x the class half's."""
    (pred, pred_prior), (target, target_prior) = pred.chunk(2), target.chunk(2)
    loss = ((pred.float() - target.float()) ** 2).reshape(1, -1).mean(1).mean()
    prior = ((pred_prior.float() - target_prior.float()) ** 2).reshape(1, -1).mean(1).mean()
    return loss + prior_loss_weight * prior


def denoising_script_loss(models, pixels, states, prior_loss_weight, **unet_inputs):
    """The loss of diffusers' DDPM DreamBooth scripts (train_dreambooth.py, train_dreambooth_lora_sdxl.py) on a batch
    of instance and class pixels with their text states, written from their steps: the VAE's sample scaled, noise,
    a uniform integer timestep, the scheduler's noise added, the UNet's prediction (unet_inputs: SDXL's added
    conditions), the target its prediction type names (the noise, or v), the instance and prior means."""
    import torch

    vae, scheduler = models.vae, models.scheduler
    latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],))
    noisy = scheduler.add_noise(latents, noise, timesteps)
    pred = models.denoiser(noisy, timesteps, states, return_dict=False, **unet_inputs)[0]
    velocity = scheduler.config.prediction_type == "v_prediction"
    target = scheduler.get_velocity(latents, noise, timesteps) if velocity else noise
    return prior_preserving_mse(pred, target, prior_loss_weight)


def clip_states(pipe, prompts):
    """The text states train_dreambooth.py conditions on: the tokenizer's ids padded to its length, the text
    encoder's last hidden states."""
    import torch

    ids = pipe.tokenizer(list(prompts), padding="max_length", max_length=pipe.tokenizer.model_max_length,
                         truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        return pipe.text_encoder(ids)[0]

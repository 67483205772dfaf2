"""SD 3.5's contract (tests/unit/test_family_contract.py): the loss of diffusers' train_dreambooth_lora_sd3.py on a
batch with its defaults (logit-normal timesteps, --precondition_outputs 1), which the test holds ours to."""

from dreambooth.families.shared import scripts


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    """Written from the script's steps: the VAE's sample shifted and scaled, noise, a logit-normal index into the
    scheduler's schedule, the straight path, the transformer's output turned into the implied clean latents (noisy -
    sigma x output) against the clean latents, the instance and prior means."""
    import torch
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from dreambooth.families import sd3

    vae, scheduler = models.vae, models.scheduler
    latents = (vae.encode(pixels).latent_dist.sample() - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.randn_like(latents)
    u = compute_density_for_timestep_sampling("logit_normal", latents.shape[0], 0.0, 1.0, 1.29)
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    sigmas = torch.stack([scheduler.sigmas[(scheduler.timesteps == t).nonzero().item()] for t in timesteps])
    sigmas = sigmas.view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    with torch.no_grad():
        encoded = [pipe.encode_prompt(p, None, None, do_classifier_free_guidance=False,
                                      max_sequence_length=sd3.T5_MAX_LENGTH) for p in (instance_prompt, class_prompt)]
    states, pooled = torch.cat([e[0] for e in encoded]), torch.cat([e[2] for e in encoded])
    pred = models.denoiser(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=states,
                           pooled_projections=pooled, return_dict=False)[0]
    return scripts.prior_preserving_mse(pred * (-sigmas) + noisy, latents, prior_loss_weight)

"""Flux.1's contract (tests/unit/test_family_contract.py): the loss of diffusers' train_dreambooth_lora_flux.py on a
batch, the guidance value (the family's default) an input of dev's transformer, which the test holds ours to."""

from dreambooth.families.shared import scripts


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    """Written from the script's steps: the VAE's sample shifted and scaled, noise, a uniform index into the
    scheduler's schedule, the straight path, the transformer on 2x2-packed latents with their ids, T5's states and
    CLIP-L's pooled output, the velocity target, the instance and prior means."""
    import torch
    from diffusers import FluxPipeline

    from dreambooth.families import flux

    vae, scheduler = models.vae, models.scheduler
    latents = (vae.encode(pixels).latent_dist.sample() - vae.config.shift_factor) * vae.config.scaling_factor
    rows, channels, h, w = latents.shape
    noise = torch.randn_like(latents)
    timesteps, sigmas = scripts.uniform_schedule_draw(scheduler, rows)
    noisy = (1.0 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise
    with torch.no_grad():
        encoded = [pipe.encode_prompt(p, None, max_sequence_length=flux.T5_MAX_LENGTH)
                   for p in (instance_prompt, class_prompt)]
    states, pooled = torch.cat([e[0] for e in encoded]), torch.cat([e[1] for e in encoded])
    guided = models.denoiser.config.guidance_embeds
    guidance = torch.full((rows,), models.family.guidance_scale) if guided else None
    pred = models.denoiser(hidden_states=FluxPipeline._pack_latents(noisy, rows, channels, h, w),
                           timestep=timesteps / 1000, guidance=guidance, pooled_projections=pooled,
                           encoder_hidden_states=states, txt_ids=encoded[0][2],
                           img_ids=FluxPipeline._prepare_latent_image_ids(rows, h // 2, w // 2, noisy.device,
                                                                         noisy.dtype), return_dict=False)[0]
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    pred = FluxPipeline._unpack_latents(pred, h * scale, w * scale, scale)
    return scripts.prior_preserving_mse(pred, noise - latents, prior_loss_weight)

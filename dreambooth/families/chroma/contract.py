"""Chroma's contract (tests/unit/test_family_contract.py): the loss of Flux.1's DreamBooth script with
ChromaPipeline's conditioning (diffusers has no Chroma script) on a batch, which the test holds ours to."""

from dreambooth.families.shared import scripts


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    """Flux.1's DreamBooth script's steps with ChromaPipeline's conditioning: the VAE's sample shifted and scaled,
    noise, a uniform timestep index into the scheduler's schedule, the straight path, the transformer on 2x2-packed
    latents with the prompts' states and the pipeline's text mask extended over the image tokens, no guidance
    input, the velocity target, the instance and prior means."""
    import torch
    from diffusers import FluxPipeline

    vae, scheduler = models.vae, models.scheduler
    latents = (vae.encode(pixels).latent_dist.sample() - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.randn_like(latents)
    rows, channels, h, w = latents.shape
    timesteps, sigmas = scripts.uniform_schedule_draw(scheduler, rows)
    noisy = (1.0 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise
    with torch.no_grad():
        encoded = [pipe.encode_prompt([p], do_classifier_free_guidance=False) for p in (instance_prompt, class_prompt)]
    states = torch.cat([e[0] for e in encoded])
    packed = FluxPipeline._pack_latents(noisy, rows, channels, h, w)
    mask = pipe._prepare_attention_mask(rows, packed.shape[1], states.dtype, torch.cat([e[2] for e in encoded]))
    pred = models.denoiser(hidden_states=packed, timestep=timesteps / 1000, encoder_hidden_states=states,
                           txt_ids=encoded[0][1], img_ids=FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, noisy.device,
                                                                                                 states.dtype),
                           attention_mask=mask, return_dict=False)[0]
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    pred = FluxPipeline._unpack_latents(pred, h * scale, w * scale, scale)
    return scripts.prior_preserving_mse(pred, noise - latents, prior_loss_weight)

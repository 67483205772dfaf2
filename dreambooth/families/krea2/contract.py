"""What the family contract (tests/unit/test_family_contract.py) needs that only Krea 2 knows: the loss of diffusers'
train_dreambooth_lora_krea2.py, written from that script's steps with Krea2Pipeline's own functions."""


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    """The script's loss on a batch of one instance and one class image (pixels in [-1, 1]), with prior preservation
    and its default uniform weighting: a sample of the VAE's posterior of each image as a one-frame video, normalised
    per channel by the VAE config's means and deviations; noise; a uniform draw u, the schedule's timestep at index
    u x num_train_timesteps and its sigma; the straight path; the latents packed into 2x2 patches; the transformer on
    the prompts' states and masks as the pipeline's encode_prompt makes them (instance, then class), the pipeline's
    position ids, the timestep / 1000; the prediction unpacked; the velocity target noise - latents; the instance
    rows' mean squared error plus prior_loss_weight x the class rows'. Its random numbers are drawn in the order the
    script draws them (the posterior's sample, the noise, u), which is our step's order too."""
    import torch
    from diffusers import Krea2Pipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling

    vae, scheduler, transformer = models.vae, models.scheduler, models.denoiser
    # collate_fn: the frame axis; main(): vae.encode(...).latent_dist.sample(), then (x - mean) * (1 / std)
    latents = vae.encode(pixels.unsqueeze(2)).latent_dist.sample()
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    model_input = (latents - latents_mean) * latents_std
    noise = torch.randn_like(model_input)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(weighting_scheme="none", batch_size=bsz, logit_mean=0.0, logit_std=1.0,
                                              mode_scale=1.29)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[step_indices].flatten().view(-1, 1, 1, 1, 1)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise

    # the script's inlined Krea2Pipeline._pack_latents (patch 2): (B, C, 1, H, W) -> (B, H/2 x W/2, 4C)
    _, channels, _, height, width = model_input.shape
    packed = noisy.permute(0, 2, 1, 3, 4).reshape(bsz, channels, height // 2, 2, width // 2, 2)
    packed = packed.permute(0, 2, 4, 1, 3, 5).reshape(bsz, (height // 2) * (width // 2), channels * 4)

    with torch.no_grad():
        pairs = [pipe.encode_prompt(prompt=prompt, max_sequence_length=512) for prompt in (instance_prompt,
                                                                                          class_prompt)]
    prompt_embeds = torch.cat([embeds for embeds, _ in pairs])
    prompt_embeds_mask = torch.cat([mask for _, mask in pairs])
    position_ids = Krea2Pipeline.prepare_position_ids(prompt_embeds.shape[1], height // 2, width // 2, pixels.device)
    pred = transformer(hidden_states=packed, encoder_hidden_states=prompt_embeds, timestep=timesteps / 1000,
                       position_ids=position_ids, encoder_attention_mask=prompt_embeds_mask, return_dict=False)[0]
    # the script's inlined Krea2Pipeline._unpack_latents: back to (B, C, 1, H, W)
    pred = pred.view(bsz, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    pred = pred.reshape(bsz, channels, 1, height, width)

    target = noise - model_input
    (pred, pred_prior), (target, target_prior) = pred.chunk(2), target.chunk(2)
    prior_loss = ((pred_prior.float() - target_prior.float()) ** 2).reshape(target_prior.shape[0], -1).mean(1).mean()
    loss = ((pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(1).mean()
    return loss + prior_loss_weight * prior_loss

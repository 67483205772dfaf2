"""What the family contract (tests/unit/test_family_contract.py) needs that only this family knows: the loss of
diffusers' examples/dreambooth/train_dreambooth_lora_ideogram4.py on a batch, written from that script's steps with
Ideogram4Pipeline's own functions."""

# The script's defaults: --weighting_scheme, --logit_mean, --logit_std, --mode_scale, --max_sequence_length
SCHEME, LOGIT_MEAN, LOGIT_STD, MODE_SCALE, MAX_SEQUENCE_LENGTH = "logit_normal", 0.0, 1.5, 1.29, 2048


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    """The script's loss with prior preservation on one instance and one class image (pixels (2, 3, H, W) in [-1, 1],
    instance first), its default flags: each prompt's packed conditioning from pipe.encode_prompt for the image's
    token grid (2048 text positions); the VAE's mode, each 2x2 patch one token (row, column, channel), normalised
    by the VAE's batch-norm statistics; the noise; a sigma per image from the logit-normal density around the
    resolution-shifted mean, used as it is; the straight path behind 2048 zero text positions; the transformer at
    time 1 - sigma; its image positions against latents - noise; the instance mean plus prior_loss_weight x the
    class mean, each weighted (logit_normal: 1). (Our step draws the posterior's sample, the mode within 3e-7,
    before the noise: the same numbers are drawn here first.)"""
    import torch
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _resolution_aware_mu
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    vae, transformer, device = models.vae, models.denoiser, pixels.device
    patch = pipe.patch_size
    grid_h, grid_w = (side // (pipe.vae_scale_factor * patch) for side in pixels.shape[-2:])
    with torch.no_grad():
        bundles = [pipe.encode_prompt(prompt=p, grid_h=grid_h, grid_w=grid_w, max_sequence_length=MAX_SEQUENCE_LENGTH,
                                      device=device) for p in (instance_prompt, class_prompt)]
    prompt_embeds, position_ids, segment_ids, indicator = (torch.cat(parts) for parts in zip(*bundles))

    latents = vae.encode(pixels).latent_dist.mode()
    torch.randn(latents.shape)  # (see above)
    b, c, h, w = latents.shape
    # the script's patchify_latents: (B, C, H, W) -> (B, tokens, patch x patch x C), the channel varying fastest
    model_input = latents.view(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1)
    model_input = model_input.reshape(b, (h // patch) * (w // patch), patch * patch * c)
    mean = vae.bn.running_mean.view(1, 1, -1)
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, 1, -1)
    model_input = (model_input - mean) / std

    noise = torch.randn_like(model_input)
    image_h, image_w = h * pipe.vae_scale_factor, w * pipe.vae_scale_factor
    sigmas = compute_density_for_timestep_sampling(SCHEME, b, _resolution_aware_mu(image_h, image_w, LOGIT_MEAN),
                                                   LOGIT_STD, MODE_SCALE, device=device)
    sigmas = sigmas.to(model_input.dtype).view(b, 1, 1)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    packed = torch.cat([noisy.new_zeros(b, MAX_SEQUENCE_LENGTH, noisy.shape[-1]), noisy], dim=1)
    pred = transformer(hidden_states=packed, timestep=(1.0 - sigmas).reshape(b), encoder_hidden_states=prompt_embeds,
                       position_ids=position_ids, segment_ids=segment_ids, indicator=indicator,
                       return_dict=False)[0][:, MAX_SEQUENCE_LENGTH:]
    weighting = compute_loss_weighting_for_sd3(SCHEME, sigmas)
    target = model_input - noise

    def weighted_mean(rows):
        return (weighting[rows].float() * (pred[rows].float() - target[rows].float()) ** 2).reshape(1, -1).mean(1).mean()

    return weighted_mean(slice(0, 1)) + prior_loss_weight * weighted_mean(slice(1, 2))

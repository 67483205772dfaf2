"""The family contract's reference (tests/unit/test_family_contract.py): the loss diffusers'
train_dreambooth_lora_hidream.py computes on a batch of one instance and one class image, written from its steps
with the pipeline's own functions, drawing its random numbers in the order our step draws them (the posterior's
sample, the noise, the timesteps)."""


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    """The script's loss with prior preservation (its defaults: weighting "none", --max_sequence_length 128): the
    prompts encoded by the pipeline's encode_prompt, the instance's states then the class's (Llama's along its
    second axis), the VAE's posterior sampled, shifted and scaled, noise, a uniform index into the schedule of a
    FlowMatchEulerDiscreteScheduler of the folder's scheduler config shifted by 3.0, the straight path at its
    sigma, the transformer (loaded with force_inference_output: ours is) on the noisy latents, its output negated,
    the velocity target, the instance and prior means. pixels: (2, 3, H, W) in [-1, 1], the instance first."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    vae, transformer = models.vae, models.denoiser
    assert transformer.config.force_inference_output  # (as the script loads it)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=3.0)

    with torch.no_grad():
        encoded = [pipe.encode_prompt(prompt=p, max_sequence_length=128) for p in (instance_prompt, class_prompt)]
    t5 = torch.cat([e[0] for e in encoded])
    llama = torch.cat([e[2] for e in encoded], dim=1)
    pooled = torch.cat([e[4] for e in encoded])

    model_input = vae.encode(pixels.to(vae.dtype)).latent_dist.sample()
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.randn_like(model_input)
    rows = model_input.shape[0]
    u = compute_density_for_timestep_sampling(weighting_scheme="none", batch_size=rows, logit_mean=0.0, logit_std=1.0,
                                              mode_scale=1.29)
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    sigmas = torch.stack([scheduler.sigmas[(scheduler.timesteps == t).nonzero().item()] for t in timesteps])
    sigmas = sigmas.view(-1, 1, 1, 1).to(model_input.dtype)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    pred = -transformer(hidden_states=noisy, encoder_hidden_states_t5=t5, encoder_hidden_states_llama3=llama,
                        pooled_embeds=pooled, timesteps=timesteps, return_dict=False)[0]
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    (pred, pred_prior), (target, target_prior) = pred.chunk(2), target.chunk(2)
    (weight, weight_prior) = weighting.chunk(2)

    def mean(w, p, t):
        return torch.mean((w.float() * (p.float() - t.float()) ** 2).reshape(t.shape[0], -1), 1).mean()

    return mean(weight, pred, target) + prior_loss_weight * mean(weight_prior, pred_prior, target_prior)

"""Z-Image's contract (tests/unit/test_family_contract.py): the loss of diffusers'
train_dreambooth_lora_z_image.py on a batch, which the test holds ours to."""

from dreambooth.families.shared import scripts


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    """The loss of diffusers' train_dreambooth_lora_z_image.py on a batch of instance and class pixels, written from
    its steps: the VAE's mode shifted and scaled, noise, a uniform timestep index into the scheduler's schedule, the
    straight path, the transformer on each image as a one-frame list item with the prompts' own states and the
    timestep 1 - t, its prediction negated, the velocity target, the instance and prior means. (Our step draws the
    posterior's sample, the mode within 3e-7, before the noise: the reference draws the same numbers first.)"""
    import torch

    vae, scheduler = models.vae, models.scheduler
    latents = vae.encode(pixels).latent_dist.mode()
    torch.randn(latents.shape)  # (see above)
    latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.randn_like(latents)
    timesteps, sigmas = scripts.uniform_schedule_draw(scheduler, latents.shape[0])
    noisy = (1.0 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise
    with torch.no_grad():
        states = [pipe.encode_prompt(p, do_classifier_free_guidance=False)[0][0] for p in (instance_prompt, class_prompt)]
    out = models.denoiser(list(noisy.unsqueeze(2).unbind(dim=0)), (1000 - timesteps) / 1000, states, return_dict=False)[0]
    pred = -torch.stack(out, dim=0).squeeze(2)
    return scripts.prior_preserving_mse(pred, noise - latents, prior_loss_weight)

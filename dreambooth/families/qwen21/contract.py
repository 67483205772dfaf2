"""Qwen-Image 2.1's contract (tests/unit/test_family_contract.py): the loss of diffusers'
train_dreambooth_lora_qwenimage21.py on a batch, which the test holds ours to."""

from dreambooth.families.shared import scripts


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    """The loss of diffusers' train_dreambooth_lora_qwenimage21.py on a batch of instance and class pixels, written
    from its steps: the images as RGBA (opaque), the VAE's sample of a one-frame video normalised per channel, noise,
    a uniform timestep index into the scheduler's schedule, the straight path, the transformer on the latents
    flattened to tokens after the prompts' states and masks (each padded to the longer; no mask when nothing is
    padded), one slot per 2x2 latents, the image's tail of its output, the velocity target, the instance and prior
    means."""
    import torch
    from diffusers import QwenImage21Pipeline

    vae = models.vae
    rgba = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1).unsqueeze(2)
    latents, noise, timesteps, noisy = scripts.one_frame_flow_draw(vae, models.scheduler, rgba)
    rows, channels, _, h, w = latents.shape
    with torch.no_grad():
        pairs = [pipe.encode_prompt(prompt=p)[:2] for p in (instance_prompt, class_prompt)]
    length = max(states.shape[1] for states, _ in pairs)
    states = torch.cat([torch.nn.functional.pad(s, (0, 0, 0, length - s.shape[1])) for s, _ in pairs])
    masks = torch.cat([torch.nn.functional.pad(torch.ones(s.shape[:2], dtype=torch.long) if m is None else m,
                                               (0, length - s.shape[1])) for s, m in pairs])
    masks = None if masks.all() else masks
    packed = QwenImage21Pipeline._pack_latents(noisy, rows, channels, h, w)
    img_mask = torch.cat([torch.zeros(rows, length, dtype=torch.bool), torch.ones(rows, h * w // 4, dtype=torch.bool)],
                         dim=1)
    pred = models.denoiser(hidden_states=packed, encoder_hidden_states=states, encoder_hidden_states_mask=masks,
                           timestep=timesteps / 1000, img_shapes=[[(1, h, w)]] * rows, img_mask=img_mask,
                           return_dict=False)[0]
    pred = pred[:, -packed.shape[1]:]
    scale = 2 ** len(vae.temperal_downsample)
    pred = QwenImage21Pipeline._unpack_latents(pred, h * scale, w * scale, scale)
    return scripts.prior_preserving_mse(pred, noise - latents, prior_loss_weight)

"""Qwen-Image's contract (tests/unit/test_family_contract.py): the loss of diffusers'
train_dreambooth_lora_qwen_image.py on a batch, which the test holds ours to."""

from dreambooth.families.shared import scripts


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    """The loss of diffusers' train_dreambooth_lora_qwen_image.py on a batch of instance and class pixels, written
    from its steps: the VAE's sample of a one-frame video normalised per channel, noise, a uniform timestep index
    into the scheduler's schedule, the straight path, the transformer on 2x2-packed latents with the prompts' states
    and masks (each padded to the longer), the velocity target, the instance and prior means."""
    import torch
    from diffusers import QwenImagePipeline

    vae = models.vae
    latents, noise, timesteps, noisy = scripts.one_frame_flow_draw(vae, models.scheduler, pixels.unsqueeze(2))
    rows, _, _, h, w = latents.shape
    with torch.no_grad():
        (inst, inst_mask), (cls, cls_mask) = (pipe.encode_prompt([p]) for p in (instance_prompt, class_prompt))
    inst_mask, cls_mask = (torch.ones(x.shape[:2], dtype=torch.long) if m is None else m
                           for x, m in ((inst, inst_mask), (cls, cls_mask)))  # (None: all of it, the pipeline's way)
    length = max(inst.shape[1], cls.shape[1])
    states = torch.cat([torch.nn.functional.pad(x, (0, 0, 0, length - x.shape[1])) for x in (inst, cls)])
    masks = torch.cat([torch.nn.functional.pad(m, (0, length - m.shape[1])) for m in (inst_mask, cls_mask)])
    packed = QwenImagePipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), rows, latents.shape[1], h, w)
    pred = models.denoiser(hidden_states=packed, encoder_hidden_states=states, encoder_hidden_states_mask=masks,
                           timestep=timesteps / 1000, img_shapes=[(1, h // 2, w // 2)] * rows, return_dict=False)[0]
    scale = 2 ** len(vae.temperal_downsample)
    pred = QwenImagePipeline._unpack_latents(pred, h * scale, w * scale, scale)
    return scripts.prior_preserving_mse(pred, noise - latents, prior_loss_weight)

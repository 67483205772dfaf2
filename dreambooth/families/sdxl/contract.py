"""SDXL's contract (tests/unit/test_family_contract.py): the loss of diffusers' train_dreambooth_lora_sdxl.py on a
batch, which the test holds ours to: both encoders' penultimate states side by side, the second's pooled output and
each image's size and crop (the whole square, uncropped) as the UNet's added conditions."""

from dreambooth.families.shared import scripts


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    import torch

    with torch.no_grad():
        encoded = [pipe.encode_prompt(p, do_classifier_free_guidance=False) for p in (instance_prompt, class_prompt)]
    states, pooled = torch.cat([e[0] for e in encoded]), torch.cat([e[2] for e in encoded])
    size = pixels.shape[-1]
    time_ids = torch.tensor([[size, size, 0, 0, size, size]] * pixels.shape[0], dtype=states.dtype)
    return scripts.denoising_script_loss(models, pixels, states, prior_loss_weight,
                                         added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids})

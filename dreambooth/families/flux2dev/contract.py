"""FLUX.2 [dev]'s contract (tests/unit/test_family_contract.py): the loss of diffusers' train_dreambooth_lora_flux2.py
on a batch, the family's guidance value an input of the transformer, which the test holds ours to."""


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    from diffusers import Flux2Pipeline

    from dreambooth.families.shared import flux2base

    return flux2base.script_reference_loss(Flux2Pipeline, models.family.guidance_scale)(
        models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight)

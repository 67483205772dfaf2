"""FLUX.2 [klein]'s contract (tests/unit/test_family_contract.py): the loss of diffusers'
train_dreambooth_lora_flux2_klein.py on a batch (no guidance input), which the test holds ours to."""


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    from diffusers import Flux2KleinPipeline

    from dreambooth.families.shared import flux2base

    return flux2base.script_reference_loss(Flux2KleinPipeline, None)(models, pixels, instance_prompt, class_prompt,
                                                                     pipe, prior_loss_weight)

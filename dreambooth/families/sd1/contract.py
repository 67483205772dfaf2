"""SD 1.x's contract (tests/unit/test_family_contract.py): the loss of diffusers' train_dreambooth.py on a batch,
which the test holds ours to."""

from dreambooth.families.shared import scripts


def reference_loss(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
    states = scripts.clip_states(pipe, (instance_prompt, class_prompt))
    return scripts.denoising_script_loss(models, pixels, states, prior_loss_weight)

"""The family contract, run in-process for every family of the table. What it needs that only the family knows is in
the family's folder, contract.py: its diffusers DreamBooth script's loss, written from that script's steps. Its tiny
model builds and is read as its family, the training loss is the script's on the same draws, and LoRA
adapters trained two steps load in the family's diffusers pipeline and change the image it draws. (Every family's
checkpoint resumed to the uninterrupted adapters: tests/unit/test_checkpoint.py; its released parameter counts
built on the meta device: tests/unit/test_memory.py; both parametrized over the table too.)"""

import importlib

import familysteps
import numpy as np
import pytest
import torch

from dreambooth import families

CPU = torch.device("cpu")


def contract_of(name):
    return importlib.import_module(f"{families.__name__}.{name}.contract")


@pytest.fixture(params=list(families.FAMILIES))
def family_model(request, tiny_model_of):
    """(family, its tiny model's folder, its diffusers pipeline of that model)."""
    import diffusers

    family = families.FAMILIES[request.param]
    model = tiny_model_of(family.random.arch)
    return family, model, getattr(diffusers, family.pipeline).from_pretrained(model)


def test_the_tiny_model_builds_and_is_read_as_its_family(family_model):
    family, model, pipe = family_model
    assert families.family_of(model) is family and families.require(model, "train") is family
    families.check_model_dir(model)
    assert type(pipe).__name__ == family.pipeline


def test_the_training_loss_is_diffusers_scripts_on_the_same_draws(family_model, make_plan):
    family, model, pipe = family_model
    ours, expected = familysteps.losses(model, make_plan, contract_of(family.name).reference_loss, pipe)
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, expected)


def test_lora_adapters_of_two_steps_load_in_the_pipeline_and_change_its_image(family_model, train_tiny, tmp_path):
    """Trained as train.py --use_lora trains them, saved as it saves them, loaded by the pipeline's own
    load_lora_weights; the image drawn with the same seed changes."""
    from dreambooth.generation import drawing
    from dreambooth.models import outputs

    family, model, pipe = family_model
    plan, state, losses = train_tiny(model, 2, use_lora=True, learning_rate=1e-2, output_dir=str(tmp_path / "lora"))
    assert all(np.isfinite(losses))
    outputs.save_pipeline(state.models, plan)
    settings = drawing.settings_for(drawing.ImageSettings(num_inference_steps=2), family, model)

    def draw():
        images, _ = drawing.generate_batch(pipe, ["photo of unqtkn toy"], [3], settings, family.pipeline_kwargs(),
                                           family.guidance_argument)
        return np.asarray(images[0], dtype=int)

    before = draw()
    pipe.load_lora_weights(plan.output_dir)
    assert np.abs(draw() - before).max() > 0

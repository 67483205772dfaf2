"""validation.py: samples during training, without disturbing training."""

import os

import numpy as np
import torch
from PIL import Image

from dreambooth.generation import drawing
from dreambooth.generation import imaging
from dreambooth.models import networks
from dreambooth.training import validation

CPU = torch.device("cpu")


def test_a_round_draws_what_generate_draws_and_leaves_training_as_it_was(make_plan, tiny_model, tmp_path):
    plan = make_plan(validation_prompts=("photo of unqtkn toy", "a toy"), num_validation_images=2,
                     validation_inference_steps=3)
    nets = networks.setup_models(plan, CPU, CPU, distributed=False)
    sampler = validation.Sampler(nets, plan, amp_dtype=None)
    torch.manual_seed(11)
    rng = torch.get_rng_state()
    for step in (5, 10):
        timeline, images = validation.run_round(sampler, step, rank=0, world=1, run_dir=str(tmp_path))
    assert torch.equal(torch.get_rng_state(), rng)  # the training noise stream is untouched
    assert nets.denoiser.training and nets.text_encoder.training
    # (its pipeline holds no text encoder: diffusers draws on its first module by name that is on a GPU, which would
    # be a trained text encoder on a worker's second card; the denoiser's device it is)
    pipe = sampler.pipeline()
    assert all(pipe.components[name] is None for name in plan.family.text_encoders) and pipe.device == CPU
    names = ["photo-of-unqtkn-toy-00000.png", "photo-of-unqtkn-toy-00001.png", "a-toy-00000.png", "a-toy-00001.png"]
    assert list(images) == names
    for step in (5, 10):
        assert sorted(os.listdir(tmp_path / "validation" / f"step-{step}")) == sorted(names)
    with Image.open(timeline) as sheet:
        assert timeline == str(tmp_path / "validation" / validation.TIMELINE)
        assert sheet.size == (imaging.LABEL_WIDTH + 4 * 128, 2 * 128)
        # each row named on its left ("step 5", "step 10"): dark text on the white strip, the two names unlike
        strips = [np.asarray(sheet.convert("L").crop((0, row * 128, imaging.LABEL_WIDTH, (row + 1) * 128)))
                  for row in (0, 1)]
        assert all((strip < 128).any() for strip in strips) and not np.array_equal(*strips)
    # Image 1 of "a toy" is the one generate.py draws from the same weights, seed and steps.
    pipe = drawing.load_pipeline(tiny_model, CPU)
    drawn, _ = drawing.generate_batch(pipe, ["a toy"], [drawing.image_seed(plan.seed, "a toy", 1)],
                                      drawing.ImageSettings(num_inference_steps=3))
    assert np.abs(np.asarray(drawn[0], dtype=int) - np.asarray(images["a-toy-00001.png"], dtype=int)).max() <= 1


def test_lora_bf16_weights_sample_under_autocast(make_plan, tmp_path):
    """The GPU configuration (bf16 frozen weights, fp32 adapters, autocast) sampled on CPU."""
    plan = make_plan(use_lora=True, mixed_precision="bf16", validation_prompts=("a toy",), num_validation_images=1,
                     validation_inference_steps=2)
    nets = networks.setup_models(plan, CPU, CPU, distributed=False)
    _, images = validation.run_round(validation.Sampler(nets, plan, torch.bfloat16), 1, 0, 1, str(tmp_path))
    pixels = np.asarray(images["a-toy-00000.png"])
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0


def test_frozen_text_encoders_leave_the_device_and_samples_and_steps_go_on(make_plan, tmp_path):
    """With frozen encoders (--no-train_text_encoder, states computed once) the worker releases them after the
    samples' prompts are encoded: moved here to the meta device, where any read of them would fail, the
    samples are the same images and a training step still runs."""
    from dreambooth.generation import prompts
    from dreambooth.training import conditioning
    from dreambooth.training import steps

    plan = make_plan(train_text_encoder=False, validation_prompts=("a toy",), num_validation_images=1,
                     validation_inference_steps=2)
    assert plan.text_encoded_once
    nets = networks.setup_models(plan, CPU, CPU, distributed=False)
    ids = prompts.prompt_ids(plan.model_dir, ["photo of unqtkn toy"], "photo of a toy", plan.family)
    encoded = conditioning.step_prompts(plan.family, nets.text_encoders(), plan, ids, CPU)
    sampler = validation.Sampler(nets, plan, amp_dtype=None)
    _, before = validation.run_round(sampler, 1, 0, 1, str(tmp_path / "a"))
    nets.release_text_encoders("meta")
    assert nets.text_encoders_released and all(p.is_meta for p in nets.text_encoder.parameters())
    _, after = validation.run_round(sampler, 1, 0, 1, str(tmp_path / "b"))
    assert np.array_equal(np.asarray(before["a-toy-00000.png"]), np.asarray(after["a-toy-00000.png"]))
    state = steps.make_train_state(nets, plan)
    pixels = torch.randint(0, 255, (1, 64, 64, 3), dtype=torch.uint8)
    loss, _, _ = steps.train_step(state, [{"instance_pixels": pixels, "class_pixels": pixels}], encoded, 1.0, 1.0)
    assert torch.isfinite(loss)

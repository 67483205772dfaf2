"""Model families (families.py): read from the model's files, and SD 2.x v-prediction end to end
on the tiny SD 2.x model: train (full and LoRA), resume, generate at its own resolution."""

import json
import os
import shutil

import pytest
import torch

import families
import utils


def test_the_family_is_read_from_the_model_folder(tiny_model, tiny_sd2v_model, tmp_path):
    assert families.family_of(tiny_model).name == "sd1"
    assert families.family_of(tiny_sd2v_model).name == "sd2"
    assert families.prediction_type(tiny_model) == "epsilon"
    assert families.prediction_type(tiny_sd2v_model) == "v_prediction"
    assert utils.native_resolution(tiny_sd2v_model) == 96 and utils.native_resolution(tiny_model) == 64

    # An SDXL folder (its pipeline class) and a pipeline of no family: one line each, before any weight loads.
    xl = shutil.copytree(tiny_model, tmp_path / "xl")
    index = json.loads((xl / "model_index.json").read_text())
    (xl / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionXLPipeline"}))
    assert families.family_of(str(xl)).name == "sdxl"
    with pytest.raises(utils.UserError, match="is an SDXL model .*not supported yet"):
        utils.check_model_dir(str(xl))
    (xl / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(utils.UserError, match="is a FluxPipeline model; this suite trains SD 1.x"):
        families.family_of(str(xl))


def test_the_sd2_v_model_trains_towards_v(tiny_sd2v_model):
    """Its training scheduler predicts v: the target of a step is the velocity, not the noise."""
    from diffusers import DDPMScheduler

    import steps

    scheduler = DDPMScheduler.from_pretrained(tiny_sd2v_model, subfolder="scheduler")
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    timesteps = torch.tensor([10, 900])
    target = steps.diffusion_target(scheduler, latents, noise, timesteps)
    alpha = scheduler.alphas_cumprod[timesteps].sqrt().view(-1, 1, 1, 1)
    sigma = (1 - scheduler.alphas_cumprod[timesteps]).sqrt().view(-1, 1, 1, 1)
    assert torch.allclose(target, alpha * noise - sigma * latents, atol=1e-6)


def test_sd2_v_trains_resumes_and_draws_at_its_own_resolution(ray_session, tiny_sd2v_model, toy_images, tmp_path):
    """generate.py draws its class images at 96 px (the model's size, not SD 1.x's); train.py trains
    on them (full, then resumed past its end; LoRA); the outputs load as SD 2.x v-prediction pipelines
    and draw again."""
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    import generate
    import train

    class_dir = tmp_path / "class"
    generate.main(["--model_dir", tiny_sd2v_model, "--output_dir", str(class_dir), "--prompts", "photo of a toy",
                   "--num_samples_per_prompt", "2", "--num_inference_steps", "2"])
    with Image.open(class_dir / "photo-of-a-toy-00000.png") as image:
        assert image.size == (96, 96)
    common = ["--model_dir", tiny_sd2v_model, "--instance_images_dir", toy_images,
              "--instance_prompt", "photo of unqtkn toy", "--class_images_dir", str(class_dir),
              "--class_prompt", "photo of a toy", "--num_workers", "1", "--lr", "1e-4",
              "--storage_path", str(tmp_path / "runs"), "--checkpointing_steps", "2"]
    out = tmp_path / "tuned"
    first = train.main([*common, "--output_dir", str(out), "--max_train_steps", "2"])
    assert first.metrics["step"] == 2 and first.metrics["loss"] > 0
    resumed = train.main([*common, "--output_dir", str(out), "--max_train_steps", "3",
                          "--resume_from_checkpoint", "latest"])
    assert resumed.metrics["step"] == 3
    tuned = StableDiffusionPipeline.from_pretrained(str(out), safety_checker=None)
    base = StableDiffusionPipeline.from_pretrained(tiny_sd2v_model, safety_checker=None)
    assert tuned.scheduler.config.prediction_type == "v_prediction"
    assert tuned.text_encoder.config.hidden_act == "gelu" and tuned.unet.config.use_linear_projection
    assert any(not torch.equal(v, base.unet.state_dict()[k]) for k, v in tuned.unet.state_dict().items())

    lora = tmp_path / "lora"
    train.main([*common, "--output_dir", str(lora), "--max_train_steps", "2", "--use_lora"])
    drawn = tmp_path / "drawn"
    generate.main(["--model_dir", tiny_sd2v_model, "--lora_weights_dir", str(lora), "--output_dir", str(drawn),
                   "--prompts", "photo of unqtkn toy", "--num_samples_per_prompt", "1", "--num_inference_steps", "2"])
    with Image.open(drawn / "photo-of-unqtkn-toy-00000.png") as image:
        assert image.size == (96, 96)
    assert os.path.isfile(lora / utils.LORA_WEIGHTS_FILE)

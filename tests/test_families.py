"""Model families (families.py): read from the model's files, and SD 2.x v-prediction end to end
on the tiny SD 2.x model: train (full and LoRA), resume, generate at its own resolution."""

import json
import os
import shutil

import pytest
import torch

import families
import utils


def test_the_family_is_read_from_the_model_folder(tiny_model, tiny_sd2v_model, tiny_sdxl_model, tmp_path):
    assert [families.family_of(m).name for m in (tiny_model, tiny_sd2v_model, tiny_sdxl_model)] == ["sd1", "sd2", "sdxl"]
    assert families.prediction_type(tiny_model) == "epsilon"
    assert families.prediction_type(tiny_sd2v_model) == "v_prediction"
    assert [utils.native_resolution(m) for m in (tiny_model, tiny_sd2v_model, tiny_sdxl_model)] == [64, 96, 128]
    for model in (tiny_model, tiny_sd2v_model, tiny_sdxl_model):
        utils.check_model_dir(model)

    # What the suite does not do with a family yet is refused in one line, before any weight loads.
    with pytest.raises(utils.UserError, match=r"training an SDXL model \(.*\) is not supported yet: this version "
                                              "does it for SD 1.x, SD 2.x"):
        families.require(tiny_sdxl_model, "train")
    assert families.require(tiny_sdxl_model, "draw").name == families.require(tiny_sdxl_model, "export").name == "sdxl"
    # A folder that says SDXL must have SDXL's parts; a pipeline of no family is named.
    xl = shutil.copytree(tiny_model, tmp_path / "xl")
    index = json.loads((xl / "model_index.json").read_text())
    (xl / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(utils.UserError, match="missing its 'text_encoder_2' component"):
        utils.check_model_dir(str(xl))
    (xl / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(utils.UserError, match="is a FluxPipeline model; this suite runs SD 1.x"):
        utils.check_model_dir(str(xl))


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


def test_sdxl_draws_on_the_actor_pool_and_training_it_is_refused_in_one_line(ray_session, tiny_sdxl_model,
                                                                           toy_images, tmp_path):
    """generate.py draws with StableDiffusionXLPipeline at the model's 128 px; train.py stops before
    Ray Train starts, naming what this version trains."""
    from PIL import Image

    import generate
    import train

    out = tmp_path / "drawn"
    generate.main(["--model_dir", tiny_sdxl_model, "--output_dir", str(out), "--prompts", "photo of a toy, on a table",
                   "--num_samples_per_prompt", "2", "--num_inference_steps", "2"])
    for i in range(2):
        with Image.open(out / f"photo-of-a-toy-on-a-table-{i:05d}.png") as image:
            assert image.size == (128, 128)
    with pytest.raises(utils.UserError, match="training an SDXL model"):
        train.main(["--model_dir", tiny_sdxl_model, "--output_dir", str(tmp_path / "tuned"),
                    "--instance_data_dir", toy_images, "--instance_prompt", "photo of unqtkn toy"])
    assert not os.path.exists(tmp_path / "tuned")

"""Model families (families/): read from the model's files, and SD 2.x v-prediction end to end
on the tiny SD 2.x model: train (full and LoRA), resume, generate at its own resolution."""

import json
import os
import shutil

import pytest
import torch
from support import NEW_FAMILY
from support import draw_here
from support import vae_of_its_own

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth.families import sdxl as family_sdxl
from dreambooth.training import conditioning


def test_the_family_is_read_from_the_model_folder(tiny_model, tiny_sd2v_model, tiny_sdxl_model, tmp_path,
                                                   monkeypatch):
    assert [families.family_of(m).name for m in (tiny_model, tiny_sd2v_model, tiny_sdxl_model)] == ["sd1", "sd2", "sdxl"]
    assert families.prediction_type(tiny_model) == "epsilon"
    assert families.prediction_type(tiny_sd2v_model) == "v_prediction"
    assert [families.native_resolution(m) for m in (tiny_model, tiny_sd2v_model, tiny_sdxl_model)] == [64, 96, 128]
    for model in (tiny_model, tiny_sd2v_model, tiny_sdxl_model):
        families.check_model_dir(model)

    assert all(families.require(tiny_sdxl_model, action).name == "sdxl" for action in ("draw", "train", "export"))
    # What the suite does not do with a family (a later one, while it is built) is refused in one line.
    class DrawOnly(family_sdxl.SDXL):
        supports = frozenset({"draw"})

    monkeypatch.setitem(families.FAMILIES, "sdxl", DrawOnly())
    with pytest.raises(errors.UserError, match=r"training an SDXL model \(.*\) is not supported yet: this version "
                                              "does it for SD 1.x, SD 2.x"):
        families.require(tiny_sdxl_model, "train")
    # A folder that says SDXL must have SDXL's parts; a pipeline of no family is named.
    xl = shutil.copytree(tiny_model, tmp_path / "xl")
    index = json.loads((xl / "model_index.json").read_text())
    (xl / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(errors.UserError, match="missing its 'text_encoder_2' component"):
        families.check_model_dir(str(xl))
    (xl / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline"}))
    with pytest.raises(errors.UserError, match="is a FluxKontextPipeline model; this suite runs SD 1.x"):
        families.check_model_dir(str(xl))


def test_the_sd2_v_model_trains_towards_v(tiny_sd2v_model):
    """Its training scheduler predicts v: the target of a step is the velocity, not the noise."""
    from diffusers import DDPMScheduler

    from dreambooth.families.shared import objectives

    scheduler = DDPMScheduler.from_pretrained(tiny_sd2v_model, subfolder="scheduler")
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    timesteps = torch.tensor([10, 900])
    target = objectives.diffusion_target(scheduler, latents, noise, timesteps)
    alpha = scheduler.alphas_cumprod[timesteps].sqrt().view(-1, 1, 1, 1)
    sigma = (1 - scheduler.alphas_cumprod[timesteps]).sqrt().view(-1, 1, 1, 1)
    assert torch.allclose(target, alpha * noise - sigma * latents, atol=1e-6)


def drawn_size(folder, name):
    from PIL import Image

    with Image.open(folder / name) as image:
        return image.size


def class_images_drawn(model, tmp_path):
    """Two class images drawn as generate.py draws them with model (its folder) and no size given (settings_for: the
    model's own size), in this process (conftest.draw_here)."""
    from dreambooth.generation import drawing

    class_dir = tmp_path / "class"
    draw_here(model, class_dir, ["photo of a toy"], 2, drawing.ImageSettings(num_inference_steps=2))
    return class_dir


def drawn_here(model, lora_dir, folder):
    """The size of one image drawn with lora_dir's adapters on model, in this process by generate's own drawing (the
    actor pool's class: drawing.make_images_of(here=True), which test_generate checks draws the pool's files)."""
    from dreambooth.generation import drawing
    from dreambooth.models import outputs

    settings = drawing.ImageSettings(num_inference_steps=2)
    job = drawing.top_up(str(folder), outputs.ModelRef(model, str(lora_dir)), ["photo of unqtkn toy"], 1, settings,
                         False)
    drawing.make_images_of([job], settings, batch_size=1, num_actors=1, here=True)
    return drawn_size(folder, "photo-of-unqtkn-toy-00000.png")


def test_sd2_v_trains_and_draws_at_its_own_resolution(tiny_sd2v_model, tmp_path, train_tiny):
    """generate.py's drawing makes its class images at 96 px (the model's size, not SD 1.x's); a full fine-tune's steps and a
    LoRA's (as a worker takes them, without Ray: every run on Ray is SD 1.x's code too) save a pipeline that loads as
    SD 2.x v-prediction, and adapters that draw again at 96 px. (A run resumed past its end, whose checkpoint holds
    the same UNet and text encoder as SD 1.x's: test_recovery's test_seeded_run_cut_and_resumed_with_every_gpu_option,
    SD 1.x and SDXL.)"""
    from diffusers import StableDiffusionPipeline

    from dreambooth.models import outputs

    class_dir = class_images_drawn(tiny_sd2v_model, tmp_path)
    assert drawn_size(class_dir, "photo-of-a-toy-00000.png") == (96, 96)
    out = tmp_path / "tuned"
    plan, state, losses = train_tiny(tiny_sd2v_model, steps_taken=2, output_dir=str(out), learning_rate=1e-3)
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    outputs.save_pipeline(state.models, plan)
    tuned = StableDiffusionPipeline.from_pretrained(str(out), safety_checker=None)
    base = StableDiffusionPipeline.from_pretrained(tiny_sd2v_model, safety_checker=None)
    assert tuned.scheduler.config.prediction_type == "v_prediction"
    assert tuned.text_encoder.config.hidden_act == "gelu" and tuned.unet.config.use_linear_projection
    assert any(not torch.equal(v, base.unet.state_dict()[k]) for k, v in tuned.unet.state_dict().items())

    lora = tmp_path / "lora"
    plan, state, _ = train_tiny(tiny_sd2v_model, steps_taken=2, output_dir=str(lora), use_lora=True)
    outputs.save_pipeline(state.models, plan)
    assert os.path.isfile(lora / files.LORA_WEIGHTS_FILE)
    assert drawn_here(tiny_sd2v_model, lora, tmp_path / "drawn") == (96, 96)


def test_sdxl_time_ids_are_each_photos_true_size_and_crop():
    """A 3:2 photo (600 x 400 before the resize to 24 x 16): each view's six numbers are its original
    height and width, the crop's top-left in the stored image as the view shows it, the trained
    size; the view's pixels are exactly that crop (mirrored when flipped)."""
    import numpy as np

    from dreambooth.training import dataset

    stored = np.random.default_rng(0).integers(0, 255, (16, 24, 3), dtype=np.uint8)
    batch = {"instance": np.zeros(8, dtype=np.int64), "seed": np.arange(8)}
    out = dataset.make_views(batch, [stored], None, 16, False, True, sizes={"instance": [(400, 600)], "class": []})
    assert out["instance_time_ids"].shape == (8, 6) and out["instance_time_ids"].dtype == np.float32
    lefts, flips = set(), set()
    for pixels, ids in zip(out["instance_pixels"], out["instance_time_ids"]):
        height, width, top, left, target_h, target_w = ids.astype(int).tolist()
        assert (height, width, top, target_h, target_w) == (400, 600, 0, 16, 16)
        plain = stored[top:top + 16, left:left + 16]
        mirrored = stored[:, ::-1][top:top + 16, left:left + 16]
        flips.add(np.array_equal(pixels, mirrored) and not np.array_equal(pixels, plain))
        assert np.array_equal(pixels, plain) or np.array_equal(pixels, mirrored)
        lefts.add(left)
    assert len(lefts) > 1 and flips == {True, False}  # random crops, some flipped
    # Cached latents hold the center crop and its mirror image.
    views = dataset.latent_view_time_ids((400, 600), (16, 24), 16, 2)
    assert views.tolist() == [[400, 600, 0, 4, 16, 16], [400, 600, 0, 4, 16, 16]]
    assert dataset.latent_view_time_ids((30, 50), (16, 27), 16, 2)[:, 3].tolist() == [5, 6]


def test_the_sdxl_unet_is_conditioned_on_each_rows_size_and_crop(tiny_sdxl_model, make_plan):
    """batch_loss feeds the pooled text embedding and the batch's time ids to the UNet: other time
    ids give another loss for the same noise; a stream without them is the uncropped square."""
    from dreambooth.generation import prompts as prompts_lib
    from dreambooth.models import networks
    from dreambooth.training import steps

    plan = make_plan(model_dir=tiny_sdxl_model, resolution=128)
    ids = prompts_lib.prompt_ids(tiny_sdxl_model, ["photo of unqtkn toy"], "photo of a toy")
    nets = networks.setup_models(plan, torch.device("cpu"), torch.device("cpu"), distributed=False)
    prompts = conditioning.step_prompts(plan.family, nets.text_encoders(), plan, ids, torch.device("cpu"))
    assert prompts.instance.shape == (1, 2, 77)  # both tokenizers' ids
    pixels = torch.randint(0, 255, (1, 128, 128, 3), dtype=torch.uint8)
    square = torch.tensor([[128.0, 128, 0, 0, 128, 128]])

    def loss(**time_ids):
        torch.manual_seed(0)
        with torch.no_grad():
            return steps.batch_loss(nets, {"instance_pixels": pixels, "class_pixels": pixels, **time_ids},
                                    prompts, 1.0)[0]

    cropped = torch.tensor([[400.0, 600, 0, 32, 128, 128]])
    assert loss(instance_time_ids=square, class_time_ids=square) == loss()
    assert loss(instance_time_ids=cropped, class_time_ids=square) != loss()


def test_sdxl_trains_the_unet_and_both_text_encoders_with_a_vae_of_its_own(tiny_sdxl_model, train_tiny, tmp_path):
    """A full SDXL fine-tune's steps (as a worker takes them, without Ray) with a VAE of its own (as SDXL's fp16-fix
    one is): the UNet and both text encoders trained, the VAE kept as given in the saved model, which loads as
    StableDiffusionXLPipeline. (On Ray, with validation samples, the same VAE flag and a resume: test_recovery's
    test_seeded_run_cut_and_resumed_with_every_gpu_option[sdxl]; LoRA on all three, exported to kohya's SDXL names:
    test_sdxl_lora_exports_in_kohyas_names_that_diffusers_loads_to_the_same_weights.)"""
    from diffusers import AutoencoderKL
    from diffusers import StableDiffusionXLPipeline

    from dreambooth.models import outputs

    own_vae = vae_of_its_own(tiny_sdxl_model, tmp_path / "own-vae")
    out = tmp_path / "tuned"
    plan, state, losses = train_tiny(tiny_sdxl_model, steps_taken=2, output_dir=str(out), vae_dir=str(own_vae))
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    outputs.save_pipeline(state.models, plan)
    tuned, base = (StableDiffusionXLPipeline.from_pretrained(m) for m in (str(out), tiny_sdxl_model))
    given = AutoencoderKL.from_pretrained(own_vae).state_dict()
    assert all(torch.equal(v, given[k]) for k, v in tuned.vae.state_dict().items())
    for part in ("unet", "text_encoder", "text_encoder_2"):
        changed = getattr(tuned, part).state_dict()
        assert any(not torch.equal(v, getattr(base, part).state_dict()[k]) for k, v in changed.items()), part


def test_sdxl_dora_loha_and_lokr_outputs_load_in_its_pipeline_and_predict_as_trained(tiny_sdxl_model, train_tiny,
                                                                                    tmp_path):
    """--adapter dora|loha|lokr on SDXL (UNet and both text encoders; DoRA on the UNet alone): the file its pipeline
    loads (load_lora_weights; LoHa and LoKr fused through peft by generate.py's loading) predicts as the trained UNet
    does, unlike the base. (Its LoRA: the kohya export test below.)"""
    import familysteps
    from diffusers import StableDiffusionXLPipeline

    from dreambooth.models import networks
    from dreambooth.models import outputs

    base = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_model)
    config = base.unet.config
    generator = torch.Generator().manual_seed(2)
    x, states = torch.randn(1, 4, 8, 8, generator=generator), torch.randn(1, 8, config.cross_attention_dim, generator=generator)
    pooled = torch.randn(1, config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim,
                         generator=generator)
    time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]])
    for adapter in ("dora", "loha", "lokr"):
        plan, state, _ = train_tiny(tiny_sdxl_model, 2, output_dir=str(tmp_path / adapter),
                                    **familysteps.adapter_fields(adapter))
        assert plan.train_text_encoder
        outputs.save_pipeline(state.models, plan)
        pipe = familysteps.output_loaded(StableDiffusionXLPipeline, tiny_sdxl_model, plan.output_dir, adapter)

        def predict(unet):
            with torch.no_grad():
                return plan.family.denoise(unet, x, torch.tensor([500]), states, pooled, time_ids)

        assert not torch.allclose(predict(pipe.unet), predict(base.unet), atol=1e-4), adapter
        ours = networks.unwrap(state.models.denoiser).eval()
        torch.testing.assert_close(predict(pipe.unet), predict(ours), rtol=1e-4, atol=1e-4, msg=adapter)


def test_sdxl_lora_exports_in_kohyas_names_that_diffusers_loads_to_the_same_weights(tiny_sdxl_model, train_tiny,
                                                                                   tmp_path):
    """--use_lora on SDXL: adapters on the UNet and both text encoders, written by export.py in kohya's SDXL names
    (lora_unet, lora_te1, lora_te2), which diffusers loads to the same fused weights as our own file, changed from
    the base's; generate's drawing with the adapters draws at the model's own 128 px without a size given."""
    from diffusers import StableDiffusionXLPipeline
    from safetensors import safe_open

    from dreambooth.commands import export
    from dreambooth.models import outputs

    plan, state, _ = train_tiny(tiny_sdxl_model, 2, use_lora=True, output_dir=str(tmp_path / "lora"))
    outputs.save_pipeline(state.models, plan)
    assert drawn_here(tiny_sdxl_model, plan.output_dir, tmp_path / "drawn") == (128, 128)
    kohya = export.main(["--model_dir", plan.output_dir, "--output_file", str(tmp_path / "lora.safetensors"),
                         "--save_precision", "fp32"])
    with safe_open(kohya, "pt") as f:
        prefixes = {k.split("_text_model")[0] if "_text_model" in k else k[:len("lora_unet")] for k in f.keys()}
    assert prefixes == {"lora_unet", "lora_te1", "lora_te2"}

    def fused(source):
        pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_model)
        pipe.load_lora_weights(source)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
        return pipe

    ours, theirs = fused(plan.output_dir), fused(kohya)
    base = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_model)
    for part in ("unet", "text_encoder", "text_encoder_2"):
        a, b, orig = (getattr(p, part).state_dict() for p in (ours, theirs, base))
        assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), part
        assert any(not torch.equal(a[k], orig[k]) for k in orig), part


def test_sdxl_prior_prediction_gives_the_base_model_the_pooled_class_prompt_and_each_rows_time_ids(
        tiny_sdxl_model, make_plan):
    """--prior_preservation prior_prediction on SDXL: the class rows (the photos again) carry the
    photos' size/crop ids and the class prompt's pooled embedding to the base UNet as well, so an
    untrained model's prior loss is 0 (to rounding) and a changed one's is not."""
    from dreambooth.generation import prompts as prompts_lib
    from dreambooth.models import networks
    from dreambooth.training import steps

    plan = make_plan(model_dir=tiny_sdxl_model, resolution=128, prior_prediction=True)
    ids = prompts_lib.prompt_ids(tiny_sdxl_model, ["photo of unqtkn toy"], "photo of a toy")
    nets = networks.setup_models(plan, torch.device("cpu"), torch.device("cpu"), distributed=False)
    prompts = conditioning.with_base_class(
        conditioning.step_prompts(plan.family, nets.text_encoders(), plan, ids, torch.device("cpu")), plan.family,
        nets.text_encoders(), ids, torch.device("cpu"))
    assert prompts.class_base_pooled.shape[0] == 1
    batch = {"instance_pixels": torch.randint(0, 255, (2, 128, 128, 3), dtype=torch.uint8),
             "instance_time_ids": torch.tensor([[400.0, 600, 0, 32, 128, 128], [128, 128, 0, 0, 128, 128]])}

    def losses():
        torch.manual_seed(0)
        with torch.no_grad():
            return steps.batch_loss(nets, batch, prompts, 1.0)

    _, instance, prior = losses()
    assert prior.item() < 1e-9 * instance.item()
    with torch.no_grad():
        for weight in nets.denoiser.parameters():
            weight.mul_(1.01)
    assert losses()[2].item() > 1e-6




def test_what_a_family_changes_reaches_the_training_step_and_the_samples(tiny_model, make_plan, tmp_path, monkeypatch):
    """A family of the test's own (built on the UNet families' base, as SD 1.x is), in the table, is found from its
    model folder, carried in the plan, and what it changes (here the text conditioning) reaches the training step
    and the validation samples; what it inherits runs as SD 1.x's does. (A family folder copied under a new name
    is a family of every script: tests/integration/test_families_scripts.py.)"""
    from dreambooth.commands import export
    from dreambooth.generation import prompts as prompts_lib
    from dreambooth.models import networks
    from dreambooth.training import steps
    from dreambooth.training import validation

    (tmp_path / "family_penultimate.py").write_text(NEW_FAMILY)
    monkeypatch.syspath_prepend(str(tmp_path))
    import family_penultimate

    monkeypatch.setattr(families, "FAMILIES", {"sd1-penultimate": family_penultimate.FAMILY, **families.FAMILIES})
    model = shutil.copytree(tiny_model, tmp_path / "model")
    config = json.loads((model / "text_encoder" / "config.json").read_text())
    (model / "text_encoder" / "config.json").write_text(json.dumps({**config, "conditioning_layer": "penultimate"}))
    assert families.family_of(str(model)) is family_penultimate.FAMILY
    assert families.family_of(tiny_model).name == "sd1"

    def first_loss(model_dir):
        plan = make_plan(model_dir=model_dir, num_validation_images=1, validation_prompts=("a toy",))
        nets = networks.setup_models(plan, torch.device("cpu"), torch.device("cpu"), distributed=False)
        ids = prompts_lib.prompt_ids(model_dir, ["photo of unqtkn toy"], "photo of a toy", plan.family)
        prompts = conditioning.step_prompts(plan.family, nets.text_encoders(), plan, ids, torch.device("cpu"))
        state = steps.make_train_state(nets, plan)
        pixels = torch.randint(0, 255, (1, 64, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        loss = float(steps.train_step(state, [{"instance_pixels": pixels, "class_pixels": pixels}], prompts, 1.0,
                                      1.0)[0])
        states, _ = validation.Sampler(nets, plan, amp_dtype=None).encode(["a toy"])
        return plan, loss, states

    plan, loss, states = first_loss(str(model))
    base_plan, base_loss, base_states = first_loss(tiny_model)
    assert plan.family.name == "sd1-penultimate" and base_plan.family.name == "sd1"
    assert loss != base_loss  # the same weights and seed, conditioned on another layer
    assert not torch.allclose(states, base_states)
    # What it inherits runs as SD 1.x's does: its export is SD 1.x's single file.
    assert set(export.full_checkpoint(str(model))) == set(export.full_checkpoint(tiny_model))



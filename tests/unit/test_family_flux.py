"""families/flux/: Flux.1 on its tiny random model (real classes: FluxTransformer2DModel with a guidance input,
CLIP-L, T5 with a tokenizer made here, a 16-channel VAE), trained by flow matching on packed latents, without Ray
(the Ray runs are at the end, marked slow)."""

import dataclasses
import os
import shutil
import types

import familysteps
import pytest
import torch

from dreambooth import families
from dreambooth.families import flux as family_flux
from dreambooth.families.shared import fluxblocks
from dreambooth.generation import prompts
from dreambooth.models import networks
from dreambooth.models import outputs
from dreambooth.training import conditioning
from dreambooth.training import steps

CPU = torch.device("cpu")


def test_the_family_is_read_from_its_folder_with_its_own_sizes(tiny_flux_model):
    assert families.family_of(tiny_flux_model) is family_flux.FAMILY
    families.check_model_dir(tiny_flux_model)  # transformer, vae, CLIP-L and T5 with their tokenizers
    assert families.native_resolution(tiny_flux_model) == 64  # the VAE's sample size
    assert families.size_multiple(tiny_flux_model) == 4  # the VAE's scale x the 2x2 packing


def test_packing_is_the_pipelines_and_unpacking_undoes_it():
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 6, 8)
    tokens = fluxblocks.pack(latents)
    assert tokens.shape == (2, 12, 64)
    torch.testing.assert_close(fluxblocks.unpack(tokens, 6, 8), latents)
    torch.testing.assert_close(FluxPipeline._unpack_latents(tokens, 6 * 8, 8 * 8, 8), latents)


def test_our_conditioning_is_the_pipelines(tiny_flux_model):
    """T5's states at 512 tokens and CLIP-L's pooled output, as FluxPipeline.encode_prompt makes them of the
    same prompt: CLIP's 77 ids travel padded beside T5's 512 and are read back at CLIP's length."""
    from diffusers import FluxPipeline

    family = families.family_of(tiny_flux_model)
    pipe = FluxPipeline.from_pretrained(tiny_flux_model)
    prompt = "photo of unqtkn toy, on a beach"
    ids = torch.tensor(prompts.prompt_ids(tiny_flux_model, [prompt], None, family)["instance"])
    assert ids.shape == (1, 2, 512)
    with torch.no_grad():  # (T5's attention takes another kernel with gradients: both without)
        expected, pooled, _ = pipe.encode_prompt(prompt, prompt, max_sequence_length=family_flux.T5_MAX_LENGTH)
        states, ours = family.encode_text([pipe.text_encoder, pipe.text_encoder_2], ids)
    torch.testing.assert_close(states, expected)
    torch.testing.assert_close(ours, pooled)


@pytest.fixture()
def flux_run(tiny_flux_model, train_tiny):
    def run(steps_taken=3, model_dir=tiny_flux_model, **fields):
        return train_tiny(model_dir, steps_taken, **fields)

    return run


def test_a_full_fine_tune_moves_the_transformer_and_clip_and_leaves_t5(flux_run, tiny_flux_model):
    from transformers import T5EncoderModel

    plan, state, losses = flux_run(steps_taken=6)
    assert losses[-1] < losses[0]  # a fixed batch is learnt
    base_t5 = T5EncoderModel.from_pretrained(tiny_flux_model, subfolder="text_encoder_2")
    nets = state.models
    assert all(torch.equal(a, b) for a, b in zip(nets.encoders[1].parameters(), base_t5.parameters()))
    assert not any(p.requires_grad for p in nets.encoders[1].parameters())  # T5 stays frozen, as diffusers' script
    assert any(p.requires_grad for p in nets.encoders[0].parameters())


def test_the_guidance_value_is_an_input_of_dev_in_training(flux_run, tiny_flux_model):
    """--guidance_scale reaches the transformer's guidance embedding: the same seeded step at another value
    gives another loss (and it is in the run's identity, which decides resuming)."""
    from dreambooth.planning import run_identity

    _, _, at_default = flux_run(steps_taken=1)
    _, _, at_one = flux_run(steps_taken=1, guidance_scale=1.0)
    assert at_default[0] != at_one[0]
    _, _, again = flux_run(steps_taken=1, guidance_scale=family_flux.FAMILY.guidance_scale)
    assert again == at_default  # None is the family's 3.5
    from dreambooth.planning import planning

    def identity(*extra):
        args = planning.parse_args(["--model_dir", tiny_flux_model, "--output_dir", "/o", "--instance_data_dir", "/i",
                                    "--instance_prompt", "p", *extra])
        return run_identity.of_run(vars(args), family_flux.FAMILY, [], [], [], [], [], 64, ())

    assert identity()["guidance_scale"] == 3.5 and identity() == identity("--guidance_scale", "3.5")
    assert run_identity.differences(identity(), identity("--guidance_scale", "1")) == ["--guidance_scale 3.5 -> 1.0"]
    assert "guidance_scale" not in run_identity.of_run(vars(planning.parse_args([
        "--model_dir", tiny_flux_model, "--output_dir", "/o", "--instance_data_dir", "/i", "--instance_prompt", "p"])),
        families.FAMILIES["sd3"], [], [], [], [], [], 64, ())  # drawing only, for the other families


@pytest.fixture(scope="module")
def schnell_model(tiny_flux_model, tmp_path_factory):
    """The tiny model with a transformer without the guidance input (Flux.1 schnell's layout)."""
    from diffusers import FluxTransformer2DModel

    folder = tmp_path_factory.mktemp("schnell") / "model"
    shutil.copytree(tiny_flux_model, folder)
    config = dict(FluxTransformer2DModel.load_config(os.path.join(tiny_flux_model, "transformer")),
                  guidance_embeds=False)
    torch.manual_seed(0)
    FluxTransformer2DModel.from_config(config).save_pretrained(folder / "transformer")
    return str(folder)


def test_the_base_models_own_prediction_keeps_the_prior(tiny_flux_model, make_plan):
    """--prior_preservation prior_prediction with LoRA: the class rows' target is the transformer's prediction
    with its adapters off (under the class prompt's base states and the same guidance); it trains, and the
    first step's prior loss is zero (the adapters start as the identity)."""
    plan = make_plan(model_dir=tiny_flux_model, resolution=64, use_lora=True, prior_prediction=True,
                     class_prompt="photo of a toy")
    torch.manual_seed(0)
    nets = networks.setup_models(plan, CPU, CPU, distributed=False)
    ids = prompts.prompt_ids(tiny_flux_model, ["photo of unqtkn toy"], "photo of a toy", plan.family)
    encoders = nets.text_encoders()
    step_prompts = conditioning.with_base_class(conditioning.step_prompts(plan.family, encoders, plan, ids, CPU),
                                                plan.family, encoders, ids, CPU)
    state = steps.make_train_state(nets, plan)
    batch = {"instance_pixels": torch.randint(0, 255, (1, 64, 64, 3), dtype=torch.uint8)}
    _, _, prior = steps.train_step(state, [batch], step_prompts, 1.0, 1.0)
    assert float(prior) == pytest.approx(0.0, abs=1e-6)
    _, _, prior = steps.train_step(state, [batch], step_prompts, 1.0, 1.0)
    assert float(prior) > 0  # the adapters moved: the tuned prediction leaves the base one


def test_schnell_trains_without_a_guidance_input(flux_run, schnell_model):
    _, state, losses = flux_run(steps_taken=2, model_dir=schnell_model, use_lora=True)
    assert networks.unwrap(state.models.denoiser).config.guidance_embeds is False
    assert all(torch.isfinite(torch.tensor(losses)))
    _, _, other = flux_run(steps_taken=2, model_dir=schnell_model, use_lora=True, guidance_scale=1.0)
    assert other == losses  # no guidance input: the value changes nothing


def test_lora_and_full_outputs_load_in_the_flux_pipeline(flux_run, tiny_flux_model, tmp_path):
    from diffusers import FluxPipeline

    base = FluxPipeline.from_pretrained(tiny_flux_model)
    for adapter in familysteps.ADAPTERS:  # (LoRA, DoRA, LoHa, LoKr, full)
        plan, state, _ = flux_run(steps_taken=2, output_dir=str(tmp_path / f"out-{adapter}"),
                                  **familysteps.adapter_fields(adapter))
        outputs.save_pipeline(state.models, plan)
        ours = networks.unwrap(state.models.denoiser)
        pipe = familysteps.output_loaded(FluxPipeline, tiny_flux_model, plan.output_dir, adapter)
        familysteps.lycoris_exported(pipe, tiny_flux_model, plan, adapter, tmp_path)
        x = torch.randn(1, 16, 32, 32, generator=torch.Generator().manual_seed(2))
        states, pooled = torch.randn(1, 512, 32), torch.randn(1, 32)  # T5's width; CLIP-L's pooled
        t = torch.tensor([500.0])

        def predict(model):
            with torch.no_grad():
                return plan.family.denoise(model, x, t, states, pooled, None, 3.5)

        assert not torch.allclose(predict(pipe.transformer), predict(base.transformer), atol=1e-4), adapter
        torch.testing.assert_close(predict(pipe.transformer), predict(ours.eval()), rtol=1e-4, atol=1e-4, msg=adapter)


def test_validation_samples_are_what_generate_draws_from_the_same_weights(tiny_flux_model, make_plan, tmp_path):
    settings = familysteps.validation_draws_what_generate_draws(tiny_flux_model, make_plan, tmp_path, "a toy",
                                                                "a-toy-00000.png").settings
    assert settings.guidance_scale == 3.5


def test_a_negative_prompt_is_refused_in_one_line(tiny_flux_model, tmp_path):
    """In the drawing's settings, and by generate.py before Ray starts or a folder is made."""
    from dreambooth import errors
    from dreambooth.commands import generate
    from dreambooth.generation import drawing

    with pytest.raises(errors.UserError, match="Flux.1 draws without a negative prompt"):
        drawing.settings_for(drawing.ImageSettings(negative_prompt="blurry"), family_flux.FAMILY, "/unread")
    assert drawing.settings_for(drawing.ImageSettings(resolution=64), families.FAMILIES["sd1"],
                                "/unread").guidance_scale == 7.5
    with pytest.raises(errors.UserError, match="Flux.1 draws without a negative prompt"):
        generate.main(["--model_dir", tiny_flux_model, "--output_dir", str(tmp_path / "neg"), "--prompts", "a toy",
                       "--negative_prompt", "blurry"])
    assert not (tmp_path / "neg").exists()


def test_lora_trains_over_an_nf4_base_under_bf16(flux_run, tmp_path):
    """--base_precision nf4 (bitsandbytes on CPU, the GPU's code path) with bf16 autocast and channels-last:
    the frozen transformer's linear layers are packed 4-bit, the fp32 adapters train, the pipeline loads them."""
    import bitsandbytes as bnb
    from diffusers import FluxPipeline

    plan, state, losses = flux_run(steps_taken=2, use_lora=True, base_precision="nf4", mixed_precision="bf16",
                                   channels_last=True, output_dir=str(tmp_path / "out"))
    denoiser = networks.unwrap(state.models.denoiser)
    assert isinstance(denoiser.transformer_blocks[0].attn.to_q.base_layer, bnb.nn.Linear4bit)
    assert isinstance(denoiser.single_transformer_blocks[0].proj_out, bnb.nn.Linear4bit)  # frozen, not adapted
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(p.abs().sum() > 0 for n, p in denoiser.named_parameters() if "lora_B" in n)
    outputs.save_pipeline(state.models, plan)
    assert outputs.read_output(plan.output_dir).lora.rank == plan.lora_rank
    FluxPipeline.from_pretrained(plan.model_dir).load_lora_weights(plan.output_dir)


def test_lora_exports_in_kohyas_flux_layout_that_the_converters_read_back(tiny_flux_model, flux_run, tmp_path):
    """export.py on a Flux LoRA: kohya's original-layout names (double_blocks' fused qkv, single_blocks' linear1
    holding q, k, v and the MLP's input, lora_te1_ for CLIP-L). Read back by diffusers' own kohya -> diffusers
    Flux converter (it knows Flux.1's full widths, so a block of them is made here), every adapter's update
    (up @ down x alpha / rank) is the trained one; and the tiny model's run exports end to end."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
    from safetensors.torch import load_file

    from dreambooth.commands import export

    width, rank, alpha = 3072, 2, 4.0
    generator = torch.Generator().manual_seed(0)
    shapes = {"transformer_blocks.0.attn.to_q": (width, width), "transformer_blocks.0.attn.add_v_proj": (width, width),
              "transformer_blocks.0.ff.net.0.proj": (width, 4 * width), "transformer_blocks.0.attn.to_out.0": (width, width),
              "single_transformer_blocks.0.attn.to_q": (width, width),
              "single_transformer_blocks.0.attn.to_k": (width, width),
              "single_transformer_blocks.0.attn.to_v": (width, width), "single_transformer_blocks.0.proj_out": (
                  5 * width, width)}
    ours = {}
    for module, (fan_in, fan_out) in shapes.items():
        ours[f"transformer.{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator)
        ours[f"transformer.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator)
    config_dir = tmp_path / "base" / "transformer"
    config_dir.mkdir(parents=True)
    (config_dir / "config.json").write_text('{"num_attention_heads": 24, "attention_head_dim": 128}')
    kohya = family_flux.FAMILY.kohya_lora(ours, {"transformer": alpha}, str(tmp_path / "base"))
    assert {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", "lora_unet_double_blocks_0_txt_attn_qkv.alpha",
            "lora_unet_double_blocks_0_img_mlp_0.lora_up.weight", "lora_unet_single_blocks_0_linear1.lora_up.weight",
            "lora_unet_single_blocks_0_linear2.alpha"} <= set(kohya)
    assert kohya["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape == (7 * width, 4 * rank)
    back = _convert_kohya_flux_lora_to_diffusers(dict(kohya))

    def update(state, module, scale):
        return state[f"transformer.{module}.lora_B.weight"] @ state[f"transformer.{module}.lora_A.weight"] * scale

    for module in shapes:
        torch.testing.assert_close(update(back, module, 1.0), update(ours, module, alpha / rank), rtol=1e-4, atol=1e-4)
    assert update(back, "single_transformer_blocks.0.proj_mlp", 1.0).abs().max() == 0  # a part left as zeros

    plan, state, _ = flux_run(steps_taken=1, use_lora=True, output_dir=str(tmp_path / "tuned"))
    outputs.save_pipeline(state.models, plan)
    written = export.main(["--model_dir", plan.output_dir, "--output_file", str(tmp_path / "flux-lora.safetensors")])
    names = load_file(written)
    assert any(k.startswith("lora_unet_single_blocks_0_linear1") for k in names)
    assert any(k.startswith("lora_te1_text_model_encoder_layers_0_self_attn_q_proj") for k in names)


def test_fsdp_is_a_full_fine_tune_of_the_denoiser_alone(capsys):
    """--fsdp refuses what it does not shard or was not tested with, in one line naming each; the memory table
    splits the denoiser's weights, gradients and AdamW state over the workers."""
    from dreambooth.planning import memory
    from dreambooth.planning import planning

    base = ["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/i", "--instance_prompt", "p", "--fsdp"]
    with pytest.raises(SystemExit):
        planning.parse_args(base + ["--use_lora", "--use_ema", "--train_text_encoder"])
    assert ("--fsdp shards a full fine-tune of the denoiser alone, in bf16 or fp32: leave out --use_lora, "
            "--train_text_encoder, --use_ema") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        planning.parse_args(base + ["--num_workers", "2", "--min_workers", "1"])
    assert "leave out --min_workers (each shard is sized for --num_workers)" in capsys.readouterr().err
    for extra in ([], ["--no-train_text_encoder"]):  # (the text encoders, trained by default, are frozen under it)
        args = planning.parse_args(base + extra)
        assert args.fsdp and not args.train_text_encoder
    with pytest.raises(ValueError, match="--fsdp trains in bf16 or fp32 and this GPU has no bf16"):
        steps.make_train_state(types.SimpleNamespace(denoiser_device=CPU),
                               dataclasses.replace(planning.offline_plan(), fsdp=True, mixed_precision="fp16"))
    full = memory.Setup(gradient_checkpointing=True, train_text_encoder=False, batch=1, resolution=1024)
    one, eight = memory.need("flux", full), memory.need("flux", memory.dataclasses.replace(full, shards=8))
    assert one.static - eight.static == pytest.approx(11901.41e6 * 16 * 7 / 8 / memory.GIB, rel=1e-3)



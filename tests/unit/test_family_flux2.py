"""families/flux2/: FLUX.2 [klein] on its tiny random model (real classes: Flux2Transformer2DModel, a Qwen3 text
encoder with a byte-level tokenizer made here, AutoencoderKLFlux2), its conditioning and training step checked
against Flux2KleinPipeline's and diffusers' train_dreambooth_lora_flux2_klein.py's own math."""

import inspect

import familysteps
import pytest
import torch

from dreambooth import families
from dreambooth.families import flux2 as family_flux2
from dreambooth.families.shared import flux2base
from dreambooth.generation import prompts

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipe(tiny_flux2_model):
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(tiny_flux2_model)


def test_the_family_is_read_from_its_folder_with_the_pipelines_own_constants(tiny_flux2_model, pipe):
    assert families.family_of(tiny_flux2_model) is family_flux2.FAMILY
    families.check_model_dir(tiny_flux2_model)  # transformer, its own VAE, the text encoder and its tokenizer
    assert families.native_resolution(tiny_flux2_model) == 64  # the tiny VAE's sample size
    assert families.size_multiple(tiny_flux2_model) == 4  # the VAE's scale x the 2x2 fold (one token a pixel)
    defaults = inspect.signature(pipe._get_qwen3_prompt_embeds).parameters
    assert family_flux2.OUT_LAYERS == defaults["hidden_states_layers"].default
    assert flux2base.MAX_TOKENS == pipe.tokenizer_max_length == defaults["max_sequence_length"].default
    assert families.ARCHS["flux2"] is family_flux2.FAMILY


def test_our_conditioning_is_the_pipelines(tiny_flux2_model, pipe):
    """Three hidden layers of every token of the templated prompt, side by side, as
    Flux2KleinPipeline.encode_prompt makes them for the same prompts; no pooled embedding."""
    family = family_flux2.FAMILY
    texts = ["photo of unqtkn toy, on a beach", "photo of a toy"]
    ids = torch.tensor(prompts.prompt_ids(tiny_flux2_model, texts, None, family)["instance"])
    assert ids.shape == (2, 2, flux2base.MAX_TOKENS)
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(texts)
        states, pooled = family.encode_text([pipe.text_encoder], ids)
    assert pooled is None and states.shape == (2, flux2base.MAX_TOKENS, 3 * 32)
    torch.testing.assert_close(states, expected)


def test_the_latents_are_the_pipelines_and_decode_back(tiny_flux2_model, pipe):
    """The VAE's mode folded 2x2 and normalised by its batch-norm statistics, as the script and the pipeline encode;
    decoded as the pipeline decodes its output."""
    from diffusers import Flux2KleinPipeline

    family = family_flux2.FAMILY
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    vae = pipe.vae
    with torch.no_grad():
        mode = vae.encode(pixels).latent_dist.mode()
        torch.manual_seed(0)
        sample = family.latent_posterior(vae, pixels).sample()
        torch.testing.assert_close(sample, mode, rtol=0, atol=1e-5)  # (the posterior's floor: within 3e-7 x noise)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        scaled = family.scale_latents(vae, mode)
        torch.testing.assert_close(scaled, (Flux2KleinPipeline._patchify_latents(mode) - mean) / std)
        torch.testing.assert_close(family.decode_latents(vae, scaled), vae.decode(mode).sample)
    assert scaled.shape == (1, family.latent_channels(vae.config), 16, 16) == (1, 32, 16, 16)
    assert 64 // scaled.shape[-1] == family.vae_downscale(vae.config)


def test_lora_adapts_the_scripts_layers_and_both_outputs_load_in_the_pipeline(tiny_flux2_model, train_tiny, tmp_path):
    """The adapters sit on the layers diffusers' klein script names (its target list, given to peft on the same
    transformer); the LoRA file and the full model load in Flux2KleinPipeline and predict as the trained
    transformer does, unlike the base."""
    from diffusers import Flux2KleinPipeline

    familysteps.flux2_lora_on_the_scripts_layers(Flux2KleinPipeline, tiny_flux2_model, 24, train_tiny, tmp_path)


def test_lora_exports_in_kohyas_flux2_names_that_comfyui_maps_and_merges_to_the_trained_weights(tiny_flux2_model,
                                                                                                 train_tiny, tmp_path):
    """export.py on a [klein] LoRA: kohya's names of FLUX.2's original modules (lora_unet_double_blocks_<i>_img_attn_qkv
    holding q, k and v, ..._img_attn_proj, ..._single_blocks_<i>_linear1, ..._linear2), each one ComfyUI maps onto its
    FLUX.2 model; merged as ComfyUI merges it, the trained transformer's weights; Flux2KleinPipeline reads it back
    (diffusers' kohya FLUX.2 reader) to the same (familysteps.kohya_export_read_as_comfyui_reads_it). The lines
    dreambooth_run.sh ends with offer the export for LoRA, not yet for a full model."""
    from diffusers import Flux2KleinPipeline

    from dreambooth.commands import export

    tensors = familysteps.kohya_export_read_as_comfyui_reads_it(
        Flux2KleinPipeline, tiny_flux2_model, train_tiny, tmp_path, familysteps.comfyui_flux2_layout,
        flux2base.kohya_module)
    assert {key.split(".")[0] for key in tensors} == {
        "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_img_attn_proj",
        "lora_unet_single_blocks_0_linear1", "lora_unet_single_blocks_0_linear2"}
    rank = tensors["lora_unet_double_blocks_0_img_attn_proj.lora_down.weight"].shape[0]
    assert tensors["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 3 * rank
    assert tensors["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item() == 3 * 8.0  # (the scale alpha / rank kept)
    assert export.why_no_file(str(tmp_path / "kohya-lora"), tiny_flux2_model) is None
    assert export.why_no_file(str(tmp_path / "full"), tiny_flux2_model) is None  # (a full model: its transformer alone)


def test_validation_samples_are_what_generate_draws_from_the_same_weights(tiny_flux2_model, make_plan, tmp_path):
    """Drawn with guidance 4.0 against the empty prompt, the pipeline's way, by both."""
    settings = familysteps.validation_draws_what_generate_draws(tiny_flux2_model, make_plan, tmp_path).settings
    assert (settings.guidance_scale, settings.resolution) == (4.0, 64)


def test_lora_trains_over_a_quantised_base_under_bf16(tiny_flux2_model, train_tiny, tmp_path):
    """--base_precision nf4 (bitsandbytes on CPU, the GPU's code path) with bf16 autocast: the frozen transformer's
    linear layers quantised, the fp32 adapters train, Flux2KleinPipeline loads them."""
    import bitsandbytes as bnb
    from diffusers import Flux2KleinPipeline

    from dreambooth.models import networks
    from dreambooth.models import outputs

    plan, state, losses = train_tiny(tiny_flux2_model, 2, use_lora=True, base_precision="nf4", mixed_precision="bf16",
                                     output_dir=str(tmp_path / "out"))
    denoiser = networks.unwrap(state.models.denoiser)
    assert isinstance(denoiser.transformer_blocks[0].attn.to_q.base_layer, bnb.nn.Linear4bit)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(p.abs().sum() > 0 for n, p in denoiser.named_parameters() if "lora_B" in n)
    outputs.save_pipeline(state.models, plan)
    Flux2KleinPipeline.from_pretrained(plan.model_dir).load_lora_weights(plan.output_dir)

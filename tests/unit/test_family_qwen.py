"""families/qwen/: Qwen-Image on its tiny random model (real classes: QwenImageTransformer2DModel, a Qwen2.5-VL
text encoder with a byte-level tokenizer made here, AutoencoderKLQwenImage), its conditioning and training step
checked against QwenImagePipeline's and diffusers' Qwen-Image DreamBooth script's own math."""

import familysteps
import pytest
import torch

from dreambooth import families
from dreambooth.families import qwen as family_qwen
from dreambooth.generation import prompts

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipe(tiny_qwen_model):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(tiny_qwen_model)


def test_the_family_is_read_from_its_folder_with_the_pipelines_own_constants(tiny_qwen_model, pipe):
    assert families.family_of(tiny_qwen_model) is family_qwen.FAMILY
    families.check_model_dir(tiny_qwen_model)  # transformer, its own VAE, the text encoder and its tokenizer
    assert families.native_resolution(tiny_qwen_model) == 64  # the tiny transformer's recorded sample size x 4
    assert families.size_multiple(tiny_qwen_model) == 8  # the VAE's scale x the 2x2 packing
    assert (family_qwen.TEMPLATE, family_qwen.DROP, family_qwen.MAX_TOKENS, family_qwen.DEFAULT_SAMPLE_SIZE) == (
        pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx, pipe.tokenizer_max_length,
        pipe.default_sample_size)


def test_our_conditioning_is_the_pipelines(tiny_qwen_model, pipe):
    """The states of each prompt's own tokens after the template and their mask, as
    QwenImagePipeline.encode_prompt makes them for the same prompts (trimmed to the longest of them)."""
    family = family_qwen.FAMILY
    texts = ["photo of unqtkn toy, on a beach", "photo of a toy"]
    ids = torch.tensor(prompts.prompt_ids(tiny_qwen_model, texts, None, family)["instance"])
    assert ids.shape == (2, 2, family_qwen.DROP + family_qwen.MAX_TOKENS)
    with torch.no_grad():
        expected, expected_mask = pipe.encode_prompt(texts)
        states, mask = family.encode_text([pipe.text_encoder], ids)
    torch.testing.assert_close(states, expected)
    assert torch.equal(mask, expected_mask.long()) and mask[1].sum() < mask[0].sum()
    padded, padded_mask = family.pad_text(states, mask, states.shape[1] + 3)
    assert padded.shape[1] == padded_mask.shape[1] == states.shape[1] + 3 and not padded[:, -3:].any()


def test_the_latents_are_the_pipelines_and_decode_back(tiny_qwen_model, pipe):
    """One frame of the video VAE, normalised per channel as diffusers' script does, and undone as the
    pipeline decodes."""
    family = family_qwen.FAMILY
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    vae = pipe.vae
    with torch.no_grad():
        posterior = family.latent_posterior(vae, pixels)
        raw = vae.encode(pixels.unsqueeze(2)).latent_dist.mean
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std_inverse = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        torch.testing.assert_close(family.scale_latents(vae, posterior.mean), ((raw - mean) * std_inverse)[:, :, 0])
        decoded = family.decode_latents(vae, family.scale_latents(vae, posterior.mean))
        torch.testing.assert_close(decoded, vae.decode(raw).sample[:, :, 0])
    assert posterior.mean.shape == (1, 16, 16, 16) and decoded.shape == (1, 3, 64, 64)


def test_lora_and_full_outputs_load_in_the_qwen_image_pipeline(tiny_qwen_model, train_tiny, tmp_path):
    from diffusers import QwenImagePipeline

    mask = torch.tensor([[1, 1, 1, 1, 0]])  # (the tiny text encoder's width: 32)
    familysteps.outputs_load_in_the_pipeline(QwenImagePipeline, tiny_qwen_model, train_tiny, tmp_path, (
        torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2)), torch.randn(1, 5, 32), mask))


def test_validation_samples_are_what_generate_draws_from_the_same_weights(tiny_qwen_model, make_plan, tmp_path):
    """Drawn against the family's negative prompt (" ") with true_cfg_scale, the pipeline's way, by both."""
    import numpy as np

    from dreambooth.generation import drawing

    drew = familysteps.validation_draws_what_generate_draws(tiny_qwen_model, make_plan, tmp_path)
    settings = drew.settings
    assert (settings.guidance_scale, settings.negative_prompt, settings.resolution) == (4.0, " ", 64)
    # the guidance reaches the pipeline by its name (true_cfg_scale): 1.0 draws without guidance, unlike 4.0
    guided, unguided = (drawing.generate_batch(
        drew.pipe, ["a toy, on a beach"], [drew.seed], drawing.dataclasses.replace(settings, guidance_scale=value),
        {"output_type": "np"}, drew.plan.family.guidance_argument)[0][0] for value in (4.0, 1.0))
    assert np.abs(guided - unguided).max() > 1e-5
    assert drew.sampler.negative == settings.negative_prompt == " "


def test_lora_exports_in_kohyas_layout_that_the_pipeline_loads_to_the_same_transformer(tiny_qwen_model, train_tiny,
                                                                                        tmp_path):
    """export.py on a Qwen-Image LoRA: lora_unet_transformer_blocks_<i>_attn_to_q ... with lora_down/lora_up and
    alpha, which QwenImagePipeline.load_lora_weights reads (through diffusers' converter of such files) into
    the same transformer as the run's own LoRA file."""
    from diffusers import QwenImagePipeline
    from safetensors.torch import load_file

    from dreambooth.commands import export
    from dreambooth.models import outputs

    plan, state, _ = train_tiny(tiny_qwen_model, 2, use_lora=True, lora_alpha=8, output_dir=str(tmp_path / "tuned"))
    outputs.save_pipeline(state.models, plan)
    written = export.main(["--model_dir", plan.output_dir, "--output_file", str(tmp_path / "qwen-lora.safetensors")])
    names = load_file(written)
    assert {"lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight",
            "lora_unet_transformer_blocks_0_attn_to_out_0.lora_up.weight",
            "lora_unet_transformer_blocks_0_attn_to_k.alpha"} <= set(names)
    assert float(names["lora_unet_transformer_blocks_0_attn_to_k.alpha"]) == 8
    # ComfyUI's rule (comfy/lora.py, model_lora_keys_unet): lora_unet_<key, "_" for "."> names the weight
    # diffusion_model.<key>.weight of its model, and its Qwen-Image model (comfy/ldm/qwen_image/model.py) has the
    # transformer's diffusers names (transformer_blocks.<i>.attn.to_q, ...): every exported module is one of those
    base = QwenImagePipeline.from_pretrained(tiny_qwen_model)
    comfy = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_") for k in base.transformer.state_dict()
             if k.endswith(".weight")}
    assert {k.split(".")[0] for k in names} <= comfy and len({k.split(".")[0] for k in names}) == 4
    pipes = []
    for source in (plan.output_dir, written):
        pipe = QwenImagePipeline.from_pretrained(tiny_qwen_model)
        pipe.load_lora_weights(source)
        pipes.append(pipe)
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    states, mask, t = torch.randn(1, 5, 32), torch.tensor([[1, 1, 1, 1, 0]]), torch.tensor([300.0])
    with torch.no_grad():
        ours, kohya = (plan.family.denoise(p.transformer, x, t, states, mask, None) for p in pipes)
        before = plan.family.denoise(base.transformer, x, t, states, mask, None)
    assert not torch.allclose(ours, before, atol=1e-5)
    torch.testing.assert_close(kohya, ours, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision, layer", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_lora_trains_over_a_quantised_base_under_bf16(tiny_qwen_model, train_tiny, tmp_path, precision, layer):
    """--base_precision (bitsandbytes on CPU, the GPU's code path) with bf16 autocast: the frozen transformer's
    linear layers quantised, the fp32 adapters train, QwenImagePipeline loads them."""
    import bitsandbytes as bnb
    from diffusers import QwenImagePipeline

    from dreambooth.models import networks
    from dreambooth.models import outputs

    plan, state, losses = train_tiny(tiny_qwen_model, 2, use_lora=True, base_precision=precision,
                                     mixed_precision="bf16", output_dir=str(tmp_path / "out"))
    denoiser = networks.unwrap(state.models.denoiser)
    assert isinstance(denoiser.transformer_blocks[0].attn.to_q.base_layer, getattr(bnb.nn, layer))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(p.abs().sum() > 0 for n, p in denoiser.named_parameters() if "lora_B" in n)
    outputs.save_pipeline(state.models, plan)
    QwenImagePipeline.from_pretrained(plan.model_dir).load_lora_weights(plan.output_dir)


def test_a_vae_of_another_kind_is_refused_before_anything_runs(tiny_qwen_model, tiny_model, tmp_path):
    """--pretrained_vae_model_name_or_path with SD's AutoencoderKL for Qwen-Image: one line naming both kinds (it
    used to fail in the worker, blaming the base model's files)."""
    from dreambooth import errors
    from dreambooth.planning import planning

    args = planning.parse_args(["--model_dir", tiny_qwen_model, "--instance_data_dir", str(tmp_path), "--instance_prompt",
                                "photo of unqtkn toy", "--output_dir", str(tmp_path / "out"),
                                "--pretrained_vae_model_name_or_path", f"{tiny_model}/vae"])
    with pytest.raises(errors.UserError, match=r"is an AutoencoderKL; Qwen-Image's VAE is an AutoencoderKLQwenImage"):
        planning.checked_files(args, None)

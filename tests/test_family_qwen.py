"""family_qwen.py: Qwen-Image on its tiny random model (real classes: QwenImageTransformer2DModel, a Qwen2.5-VL
text encoder with a byte-level tokenizer made here, AutoencoderKLQwenImage), its conditioning and training step
checked against QwenImagePipeline's and diffusers' Qwen-Image DreamBooth script's own math."""

import pytest
import torch

from dreambooth import families
from dreambooth.families import family_qwen
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

"""families/zimage/: Z-Image on its tiny random model (real classes: ZImageTransformer2DModel, a Qwen3 text encoder
with a byte-level tokenizer made here, Flux.1's AutoencoderKL), its conditioning and training step checked against
ZImagePipeline's and diffusers' train_dreambooth_lora_z_image.py's own math."""

import familysteps
import pytest
import torch

from dreambooth import families
from dreambooth.families import zimage as family_zimage
from dreambooth.generation import prompts

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipe(tiny_zimage_model):
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(tiny_zimage_model)


def test_the_family_is_read_from_its_folder_and_its_conditioning_is_the_pipelines(tiny_zimage_model, pipe):
    """Each prompt's own tokens' second-to-last states, as ZImagePipeline.encode_prompt makes them (a list of
    prompts of their own lengths), from our padded states and their mask."""
    import inspect

    assert families.family_of(tiny_zimage_model) is family_zimage.FAMILY
    families.check_model_dir(tiny_zimage_model)
    assert families.native_resolution(tiny_zimage_model) == 64 and families.size_multiple(tiny_zimage_model) == 4
    assert family_zimage.MAX_TOKENS == inspect.signature(pipe.encode_prompt).parameters["max_sequence_length"].default
    family = family_zimage.FAMILY
    texts = ["photo of unqtkn toy, on a beach", "photo of a toy"]
    ids = torch.tensor(prompts.prompt_ids(tiny_zimage_model, texts, None, family)["instance"])
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False)
        states, mask = family.encode_text([pipe.text_encoder], ids)
    ours = family_zimage.prompt_list(states, mask)
    assert [len(x) for x in ours] == [len(x) for x in expected] and len(ours[1]) < len(ours[0])
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b)
    assert family.pipeline_text(states, mask, states, mask)["prompt_embeds"][1].shape == expected[1].shape


def test_lora_and_full_outputs_load_in_the_pipeline_and_validation_is_what_generate_draws(tiny_zimage_model,
                                                                                        train_tiny, make_plan, tmp_path):
    """The LoRA file and the full model load in ZImagePipeline and predict as the trained transformer does, unlike
    the base; validation samples equal generate.py's images of the same weights (guidance 5.0, the empty negative
    prompt)."""
    from diffusers import ZImagePipeline

    familysteps.outputs_load_in_the_pipeline(ZImagePipeline, tiny_zimage_model, train_tiny, tmp_path, (
        torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2)), torch.randn(1, 5, 32),
        torch.tensor([[1, 1, 1, 1, 0]])))
    settings = familysteps.validation_draws_what_generate_draws(tiny_zimage_model, make_plan, tmp_path).settings
    assert (settings.guidance_scale, settings.resolution) == (5.0, 64)

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


def test_lora_exports_in_kohyas_names_of_the_original_layout_that_comfyui_maps_and_merges_to_the_trained_weights(
        tiny_zimage_model, train_tiny, tmp_path):
    """export.py on a Z-Image LoRA: kohya's names of its original modules (lora_unet_layers_<i>_attention_qkv holding q,
    k and v, ..._attention_out; the refiners' likewise), each one ComfyUI maps onto its Z-Image model; merged as
    ComfyUI merges it, the trained transformer's weights; ZImagePipeline reads it back (diffusers' Z-Image reader of
    kohya's names) to the same (familysteps.kohya_export_read_as_comfyui_reads_it)."""
    from diffusers import ZImagePipeline

    from dreambooth.commands import export

    tensors = familysteps.kohya_export_read_as_comfyui_reads_it(
        ZImagePipeline, tiny_zimage_model, train_tiny, tmp_path, familysteps.comfyui_zimage_layout,
        family_zimage.kohya_module)
    assert {key.split(".")[0] for key in tensors} == {
        f"lora_unet_{blocks}_{i}_attention_{name}" for blocks, count in (("layers", 2), ("noise_refiner", 1),
                                                                          ("context_refiner", 1))
        for i in range(count) for name in ("qkv", "out")}
    assert tensors["lora_unet_layers_0_attention_qkv.alpha"].item() == 3 * 8.0  # (the scale alpha / rank kept)
    assert export.why_no_file(str(tmp_path / "kohya-lora"), tiny_zimage_model) is None
    assert export.why_no_file(str(tmp_path / "full"), tiny_zimage_model) is None  # (a full model: its transformer)

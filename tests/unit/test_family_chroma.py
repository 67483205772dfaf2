"""families/chroma/: Chroma on its tiny random model (real classes: ChromaTransformer2DModel, T5 with a tokenizer
made here, Flux.1's VAE), its conditioning checked against ChromaPipeline's, its training step against Flux.1's
script's steps with the pipeline's conditioning (diffusers has no Chroma script), its LoRA in kohya's Flux names
as ComfyUI reads Chroma's."""

import familysteps
import pytest
import torch

from dreambooth import families
from dreambooth.families import chroma as family_chroma
from dreambooth.families.shared import fluxblocks
from dreambooth.generation import prompts

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipe(tiny_chroma_model):
    from diffusers import ChromaPipeline

    return ChromaPipeline.from_pretrained(tiny_chroma_model)


def test_the_family_is_read_from_its_folder_and_its_conditioning_is_the_pipelines(tiny_chroma_model, pipe):
    """T5's states computed with the prompt's mask, and the transformer's text mask (the prompt's tokens and the
    first padding token), as ChromaPipeline.encode_prompt makes them."""
    assert families.family_of(tiny_chroma_model) is family_chroma.FAMILY
    families.check_model_dir(tiny_chroma_model)
    assert families.native_resolution(tiny_chroma_model) == 64 and families.size_multiple(tiny_chroma_model) == 4
    family = family_chroma.FAMILY
    texts = ["photo of unqtkn toy, on a beach", "photo of a toy"]
    ids = torch.tensor(prompts.prompt_ids(tiny_chroma_model, texts, None, family)["instance"])
    assert ids.shape == (2, 2, family_chroma.T5_MAX_LENGTH)
    with torch.no_grad():
        expected, _, expected_mask, *_ = pipe.encode_prompt(texts, do_classifier_free_guidance=False)
        states, mask = family.encode_text([pipe.text_encoder], ids)
    torch.testing.assert_close(states, expected)
    assert torch.equal(mask, expected_mask) and mask[1].sum() < mask[0].sum()


def test_outputs_load_in_the_pipeline_validation_is_generates_and_the_lora_exports_as_comfyui_reads_it(
        tiny_chroma_model, train_tiny, make_plan, tmp_path):
    """The LoRA file and the full model load in ChromaPipeline and predict as the trained transformer does; the
    validation samples equal generate.py's images of the same weights (guidance 5.0 against the empty negative
    prompt); the LoRA exported in kohya's names, each ComfyUI's for a Chroma key (lora_unet_ + the original key,
    Flux.1's layout, its dots as underscores), every adapted layer's and no other."""
    from diffusers import ChromaPipeline
    from safetensors import safe_open
    from safetensors.torch import load_file

    from dreambooth.commands import export

    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    familysteps.outputs_load_in_the_pipeline(ChromaPipeline, tiny_chroma_model, train_tiny, tmp_path, (
        torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2)), torch.randn(1, 5, 32), mask))
    lora = tmp_path / "lora"
    kohya = export.main(["--model_dir", str(lora), "--output_file", str(tmp_path / "kohya.safetensors"),
                         "--save_precision", "fp32"])
    ours = load_file(lora / "pytorch_lora_weights.safetensors")
    adapted = {k[len("transformer."):].rsplit(".lora_", 1)[0] for k in ours}
    with safe_open(kohya, "pt") as f:
        theirs = {k: f.get_tensor(k) for k in f.keys()}
    # every key ComfyUI derives for a Chroma LoRA from the model's original (Flux.1-layout) keys, and only those
    assert {k.split(".")[0] for k in theirs} == {fluxblocks.kohya_module(m)[0] for m in adapted}
    assert "lora_unet_double_blocks_0_img_attn_qkv" in {k.split(".")[0] for k in theirs}
    # an unfused layer's update is the trained one (the fused ones: test_family_flux, through diffusers' converter)
    down, up = (theirs[f"lora_unet_double_blocks_0_img_attn_proj.lora_{p}.weight"] for p in ("down", "up"))
    alpha, rank = float(theirs["lora_unet_double_blocks_0_img_attn_proj.alpha"]), down.shape[0]
    trained = ours["transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight"] @ \
        ours["transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight"]
    torch.testing.assert_close(up @ down * alpha / rank, trained * alpha / rank)
    settings = familysteps.validation_draws_what_generate_draws(tiny_chroma_model, make_plan, tmp_path).settings
    assert (settings.guidance_scale, settings.resolution) == (5.0, 64)

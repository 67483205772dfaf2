"""families/flux2dev/: FLUX.2 [dev] on its tiny random model (real classes: Flux2Transformer2DModel with its guidance
input, Mistral3ForConditionalGeneration with a byte-level tokenizer made here, AutoencoderKLFlux2), its conditioning
and training step checked against Flux2Pipeline's and diffusers' train_dreambooth_lora_flux2.py's own math."""

import inspect
import json

import familysteps
import pytest
import torch
from PIL import Image

from dreambooth import errors
from dreambooth import families
from dreambooth.commands import preflight
from dreambooth.families import flux2dev as family_flux2_dev
from dreambooth.families.shared import flux2base
from dreambooth.generation import prompts


@pytest.fixture(scope="module")
def pipe(tiny_flux2dev_model):
    from diffusers import Flux2Pipeline

    return Flux2Pipeline.from_pretrained(tiny_flux2dev_model)


def test_the_family_is_read_from_its_folder_with_the_pipelines_own_constants(tiny_flux2dev_model, pipe):
    from diffusers.pipelines.flux2 import system_messages

    assert families.family_of(tiny_flux2dev_model) is family_flux2_dev.FAMILY
    families.check_model_dir(tiny_flux2dev_model)  # transformer, the VAE, Mistral 3 and its tokenizer
    assert families.native_resolution(tiny_flux2dev_model) == 64 and families.size_multiple(tiny_flux2dev_model) == 4
    defaults = inspect.signature(pipe._get_mistral_3_small_prompt_embeds).parameters
    assert family_flux2_dev.OUT_LAYERS == defaults["hidden_states_layers"].default
    assert flux2base.MAX_TOKENS == pipe.tokenizer_max_length == defaults["max_sequence_length"].default
    assert family_flux2_dev.SYSTEM_MESSAGE == system_messages.SYSTEM_MESSAGE == pipe.system_message
    assert family_flux2_dev.FAMILY.guidance_scale == inspect.signature(pipe.__call__).parameters["guidance_scale"].default
    assert pipe.transformer.config.guidance_embeds and families.ARCHS["flux2dev"] is family_flux2_dev.FAMILY


def test_our_conditioning_is_the_pipelines(tiny_flux2dev_model, pipe):
    """Layers 10, 20 and 30 of every token of the system message and the prompt through the chat template, side by
    side, as Flux2Pipeline.encode_prompt makes them (an [IMG] in a prompt taken out as it does); no pooled one."""
    family = family_flux2_dev.FAMILY
    texts = ["photo of unqtkn toy, on a beach", "photo of a [IMG]toy"]
    ids = torch.tensor(prompts.prompt_ids(tiny_flux2dev_model, texts, None, family)["instance"])
    assert ids.shape == (2, 2, flux2base.MAX_TOKENS)
    text = pipe.tokenizer.decode(ids[1, 0][ids[1, 1].bool()])
    assert family_flux2_dev.SYSTEM_MESSAGE in text and "photo of a toy" in text
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(texts)
        states, pooled = family.encode_text([pipe.text_encoder], ids)
    assert pooled is None and states.shape == (2, flux2base.MAX_TOKENS, 3 * 32)
    torch.testing.assert_close(states, expected)


def test_the_guidance_value_reaches_the_transformer_in_training(tiny_flux2dev_model, make_plan, pipe):
    """Another guidance value gives another loss, as diffusers' train_dreambooth_lora_flux2.py's (the family's
    contract holds the loss at the family's default to that script's)."""
    from dreambooth.families.flux2dev import contract

    plan = make_plan(model_dir=tiny_flux2dev_model, resolution=64, guidance_scale=1.0)
    assert plan.family.guidance(plan.guidance_scale) == 1.0
    ours, _ = familysteps.losses(tiny_flux2dev_model, make_plan, contract.reference_loss, pipe)
    other, _ = familysteps.losses(tiny_flux2dev_model, lambda **k: make_plan(guidance_scale=1.0, **k),
                                  contract.reference_loss, pipe)
    assert not torch.allclose(other, ours)


def test_lora_adapts_the_scripts_layers_and_every_output_loads_in_the_pipeline(tiny_flux2dev_model, train_tiny,
                                                                               tmp_path):
    """The adapters sit on the layers diffusers' FLUX.2 script names (its target list, given to peft on the same
    transformer); each adapter's file and the full model load in Flux2Pipeline and predict as the trained
    transformer does, unlike the base."""
    from diffusers import Flux2Pipeline

    familysteps.flux2_lora_on_the_scripts_layers(Flux2Pipeline, tiny_flux2dev_model, 48, train_tiny, tmp_path)


def test_lora_exports_in_kohyas_flux2_names_that_comfyui_maps_and_merges_to_the_trained_weights(tiny_flux2dev_model,
                                                                                                 train_tiny, tmp_path):
    """export.py on a [dev] LoRA: [klein]'s layout (the FLUX.2 base's), each module one ComfyUI maps onto its FLUX.2
    model; merged as ComfyUI merges it, the trained transformer's weights; Flux2Pipeline reads it back to the same
    (familysteps.kohya_export_read_as_comfyui_reads_it)."""
    from diffusers import Flux2Pipeline

    from dreambooth.commands import export

    tensors = familysteps.kohya_export_read_as_comfyui_reads_it(
        Flux2Pipeline, tiny_flux2dev_model, train_tiny, tmp_path, familysteps.comfyui_flux2_layout,
        flux2base.kohya_module)
    modules = {key.split(".")[0] for key in tensors}
    assert {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1",
            "lora_unet_single_blocks_0_linear2"} <= modules
    assert export.why_no_file(str(tmp_path / "kohya-lora"), tiny_flux2dev_model) is None


def test_validation_samples_are_what_generate_draws_from_the_same_weights(tiny_flux2dev_model, make_plan, tmp_path):
    """Drawn at the guidance value 4.0, one prompt (no negative one), by both."""
    settings = familysteps.validation_draws_what_generate_draws(tiny_flux2dev_model, make_plan, tmp_path).settings
    assert (settings.guidance_scale, settings.resolution) == (4.0, 64)


def test_lora_trains_over_a_quantised_base_and_text_encoder_under_bf16(tiny_flux2dev_model, train_tiny, tmp_path):
    """--base_precision int8 --text_encoder_precision nf4 (bitsandbytes on CPU, the GPU's code path) with bf16
    autocast: the frozen transformer's linear layers quantised, its guidance embedder's too, and Mistral 3's (24 B
    released: 45 GiB in bf16, the part that decides the card); the states near bf16's; the fp32 adapters train,
    Flux2Pipeline loads them."""
    import bitsandbytes as bnb
    from diffusers import Flux2Pipeline

    from dreambooth.models import networks
    from dreambooth.models import outputs

    plan, state, losses = train_tiny(tiny_flux2dev_model, 2, use_lora=True, base_precision="int8",
                                     text_encoder_precision="nf4", mixed_precision="bf16",
                                     output_dir=str(tmp_path / "out"))
    denoiser = networks.unwrap(state.models.denoiser)
    assert isinstance(denoiser.transformer_blocks[0].attn.to_q.base_layer, bnb.nn.Linear8bitLt)
    assert isinstance(denoiser.time_guidance_embed.guidance_embedder.linear_1, bnb.nn.Linear8bitLt)
    [mistral] = state.models.text_encoders()
    layer = mistral.model.language_model.layers[10].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear4bit) and not layer.weight.requires_grad
    ids = torch.tensor(prompts.prompt_ids(tiny_flux2dev_model, ["photo of unqtkn toy"], None, plan.family)["instance"])
    from transformers import Mistral3ForConditionalGeneration

    reference = Mistral3ForConditionalGeneration.from_pretrained(tiny_flux2dev_model, subfolder="text_encoder")
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        quantised_states, _ = plan.family.encode_text([mistral], ids)
        states, _ = plan.family.encode_text([reference.to(torch.bfloat16)], ids)
    assert not torch.equal(quantised_states, states)
    assert torch.nn.functional.cosine_similarity(quantised_states.float().flatten(), states.float().flatten(), 0) > 0.9
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(p.abs().sum() > 0 for n, p in denoiser.named_parameters() if "lora_B" in n)
    outputs.save_pipeline(state.models, plan)
    Flux2Pipeline.from_pretrained(plan.model_dir).load_lora_weights(plan.output_dir)


def test_the_released_tokenizer_without_torchvision_is_refused_in_one_line(tiny_flux2dev_model, tmp_path):
    """The released folder's tokenizer is a PixtralProcessor, which transformers builds only with torchvision (not a
    requirement of ours, so not on this machine): a machine without it gets the line that says what to install,
    not a traceback."""
    import importlib.util
    import shutil

    assert importlib.util.find_spec("torchvision") is None
    folder = tmp_path / "model"
    shutil.copytree(tiny_flux2dev_model, folder)
    (folder / "tokenizer" / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2}))
    (folder / "tokenizer" / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor", "patch_size": 14}))
    line = r"^FLUX.2 \[dev\]'s tokenizer .* needs torchvision: pip install torchvision==0.28.0"
    for check in (families.check_model_dir, family_flux2_dev.FAMILY.load_tokenizers):  # (before Ray; a worker's)
        with pytest.raises(errors.UserError, match=line):
            check(str(folder))
    families.check_model_dir(tiny_flux2dev_model)  # (the tiny one's plain tokenizer needs none)
    # dreambooth_run.sh's Step 0 for the short name, before Step 1 fetches its 112.6 GB
    (tmp_path / "photos").mkdir()
    Image.new("RGB", (64, 64), "red").save(tmp_path / "photos" / "a.jpg")
    with pytest.raises(errors.UserError, match=line):
        preflight.main(["--photos_dir", str(tmp_path / "photos"), "--data_prefix", str(tmp_path / "data"),
                        "--class_name", "dog", "--model_name", "flux2-dev"])



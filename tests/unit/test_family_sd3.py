"""families/sd3/: SD 3.5 on its tiny random model (real classes: SD3Transformer2DModel, CLIP-L, CLIP-G,
T5 with a tokenizer made here), trained by flow matching, without Ray."""

import dataclasses
import functools

import familysteps
import pytest
import torch

from dreambooth import families
from dreambooth.families import sd3 as family_sd3
from dreambooth.families.shared import builders
from dreambooth.generation import prompts
from dreambooth.models import networks
from dreambooth.models import outputs
from dreambooth.training import validation

CPU = torch.device("cpu")


def test_the_family_is_read_from_its_folder_with_its_own_sizes(tiny_sd3_model):
    assert families.family_of(tiny_sd3_model) is family_sd3.FAMILY
    families.check_model_dir(tiny_sd3_model)  # transformer, vae, three text encoders and tokenizers
    assert families.native_resolution(tiny_sd3_model) == 64  # the transformer's sample size x the VAE's scale
    assert families.size_multiple(tiny_sd3_model) == 4  # x the patch size


def test_the_t5_tokenizer_made_here_spells_any_prompt_and_ends_it():
    tokenizer = builders.tiny_t5_tokenizer(family_sd3.T5_MAX_LENGTH)
    ids = tokenizer("photo of unqtkn toy, on a beach!").input_ids
    assert tokenizer.unk_token_id not in ids and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "photo of unqtkn toy, on a beach!"


def test_our_conditioning_is_the_pipelines(tiny_sd3_model):
    """The states and pooled text the transformer trains on are what StableDiffusion3Pipeline.encode_prompt
    makes of the same prompt (T5 at the 77 tokens training uses)."""
    from diffusers import StableDiffusion3Pipeline

    family = families.family_of(tiny_sd3_model)
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_model)
    prompt = "photo of unqtkn toy"
    expected, _, pooled, _ = pipe.encode_prompt(prompt, prompt, prompt, do_classifier_free_guidance=False,
                                                max_sequence_length=family_sd3.T5_MAX_LENGTH)
    ids = torch.tensor(prompts.prompt_ids(tiny_sd3_model, [prompt], None, family)["instance"])
    assert ids.shape == (1, 3, 77)
    with torch.no_grad():
        states, ours = family.encode_text([pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3], ids)
    torch.testing.assert_close(states, expected)
    torch.testing.assert_close(ours, pooled)


@pytest.fixture()
def sd3_run(tiny_sd3_model, train_tiny):
    return functools.partial(train_tiny, tiny_sd3_model)


def test_a_full_fine_tune_moves_the_transformer_and_clip_and_leaves_t5(sd3_run, tiny_sd3_model):
    from transformers import T5EncoderModel

    plan, state, losses = sd3_run(steps_taken=6, precondition_outputs=0)  # (sigma^2 weights would hide the trend)
    assert losses[-1] < losses[0]  # a fixed batch is learnt (the velocity of one noise per step)
    base_t5 = T5EncoderModel.from_pretrained(tiny_sd3_model, subfolder="text_encoder_3")
    nets = state.models
    assert all(torch.equal(a, b) for a, b in zip(nets.encoders[2].parameters(), base_t5.parameters()))
    assert not any(p.requires_grad for p in nets.encoders[2].parameters())  # T5 stays frozen, as diffusers' script
    assert all(any(p.requires_grad for p in te.parameters()) for te in nets.encoders[:2])


def test_lora_and_full_outputs_load_in_the_sd3_pipeline(sd3_run, tiny_sd3_model, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    base = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_model)
    for adapter in familysteps.ADAPTERS:  # (LoRA, DoRA, LoHa, LoKr, full)
        plan, state, _ = sd3_run(steps_taken=2, output_dir=str(tmp_path / f"out-{adapter}"),
                                 **familysteps.adapter_fields(adapter))
        outputs.save_pipeline(state.models, plan)
        ours = networks.unwrap(state.models.denoiser)
        pipe = familysteps.output_loaded(StableDiffusion3Pipeline, tiny_sd3_model, plan.output_dir, adapter)
        familysteps.lycoris_exported(pipe, tiny_sd3_model, plan, adapter, tmp_path)
        x = torch.randn(1, 16, 32, 32, generator=torch.Generator().manual_seed(2))
        states, pooled = torch.randn(1, 154, 32), torch.randn(1, 96)  # T5's width; CLIP-L's + CLIP-G's pooled
        t = torch.tensor([500.0])

        def predict(model):
            with torch.no_grad():
                return model(hidden_states=x, timestep=t, encoder_hidden_states=states, pooled_projections=pooled).sample

        assert not torch.allclose(predict(pipe.transformer), predict(base.transformer), atol=1e-4), adapter
        torch.testing.assert_close(predict(pipe.transformer), predict(ours.eval()), rtol=1e-4, atol=1e-4, msg=adapter)
        if adapter == "lora":  # export.py's kohya file, applied as ComfyUI applies one, then read by diffusers' converter
            comfy = kohya_applied_to_the_original_layout(plan.output_dir, base.transformer, tmp_path)
            torch.testing.assert_close(predict(comfy), predict(pipe.transformer), rtol=1e-4, atol=1e-4)


def kohya_applied_to_the_original_layout(lora_dir, base, tmp_path):
    """The transformer a loader of original-layout files makes of export.py's kohya LoRA file on base: base's
    weights in Stability's layout (family_sd3.original_transformer); each lora_unet_<key with _> adapter's update
    (up @ down x alpha / rank) added to the original weight whose name it spells, as ComfyUI matches them; then
    diffusers' own single-file converter back to an SD3Transformer2DModel."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    from dreambooth.commands import export

    lora = load_file(export.main(["--model_dir", lora_dir, "--output_file", str(tmp_path / "sd3-lora.safetensors")]))
    original = family_sd3.original_transformer(base.state_dict(), base.config.num_layers)
    by_name = {"lora_unet_" + key.removesuffix(".weight").replace(".", "_"): key for key in original}
    modules = {key.rsplit(".", 2)[0] for key in lora}
    assert {"lora_unet_joint_blocks_0_x_block_attn_qkv", "lora_unet_joint_blocks_1_context_block_attn_qkv",
            "lora_unet_joint_blocks_0_x_block_attn_proj"} <= modules
    for module in (m for m in modules if m.startswith("lora_unet_")):
        down, up, alpha = (lora[f"{module}.{part}"] for part in ("lora_down.weight", "lora_up.weight", "alpha"))
        key = by_name[module]  # (a KeyError: a name no original weight has)
        original[key] = original[key] + up @ down * (alpha / down.shape[0])
    comfy = SD3Transformer2DModel.from_config(base.config)
    comfy.load_state_dict(convert_sd3_transformer_checkpoint_to_diffusers(original))
    return comfy.eval()


def test_the_original_layout_is_what_diffusers_single_file_converter_reads_back():
    """family_sd3.original_transformer on SD 3.5 medium's kinds of block (a second attention, RMS-normed queries
    and keys): diffusers' converter turns it back into the same weights, each of them."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=24, out_channels=16, pos_embed_max_size=8,
                                  dual_attention_layers=(0, 1), qk_norm="rms_norm")
    for parameter in model.parameters():  # (not the zeros some are made with: every weight must land in its place)
        torch.nn.init.normal_(parameter)
    ours = model.state_dict()
    back = convert_sd3_transformer_checkpoint_to_diffusers(family_sd3.original_transformer(ours, 3))
    assert sorted(back) == sorted(ours)
    assert all(torch.equal(back[key], ours[key]) for key in ours)


def test_validation_samples_are_what_generate_draws_from_the_same_weights(tiny_sd3_model, make_plan, tmp_path):
    familysteps.validation_draws_what_generate_draws(tiny_sd3_model, make_plan, tmp_path, "a toy", "a-toy-00000.png")


@pytest.mark.parametrize("precision, mixed, channels_last", [("int8", "no", False), ("nf4", "bf16", True)])
def test_lora_trains_over_a_quantised_frozen_base(sd3_run, tiny_sd3_model, tmp_path, precision, mixed, channels_last):
    """--base_precision int8|nf4 (bitsandbytes on CPU, the GPU's code path; bf16 autocast and channels-last
    as a GPU run sets them): the frozen transformer's linear weights are int8 / packed 4-bit, only the fp32
    adapters train, they move, and the output is a LoRA file the pipeline loads."""
    import bitsandbytes as bnb
    from diffusers import StableDiffusion3Pipeline

    plan, state, losses = sd3_run(steps_taken=3, use_lora=True, base_precision=precision, mixed_precision=mixed,
                                  channels_last=channels_last, output_dir=str(tmp_path / "out"))
    denoiser = networks.unwrap(state.models.denoiser)
    layer = denoiser.transformer_blocks[0].attn.to_q
    assert isinstance(layer.base_layer, bnb.nn.Linear8bitLt if precision == "int8" else bnb.nn.Linear4bit)
    assert layer.base_layer.weight.dtype == (torch.int8 if precision == "int8" else torch.uint8)
    assert all(p.dtype == torch.float32 and "lora_" in n for n, p in denoiser.named_parameters() if p.requires_grad)
    assert all(torch.isfinite(torch.tensor(losses)))
    adapters = {n: p.detach() for n, p in denoiser.named_parameters() if p.requires_grad}
    assert any(v.abs().sum() > 0 for n, v in adapters.items() if "lora_B" in n)  # they start at zero: they trained
    sample_plan = dataclasses.replace(plan, validation_prompts=("a toy",), num_validation_images=1,
                                      validation_inference_steps=2)
    _, images = validation.run_round(validation.Sampler(state.models, sample_plan, state.amp_dtype), 3, 0, 1,
                                     str(tmp_path / "run"))  # eval mode and no grad, as validation samples run
    assert images["a-toy-00000.png"].size == (64, 64)
    outputs.save_pipeline(state.models, plan)
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_model)
    pipe.load_lora_weights(plan.output_dir)


def test_base_precision_needs_lora(capsys):
    from dreambooth.planning import planning

    with pytest.raises(SystemExit):
        planning.parse_args(["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/i",
                             "--instance_prompt", "p", "--base_precision", "nf4"])
    assert "--base_precision nf4 quantises the frozen model under LoRA's adapters: add --use_lora" in \
        capsys.readouterr().err

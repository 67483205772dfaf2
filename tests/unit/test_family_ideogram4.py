"""families/ideogram4/: Ideogram 4's LoRA exported by export.py on its tiny random model (diffusers'
Ideogram4Transformer2DModel, one block), held to ComfyUI's key map and merge rule rebuilt from its Ideogram 4 model's
module names (q, k and v one qkv layer there); its LoHa and LoKr, which ComfyUI maps no LyCORIS names of, refused in
one line. (Its training loss, conditioning and pipeline: the family contract, tests/unit/test_family_contract.py.)"""

import familysteps
import pytest
import torch

from dreambooth.families import ideogram4 as family_ideogram4

# ComfyUI's Ideogram 4 model (comfy/ldm/ideogram4/model.py Ideogram4Transformer2DModel, read at Comfy-Org/ComfyUI
# 9b42ead and comfyanonymous/ComfyUI 2be2a9d): each block's attention is one qkv layer (viewed as 3 x heads x head
# width: q's rows, then k's and v's) and o, its SwiGLU comfy/ldm/lumina's FeedForward (w1, w2, w3), its modulation
# adaln_modulation; outside the blocks input_proj, llm_cond_proj, t_embedding (mlp_in, mlp_out), adaln_proj and the
# final layer's linear and adaln_modulation. comfy/lora.py (ec93dcac) maps lora_unet_<weight, "_" for "."> onto each
# and has no branch of Ideogram 4's own (no diffusers or LyCORIS names).
OUTSIDE = ("input_proj", "llm_cond_proj", "t_embedding.mlp_in", "t_embedding.mlp_out", "adaln_proj",
           "final_layer.linear", "final_layer.adaln_modulation")
SAME = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaln_modulation")


def comfyui_ideogram4_layout(config):
    """{diffusers weight: (ComfyUI's Ideogram 4 weight, first row, rows or None: all)} of the linear layers of an
    Ideogram 4 transformer of config, as ComfyUI's model names them (q, k and v each width rows of attention.qkv)."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    layout = {f"{name}.weight": (f"{name}.weight", 0, None) for name in OUTSIDE}
    for i in range(config["num_layers"]):
        block = f"layers.{i}."
        for k, name in enumerate(("to_q", "to_k", "to_v")):
            layout[f"{block}attention.{name}.weight"] = (f"{block}attention.qkv.weight", k * width, width)
        layout[f"{block}attention.to_out.0.weight"] = (f"{block}attention.o.weight", 0, None)
        layout.update({f"{block}{name}.weight": (f"{block}{name}.weight", 0, None) for name in SAME})
    return layout


def test_comfyuis_ideogram4_layout_names_every_linear_layer_and_the_familys_kohya_names_are_its_own(
        tiny_ideogram4_model):
    """ComfyUI's Ideogram 4 weights (comfyui_ideogram4_layout) are the transformer's linear layers, q, k and v
    together as wide as qkv; the family's kohya name of each layer is the one ComfyUI maps onto its weight, with the
    part of qkv it is."""
    from diffusers import Ideogram4Transformer2DModel

    transformer = Ideogram4Transformer2DModel.from_pretrained(tiny_ideogram4_model, subfolder="transformer")
    layout = comfyui_ideogram4_layout(transformer.config)
    linear = {f"{name}.weight" for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)}
    assert set(layout) == linear
    keys = familysteps.comfyui_lora_keys(layout)
    for name, (theirs, row, rows) in layout.items():
        module, part = family_ideogram4.kohya_module(name[:-len(".weight")])
        assert keys[module] == theirs and (part is None) == (rows is None), name
        assert part is None or row == "qkv".index(part) * rows, name


def test_lora_exports_in_kohyas_names_of_the_original_layout_that_comfyui_maps_and_merges_to_the_trained_weights(
        tiny_ideogram4_model, train_tiny, tmp_path):
    """export.py on an Ideogram 4 LoRA (diffusers' script's layers: attention, SwiGLU): kohya's names of its original
    modules (lora_unet_layers_<i>_attention_qkv holding q, k and v, ..._attention_o, ..._feed_forward_w1), each one
    ComfyUI maps onto its Ideogram 4 model; merged as ComfyUI merges it, the trained transformer's weights
    (familysteps.kohya_export_read_as_comfyui_reads_it; diffusers reads no kohya names of Ideogram 4). Under ComfyUI's
    dotted names (diffusion_model.layers.<i>.attention.qkv, ai-toolkit's), diffusers' own Ideogram 4 reader splits
    qkv's up weight in thirds as q, k and v and gets the same weights: the rows are in ComfyUI's order."""
    from diffusers import Ideogram4Pipeline

    from dreambooth.commands import export

    tensors = familysteps.kohya_export_read_as_comfyui_reads_it(
        Ideogram4Pipeline, tiny_ideogram4_model, train_tiny, tmp_path, comfyui_ideogram4_layout,
        family_ideogram4.kohya_module, diffusers_reads_it=False)
    assert {key.split(".")[0] for key in tensors} == {
        f"lora_unet_layers_0_{name}" for name in ("attention_qkv", "attention_o", "feed_forward_w1",
                                                  "feed_forward_w2", "feed_forward_w3")}
    assert tensors["lora_unet_layers_0_attention_qkv.alpha"].item() == 3 * 8.0  # (the scale alpha / rank kept)
    assert tensors["lora_unet_layers_0_attention_o.alpha"].item() == 8.0
    pipe = Ideogram4Pipeline.from_pretrained(tiny_ideogram4_model)
    layout = comfyui_ideogram4_layout(pipe.transformer.config)
    merged = familysteps.comfyui_kohya_merged(pipe.transformer.state_dict(), tensors, layout)
    theirs = {module: original[:-len(".weight")] for module, original in familysteps.comfyui_lora_keys(layout).items()}
    pipe.load_lora_weights({f"diffusion_model.{theirs[key.split('.')[0]]}.{key.split('.', 1)[1]}": tensor
                            for key, tensor in tensors.items()})
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # (the fused weights stay, under the base model's names)
    fused = pipe.transformer.state_dict()
    for name in layout:
        torch.testing.assert_close(fused[name], merged[name], rtol=0, atol=1e-6, msg=name)
    assert export.why_no_file(str(tmp_path / "kohya-lora"), tiny_ideogram4_model) is None
    assert export.why_no_file(str(tmp_path / "full"), tiny_ideogram4_model) == \
        "export.py writes no Ideogram 4 model yet"


def test_loha_and_lokr_are_refused_in_one_line_as_comfyui_maps_no_lycoris_names_of_ideogram4(tiny_ideogram4_model,
                                                                                             train_tiny, tmp_path):
    """LoKr adapters of Ideogram 4 (LoHa's alike): no LyCORIS file, as ComfyUI maps no LyCORIS names onto its Ideogram
    4 model (and no kohya name of a LoKr can hold q, k and v in one qkv layer); export.py says so in one line, and
    the lines dreambooth_run.sh ends with offer no export."""
    from dreambooth import errors
    from dreambooth.commands import export
    from dreambooth.models import outputs

    plan, state, _ = train_tiny(tiny_ideogram4_model, 2, output_dir=str(tmp_path / "lokr"),
                                **familysteps.adapter_fields("lokr"))
    outputs.save_pipeline(state.models, plan)
    with pytest.raises(errors.UserError, match="LyCORIS layout is not written for Ideogram 4"):
        export.main(["--model_dir", plan.output_dir, "--output_file", str(tmp_path / "lokr.safetensors")])
    assert not (tmp_path / "lokr.safetensors").exists()
    assert export.why_no_file(plan.output_dir, tiny_ideogram4_model).startswith("the model holds LoHa/LoKr adapters")


def test_validation_samples_are_what_generate_draws_with_its_unconditional_transformer(tiny_ideogram4_model,
                                                                                       make_plan, tmp_path):
    """Drawn at the guidance 7.0 by both, the validation round from the prompt's states computed before the text
    encoder left (familysteps.validation_draws_what_generate_draws) and with the pipeline's unconditional transformer,
    loaded once, frozen: the random tiny one differs from the trained one, so the same image proves it was read."""
    drew = familysteps.validation_draws_what_generate_draws(tiny_ideogram4_model, make_plan, tmp_path)
    assert drew.settings.guidance_scale == 7.0
    [unconditional] = drew.sampler.drawing_networks.values()
    assert not any(p.requires_grad for p in unconditional.parameters())
    torch.testing.assert_close(unconditional.state_dict(), drew.pipe.unconditional_transformer.state_dict())
    assert not torch.equal(unconditional.input_proj.weight, drew.pipe.transformer.input_proj.weight)


def test_lora_samples_over_an_nf4_base_under_bf16_quantise_the_unconditional_transformer_too(tiny_ideogram4_model,
                                                                                             make_plan, tmp_path):
    """--base_precision nf4 under bf16 autocast (bitsandbytes on CPU, the GPU's code path): the unconditional
    transformer's linear layers are nf4 as the trained one's base, and a second round reuses it."""
    import bitsandbytes as bnb
    import numpy as np

    from dreambooth.models import networks
    from dreambooth.training import validation

    plan = make_plan(model_dir=tiny_ideogram4_model, resolution=64, use_lora=True, base_precision="nf4",
                     mixed_precision="bf16", validation_prompts=("a unqtkn toy",), num_validation_images=1,
                     validation_inference_steps=2)
    nets = networks.setup_models(plan, torch.device("cpu"), torch.device("cpu"), distributed=False)
    sampler = validation.Sampler(nets, plan, torch.bfloat16)
    nets.release_text_encoders("meta")
    _, first = validation.run_round(sampler, 1, 0, 1, str(tmp_path))
    [unconditional] = sampler.drawing_networks.values()
    assert isinstance(unconditional.layers[0].attention.to_q, bnb.nn.Linear4bit)
    _, second = validation.run_round(sampler, 2, 0, 1, str(tmp_path))
    assert sampler.drawing_networks["unconditional_transformer"] is unconditional
    pixels = np.asarray(first["a-unqtkn-toy-00000.png"])
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    assert np.array_equal(pixels, np.asarray(second["a-unqtkn-toy-00000.png"]))  # (the same weights: the same image)

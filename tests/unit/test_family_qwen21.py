"""families/qwen21/: Qwen-Image 2.1's LoRA, LoHa and LoKr exported by export.py on its tiny random model (diffusers'
QwenImage21Transformer2DModel, one block), held to ComfyUI's key map and merge rule rebuilt from its Qwen-Image 2.1
model's module names. (Its training loss, conditioning and pipeline: the family contract,
tests/unit/test_family_contract.py.)"""

import familysteps
import pytest
import torch

from dreambooth.families import qwen21 as family_qwen21

# ComfyUI's Qwen-Image 2.1 model (comfy/ldm/qwen_image21/model.py QwenImage21Transformer2DModel, read on
# Comfy-Org/ComfyUI b806797): diffusers' module names, but each block's SwiGLU input is one layer, img_mlp.gate_up
# (gate_layer's rows, then proj's: comfy/lora.py ec93dcac maps the halves' diffusers names onto it, "Qwen Image 2.1
# fuses gate_layer/proj at load")
OUTSIDE = ("img_in", "txt_in.in_layer", "txt_in.out_layer", "time_text_embed.timestep_embedder.linear_1",
           "time_text_embed.timestep_embedder.linear_2", "modulation.1", "norm_out.linear", "proj_out")
BLOCK = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.out")


def comfyui_qwen21_layout(config):
    """{diffusers weight: (ComfyUI's Qwen-Image 2.1 weight, first row, rows or None: all)} of the linear layers of a
    Qwen-Image 2.1 transformer of config, as ComfyUI's model names them (gate_layer and proj: the halves of
    img_mlp.gate_up)."""
    mlp = config["num_attention_heads"] * config["attention_head_dim"] * config["mlp_ratio"]
    layout = {f"{name}.weight": (f"{name}.weight", 0, None) for name in OUTSIDE}
    for i in range(config["num_layers"]):
        block = f"transformer_blocks.{i}."
        layout.update({f"{block}{name}.weight": (f"{block}{name}.weight", 0, None) for name in BLOCK})
        for k, name in enumerate(("gate_layer", "proj")):
            layout[f"{block}img_mlp.{name}.weight"] = (f"{block}img_mlp.gate_up.weight", k * mlp, mlp)
    return layout


def adaptable_layout(config):
    """comfyui_qwen21_layout's layers of their own: every layer the family can adapt (not a half of gate_up)."""
    return {name: place for name, place in comfyui_qwen21_layout(config).items() if place[2] is None}


def test_comfyuis_qwen21_layout_names_every_linear_layer_as_diffusers_reads_it_back(tiny_qwen21_model):
    """ComfyUI's Qwen-Image 2.1 weights (comfyui_qwen21_layout) are the transformer's linear layers, gate_layer and
    proj the rows of gate_up that diffusers' own reader of ComfyUI's checkpoint
    (convert_qwen_image21_transformer_checkpoint_to_diffusers) gives them; the family's kohya name of each other
    layer is the one ComfyUI maps onto its weight, and a half of gate_up has none (the family never adapts one)."""
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers

    transformer = QwenImage21Transformer2DModel.from_pretrained(tiny_qwen21_model, subfolder="transformer")
    layout = comfyui_qwen21_layout(transformer.config)
    linear = {f"{name}.weight" for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)}
    assert set(layout) == linear
    rows = {}
    for theirs, row, count in layout.values():
        rows[theirs] = max(rows.get(theirs, 1), row + (count or 1))
    original = {theirs: torch.arange(count, dtype=torch.float32)[:, None] for theirs, count in rows.items()}
    converted = convert_qwen_image21_transformer_checkpoint_to_diffusers(dict(original))
    assert set(converted) == linear
    for ours, (theirs, row, count) in layout.items():
        torch.testing.assert_close(converted[ours], original[theirs][row:row + count] if count else original[theirs])
    keys = familysteps.comfyui_lora_keys(adaptable_layout(transformer.config))
    for name, (theirs, _, count) in layout.items():
        module = name[:-len(".weight")]
        if count is None:
            assert keys[family_qwen21.kohya_module(module)[0]] == theirs
        else:
            with pytest.raises(KeyError, match="gate_up"):
                family_qwen21.kohya_module(module)


def test_lora_exports_in_kohyas_names_that_comfyui_maps_and_merges_to_the_trained_weights(tiny_qwen21_model,
                                                                                          train_tiny, tmp_path):
    """export.py on a Qwen-Image 2.1 LoRA (the blocks' attention, diffusers' script's layers): kohya's names of
    diffusers' modules, which ComfyUI's model keeps (lora_unet_transformer_blocks_<i>_attn_to_q, ...), each one
    ComfyUI maps onto its Qwen-Image 2.1 model; with lora_down, lora_up and the alpha, merged as ComfyUI merges it,
    the trained transformer's weights (familysteps.kohya_export_read_as_comfyui_reads_it; diffusers' Qwen-Image 2.1
    pipeline reads no kohya names: not read back). The lines dreambooth_run.sh ends with offer the export for LoRA,
    not yet for a full model."""
    from diffusers import QwenImage21Pipeline

    from dreambooth.commands import export

    tensors = familysteps.kohya_export_read_as_comfyui_reads_it(
        QwenImage21Pipeline, tiny_qwen21_model, train_tiny, tmp_path, adaptable_layout, family_qwen21.kohya_module,
        diffusers_reads_it=False)
    assert {key.split(".")[0] for key in tensors} == {
        f"lora_unet_transformer_blocks_0_attn_{name}" for name in ("to_q", "to_k", "to_v", "to_out_0")}
    assert tensors["lora_unet_transformer_blocks_0_attn_to_q.alpha"].item() == 8.0  # (the scale alpha / rank kept)
    assert export.why_no_file(str(tmp_path / "kohya-lora"), tiny_qwen21_model) is None
    assert export.why_no_file(str(tmp_path / "full"), tiny_qwen21_model) is None  # (a full model: its transformer)


@pytest.mark.parametrize("adapter", ["loha", "lokr"])
def test_loha_and_lokr_export_in_the_lycoris_names_comfyui_maps_for_qwen21(tiny_qwen21_model, train_tiny, tmp_path,
                                                                           adapter):
    """export.py on LoHa and LoKr adapters of Qwen-Image 2.1: lycoris_<module, "_" for ".">, the names ComfyUI maps
    for its Qwen-Image models (comfy/lora.py's QwenImage branch, which its Qwen-Image 2.1 model is) onto the same
    weights; merged as ComfyUI merges them, the weights peft fuses (familysteps.lycoris_exported)."""
    from diffusers import QwenImage21Pipeline

    from dreambooth.models import outputs

    plan, state, _ = train_tiny(tiny_qwen21_model, 2, output_dir=str(tmp_path / adapter),
                                **familysteps.adapter_fields(adapter))
    outputs.save_pipeline(state.models, plan)
    pipe = familysteps.output_loaded(QwenImage21Pipeline, tiny_qwen21_model, plan.output_dir, adapter)
    familysteps.lycoris_exported(pipe, tiny_qwen21_model, plan, adapter, tmp_path)
    assert (tmp_path / f"{adapter}-export" / "lycoris.safetensors").exists()

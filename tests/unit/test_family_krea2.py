"""families/krea2/: Krea 2's LoRA, LoHa and LoKr exported by export.py on its tiny random model (diffusers'
Krea2Transformer2DModel, one block, one text-fusion block of each kind), held to ComfyUI's key map and merge rule
rebuilt from its Krea 2 model's module names. (Its training loss, conditioning and pipeline: the family contract,
tests/unit/test_family_contract.py.)"""

import familysteps
import pytest
import torch

from dreambooth.families import krea2 as family_krea2

# ComfyUI's Krea 2 model (comfy/ldm/krea2/model.py SingleStreamDiT, read at 08381b1a): Krea's own names, which its
# loader keeps (comfy/lora.py at ec93dcac maps diffusers' names onto them through comfy/utils.py krea2_to_diffusers).
# A block's and a text fusion block's attention (wq, wk, wv, the sigmoid gate, wo) and SwiGLU (gate, up, down); the
# transformer's image input (first), time MLP (tmlp, a Sequential: 0 and 2), time modulation (tproj.1), text MLP
# (txtmlp: its RMSNorm, then 1 and 3), the text fusion's projector and the last layer's linear.
ATTENTION = {"to_q": "wq", "to_k": "wk", "to_v": "wv", "to_gate": "gate", "to_out.0": "wo"}
OUTSIDE = {"img_in": "first", "time_embed.linear_1": "tmlp.0", "time_embed.linear_2": "tmlp.2",
           "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1", "txt_in.linear_2": "txtmlp.3",
           "text_fusion.projector": "txtfusion.projector", "final_layer.linear": "last.linear"}


def comfyui_krea2_layout(config):
    """{diffusers weight: (ComfyUI's Krea 2 weight, 0, None: all rows)} of the linear layers of a Krea 2 transformer
    of config, as ComfyUI's Krea 2 model names them (no layer fused)."""
    def block(ours, theirs):
        return {**{f"{ours}.attn.{name}": f"{theirs}.attn.{original}" for name, original in ATTENTION.items()},
                **{f"{ours}.ff.{name}": f"{theirs}.mlp.{name}" for name in ("gate", "up", "down")}}

    modules = dict(OUTSIDE)
    for i in range(config["num_layers"]):
        modules.update(block(f"transformer_blocks.{i}", f"blocks.{i}"))
    for blocks, count in (("layerwise_blocks", config["num_layerwise_text_blocks"]),
                          ("refiner_blocks", config["num_refiner_text_blocks"])):
        for i in range(count):
            modules.update(block(f"text_fusion.{blocks}.{i}", f"txtfusion.{blocks}.{i}"))
    return {f"{ours}.weight": (f"{theirs}.weight", 0, None) for ours, theirs in modules.items()}


def test_comfyuis_krea2_layout_names_every_linear_layer_as_diffusers_reads_it_back(tiny_krea2_model):
    """ComfyUI's Krea 2 weights (comfyui_krea2_layout) are the transformer's linear layers, one each; diffusers' own
    reader of Krea's original checkpoint (convert_krea2_transformer_checkpoint_to_diffusers) names each of them back
    as the transformer does; the family's kohya name of each layer is the one ComfyUI maps onto that weight."""
    from diffusers import Krea2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    transformer = Krea2Transformer2DModel.from_pretrained(tiny_krea2_model, subfolder="transformer")
    layout = comfyui_krea2_layout(transformer.config)
    linear = {f"{name}.weight" for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)}
    assert set(layout) == linear and len({theirs for theirs, _, _ in layout.values()}) == len(layout)
    for ours, (theirs, _, _) in layout.items():
        assert list(convert_krea2_transformer_checkpoint_to_diffusers({theirs: torch.zeros(1)})) == [ours], theirs
    keys = familysteps.comfyui_lora_keys(layout)
    assert all(keys[family_krea2.kohya_module(name[:-len(".weight")])[0]] == layout[name][0] for name in layout)
    assert family_krea2.kohya_module("transformer_blocks.0.attn.to_out.0") == ("lora_unet_blocks_0_attn_wo", None)


def test_lora_exports_in_kohyas_names_of_the_original_layout_that_comfyui_maps_and_merges_to_the_trained_weights(
        tiny_krea2_model, train_tiny, tmp_path):
    """export.py on a Krea 2 LoRA (diffusers' script's layers: attention, MLPs, embeddings, the projector, the final
    layer): kohya's names of Krea's original modules (lora_unet_blocks_<i>_attn_wq, ..._txtfusion_refiner_blocks_<i>
    _mlp_up, lora_unet_first, ...), each one ComfyUI maps onto its Krea 2 model; with lora_down, lora_up and the
    alpha, merged as ComfyUI merges it, the trained transformer's weights (familysteps.kohya_export_read_as_comfyui_
    reads_it; diffusers' Krea 2 pipeline reads no kohya names: not read back). The lines dreambooth_run.sh ends with
    offer the export for LoRA, not yet for a full model."""
    from diffusers import Krea2Pipeline

    from dreambooth.commands import export

    tensors = familysteps.kohya_export_read_as_comfyui_reads_it(
        Krea2Pipeline, tiny_krea2_model, train_tiny, tmp_path, comfyui_krea2_layout, family_krea2.kohya_module,
        diffusers_reads_it=False)
    modules = {key.split(".")[0] for key in tensors}
    assert {"lora_unet_blocks_0_attn_wq", "lora_unet_blocks_0_attn_gate", "lora_unet_blocks_0_mlp_up",
            "lora_unet_txtfusion_layerwise_blocks_0_attn_wo", "lora_unet_txtfusion_refiner_blocks_0_mlp_down",
            "lora_unet_txtfusion_projector", "lora_unet_first", "lora_unet_last_linear", "lora_unet_tproj_1",
            "lora_unet_tmlp_0", "lora_unet_txtmlp_3"} <= modules
    assert not any(name.endswith("_mlp_gate") for name in modules)  # (diffusers' script adapts ff.up and ff.down)
    assert tensors["lora_unet_blocks_0_attn_wq.alpha"].item() == 8.0  # (the scale alpha / rank kept)
    assert export.why_no_file(str(tmp_path / "kohya-lora"), tiny_krea2_model) is None
    assert export.why_no_file(str(tmp_path / "full"), tiny_krea2_model) is None  # (a full model: its transformer alone)


@pytest.mark.parametrize("adapter", ["loha", "lokr"])
def test_loha_and_lokr_export_in_the_lycoris_names_comfyui_maps_for_krea2(tiny_krea2_model, train_tiny, tmp_path,
                                                                          adapter):
    """export.py on LoHa and LoKr adapters of Krea 2: lycoris_<diffusers' module, "_" for ".">, the names ComfyUI
    maps for its Krea 2 model (comfy/lora.py's Krea2 branch, through krea2_to_diffusers) onto the same weights;
    merged as ComfyUI merges them, the weights peft fuses (familysteps.lycoris_exported)."""
    from diffusers import Krea2Pipeline

    from dreambooth.models import outputs

    plan, state, _ = train_tiny(tiny_krea2_model, 2, output_dir=str(tmp_path / adapter),
                                **familysteps.adapter_fields(adapter))
    outputs.save_pipeline(state.models, plan)
    pipe = familysteps.output_loaded(Krea2Pipeline, tiny_krea2_model, plan.output_dir, adapter)
    familysteps.lycoris_exported(pipe, tiny_krea2_model, plan, adapter, tmp_path)
    assert (tmp_path / f"{adapter}-export" / "lycoris.safetensors").exists()

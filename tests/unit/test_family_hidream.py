"""families/hidream/: HiDream-I1's LoRA, LoHa and LoKr exported by export.py on its tiny random model (diffusers'
HiDreamImageTransformer2DModel, one dual- and one single-stream block of 4 routed experts), held to ComfyUI's key map
and merge rule rebuilt from its HiDream model's module names. (Its training loss, conditioning and pipeline: the family
contract, tests/unit/test_family_contract.py.)"""

import familysteps
import pytest
import torch

from dreambooth.families import hidream as family_hidream


def test_comfyuis_hidream_weights_are_diffusers_own_under_the_same_names(tiny_hidream_model):
    """The weights a LoRA can adapt in ComfyUI's HiDream model (familysteps.comfyui_hidream_layout: its linear layers
    and gates as comfy/ldm/hidream/model.py names them) are every 2-D weight of diffusers' transformer, each under its
    own name: HiDream-I1's original layout is diffusers' own, and the family's kohya names are ComfyUI's for each."""
    from diffusers import HiDreamImageTransformer2DModel

    transformer = HiDreamImageTransformer2DModel.from_pretrained(tiny_hidream_model, subfolder="transformer")
    layout = familysteps.comfyui_hidream_layout(transformer.config)
    assert set(layout) == {name for name, tensor in transformer.state_dict().items() if tensor.ndim == 2}
    assert all(original == name and (row, rows) == (0, None) for name, (original, row, rows) in layout.items())
    keys = familysteps.comfyui_lora_keys(layout)
    assert all(keys[family_hidream.kohya_module(name[:-len(".weight")])[0]] == name for name in layout)


def test_lora_exports_in_kohyas_names_that_comfyui_maps_and_merges_to_the_trained_weights(tiny_hidream_model,
                                                                                          train_tiny, tmp_path):
    """export.py on a HiDream LoRA (the image stream's attention, diffusers' script's layers): kohya's names of its
    original modules, which are diffusers' own (lora_unet_double_stream_blocks_<i>_block_attn1_to_q, ...), each one
    ComfyUI maps onto its HiDream model; with lora_down, lora_up and the alpha, merged as ComfyUI merges it, the
    trained transformer's weights (familysteps.kohya_export_read_as_comfyui_reads_it; diffusers' HiDream pipeline reads
    no kohya names: not read back). The lines dreambooth_run.sh ends with offer the export for LoRA, not yet for a
    full model."""
    from diffusers import HiDreamImagePipeline

    from dreambooth.commands import export

    tensors = familysteps.kohya_export_read_as_comfyui_reads_it(
        HiDreamImagePipeline, tiny_hidream_model, train_tiny, tmp_path, familysteps.comfyui_hidream_layout,
        family_hidream.kohya_module, diffusers_reads_it=False)
    assert {key.split(".")[0] for key in tensors} == {
        f"lora_unet_{blocks}_0_block_attn1_{name}" for blocks in ("double_stream_blocks", "single_stream_blocks")
        for name in ("to_q", "to_k", "to_v", "to_out")}
    module = "lora_unet_double_stream_blocks_0_block_attn1_to_q"
    rank = tensors[f"{module}.lora_down.weight"].shape[0]
    assert tensors[f"{module}.lora_up.weight"].shape[1] == rank and rank != 8
    assert tensors[f"{module}.alpha"].item() == 8.0 and tensors[f"{module}.alpha"].dtype == torch.float32  # alpha kept
    assert export.why_no_file(str(tmp_path / "kohya-lora"), tiny_hidream_model) is None
    assert export.why_no_file(str(tmp_path / "full"), tiny_hidream_model) is None  # (a full model: its transformer)


@pytest.mark.parametrize("adapter", ["loha", "lokr"])
def test_loha_and_lokr_export_in_the_lycoris_names_comfyui_maps_for_hidream(tiny_hidream_model, train_tiny, tmp_path,
                                                                            adapter):
    """export.py on LoHa and LoKr adapters of HiDream: lycoris_<module, "_" for ".">, the names ComfyUI maps for its
    HiDream model (SimpleTuner's LyCORIS names) onto the same weights; merged as ComfyUI merges them, the weights
    peft fuses (familysteps.lycoris_exported)."""
    from diffusers import HiDreamImagePipeline

    from dreambooth.models import outputs

    plan, state, _ = train_tiny(tiny_hidream_model, 2, output_dir=str(tmp_path / adapter),
                                **familysteps.adapter_fields(adapter))
    outputs.save_pipeline(state.models, plan)
    pipe = familysteps.output_loaded(HiDreamImagePipeline, tiny_hidream_model, plan.output_dir, adapter)
    familysteps.lycoris_exported(pipe, tiny_hidream_model, plan, adapter, tmp_path)
    assert (tmp_path / f"{adapter}-export" / "lycoris.safetensors").exists()

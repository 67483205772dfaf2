"""train.py's adapters fused into a pipeline's networks for drawing (generate.py, serve.py): LoRA's and DoRA's
through diffusers' load_lora_weights; LyCORIS' (train.py --adapter loha|lokr) through peft, as diffusers reads LoRA's
names only: theirs are in peft's own names, with each network's peft config in the file's metadata, as diffusers
writes it.
"""

import json
import os

from dreambooth import files

LYCORIS = ("LOHA", "LOKR")  # peft's types of the adapters this module loads


def file_settings(lora_dir):
    """{network: its peft config as a dict} from the metadata of lora_dir's adapter file ({} when it has none)."""
    from safetensors import safe_open

    with safe_open(os.path.join(lora_dir, files.LORA_WEIGHTS_FILE), "pt") as f:
        flat = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
    settings = {}
    for key, value in flat.items():
        network, _, name = key.partition(".")
        settings.setdefault(network, {})[name] = value
    return settings


def is_lycoris(lora_dir):
    """Whether lora_dir's adapter file holds LoHa or LoKr adapters (peft's names), not LoRA's."""
    return any(config.get("peft_type") in LYCORIS for config in file_settings(lora_dir).values())


def fuse(pipe, lora_dir, scale=1.0, before_merge=None):
    """The adapters of lora_dir (any kind train.py writes) merged into the weights of pipe's networks at scale, their
    layers then taken out: the pipeline draws at the base model's speed. before_merge: called with each adapter layer
    (peft's) before its base layer's weights change (serve.py keeps the base's weights to put back)."""
    if is_lycoris(lora_dir):
        fuse_lycoris(pipe, lora_dir, scale, before_merge)
        return
    pipe.load_lora_weights(lora_dir, weight_name=files.LORA_WEIGHTS_FILE)
    if before_merge:
        import torch
        from peft.tuners.tuners_utils import BaseTunerLayer

        for network in pipe.components.values():
            if isinstance(network, torch.nn.Module):
                for layer in network.modules():
                    if isinstance(layer, BaseTunerLayer):
                        before_merge(layer)
    pipe.fuse_lora(lora_scale=scale)
    pipe.unload_lora_weights()  # the fused weights stay; the adapter layers go


def fuse_lycoris(pipe, lora_dir, scale=1.0, before_merge=None):
    """The LoHa/LoKr adapters of lora_dir merged into the weights of pipe's networks at scale, their layers then
    taken out again: the pipeline draws at the base model's speed, as a fused LoRA does. before_merge: called with
    each adapter layer before its weights change (serve.py keeps the base's weights to put back)."""
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import load_file

    weights = load_file(os.path.join(lora_dir, files.LORA_WEIGHTS_FILE))
    for network, config in file_settings(lora_dir).items():
        own = {key[len(network) + 1:]: value for key, value in weights.items() if key.startswith(network + ".")}
        model = getattr(pipe, network)
        peft.inject_adapter_in_model(peft.get_peft_config(config), model)
        model.to(next(iter(model.parameters())).device)
        result = peft.set_peft_model_state_dict(model, own)
        missing = [key for key in result.missing_keys if any(part in key for part in ("hada_", "lokr_"))]
        if result.unexpected_keys or missing:
            raise ValueError(f"{lora_dir}: the {network}'s adapters do not fit it (unexpected: "
                             f"{result.unexpected_keys[:3]}, missing: {missing[:3]})")
        for name, layer in list(model.named_modules()):
            if isinstance(layer, BaseTunerLayer):
                if before_merge:
                    before_merge(layer)
                layer.scale_layer(scale)
                layer.merge()
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, layer.get_base_layer())
        del model.peft_config

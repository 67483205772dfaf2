"""The original single-file layouts the other tools read (A1111, ComfyUI, kohya's sd-scripts), shared by the
families: the key maps of a UNet (SD 1.x, 2.x, SDXL) and of the VAE every family has, kohya's names of a UNet
family's LoRA, and OpenCLIP's names of a text encoder (SD 2.x's, SDXL's second). Each family's own layout (a
transformer's) is in its folder; export.py asks the family."""

import re

from dreambooth import errors

# Inside a UNet resnet, a VAE resnet and the VAE's attention: diffusers name -> original name.
UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
               "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
# The original VAE attention projects with 1x1 convolutions where diffusers uses linear layers.
VAE_CONV_1X1 = ("q", "k", "v", "proj_out")


def unet_prefixes(config):
    """[(diffusers prefix, original prefix, renames inside)] of an SD 1.x UNet of this config.

    The original numbers its blocks in one sequence per side: input_blocks 0 is conv_in, then each
    level's layers_per_block (resnet, attention) pairs and its downsampler; output_blocks hold each
    level's layers_per_block + 1 pairs, the upsampler after the last pair's attention (if any).
    """
    per_level = config["layers_per_block"] + 1
    prefixes = [("time_embedding.linear_1.", "time_embed.0.", {}), ("time_embedding.linear_2.", "time_embed.2.", {}),
                ("conv_in.", "input_blocks.0.0.", {}), ("conv_norm_out.", "out.0.", {}), ("conv_out.", "out.2.", {}),
                ("mid_block.resnets.0.", "middle_block.0.", UNET_RESNET),
                ("mid_block.attentions.0.", "middle_block.1.", {}),
                ("mid_block.resnets.1.", "middle_block.2.", UNET_RESNET)]
    for level, up_type in enumerate(config["up_block_types"]):
        for j in range(per_level - 1):
            block = 1 + level * per_level + j
            prefixes += [(f"down_blocks.{level}.resnets.{j}.", f"input_blocks.{block}.0.", UNET_RESNET),
                         (f"down_blocks.{level}.attentions.{j}.", f"input_blocks.{block}.1.", {})]
        downsampler = f"input_blocks.{(level + 1) * per_level}.0.op."
        prefixes.append((f"down_blocks.{level}.downsamplers.0.conv.", downsampler, {}))
        for j in range(per_level):
            block = level * per_level + j
            prefixes += [(f"up_blocks.{level}.resnets.{j}.", f"output_blocks.{block}.0.", UNET_RESNET),
                         (f"up_blocks.{level}.attentions.{j}.", f"output_blocks.{block}.1.", {})]
        upsampler = f"output_blocks.{level * per_level + per_level - 1}.{2 if 'CrossAttn' in up_type else 1}.conv."
        prefixes.append((f"up_blocks.{level}.upsamplers.0.conv.", upsampler, {}))
    return prefixes


def vae_prefixes(config):
    """[(diffusers prefix, original prefix, renames inside)] of an SD 1.x VAE (AutoencoderKL).
    The original counts the decoder's levels from the bottom: diffusers' up_blocks 0 is its up.<last>."""
    levels = len(config["down_block_types"])
    prefixes = [(name, name, {}) for name in ("encoder.conv_in.", "encoder.conv_out.", "decoder.conv_in.",
                                              "decoder.conv_out.", "quant_conv.", "post_quant_conv.")]
    for part in ("encoder", "decoder"):
        prefixes += [(f"{part}.conv_norm_out.", f"{part}.norm_out.", {}),
                     (f"{part}.mid_block.resnets.0.", f"{part}.mid.block_1.", VAE_RESNET),
                     (f"{part}.mid_block.resnets.1.", f"{part}.mid.block_2.", VAE_RESNET),
                     (f"{part}.mid_block.attentions.0.", f"{part}.mid.attn_1.", VAE_ATTENTION)]
    for level in range(levels):
        up = levels - 1 - level
        prefixes += [(f"encoder.down_blocks.{level}.resnets.", f"encoder.down.{level}.block.", VAE_RESNET),
                     (f"encoder.down_blocks.{level}.downsamplers.0.", f"encoder.down.{level}.downsample.", {}),
                     (f"decoder.up_blocks.{level}.resnets.", f"decoder.up.{up}.block.", VAE_RESNET),
                     (f"decoder.up_blocks.{level}.upsamplers.0.", f"decoder.up.{up}.upsample.", {})]
    return prefixes


def rename(state_dict, prefixes, what):
    """{original key: tensor}: each key's longest matching diffusers prefix replaced, then the
    renames inside it applied to whole name segments. A key no prefix covers is an error: a
    weight left behind would load as random in the other tools."""
    prefixes = sorted(prefixes, key=lambda p: -len(p[0]))
    out = {}
    for key, tensor in state_dict.items():
        match = next((p for p in prefixes if key.startswith(p[0])), None)
        if match is None:
            raise errors.UserError(f"export: no original-layout name for the {what} weight {key}: "
                                   "only SD 1.x, 2.x and SDXL architectures are supported")
        old, new, inside = match
        rest = "." + key[len(old):]
        for a, b in inside.items():
            rest = rest.replace(f".{a}.", f".{b}.")
        if inside is VAE_ATTENTION and rest.endswith(".weight") and rest[1:-len(".weight")] in VAE_CONV_1X1 \
                and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]
        out[new + rest[1:]] = tensor
    return out


# Keys of pytorch_lora_weights.safetensors as diffusers writes them (older and PEFT spellings).
LORA_KEY = re.compile(r"^(unet|text_encoder|text_encoder_2)\.(.+)\.(lora\.down|lora\.up|lora_linear_layer\.down|"
                      r"lora_linear_layer\.up|lora_A|lora_B)\.weight$")


def kohya_text_module(prefix, module):
    """kohya's name of a text encoder's LoRA module (peft's name, with or without text_model.): prefix
    (lora_te_, lora_te1_, ...) and text_model_<module path with underscores>."""
    return prefix + (module if module.startswith("text_model.") else "text_model." + module).replace(".", "_")


def unet_kohya_lora(state_dict, alphas, text_prefixes):
    """{kohya key: tensor} of the UNet families' LoRA: lora_unet_<module>.lora_down/lora_up.weight and .alpha, text
    encoder modules as <prefix>text_model_<module> (text_prefixes {network: prefix}: SD 1.x's lora_te_, which A1111
    and ComfyUI map, SDXL's lora_te1_ and lora_te2_)."""
    import torch

    prefixes = {"unet": "lora_unet_", **text_prefixes}
    out = {}
    for key, tensor in state_dict.items():
        match = LORA_KEY.match(key)
        if match is None or match.group(1) not in prefixes:
            raise errors.UserError(f"export: {key} is not a LoRA weight of the UNet or text encoder")
        model, module, kind = match.groups()
        name = prefixes[model] + module.replace(".", "_") if model == "unet" else \
            kohya_text_module(prefixes[model], module)
        direction = "down" if kind.endswith(("down", "lora_A")) else "up"
        out[f"{name}.lora_{direction}.weight"] = tensor
        if direction == "down":
            # kohya scales each module by alpha / rank; without an alpha every loader assumes alpha = rank.
            out[f"{name}.alpha"] = torch.tensor(float(alphas.get(model, tensor.shape[0])))
    return out


# Keys of train.py's LoHa/LoKr file (peft's names: --adapter loha|lokr) and LyCORIS' names for the same factors
LYCORIS_KEY = re.compile(r"^(unet|transformer|text_encoder|text_encoder_2)\.(.+)\.(hada_w[12]_[ab]|hada_t[12]|"
                         r"lokr_w[12](?:_[ab])?|lokr_t2)$")
# The prefix of the denoiser's modules in a LyCORIS file: kohya's for a UNet; for a diffusion transformer, the one
# ComfyUI (comfy/lora.py, model_lora_keys_unet) and Forge map for SD 3.5, Flux.1, Chroma and Qwen-Image alike,
# lycoris_<diffusers' module name, "_" for ".">, onto the slice of a fused weight where theirs is fused (Flux.1's qkv)
LYCORIS_DENOISER_PREFIX = {"unet": "lora_unet_", "transformer": "lycoris_"}


def lycoris(state_dict, alphas, text_prefixes, ranks):
    """{LyCORIS key: tensor} of LoHa/LoKr adapters: the denoiser's modules named as LYCORIS_DENOISER_PREFIX says (a
    UNet's in kohya's names, as unet_kohya_lora), the text encoders' as kohya's (text_prefixes {network: prefix}), with
    LyCORIS' factor names, which are peft's (hada_w1_a ..., lokr_w1, lokr_w2_a ...), and each module's alpha. ranks
    {network: r}. peft scales LoKr by alpha / r always, LyCORIS' loaders not where neither factor is split in two
    (lokr_w1 and lokr_w2 whole): there the scale goes into lokr_w2, and the module's alpha is lokr_w2's rows over
    lokr_w1's (LyCORIS' loader needs one; ComfyUI's newer LoKr code divides such a module's alpha by that ratio, its
    older code, LyCORIS' and A1111's apply none: each scales it by 1)."""
    import torch

    prefixes = {**LYCORIS_DENOISER_PREFIX, **text_prefixes}
    modules = {}
    for key, tensor in state_dict.items():
        match = LYCORIS_KEY.match(key)
        if match is None or match.group(1) not in prefixes:
            raise errors.UserError(f"export: {key} is not a LoHa or LoKr weight of the denoiser or of a text encoder "
                                   "the family's layout names")
        model, module, factor = match.groups()
        name = prefixes[model] + module.replace(".", "_") if model in LYCORIS_DENOISER_PREFIX else \
            kohya_text_module(prefixes[model], module)
        modules.setdefault((model, name), {})[factor] = tensor
    out = {}
    for (model, name), factors in modules.items():
        alpha = float(alphas.get(model, ranks[model]))
        if "lokr_w2" in factors and "lokr_w1" in factors:  # (neither split: no alpha / r applied)
            factors = {**factors, "lokr_w2": factors["lokr_w2"] * (alpha / ranks[model])}
            alpha = float(factors["lokr_w2"].shape[0] // factors["lokr_w1"].shape[0])
        out.update({f"{name}.{factor}": tensor.contiguous() for factor, tensor in factors.items()})
        out[f"{name}.alpha"] = torch.tensor(alpha)
    return out


# SD 2.x's text encoder in OpenCLIP's names: diffusers name inside a layer -> OpenCLIP name.
OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
                   "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
OPEN_CLIP_OUTER = {"text_model.embeddings.token_embedding.weight": "token_embedding.weight",
                   "text_model.embeddings.position_embedding.weight": "positional_embedding",
                   "text_model.final_layer_norm.weight": "ln_final.weight",
                   "text_model.final_layer_norm.bias": "ln_final.bias"}


def open_clip_text_encoder(weights, prefix):
    """{prefix + OpenCLIP key: tensor} of a text encoder ({text_model.* key: tensor}): OpenCLIP's
    resblocks, each layer's q, k and v projections stacked into in_proj (q first), and a
    projection (SDXL's second encoder) as OpenCLIP's text_projection matrix, transposed.
    The released SD 2.x files hold one layer more (OpenCLIP's last, which SD 2.x never uses:
    it reads the layer before); the other tools load without it, as diffusers drops it."""
    import torch

    out, qkv = {}, {}
    layer = re.compile(r"^text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    for key, tensor in weights.items():
        if key in OPEN_CLIP_OUTER:
            out[OPEN_CLIP_OUTER[key]] = tensor
            continue
        if key == "text_projection.weight":
            out["text_projection"] = tensor.T.contiguous()
            continue
        match = layer.match(key)
        if match is None:
            if key.endswith("position_ids"):
                continue  # a buffer, not a weight
            raise errors.UserError(f"export: no OpenCLIP name for the text encoder weight {key}")
        index, module, kind = match.groups()
        if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            qkv.setdefault((index, kind), {})[module[len("self_attn."):-len("_proj")]] = tensor
        elif module in OPEN_CLIP_LAYER:
            out[f"transformer.resblocks.{index}.{OPEN_CLIP_LAYER[module]}.{kind}"] = tensor
        else:
            raise errors.UserError(f"export: no OpenCLIP name for the text encoder weight {key}")
    for (index, kind), parts in qkv.items():
        out[f"transformer.resblocks.{index}.attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return {prefix + key: tensor for key, tensor in out.items()}


def joined_layout(state_dict, name, what):
    """{original key: tensor} of a transformer's diffusers state_dict: name(key) -> (original key, part), part None for
    a tensor of its own, else its place among the tensors that are one tensor there, joined along the first axis (an
    attention's q, k and v: one qkv). A key named None is an error, as in rename."""
    import torch

    out, parts = {}, {}
    for key, tensor in state_dict.items():
        original, part = name(key)
        if original is None:
            raise errors.UserError(f"export: no original-layout name for the {what} weight {key}")
        if part is None:
            out[original] = tensor
        else:
            parts.setdefault(original, {})[part] = tensor
    for original, pieces in parts.items():
        out[original] = torch.cat([pieces[i] for i in range(len(pieces))])
    return out


def replaced(key, pairs):
    """key with each (old, new) of pairs replaced in turn."""
    for old, new in pairs:
        key = key.replace(old, new)
    return key


def block_name(key, blocks, outside):
    """(the original name of a transformer weight or None, its place in a fused tensor or None), for a transformer
    whose blocks ({diffusers' blocks: (the original's, {module inside: (original module, part)})}) and other modules
    (outside: {module: original module}) are renamed; a weight of an original module named *_norm is its scale."""
    module, _, param = key.rpartition(".")
    group, _, rest = module.partition(".")
    index, _, inner = rest.partition(".")
    if group in blocks and index.isdigit():
        theirs, table = blocks[group]
        if inner not in table:
            return None, None
        name, part = table[inner]
        return f"{theirs}.{index}.{name}.{'scale' if name.endswith('_norm') else param}", part
    return (f"{outside[module]}.{param}" if module in outside else None), None


def kohya_block_module(module, blocks, parts, what):
    """(kohya's name, its part of a fused layer named by parts, or None) of a module of a transformer's blocks
    (diffusers' name), from their original names (block_name's blocks): lora_unet_ and the original module's name
    with "_" for "."; a KeyError for a module outside the blocks' tables."""
    name, part = block_name(module + ".weight", blocks, {})
    if name is None:
        raise KeyError(f"no original {what} layer for {module}")
    return "lora_unet_" + name.rpartition(".")[0].replace(".", "_"), None if part is None else parts[part]


def swap_halves(weights, key):
    """weights with key's two halves (first axis) swapped where it is: an AdaLN modulation of (scale, shift) in
    diffusers and (shift, scale) in the original layouts."""
    import torch

    if key in weights:
        first, second = weights[key].chunk(2)
        weights[key] = torch.cat([second, first])
    return weights

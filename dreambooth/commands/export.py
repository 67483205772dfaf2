"""Export a tuned model as one .safetensors file for AUTOMATIC1111, ComfyUI and other SD tools.

    python export.py --model_dir $TUNED_MODEL_DIR --output_file my-dog.safetensors
    python export.py --model_dir $TUNED_LORA_DIR --output_file my-dog-lora.safetensors

A full model (train.py's output, or any diffusers SD 1.x, 2.x, SDXL or SD 3.5 folder) becomes one checkpoint
in the original layout (model.diffusion_model.*, first_stage_model.*, the text encoders as the family's
files hold them): put it in A1111's models/Stable-diffusion or ComfyUI's models/checkpoints. A LoRA output
(train.py --use_lora) becomes a kohya-layout LoRA (lora_unet_*, lora_te_*, with each module's alpha; Flux.1's
and SD 3.5's in kohya's layouts of their original modules): models/Lora in both. diffusers reads them back
with its pipelines' from_single_file(file, config=<the model folder>) and load_lora_weights(file) (but SD 3.5's
LoRA file, which ComfyUI reads: diffusers has no reader of kohya's SD 3 layout).
"""

import os
import re
import sys
import tempfile

from dreambooth import errors
from dreambooth import families
from dreambooth import filemodes
from dreambooth import files
from dreambooth import storage
from dreambooth.config import flags
from dreambooth.families.family import kohya_text_module
from dreambooth.models import networks
from dreambooth.models import outputs
from dreambooth.planning import model_flags

# ------------------------------------------------------------------ full model

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


def full_checkpoint(model_dir, allow_unsafe_weights=False):
    """{original key: tensor} of a diffusers folder, weights as stored (fp32 after training): the denoiser under
    model.diffusion_model. (an SD 1.x/2.x/SDXL UNet renamed here, a transformer in its family's layout:
    family.Family.single_file_denoiser), the VAE under first_stage_model., the text encoders in their family's
    layout (family.Family.single_file_text_encoders)."""
    from diffusers import AutoencoderKL
    from transformers import CLIPPreTrainedModel

    family = families.family_of(model_dir)

    def load(cls, subfolder):
        return networks.from_pretrained(cls, model_dir, allow_unsafe_weights, subfolder=subfolder)

    checkpoint = {"model.diffusion_model." + key: tensor for key, tensor in denoiser_weights(family, load).items()}
    vae = load(AutoencoderKL, "vae")
    for key, tensor in rename(vae.state_dict(), vae_prefixes(vae.config), "VAE").items():
        checkpoint["first_stage_model." + key] = tensor

    def text_weights(model):
        if not isinstance(model, CLIPPreTrainedModel):  # (T5: as it is)
            return model.state_dict()
        # transformers >= 5.6 flattened CLIPTextModel; the original layouts keep its text_model level.
        return {key if key.startswith(("text_model.", "text_projection.")) else "text_model." + key: tensor
                for key, tensor in model.state_dict().items()}

    checkpoint.update(family.single_file_text_encoders([text_weights(m) for m in family.load_text_encoders(model_dir, load)]))
    return checkpoint


def denoiser_weights(family, load):
    """{original key: tensor} of the family's denoiser: a UNet renamed here (SD 1.x/2.x, SDXL's with its pooled
    text and size embedding), a transformer by its family."""
    from diffusers import UNet2DConditionModel

    if family.denoiser != "unet":
        return family.single_file_denoiser(family.load_denoiser(load))
    unet = load(UNet2DConditionModel, "unet")
    unet_names = unet_prefixes(unet.config)
    if unet.config.addition_embed_type == "text_time":  # SDXL's pooled text and size/crop embedding
        unet_names += [("add_embedding.linear_1.", "label_emb.0.0.", {}), ("add_embedding.linear_2.", "label_emb.0.2.", {})]
    return rename(unet.state_dict(), unet_names, "UNet")


# ------------------------------------------------------------------ LoRA

# Keys of pytorch_lora_weights.safetensors as diffusers writes them (older and PEFT spellings).
LORA_KEY = re.compile(r"^(unet|text_encoder|text_encoder_2)\.(.+)\.(lora\.down|lora\.up|lora_linear_layer\.down|"
                      r"lora_linear_layer\.up|lora_A|lora_B)\.weight$")


def lora_alphas(lora_dir):
    """{'unet': alpha, 'text_encoder': alpha} from the adapter metadata diffusers stored in the file
    (train.py writes it), else from train.py's record; {} if neither says (alpha = rank)."""
    import json

    from safetensors import safe_open

    with safe_open(os.path.join(lora_dir, files.LORA_WEIGHTS_FILE), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
    parts = ("unet", "transformer", "text_encoder", "text_encoder_2")
    alphas = {model: meta[f"{model}.lora_alpha"] for model in parts if f"{model}.lora_alpha" in meta}
    output = outputs.read_output(lora_dir)
    lora = output.lora if not alphas and output else None
    if lora:
        alphas = {model: lora.alpha for model in parts}
    return alphas


def kohya_lora(state_dict, alphas):
    """{kohya key: tensor}: lora_unet_<module>.lora_down/lora_up.weight and .alpha, text encoder
    modules as lora_te_text_model_<module> (SD 1.x's kohya names, which A1111 and ComfyUI map),
    or SDXL's two as lora_te1_… and lora_te2_…."""
    import torch

    sdxl = any(key.startswith("text_encoder_2.") for key in state_dict)
    prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te1_" if sdxl else "lora_te_",
                "text_encoder_2": "lora_te2_"}
    out = {}
    for key, tensor in state_dict.items():
        match = LORA_KEY.match(key)
        if match is None:
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


def lora_checkpoint(lora_dir):
    """The kohya-layout tensors of train.py's LoRA output: its base model's family's layout (Flux.1's, SD 3.5's), else
    the UNet families' (also when the base of UNet adapters is not here). A UserError when a transformer's base is
    not here or its family's LoRA is not exported yet."""
    from safetensors.torch import load_file

    output = outputs.read_output(lora_dir)
    base = output.base_model if output else ""
    family = families.require(base, "export_lora") if base and os.path.isdir(base) else None
    state_dict, alphas = load_file(os.path.join(lora_dir, files.LORA_WEIGHTS_FILE)), lora_alphas(lora_dir)
    if family is None and any(key.startswith("transformer.") for key in state_dict):
        raise errors.UserError(f"the base model of the LoRA adapters in {lora_dir} ({base or 'not recorded'}) is not "
                               "here, and a transformer's layout is its family's: cache it (cache_model.py) first")
    return (family.kohya_lora(state_dict, alphas, base) if family else None) or kohya_lora(state_dict, alphas)


# ------------------------------------------------------------------ command line

SAVE_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
HELPS = {"model_dir": "train.py's output folder: a full model (or any diffusers SD 1.x, 2.x, SDXL or SD 3.5 folder) becomes an original-"
                      "layout checkpoint, a --use_lora output a kohya-layout LoRA (SD 1.x/2.x/SDXL; Flux.1's and SD "
                      "3.5's in their own kohya layouts).",
         "overwrite": "Replace --output_file if it exists."}


def write_checkpoint(checkpoint, path, save_precision, metadata):
    """Floating tensors cast to save_precision, written atomically (a partial file never has the name)."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, SAVE_DTYPES[save_precision])
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in checkpoint.items()}
    partial = path + ".partial"
    save_file(tensors, partial, metadata=metadata)
    filemodes.follow_umask(partial)  # (safetensors writes it for its owner only)
    os.replace(partial, path)


def main(argv=None):
    parser = flags.make_parser(__doc__.splitlines()[0], ["model_dir", "output_file", "save_precision", "overwrite",
                                                         "allow_unsafe_weights"], helps=HELPS)
    args = model_flags.resolve_models(parser.parse_args(argv))
    files.check_output_path(args.output_file, "--output_file", [("--model_dir", args.model_dir)], is_file=True)
    if storage.exists(args.output_file) and not args.overwrite:
        raise errors.UserError(f"{args.output_file} exists: pass --overwrite to replace it")
    if not args.output_file.endswith(".safetensors"):
        raise errors.UserError("--output_file must end in .safetensors (the other tools pick files by it)")
    with tempfile.TemporaryDirectory(prefix="dreambooth-export-") as scratch:  # (a bucket's file: written here first)
        local = os.path.join(scratch, os.path.basename(args.output_file)) if storage.is_remote(args.output_file) \
            else args.output_file
        export_to(args, local)
        if local != args.output_file:
            storage.upload_file(local, args.output_file)
    print(args.output_file)
    return args.output_file


def export_to(args, path):
    """Write the single file of args.model_dir to path (a local file), saying what it is and where it goes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if outputs.holds_lora(args.model_dir):
        checkpoint = lora_checkpoint(args.model_dir)
        ranks = sorted({int(v.shape[0]) for k, v in checkpoint.items() if k.endswith(".lora_down.weight")})
        alphas = sorted({float(v) for k, v in checkpoint.items() if k.endswith(".alpha")})
        # kohya's own metadata names, which A1111 shows in its LoRA info.
        metadata = {"ss_network_module": "networks.lora", "ss_network_dim": str(ranks[0]),
                    "ss_network_alpha": str(alphas[0])}
        kind, where = "LoRA (kohya layout)", "A1111 / ComfyUI: models/Lora"
    else:
        families.check_model_dir(args.model_dir, args.allow_unsafe_weights)
        families.require(args.model_dir, "export")
        checkpoint = full_checkpoint(args.model_dir, args.allow_unsafe_weights)
        metadata = {"format": "pt"}
        kind, where = "Stable Diffusion checkpoint (original layout)", \
            "A1111: models/Stable-diffusion, ComfyUI: models/checkpoints"
    write_checkpoint(checkpoint, path, args.save_precision, metadata)
    size = os.path.getsize(path)
    size = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
    print(f"{kind}, {len(checkpoint)} tensors, {args.save_precision}, {size} -> {args.output_file} "
          f"({where})", file=sys.stderr)

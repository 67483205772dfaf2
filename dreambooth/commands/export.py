"""Export a tuned model as one .safetensors file for ComfyUI, AUTOMATIC1111 and kohya's tools.

    python export.py --model_dir $TUNED_MODEL_DIR --output_file my-dog.safetensors
    python export.py --model_dir $TUNED_LORA_DIR --output_file my-dog-lora.safetensors

A full model (train.py's output, or any diffusers folder of a family it exports: --help lists them) becomes one
checkpoint in the original layout (model.diffusion_model.*, first_stage_model.*, the text encoders as the family's
files hold them): put it in A1111's models/Stable-diffusion or ComfyUI's models/checkpoints; a flow model's
transformer alone, in its original layout, as its own release ships it (ComfyUI's models/diffusion_models, its VAE
and text encoders the base model's). A LoRA output
(train.py --use_lora) becomes a kohya-layout LoRA (lora_unet_*, lora_te_*, with each module's alpha; a
transformer's in kohya's layout of its family's original modules): models/Lora in both. diffusers reads them back
with its pipelines' from_single_file(file, config=<the model folder>) and load_lora_weights(file) (but SD 3.5's
LoRA file, which ComfyUI reads: diffusers has no reader of kohya's SD 3 layout). LoHa and LoKr outputs
(train.py --adapter loha|lokr) become LyCORIS-layout files (hada_w1_a ..., lokr_w1 ...): a UNet's in kohya's module
names, which ComfyUI and A1111 read; a transformer's in the names ComfyUI and Forge read (lycoris_<module>).
"""

import json
import os
import struct
import sys
import tempfile

from dreambooth import errors
from dreambooth import families
from dreambooth import filemodes
from dreambooth import files
from dreambooth import storage
from dreambooth.config import flags
from dreambooth.families.shared import layouts
from dreambooth.models import adapters
from dreambooth.models import modelcache
from dreambooth.models import networks
from dreambooth.models import outputs
from dreambooth.planning import model_flags

# ------------------------------------------------------------------ full model

def full_checkpoint(model_dir, allow_unsafe_weights=False):
    """{original key: tensor} of a diffusers folder, weights as stored (fp32 after training): the denoiser under
    model.diffusion_model., the VAE under first_stage_model., the text encoders: each in its family's layout
    (family.Family.single_file_denoiser, single_file_vae, single_file_text_encoders)."""
    from diffusers import AutoencoderKL
    from transformers import CLIPPreTrainedModel

    family = families.family_of(model_dir)

    def load(cls, subfolder):
        return networks.from_pretrained(cls, model_dir, allow_unsafe_weights, subfolder=subfolder)

    if family.denoiser_file:  # (a flow model's file: its transformer alone, as its own release)
        return family.single_file_denoiser(family.load_denoiser(load))
    checkpoint = {"model.diffusion_model." + key: tensor
                  for key, tensor in family.single_file_denoiser(family.load_denoiser(load)).items()}
    for key, tensor in family.single_file_vae(load(AutoencoderKL, "vae")).items():
        checkpoint["first_stage_model." + key] = tensor

    def text_weights(model):
        if not isinstance(model, CLIPPreTrainedModel):  # (T5: as it is)
            return model.state_dict()
        # transformers >= 5.6 flattened CLIPTextModel; the original layouts keep its text_model level.
        return {key if key.startswith(("text_model.", "text_projection.")) else "text_model." + key: tensor
                for key, tensor in model.state_dict().items()}

    checkpoint.update(family.single_file_text_encoders([text_weights(m) for m in family.load_text_encoders(model_dir, load)]))
    return checkpoint


# ------------------------------------------------------------------ LoRA

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


def lora_checkpoint(lora_dir):
    """The kohya-layout tensors of train.py's LoRA output: its base model's family's layout (Flux.1's, SD 3.5's,
    FLUX.2's, Z-Image's, HiDream-I1's, Krea 2's, Qwen-Image 2.1's, Ideogram 4's), else the UNet families' (also when
    the base of UNet adapters is not here); LoHa's and LoKr's in LyCORIS' layout (a transformer's modules as ComfyUI
    names them, lycoris_<module>: layouts.lycoris; not of a family without lycoris_export). A UserError when a
    transformer's base is not here or its family's adapters of that kind are not exported yet."""
    from safetensors.torch import load_file

    output = outputs.read_output(lora_dir)
    base = output.base_model if output else ""
    family = families.require(base, "export_lora") if base and os.path.isdir(base) else None
    state_dict, alphas = load_file(os.path.join(lora_dir, files.LORA_WEIGHTS_FILE)), lora_alphas(lora_dir)
    kind = adapter_kind(state_dict)
    if kind == "dora":
        raise errors.UserError(f"{lora_dir} {not_written(kind, family)}")
    if family is None and any(key.startswith("transformer.") for key in state_dict):
        raise errors.UserError(f"the base model of the LoRA adapters in {lora_dir} ({base or 'not recorded'}) is not "
                               "here, and a transformer's layout is its family's: cache it (cache_model.py) first")
    if family is None:  # UNet adapters whose base is not here: the first UNet family that names their text encoders
        adapted = {key.split(".")[0] for key in state_dict} - {"unet"}
        family = next(f for f in families.FAMILIES.values()
                      if f.denoiser == "unet" and adapted <= set(f.kohya_text_prefixes))
    if not_written(kind, family, state_dict):
        raise errors.UserError(f"{lora_dir} {not_written(kind, family, state_dict)}")
    if kind == "lycoris":  # LoHa, LoKr: LyCORIS' layout, each network's rank and alpha from its peft config
        settings = adapters.file_settings(lora_dir).items()
        return layouts.lycoris(state_dict, {network: config["alpha"] for network, config in settings},
                               family.kohya_text_prefixes, {network: config["r"] for network, config in settings})
    return family.kohya_lora(state_dict, alphas, base)


def adapter_kind(keys):
    """'dora', 'lycoris' (LoHa or LoKr) or 'lora': the adapters of train.py's adapter file, by its tensors' names."""
    keys = list(keys)
    if any("lora_magnitude_vector" in key for key in keys):
        return "dora"
    return "lycoris" if any(".hada_" in key or ".lokr_" in key for key in keys) else "lora"


TEXT_LYCORIS = ("holds LoHa/LoKr adapters of the text encoder too: their LyCORIS layout is written for the transformer "
                "alone yet (train with --no-train_text_encoder for a file; generate.py reads the folder's own)")


def not_written(kind, family, keys=()):
    """Why export.py writes no file of adapters of kind (adapter_kind's) for family, whose tensors are named keys, or
    None when it writes one."""
    if kind == "dora":
        return ("holds DoRA adapters (--adapter dora): their kohya layout is not written yet; diffusers' "
                "load_lora_weights reads the folder's own file")
    if kind == "lycoris" and not family.lycoris_export:
        return (f"holds LoHa/LoKr adapters: their LyCORIS layout is not written for {family.label} (ComfyUI maps none "
                "onto its model); generate.py reads the folder's own")
    if kind == "lycoris" and family.denoiser != "unet" and any(key.startswith("text_encoder") for key in keys):
        return TEXT_LYCORIS
    return None


def why_no_file(model_dir, base):
    """Why export.py writes no file of train.py's output model_dir (its record says which adapters), whose base model
    is base, in words that finish 'no file: ...'; None when it writes one (a full model or adapters of a family it
    exports, as not_written rules)."""
    family = families.family_of(modelcache.resolve_model_name(base))
    if not outputs.holds_lora(model_dir):
        return None if "export" in family.supports else f"export.py writes no {family.label} model yet"
    output = outputs.read_output(model_dir)
    adapter = output.lora.adapter if output and output.lora else "lora"
    kind = {"loha": "lycoris", "lokr": "lycoris"}.get(adapter, adapter)
    if "export_lora" not in family.supports:
        return f"export.py writes no {family.label} adapters yet"
    keys = files.safetensors_header(os.path.join(model_dir, files.LORA_WEIGHTS_FILE))[1] if kind == "lycoris" else ()
    reason = not_written(kind, family, keys)
    return f"the model {reason}" if reason else None


MODEL_ID = "dreambooth_model_id"  # the file's metadata: the train.py output it was exported from (its model id)


def forget_stale_file(path, model_dir):
    """Remove path, a file export.py wrote of another train.py output than model_dir (the model a run replaced, by
    the id in its metadata), saying so: an export never stays beside a model it is not of. A file without that
    id, and a bucket's, are left. True when removed."""
    output = outputs.read_output(model_dir)
    if storage.is_remote(path) or not os.path.isfile(path) or output is None or not output.model_id:
        return False
    try:
        made_from = (files.safetensors_header(path)[1].get("__metadata__") or {}).get(MODEL_ID)
    except (OSError, ValueError, struct.error):
        return False
    if made_from is None or made_from == output.model_id:
        return False
    os.remove(path)
    print(f"removed {path}: the export of the model this run replaced", file=sys.stderr)
    return True


def writes_file_of(model_dir, base):
    """Whether export.py writes a file of train.py's output model_dir whose base model is base (why_no_file)."""
    return why_no_file(model_dir, base) is None


# ------------------------------------------------------------------ command line

SAVE_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# The families export.py writes a file of: a full model in its original layout, adapters in kohya's or LyCORIS'
EXPORTED_MODELS = ", ".join(f.label for f in families.FAMILIES.values() if "export" in f.supports)
HELPS = {"model_dir": "train.py's output folder (or a diffusers folder of one of the families below). A full model "
                      "becomes one file in its original layout: a checkpoint of a UNet family or SD 3.5 (A1111's "
                      "models/Stable-diffusion, ComfyUI's models/checkpoints), the transformer alone of the other "
                      f"flow models (ComfyUI's models/diffusion_models); full models of {EXPORTED_MODELS}. A "
                      "--use_lora output becomes a LoRA in kohya's layout, an --adapter loha|lokr output a LyCORIS "
                      "file: a UNet's in kohya's names, which ComfyUI and AUTOMATIC1111 read, a transformer's in its "
                      f"family's original names, which ComfyUI reads; adapters of {flags.EXPORTED_ADAPTERS}"
                      + (f" (no LyCORIS file of {flags.NO_LYCORIS} yet)" if flags.NO_LYCORIS else "") + ".",
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
    output = outputs.read_output(args.model_dir)  # (train.py's record; None for any other diffusers folder)
    if outputs.holds_lora(args.model_dir):
        checkpoint = lora_checkpoint(args.model_dir)
        alphas = sorted({float(v) for k, v in checkpoint.items() if k.endswith(".alpha")})
        algo = next(({".hada_": "loha", ".lokr_": "lokr"}[part] for k in checkpoint for part in (".hada_", ".lokr_")
                     if part in k), None)
        # kohya's own metadata names, which A1111 shows in its LoRA info (LyCORIS' for LoHa and LoKr).
        if algo:
            metadata = {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps({"algo": algo}),
                        "ss_network_dim": str(output.lora.rank if output and output.lora else ""),
                        # (the run's: a LoKr module whose factors are whole has no alpha of its own, layouts.lycoris)
                        "ss_network_alpha": str(float(output.lora.alpha) if output and output.lora else alphas[0])}
            names = "kohya's names" if any(k.startswith("lora_unet_") for k in checkpoint) else "ComfyUI's names"
            kind = f"{'LoHa' if algo == 'loha' else 'LoKr'} (LyCORIS layout, {names})"
        else:
            ranks = sorted({int(v.shape[0]) for k, v in checkpoint.items() if k.endswith(".lora_down.weight")})
            metadata = {"ss_network_module": "networks.lora", "ss_network_dim": str(ranks[0]),
                        "ss_network_alpha": str(alphas[0])}
            kind = "LoRA (kohya layout)"
        flow = output and os.path.isdir(output.base_model) and families.family_of(output.base_model).flow_matching
        where = "ComfyUI: models/Lora" if flow else "A1111 / ComfyUI: models/Lora"  # (A1111 reads no flow model's)
    else:
        families.check_model_dir(args.model_dir, args.allow_unsafe_weights)
        families.require(args.model_dir, "export")
        checkpoint = full_checkpoint(args.model_dir, args.allow_unsafe_weights)
        metadata = {"format": "pt"}
        family = families.family_of(args.model_dir)
        kind, where = "Stable Diffusion checkpoint (original layout)", \
            "A1111: models/Stable-diffusion, ComfyUI: models/checkpoints"
        if family.denoiser_file:
            kind = f"{family.label} {family.denoiser_label} (its original layout, alone)"
            where = "ComfyUI: models/diffusion_models, beside the base model's VAE and text encoders"
    if output is not None and output.model_id:
        metadata[MODEL_ID] = output.model_id  # (forget_stale_file: a later model of the subject replaces it)
    write_checkpoint(checkpoint, path, args.save_precision, metadata)
    size = os.path.getsize(path)
    size = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
    print(f"{kind}, {len(checkpoint)} tensors, {args.save_precision}, {size} -> {args.output_file} "
          f"({where})", file=sys.stderr)

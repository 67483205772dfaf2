"""Disk a run needs, counted before it starts: a checkpoint's bytes and a saved model's, from the weight
files' headers (the preflight, the sweep's check and each checkpoint's own check read them)."""

import glob
import os

from dreambooth import families
from dreambooth import files


def expected_bytes(params, with_ema):
    """About the size of a checkpoint of the trained params: the weights, AdamW's two moments of each
    (an upper bound: 8-bit Adam's are smaller) and the moving average's copy."""
    weights = sum(p.numel() * p.element_size() for p in params)
    return weights * (3 + (1 if with_ema else 0))


LORA_BYTES = 200e6  # a LoRA checkpoint or model (adapters and their optimizer state), rounded up


TRAINED_BYTES = 12  # a checkpoint's bytes per trained parameter: its fp32 weight and AdamW's two fp32 moments


def trained_networks(family, names, train_text_encoder):
    """Of names (a model's networks), those a full fine-tune of family trains: the denoiser, and the text encoders
    the family trains (not T5) when train_text_encoder."""
    return {name for name in names
            if name == family.denoiser or (train_text_encoder and name in family.trainable_text_encoders)}


def disk_bytes(model_dir, lora, train_text_encoder, rank=None, adapter="lora"):
    """(a checkpoint's bytes, a saved model's bytes) of a run training model_dir: a checkpoint holds the trained
    networks' fp32 weights and AdamW's two moments (counted from the weight files' parameters, whatever their
    dtype: a bf16 Flux file holds half the bytes it trains in), a full model the trained networks in fp32 and
    the others as their files are. LoRA's of a known rank likewise, of its adapters (adapter_params); of an
    unknown one LORA_BYTES."""
    if lora and rank is None:
        return LORA_BYTES, LORA_BYTES
    family, counts = families.family_of(model_dir), files.safetensors_params(model_dir)
    trained = trained_networks(family, counts, train_text_encoder)
    if lora:
        # LoHa: two pairs of factors per layer; DoRA: a magnitude per output too; LoKr: fewer than LoRA's
        count = adapter_params(model_dir, family, trained, rank) * (2 if adapter in ("loha", "dora") else 1)
        return TRAINED_BYTES * count + ADAPTER_FILE_BYTES, 4 * count + ADAPTER_FILE_BYTES
    kept = sum(os.path.getsize(path) for path in glob.glob(os.path.join(model_dir, "*", "*.safetensors"))
               if os.path.basename(os.path.dirname(path)) not in trained)
    trained_count = sum(counts[name] for name in trained)
    return TRAINED_BYTES * trained_count, kept + 4 * trained_count


ADAPTER_FILE_BYTES = 1e6  # beside a LoRA's weights: the names in its file's header, the checkpoint's own records


def adapter_params(model_dir, family, trained, rank):
    """The parameters of rank-rank LoRA adapters on the layers --use_lora adapts in model_dir's trained networks (the
    family's denoiser_lora_targets, the text encoders' attention projections), from the weight files' headers: rank
    x (inputs + outputs) of each adapted layer, as peft makes them."""
    import re

    from dreambooth.models import networks

    total = 0
    for name in trained:
        targets = family.denoiser_lora_targets if name == family.denoiser else networks.TEXT_ENCODER_LORA_TARGETS
        for path in glob.glob(os.path.join(model_dir, name, "*.safetensors")):
            for key, entry in files.safetensors_header(path)[1].items():
                shape = entry["shape"] if key.endswith(".weight") else ()  # (not "__metadata__", nor a bias)
                if len(shape) < 2:
                    continue
                module = key.removesuffix(".weight")
                adapted = (re.fullmatch(targets, module) if isinstance(targets, str) else
                           any(module == t or module.endswith("." + t) for t in targets))
                if adapted:
                    inputs = 1
                    for size in shape[1:]:  # (a convolution's: its input channels x its kernel)
                        inputs *= size
                    total += rank * (inputs + shape[0])
    return total

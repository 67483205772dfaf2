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


def disk_bytes(model_dir, lora, train_text_encoder):
    """(a checkpoint's bytes, a saved model's bytes) of a run training model_dir: a checkpoint holds the trained
    networks' fp32 weights and AdamW's two moments (counted from the weight files' parameters, whatever their
    dtype: a bf16 Flux file holds half the bytes it trains in), a full model the trained networks in fp32 and
    the others as their files are; LoRA's are a few MB."""

    if lora:
        return LORA_BYTES, LORA_BYTES
    family, counts = families.family_of(model_dir), files.safetensors_params(model_dir)
    trained = trained_networks(family, counts, train_text_encoder)
    kept = sum(os.path.getsize(path) for path in glob.glob(os.path.join(model_dir, "*", "*.safetensors"))
               if os.path.basename(os.path.dirname(path)) not in trained)
    trained_count = sum(counts[name] for name in trained)
    return TRAINED_BYTES * trained_count, kept + 4 * trained_count

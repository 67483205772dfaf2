"""Models with random weights, built from config: the real diffusers and transformers classes of each
family at several widths (MODEL_SIZES, and a family's own full sizes), for the tests, the benchmarks and
`cache_model.py --tiny / --random_model`. A run never builds one; it loads what these wrote."""

import functools
import os
import shutil

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import hub
from dreambooth import machine

TINY_TOKENIZER_DIR = os.path.join(files.ASSETS_DIR, "tiny_tokenizer")


# Architectures built from config with random weights: the real classes at several widths (the
# SD 1.x layout, or another family's with its random.changes). tiny: 64 px, for tests. small: SD's
# layout at a fifth of its width, 256 px, enough compute that a CPU benchmark sees both overhead and
# work. sd15: the full SD 1.x shapes, 512 px. A family's own full sizes are its random.own_sizes (SDXL's: sdxl).
MODEL_SIZES = {
    "tiny": dict(unet_channels=(32, 64), unet_layers=1, unet_down=("DownBlock2D", "CrossAttnDownBlock2D"),
                 vae_channels=(32, 64), vae_layers=1, text_hidden=32, text_layers=2, text_heads=4,
                 latent_size=32),
    "small": dict(unet_channels=(64, 128, 256, 256), unet_layers=2,
                  unet_down=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                  vae_channels=(32, 64, 128, 128), vae_layers=2, text_hidden=128, text_layers=4, text_heads=4,
                  latent_size=32),
    "sd15": dict(unet_channels=(320, 640, 1280, 1280), unet_layers=2,
                 unet_down=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 vae_channels=(128, 256, 512, 512), vae_layers=2, text_hidden=768, text_layers=12, text_heads=12,
                 latent_size=64, vocab_size=49408),
}


def size_spec(size, family):
    """The MODEL_SIZES entry of size, or one of the family's own full sizes (family.random.own_sizes)."""
    return MODEL_SIZES[size] if size in MODEL_SIZES else family.random.own_sizes[size]


def random_sizes():
    """{size: the family that owns it, or None for every family's}: what --random_model takes."""
    return {**dict.fromkeys(MODEL_SIZES), **{size: f for f in families.FAMILIES.values() for size in f.random.own_sizes}}


def build_pipeline(size="tiny", seed=0, safety_checker=False, arch=None):
    """A randomly initialised pipeline of one of MODEL_SIZES and a family's architecture (its --arch
    name: families.ARCHS), the real diffusers/transformers classes."""
    import torch
    from transformers import CLIPTokenizer

    arch = arch or families.DEFAULT.random.arch
    torch.manual_seed(seed)
    tokenizer = CLIPTokenizer.from_pretrained(TINY_TOKENIZER_DIR, model_max_length=77)
    nets = build_networks(size, arch, tokenizer)
    betas = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                 steps_offset=1)
    return families.ARCHS[arch].random.pipeline(nets, tokenizer, betas, safety_checker)


@functools.lru_cache(maxsize=32)
def meta_networks(size, arch, depth=()):
    """build_networks of size and arch on the meta device: their shapes without memory or weights (built once a
    process: a caller that changes one works on a copy). depth: ((spec key, blocks), ...) in place of the size's
    block counts (activations.py counts a block's activations on shallow copies)."""
    import torch
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(TINY_TOKENIZER_DIR, model_max_length=77)
    with torch.device("meta"):
        return build_networks(size, arch, tokenizer, dict(depth), meta_text_side(size, arch))


@functools.lru_cache(maxsize=16)
def meta_text_side(size, arch):
    """The random text encoders of size and arch on the meta device, with the text width and extras the denoiser is
    built for (its family's RandomModels.text_encoders): built once for a model and its shallow copies (meta_networks'
    depth changes the denoiser's blocks alone; the copies' text encoders, never read, are the model's own)."""
    import torch
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(TINY_TOKENIZER_DIR, model_max_length=77)
    family = families.ARCHS[arch]
    with torch.device("meta"):
        return family.random.text_encoders(size_spec(size, family), tokenizer)


def parameter_counts(size, arch):
    """{network: parameter count} of a random model of size and arch (meta_networks)."""
    return {name: sum(p.numel() for p in net.parameters()) for name, net in meta_networks(size, arch).items()}


def check_room_for(size, arch, cache_dir):
    """UserError, before building it, when a random model's fp32 weights (counted on the meta device) would not
    fit this machine's available memory or cache_dir's free disk (Flux.1 dev's: 67 GB)."""
    need = 4 * sum(parameter_counts(size, arch).values())
    os.makedirs(cache_dir, exist_ok=True)
    for what, have in (("memory", machine.available_memory()), (f"free disk in {cache_dir}",
                                                                shutil.disk_usage(cache_dir).free)):
        if have is not None and need > have:
            raise errors.UserError(f"--random_model {size} builds {need / 1e9:.0f} GB of fp32 weights and this machine "
                                   f"has {have / 1e9:.0f} GB of {what}: build it on a larger machine (or --tiny)")


def build_networks(size, arch, tokenizer, changes=None, text_side=None):
    """{denoiser, "vae", text encoders}: the random networks of build_pipeline, named as the family's
    subfolders (in torch's current default device: "meta" counts a full-size model's parameters
    without memory); changes: what differs from the size's spec; text_side: the text encoders, text width and
    extras already built for it (meta_text_side), else built here."""
    hub.quiet_hf_logging()
    family = families.ARCHS[arch]
    spec = {**size_spec(size, family), **(changes or {})}
    latent_size = int(spec["latent_size"] * family.random.changes["resolution_scale"])
    nets, text_width, denoiser_extra = text_side or family.random.text_encoders(spec, tokenizer)
    denoiser = family.random.denoiser(spec, latent_size, text_width, denoiser_extra)  # (in this order: the seed's draws)
    return {family.denoiser: denoiser, "vae": family.random.vae(spec, latent_size), **nets}


def build_tiny_eval_models(folder, seed=0, image_size=64):
    """Random, tiny DINO-style ViT and CLIP models with their processors, saved (safetensors) under
    folder/dino and folder/clip: the real classes, so every scoring path runs offline."""
    import torch
    from transformers import CLIPConfig
    from transformers import CLIPImageProcessor
    from transformers import CLIPModel
    from transformers import CLIPProcessor
    from transformers import CLIPTokenizer
    from transformers import ViTConfig
    from transformers import ViTImageProcessor
    from transformers import ViTModel

    hub.quiet_hf_logging()
    torch.manual_seed(seed)
    dino = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              image_size=image_size, patch_size=16), add_pooling_layer=False)
    size = {"height": image_size, "width": image_size}
    dino_dir, clip_dir = os.path.join(folder, "dino"), os.path.join(folder, "clip")
    dino.save_pretrained(dino_dir)
    ViTImageProcessor(size=size).save_pretrained(dino_dir)
    tokenizer = CLIPTokenizer.from_pretrained(TINY_TOKENIZER_DIR, model_max_length=77)
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=image_size, patch_size=16)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(clip_dir)
    processor = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size=size)
    CLIPProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(clip_dir)
    return dino_dir, clip_dir

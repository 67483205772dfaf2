"""The Stable Diffusion networks: random SD 1.x, 2.x and SDXL models built from config, loading with the
safetensors rule, and the training set-up (devices, train mode, layout, DDP, compile).

One code path for every device: each option a GPU run turns on (channels-last, gradient
checkpointing, DDP, torch.compile, a second device for the text encoder and VAE) is a
setting that a CPU run can turn on too.
"""

import dataclasses
import os

from dreambooth import families
from dreambooth import utils

TINY_TOKENIZER_DIR = os.path.join(utils.REPO_DIR, "assets", "tiny_tokenizer")

# Architectures built from config with random weights: the real classes at several widths (the
# SD 1.x layout, or another family's with ARCHITECTURES below). tiny: 64 px, for tests. small: SD's
# layout at a fifth of its width, 256 px, enough compute that a CPU benchmark sees both overhead and
# work. sd15: the full SD 1.x shapes, 512 px. sdxl: the full SDXL shapes.
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
    # SDXL base 1.0's shapes (its architecture only: --random_model sdxl), 1024 px: three levels,
    # 1, 2 and 10 transformer layers in them, CLIP ViT-L and OpenCLIP bigG text encoders.
    "sdxl": dict(unet_channels=(320, 640, 1280), unet_layers=2,
                 unet_down=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 transformer_layers=(1, 2, 10),
                 vae_channels=(128, 256, 512, 512), vae_layers=2, text_hidden=768, text_layers=12, text_heads=12,
                 text2_hidden=1280, text2_layers=32, text2_heads=20, time_embed_dim=256, latent_size=64,
                 vocab_size=49408),
}


def safetensors_only(allow_unsafe_weights):
    """use_safetensors= for from_pretrained: True refuses pickled weights, None accepts either."""
    return None if allow_unsafe_weights else True


def from_pretrained(cls, model_dir, allow_unsafe_weights=False, **kwargs):
    """cls.from_pretrained(model_dir) with the suite's weight rule: safetensors only unless allowed."""
    utils.quiet_hf_logging()
    return cls.from_pretrained(model_dir, use_safetensors=safetensors_only(allow_unsafe_weights), **kwargs)


def tiny_safety_checker(projection_dim=32):
    """A randomly initialised SD safety checker (real diffusers class) and its image processor.

    With its concept weights at 1 no image is flagged (a cosine never exceeds 1);
    a test lowers them to flag every image.
    """
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    config = CLIPConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=projection_dim)
    checker = StableDiffusionSafetyChecker(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return checker, processor


# What a random model of each architecture changes in its MODEL_SIZES entry and around it, as the
# released models of its family do. sd1: SD 1.4/1.5. sd2-v: SD 2.1 (768 px, v-prediction): OpenCLIP's
# gelu text encoder, linear projections in the UNet's transformers, a head count per level, DDIM.
# sdxl: SDXL base 1.0 (1024 px): two text encoders (CLIP ViT-L's kind, then OpenCLIP's with a
# projection, whose pooled output and the image's size and crop condition the UNet: "text_time"),
# their penultimate states concatenated as the cross-attention input, Euler, the VAE's 0.13025.
ARCHITECTURES = {
    "sd1": dict(text_act="quick_gelu", linear_projection=False, prediction_type="epsilon", resolution_scale=1),
    "sd2-v": dict(text_act="gelu", linear_projection=True, prediction_type="v_prediction", resolution_scale=1.5),
    "sdxl": dict(text_act="quick_gelu", text2_act="gelu", linear_projection=True, prediction_type="epsilon",
                 resolution_scale=2, time_embed_dim=8, vae_scaling_factor=0.13025),
}


def _text_encoder(cls, spec, tokenizer, act, **extra):
    from transformers import CLIPTextConfig

    return cls(CLIPTextConfig(
        vocab_size=spec.get("vocab_size", len(tokenizer)),
        hidden_size=spec["text_hidden"],
        intermediate_size=4 * spec["text_hidden"],
        num_hidden_layers=spec["text_layers"],
        num_attention_heads=spec["text_heads"],
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act=act,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    ))


def build_pipeline(size="tiny", seed=0, safety_checker=False, arch="sd1"):
    """A randomly initialised pipeline of one of MODEL_SIZES and ARCHITECTURES (real diffusers/transformers classes)."""
    import torch
    from diffusers import (DDIMScheduler, EulerDiscreteScheduler, PNDMScheduler, StableDiffusionPipeline,
                           StableDiffusionXLPipeline)
    from transformers import CLIPTokenizer

    torch.manual_seed(seed)
    tokenizer = CLIPTokenizer.from_pretrained(TINY_TOKENIZER_DIR, model_max_length=77)
    nets = build_networks(size, arch, tokenizer)
    betas = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                 steps_offset=1)
    if arch == "sdxl":  # SDXL base 1.0's scheduler
        scheduler = EulerDiscreteScheduler(timestep_spacing="leading", **betas)
        return StableDiffusionXLPipeline(tokenizer=tokenizer, tokenizer_2=tokenizer, scheduler=scheduler, **nets)
    if arch == "sd1":  # the scheduler of SD 1.4's scheduler/scheduler_config.json
        scheduler = PNDMScheduler(skip_prk_steps=True, set_alpha_to_one=False, **betas)
    else:  # SD 2.1's
        scheduler = DDIMScheduler(clip_sample=False, set_alpha_to_one=False,
                                  prediction_type=ARCHITECTURES[arch]["prediction_type"], **betas)
    checker, processor = tiny_safety_checker() if safety_checker else (None, None)
    return StableDiffusionPipeline(tokenizer=tokenizer, scheduler=scheduler, safety_checker=checker,
                                   feature_extractor=processor, requires_safety_checker=safety_checker, **nets)


def build_networks(size, arch, tokenizer):
    """{"unet", "vae", "text_encoder"[, "text_encoder_2"]}: the random networks of build_pipeline
    (in torch's current default device: "meta" counts a full-size model's parameters without memory)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    spec, kind = MODEL_SIZES[size], ARCHITECTURES[arch]
    latent_size = int(spec["latent_size"] * kind["resolution_scale"])
    text_encoder = _text_encoder(CLIPTextModel, spec, tokenizer, kind["text_act"])
    down = spec["unet_down"]
    up = tuple(reversed([name.replace("Down", "Up") for name in down]))
    # SD 1.x: 8 heads everywhere; SD 2.x and SDXL: heads of 64 channels, so more heads at each wider level.
    heads = 8 if arch == "sd1" else tuple(max(2, c // 64) for c in spec["unet_channels"])
    unet_extra, text_width = {}, spec["text_hidden"]
    if arch == "sdxl":
        # The second encoder is the wider one, as in SDXL (768 and 1280): the single-file loaders tell
        # the two apart by their width.
        wide = dict(spec, text_hidden=spec.get("text2_hidden", 2 * spec["text_hidden"]),
                    text_layers=spec.get("text2_layers", spec["text_layers"]),
                    text_heads=spec.get("text2_heads", spec["text_heads"]))
        text_encoder_2 = _text_encoder(CLIPTextModelWithProjection, wide, tokenizer, kind["text2_act"],
                                       projection_dim=wide["text_hidden"])
        text_width = spec["text_hidden"] + wide["text_hidden"]  # both encoders' states side by side
        # The pooled text embedding and six size/crop numbers, each in a time_embed_dim sinusoid.
        time_dim = spec.get("time_embed_dim", kind["time_embed_dim"])
        unet_extra = dict(addition_embed_type="text_time", addition_time_embed_dim=time_dim,
                          projection_class_embeddings_input_dim=wide["text_hidden"] + 6 * time_dim,
                          transformer_layers_per_block=spec.get("transformer_layers", 1))
    unet = UNet2DConditionModel(
        sample_size=latent_size,
        block_out_channels=spec["unet_channels"],
        layers_per_block=spec["unet_layers"],
        down_block_types=down,
        up_block_types=up,
        cross_attention_dim=text_width,
        attention_head_dim=heads,
        use_linear_projection=kind["linear_projection"],
        **unet_extra,
    )
    num_vae_blocks = len(spec["vae_channels"])
    vae = AutoencoderKL(
        block_out_channels=spec["vae_channels"],
        layers_per_block=spec["vae_layers"],
        down_block_types=("DownEncoderBlock2D",) * num_vae_blocks,
        up_block_types=("UpDecoderBlock2D",) * num_vae_blocks,
        latent_channels=4,
        sample_size=latent_size * 2 ** (num_vae_blocks - 1),
        **({"scaling_factor": kind["vae_scaling_factor"], "force_upcast": True} if arch == "sdxl" else {}),
    )
    nets = dict(unet=unet, vae=vae, text_encoder=text_encoder)
    if arch == "sdxl":
        nets["text_encoder_2"] = text_encoder_2
    return nets


# ---------------------------------------------------------------- training set-up


@dataclasses.dataclass
class Models:
    """The networks of one training worker. The UNet lives on unet_device; the text
    encoder and VAE on aux_device (the same device, or a worker's second GPU)."""

    unet: object
    text_encoder: object
    vae: object
    scheduler: object
    unet_device: object
    aux_device: object
    text_encoder_2: object = None  # SDXL's second text encoder (with a projection), on aux_device
    frozen_unet: object = None  # --prior_preservation prior_prediction, full fine-tuning: the base UNet, frozen

    def text_encoders(self):
        """The text encoders in the order the prompt's states are concatenated (SDXL: two)."""
        return [m for m in (self.text_encoder, self.text_encoder_2) if m is not None]

    def base_unet(self):
        """A context manager giving the base model's UNet for no-grad predictions: the frozen copy, or
        with LoRA the trained UNet with its adapters switched off until the block ends."""
        import contextlib

        @contextlib.contextmanager
        def adapters_off():
            unet = unwrap(self.unet)
            unet.disable_adapters()
            try:
                yield unet
            finally:
                unet.enable_adapters()

        return contextlib.nullcontext(self.frozen_unet) if self.frozen_unet is not None else adapters_off()

    def ddp_wrapped(self):
        """The trained networks that DDP wraps (they have no_sync), for gradient accumulation."""
        return [m for m in (self.unet, *self.text_encoders()) if hasattr(m, "no_sync")]


def unwrap(model):
    """The plain module under torch.compile's and DDP's wrappers."""
    while hasattr(model, "_orig_mod") or hasattr(model, "module"):
        model = getattr(model, "_orig_mod", None) or model.module
    return model


def load_models(model_dir, unet_device, aux_device, train_text_encoder, allow_unsafe_weights=False, vae_dir=None,
                family=None):
    """fp32 UNet and text encoder, frozen VAE, each on its device, in the mode training needs.

    from_pretrained returns eval mode; trained networks must be in train mode, or
    transformers' gradient checkpointing (which acts only when training) never runs.
    """
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    family = family or families.family_of(model_dir)
    unet = from_pretrained(UNet2DConditionModel, model_dir, allow_unsafe_weights, subfolder="unet")
    encoders = [from_pretrained(CLIPTextModel, model_dir, allow_unsafe_weights, subfolder="text_encoder")]
    if "text_encoder_2" in family.text_encoders:
        encoders.append(from_pretrained(CLIPTextModelWithProjection, model_dir, allow_unsafe_weights,
                                        subfolder="text_encoder_2"))
    vae = load_vae(model_dir, vae_dir, allow_unsafe_weights)
    scheduler = DDPMScheduler.from_pretrained(model_dir, subfolder="scheduler")
    unet.train()
    vae.requires_grad_(False).eval()
    for text_encoder in encoders:
        text_encoder.requires_grad_(train_text_encoder).train(train_text_encoder).to(aux_device)
    return Models(unet.to(unet_device), encoders[0], vae.to(aux_device), scheduler, unet_device, aux_device,
                  *encoders[1:])


def load_vae(model_dir, vae_dir=None, allow_unsafe_weights=False):
    """The model's VAE, or the one in vae_dir (--pretrained_vae_model_name_or_path) in its place."""
    from diffusers import AutoencoderKL

    if vae_dir:
        return from_pretrained(AutoencoderKL, vae_dir, allow_unsafe_weights)
    return from_pretrained(AutoencoderKL, model_dir, allow_unsafe_weights, subfolder="vae")


def ddp(model, device):
    """DistributedDataParallel over the initialised process group, on model's one device.

    gradient_as_bucket_view: gradients live in the all-reduce buckets instead of beside
    them (one fp32 copy of the gradients less, ~3.4 GB for SD's UNet). broadcast_buffers
    off: the networks have no buffers that training changes.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # torch 2.14 renamed the per-forward buffer broadcast; older releases (the GPU images) lack the new name.
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True, **{no_sync: False})


# The layers LoRA adapts (diffusers' DreamBooth LoRA script's choice): attention projections.
UNET_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
TEXT_ENCODER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def lora_config(plan, targets):
    from peft import LoraConfig

    return LoraConfig(r=plan.lora_rank, lora_alpha=plan.lora_alpha, lora_dropout=plan.lora_dropout,
                      init_lora_weights="gaussian", target_modules=list(targets))


def add_lora(models, plan):
    """Freeze every weight and add trainable fp32 LoRA adapters (peft) to the UNet and, with
    train_text_encoder, the text encoders. The frozen weights go to the run's autocast dtype
    (bf16/fp16 on GPUs): that is where LoRA's memory saving comes from."""
    import torch
    from diffusers.training_utils import cast_training_params

    from dreambooth import steps  # here, not at the top: it imports torch (2 s a --help or a one-line error never waits for)

    frozen_dtype = steps.amp_dtype(plan.mixed_precision, models.unet_device) or torch.float32
    for model in (models.unet, *models.text_encoders(), models.vae):
        model.requires_grad_(False).to(dtype=frozen_dtype)
    models.unet.add_adapter(lora_config(plan, UNET_LORA_TARGETS))
    trained = [models.unet]
    if plan.train_text_encoder:
        for text_encoder in models.text_encoders():
            text_encoder.add_adapter(lora_config(plan, TEXT_ENCODER_LORA_TARGETS))
            trained.append(text_encoder)
    cast_training_params(trained, dtype=torch.float32)


def load_frozen_unet(plan, device):
    """The base model's UNet, frozen, in the run's autocast dtype (fp32 without one): the target of
    --prior_preservation prior_prediction when every weight is trained."""
    import torch
    from diffusers import UNet2DConditionModel

    from dreambooth import steps  # here, not at the top: it imports torch (2 s a --help or a one-line error never waits for)

    dtype = steps.amp_dtype(plan.mixed_precision, device) or torch.float32
    unet = from_pretrained(UNet2DConditionModel, plan.model_dir, plan.allow_unsafe_weights, subfolder="unet")
    return unet.requires_grad_(False).eval().to(device, dtype=dtype)


def freeze_unread_layers(text_encoder):
    """SDXL reads its first text encoder's penultimate states: the last layer and the final norm
    never touch the loss. Left trainable, they would get no gradient (AdamW skips them) and DDP
    would stop the run waiting for theirs; frozen, they stay as they were either way."""
    inner = getattr(text_encoder, "text_model", text_encoder)  # transformers >= 5.6 flattened it
    for module in (inner.encoder.layers[-1], inner.final_layer_norm):
        module.requires_grad_(False)


def has_lora(model):
    return hasattr(unwrap(model), "peft_config")


def trained_state_dict(model):
    """The weights a checkpoint keeps: all of them, or with LoRA the adapters only.
    Contiguous, because channels-last weights are not, and safetensors refuses them."""
    model = unwrap(model)
    if has_lora(model):
        return {k: v.detach().contiguous() for k, v in model.named_parameters() if v.requires_grad}
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def load_trained_state_dict(model, weights):
    """Load what trained_state_dict wrote; with LoRA every adapter weight must be in it."""
    model = unwrap(model)
    if not has_lora(model):
        model.load_state_dict(weights)
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    trained = {k for k, v in model.named_parameters() if v.requires_grad}
    if unexpected or trained & set(missing):
        raise ValueError(f"checkpoint does not match the model's LoRA adapters "
                         f"(unexpected: {unexpected[:3]}, missing: {sorted(trained & set(missing))[:3]})")


def setup_models(plan, unet_device, aux_device, distributed, load_guard=None):
    """Load the models of a plan.Plan and apply its memory/speed options (gradient
    checkpointing, channels-last, torch.compile).

    distributed: wrap the trained networks in DDP (a process group of several workers exists).
    load_guard: a context manager around the loading alone (train.py's turns the files' errors
    into ones that stop the run; DDP's collectives are outside it).
    """
    import contextlib

    import torch

    with load_guard or contextlib.nullcontext():
        models = load_models(plan.model_dir, unet_device, aux_device, plan.train_text_encoder,
                             plan.allow_unsafe_weights, plan.vae_dir, plan.family)
        if plan.prior_prediction and not plan.use_lora:
            models.frozen_unet = load_frozen_unet(plan, unet_device)
    if plan.use_lora:
        add_lora(models, plan)
    if models.text_encoder_2 is not None:
        freeze_unread_layers(models.text_encoder)
    if plan.gradient_checkpointing:
        models.unet.enable_gradient_checkpointing()
        if plan.train_text_encoder:
            for te in models.text_encoders():  # transformers 5.20 renamed the method
                (getattr(te, "activation_checkpointing_enable", None) or te.gradient_checkpointing_enable)()
    if plan.channels_last:
        # NHWC convolutions run on tensor cores without layout transposes.
        for model in (models.unet, models.vae, models.frozen_unet):
            if model is not None:
                model.to(memory_format=torch.channels_last)
    if distributed:
        models.unet = ddp(models.unet, unet_device)
        if plan.train_text_encoder:
            models.text_encoder = ddp(models.text_encoder, aux_device)
            if models.text_encoder_2 is not None:
                models.text_encoder_2 = ddp(models.text_encoder_2, aux_device)
    if plan.torch_compile:
        models.unet = torch.compile(models.unet, backend=plan.torch_compile)
    return models

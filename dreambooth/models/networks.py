"""The Stable Diffusion networks: random SD 1.x, 2.x and SDXL models built from config, loading with the
safetensors rule, and the training set-up (devices, train mode, layout, DDP, compile).

One code path for every device: each option a GPU run turns on (channels-last, gradient
checkpointing, DDP, torch.compile, a second device for the text encoder and VAE) is a
setting that a CPU run can turn on too.
"""

import dataclasses

from dreambooth import errors
from dreambooth import families
from dreambooth import hub
from dreambooth import machine
from dreambooth.models import quantize
from dreambooth.models import sharding


def safetensors_only(allow_unsafe_weights):
    """use_safetensors= for from_pretrained: True refuses pickled weights, None accepts either."""
    return None if allow_unsafe_weights else True


def from_pretrained(cls, model_dir, allow_unsafe_weights=False, **kwargs):
    """cls.from_pretrained(model_dir) with the suite's weight rule: safetensors only unless allowed."""
    hub.quiet_hf_logging()
    return cls.from_pretrained(model_dir, use_safetensors=safetensors_only(allow_unsafe_weights), **kwargs)


# ---------------------------------------------------------------- training set-up


@dataclasses.dataclass
class Models:
    """The networks of one training worker. The denoiser (a UNet, or a flow family's transformer) lives on
    denoiser_device; the text encoders and VAE on aux_device (the same device, or a worker's second GPU)."""

    denoiser: object
    vae: object
    scheduler: object
    denoiser_device: object
    aux_device: object
    family: families.Family  # what the text encoders do with token ids, the denoiser's inputs and objective
    encoders: list  # the family's text encoders, in its order (family.text_encoders), on aux_device
    frozen_denoiser: object = None  # --prior_preservation prior_prediction, full fine-tuning: the base denoiser
    text_encoders_released: bool = False  # moved off aux_device: training reads only their precomputed states

    def release_text_encoders(self, device="cpu"):
        """Move the frozen text encoders to device (host memory) once every state training and its samples
        read is computed (plan.text_encoded_once): T5-XXL's 9 GiB in bf16 leave the GPU. They stay whole
        for a full model's save."""
        self.encoders = [text_encoder.to(device) for text_encoder in self.encoders]
        self.text_encoders_released = True

    @property
    def text_encoder(self):
        return self.encoders[0]

    def text_encoders(self):
        """The text encoders in the order the prompt's states are concatenated (SDXL: two, SD 3.5: three)."""
        return list(self.encoders)

    def trainable(self):
        """[(index, text encoder)] of those --train_text_encoder trains (the family's choice: SD 3.5's T5 stays frozen)."""
        return [(k, te) for k, (name, te) in enumerate(zip(self.family.text_encoders, self.encoders))
                if name in self.family.trainable_text_encoders]

    def trained_text_encoders(self):
        return [te for _, te in self.trainable()]

    def base_denoiser(self):
        """A context manager giving the base model's denoiser for no-grad predictions: the frozen copy, or
        with LoRA the trained denoiser with its adapters switched off until the block ends."""
        import contextlib

        @contextlib.contextmanager
        def adapters_off():
            denoiser = unwrap(self.denoiser)
            denoiser.disable_adapters()
            try:
                yield denoiser
            finally:
                denoiser.enable_adapters()

        return contextlib.nullcontext(self.frozen_denoiser) if self.frozen_denoiser is not None else adapters_off()

    def place_text_side(self):
        """The text encoders and the VAE on aux_device."""
        self.vae = self.vae.to(self.aux_device)
        self.encoders = [text_encoder.to(self.aux_device) for text_encoder in self.encoders]

    def place_denoiser(self):
        """The denoiser (and the frozen base one) on denoiser_device."""
        self.denoiser = self.denoiser.to(self.denoiser_device)
        if self.frozen_denoiser is not None:
            self.frozen_denoiser = self.frozen_denoiser.to(self.denoiser_device)

    def ddp_wrapped(self):
        """The trained networks that DDP wraps (they have no_sync), for gradient accumulation."""
        return [m for m in (self.denoiser, *self.text_encoders()) if hasattr(m, "no_sync")]


def unwrap(model):
    """The plain module under torch.compile's and DDP's wrappers."""
    while hasattr(model, "_orig_mod") or hasattr(model, "module"):
        model = getattr(model, "_orig_mod", None) or model.module
    return model


def load_models(model_dir, denoiser_device, aux_device, train_text_encoder, allow_unsafe_weights=False, vae_dir=None,
                family=None):
    """fp32 denoiser and text encoders, frozen VAE, in the mode training needs, still in host memory: their
    devices are recorded, and Models.place_text_side / place_denoiser move them there (after LoRA's cast of
    the frozen weights: a 12 B transformer never reaches the GPU in fp32).

    from_pretrained returns eval mode; trained networks must be in train mode, or
    transformers' gradient checkpointing (which acts only when training) never runs.
    """
    family = family or families.family_of(model_dir)

    def load(cls, subfolder):
        return from_pretrained(cls, model_dir, allow_unsafe_weights, subfolder=subfolder)

    denoiser = family.load_denoiser(load)
    encoders = family.load_text_encoders(model_dir, load)
    vae = load_vae(model_dir, vae_dir, allow_unsafe_weights, family)
    scheduler = family.load_scheduler(model_dir)
    denoiser.train()
    vae.requires_grad_(False).eval()
    for name, text_encoder in zip(family.text_encoders, encoders):
        trained = train_text_encoder and name in family.trainable_text_encoders
        text_encoder.requires_grad_(trained).train(trained)
    return Models(denoiser, vae, scheduler, denoiser_device, aux_device, family, encoders)


def load_vae(model_dir, vae_dir=None, allow_unsafe_weights=False, family=None):
    """The model's VAE (its family's class), or the one in vae_dir (--pretrained_vae_model_name_or_path) in its
    place."""
    cls = (family or families.family_of(model_dir)).vae_class()
    if vae_dir:
        return from_pretrained(cls, vae_dir, allow_unsafe_weights)
    return from_pretrained(cls, model_dir, allow_unsafe_weights, subfolder="vae")


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


# The text encoders' layers LoRA adapts (diffusers' DreamBooth LoRA script's choice): attention projections;
# the denoiser's are its family's (family.denoiser_lora_targets).
TEXT_ENCODER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def lora_config(plan, targets, dora=False):
    """peft's config of the run's adapters (plan.adapter: LoRA, DoRA with dora, LoHa or LoKr) on targets."""
    import peft

    targets = targets if isinstance(targets, str) else list(targets)  # (a str: a regex)
    if plan.adapter in ("loha", "lokr"):  # (zero at the start, as LoRA's: the base model's output)
        config = peft.LoHaConfig if plan.adapter == "loha" else peft.LoKrConfig
        return config(r=plan.lora_rank, alpha=plan.lora_alpha, module_dropout=plan.lora_dropout, init_weights=True,
                      target_modules=targets)
    return peft.LoraConfig(r=plan.lora_rank, lora_alpha=plan.lora_alpha, lora_dropout=plan.lora_dropout,
                           init_lora_weights="gaussian", use_dora=dora, target_modules=targets)


def freeze_for_lora(models, plan):
    """LoRA's first half, in host memory: every weight frozen and cast to the run's autocast dtype (bf16/fp16 on
    GPUs): that is where LoRA's memory saving comes from."""
    import torch

    from dreambooth import machine

    frozen_dtype = machine.amp_dtype(plan.mixed_precision, models.denoiser_device) or torch.float32
    for model in (models.denoiser, *models.text_encoders(), models.vae):
        model.requires_grad_(False).to(dtype=frozen_dtype)


def add_lora(models, plan):
    """LoRA's second half: trainable fp32 LoRA adapters (peft) on the denoiser, over its int8/nf4 weights with
    --base_precision (quantised as they move to its device), and with train_text_encoder on the text encoders
    the family trains."""
    import torch
    from diffusers.training_utils import cast_training_params

    if plan.base_precision:
        models.denoiser = quantize.quantized(models.denoiser, plan.base_precision, models.denoiser.dtype,
                                             models.denoiser_device)
    # (--adapter dora: DoRA on the denoiser; the text encoders' adapters stay LoRA, the kind diffusers'
    # load_lora_weights reads back for them: it drops a text encoder's DoRA magnitudes)
    models.denoiser.add_adapter(lora_config(plan, models.family.denoiser_lora_targets, dora=plan.adapter == "dora"))
    trained = [models.denoiser]
    if plan.train_text_encoder:
        for text_encoder in models.trained_text_encoders():
            text_encoder.add_adapter(lora_config(plan, TEXT_ENCODER_LORA_TARGETS))
            trained.append(text_encoder)
    cast_training_params(trained, dtype=torch.float32)


def quantize_frozen_text_encoders(models, plan):
    """--text_encoder_precision: the text encoders the run does not train, quantised (quantize.py) as they move to
    aux_device; those it trains keep their weights."""
    trained = {id(te) for te in models.trained_text_encoders()} if plan.train_text_encoder else set()
    models.encoders = [te if id(te) in trained else
                       quantize.quantized(te, plan.text_encoder_precision, te.dtype, models.aux_device)
                       for te in models.encoders]


def load_frozen_denoiser(plan, device):
    """The base model's denoiser, frozen, in the run's autocast dtype (fp32 without one): the target of
    --prior_preservation prior_prediction when every weight is trained."""
    import torch


    dtype = machine.amp_dtype(plan.mixed_precision, device) or torch.float32
    denoiser = plan.family.load_denoiser(
        lambda cls, subfolder: from_pretrained(cls, plan.model_dir, plan.allow_unsafe_weights, subfolder=subfolder))
    return denoiser.requires_grad_(False).eval().to(dtype=dtype)  # (Models.place_denoiser moves it)


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


def setup_models(plan, denoiser_device, aux_device, distributed, load_guard=None, before_denoiser=None):
    """Load the models of a plan.Plan and apply its memory/speed options (gradient
    checkpointing, channels-last, torch.compile).

    distributed: wrap the trained networks in DDP (a process group of several workers exists).
    load_guard: a context manager around the loading alone (train.py's turns the files' errors
    into ones that stop the run; DDP's collectives are outside it).
    before_denoiser(models): called with the text encoders on their device and the denoiser still in host
    memory (the worker computes the frozen encoders' states there and releases them: T5-XXL and a 12 B
    transformer are never on one card together).
    """
    import contextlib

    import torch

    with load_guard or contextlib.nullcontext():
        models = load_models(plan.model_dir, denoiser_device, aux_device, plan.train_text_encoder,
                             plan.allow_unsafe_weights, plan.vae_dir, plan.family)
        if plan.prior_prediction and not plan.use_lora:
            models.frozen_denoiser = load_frozen_denoiser(plan, denoiser_device)
    if plan.use_lora:
        freeze_for_lora(models, plan)  # (in host memory: the frozen weights go to the GPU in their autocast dtype)
    if plan.text_encoder_precision:
        quantize_frozen_text_encoders(models, plan)
    models.place_text_side()
    if before_denoiser is not None:
        before_denoiser(models)
    if plan.use_lora:
        add_lora(models, plan)
    models.place_denoiser()
    models.family.freeze_unread_layers(models.text_encoders())
    if plan.gradient_checkpointing:
        models.denoiser.enable_gradient_checkpointing()
        if plan.train_text_encoder:
            for te in models.trained_text_encoders():  # transformers 5.20 renamed the method
                (getattr(te, "activation_checkpointing_enable", None) or te.gradient_checkpointing_enable)()
    if plan.channels_last:
        # NHWC convolutions run on tensor cores without layout transposes.
        for model in (models.denoiser, models.vae, models.frozen_denoiser):
            if model is not None:
                model.to(memory_format=torch.channels_last)
    if plan.fsdp:  # (its text encoders are frozen: nothing else to wrap)
        models.denoiser = sharding.shard(models.denoiser)
    elif distributed:
        models.denoiser = ddp(models.denoiser, denoiser_device)
    if distributed:
        if plan.train_text_encoder:
            for k, text_encoder in models.trainable():
                models.encoders[k] = ddp(text_encoder, aux_device)
    if plan.torch_compile:
        models.denoiser = compiled(models.denoiser, plan.torch_compile)
    return models


def compiled(module, backend):
    """torch.compile(module, backend=backend); an unknown backend is a UserError (no restart would mend it)."""
    import torch
    from torch._dynamo.exc import InvalidBackend

    try:
        return torch.compile(module, backend=backend)
    except InvalidBackend:
        known = ", ".join(torch._dynamo.list_backends())
        raise errors.UserError(f"--torch_compile {backend}: not a backend of this torch ({known})") from None

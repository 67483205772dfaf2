"""A denoiser's activation memory in training, counted rather than guessed: the bytes autograd keeps for the
backward pass of one training forward (one image, bf16), on torch's meta device (no weights, no compute:
a 12B transformer at 1024 px counts in about a second), then calibrated on a GPU measurement.

What is counted: every tensor saved for backward that is not a parameter, once. Attention is counted as the
fused kernels a GPU runs keep it (queries, keys, values, output and the log-sum-exp per row), not as the
eager math path would (the full attention matrix): PyTorch's SDPA takes a fused kernel on every GPU the
suite targets. What is not counted: kernel workspaces, the allocator's fragmentation, the gradients in
flight. The calibration covers those: SD 1.x's UNet at 512 px counts COUNTED_SD1 GiB per image and
measured MEASURED_SD1 on an H100 (benchmarks/bench.py; memory.py's figures), so a count is scaled by their ratio,
with gradient checkpointing and without. That a transformer's overhead scales like the UNet's is the
assumption; no transformer was measured on a GPU yet.
"""

import functools
import os

# SD 1.x's UNet, 512 px, per image: (without, with gradient checkpointing), GiB
COUNTED_SD1 = (1.0785, 0.1456)  # this module's count (tests/unit/test_memory.py recounts it)
MEASURED_SD1 = (0.95, 0.11)  # memory.ACTIVATION_GIB, memory.CHECKPOINTED_GIB: H100 peaks less the static memory


def saved_gib(module, forward):
    """GiB that autograd saves for backward while forward() runs module: non-parameter tensors, each once;
    scaled_dot_product_attention counted as a fused kernel keeps it."""
    import torch

    parameters = {id(p) for p in module.parameters()}
    saved = {}

    def pack(tensor):
        if id(tensor) not in parameters:
            saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    class FusedAttention(torch.autograd.Function):
        """What a flash / memory-efficient SDPA kernel keeps: q, k, v, the output and the row log-sum-exp."""

        @staticmethod
        def forward(ctx, query, key, value):
            out = torch.empty_like(query)
            ctx.save_for_backward(query, key, value, out,
                                  torch.empty(query.shape[:-1], device=query.device, dtype=torch.float32))
            return out

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError("counting only")

    def attention(*args, **kwargs):
        query, key, value = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
        return FusedAttention.apply(query, key, value)

    functional = torch.nn.functional
    eager = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = attention  # (diffusers looks it up at each call)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            forward()
    finally:
        functional.scaled_dot_product_attention = eager
    return sum(saved.values()) / 2 ** 30


def meta_denoiser(family, source, depth=()):
    """(family's denoiser on the meta device in bf16 and train mode, its latents' channels, the VAE's
    downscaling) of a model folder's configs, or of one of its own full sizes (family.random.own_sizes: the released
    models' shapes)."""
    import copy
    import os

    import torch

    from dreambooth import hub
    from dreambooth.families.shared import family as family_lib  # (here, not at the top: see per_image_gib)
    from dreambooth.models import random_models

    hub.quiet_hf_logging()  # (diffusers' note on casting a model with fp32 modules to bf16)
    with torch.device("meta"):
        if os.path.isdir(source):
            denoiser = family.denoiser_of_config(source)
            vae = family_lib.part_config(source, "vae")
        else:
            nets = random_models.meta_networks(source, family.random.arch, depth)
            denoiser, vae = copy.deepcopy(nets[family.denoiser]), nets["vae"].config  # (shared: changed below)
    return denoiser.to(torch.bfloat16).train(), family.latent_channels(vae), family.vae_downscale(vae)


@functools.lru_cache(maxsize=64)
def per_image_gib(family_name, source, resolution, checkpointed):
    """Calibrated activation GiB per image of a training step of family_name's denoiser (source: a model
    folder or an own size) at resolution px, with or without gradient checkpointing. For the flow-matching
    families (their text_tokens and joint attention); the UNet families' figures are memory.py's scaling of
    SD 1.x's measurement."""
    from dreambooth import families  # here, not at the top: the table imports every family module
    from dreambooth.models import random_models

    family = families.FAMILIES[family_name]
    kinds = () if os.path.isdir(source) else [key for key in family.random.block_counts
                                              if random_models.size_spec(source, family).get(key, 0) > 2]
    if not kinds:
        return counted_gib(family, source, resolution, checkpointed)
    # An own size whose blocks of one kind each save the same (RandomModels.block_counts): a shallow copy's count (one
    # block of each kind) plus, per kind, its blocks past the first times what a second one adds
    spec = random_models.size_spec(source, family)
    base = counted_gib(family, source, resolution, checkpointed, tuple((key, 1) for key in kinds))
    return base + sum((spec[key] - 1) * (counted_gib(family, source, resolution, checkpointed, tuple(
        (other, 2 if other == key else 1) for other in kinds)) - base) for key in kinds)


def counted_gib(family, source, resolution, checkpointed, depth=()):
    """per_image_gib's figure of the denoiser of source (depth: meta_networks')."""
    import torch

    denoiser, channels, scale = meta_denoiser(family, source, depth)
    if checkpointed:
        denoiser.enable_gradient_checkpointing()
    config = denoiser.config
    meta = dict(device="meta", dtype=torch.bfloat16)
    latents = torch.empty(1, channels, resolution // scale, resolution // scale, **meta)
    states = torch.empty(1, family.text_tokens, family.text_width(config), **meta)
    pooled = family.meta_side_input(config, meta)
    timesteps = torch.ones(1, device="meta")
    counted = saved_gib(denoiser, lambda: family.denoise(denoiser, latents, timesteps, states, pooled, None,
                                                          family.guidance_scale))
    return counted * MEASURED_SD1[checkpointed] / COUNTED_SD1[checkpointed]

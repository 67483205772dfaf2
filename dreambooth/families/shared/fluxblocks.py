"""Flux.1's transformer layout, shared by the families built on it: latents packed 2x2 into tokens with their
position ids (Flux.1, Chroma; Qwen-Image packs its latents the same way), Flux.1's 16-channel VAE, and the
double- and single-stream blocks' LoRA layers with kohya's names for them (FluxBlocks: Flux.1, Chroma)."""

from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import layouts


def pack(latents):
    """(B, C, h, w) latents -> (B, h/2 x w/2, 4C) tokens of 2x2 patches, as FluxPipeline packs them."""
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def unpack(tokens, h, w):
    """(B, h/2 x w/2, 4C) tokens -> (B, C, h, w) latents (pack's inverse)."""
    b, _, channels = tokens.shape
    tokens = tokens.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return tokens.reshape(b, channels // 4, h, w)


def image_ids(h, w, device, dtype):
    """(h/2 x w/2, 3) position ids of the packed tokens of (h, w) latents: (0, row, column)."""
    from diffusers import FluxPipeline

    return FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)


# A full transformer's weights by BFL's names (Flux.1's release; Chroma's keeps them; diffusers' single-file readers
# map them back): a double block's modulations, layers (q, k and v one qkv each stream) and q and k norms (a scale
# there); a single block's (its input linear1: q, k, v and the MLP's), the layers outside the blocks
ATTENTION_NAMES = {"attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1),
                   "attn.to_v": ("img_attn.qkv", 2), "attn.add_q_proj": ("txt_attn.qkv", 0),
                   "attn.add_k_proj": ("txt_attn.qkv", 1), "attn.add_v_proj": ("txt_attn.qkv", 2),
                   "attn.to_out.0": ("img_attn.proj", None), "attn.to_add_out": ("txt_attn.proj", None),
                   "attn.norm_q": ("img_attn.norm.query_norm", None), "attn.norm_k": ("img_attn.norm.key_norm", None),
                   "attn.norm_added_q": ("txt_attn.norm.query_norm", None),
                   "attn.norm_added_k": ("txt_attn.norm.key_norm", None)}  # (FLUX.2's double blocks' too)
DOUBLE_NAMES = {**ATTENTION_NAMES, "norm1.linear": ("img_mod.lin", None), "norm1_context.linear": ("txt_mod.lin", None),
                "ff.net.0.proj": ("img_mlp.0", None), "ff.net.2": ("img_mlp.2", None),
                "ff_context.net.0.proj": ("txt_mlp.0", None), "ff_context.net.2": ("txt_mlp.2", None)}
SINGLE_NORM_NAMES = {"attn.norm_q": ("norm.query_norm", None), "attn.norm_k": ("norm.key_norm", None)}
SINGLE_NAMES = {**SINGLE_NORM_NAMES, "attn.to_q": ("linear1", 0), "attn.to_k": ("linear1", 1),
                "attn.to_v": ("linear1", 2), "proj_mlp": ("linear1", 3), "proj_out": ("linear2", None),
                "norm.linear": ("modulation.lin", None)}
EDGE_NAMES = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
              "norm_out.linear": "final_layer.adaLN_modulation.1"}  # (FLUX.2's too)
OUTSIDE_NAMES = {**EDGE_NAMES, **{f"time_text_embed.{embedder}.linear_{i}": f"{theirs}.{layer}"
                                  for embedder, theirs in (("timestep_embedder", "time_in"),
                                                           ("text_embedder", "vector_in"),
                                                           ("guidance_embedder", "guidance_in"))
                                  for i, layer in ((1, "in_layer"), (2, "out_layer"))}}


def block_names(double, single):
    """layouts.block_name's blocks of a transformer whose double and single blocks are named so."""
    return {"transformer_blocks": ("double_blocks", double), "single_transformer_blocks": ("single_blocks", single)}


def kohya_module(module):
    """(kohya's module name, the part of its fused layer or None) of a transformer module's diffusers name: its BFL
    name (lora_unet_double_blocks_<i>_img_attn_qkv: q, k, v; ..._single_blocks_<i>_linear1: q, k, v, mlp)."""
    return layouts.kohya_block_module(module, block_names(DOUBLE_NAMES, SINGLE_NAMES), ("q", "k", "v", "mlp"), "Flux")


def bfl_name(key):
    """(BFL's name of a Flux.1 transformer weight or None, its place in a fused layer or None)."""
    return layouts.block_name(key, block_names(DOUBLE_NAMES, SINGLE_NAMES), OUTSIDE_NAMES)


def original_transformer(denoiser, name, label):
    """The transformer's weights by name (bfl_name, or a family's own), the final layer's modulation as
    (shift, scale) there (diffusers' is (scale, shift))."""
    weights = layouts.joined_layout(denoiser.state_dict(), name, label)
    for param in ("weight", "bias"):
        layouts.swap_halves(weights, f"final_layer.adaLN_modulation.1.{param}")
    return weights


class FluxBlocksModels(builders.RandomModels):
    """Random models over Flux.1's VAE: SD's at 16 channels, scaled and shifted by changes' vae_scaling_factor and
    vae_shift_factor."""

    def vae_config(self):
        return {"latent_channels": 16, "scaling_factor": self.changes["vae_scaling_factor"],
                "shift_factor": self.changes["vae_shift_factor"], "use_quant_conv": False,
                "use_post_quant_conv": False}


class FluxBlocks(family.Family):
    """A transformer of Flux.1's double- and single-stream blocks over packed latents."""

    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' Flux DreamBooth LoRA script's layers: the attention of both streams and their feed-forwards
    denoiser_lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                             "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                             "ff_context.net.0.proj", "ff_context.net.2")
    flow_matching = True
    default_weighting_scheme = "none"  # diffusers' Flux DreamBooth scripts' default: uniform

    def native_resolution(self, model_dir):
        """The VAE's sample size: a Flux transformer has none of its own (released models: 1024)."""
        return family.part_config(model_dir, "vae")["sample_size"]

    def size_multiple(self, model_dir):
        """The VAE's downscaling times the 2x2 packing."""
        return self.vae_scale(model_dir) * 2

    def unpack_latents(self, pipe, latents, height, width):
        """The pipeline's latent output is packed tokens: back to (B, C, h, w)."""
        return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' Flux DreamBooth LoRA script writes them."""
        return peft_layers

    # --- export (export.py): kohya's Flux LoRA layout, which ComfyUI, Forge and diffusers load
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (peft names, lora_A/lora_B) in the original Flux layout:
        lora_unet_double_blocks_<i>_img_attn_qkv, ..._single_blocks_<i>_linear1, lora_te1_<CLIP-L module>.
        Where the original fuses layers (q, k and v; a single block's linear1 also holds the MLP's input), the
        adapters are joined block-diagonally: the down weights stacked, each up weight in its rows and its
        columns, a part without adapters as zeros, alpha x the number of parts (the scale alpha / rank kept)."""
        config = family.part_config(model_dir, self.denoiser)
        width = config["num_attention_heads"] * config["attention_head_dim"]

        def module_of(network, module):
            return (layouts.kohya_text_module("lora_te1_", module), None) if network == "text_encoder" else \
                kohya_module(module)

        return family.kohya_lora_tensors(
            family.group_lora(state_dict, module_of),
            lambda name: alphas.get("text_encoder" if name.startswith("lora_te1_") else self.denoiser),
            lambda name: ("q", "k", "v", "mlp") if name.endswith("linear1") else ("q", "k", "v"),  # the fused rows
            {"q": width, "k": width, "v": width, "mlp": 4 * width})  # (Flux's MLP ratio is 4)

    # --- export (export.py): a full model as its transformer alone in BFL's layout (Flux.1's release, ComfyUI's files)
    denoiser_file = True

    def single_file_denoiser(self, denoiser):
        return original_transformer(denoiser, self.original_name, self.label)

    def original_name(self, key):
        """(BFL's name of a transformer weight or None, its place in a fused layer or None): bfl_name."""
        return bfl_name(key)

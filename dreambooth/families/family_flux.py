"""Flux.1 (dev, schnell): a flow-matching transformer (FluxTransformer2DModel: double-stream then
single-stream blocks) over 16-channel latents packed 2x2 into tokens with their position ids, conditioned
on T5's states and CLIP-L's pooled output. dev is guidance-distilled: its transformer also takes the
guidance value (--guidance_scale, in training too, as diffusers' Flux script); schnell has no guidance
input. Trained on the straight path towards the velocity (objectives.flow_matching) on the scheduler's
sigmas; 1024 px; no safety checker and no negative prompt.
"""

from dreambooth.families import builders
from dreambooth.families import family
from dreambooth.families import family_sd1
from dreambooth.families import family_sd3
from dreambooth.families import known
from dreambooth.families import layouts

T5_MAX_LENGTH = 512  # T5's tokens, in training and drawing (diffusers' Flux scripts' --max_sequence_length default)


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


# diffusers' module -> (the original layout's module, the part of a fused layer it is), for kohya's names
DOUBLE = {"attn.to_q": ("img_attn_qkv", "q"), "attn.to_k": ("img_attn_qkv", "k"), "attn.to_v": ("img_attn_qkv", "v"),
          "attn.to_out.0": ("img_attn_proj", None), "attn.add_q_proj": ("txt_attn_qkv", "q"),
          "attn.add_k_proj": ("txt_attn_qkv", "k"), "attn.add_v_proj": ("txt_attn_qkv", "v"),
          "attn.to_add_out": ("txt_attn_proj", None), "ff.net.0.proj": ("img_mlp_0", None),
          "ff.net.2": ("img_mlp_2", None), "ff_context.net.0.proj": ("txt_mlp_0", None),
          "ff_context.net.2": ("txt_mlp_2", None)}
SINGLE = {"attn.to_q": ("linear1", "q"), "attn.to_k": ("linear1", "k"), "attn.to_v": ("linear1", "v"),
          "proj_mlp": ("linear1", "mlp"), "proj_out": ("linear2", None)}


def kohya_module(module):
    """(kohya's module name, the part of its fused layer or None) of a transformer module's diffusers name."""
    blocks, index, inner = module.split(".", 2)
    if blocks == "transformer_blocks":
        original, part = DOUBLE[inner]
        return f"lora_unet_double_blocks_{index}_{original}", part
    if blocks == "single_transformer_blocks":
        original, part = SINGLE[inner]
        return f"lora_unet_single_blocks_{index}_{original}", part
    raise KeyError(f"no original Flux layer for {module}")


class FluxModels(builders.RandomModels):
    arch = "flux"
    note = "Flux.1 dev's layout: a double/single-stream transformer, CLIP-L and T5, flow matching, " \
                  "16-channel latents packed 2x2, a guidance input"
    changes = dict(resolution_scale=1, layers=1, single_layers=1, head_dim=16, heads=2, rope=(4, 4, 8),
                       t5_width=32, t5_layers=2, t5_heads=4, vae_scaling_factor=0.3611, vae_shift_factor=0.1159)
    # Flux.1 dev's shapes (--random_model flux-dev), 1024 px: 19 double- and 38 single-stream blocks of 24 heads
    # of 128, CLIP ViT-L, T5 v1.1 XXL's encoder; its VAE is SD's at 16 channels
    own_sizes = {"flux-dev": dict(layers=19, single_layers=38, head_dim=128, heads=24, rope=(16, 56, 56),
                                  t5_width=4096, t5_layers=24, t5_heads=64, t5_kv=64, t5_ff=10240, t5_vocab=32128,
                                  text_hidden=768, text_layers=12, text_heads=12, vocab_size=49408,
                                  vae_channels=(128, 256, 512, 512), vae_layers=2, latent_size=128)}

    def text_encoders(self, spec, tokenizer):
        from transformers import CLIPTextModel

        arch = {**self.changes, **spec}
        clip = family_sd1.clip_text_encoder(CLIPTextModel, spec, tokenizer, "quick_gelu")
        t5 = family_sd3.t5_encoder(arch, family_sd3.tiny_t5_tokenizer(T5_MAX_LENGTH))
        return {"text_encoder": clip, "text_encoder_2": t5}, arch["t5_width"], {"pooled_projection_dim": spec["text_hidden"]}

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import FluxTransformer2DModel

        arch = {**self.changes, **spec}
        return FluxTransformer2DModel(patch_size=1, in_channels=4 * 16, num_layers=arch["layers"],
                                      num_single_layers=arch["single_layers"], attention_head_dim=arch["head_dim"],
                                      num_attention_heads=arch["heads"], joint_attention_dim=text_width,
                                      guidance_embeds=True, axes_dims_rope=arch["rope"], **extra)

    def vae_config(self):
        return {"latent_channels": 16, "scaling_factor": self.changes["vae_scaling_factor"],
                "shift_factor": self.changes["vae_shift_factor"], "use_quant_conv": False,
                "use_post_quant_conv": False}

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers import FluxPipeline

        # Flux.1 dev's scheduler: its shift grows with the image's token count
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
        return FluxPipeline(tokenizer=tokenizer, tokenizer_2=family_sd3.tiny_t5_tokenizer(T5_MAX_LENGTH),
                            scheduler=scheduler, **nets)


class Flux(family.Family):
    name, label = "flux", "Flux.1"
    pipeline = "FluxPipeline"
    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' Flux DreamBooth LoRA script's layers: the attention of both streams and their feed-forwards
    denoiser_lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                             "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                             "ff_context.net.0.proj", "ff_context.net.2")
    text_encoders = ("text_encoder", "text_encoder_2")  # CLIP-L (pooled), T5 (states)
    trainable_text_encoders = ("text_encoder",)  # CLIP-L, as diffusers' Flux script: T5 stays frozen
    supports = frozenset({"train", "draw", "export_lora"})  # (not yet: its original single-file layout)
    negative_prompt = False  # dev is guidance-distilled: one prompt, the guidance value instead
    guidance_scale = 3.5  # dev's guidance value (FluxPipeline's and diffusers' Flux script's default)
    guided_training = True  # the guidance value is an input of the transformer in training (dev)
    released_resolutions = (1024,)
    # flux-dev's, for memory.py (tests/unit/test_memory.py counts them on the meta device)
    released_params = {"transformer": 11901.41e6, "text_encoder": 123.06e6, "text_encoder_2": 4762.31e6, "vae": 83.82e6}
    released_size = "flux-dev"  # the own size whose activations memory.py counts for a released model
    random = FluxModels()
    text_tokens = T5_MAX_LENGTH  # the text states' length in training (activations.py)

    def native_resolution(self, model_dir):
        """The VAE's sample size: a Flux transformer has none of its own (released models: 1024)."""
        return family.part_config(model_dir, "vae")["sample_size"]

    def size_multiple(self, model_dir):
        """The VAE's downscaling times the 2x2 packing."""
        return self.vae_scale(model_dir) * 2

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import FluxTransformer2DModel

        return load(FluxTransformer2DModel, self.denoiser)

    def load_tokenizers(self, model_dir):
        from transformers import CLIPTokenizer
        from transformers import T5TokenizerFast

        return [CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer"),
                T5TokenizerFast.from_pretrained(model_dir, subfolder="tokenizer_2", model_max_length=T5_MAX_LENGTH)]

    def load_text_encoders(self, model_dir, load):
        from transformers import CLIPTextModel
        from transformers import T5EncoderModel

        return [load(CLIPTextModel, "text_encoder"), load(T5EncoderModel, "text_encoder_2")]

    def encode_text(self, text_encoders, ids):
        """As FluxPipeline.encode_prompt does: T5's states (N, 512, D) and CLIP-L's pooled output (N, P).
        ids: (N, 2, 512), CLIP's 77 first (the rest is padding, dataset.tokenize_all)."""
        clip, t5 = text_encoders
        pooled = clip(ids[:, 0, :family.config_of(clip).max_position_embeddings]).pooler_output
        states = t5(ids[:, 1])[0]
        return states.to(pooled.dtype), pooled

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "none"  # diffusers' Flux DreamBooth scripts' default: uniform

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: packed into tokens with their ids, the timestep as a
        fraction of the schedule (the transformer scales it by 1000 itself), the guidance value for dev."""
        import torch

        h, w = noisy.shape[-2:]
        guided = family.config_of(model).guidance_embeds
        guidance = torch.full((noisy.shape[0],), guidance, device=noisy.device) if guided else None
        out = model(hidden_states=pack(noisy), timestep=timesteps / 1000, guidance=guidance,
                    pooled_projections=pooled, encoder_hidden_states=states,
                    txt_ids=states.new_zeros(states.shape[1], 3), img_ids=image_ids(h, w, noisy.device, states.dtype),
                    return_dict=False)[0]
        return unpack(out, h, w)

    def pipeline_kwargs(self):
        return {"max_sequence_length": T5_MAX_LENGTH}

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

    # The base models of this family the suite knows by short name (families.KNOWN_MODELS)
    memory_rows = (("Flux.1 dev", "flux-dev", (512, 1024), (4, 8)),)
    known_models = (
        # The flow-matching transformers, in the bf16/fp16 files their repositories hold: transformer (Flux 23.8 GB,
        # SD 3.5 large 16.1, medium 4.9), T5-XXL 9.5, CLIP-L 0.25 (+ CLIP-G 1.4 for SD 3.5), VAE 0.2. Their short
        # names are also their --random_model sizes (family_flux/family_sd3 own_sizes): the preflight counts those.
        # The revisions could not be checked from here (no hub access); they are the commits people's hub caches show.
        known.KnownModel("flux-dev", "black-forest-labs/FLUX.1-dev", "3de623fc3c33e44ffbe2bad470d0f45bccf2eb21", 1024,
                         "flow", 33.8, gated=True),
        known.KnownModel("flux-schnell", "black-forest-labs/FLUX.1-schnell", "741f7c3ce8b383c54771c7003378a50191e9efe9", 1024,
                         "flow", 33.8),
    )


FAMILY = Flux()

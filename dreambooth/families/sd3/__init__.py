"""SD 3.5 (medium, large): a flow-matching transformer (SD3Transformer2DModel, MMDiT) over 16-channel
latents, conditioned on three text encoders: CLIP-L and CLIP-G (with projections; their penultimate
states side by side, their pooled outputs concatenated) and T5 (its states after CLIP's, which are
zero-padded to T5's width). Trained on the straight path towards the velocity (objectives.flow_matching)
on the scheduler's shifted sigmas; 1024 px; no safety checker.
"""

from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import known
from dreambooth.families.shared import layouts

T5_MAX_LENGTH = 77  # T5's tokens in training (diffusers' SD3 scripts' --max_sequence_length default)


# The original (Stability's MMDiT) layout of a block, as diffusers' single-file converter reads it: diffusers'
# module in transformer_blocks.<i> -> (its module in joint_blocks.<i>, the part of a fused q/k/v layer it is)
BLOCK = {
    **{f"attn.to_{p}": ("x_block.attn.qkv", p) for p in "qkv"},
    **{f"attn.add_{p}_proj": ("context_block.attn.qkv", p) for p in "qkv"},
    **{f"attn2.to_{p}": ("x_block.attn2.qkv", p) for p in "qkv"},  # (SD 3.5 medium's second attention)
    "attn.to_out.0": ("x_block.attn.proj", None), "attn.to_add_out": ("context_block.attn.proj", None),
    "attn2.to_out.0": ("x_block.attn2.proj", None),
    "attn.norm_q": ("x_block.attn.ln_q", None), "attn.norm_k": ("x_block.attn.ln_k", None),
    "attn.norm_added_q": ("context_block.attn.ln_q", None), "attn.norm_added_k": ("context_block.attn.ln_k", None),
    "attn2.norm_q": ("x_block.attn2.ln_q", None), "attn2.norm_k": ("x_block.attn2.ln_k", None),
    "norm1.linear": ("x_block.adaLN_modulation.1", None),
    "norm1_context.linear": ("context_block.adaLN_modulation.1", None),
    "ff.net.0.proj": ("x_block.mlp.fc1", None), "ff.net.2": ("x_block.mlp.fc2", None),
    "ff_context.net.0.proj": ("context_block.mlp.fc1", None), "ff_context.net.2": ("context_block.mlp.fc2", None)}
OUTSIDE = {"pos_embed.proj": "x_embedder.proj", "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
           "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
           "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
           "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2", "context_embedder": "context_embedder",
           "proj_out": "final_layer.linear", "norm_out.linear": "final_layer.adaLN_modulation.1"}


def original_module(module):
    """(the original layout's module, the part of a fused q/k/v layer or None) of a transformer module's diffusers
    name; KeyError for one it has not."""
    if module.startswith("transformer_blocks."):
        _, index, inner = module.split(".", 2)
        original, part = BLOCK[inner]
        return f"joint_blocks.{index}.{original}", part
    return OUTSIDE[module], None


def swap_halves(tensor):
    """The two halves of an adaLN output swapped: the original orders (shift, scale), diffusers (scale, shift) in
    its last block's context norm and its final norm."""
    import torch

    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first])


def original_transformer(state_dict, num_layers):
    """{original key: tensor} of an SD3Transformer2DModel's state_dict, the layout diffusers' single-file loader
    and ComfyUI read: q, k and v fused into qkv, the last block's context norm and the final norm swapped."""
    import torch

    fused, out = {}, {}
    for key, tensor in state_dict.items():
        module, kind = key.rsplit(".", 1)
        if key == "pos_embed.pos_embed":
            out["pos_embed"] = tensor
            continue
        original, part = original_module(module)
        if module in ("norm_out.linear", f"transformer_blocks.{num_layers - 1}.norm1_context.linear"):
            tensor = swap_halves(tensor)
        if part is None:
            out[f"{original}.{kind}"] = tensor
        else:
            fused.setdefault(f"{original}.{kind}", {})[part] = tensor
    for key, parts in fused.items():
        out[key] = torch.cat([parts[p] for p in "qkv"])
    return out


class SD3Models(builders.RandomModels):
    block_counts = ("layers",)  # (activations.py: each block keeps the same)
    note = "SD 3.5's layout: an MMDiT transformer, CLIP-L, CLIP-G and T5, flow matching, 16-channel latents"
    changes = dict(resolution_scale=1, layers=2, head_dim=8, heads=4, t5_width=32, t5_layers=2, t5_heads=4,
                       vae_scaling_factor=1.5305, vae_shift_factor=0.0609, shift=3.0)
    # SD 3.5's shapes (--random_model sd35-medium|sd35-large), 1024 px: MMDiT blocks of heads of 64 with RMS-normed
    # queries and keys (medium: 24 blocks of 24 heads, its first 13 with a second attention; large: 38 of 38),
    # CLIP ViT-L, OpenCLIP bigG, T5 v1.1 XXL's encoder; SD 3's 16-channel VAE
    _clips = dict(text_hidden=768, text_layers=12, text_heads=12, text2_hidden=1280, text2_layers=32, text2_heads=20,
                  vocab_size=49408, t5_width=4096, t5_layers=24, t5_heads=64, t5_kv=64, t5_ff=10240, t5_vocab=32128,
                  vae_channels=(128, 256, 512, 512), vae_layers=2, latent_size=128, head_dim=64, qk_norm="rms_norm")
    own_sizes = {"sd35-medium": dict(_clips, layers=24, heads=24, pos_embed_max_size=384,
                                     dual_attention_layers=tuple(range(13))),
                 "sd35-large": dict(_clips, layers=38, heads=38, pos_embed_max_size=192)}

    def text_encoders(self, spec, tokenizer):
        from transformers import CLIPTextModelWithProjection

        arch = {**self.changes, **spec}
        # CLIP-G is the wider one (1280 wide, 32 layers of 20 heads in the released models)
        wide = dict(spec, text_hidden=spec.get("text2_hidden", 2 * spec["text_hidden"]),
                    text_layers=spec.get("text2_layers", spec["text_layers"]),
                    text_heads=spec.get("text2_heads", spec["text_heads"]))
        clip_l = builders.clip_text_encoder(CLIPTextModelWithProjection, spec, tokenizer, "quick_gelu",
                                              projection_dim=spec["text_hidden"])
        clip_g = builders.clip_text_encoder(CLIPTextModelWithProjection, wide, tokenizer, "gelu",
                                              projection_dim=wide["text_hidden"])
        t5 = builders.t5_encoder(arch, builders.tiny_t5_tokenizer(T5_MAX_LENGTH))
        pooled_width = spec["text_hidden"] + wide["text_hidden"]
        return ({"text_encoder": clip_l, "text_encoder_2": clip_g, "text_encoder_3": t5}, arch["t5_width"],
                {"pooled_projection_dim": pooled_width})

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import SD3Transformer2DModel

        arch = {**self.changes, **spec}
        released = {k: arch[k] for k in ("qk_norm", "dual_attention_layers") if k in arch}  # (3.5's own)
        return SD3Transformer2DModel(sample_size=latent_size, patch_size=2, in_channels=16, out_channels=16,
                                     num_layers=arch["layers"], attention_head_dim=arch["head_dim"],
                                     num_attention_heads=arch["heads"], joint_attention_dim=text_width,
                                     caption_projection_dim=arch["head_dim"] * arch["heads"],
                                     pos_embed_max_size=arch.get("pos_embed_max_size", latent_size), **released,
                                     **extra)

    def vae_config(self):
        return {"latent_channels": 16, "scaling_factor": self.changes["vae_scaling_factor"],
                "shift_factor": self.changes["vae_shift_factor"], "use_quant_conv": False,
                "use_post_quant_conv": False}

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline(tokenizer=tokenizer, tokenizer_2=tokenizer, tokenizer_3=builders.tiny_t5_tokenizer(T5_MAX_LENGTH),
                                        scheduler=FlowMatchEulerDiscreteScheduler(shift=self.changes["shift"]),
                                        **nets)


class SD3(family.Family):
    label = "SD 3.5"
    order = 40
    pipeline = "StableDiffusion3Pipeline"
    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' SD3 DreamBooth LoRA script's layers: the joint attention's projections of both streams
    denoiser_lora_targets = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                             "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3")
    supports = frozenset({"train", "draw", "export", "export_lora"})
    released_resolutions = (1024,)
    released_params = {"transformer": 8056.63e6, "text_encoder": 123.65e6, "text_encoder_2": 694.66e6,
                       "text_encoder_3": 4762.31e6, "vae": 83.82e6}  # sd35-large's (memory.py)
    released_size = "sd35-large"  # the own size whose activations memory.py counts for a released model
    random = SD3Models()
    text_tokens = 2 * T5_MAX_LENGTH  # CLIP's 77 states, then T5's (activations.py)

    def size_multiple(self, model_dir):
        """The VAE's downscaling times the transformer's patch size."""
        return self.vae_scale(model_dir) * family.part_config(model_dir, self.denoiser)["patch_size"]

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import SD3Transformer2DModel

        return load(SD3Transformer2DModel, self.denoiser)

    def load_tokenizers(self, model_dir):
        from transformers import CLIPTokenizer
        from transformers import T5TokenizerFast

        return [CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer"),
                CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer_2"),
                T5TokenizerFast.from_pretrained(model_dir, subfolder="tokenizer_3", model_max_length=T5_MAX_LENGTH)]

    def load_text_encoders(self, model_dir, load):
        from transformers import CLIPTextModelWithProjection
        from transformers import T5EncoderModel

        return [load(CLIPTextModelWithProjection, "text_encoder"), load(CLIPTextModelWithProjection, "text_encoder_2"),
                load(T5EncoderModel, "text_encoder_3")]

    def encode_text(self, text_encoders, ids):
        """As StableDiffusion3Pipeline.encode_prompt does: CLIP-L's and CLIP-G's penultimate states side
        by side, zero-padded to T5's width, then T5's states after them; the two pooled outputs joined."""
        import torch

        clip_states, pooled = [], []
        for k, text_encoder in enumerate(text_encoders[:2]):
            out = text_encoder(ids[:, k], output_hidden_states=True)
            clip_states.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        t5 = text_encoders[2](ids[:, 2])[0]
        clip = torch.cat(clip_states, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5.to(clip.dtype)], dim=-2), torch.cat(pooled, dim=-1)

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "logit_normal"  # diffusers' SD 3 DreamBooth scripts' default
    precondition_outputs = True  # ... and theirs: --precondition_outputs 1

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        return model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=states,
                     pooled_projections=pooled).sample

    def pipeline_kwargs(self):
        return {"max_sequence_length": T5_MAX_LENGTH}  # T5 reads as many tokens as in training

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' SD3 DreamBooth LoRA script writes them."""
        return peft_layers

    # --- export (export.py): Stability's single-file layout (the files with CLIP-L, CLIP-G and T5 in them)
    def single_file_denoiser(self, denoiser):
        return original_transformer(denoiser.state_dict(), denoiser.config.num_layers)

    def single_file_text_encoders(self, weights):
        # (T5's encoder.embed_tokens is its shared embedding, tied; a file holds it under both names, a copy under
        # the second: diffusers' single-file loader fills each from its own key)
        return {f"text_encoders.{name}.transformer.{key}": tensor.clone() if key == "encoder.embed_tokens.weight" else tensor
                for name, encoder in zip(("clip_l", "clip_g", "t5xxl"), weights) for key, tensor in encoder.items()}

    # --- export (export.py): kohya's SD 3 LoRA layout (sd-scripts'), which ComfyUI loads
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (peft names) in the original MMDiT layout:
        lora_unet_joint_blocks_<i>_x_block_attn_qkv (q, k and v joined: family.kohya_lora_tensors), ..._proj,
        ..._context_block_..., lora_te1_/lora_te2_<module> for CLIP-L and CLIP-G."""
        prefixes = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}  # CLIP-L's, CLIP-G's

        def module_of(network, module):
            if network != self.denoiser:
                return layouts.kohya_text_module(prefixes[network], module), None
            original, part = original_module(module)
            return "lora_unet_" + original.replace(".", "_"), part

        def alpha_of(name):
            return alphas.get(next((net for net, prefix in prefixes.items() if name.startswith(prefix)), self.denoiser))

        return family.kohya_lora_tensors(family.group_lora(state_dict, module_of), alpha_of,
                                         lambda name: ("q", "k", "v"))

    # The base models of this family the suite knows by short name (families.KNOWN_MODELS)
    memory_rows = (("SD 3.5 large", "sd35-large", (1024,), (4,)), ("SD 3.5 medium", "sd35-medium", (1024,), ()))
    known_models = (
        known.KnownModel("sd35-medium", "stabilityai/stable-diffusion-3.5-medium", "b940f670f0eda2d07fbb75229e779da1ad11eb80",
                         1024, "flow", 16.3, gated=True),
        known.KnownModel("sd35-large", "stabilityai/stable-diffusion-3.5-large", "ceddf0a7fdf2064ea28e2213e3b84e4afa170a0f",
                         1024, "flow", 27.5, gated=True),
    )


FAMILY = SD3()

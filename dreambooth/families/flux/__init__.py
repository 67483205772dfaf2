"""Flux.1 (dev, schnell): a flow-matching transformer (FluxTransformer2DModel: double-stream then
single-stream blocks) over 16-channel latents packed 2x2 into tokens with their position ids, conditioned
on T5's states and CLIP-L's pooled output. dev is guidance-distilled: its transformer also takes the
guidance value (--guidance_scale, in training too, as diffusers' Flux script); schnell has no guidance
input. Trained on the straight path towards the velocity (objectives.flow_matching) on the scheduler's
sigmas; 1024 px; no safety checker and no negative prompt.
"""

from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import fluxblocks
from dreambooth.families.shared import known

T5_MAX_LENGTH = 512  # T5's tokens, in training and drawing (diffusers' Flux scripts' --max_sequence_length default)


class FluxModels(fluxblocks.FluxBlocksModels):
    block_counts = ("layers", "single_layers")  # (activations.py: each block keeps the same)
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
        clip = builders.clip_text_encoder(CLIPTextModel, spec, tokenizer, "quick_gelu")
        t5 = builders.t5_encoder(arch, builders.tiny_t5_tokenizer(T5_MAX_LENGTH))
        return {"text_encoder": clip, "text_encoder_2": t5}, arch["t5_width"], {"pooled_projection_dim": spec["text_hidden"]}

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import FluxTransformer2DModel

        arch = {**self.changes, **spec}
        return FluxTransformer2DModel(patch_size=1, in_channels=4 * 16, num_layers=arch["layers"],
                                      num_single_layers=arch["single_layers"], attention_head_dim=arch["head_dim"],
                                      num_attention_heads=arch["heads"], joint_attention_dim=text_width,
                                      guidance_embeds=True, axes_dims_rope=arch["rope"], **extra)

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers import FluxPipeline

        # Flux.1 dev's scheduler: its shift grows with the image's token count
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
        return FluxPipeline(tokenizer=tokenizer, tokenizer_2=builders.tiny_t5_tokenizer(T5_MAX_LENGTH),
                            scheduler=scheduler, **nets)


class Flux(fluxblocks.FluxBlocks):
    label = "Flux.1"
    order = 50
    pipeline = "FluxPipeline"
    text_encoders = ("text_encoder", "text_encoder_2")  # CLIP-L (pooled), T5 (states)
    trainable_text_encoders = ("text_encoder",)  # CLIP-L, as diffusers' Flux script: T5 stays frozen
    supports = frozenset({"train", "draw", "export", "export_lora"})
    negative_prompt = False  # dev is guidance-distilled: one prompt, the guidance value instead
    guidance_scale = 3.5  # dev's guidance value (FluxPipeline's and diffusers' Flux script's default)
    guided_training = True  # the guidance value is an input of the transformer in training (dev)
    released_resolutions = (1024,)
    # flux-dev's, for memory.py (tests/unit/test_memory.py counts them on the meta device)
    released_params = {"transformer": 11901.41e6, "text_encoder": 123.06e6, "text_encoder_2": 4762.31e6, "vae": 83.82e6}
    released_size = "flux-dev"  # the own size whose activations memory.py counts for a released model
    random = FluxModels()
    text_tokens = T5_MAX_LENGTH  # the text states' length in training (activations.py)

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

    # --- the denoiser
    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: packed into tokens with their ids, the timestep as a
        fraction of the schedule (the transformer scales it by 1000 itself), the guidance value for dev."""
        import torch

        h, w = noisy.shape[-2:]
        guided = family.config_of(model).guidance_embeds
        guidance = torch.full((noisy.shape[0],), guidance, device=noisy.device) if guided else None
        out = model(hidden_states=fluxblocks.pack(noisy), timestep=timesteps / 1000, guidance=guidance,
                    pooled_projections=pooled, encoder_hidden_states=states,
                    txt_ids=states.new_zeros(states.shape[1], 3), img_ids=fluxblocks.image_ids(h, w, noisy.device, states.dtype),
                    return_dict=False)[0]
        return fluxblocks.unpack(out, h, w)

    def pipeline_kwargs(self):
        return {"max_sequence_length": T5_MAX_LENGTH}

    # The base models of this family the suite knows by short name (families.KNOWN_MODELS)
    memory_rows = (("Flux.1 dev", "flux-dev", (512, 1024), (4, 8)),)
    known_models = (
        # The flow-matching transformers, in the bf16/fp16 files their repositories hold: transformer (Flux 23.8 GB,
        # SD 3.5 large 16.1, medium 4.9), T5-XXL 9.5, CLIP-L 0.25 (+ CLIP-G 1.4 for SD 3.5), VAE 0.2. Their short
        # names are also their --random_model sizes (Flux.1's and SD 3.5's own_sizes): the preflight counts those.
        # The revisions could not be checked from here (no hub access); they are the commits people's hub caches show.
        known.KnownModel("flux-dev", "black-forest-labs/FLUX.1-dev", "3de623fc3c33e44ffbe2bad470d0f45bccf2eb21", 1024,
                         "flow", 33.8, gated=True),
        known.KnownModel("flux-schnell", "black-forest-labs/FLUX.1-schnell", "741f7c3ce8b383c54771c7003378a50191e9efe9", 1024,
                         "flow", 33.8),
    )


FAMILY = Flux()

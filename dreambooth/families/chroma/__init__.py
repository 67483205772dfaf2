"""Chroma (lodestones' Chroma1: Flux.1 schnell's double- and single-stream blocks, 8.9 B, each block's modulation
from one small approximator network instead of CLIP's pooled output): flow matching over Flux.1's 16-channel VAE
latents packed 2x2, conditioned on T5-XXL's states computed with their attention mask, every padding token but
the first masked out in the transformer too; no guidance input, no CLIP. The pipeline draws with
classifier-free guidance 5.0 against a negative prompt (empty by default). diffusers has no Chroma DreamBooth
script: it is trained as diffusers' Flux script trains Flux.1 (a sample of the VAE's posterior,
objectives.flow_matching on the scheduler's sigmas, uniform timesteps), with the pipeline's own conditioning.
The original layout is Flux.1's, so its LoRA exports in Flux.1's kohya names, which ComfyUI reads for Chroma, and a
full model as its transformer in BFL's names, with the approximator's (distilled_guidance_layer) own.
"""

from dreambooth.families.shared import builders
from dreambooth.families.shared import fluxblocks
from dreambooth.families.shared import known
from dreambooth.families.shared import layouts

T5_MAX_LENGTH = 512  # ChromaPipeline's max_sequence_length default


class ChromaModels(fluxblocks.FluxBlocksModels):
    block_counts = ("layers", "single_layers")  # (activations.py: each block keeps the same)
    note = "Chroma's layout: Flux.1's double/single-stream transformer with an approximator for its modulation, " \
           "T5 with its mask, flow matching, 16-channel latents packed 2x2"
    changes = dict(resolution_scale=1, layers=1, single_layers=1, head_dim=16, heads=2, rope=(4, 4, 8), t5_width=32,
                   t5_layers=2, t5_heads=4, approximator_width=32, approximator_layers=1, vae_scaling_factor=0.3611,
                   vae_shift_factor=0.1159)
    # Chroma1's shapes (--random_model chroma), 1024 px: 19 double- and 38 single-stream blocks of 24 heads of 128,
    # an approximator of 5 layers 5120 wide, T5 v1.1 XXL's encoder, Flux.1's VAE
    own_sizes = {"chroma": dict(layers=19, single_layers=38, head_dim=128, heads=24, rope=(16, 56, 56), t5_width=4096,
                                t5_layers=24, t5_heads=64, t5_kv=64, t5_ff=10240, t5_vocab=32128,
                                approximator_width=5120, approximator_layers=5, vae_channels=(128, 256, 512, 512),
                                vae_layers=2, latent_size=128)}

    def text_encoders(self, spec, tokenizer):
        arch = {**self.changes, **spec}
        t5 = builders.t5_encoder(arch, builders.tiny_t5_tokenizer(T5_MAX_LENGTH))
        return {"text_encoder": t5}, arch["t5_width"], {}

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import ChromaTransformer2DModel

        arch = {**self.changes, **spec}
        return ChromaTransformer2DModel(patch_size=1, in_channels=4 * 16, num_layers=arch["layers"],
                                        num_single_layers=arch["single_layers"], attention_head_dim=arch["head_dim"],
                                        num_attention_heads=arch["heads"], joint_attention_dim=text_width,
                                        axes_dims_rope=arch["rope"], approximator_hidden_dim=arch["approximator_width"],
                                        approximator_layers=arch["approximator_layers"])

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import ChromaPipeline
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
        return ChromaPipeline(tokenizer=builders.tiny_t5_tokenizer(T5_MAX_LENGTH), scheduler=scheduler, **nets)


class Chroma(fluxblocks.FluxBlocks):
    label = "Chroma"
    order = 100
    pipeline = "ChromaPipeline"
    text_encoders = ("text_encoder",)  # T5 (its states, with their mask)
    trainable_text_encoders = ()  # T5 stays frozen, as in Flux.1's script
    supports = frozenset({"train", "draw", "export", "export_lora"})
    guidance_scale = 5.0  # ChromaPipeline's default
    released_resolutions = (1024,)
    # Chroma1's transformer, T5-XXL and Flux.1's VAE, counted on the meta device (tests/unit/test_memory.py)
    released_params = {"transformer": 8899.98e6, "text_encoder": 4762.31e6, "vae": 83.82e6}
    released_size = "chroma"
    memory_rows = (("Chroma", "chroma", (512, 1024), (4, 8)),)
    random = ChromaModels()
    # Its base model by short name (families.KNOWN_MODELS), also a --random_model size (own_sizes): Chroma1-HD,
    # 27.5 GB of bf16 safetensors (transformer 17.8, T5-XXL 9.5, VAE 0.2). Apache 2.0, not gated. The revision could not
    # be checked from here (no hub access): it is the commit people's hub caches show.
    known_models = (known.KnownModel("chroma", "lodestones/Chroma1-HD", "0e0c60ece1e82b17cb7f77342d765ba5024c40c0", 1024,
                                     "flow", 27.5),)
    text_tokens = T5_MAX_LENGTH  # the text states' length in training (activations.py)

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import ChromaTransformer2DModel

        return load(ChromaTransformer2DModel, self.denoiser)

    def load_tokenizers(self, model_dir):
        from transformers import T5TokenizerFast

        return [T5TokenizerFast.from_pretrained(model_dir, subfolder="tokenizer", model_max_length=T5_MAX_LENGTH)]

    def load_text_encoders(self, model_dir, load):
        from transformers import T5EncoderModel

        return [load(T5EncoderModel, "text_encoder")]

    def token_ids(self, tokenizers, prompt):
        """(2, T5_MAX_LENGTH): the prompt's T5 ids and their attention mask, as ChromaPipeline tokenizes it."""
        import numpy as np

        tokens = tokenizers[0](prompt, max_length=T5_MAX_LENGTH, padding="max_length", truncation=True,
                               return_tensors="np")
        return np.stack([tokens.input_ids[0], tokens.attention_mask[0]]).astype(np.int64)

    def encode_text(self, text_encoders, ids):
        """As ChromaPipeline.encode_prompt does: T5's states with the prompt's mask, and in the place of a pooled
        embedding the transformer's text mask: the prompt's tokens and the first padding token (in the states'
        dtype, as the pipeline makes it)."""
        import torch

        input_ids, mask = ids[:, 0], ids[:, 1]
        states = text_encoders[0](input_ids, attention_mask=mask)[0]
        lengths = mask.sum(dim=1)
        keep = torch.arange(mask.shape[1], device=mask.device)[None] <= lengths[:, None]
        return states, keep.to(states.dtype)

    def meta_side_input(self, denoiser_config, tensor_options):
        return None  # (no mask: every text token is read)

    def pipeline_text(self, states, side, negative, negative_side):
        return dict(prompt_embeds=states, prompt_attention_mask=side, negative_prompt_embeds=negative,
                    negative_prompt_attention_mask=negative_side)

    # --- the denoiser (Flux.1's blocks' LoRA layers, Flux.1's script's objective and kohya layout: ComfyUI reads
    # Chroma's LoRA in Flux.1's names)

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: packed into tokens with their ids as Flux.1's, the text mask
        (pooled: encode_text's; None: every token) extended over the image tokens as the pipeline extends it."""
        import torch

        h, w = noisy.shape[-2:]
        tokens = fluxblocks.pack(noisy)
        mask = None
        if pooled is not None:
            mask = torch.cat([pooled, torch.ones(tokens.shape[:2], device=noisy.device, dtype=torch.bool)], dim=1)
        out = model(hidden_states=tokens, timestep=timesteps / 1000, encoder_hidden_states=states,
                    txt_ids=states.new_zeros(states.shape[1], 3),
                    img_ids=fluxblocks.image_ids(h, w, noisy.device, states.dtype), attention_mask=mask,
                    return_dict=False)[0]
        return fluxblocks.unpack(out, h, w)

    def pipeline_kwargs(self):
        return {"max_sequence_length": T5_MAX_LENGTH}

    # --- export (export.py): BFL's names (fluxblocks.bfl_name) and the approximator's own
    def original_name(self, key):
        """The approximator's layers and norms (a scale there) by its original names, the rest by Flux.1's."""
        if key.startswith("distilled_guidance_layer."):
            name = layouts.replaced(key, ((".linear_1.", ".in_layer."), (".linear_2.", ".out_layer.")))
            return (name.removesuffix(".weight") + ".scale" if ".norms." in name else name), None
        return fluxblocks.bfl_name(key)


FAMILY = Chroma()

"""Qwen-Image: a flow-matching MMDiT (QwenImageTransformer2DModel: 60 dual-stream blocks) over 16-channel
latents of its own VAE (AutoencoderKLQwenImage, a causal video VAE drawn one frame at a time, normalised by
per-channel means and deviations), packed 2x2 into tokens, conditioned on the last hidden states of
Qwen2.5-VL-7B read through a chat template whose first 34 tokens are dropped, with their attention mask (the
prompt states are as long as the longest prompt, not padded to a fixed length). Classifier-free guidance is
the pipeline's true_cfg_scale against a negative prompt. The text encoder is never trained: its states are
computed once and it leaves the device, as Flux.1's T5 does. Trained as diffusers'
train_dreambooth_lora_qwen_image.py trains it (objectives.flow_matching on the scheduler's unshifted sigmas).
"""

from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import fluxblocks
from dreambooth.families.shared import known
from dreambooth.families.shared import qwenvae

# QwenImagePipeline's prompt template and the count of its tokens the pipeline drops (prompt_template_encode,
# prompt_template_encode_start_idx), and its longest prompt (tokenizer_max_length): tests/unit/test_family_qwen.py
# checks them against a pipeline's own
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
DROP = 34
MAX_TOKENS = 1024
DEFAULT_SAMPLE_SIZE = 128  # QwenImagePipeline's latent size when none is given (1024 px with its VAE)


class QwenImageModels(builders.RandomModels):
    block_counts = ("layers",)  # (activations.py: each block keeps the same)
    note = "Qwen-Image's layout: a dual-stream transformer, a Qwen2.5-VL text encoder, flow matching, " \
                  "16-channel latents of its video VAE packed 2x2"
    # tiny: 64 px (16 x 16 latents of a 4x VAE), one block of 2 heads of 16, a 2-layer Qwen2.5-VL 32 wide
    changes = dict(resolution_scale=0.5, layers=1, head_dim=16, heads=2, rope=(4, 6, 6), text_kv_heads=2,
                       vae_base=16, vae_mult=(1, 2, 2), vae_time_down=(False, False), vision_width=32)
    # Qwen-Image's shapes (--random_model qwen-image), 1024 px: 60 blocks of 24 heads of 128 reading Qwen2.5-VL-7B
    # (28 layers 3584 wide, its 32-block vision tower too: the pipeline loads the whole model), the video VAE
    own_sizes = {"qwen-image": dict(layers=60, head_dim=128, heads=24, rope=(16, 56, 56), text_hidden=3584,
                                    text_layers=28, text_heads=28, text_kv_heads=4, text_ff=18944, text_vocab=152064,
                                    mrope=[16, 24, 24], vision_width=1280, vision_depth=32, vision_heads=16,
                                    vision_ff=3420, vision_full=(7, 15, 23, 31), vae_base=96, vae_mult=(1, 2, 4, 4),
                                    vae_layers=2, vae_time_down=(False, True, True), latent_size=256)}

    def text_encoders(self, spec, tokenizer):
        from transformers import Qwen2_5_VLConfig
        from transformers import Qwen2_5_VLForConditionalGeneration

        arch = {**self.changes, **spec}
        qwen_tokenizer = builders.tiny_byte_tokenizer()
        width, heads = arch["text_hidden"], arch["text_heads"]
        half = width // heads // 2  # the multimodal rotary sections (time, height, width) of a head's half
        sections = arch.get("mrope", [half - 2 * (half // 3), half // 3, half // 3])
        text = dict(vocab_size=arch.get("text_vocab", len(qwen_tokenizer)), hidden_size=width,
                    intermediate_size=arch.get("text_ff", 2 * width), num_hidden_layers=arch["text_layers"],
                    num_attention_heads=heads, num_key_value_heads=arch["text_kv_heads"],
                    max_position_embeddings=2 * (MAX_TOKENS + DROP),
                    rope_scaling={"type": "mrope", "mrope_section": sections},
                    bos_token_id=None, eos_token_id=qwen_tokenizer.eos_token_id,
                    pad_token_id=qwen_tokenizer.pad_token_id)
        vision_width = arch["vision_width"]
        vision = dict(depth=arch.get("vision_depth", 1), hidden_size=vision_width,
                      intermediate_size=arch.get("vision_ff", 2 * vision_width), num_heads=arch.get("vision_heads", 2),
                      out_hidden_size=width, fullatt_block_indexes=list(arch.get("vision_full", (0,))))
        encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))
        return {"text_encoder": encoder}, width, {}

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import QwenImageTransformer2DModel

        arch = {**self.changes, **spec}
        model = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * 16, out_channels=16, num_layers=arch["layers"],
                                            attention_head_dim=arch["head_dim"], num_attention_heads=arch["heads"],
                                            joint_attention_dim=text_width, axes_dims_rope=arch["rope"])
        if latent_size != DEFAULT_SAMPLE_SIZE:
            model.register_to_config(sample_size=latent_size)  # (its native size: native_resolution)
        return model

    def vae(self, spec, latent_size):
        return qwenvae.random_vae({**self.changes, **spec})

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers import QwenImagePipeline

        # Qwen-Image's scheduler: an exponential shift that grows with the image's token count
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192,
                                                    shift_terminal=0.02, time_shift_type="exponential")
        return QwenImagePipeline(tokenizer=builders.tiny_byte_tokenizer(), scheduler=scheduler, **nets)


class QwenImage(qwenvae.MaskedPrompts, qwenvae.QwenVideoVAE):
    label = "Qwen-Image"
    order = 60
    trimmed_text = True  # (its states as long as the longest prompt, with their mask)
    pipeline = "QwenImagePipeline"
    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' Qwen-Image DreamBooth LoRA script's default layers: the image stream's attention
    denoiser_lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    text_encoders = ("text_encoder",)  # Qwen2.5-VL-7B (its last hidden states)
    trainable_text_encoders = ()  # frozen, as in diffusers' script
    supports = frozenset({"train", "draw", "export", "export_lora"})
    denoiser_file = True  # (its transformer alone: ComfyUI's Qwen-Image files)
    guidance_scale = 4.0  # QwenImagePipeline's true_cfg_scale default
    guidance_argument = "true_cfg_scale"
    default_negative_prompt = " "  # the pipeline guides only against a negative prompt (its model card's: " ")
    released_resolutions = (1024,)  # (the pipeline's default; its model card also draws 1328 px squares)
    random = QwenImageModels()
    # (its native size and the VAE, one frame normalised per channel: qwenvae.QwenVideoVAE; the prompts' mask:
    # qwenvae.MaskedPrompts)
    default_sample_size = DEFAULT_SAMPLE_SIZE
    text_tokens = 128  # the text states' length in training for activations.py: a prompt's, not padded to 1024
    # Qwen-Image's 20 B transformer, Qwen2.5-VL-7B (8.3 B with its vision tower) and the 127 M video VAE, counted
    # on the meta device (tests/unit/test_memory.py)
    released_params = {"transformer": 20430.40e6, "text_encoder": 8292.17e6, "vae": 126.89e6}
    released_size = "qwen-image"
    memory_rows = (("Qwen-Image", "qwen-image", (512, 1024), (4, 8)),)
    # Its base model by short name (families.KNOWN_MODELS), also a --random_model size (own_sizes): 57.7 GB of bf16
    # safetensors (transformer 40.9, Qwen2.5-VL 16.6, VAE 0.25). Not gated (Apache 2.0). The revision could not be
    # checked from here (no hub access): it is the commit people's hub caches show.
    known_models = (known.KnownModel("qwen-image", "Qwen/Qwen-Image", "75e0b4be04f60ec59a75f475837eced720f823b6", 1024,
                                     "flow", 57.7),)

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import QwenImageTransformer2DModel

        return load(QwenImageTransformer2DModel, self.denoiser)

    def load_tokenizers(self, model_dir):
        from transformers import Qwen2TokenizerFast

        return [Qwen2TokenizerFast.from_pretrained(model_dir, subfolder="tokenizer")]

    def load_text_encoders(self, model_dir, load):
        from transformers import Qwen2_5_VLForConditionalGeneration

        return [load(Qwen2_5_VLForConditionalGeneration, "text_encoder")]

    def token_ids(self, tokenizers, prompt):
        """(2, DROP + MAX_TOKENS): the templated prompt's ids and attention mask, as QwenImagePipeline tokenizes
        it (padded to the longest a prompt may be, so that every prompt's ids stack)."""
        import numpy as np

        tokens = tokenizers[0](TEMPLATE.format(prompt), max_length=MAX_TOKENS + DROP, padding="max_length",
                               truncation=True, return_tensors="np")
        return np.stack([tokens.input_ids[0], tokens.attention_mask[0]]).astype(np.int64)

    def encode_text(self, text_encoders, ids):
        """As QwenImagePipeline.encode_prompt does: the last hidden states of the prompt's own tokens after the
        template's first DROP, zero-padded to the longest of these prompts, and their mask (N, L) in the place
        of a pooled embedding. ids: (N, 2, DROP + MAX_TOKENS) of token_ids."""
        import torch

        input_ids, mask = ids[:, 0], ids[:, 1]
        states = text_encoders[0](input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        lengths = mask.sum(dim=1) - DROP
        length = int(lengths.max())
        keep = torch.arange(length, device=ids.device) < lengths[:, None]
        # (right-padded: each prompt's tokens are its first ones)
        return states[:, DROP:DROP + length] * keep[..., None].to(states.dtype), keep.long()

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "none"  # diffusers' Qwen-Image DreamBooth script's default: uniform

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: packed 2x2 into tokens, the timestep as a fraction of the
        schedule, the prompt states with their mask (pooled: encode_text's mask)."""
        h, w = noisy.shape[-2:]
        out = model(hidden_states=fluxblocks.pack(noisy), encoder_hidden_states=states,
                    encoder_hidden_states_mask=pooled, timestep=timesteps / 1000,
                    img_shapes=[(1, h // 2, w // 2)] * noisy.shape[0], return_dict=False)[0]
        return fluxblocks.unpack(out, h, w)

    def unpack_latents(self, pipe, latents, height, width):
        """The pipeline's latent output is packed tokens: back to (B, C, h, w) (its own unpacking adds a frame)."""
        return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)[:, :, 0]

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' Qwen-Image DreamBooth LoRA script writes them."""
        return peft_layers

    # --- export (export.py): kohya's layout of a Qwen-Image LoRA (musubi-tuner's, which ComfyUI and diffusers load)
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (peft names, lora_A/lora_B): lora_unet_ and the transformer
        module's name with its dots as underscores (Qwen-Image's original layout is diffusers' own: no layer is
        fused), lora_down/lora_up and the alpha (its text encoder is frozen: denoiser adapters alone)."""
        return family.denoiser_kohya_lora(self, state_dict, alphas)

    def single_file_denoiser(self, denoiser):
        """The transformer's own names: Qwen-Image's original layout is diffusers' (diffusers' single-file reader
        keeps every name)."""
        return dict(denoiser.state_dict())



FAMILY = QwenImage()

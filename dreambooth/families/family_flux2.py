"""FLUX.2 [klein] (4B and 9B; base and step-distilled): a flow-matching transformer (Flux2Transformer2DModel:
double-stream then single-stream blocks with 4-axis position ids) over the latents of its own VAE
(AutoencoderKLFlux2: 32 channels, each 2x2 patch folded into 128 channels and normalised by the VAE's batch-norm
statistics), one token a latent pixel, conditioned on three hidden layers of a Qwen3 text encoder read through
its chat template, side by side (every prompt padded to 512 tokens). No guidance input: the base models draw
with classifier-free guidance against the empty prompt (guidance_scale 4.0); the distilled ones ignore it. The
text encoder is never trained: its states are computed once and it leaves the device, as Flux.1's T5 does.
Trained as diffusers' train_dreambooth_lora_flux2_klein.py trains it: the VAE's mode, not a sample, as the
clean latents; objectives.flow_matching on the scheduler's sigmas; uniform timesteps by default.
"""

from dreambooth.families import builders
from dreambooth.families import family
from dreambooth.families import family_qwen
from dreambooth.families import known

MAX_TOKENS = 512  # Flux2KleinPipeline's max_sequence_length default, and diffusers' klein script's
OUT_LAYERS = (9, 18, 27)  # the text encoder's hidden states the pipeline stacks (its text_encoder_out_layers)
# Qwen3's chat template as the pipeline applies it (one user message, the reply's start, thinking off), for the
# tiny tokenizer built here; a released model's tokenizer brings its own
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def tiny_tokenizer():
    """Qwen-Image's tiny byte-level tokenizer (family_qwen.tiny_tokenizer) with Qwen3's chat template."""
    tokenizer = family_qwen.tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def tokens_of(latents):
    """(B, C, h, w) latents -> (B, h x w, C) tokens, one a latent pixel (Flux2KleinPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


class Flux2Models(builders.RandomModels):
    arch = "flux2"
    note = "FLUX.2 [klein]'s layout: a double/single-stream transformer, a Qwen3 text encoder read at three layers, " \
           "flow matching, 32-channel latents folded 2x2"
    # tiny: 64 px; a Qwen3 32 wide of 28 layers (text_depth: the pipeline reads layers 9, 18 and 27); the VAE's batch-norm
    # statistics drawn (a fresh one's are 0 and 1: the normalisation would go untested)
    changes = dict(resolution_scale=1, layers=1, single_layers=1, head_dim=16, heads=2, rope=(4, 4, 4, 4),
                   text_depth=28, text_kv_heads=2, text_head_dim=16, vae_latents=8)
    # FLUX.2 [klein] 4B's and 9B's shapes (--random_model flux2-klein-4b|flux2-klein-9b), 1024 px: 5 + 20 and
    # 8 + 24 blocks of 24 and 32 heads of 128 reading Qwen3-4B's and Qwen3-8B's layers 9, 18, 27 (3 x 2560 and
    # 3 x 4096 wide), the VAE of 32 latent channels
    _vae = dict(vae_channels=(128, 256, 512, 512), vae_layers=2, vae_latents=32, latent_size=128)
    guidance_embeds = False  # the transformer's guidance input ([dev]'s, guidance-distilled)
    own_sizes = {
        "flux2-klein-4b": dict(_vae, layers=5, single_layers=20, head_dim=128, heads=24, rope=(32, 32, 32, 32),
                               text_hidden=2560, text_depth=36, text_heads=32, text_kv_heads=8, text_head_dim=128,
                               text_ff=9728, text_vocab=151936, text_tied=True),
        "flux2-klein-9b": dict(_vae, layers=8, single_layers=24, head_dim=128, heads=32, rope=(32, 32, 32, 32),
                               text_hidden=4096, text_depth=36, text_heads=32, text_kv_heads=8, text_head_dim=128,
                               text_ff=12288, text_vocab=151936, text_tied=False)}

    def text_encoders(self, spec, tokenizer):
        from transformers import Qwen3Config
        from transformers import Qwen3ForCausalLM

        arch = {**self.changes, **spec}
        qwen_tokenizer = tiny_tokenizer()
        width = arch["text_hidden"]
        config = Qwen3Config(vocab_size=arch.get("text_vocab", len(qwen_tokenizer)), hidden_size=width,
                             intermediate_size=arch.get("text_ff", 2 * width), num_hidden_layers=arch["text_depth"],
                             num_attention_heads=arch["text_heads"], num_key_value_heads=arch["text_kv_heads"],
                             head_dim=arch["text_head_dim"], max_position_embeddings=2 * MAX_TOKENS,
                             tie_word_embeddings=arch.get("text_tied", True), bos_token_id=None,
                             eos_token_id=qwen_tokenizer.eos_token_id, pad_token_id=qwen_tokenizer.pad_token_id)
        return {"text_encoder": Qwen3ForCausalLM(config)}, len(OUT_LAYERS) * width, {}

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import Flux2Transformer2DModel

        arch = {**self.changes, **spec}
        return Flux2Transformer2DModel(patch_size=1, in_channels=4 * arch["vae_latents"], num_layers=arch["layers"],
                                       num_single_layers=arch["single_layers"], attention_head_dim=arch["head_dim"],
                                       num_attention_heads=arch["heads"], joint_attention_dim=text_width,
                                       axes_dims_rope=arch["rope"], guidance_embeds=self.guidance_embeds)

    def vae(self, spec, latent_size):
        import torch
        from diffusers import AutoencoderKLFlux2

        arch = {**self.changes, **spec}
        blocks = len(arch["vae_channels"])
        vae = AutoencoderKLFlux2(block_out_channels=arch["vae_channels"], layers_per_block=arch["vae_layers"],
                                 down_block_types=("DownEncoderBlock2D",) * blocks,
                                 up_block_types=("UpDecoderBlock2D",) * blocks, latent_channels=arch["vae_latents"],
                                 sample_size=latent_size * 2 ** (blocks - 1))
        if vae.bn.running_mean.device.type != "meta":
            with torch.no_grad():
                vae.bn.running_mean.normal_(0.0, 0.5)
                vae.bn.running_var.uniform_(0.5, 2.0)
        return vae

    @staticmethod
    def scheduler():
        """The released models' scheduler ([klein]'s base models' and [dev]'s, Flux.1 dev's): the pipeline shifts it
        by the image's token count."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                               base_image_seq_len=256, max_image_seq_len=4096)

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import Flux2KleinPipeline

        return Flux2KleinPipeline(tokenizer=tiny_tokenizer(), scheduler=self.scheduler(), is_distilled=False, **nets)


class Flux2Klein(family.Family):
    name, label = "flux2", "FLUX.2 [klein]"
    pipeline = "Flux2KleinPipeline"
    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' klein DreamBooth LoRA script's layers: the double blocks' attention projections, the single blocks'
    # fused qkv-and-MLP input and their output (as a regular expression: the double blocks' to_out is a list)
    denoiser_lora_targets = (r".*\.(to_k|to_q|to_v|to_out\.0|to_qkv_mlp_proj)"
                             r"|.*single_transformer_blocks\.\d+\.attn\.to_out")
    text_encoders = ("text_encoder",)  # Qwen3 (three of its hidden layers)
    trainable_text_encoders = ()  # frozen, as in diffusers' script
    supports = frozenset({"train", "draw"})  # (not yet: an export layout of its own)
    negative_prompt = False  # the pipeline guides against the empty prompt only
    guidance_scale = 4.0  # Flux2KleinPipeline's default (the base models'; the distilled ones ignore it)
    released_resolutions = (1024,)
    # FLUX.2 [klein] 9B's transformer, Qwen3-8B and the VAE, counted on the meta device (tests/unit/test_memory.py); the
    # 4B's: 3875.54 M, Qwen3-4B 4022.47 M
    released_params = {"transformer": 9078.58e6, "text_encoder": 8190.74e6, "vae": 84.05e6}
    released_size = "flux2-klein-9b"
    memory_rows = (("FLUX.2 [klein] 4B", "flux2-klein-4b", (512, 1024), (4,)),
                   ("FLUX.2 [klein] 9B", "flux2-klein-9b", (512, 1024), (4, 8)))
    random = Flux2Models()
    # Its base models by short name (families.KNOWN_MODELS), also --random_model sizes (own_sizes): the undistilled
    # [klein] base models, the ones diffusers' klein script and the trainers fine-tune (the step-distilled FLUX.2-klein-4B
    # and -9B are for drawing), in bf16 safetensors: 4B 16.0 GB (transformer 7.8, Qwen3-4B 8.0, VAE 0.2), 9B 34.7 GB
    # (transformer 18.2, Qwen3-8B 16.4). The 4B is Apache 2.0; the 9B is under the FLUX non-commercial license, served
    # to accounts that accepted it. The revisions could not be checked from here (no hub access): they are the
    # commits people's hub caches show (models--black-forest-labs--FLUX.2-klein-base-*/snapshots/<commit>).
    known_models = (
        known.KnownModel("flux2-klein-4b", "black-forest-labs/FLUX.2-klein-base-4B",
                         "a3b4f4849157f664bdbc776fd7453c2783562f4d", 1024, "flow", 16.0),
        known.KnownModel("flux2-klein-9b", "black-forest-labs/FLUX.2-klein-base-9B",
                         "17c3b160520b7dd44665dbf0b9ed9dd30c15cd06", 1024, "flow", 34.7, gated=True),
    )
    text_tokens = MAX_TOKENS  # the text states' length in training (activations.py)
    out_layers = OUT_LAYERS  # the text encoder's hidden states read, side by side

    def native_resolution(self, model_dir):
        """The pipeline's default size (128 latent pixels x the VAE's downscaling: 1024 px); a random model built
        here says its own in its VAE's sample size."""
        return family.part_config(model_dir, "vae")["sample_size"]

    def size_multiple(self, model_dir):
        return self.vae_scale(model_dir)

    # --- the VAE: 2x2 patches folded into channels, normalised by its batch-norm statistics
    def vae_class(self):
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2

    def vae_downscale(self, vae_config):
        return 2 ** len(vae_config["block_out_channels"])  # (the VAE's, then the 2x2 fold)

    def latent_channels(self, vae_config):
        return 4 * vae_config["latent_channels"]

    def latent_posterior(self, vae, pixels):
        """The posterior with its variance at the floor, so that a sample is the mode (what diffusers' script and
        the pipeline encode): its log-variance halves set to the lowest value diffusers keeps (-30)."""
        import torch
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        mean = vae.encode(pixels.to(vae.dtype)).latent_dist.mean
        return DiagonalGaussianDistribution(torch.cat([mean, torch.full_like(mean, -30.0)], dim=1))

    def scale_latents(self, vae, latents):
        from diffusers import Flux2KleinPipeline

        mean, std = self._latent_stats(vae, latents)
        return (Flux2KleinPipeline._patchify_latents(latents) - mean) / std

    def decode_latents(self, vae, latents):
        from diffusers import Flux2KleinPipeline

        mean, std = self._latent_stats(vae, latents)
        return vae.decode(Flux2KleinPipeline._unpatchify_latents(latents * std + mean).to(vae.dtype)).sample

    @staticmethod
    def _latent_stats(vae, latents):
        import torch

        options = dict(device=latents.device, dtype=latents.dtype)
        return (vae.bn.running_mean.view(1, -1, 1, 1).to(**options),
                torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(**options))

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import Flux2Transformer2DModel

        return load(Flux2Transformer2DModel, self.denoiser)

    def load_tokenizers(self, model_dir):
        from transformers import Qwen2TokenizerFast

        return [Qwen2TokenizerFast.from_pretrained(model_dir, subfolder="tokenizer")]

    def load_text_encoders(self, model_dir, load):
        from transformers import Qwen3ForCausalLM

        return [load(Qwen3ForCausalLM, "text_encoder")]

    def token_ids(self, tokenizers, prompt):
        """(2, MAX_TOKENS): the prompt's ids through the tokenizer's chat template and their attention mask, as
        Flux2KleinPipeline tokenizes it."""
        import numpy as np

        tokenizer = tokenizers[0]
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        tokens = tokenizer(text, max_length=MAX_TOKENS, padding="max_length", truncation=True, return_tensors="np")
        return np.stack([tokens.input_ids[0], tokens.attention_mask[0]]).astype(np.int64)

    def encode_text(self, text_encoders, ids):
        """As Flux2KleinPipeline.encode_prompt does: hidden layers out_layers side by side, (N, 512, 3D), every
        token's (the padding's too: the transformer reads them all); no pooled embedding."""
        import torch

        out = text_encoders[0](input_ids=ids[:, 0], attention_mask=ids[:, 1], output_hidden_states=True,
                               use_cache=False)
        states = torch.stack([out.hidden_states[k] for k in self.out_layers], dim=2)  # (N, L, 3, D)
        return states.flatten(2), None

    def meta_side_input(self, denoiser_config, tensor_options):
        return None

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "none"  # diffusers' klein DreamBooth script's default: uniform

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: a token a latent pixel with its (0, row, column, 0) ids, the
        text tokens with theirs (0, 0, 0, position), the timestep as a fraction of the schedule; the guidance value
        for a guidance-distilled transformer (FLUX.2 dev's), none for [klein]'s."""
        import torch
        from diffusers import Flux2KleinPipeline

        b, c, h, w = noisy.shape
        tokens = tokens_of(noisy)
        if family.config_of(model).guidance_embeds:
            guidance = torch.full((b,), self.guidance(guidance), device=noisy.device)  # (None: the family's)
        else:
            guidance = None
        out = model(hidden_states=tokens, timestep=timesteps / 1000, guidance=guidance, encoder_hidden_states=states,
                    txt_ids=Flux2KleinPipeline._prepare_text_ids(states).to(noisy.device),
                    img_ids=Flux2KleinPipeline._prepare_latent_ids(noisy).to(noisy.device), return_dict=False)[0]
        return out[:, :tokens.shape[1]].permute(0, 2, 1).reshape(b, c, h, w)

    def pipeline_text(self, states, side, negative, negative_side):
        return dict(prompt_embeds=states, negative_prompt_embeds=negative)

    def pipeline_kwargs(self):
        return {"max_sequence_length": MAX_TOKENS, "text_encoder_out_layers": self.out_layers}

    def unpack_latents(self, pipe, latents, height, width):
        """The pipeline's latent output is the VAE's own (its normalisation and fold undone): as the denoiser makes
        them again."""
        return self.scale_latents(pipe.vae, latents)

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' klein DreamBooth LoRA script writes them."""
        return peft_layers


FAMILY = Flux2Klein()

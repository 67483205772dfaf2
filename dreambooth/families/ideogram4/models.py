"""Ideogram 4's random models (cache_model.py --tiny/--random_model --arch ideogram4): the real diffusers and
transformers classes at the tiny widths or the released shapes, with the pipeline's second, unconditional
transformer."""

from dreambooth.families.shared import builders
from dreambooth.families.shared import flux2base

MAX_TOKENS = 2048  # Ideogram4Pipeline's max_sequence_length default, and diffusers' script's: a prompt's most tokens
PATCH = 2  # the pipeline's patch_size: 2x2 latent pixels a token


# A chat template for the tiny tokenizer built here: Qwen3-VL's layout for a user message of text parts (the
# released tokenizer brings Qwen3-VL's own)
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer():
    """The tiny byte-level tokenizer (builders.tiny_byte_tokenizer) with the template above."""
    tokenizer = builders.tiny_byte_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


class Ideogram4Models(builders.RandomModels):
    block_counts = ("layers",)  # (activations.py: each block keeps the same)
    note = "Ideogram 4's layout: a single-stream transformer over packed text and 2x2 image tokens, a Qwen3-VL " \
           "text encoder read at 13 layers, FLUX.2's VAE, flow matching"
    # tiny: 64 px (an 8x VAE of 8-wide blocks: 4 x 4 tokens), one block of 2 heads of 16, a Qwen3-VL of 36 layers 16
    # wide (the pipeline reads layers up to 35) with a one-block vision tower. (Names of their own: MODEL_SIZES'
    # text and VAE widths would override them.)
    changes = dict(resolution_scale=0.25, layers=1, head_dim=16, heads=2, ff=64, adaln=16, rope=(4, 2, 2),
                   te_width=16, te_depth=36, te_heads=2, te_kv_heads=1, te_head_dim=8, te_ff=32, te_rope=(2, 1, 1),
                   vision_width=16, vision_depth=1, vision_heads=2, vision_ff=32, vision_positions=16,
                   vision_deepstack=(), vae_widths=(8, 8, 8, 8), vae_depth=1, vae_groups=4, vae_latents=8)
    # Ideogram 4's shapes (--random_model ideogram-4), 1024 px (latent_size: the VAE's 128 latent pixels, / 0.25):
    # Ideogram4Transformer2DModel's defaults, its released config (34 blocks of 18 heads of 256, SwiGLU 12288, AdaLN
    # 512, MRoPE sections 24, 20, 20), reading Qwen3-VL-8B (36 layers 4096 wide, 32 heads and 8 KV heads of 128, MLP
    # 12288, interleaved MRoPE 24, 20, 20; its 27-block vision tower too: the pipeline loads Qwen3VLModel whole),
    # FLUX.2's VAE
    own_sizes = {"ideogram-4": dict(layers=34, head_dim=256, heads=18, ff=12288, adaln=512, rope=(24, 20, 20),
                                    te_width=4096, te_depth=36, te_heads=32, te_kv_heads=8, te_head_dim=128,
                                    te_ff=12288, te_rope=(24, 20, 20), te_vocab=151936, vision_width=1152,
                                    vision_depth=27, vision_heads=16, vision_ff=4304, vision_positions=2304,
                                    vision_deepstack=(8, 16, 24), vae_widths=(128, 256, 512, 512), vae_depth=2,
                                    vae_groups=32, vae_latents=32, latent_size=512)}

    def text_encoders(self, spec, tokenizer):
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS
        from transformers import Qwen3VLConfig
        from transformers import Qwen3VLModel

        arch = {**self.changes, **spec}
        qwen_tokenizer = tiny_tokenizer()
        width = arch["te_width"]
        text = dict(vocab_size=arch.get("te_vocab", len(qwen_tokenizer)), hidden_size=width,
                    intermediate_size=arch["te_ff"], num_hidden_layers=arch["te_depth"],
                    num_attention_heads=arch["te_heads"], num_key_value_heads=arch["te_kv_heads"],
                    head_dim=arch["te_head_dim"], max_position_embeddings=2 * MAX_TOKENS,
                    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
                                     "mrope_section": list(arch["te_rope"])},
                    pad_token_id=qwen_tokenizer.pad_token_id)
        vision = dict(depth=arch["vision_depth"], hidden_size=arch["vision_width"], intermediate_size=arch["vision_ff"],
                      num_heads=arch["vision_heads"], out_hidden_size=width,
                      num_position_embeddings=arch["vision_positions"],
                      deepstack_visual_indexes=list(arch["vision_deepstack"]))
        encoder = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision))
        return {"text_encoder": encoder}, len(QWEN3_VL_ACTIVATION_LAYERS) * width, {}

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import Ideogram4Transformer2DModel

        arch = {**self.changes, **spec}
        return Ideogram4Transformer2DModel(in_channels=PATCH * PATCH * arch["vae_latents"], num_layers=arch["layers"],
                                           attention_head_dim=arch["head_dim"], num_attention_heads=arch["heads"],
                                           intermediate_size=arch["ff"], adaln_dim=arch["adaln"],
                                           llm_features_dim=text_width, mrope_section=tuple(arch["rope"]))

    def vae(self, spec, latent_size):
        """FLUX.2's VAE (flux2base.random_vae: its batch-norm statistics drawn), of its own group count."""
        arch = {**self.changes, **spec}
        return flux2base.random_vae(arch["vae_widths"], arch["vae_depth"], arch["vae_latents"], latent_size,
                                    norm_num_groups=arch["vae_groups"])

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        """Ideogram4Pipeline with a second transformer of the same shape, random too, as its unconditional one, and
        a plain flow-matching scheduler (the pipeline sets its own sigmas: no shift)."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers import Ideogram4Pipeline
        from diffusers import Ideogram4Transformer2DModel

        unconditional = Ideogram4Transformer2DModel.from_config(nets["transformer"].config)
        return Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), tokenizer=tiny_tokenizer(),
                                 unconditional_transformer=unconditional, **nets)

"""FLUX.2 [dev]: FLUX.2 [klein]'s transformer at 32 B parameters, over the same VAE, with a guidance input
(guidance-distilled, as Flux.1 dev: one prompt and the guidance value, no negative prompt), conditioned on three
hidden layers (10, 20, 30) of Mistral Small 3.1 (Mistral3ForConditionalGeneration, 24 B) read through its chat
template with the pipeline's system message. Everything else is the FLUX.2 base's (flux2base.py): the latents, the token layout, the
objective. Trained as diffusers' train_dreambooth_lora_flux2.py trains it: the guidance value is an input in
training too (--guidance_scale; that script's default is 3.5, the pipeline draws at 4.0, and one value serves both
here: 4.0 unless given).

Its tokenizer folder is a PixtralProcessor (what the pipeline and diffusers' script load, through AutoProcessor),
which transformers builds only with torchvision installed: the released model needs it (said in one line before
a run starts); the tiny model built here saves a plain tokenizer, which AutoProcessor returns as it is.
"""

from dreambooth import errors
from dreambooth.families.shared import builders
from dreambooth.families.shared import flux2base
from dreambooth.families.shared import known

OUT_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers default, and diffusers' script's
# Flux2Pipeline's SYSTEM_MESSAGE (diffusers/pipelines/flux2/system_messages.py), the text every prompt follows
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")
# A chat template for the tiny tokenizer built here, reading each message's text parts (the released tokenizer
# brings Mistral's own)
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] }}]{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endif %}[/{{ message['role'] }}]{% endfor %}")
TORCHVISION_LINE = ("FLUX.2 [dev]'s tokenizer (transformers' PixtralProcessor, as diffusers loads it) needs torchvision: "
                    "pip install torchvision==0.28.0 (the release for torch 2.13; a CPU machine: "
                    "--index-url https://download.pytorch.org/whl/cpu)")


def tiny_tokenizer():
    """Qwen-Image's tiny byte-level tokenizer with the template above and Pixtral's image token ([IMG], which
    the pipeline strips from prompts)."""
    tokenizer = builders.tiny_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "[IMG]"]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def messages_of(prompt):
    """The conversation the pipeline templates for a prompt: its system message, then the prompt as the user's
    one text part, any [IMG] taken out (Flux2Pipeline's format_input)."""
    return [{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
            {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]}]


class Flux2DevModels(flux2base.Flux2Models):
    note = "FLUX.2 [dev]'s layout: [klein]'s transformer with a guidance input, a Mistral 3 text encoder read at " \
           "three layers"
    # tiny: as [klein]'s, with a Mistral 3 of 30 layers 32 wide (layers 10, 20 and 30 read) and a 1-layer vision tower
    changes = dict(flux2base.TINY, text_depth=30, text_kv_heads=1, vision_width=16)
    guidance_embeds = True
    # FLUX.2 [dev]'s shapes (--random_model flux2-dev), 1024 px: 8 + 48 blocks of 48 heads of 128 (diffusers'
    # Flux2Transformer2DModel defaults) reading Mistral Small 3.1's layers 10, 20, 30 (3 x 5120 wide: 40 layers,
    # its 24-layer Pixtral vision tower too: the pipeline loads the whole model), the VAE of 32 latent channels
    own_sizes = {"flux2-dev": dict(flux2base.Flux2Models._vae, layers=8, single_layers=48, head_dim=128, heads=48,
                                   rope=(32, 32, 32, 32), text_hidden=5120, text_depth=40, text_heads=32,
                                   text_kv_heads=8, text_head_dim=128, text_ff=32768, text_vocab=131072,
                                   vision_width=1024, vision_depth=24, vision_heads=16, vision_ff=4096,
                                   vision_size=1540)}

    def text_encoders(self, spec, tokenizer):
        from transformers import Mistral3Config
        from transformers import Mistral3ForConditionalGeneration
        from transformers import MistralConfig
        from transformers import PixtralVisionConfig

        arch = {**self.changes, **spec}
        mistral_tokenizer = tiny_tokenizer()
        width, vision = arch["text_hidden"], arch["vision_width"]
        text = MistralConfig(vocab_size=arch.get("text_vocab", len(mistral_tokenizer)), hidden_size=width,
                             intermediate_size=arch.get("text_ff", 2 * width), num_hidden_layers=arch["text_depth"],
                             num_attention_heads=arch["text_heads"], num_key_value_heads=arch["text_kv_heads"],
                             head_dim=arch["text_head_dim"], max_position_embeddings=2 * flux2base.MAX_TOKENS,
                             tie_word_embeddings=False, pad_token_id=mistral_tokenizer.pad_token_id)
        heads = arch.get("vision_heads", 1)
        vision_config = PixtralVisionConfig(hidden_size=vision, intermediate_size=arch.get("vision_ff", 2 * vision),
                                            num_hidden_layers=arch.get("vision_depth", 1), num_attention_heads=heads,
                                            head_dim=vision // heads, image_size=arch.get("vision_size", 28),
                                            patch_size=14)
        config = Mistral3Config(text_config=text, vision_config=vision_config, tie_word_embeddings=False,
                                image_token_index=mistral_tokenizer.convert_tokens_to_ids("[IMG]"))
        return ({"text_encoder": Mistral3ForConditionalGeneration(config)}, len(OUT_LAYERS) * width, {})

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import Flux2Pipeline

        return Flux2Pipeline(tokenizer=tiny_tokenizer(), scheduler=self.scheduler(), **nets)


class Flux2Dev(flux2base.Flux2Family):
    label = "FLUX.2 [dev]"
    order = 80
    pipeline = "Flux2Pipeline"
    # (its LoRA layers, denoiser_lora_targets, are the base's: diffusers' FLUX.2 script names [klein]'s ones)
    text_encoders = ("text_encoder",)  # Mistral Small 3.1 (three of its hidden layers)
    guidance_scale = 4.0  # Flux2Pipeline's default (see the module's note)
    guided_training = True  # the guidance value is an input of the transformer in training too
    out_layers = OUT_LAYERS
    # FLUX.2 [dev]'s transformer, Mistral Small 3.1 (with its vision tower) and the VAE, counted on the meta device
    # (tests/unit/test_memory.py)
    released_params = {"transformer": 32223.28e6, "text_encoder": 24011.36e6, "vae": 84.05e6}
    released_size = "flux2-dev"
    memory_rows = (("FLUX.2 [dev]", "flux2-dev", (512, 1024), (8,)),)
    random = Flux2DevModels()
    # Its base model by short name: the diffusers folders in bf16, 112.6 GB (transformer 64.4, Mistral Small 3.1
    # 48.0, VAE 0.2), under the FLUX [dev] non-commercial license, served to accounts that accepted it. The revision
    # could not be checked from here (no hub access): it is the commit people's hub caches show
    # (models--black-forest-labs--FLUX.2-dev/snapshots/<commit>).
    known_models = (
        known.KnownModel("flux2-dev", "black-forest-labs/FLUX.2-dev", "26afe3a78bb242c0a8bb181dcc8937bb16e5c66c",
                         1024, "flow", 112.6, gated=True),
    )

    def check_folder(self, model_dir):
        """The released tokenizer folder (a PixtralProcessor's: its processor_config.json; model_dir None: the
        released model, not fetched yet) on a machine without torchvision: the line that says what to install."""
        import importlib.util
        import os

        released = model_dir is None or os.path.exists(os.path.join(model_dir, "tokenizer", "processor_config.json"))
        if released and importlib.util.find_spec("torchvision") is None:
            raise errors.UserError(TORCHVISION_LINE)

    def load_tokenizers(self, model_dir):
        """The tokenizer folder through AutoProcessor, as the pipeline loads it: the released model's
        PixtralProcessor (a one-line error without torchvision), a plain tokenizer as it is."""
        from transformers import AutoProcessor

        try:
            return [AutoProcessor.from_pretrained(model_dir, subfolder="tokenizer")]
        except ImportError as err:
            if "torchvision" in str(err).lower():
                raise errors.UserError(TORCHVISION_LINE) from None
            raise

    def load_text_encoders(self, model_dir, load):
        from transformers import Mistral3ForConditionalGeneration

        return [load(Mistral3ForConditionalGeneration, "text_encoder")]

    def token_ids(self, tokenizers, prompt):
        """(2, MAX_TOKENS): the ids of the prompt's conversation (messages_of) through the chat template, no reply
        started, and their attention mask, as Flux2Pipeline tokenizes it."""
        import numpy as np

        tokens = tokenizers[0].apply_chat_template([messages_of(prompt)], add_generation_prompt=False, tokenize=True,
                                                   return_dict=True, return_tensors="np", padding="max_length",
                                                   truncation=True, max_length=flux2base.MAX_TOKENS)
        return np.stack([tokens["input_ids"][0], tokens["attention_mask"][0]]).astype(np.int64)

    def pipeline_text(self, states, side, negative, negative_side):
        return dict(prompt_embeds=states)  # (no negative prompt: guidance-distilled)

    def unpack_latents(self, pipe, latents, height, width):
        """Flux2Pipeline's latent output is its tokens (B, h x w, C), as the denoiser makes them (unlike
        [klein]'s pipeline, which unfolds them): back to (B, C, h, w)."""
        b, _, c = latents.shape
        scale = pipe.vae_scale_factor * 2  # (the VAE's, then the 2x2 fold)
        return latents.permute(0, 2, 1).reshape(b, c, height // scale, width // scale)


FAMILY = Flux2Dev()

"""How a family's models with random weights are built: the real diffusers and transformers classes at the
widths of models/random_models.py's MODEL_SIZES, or of a family's own full sizes. cache_model.py --tiny and
--random_model write them, the tests and the GPU benchmarks train them, and memory.py counts a released model's
parameters on the meta device through them. A run never builds one: it loads the folder these wrote, through
the family's own interface (family.Family), which knows nothing of this one.

Each family has one subclass of RandomModels, its Family's `random`; the random text encoders and tiny tokenizers
that several families' models are built with are here too.
"""

import string


class RandomModels:
    """What a family's random models are and how each network is built; the methods that raise
    NotImplementedError are the ones a family must give."""

    arch = ""  # the --arch name of its random models (families.ARCHS)
    note = ""  # what they are, for cache_model.py --help
    changes = {}  # what they change around random_models.MODEL_SIZES' widths (also in their revision)
    own_sizes = {}  # its full-size models' shapes ({--random_model name: spec}) beside random_models.MODEL_SIZES
    # spec keys of block counts whose blocks of one kind each keep the same activations: activations.py counts a
    # full size on copies of one and two blocks (its memory table in seconds); () where blocks differ by position
    block_counts = ()

    def text_encoders(self, spec, tokenizer):
        """({subfolder: random text encoder}, the denoiser's text width, the denoiser's extra config) for a
        random_models.MODEL_SIZES spec."""
        raise NotImplementedError

    def denoiser(self, spec, latent_size, text_width, extra):
        """A random denoiser of a spec for latent_size latents, reading text states text_width wide, with extra
        config from text_encoders."""
        raise NotImplementedError

    def vae_config(self):
        """What its random VAE changes in AutoencoderKL's config."""
        return {}

    def vae(self, spec, latent_size):
        """A random VAE of a spec whose latents are latent_size wide (AutoencoderKL, vae_config's changes)."""
        from diffusers import AutoencoderKL

        blocks = len(spec["vae_channels"])
        return AutoencoderKL(block_out_channels=spec["vae_channels"], layers_per_block=spec["vae_layers"],
                             down_block_types=("DownEncoderBlock2D",) * blocks,
                             up_block_types=("UpDecoderBlock2D",) * blocks,
                             sample_size=latent_size * 2 ** (blocks - 1),
                             **{"latent_channels": 4, **self.vae_config()})

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        """The family's pipeline of the random networks nets, with its released models' scheduler."""
        raise NotImplementedError


# --- the random text encoders and tiny tokenizers several families' models are built with

def clip_text_encoder(cls, spec, tokenizer, act, **extra):
    """A random CLIP text encoder (cls: transformers' CLIPTextModel or CLIPTextModelWithProjection)
    of a random_models.MODEL_SIZES spec's width, for tokenizer's vocabulary."""
    from transformers import CLIPTextConfig

    return cls(CLIPTextConfig(
        vocab_size=spec.get("vocab_size", len(tokenizer)),
        hidden_size=spec["text_hidden"],
        intermediate_size=4 * spec["text_hidden"],
        num_hidden_layers=spec["text_layers"],
        num_attention_heads=spec["text_heads"],
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act=act,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    ))


def tiny_t5_tokenizer(max_length):
    """A T5 tokenizer made here (the tokenizers library's Unigram model, as T5's sentencepiece one is):
    every character alone and after a word boundary, a few whole words, T5's <pad>, </s> and <unk>."""
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import processors
    from transformers import T5TokenizerFast

    pieces = ["<pad>", "</s>", "<unk>", "\u2581"]
    pieces += ["\u2581" + w for w in ("photo", "of", "a", "the", "dog", "toy", "in")]
    pieces += [p for c in string.ascii_lowercase + string.digits + string.punctuation for p in (c, "\u2581" + c)]
    vocab = [(piece, 0.0 if k < 3 else -1.0 - 0.01 * k) for k, piece in enumerate(pieces)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                           extra_ids=0, model_max_length=max_length)


def t5_encoder(arch, tokenizer):
    """A random T5 encoder of arch's t5_* numbers (T5 v1.1's gated-GELU layout), for tokenizer's ids: the tiny one's
    vocabulary unless arch names T5's own (t5_vocab)."""
    from transformers import T5Config
    from transformers import T5EncoderModel

    width = arch["t5_width"]
    return T5EncoderModel(T5Config(vocab_size=arch.get("t5_vocab", len(tokenizer)), d_model=width,
                                   d_kv=arch.get("t5_kv", width // 4), d_ff=arch.get("t5_ff", 2 * width),
                                   num_layers=arch["t5_layers"], num_heads=arch["t5_heads"],
                                   feed_forward_proj="gated-gelu", pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id))


def tiny_byte_tokenizer():
    """A Qwen2 tokenizer made here: byte-level BPE with every byte a token and no merges, Qwen's <|endoftext|>
    (its padding) and the chat template's <|im_start|> and <|im_end|>."""
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from transformers import Qwen2TokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = Qwen2TokenizerFast(tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


# Qwen3's chat template as the pipeline applies it (one user message, the reply's start, thinking off), for the
# tiny tokenizer built here; a released model's tokenizer brings its own
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def tiny_qwen3_tokenizer():
    """The tiny byte-level tokenizer (tiny_byte_tokenizer) with Qwen3's chat template."""
    tokenizer = tiny_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def qwen3_text(arch, tokenizer, layers, positions):
    """The settings of a random Qwen3 text stack (Qwen3Config's, or a Qwen3-VL config's text_config) of arch's text_*
    numbers, layers deep, of positions positions, for tokenizer's ids: its MLP twice its width and tokenizer's
    vocabulary unless arch says text_ff and text_vocab."""
    width = arch["text_hidden"]
    return dict(vocab_size=arch.get("text_vocab", len(tokenizer)), hidden_size=width,
                intermediate_size=arch.get("text_ff", 2 * width), num_hidden_layers=layers,
                num_attention_heads=arch["text_heads"], num_key_value_heads=arch["text_kv_heads"],
                head_dim=arch["text_head_dim"], max_position_embeddings=positions, pad_token_id=tokenizer.pad_token_id)

"""HiDream-I1 (HiDream.ai's 17 B sparse transformer, HiDreamImageTransformer2DModel): flow matching over Flux.1's
16-channel VAE latents (shifted and scaled), which the transformer cuts into 2x2 patches itself; 16 dual-stream
then 32 single-stream blocks whose feed-forwards are mixtures of experts (4 routed, 2 active, and a shared one).
It is conditioned on four text encoders, none of them trained: CLIP-L's and CLIP-G's projected pooled outputs
side by side (the timestep's companion), T5-XXL's states, and every hidden layer of Llama 3.1 8B Instruct, each
block reading its own layer (the transformer's llama_layers) beside T5's and the last block's Llama states. Every
encoder reads the prompt at the pipeline's 128 tokens. The encoders' states are computed once and they leave the
device, as Flux.1's T5 does. The pipeline draws with classifier-free guidance 5.0 against a negative prompt
(empty by default), always at its own 1024 x 1024 pixel count (the asked size sets the aspect only).

Trained as diffusers' train_dreambooth_lora_hidream.py trains it: a sample of the VAE's posterior, the
scheduler's sigmas shifted by 3.0 (the script's FlowMatchEulerDiscreteScheduler, whatever the model folder's
sampler), uniform timesteps by default, the transformer's output negated as the velocity; the transformer routes
its tokens as it does when drawing (the script's force_inference_output): the routed experts take no gradient,
and here they are frozen (a full fine-tune trains the rest).

The released repositories hold no Llama (model_index.json names none for text_encoder_4 and tokenizer_4): the
model folder this suite reads is the pipeline's folder with meta-llama/Meta-Llama-3.1-8B-Instruct's model in
text_encoder_4/ (LlamaForCausalLM) and its tokenizer in tokenizer_4/ (PreTrainedTokenizerFast), both named in
model_index.json (check_folder says so before a run starts). Its LoRA exports in kohya's names of its original
layout (diffusers' own), which ComfyUI loads.
"""

import contextlib

from dreambooth import errors
from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import fluxblocks

MAX_TOKENS = 128  # every encoder's tokens: HiDreamImagePipeline's max_sequence_length default, and the script's
TRAIN_SHIFT = 3.0  # the shift the script gives its FlowMatchEulerDiscreteScheduler, whatever the folder's sampler
CLIP_POSITIONS = 248  # HiDream's CLIP-L and CLIP-G read up to 248 tokens (Long-CLIP's positions)
LLAMA_LAYERS = 32  # Llama 3.1 8B's hidden layers: the states carry each (released_size's text_tokens)
# The released transformer's llama_layers: block k reads Llama's layer k, the last 16 single-stream blocks the last
RELEASED_LLAMA_LAYERS = tuple(range(32)) + (31,) * 16
LLAMA_HELP = ("HiDream-I1's repositories hold no Llama: put meta-llama/Meta-Llama-3.1-8B-Instruct (gated: accept its "
              "license on the hub) in the model folder, its model in text_encoder_4/ and its tokenizer in tokenizer_4/, "
              'and name them in model_index.json: "text_encoder_4": ["transformers", "LlamaForCausalLM"], '
              '"tokenizer_4": ["transformers", "PreTrainedTokenizerFast"]')


# (kohya's module name, None) of a HiDream transformer module's diffusers name (lora_unet_double_stream_blocks_<i>_
# block_attn1_to_q): HiDream-I1's original layout, which ComfyUI's HiDream model keeps (comfy/ldm/hidream/model.py), is
# diffusers' own
kohya_module = family.unfused_kohya_module


def split_states(states):
    """(T5's states (N, L, D), Llama's (layers, N, L, D)) of encode_text's states (N, L x (1 + layers), D): T5's L
    tokens, then each Llama layer's, as the transformer and the pipeline take them."""
    n, total, width = states.shape
    llama = states[:, MAX_TOKENS:].reshape(n, total // MAX_TOKENS - 1, MAX_TOKENS, width)
    return states[:, :MAX_TOKENS], llama.transpose(0, 1)


def tiny_llama_tokenizer():
    """A Llama 3 tokenizer made here: byte-level BPE with every byte a token and no merges, Llama 3's
    <|begin_of_text|> before each text and <|eot_id|> (the Instruct model's end, which the pipeline pads with)."""
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|eot_id|>"
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({bos: len(vocab), eos: len(vocab) + 1})
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.add_special_tokens([bos, eos])
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos)


def long_clip_tokenizer(tokenizer):
    """A copy of a CLIP tokenizer that says CLIP_POSITIONS tokens (the text encoders built for it get as many
    positions: the pipeline reads 128)."""
    import copy

    long = copy.deepcopy(tokenizer)
    long.model_max_length = CLIP_POSITIONS
    return long


def routed_as_drawn(model):
    """The transformer routing its tokens as when it draws, in train mode too (diffusers' script loads it with
    force_inference_output=True: the experts' weighted sum without gradient, the output unpatched to (B, C, h, w)),
    its routed experts and their gates frozen: they take no gradient (and DDP would wait for theirs)."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    model.register_to_config(force_inference_output=True)
    for module in model.modules():
        if hasattr(module, "_force_inference_output"):
            module._force_inference_output = True
        if isinstance(module, MOEFeedForwardSwiGLU):
            module.experts.requires_grad_(False)
            module.gate.requires_grad_(False)
    return model


@contextlib.contextmanager
def shapes_only(model, noisy):
    """On the meta device (planning/activations.py counts what a step keeps for its backward pass, on a throwaway
    copy): the transformer routing as training routes (routed_as_drawn, which a meta copy built from a size lacks),
    the routed experts' sum, computed without gradient (nothing kept), as zeros, and the output unpatched without
    reading the patch counts' values (the two steps a meta tensor cannot take: they read data); elsewhere nothing
    changes."""
    if noisy.device.type != "meta":
        yield
        return
    import torch
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    routed_as_drawn(model)
    b, _, h, w = noisy.shape
    p = model.config.patch_size

    def unpatchify(x, img_sizes, is_training):
        channels = x.shape[-1] // (p * p)
        x = x[:, :(h // p) * (w // p)].reshape(b, h // p, w // p, p, p, channels)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(b, channels, h, w)

    experts = [m for m in model.modules() if isinstance(m, MOEFeedForwardSwiGLU)]
    for module in experts:
        module.moe_infer = lambda x, indices, weights: torch.zeros_like(x)
    model.unpatchify = unpatchify
    try:
        yield
    finally:
        del model.unpatchify
        for module in experts:
            del module.moe_infer


class HiDreamModels(fluxblocks.FluxBlocksModels):
    note = "HiDream-I1's layout: a dual/single-stream transformer of mixtures of experts, CLIP-L, CLIP-G, T5 and " \
           "Llama 3.1, flow matching, Flux.1's 16-channel VAE"
    # tiny: 64 px, one dual- and one single-stream block of 2 heads of 16 with 4 experts (2 active), reading layers
    # 0 and 2 of a 3-layer Llama 32 wide beside a 2-layer T5 as wide
    changes = dict(resolution_scale=1, layers=1, single_layers=1, head_dim=16, heads=2, rope=(8, 4, 4), experts=4,
                   active_experts=2, llama_layers=(0, 2), t5_width=32, t5_layers=2, t5_heads=4, llama_width=32,
                   llama_depth=3, llama_heads=2, llama_kv_heads=1, vae_scaling_factor=0.3611,
                   vae_shift_factor=0.1159)
    # HiDream-I1's shapes (--random_model hidream-i1), 1024 px: 16 dual- and 32 single-stream blocks of 20 heads of
    # 128, 4 routed experts (2 active) and a shared one, reading Llama 3.1 8B's 32 layers; CLIP-L and CLIP-G (with
    # projections, 248 positions), T5 v1.1 XXL's encoder, Llama 3.1 8B Instruct (the whole causal LM, as the pipeline
    # loads it), Flux.1's VAE
    own_sizes = {"hidream-i1": dict(layers=16, single_layers=32, head_dim=128, heads=20, rope=(64, 32, 32),
                                    llama_layers=RELEASED_LLAMA_LAYERS, text_hidden=768, text_layers=12, text_heads=12,
                                    text2_hidden=1280, text2_layers=32, text2_heads=20, vocab_size=49408,
                                    t5_width=4096, t5_layers=24, t5_heads=64, t5_kv=64, t5_ff=10240, t5_vocab=32128,
                                    llama_width=4096, llama_depth=LLAMA_LAYERS, llama_heads=32, llama_kv_heads=8,
                                    llama_ff=14336, llama_vocab=128256, vae_channels=(128, 256, 512, 512),
                                    vae_layers=2, latent_size=128)}

    def text_encoders(self, spec, tokenizer):
        from transformers import CLIPTextModelWithProjection
        from transformers import LlamaConfig
        from transformers import LlamaForCausalLM

        arch = {**self.changes, **spec}
        clip_tokenizer = long_clip_tokenizer(tokenizer)
        # CLIP-G is the wider one (1280 wide, 32 layers of 20 heads in the released model)
        wide = dict(spec, text_hidden=spec.get("text2_hidden", 2 * spec["text_hidden"]),
                    text_layers=spec.get("text2_layers", spec["text_layers"]),
                    text_heads=spec.get("text2_heads", spec["text_heads"]))
        clip_l = builders.clip_text_encoder(CLIPTextModelWithProjection, spec, clip_tokenizer, "quick_gelu",
                                            projection_dim=spec["text_hidden"])
        clip_g = builders.clip_text_encoder(CLIPTextModelWithProjection, wide, clip_tokenizer, "gelu",
                                            projection_dim=wide["text_hidden"])
        t5 = builders.t5_encoder(arch, builders.tiny_t5_tokenizer(512))
        llama_tokenizer = tiny_llama_tokenizer()
        width = arch["llama_width"]
        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=arch.get("llama_vocab", len(llama_tokenizer)), hidden_size=width,
            intermediate_size=arch.get("llama_ff", 2 * width), num_hidden_layers=arch["llama_depth"],
            num_attention_heads=arch["llama_heads"], num_key_value_heads=arch["llama_kv_heads"],
            max_position_embeddings=2 * MAX_TOKENS, tie_word_embeddings=False,
            bos_token_id=llama_tokenizer.bos_token_id, eos_token_id=llama_tokenizer.eos_token_id))
        pooled = spec["text_hidden"] + wide["text_hidden"]
        return ({"text_encoder": clip_l, "text_encoder_2": clip_g, "text_encoder_3": t5, "text_encoder_4": llama},
                width, {"caption_channels": [arch["t5_width"], width], "text_emb_dim": pooled})

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import HiDreamImageTransformer2DModel

        arch = {**self.changes, **spec}
        return HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=16, num_layers=arch["layers"],
            num_single_layers=arch["single_layers"], attention_head_dim=arch["head_dim"],
            num_attention_heads=arch["heads"], num_routed_experts=arch.get("experts", 4),
            num_activated_experts=arch.get("active_experts", 2), axes_dims_rope=list(arch["rope"]),
            max_resolution=[latent_size, latent_size], llama_layers=list(arch["llama_layers"]), **extra)

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import HiDreamImagePipeline
        from diffusers import UniPCMultistepScheduler

        # HiDream-I1 Full's sampler: UniPC over flow sigmas shifted by 3.0
        scheduler = UniPCMultistepScheduler(flow_shift=3.0, prediction_type="flow_prediction", use_flow_sigmas=True)
        clip_tokenizer = long_clip_tokenizer(tokenizer)
        return HiDreamImagePipeline(scheduler=scheduler, tokenizer=clip_tokenizer, tokenizer_2=clip_tokenizer,
                                    tokenizer_3=builders.tiny_t5_tokenizer(512), tokenizer_4=tiny_llama_tokenizer(),
                                    **nets)


class HiDream(family.Family):
    label = "HiDream-I1"
    order = 130
    pipeline = "HiDreamImagePipeline"
    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' HiDream DreamBooth LoRA script's default layers: the image stream's attention projections (the text
    # stream's are to_q_t, ...: not adapted), in the dual- and the single-stream blocks
    denoiser_lora_targets = ("to_k", "to_q", "to_v", "to_out")
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")  # CLIP-L, CLIP-G, T5, Llama
    trainable_text_encoders = ()  # all frozen, as in diffusers' script
    supports = frozenset({"train", "draw", "export", "export_lora"})
    denoiser_file = True  # (its transformer alone, as HiDream-ai's and ComfyUI's files hold it)
    guidance_scale = 5.0  # HiDreamImagePipeline's default (HiDream-I1 Full's)
    released_resolutions = (1024,)
    # HiDream-I1's transformer, CLIP-L, CLIP-G, T5-XXL, Llama 3.1 8B and Flux.1's VAE, counted on the meta device
    # (tests/unit/test_memory.py)
    released_params = {"transformer": 17105.73e6, "text_encoder": 123.78e6, "text_encoder_2": 694.88e6,
                       "text_encoder_3": 4762.31e6, "text_encoder_4": 8030.26e6, "vae": 83.82e6}
    released_size = "hidream-i1"
    memory_rows = (("HiDream-I1", "hidream-i1", (512, 1024), (4, 8)),)
    random = HiDreamModels()
    # Its base model is not known by short name: no revision of HiDream-ai/HiDream-I1-Full could be checked from here,
    # and its repository lacks the Llama its pipeline reads (LLAMA_HELP)
    known_models = ()
    text_tokens = MAX_TOKENS * (1 + LLAMA_LAYERS)  # the states' length for activations.py: T5's, each Llama layer's

    def native_resolution(self, model_dir):
        """The VAE's sample size (released: 1024, the pixel count the pipeline draws at; a random model built here
        says its own)."""
        return family.part_config(model_dir, "vae")["sample_size"]

    def size_multiple(self, model_dir):
        """The VAE's downscaling times the transformer's 2x2 patches."""
        return self.vae_scale(model_dir) * family.part_config(model_dir, self.denoiser)["patch_size"]

    def check_folder(self, model_dir):
        """A model folder whose model_index.json names no class for the Llama (the released repositories'): the line
        that says how to add it (model_dir None: the released model, not assembled yet: nothing to read)."""
        import os

        from dreambooth import files

        if model_dir is None:
            return
        index = files.read_json(os.path.join(model_dir, "model_index.json"))
        if any(None in (index.get(part) or [None]) for part in ("text_encoder_4", "tokenizer_4")):
            raise errors.UserError(f"{model_dir}: {LLAMA_HELP}")

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import HiDreamImageTransformer2DModel

        return routed_as_drawn(load(HiDreamImageTransformer2DModel, self.denoiser))

    def load_tokenizers(self, model_dir):
        """CLIP-L's, CLIP-G's, T5's and Llama's, the last padding with its end token as the pipeline makes it."""
        from transformers import CLIPTokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers import T5TokenizerFast

        llama = PreTrainedTokenizerFast.from_pretrained(model_dir, subfolder="tokenizer_4")
        llama.pad_token = llama.eos_token
        return [CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer"),
                CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer_2"),
                T5TokenizerFast.from_pretrained(model_dir, subfolder="tokenizer_3"), llama]

    def load_text_encoders(self, model_dir, load):
        from transformers import CLIPTextModelWithProjection
        from transformers import LlamaForCausalLM
        from transformers import T5EncoderModel

        return [load(CLIPTextModelWithProjection, "text_encoder"), load(CLIPTextModelWithProjection, "text_encoder_2"),
                load(T5EncoderModel, "text_encoder_3"), load(LlamaForCausalLM, "text_encoder_4")]

    def token_ids(self, tokenizers, prompt):
        """(6, MAX_TOKENS) as HiDreamImagePipeline tokenizes a prompt: CLIP-L's and CLIP-G's ids, T5's ids and
        attention mask, Llama's ids (after its <|begin_of_text|>) and attention mask, each padded to 128 tokens."""
        import numpy as np

        rows = []
        for k, tokenizer in enumerate(tokenizers):
            tokens = tokenizer(prompt, padding="max_length", max_length=MAX_TOKENS, truncation=True,
                               return_tensors="np")
            rows += [tokens.input_ids[0]] + ([tokens.attention_mask[0]] if k >= 2 else [])
        return np.stack(rows).astype(np.int64)

    def encode_text(self, text_encoders, ids):
        """As HiDreamImagePipeline.encode_prompt does: T5's states (with its mask), then each hidden layer of Llama's
        (with its mask; its embeddings' layer left out), one after another along the tokens, (N, 128 x (1 + layers),
        D) (T5's and Llama's widths are one: 4096), and CLIP-L's and CLIP-G's projected pooled outputs side by side.
        ids: (N, 6, 128) of token_ids."""
        import torch

        clip_l, clip_g, t5, llama = text_encoders
        pooled = torch.cat([clip_l(ids[:, 0])[0], clip_g(ids[:, 1])[0]], dim=-1)
        t5_states = t5(ids[:, 2], attention_mask=ids[:, 3])[0]
        # (the pipeline also asks for the attention maps, which transformers' fused attention does not make: its
        # hidden states are these)
        layers = llama(ids[:, 4], attention_mask=ids[:, 5], output_hidden_states=True).hidden_states[1:]
        n = ids.shape[0]
        llama_states = torch.stack(layers, dim=1).reshape(n, len(layers) * MAX_TOKENS, -1)
        return torch.cat([t5_states.to(pooled.dtype), llama_states.to(pooled.dtype)], dim=1), pooled

    def text_width(self, denoiser_config):
        return max(denoiser_config.caption_channels)

    def meta_side_input(self, denoiser_config, tensor_options):
        import torch

        return torch.empty(1, denoiser_config.text_emb_dim, **tensor_options)

    def pipeline_text(self, states, side, negative, negative_side):
        t5, llama = split_states(states)
        negative_t5, negative_llama = split_states(negative)
        return dict(prompt_embeds_t5=t5, prompt_embeds_llama3=llama, pooled_prompt_embeds=side,
                    negative_prompt_embeds_t5=negative_t5, negative_prompt_embeds_llama3=negative_llama,
                    negative_pooled_prompt_embeds=negative_side)

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "none"  # diffusers' HiDream DreamBooth script's default: uniform

    def load_scheduler(self, model_dir):
        """The script's: FlowMatchEulerDiscreteScheduler of the folder's scheduler config (HiDream-I1 Full's is
        UniPC's: its 1000 steps), shifted by 3.0."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir, subfolder="scheduler", shift=TRAIN_SHIFT)

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: the transformer patches them itself and takes the timestep
        on the schedule's 1000 steps, T5's and Llama's states apart (split_states), the pooled CLIP outputs; its
        output negated."""
        t5, llama = split_states(states)
        with shapes_only(model, noisy):
            out = model(hidden_states=noisy, timesteps=timesteps, encoder_hidden_states_t5=t5,
                        encoder_hidden_states_llama3=llama, pooled_embeds=pooled, return_dict=False)[0]
        return -out

    def pipeline_kwargs(self):
        return {"max_sequence_length": MAX_TOKENS}

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' HiDream DreamBooth LoRA script writes them."""
        return peft_layers

    # --- export (export.py): kohya's names of HiDream-I1's original modules, which are diffusers' own
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (peft names, lora_A/lora_B) in kohya's names of the original
        modules (kohya_module), the names ComfyUI maps onto each weight of its HiDream model (comfy/lora.py
        model_lora_keys_unet: lora_unet_ and the weight's name with "_" for "."), with lora_down/lora_up and the
        alpha (the scale alpha / rank kept). No layer is fused there: each adapter is one module of the file."""
        return family.denoiser_kohya_lora(self, state_dict, alphas, kohya_module)

    def single_file_denoiser(self, denoiser):
        """The transformer's own names: HiDream-I1's original layout is diffusers' (diffusers' single-file reader
        keeps every name)."""
        return dict(denoiser.state_dict())


FAMILY = HiDream()

"""Qwen-Image 2.1: a flow-matching single-stream transformer (QwenImage21Transformer2DModel: 32 blocks, 7 B) over the
64-channel latents of its own VAE (AutoencoderKLQwenImage21: RGBA in and out, 16x down, one frame of a video VAE,
normalised by per-channel means and deviations), one token a latent pixel, conditioned on the last hidden states
(before the final norm) of Qwen3-VL-8B read through the pipeline's chat template whose system message is dropped,
with their mask (the prompt states are as long as the longest prompt). The prompt's states and the image's tokens
are one sequence, causal over the text and bidirectional within the image, each group of 2x2 latent tokens taking
one slot after the text. The pipeline draws without guidance by default (true_cfg_scale 1.0). The text encoder is
never trained: its states are computed once and it leaves the device. Trained as diffusers'
train_dreambooth_lora_qwenimage21.py trains it: the VAE's sample of the RGBA image (an opaque alpha added to our RGB
photos), objectives.flow_matching on the scheduler's unshifted sigmas, uniform timesteps by default. Its LoRA exports in
kohya's names of diffusers' modules, which ComfyUI's Qwen-Image 2.1 model keeps for every layer the family adapts.

Its text side is a Qwen3VLProcessor (what the pipeline and diffusers' script load), which transformers builds only
with torchvision installed: the released model needs it (said in one line before a run starts). The tiny model built
here saves a LlavaProcessor in its place (the processor class transformers builds without torchvision that tokenizes
a text-only prompt as Qwen3VLProcessor does: its tokenizer, its chat template, nothing else).
"""

import contextlib

from dreambooth import errors
from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import known
from dreambooth.families.shared import layouts
from dreambooth.families.shared import qwenvae

# QwenImage21Pipeline's system message and text-to-image template (sys_prompt, prompt_template_t2i); the count of
# leading tokens it drops is its processor's tokens of the system message alone (token_ids)
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
TEMPLATE = (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
            "<|im_start|>assistant\n")
SYSTEM_MESSAGE = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
MAX_TOKENS = 1024  # the templated prompt's longest (the pipeline does not truncate; its states stop here)
DEFAULT_SAMPLE_SIZE = 64  # QwenImage21Pipeline's latent size when none is given (its output_resolution, 1024 px)
SLOT = 2  # each text-side slot of the target image holds 2x2 latent tokens
RELEASED_PROCESSOR = "Qwen3VLProcessor"
TORCHVISION_LINE = ("Qwen-Image 2.1's processor (transformers' Qwen3VLProcessor, as diffusers loads it) needs "
                    "torchvision: pip install torchvision==0.28.0 (the release for torch 2.13; a CPU machine: "
                    "--index-url https://download.pytorch.org/whl/cpu)")
# A chat template for the tiny tokenizer built here, as Qwen3-VL's renders text-only messages (the released processor
# brings its own)
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ComfyUI's Qwen-Image 2.1 model (comfy/ldm/qwen_image21/model.py) keeps diffusers' module names but for each block's
# SwiGLU input, which it fuses into one layer (img_mlp.gate_up: gate_layer's rows, then proj's); the family adapts
# none of those (denoiser_lora_targets: the blocks' attention)
FUSED = ("img_mlp.gate_layer", "img_mlp.proj")


def kohya_module(module):
    """(kohya's module name, None: a layer of its own) of a Qwen-Image 2.1 transformer module's diffusers name:
    lora_unet_ and the name with its dots as underscores (lora_unet_transformer_blocks_<i>_attn_to_q, ...), the name
    ComfyUI maps onto its model's weight; a KeyError for a half of a block's fused SwiGLU input (FUSED)."""
    if module.endswith(FUSED):
        raise KeyError(f"no kohya layout for {module}: ComfyUI's Qwen-Image 2.1 fuses it into img_mlp.gate_up")
    return family.unfused_kohya_module(module)


def original_name(key):
    """(ComfyUI's name of a Qwen-Image 2.1 transformer weight, its place in the fused img_mlp.gate_up or None)."""
    module, _, param = key.rpartition(".")
    part = next((i for i, name in enumerate(FUSED) if module.endswith(name)), None)
    return (key if part is None else f"{module[:-len(FUSED[part])]}img_mlp.gate_up.{param}"), part


def tiny_processor():
    """The tiny model's processor: Qwen-Image's tiny byte-level tokenizer with Qwen3-VL's chat and vision tokens
    and the template above, in a LlavaProcessor (see the module's note) with a Qwen2-VL image processor of
    Qwen3-VL's patches (16 px, merged 2x2: one vision token a slot of the 16x VAE's 2x2 latents)."""
    from transformers import LlavaProcessor
    from transformers import Qwen2VLImageProcessorPil

    tokenizer = builders.tiny_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                                                "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                                      max_pixels=64 * 64)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=TINY_CHAT_TEMPLATE,
                          image_token="<|image_pad|>")


def processor_class(model_dir):
    """The processor class model_index.json names (as the pipeline loads it)."""
    import os

    from dreambooth import files

    return files.read_json(os.path.join(model_dir, "model_index.json"))["processor"][1]


def image_layout(states, rows, h, w):
    """(B, text + h x w / 4) bool of the transformer's img_mask: False on the text positions, True on each slot of
    the target image's 2x2 latent tokens (text to image: no condition images); on the host for meta tensors, whose
    layout the transformer reads as values."""
    import torch

    device = "cpu" if states.is_meta else states.device
    return torch.cat([torch.zeros(rows, states.shape[1], dtype=torch.bool, device=device),
                      torch.ones(rows, h * w // SLOT ** 2, dtype=torch.bool, device=device)], dim=1)


class QwenImage21Models(builders.RandomModels):
    block_counts = ("layers",)  # (activations.py: each block keeps the same)
    note = "Qwen-Image 2.1's layout: a single-stream block-causal transformer, a Qwen3-VL text encoder, flow " \
           "matching, 64-channel latents of its RGBA VAE (16x)"
    # tiny: 64 px (4 x 4 latents of the 16x VAE, which the pipeline assumes), one block of 2 heads of 16, a 2-layer
    # Qwen3-VL 32 wide with a 1-block vision tower, a VAE 4 wide of 16 latent channels (means and deviations spread)
    changes = dict(released=False, resolution_scale=0.125, layers=1, head_dim=16, heads=2, mlp_ratio=3,
                   rope=(4, 6, 6), z_dim=16, text_kv_heads=2, vision_width=8, vae_base=4, vae_mult=(1, 1, 1, 1, 1),
                   vae_layers=1)
    # Qwen-Image 2.1's shapes (--random_model qwen-image-2.1), 1024 px (latent_size is scaled by resolution_scale):
    # 32 blocks of 32 heads of 128 reading Qwen3-VL-8B (36 layers 4096 wide, its 27-block vision tower too: the
    # pipeline loads the whole model), the VAE of 64 latent channels (diffusers' class defaults)
    own_sizes = {"qwen-image-2.1": dict(released=True, layers=32, head_dim=128, heads=32, mlp_ratio=3,
                                        rope=(16, 56, 56), z_dim=64, text_hidden=4096, text_layers=36, text_heads=32,
                                        text_kv_heads=8, text_head_dim=128, text_ff=12288, text_vocab=151936,
                                        text_positions=262144, mrope=(24, 20, 20),
                                        vision_width=1152, vision_depth=27, vision_heads=16, vision_ff=4304,
                                        vision_positions=2304, vision_deepstack=(8, 16, 24), vae_base=96,
                                        vae_decoder_base=144, vae_mult=(1, 2, 4, 8, 8), vae_layers=2, latent_size=512)}

    def text_encoders(self, spec, tokenizer):
        from transformers import Qwen3VLConfig
        from transformers import Qwen3VLForConditionalGeneration

        arch = {**self.changes, **spec}
        qwen_tokenizer = tiny_processor().tokenizer
        width, heads = arch["text_hidden"], arch["text_heads"]
        head_dim = arch.get("text_head_dim", width // heads)
        half = head_dim // 2  # the multimodal rotary sections (time, height, width) of a head's half
        sections = list(arch.get("mrope", (half - 2 * (half // 3), half // 3, half // 3)))
        text = dict(vocab_size=arch.get("text_vocab", len(qwen_tokenizer)), hidden_size=width,
                    intermediate_size=arch.get("text_ff", 2 * width), num_hidden_layers=arch["text_layers"],
                    num_attention_heads=heads, num_key_value_heads=arch["text_kv_heads"], head_dim=head_dim,
                    max_position_embeddings=arch.get("text_positions", 2 * MAX_TOKENS), pad_token_id=qwen_tokenizer.pad_token_id,
                    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": sections,
                                     "mrope_interleaved": True})
        vision_width = arch["vision_width"]
        vision = dict(depth=arch.get("vision_depth", 1), hidden_size=vision_width,
                      intermediate_size=arch.get("vision_ff", 2 * vision_width), num_heads=arch.get("vision_heads", 2),
                      out_hidden_size=width, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=arch.get("vision_positions", 16),
                      deepstack_visual_indexes=list(arch.get("vision_deepstack", (0,))))
        ids = {name: qwen_tokenizer.convert_tokens_to_ids(token) for name, token in (
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))} \
            if not arch["released"] else {}  # (the released model's own ids are its config's defaults)
        encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision,
                                                                tie_word_embeddings=False, **ids))
        return {"text_encoder": encoder}, width, {}

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import QwenImage21Transformer2DModel

        arch = {**self.changes, **spec}
        model = QwenImage21Transformer2DModel(patch_size=1, in_channels=arch["z_dim"], out_channels=arch["z_dim"],
                                              num_layers=arch["layers"], attention_head_dim=arch["head_dim"],
                                              num_attention_heads=arch["heads"], context_in_dim=text_width,
                                              mlp_ratio=arch["mlp_ratio"], axes_dims_rope=arch["rope"])
        if latent_size != DEFAULT_SAMPLE_SIZE:
            model.register_to_config(sample_size=latent_size)  # (its native size: native_resolution)
        return model

    def vae(self, spec, latent_size):
        from diffusers import AutoencoderKLQwenImage21

        arch = {**self.changes, **spec}
        z = arch["z_dim"]
        stats = {} if arch["released"] else dict(  # (the released model's are the class defaults)
            latents_mean=[0.1 * (k % 5) - 0.2 for k in range(z)], latents_std=[1.0 + 0.1 * (k % 3) for k in range(z)])
        return AutoencoderKLQwenImage21(base_dim=arch["vae_base"], decoder_base_dim=arch.get("vae_decoder_base",
                                                                                          arch["vae_base"]),
                                        z_dim=z, dim_mult=list(arch["vae_mult"]), num_res_blocks=arch["vae_layers"],
                                        temperal_downsample=[False] + [True] * (len(arch["vae_mult"]) - 2), **stats)

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers import QwenImage21Pipeline

        # Qwen-Image 2.1's scheduler: an exponential shift that grows with the image's token count
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192,
                                                    shift_terminal=0.02, time_shift_type="exponential")
        return QwenImage21Pipeline(scheduler=scheduler, processor=tiny_processor(), **nets)


class QwenImage21(qwenvae.MaskedPrompts, qwenvae.QwenVideoVAE):
    label = "Qwen-Image 2.1"
    order = 140
    trimmed_text = True  # (its states as long as the longest prompt, with their mask)
    pipeline = "QwenImage21Pipeline"
    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' Qwen-Image 2.1 DreamBooth LoRA script's default layers: the attention of every block
    denoiser_lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    text_encoders = ("text_encoder",)  # Qwen3-VL-8B (its last hidden states, before the final norm)
    trainable_text_encoders = ()  # frozen, as in diffusers' script
    supports = frozenset({"train", "draw", "export", "export_lora"})
    denoiser_file = True  # (its transformer alone, as ComfyUI's Qwen-Image 2.1 files hold it)
    guidance_scale = 1.0  # QwenImage21Pipeline's true_cfg_scale default: drawn without guidance, as its docs do
    guidance_argument = "true_cfg_scale"
    default_negative_prompt = " "  # (the pipeline's empty prompt) what --guidance_scale above 1 guides against
    released_resolutions = (1024,)  # (the pipeline's output_resolution default; diffusers' script trains at 1024)
    random = QwenImage21Models()
    # (its native size, a multiple of a slot's 2x2 latents, and the VAE's frame and statistics:
    # qwenvae.QwenVideoVAE; the prompts' mask: qwenvae.MaskedPrompts)
    default_sample_size = DEFAULT_SAMPLE_SIZE
    text_tokens = 128  # the text states' length in training for activations.py: a prompt's, not padded
    # Qwen-Image 2.1's 7 B transformer, Qwen3-VL-8B (8.8 B with its vision tower) and its VAE, counted on the meta
    # device (tests/unit/test_memory.py)
    released_params = {"transformer": 7115.12e6, "text_encoder": 8767.12e6, "vae": 337.74e6}
    released_size = "qwen-image-2.1"
    memory_rows = (("Qwen-Image 2.1", "qwen-image-2.1", (512, 1024), (4, 8)),)
    # Its base model by short name (families.KNOWN_MODELS), also a --random_model size (own_sizes): 33.1 GB of
    # safetensors (Qwen3-VL-8B 17.5 in bf16, transformer 14.2 in bf16, VAE 1.4 in fp32), under the non-commercial
    # Qwen Research License, served without a token (not gated). The revision could not be checked from here (no hub
    # access): it is the commit people's hub caches show (models--Qwen--Qwen-Image-2.1/snapshots/<commit>).
    known_models = (known.KnownModel("qwen-image-2.1", "Qwen/Qwen-Image-2.1",
                                     "790c92633540aa0cb11d9abf19eb46d861714758", 1024, "flow", 33.1),)

    def check_folder(self, model_dir):
        """The released processor folder (a Qwen3VLProcessor's; model_dir None: the released model, not fetched
        yet) on a machine without torchvision: the line that says what to install."""
        import importlib.util

        released = model_dir is None or processor_class(model_dir) == RELEASED_PROCESSOR
        if released and importlib.util.find_spec("torchvision") is None:
            raise errors.UserError(TORCHVISION_LINE)

    def tokenizers(self):
        return ("processor",)  # (its text side's subfolder: a processor, not a tokenizer)

    # --- the VAE: one RGBA frame of a video VAE, normalised per channel (the rest: qwenvae.QwenVideoVAE)
    def vae_class(self):
        from diffusers import AutoencoderKLQwenImage21

        return AutoencoderKLQwenImage21

    def latent_posterior(self, vae, pixels):
        """The posterior of (B, 3, H, W) pixels as one RGBA frame (an opaque alpha, 1 in [-1, 1], as diffusers'
        script reads an RGB image; a (B, 4, H, W) batch as it is), its frame axis dropped: (B, C, h, w) latents."""
        import torch

        if pixels.shape[1] == 3:
            pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        return super().latent_posterior(vae, pixels)

    def scale_latents(self, vae, latents):
        mean, std = self._latent_stats(vae, latents)
        return (latents - mean) * (1.0 / std)  # (as diffusers' script: times the deviations' inverse)

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import QwenImage21Transformer2DModel

        return load(QwenImage21Transformer2DModel, self.denoiser)

    def load_tokenizers(self, model_dir):
        """The processor folder through the class model_index.json names, as the pipeline loads it: the released
        model's Qwen3VLProcessor (a one-line error without torchvision), the tiny model's LlavaProcessor."""
        import transformers

        self.check_folder(model_dir)
        return [getattr(transformers, processor_class(model_dir)).from_pretrained(model_dir, subfolder="processor")]

    def load_text_encoders(self, model_dir, load):
        from transformers import Qwen3VLForConditionalGeneration

        return [load(Qwen3VLForConditionalGeneration, "text_encoder")]

    def token_ids(self, tokenizers, prompt):
        """(3, MAX_TOKENS): the templated prompt's ids, their attention mask and the tokens kept (the mask after the
        system message's tokens), right-padded (so that every prompt's ids stack, and each encodes as it does
        alone), as QwenImage21Pipeline tokenizes a prompt (the empty one as a space)."""
        import numpy as np

        processor = tokenizers[0]
        drop = len(processor.apply_chat_template(SYSTEM_MESSAGE, tokenize=True, return_dict=False)[0])
        tokens = processor.tokenizer(TEMPLATE.format(prompt or " "), max_length=MAX_TOKENS, padding="max_length",
                                     padding_side="right", truncation=True, return_tensors="np")
        mask = tokens.attention_mask[0]
        kept = mask.copy()
        kept[:drop] = 0
        return np.stack([tokens.input_ids[0], mask, kept]).astype(np.int64)

    def encode_text(self, text_encoders, ids):
        """As QwenImage21Pipeline.encode_prompt does for each prompt alone: the last decoder layer's states (before
        the final norm, the pipeline's hook) of the prompt's own tokens after the system message, zero-padded to the
        longest of these prompts, and their mask (N, L) in the place of a pooled embedding. ids: (N, 3, MAX_TOKENS)
        of token_ids (right-padded: the encoder reads up to the longest prompt, each prompt as alone)."""
        import torch

        input_ids, mask, kept = ids[:, 0], ids[:, 1], ids[:, 2]
        read = int(mask.sum(dim=1).max())
        model = text_encoders[0].model
        text_model = getattr(model, "language_model", model)
        handle = text_model.norm.register_forward_hook(lambda module, args, output: args[0])
        try:
            states = model(input_ids=input_ids[:, :read], attention_mask=mask[:, :read],
                           use_cache=False).last_hidden_state
        finally:
            handle.remove()
        lengths, start = kept.sum(dim=1), kept.argmax(dim=1)
        offsets = torch.arange(int(lengths.max()), device=ids.device)
        positions = (start[:, None] + offsets).clamp(max=read - 1)
        picked = states.gather(1, positions[..., None].expand(-1, -1, states.shape[-1]))
        keep = offsets < lengths[:, None]
        return picked * keep[..., None].to(picked.dtype), keep.long()

    def text_width(self, denoiser_config):
        return denoiser_config.context_in_dim

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "none"  # diffusers' Qwen-Image 2.1 DreamBooth script's default: uniform

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: one token a latent pixel after the prompt's states in one
        sequence (img_mask: image_layout), the timestep as a fraction of the schedule, the states' mask (pooled:
        encode_text's; none where every token is read, as diffusers' script passes it); the output's image tokens."""
        b, c, h, w = noisy.shape
        tokens = noisy.reshape(b, c, h * w).transpose(1, 2)
        mask = None if pooled is None or bool(pooled.all()) else pooled
        with _host_layout() if noisy.is_meta else contextlib.nullcontext():
            out = model(hidden_states=tokens, encoder_hidden_states=states, encoder_hidden_states_mask=mask,
                        timestep=timesteps / 1000, img_shapes=[[(1, h, w)]] * b,
                        img_mask=image_layout(states, b, h, w), return_dict=False)[0]
        return out[:, -h * w:].transpose(1, 2).reshape(b, c, h, w)

    def unpack_latents(self, pipe, latents, height, width):
        """The pipeline's latent output is its tokens: back to (B, C, h, w) (its own unpacking adds a frame)."""
        return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)[:, :, 0]

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' Qwen-Image 2.1 DreamBooth LoRA script writes them."""
        return peft_layers

    # --- export (export.py): kohya's names of diffusers' modules, which ComfyUI's Qwen-Image 2.1 model keeps
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (peft names, lora_A/lora_B) in kohya's names (kohya_module),
        the names ComfyUI maps onto each weight of its Qwen-Image 2.1 model (comfy/lora.py model_lora_keys_unet:
        lora_unet_ and the weight's name with "_" for "."), with lora_down/lora_up and the alpha (the scale alpha /
        rank kept). The blocks' attention, which the family adapts, is fused nowhere there."""
        return family.denoiser_kohya_lora(self, state_dict, alphas, kohya_module)

    def single_file_denoiser(self, denoiser):
        """The transformer in ComfyUI's layout (original_name): diffusers' names, each block's SwiGLU input fused."""
        return layouts.joined_layout(denoiser.state_dict(), original_name, self.label)


@contextlib.contextmanager
def _host_layout():
    """For counting on the meta device (planning/activations.py): the transformer reads its token layout's values
    (img_mask, given on the host: image_layout), and selects each token's modulation row with the layout's mask; that
    mask is moved to the modulation's (meta) device while the block lasts."""
    from diffusers.models.transformers import transformer_qwenimage21 as module

    select = module._select_modulation_rows
    module._select_modulation_rows = lambda params, mask: select(params, None if mask is None else mask.to(
        params.device))
    try:
        yield
    finally:
        module._select_modulation_rows = select


FAMILY = QwenImage21()

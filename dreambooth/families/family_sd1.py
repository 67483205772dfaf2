"""SD 1.x (1.4, 1.5): one CLIP ViT-L text encoder (OpenAI's, quick_gelu) whose last layer's states
condition the UNet; PNDM at 512 px; a safety checker; the original single file's text encoder under
cond_stage_model.transformer.* in transformers' names. SD 2.x and SDXL build on it."""

from dreambooth.families import builders
from dreambooth.families import family
from dreambooth.families import known
from dreambooth.families import layouts


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


def tiny_safety_checker(projection_dim=32):
    """A randomly initialised SD safety checker (real diffusers class) and its image processor.

    With its concept weights at 1 no image is flagged (a cosine never exceeds 1);
    a test lowers them to flag every image.
    """
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig
    from transformers import CLIPImageProcessor

    config = CLIPConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=projection_dim)
    checker = StableDiffusionSafetyChecker(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return checker, processor


class SD1Models(builders.RandomModels):
    arch = "sd1"
    note = "SD 1.4/1.5's layout"  # cache_model.py --help
    changes = dict(text_act="quick_gelu", linear_projection=False, prediction_type="epsilon", resolution_scale=1)

    def text_encoders(self, spec, tokenizer):
        from transformers import CLIPTextModel

        encoder = clip_text_encoder(CLIPTextModel, spec, tokenizer, self.changes["text_act"])
        return {"text_encoder": encoder}, spec["text_hidden"], {}

    def unet_heads(self, channels):
        """The UNet's attention_head_dim for its block widths: SD 1.x has 8 heads at every level."""
        return 8

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import UNet2DConditionModel

        down = spec["unet_down"]
        return UNet2DConditionModel(
            sample_size=latent_size,
            block_out_channels=spec["unet_channels"],
            layers_per_block=spec["unet_layers"],
            down_block_types=down,
            up_block_types=tuple(reversed([name.replace("Down", "Up") for name in down])),
            cross_attention_dim=text_width,
            attention_head_dim=self.unet_heads(spec["unet_channels"]),
            use_linear_projection=self.changes["linear_projection"],
            **extra,
        )

    def scheduler(self, betas):
        """The scheduler of SD 1.4's scheduler/scheduler_config.json."""
        from diffusers import PNDMScheduler

        return PNDMScheduler(skip_prk_steps=True, set_alpha_to_one=False, **betas)

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import StableDiffusionPipeline

        checker, processor = tiny_safety_checker() if safety_checker else (None, None)
        return StableDiffusionPipeline(tokenizer=tokenizer, scheduler=self.scheduler(betas), safety_checker=checker,
                                       feature_extractor=processor, requires_safety_checker=safety_checker, **nets)


class SD1(family.Family):
    name, label = "sd1", "SD 1.x"
    pipeline = "StableDiffusionPipeline"
    safety_checker = True
    released_resolutions = (512,)
    released_params = {"unet": 859.52e6, "text_encoder": 123.06e6, "vae": 83.65e6}
    random = SD1Models()

    def matches(self, pipeline, text_encoder_config):
        # OpenAI's CLIP uses quick_gelu, OpenCLIP's (SD 2.x) gelu; unreadable: the model check says why
        return pipeline == self.pipeline and text_encoder_config.get("hidden_act") != "gelu"

    def size_multiple(self, model_dir):
        """The VAE's downscaling times the UNet's (each down block but the last halves the latents)."""
        return self.vae_scale(model_dir) * 2 ** (len(family.part_config(model_dir, "unet")["down_block_types"]) - 1)

    def load_text_encoders(self, model_dir, load):
        from transformers import CLIPTextModel

        return [load(CLIPTextModel, "text_encoder")]

    def encode_text(self, text_encoders, ids):
        return text_encoders[0](ids)[0], None

    # --- export: the UNet families' layouts (layouts.py), the text encoders' prefixes their own
    kohya_text_prefixes = {"text_encoder": "lora_te_"}  # kohya's names of its text encoders' LoRA modules
    # GiB per worker measured on a GPU at 512 px, 2 + 2 images a step (memory.Setup's fields that differ)
    measured_memory = (({}, 18.0), ({"gradient_checkpointing": True}, 15.2))
    unet_extra_prefixes = ()  # (diffusers prefix, original prefix, renames inside) beyond SD 1.x's UNet

    def single_file_denoiser(self, unet):
        prefixes = layouts.unet_prefixes(unet.config) + list(self.unet_extra_prefixes)
        return layouts.rename(unet.state_dict(), prefixes, "UNet")

    def single_file_text_encoders(self, weights):
        return {"cond_stage_model.transformer." + k: t for k, t in weights[0].items()}

    def kohya_lora(self, state_dict, alphas, model_dir):
        return layouts.unet_kohya_lora(state_dict, alphas, self.kohya_text_prefixes)

    # The base models of this family the suite knows by short name (families.KNOWN_MODELS)
    known_models = (
        known.KnownModel("sd14", "CompVis/stable-diffusion-v1-4", "b95be7d6f134c3a9e62ee616f310733567f069ce", 512, "epsilon",
                         4.3),
        known.KnownModel("sd15", "stable-diffusion-v1-5/stable-diffusion-v1-5", "451f4fe16113bff5a5d2269ed5ad43b0592e9a14",
                         512, "epsilon", 4.3, aliases=("runwayml/stable-diffusion-v1-5",)),
    )


FAMILY = SD1()

"""The UNet families' base (SD 1.x's layout, which SD 2.x and SDXL build on): a UNet2DConditionModel conditioned
on CLIP text states, the StableDiffusionPipeline with its safety checker, and the original single file's UNet
layout (layouts.py) with kohya's names for its LoRA. Each UNet family subclasses UNetModels and UNetFamily in its
own folder and says what it changes."""

from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import layouts


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


def heads_of_64(channels):
    """The UNet's attention_head_dim for heads of 64 channels (SD 2.x, SDXL): more heads at each wider level."""
    return tuple(max(2, c // 64) for c in channels)


class UNetModels(builders.RandomModels):
    """SD 1.x's random models; a UNet family's changes (text_act, linear_projection) say what differs."""

    def text_encoders(self, spec, tokenizer):
        from transformers import CLIPTextModel

        encoder = builders.clip_text_encoder(CLIPTextModel, spec, tokenizer, self.changes["text_act"])
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


class UNetFamily(family.Family):
    """SD 1.x's pipeline, text encoder and single-file layout."""

    pipeline = "StableDiffusionPipeline"
    safety_checker = True

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
    unet_extra_prefixes = ()  # (diffusers prefix, original prefix, renames inside) beyond SD 1.x's UNet

    def single_file_denoiser(self, unet):
        prefixes = layouts.unet_prefixes(unet.config) + list(self.unet_extra_prefixes)
        return layouts.rename(unet.state_dict(), prefixes, "UNet")

    def single_file_text_encoders(self, weights):
        return {"cond_stage_model.transformer." + k: t for k, t in weights[0].items()}

    def kohya_lora(self, state_dict, alphas, model_dir):
        return layouts.unet_kohya_lora(state_dict, alphas, self.kohya_text_prefixes)

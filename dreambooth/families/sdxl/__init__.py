"""SDXL (base 1.0): two text encoders, CLIP ViT-L's kind, then OpenCLIP bigG with a projection; their
penultimate states side by side condition the UNet, and the second's pooled output with each image's
size and crop (six numbers, "text_time") go in as added conditions. 1024 px, Euler, a VAE scaled by
0.13025 that needs fp32 (force_upcast); no safety checker. The original single file holds the
encoders under conditioner.embedders.0 (transformers' names) and .1 (OpenCLIP's)."""

from dreambooth.families.shared import builders
from dreambooth.families.shared import known
from dreambooth.families.shared import layouts
from dreambooth.families.shared import unet


class SDXLModels(unet.UNetModels):
    note = "SDXL base's: two text encoders, size and crop conditioning, 2x the resolution"  # cache_model.py --help
    changes = dict(text_act="quick_gelu", text2_act="gelu", linear_projection=True, prediction_type="epsilon",
                   resolution_scale=2, time_embed_dim=8, vae_scaling_factor=0.13025)

    # SDXL base 1.0's shapes (--random_model sdxl), 1024 px: three levels, 1, 2 and 10 transformer layers in
    # them, CLIP ViT-L and OpenCLIP bigG text encoders
    own_sizes = {"sdxl": dict(unet_channels=(320, 640, 1280), unet_layers=2,
                              unet_down=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                              transformer_layers=(1, 2, 10), vae_channels=(128, 256, 512, 512), vae_layers=2,
                              text_hidden=768, text_layers=12, text_heads=12, text2_hidden=1280, text2_layers=32,
                              text2_heads=20, time_embed_dim=256, latent_size=64, vocab_size=49408)}

    def text_encoders(self, spec, tokenizer):
        from transformers import CLIPTextModel
        from transformers import CLIPTextModelWithProjection

        # The second encoder is the wider one, as in SDXL (768 and 1280): the single-file loaders
        # tell the two apart by their width.
        wide = dict(spec, text_hidden=spec.get("text2_hidden", 2 * spec["text_hidden"]),
                    text_layers=spec.get("text2_layers", spec["text_layers"]),
                    text_heads=spec.get("text2_heads", spec["text_heads"]))
        arch = self.changes
        encoders = {"text_encoder": builders.clip_text_encoder(CLIPTextModel, spec, tokenizer, arch["text_act"]),
                    "text_encoder_2": builders.clip_text_encoder(CLIPTextModelWithProjection, wide, tokenizer,
                                                                   arch["text2_act"],
                                                                   projection_dim=wide["text_hidden"])}
        # The pooled text embedding and six size/crop numbers, each in a time_embed_dim sinusoid.
        time_dim = spec.get("time_embed_dim", arch["time_embed_dim"])
        unet_extra = dict(addition_embed_type="text_time", addition_time_embed_dim=time_dim,
                          projection_class_embeddings_input_dim=wide["text_hidden"] + 6 * time_dim,
                          transformer_layers_per_block=spec.get("transformer_layers", 1))
        return encoders, spec["text_hidden"] + wide["text_hidden"], unet_extra

    def unet_heads(self, channels):
        return unet.heads_of_64(channels)

    def vae_config(self):
        return {"scaling_factor": self.changes["vae_scaling_factor"], "force_upcast": True}

    def scheduler(self, betas):
        """SDXL base 1.0's."""
        from diffusers import EulerDiscreteScheduler

        return EulerDiscreteScheduler(timestep_spacing="leading", **betas)

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(tokenizer=tokenizer, tokenizer_2=tokenizer, scheduler=self.scheduler(betas),
                                         **nets)


class SDXL(unet.UNetFamily):
    label = "SDXL"
    order = 30
    pipeline = "StableDiffusionXLPipeline"
    text_encoders = ("text_encoder", "text_encoder_2")
    safety_checker = False
    zero_negative_prompt = True
    time_ids = True
    released_resolutions = (1024,)
    released_params = {"unet": 2567.46e6, "text_encoder": 123.06e6, "text_encoder_2": 694.66e6, "vae": 83.65e6}
    random = SDXLModels()

    def matches(self, pipeline, text_encoder_config):
        return pipeline == self.pipeline

    def load_text_encoders(self, model_dir, load):
        from transformers import CLIPTextModel
        from transformers import CLIPTextModelWithProjection

        return [load(CLIPTextModel, "text_encoder"), load(CLIPTextModelWithProjection, "text_encoder_2")]

    def encode_text(self, text_encoders, ids):
        """Each encoder's penultimate states of its tokenizer's ids (N, 2, L), side by side, and the
        last encoder's projected pooled output."""
        import torch

        states = []
        for k, text_encoder in enumerate(text_encoders):
            out = text_encoder(ids[:, k], output_hidden_states=True)
            states.append(out.hidden_states[-2])
        return torch.cat(states, dim=-1), out.text_embeds

    def freeze_unread_layers(self, text_encoders):
        """The first encoder's last layer and final norm never touch the loss (its penultimate states
        are read): left trainable, they would get no gradient and DDP would stop the run waiting for
        theirs; frozen, they stay as they were either way."""
        inner = getattr(text_encoders[0], "text_model", text_encoders[0])  # transformers >= 5.6 flattened it
        for module in (inner.encoder.layers[-1], inner.final_layer_norm):
            module.requires_grad_(False)

    def size_conditioning(self, batch, num_rows, resolution, device, dtype):
        """Each row's original height and width, the crop's top and left, the trained height and width
        (dataset.py's "instance_time_ids"/"class_time_ids", instance rows first); a whole uncropped
        square where the stream has none."""
        import torch

        parts = [batch[k] for k in ("instance_time_ids", "class_time_ids") if k in batch]
        if not parts:
            row = torch.tensor([resolution, resolution, 0, 0, resolution, resolution], dtype=dtype, device=device)
            return row.expand(num_rows, -1)
        return torch.cat([p.to(device, non_blocking=True) for p in parts]).to(dtype)

    def unet_inputs(self, pooled, time_ids):
        return {"added_cond_kwargs": {"text_embeds": pooled, "time_ids": time_ids}}

    known_vaes = {"madebyollin/sdxl-vae-fp16-fix": "207b116dae70ace3637169f1ddd2434b91b3a8cd"}  # fp16 without NaNs
    kohya_text_prefixes = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
    # its pooled text and size/crop embedding
    unet_extra_prefixes = (("add_embedding.linear_1.", "label_emb.0.0.", {}), ("add_embedding.linear_2.", "label_emb.0.2.", {}))

    def single_file_text_encoders(self, weights):
        return {**{"conditioner.embedders.0.transformer." + k: t for k, t in weights[0].items()},
                **layouts.open_clip_text_encoder(weights[1], "conditioner.embedders.1.model.")}

    # The base models of this family the suite knows by short name (families.KNOWN_MODELS)
    known_models = (
        # UNet 10.3 GB, text encoders 0.5 + 2.8 GB, vae/ and vae_1_0/ 0.3 GB each (fp32; the fp16 variants
        # and the single-file checkpoints at the repository's root are not fetched)
        known.KnownModel("sdxl", "stabilityai/stable-diffusion-xl-base-1.0", "462165984030d82259a11f4367a4eed129e94a7b", 1024,
                         "epsilon", 14.2),
    )


FAMILY = SDXL()

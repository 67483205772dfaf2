"""The FLUX.2 transformer's base, shared by FLUX.2 [klein] and FLUX.2 [dev]: a flow-matching transformer
(Flux2Transformer2DModel: double-stream then single-stream blocks with 4-axis position ids) over the latents of its
own VAE (AutoencoderKLFlux2: 32 channels, each 2x2 patch folded into 128 channels and normalised by the VAE's
batch-norm statistics), one token a latent pixel, conditioned on hidden layers of a text encoder side by side
(out_layers); its LoRA adapters in kohya's names of its original (BFL) layout. Each FLUX.2 family says its text
encoder, tokenizer and released models in its own folder. Ideogram 4 draws over the same VAE (Flux2VAE, random_vae);
Z-Image encodes as FLUX.2 does (mode_posterior) and exports its denoiser's LoRA as FLUX.2 does (q, k and v fused: family.denoiser_kohya_lora)."""

from dreambooth.families.shared import builders
from dreambooth.families.shared import family
from dreambooth.families.shared import fluxblocks
from dreambooth.families.shared import layouts

MAX_TOKENS = 512  # Flux2KleinPipeline's max_sequence_length default, and diffusers' klein script's


def tokens_of(latents):
    """(B, C, h, w) latents -> (B, h x w, C) tokens, one a latent pixel (Flux2KleinPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def mode_posterior(vae, pixels):
    """The posterior of vae's encoding of pixels with its variance at the floor, so that a sample is the mode (what
    diffusers' FLUX.2 and Z-Image scripts and their pipelines encode): its log-variance halves set to the lowest value
    diffusers keeps (-30)."""
    import torch
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    mean = vae.encode(pixels.to(vae.dtype)).latent_dist.mean
    return DiagonalGaussianDistribution(torch.cat([mean, torch.full_like(mean, -30.0)], dim=1))


# What the tiny FLUX.2 models change around random_models.MODEL_SIZES' widths (each family adds its text encoder's)
TINY = dict(resolution_scale=1, layers=1, single_layers=1, head_dim=16, heads=2, rope=(4, 4, 4, 4), text_kv_heads=2,
            text_head_dim=16, vae_latents=8)


# A full FLUX.2 transformer's weights by BFL's names (diffusers' single-file reader maps them back): a double block's
# attention as Flux.1's and its SwiGLU MLPs, a single block's layers and norms, the layers outside the blocks
DOUBLE_NAMES = {**fluxblocks.ATTENTION_NAMES, "ff.linear_in": ("img_mlp.0", None), "ff.linear_out": ("img_mlp.2", None),
                "ff_context.linear_in": ("txt_mlp.0", None), "ff_context.linear_out": ("txt_mlp.2", None)}
SINGLE_NAMES = {**fluxblocks.SINGLE_NORM_NAMES, "attn.to_qkv_mlp_proj": ("linear1", None),
                "attn.to_out": ("linear2", None)}
OUTSIDE_NAMES = {**fluxblocks.EDGE_NAMES, **{f"time_guidance_embed.{embedder}.linear_{i}": f"{theirs}.{layer}"
                                             for embedder, theirs in (("timestep_embedder", "time_in"),
                                                                      ("guidance_embedder", "guidance_in"))
                                             for i, layer in ((1, "in_layer"), (2, "out_layer"))},
                 **{f"{name}.linear": f"{name}.lin" for name in ("double_stream_modulation_img",
                                                                 "double_stream_modulation_txt",
                                                                 "single_stream_modulation")}}


def kohya_module(module):
    """(kohya's module name, the part of its fused layer or None) of a FLUX.2 transformer module's diffusers name: its
    BFL name (lora_unet_double_blocks_<i>_img_attn_qkv: q, k, v; ..._img_attn_proj, ..._single_blocks_<i>_linear1, a
    layer of its own in diffusers too), which ComfyUI's FLUX.2 model keeps (comfy/utils.py flux_to_diffusers)."""
    return layouts.kohya_block_module(module, fluxblocks.block_names(DOUBLE_NAMES, SINGLE_NAMES), ("q", "k", "v"),
                                      "FLUX.2")


def original_name(key):
    """(BFL's name of a FLUX.2 transformer weight or None, its place in a fused qkv or None)."""
    return layouts.block_name(key, fluxblocks.block_names(DOUBLE_NAMES, SINGLE_NAMES), OUTSIDE_NAMES)


def random_vae(widths, depth, latents, latent_size, **config):
    """A FLUX.2 VAE (AutoencoderKLFlux2) of random weights, blocks widths wide and depth deep, of latents channels
    latent_size wide (config: what else it changes), its batch-norm statistics drawn (a fresh one's are 0 and 1, and
    the normalisation would go untested)."""
    import torch
    from diffusers import AutoencoderKLFlux2

    blocks = len(widths)
    vae = AutoencoderKLFlux2(block_out_channels=widths, layers_per_block=depth,
                             down_block_types=("DownEncoderBlock2D",) * blocks,
                             up_block_types=("UpDecoderBlock2D",) * blocks, latent_channels=latents,
                             sample_size=latent_size * 2 ** (blocks - 1), **config)
    if vae.bn.running_mean.device.type != "meta":
        with torch.no_grad():
            vae.bn.running_mean.normal_(0.0, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


class Flux2Models(builders.RandomModels):
    """The FLUX.2 transformer and VAE of random weights (the VAE's batch-norm statistics drawn: a fresh one's are 0 and
    1, and the normalisation would go untested); a FLUX.2 family gives its text encoder and pipeline."""

    block_counts = ("layers", "single_layers")  # (activations.py: each block keeps the same)

    # The released models' VAE shape (each FLUX.2 family's own_sizes start from it)
    _vae = dict(vae_channels=(128, 256, 512, 512), vae_layers=2, vae_latents=32, latent_size=128)
    guidance_embeds = False  # the transformer's guidance input ([dev]'s, guidance-distilled)

    def denoiser(self, spec, latent_size, text_width, extra):
        from diffusers import Flux2Transformer2DModel

        arch = {**self.changes, **spec}
        return Flux2Transformer2DModel(patch_size=1, in_channels=4 * arch["vae_latents"], num_layers=arch["layers"],
                                       num_single_layers=arch["single_layers"], attention_head_dim=arch["head_dim"],
                                       num_attention_heads=arch["heads"], joint_attention_dim=text_width,
                                       axes_dims_rope=arch["rope"], guidance_embeds=self.guidance_embeds)

    def vae(self, spec, latent_size):
        arch = {**self.changes, **spec}
        return random_vae(arch["vae_channels"], arch["vae_layers"], arch["vae_latents"], latent_size)

    @staticmethod
    def scheduler():
        """The released models' scheduler ([klein]'s base models' and [dev]'s, Flux.1 dev's): the pipeline shifts it
        by the image's token count."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                               base_image_seq_len=256, max_image_seq_len=4096)


class Flux2VAE(family.Family):
    """A family over FLUX.2's VAE (AutoencoderKLFlux2): its latents each 2x2 patch folded into one latent pixel's
    channels, normalised by the VAE's batch-norm statistics, the posterior's sample its mode; a family says the
    fold's order (scale_latents, decode_latents)."""

    def size_multiple(self, model_dir):
        """The VAE's downscaling times the 2x2 fold: a latent pixel's pixels."""
        return self.vae_scale(model_dir)

    def vae_class(self):
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2

    def vae_downscale(self, vae_config):
        return 2 ** len(vae_config["block_out_channels"])  # (the VAE's, then the 2x2 fold)

    def latent_channels(self, vae_config):
        return 4 * vae_config["latent_channels"]

    def latent_posterior(self, vae, pixels):
        """The posterior whose sample is its mode (what diffusers' scripts encode): mode_posterior."""
        return mode_posterior(vae, pixels)

    @staticmethod
    def _latent_stats(vae, latents):
        import torch

        options = dict(device=latents.device, dtype=latents.dtype)
        return (vae.bn.running_mean.view(1, -1, 1, 1).to(**options),
                torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(**options))


class Flux2Family(Flux2VAE):
    """A FLUX.2 transformer family; its own folder gives the text encoder it reads (out_layers), its tokenizer and
    token ids, and its released models."""

    denoiser, denoiser_label = "transformer", "transformer"
    # diffusers' klein DreamBooth LoRA script's layers: the double blocks' attention projections, the single blocks'
    # fused qkv-and-MLP input and their output (as a regular expression: the double blocks' to_out is a list)
    denoiser_lora_targets = (r".*\.(to_k|to_q|to_v|to_out\.0|to_qkv_mlp_proj)"
                             r"|.*single_transformer_blocks\.\d+\.attn\.to_out")
    trainable_text_encoders = ()  # frozen, as in diffusers' script
    supports = frozenset({"train", "draw", "export", "export_lora"})
    denoiser_file = True  # (its transformer alone, in BFL's layout: ComfyUI's FLUX.2 files)
    negative_prompt = False  # the pipeline guides against the empty prompt only
    released_resolutions = (1024,)
    text_tokens = MAX_TOKENS  # the text states' length in training (activations.py)

    def native_resolution(self, model_dir):
        """The pipeline's default size (128 latent pixels x the VAE's downscaling: 1024 px); a random model built
        here says its own in its VAE's sample size."""
        return family.part_config(model_dir, "vae")["sample_size"]

    # --- the VAE (Flux2VAE): each 2x2 patch folded as the pipeline's _patchify_latents folds it (channel, row,
    # column)
    def scale_latents(self, vae, latents):
        from diffusers import Flux2KleinPipeline

        mean, std = self._latent_stats(vae, latents)
        return (Flux2KleinPipeline._patchify_latents(latents) - mean) / std

    def decode_latents(self, vae, latents):
        from diffusers import Flux2KleinPipeline

        mean, std = self._latent_stats(vae, latents)
        return vae.decode(Flux2KleinPipeline._unpatchify_latents(latents * std + mean).to(vae.dtype)).sample

    # --- the networks
    def load_denoiser(self, load):
        from diffusers import Flux2Transformer2DModel

        return load(Flux2Transformer2DModel, self.denoiser)

    def encode_text(self, text_encoders, ids):
        """As Flux2KleinPipeline.encode_prompt does: hidden layers out_layers side by side, (N, 512, 3D), every
        token's (the padding's too: the transformer reads them all); no pooled embedding."""
        import torch

        out = text_encoders[0](input_ids=ids[:, 0], attention_mask=ids[:, 1], output_hidden_states=True,
                               use_cache=False)
        states = torch.stack([out.hidden_states[k] for k in self.out_layers], dim=2)  # (N, L, 3, D)
        return states.flatten(2), None

    def meta_side_input(self, denoiser_config, tensor_options):
        return None

    # --- the objective and the denoiser
    flow_matching = True
    default_weighting_scheme = "none"  # diffusers' klein DreamBooth script's default: uniform

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The velocity (B, C, h, w) of noisy latents: a token a latent pixel with its (0, row, column, 0) ids, the
        text tokens with theirs (0, 0, 0, position), the timestep as a fraction of the schedule; the guidance value
        for a guidance-distilled transformer (FLUX.2 dev's), none for [klein]'s."""
        import torch
        from diffusers import Flux2KleinPipeline

        b, c, h, w = noisy.shape
        tokens = tokens_of(noisy)
        if family.config_of(model).guidance_embeds:
            guidance = torch.full((b,), self.guidance(guidance), device=noisy.device)  # (None: the family's)
        else:
            guidance = None
        out = model(hidden_states=tokens, timestep=timesteps / 1000, guidance=guidance, encoder_hidden_states=states,
                    txt_ids=Flux2KleinPipeline._prepare_text_ids(states).to(noisy.device),
                    img_ids=Flux2KleinPipeline._prepare_latent_ids(noisy).to(noisy.device), return_dict=False)[0]
        return out[:, :tokens.shape[1]].permute(0, 2, 1).reshape(b, c, h, w)

    def pipeline_text(self, states, side, negative, negative_side):
        return dict(prompt_embeds=states, negative_prompt_embeds=negative)

    def pipeline_kwargs(self):
        return {"max_sequence_length": MAX_TOKENS, "text_encoder_out_layers": self.out_layers}

    def unpack_latents(self, pipe, latents, height, width):
        """The pipeline's latent output is the VAE's own (its normalisation and fold undone): as the denoiser makes
        them again."""
        return self.scale_latents(pipe.vae, latents)

    def lora_file_layers(self, peft_layers):
        """peft's own names, as diffusers' klein DreamBooth LoRA script writes them."""
        return peft_layers

    # --- export (export.py): kohya's layout of FLUX.2's original modules, which ComfyUI and diffusers load
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (peft names, lora_A/lora_B) in the original FLUX.2 layout
        (kohya_module): lora_unet_ and the original module's name with its dots as underscores, the names ComfyUI
        maps onto each weight of its FLUX.2 model (comfy/lora.py model_lora_keys_unet). A double block's q, k and v
        are one qkv layer there: their adapters joined block-diagonally (family.kohya_lora_tensors: the down weights
        stacked, each up weight in its rows and columns, a part without adapters as zeros, alpha x 3, the scale
        alpha / rank kept); a single block's input and output are one layer each in diffusers too."""
        config = family.part_config(model_dir, self.denoiser)
        width = config["num_attention_heads"] * config["attention_head_dim"]
        return family.denoiser_kohya_lora(self, state_dict, alphas, kohya_module, dict.fromkeys(("q", "k", "v"), width))

    def single_file_denoiser(self, denoiser):
        """The transformer in BFL's layout (original_name), the final layer's modulation as (shift, scale) there
        (diffusers' is (scale, shift))."""
        weights = layouts.joined_layout(denoiser.state_dict(), original_name, self.label)
        return layouts.swap_halves(weights, "final_layer.adaLN_modulation.1.weight")



def script_reference_loss(pipeline_class, guidance):
    """A FLUX.2 family's contract's reference_loss(models, pixels, instance prompt, class prompt, pipe,
    prior_loss_weight) (tests/unit/test_family_contract.py; not used by a run): the loss of
    diffusers' FLUX.2 DreamBooth LoRA scripts (train_dreambooth_lora_flux2_klein.py: guidance None;
    train_dreambooth_lora_flux2.py: its guidance value) on a batch of instance and class pixels, written from their
    steps: the VAE's mode folded 2x2 and normalised, noise, a uniform timestep index into the scheduler's schedule,
    the straight path, the transformer on one token a latent pixel with the ids the pipeline makes, the velocity
    target, the instance and prior means. (Our step draws the posterior's sample, the mode within 3e-7, before the
    noise: the reference draws the same numbers first.)"""
    import torch

    from dreambooth.families.shared import scripts

    def reference(models, pixels, instance_prompt, class_prompt, pipe, prior_loss_weight):
        vae, scheduler = models.vae, models.scheduler
        latents = vae.encode(pixels).latent_dist.mode()
        torch.randn(latents.shape)  # (see above)
        latents = pipeline_class._patchify_latents(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        latents = (latents - mean) / std
        latent_ids = pipeline_class._prepare_latent_ids(latents)
        noise = torch.randn_like(latents)
        rows = latents.shape[0]
        timesteps, sigmas = scripts.uniform_schedule_draw(scheduler, rows)
        noisy = (1.0 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise
        with torch.no_grad():
            (inst, inst_ids), (cls, cls_ids) = (pipe.encode_prompt([p]) for p in (instance_prompt, class_prompt))
        packed = pipeline_class._pack_latents(noisy)
        guided = None if guidance is None else torch.full([1], guidance).expand(rows)
        pred = models.denoiser(hidden_states=packed, timestep=timesteps / 1000, guidance=guided,
                               encoder_hidden_states=torch.cat([inst, cls]), txt_ids=torch.cat([inst_ids, cls_ids]),
                               img_ids=latent_ids, return_dict=False)[0]
        pred = pipeline_class._unpack_latents_with_ids(pred[:, :packed.size(1)], latent_ids)
        return scripts.prior_preserving_mse(pred, noise - latents, prior_loss_weight)

    return reference

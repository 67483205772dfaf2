"""Qwen-Image's VAE, shared by the families drawn over it (Qwen-Image, Krea 2) and by Qwen-Image 2.1 over its RGBA
sibling: a causal video VAE (AutoencoderKLQwenImage) drawn one frame at a time, its latents normalised per channel by
its config's means and deviations, read by a transformer in 2x2 groups of latents; and the prompt states with their
mask, as Qwen-Image's pipelines take them."""

from dreambooth.families.shared import family


def random_vae(arch):
    """Qwen-Image's VAE (AutoencoderKLQwenImage, 16 latent channels) of random weights, of a random model's numbers
    (vae_base, vae_mult, vae_layers, vae_time_down)."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(base_dim=arch["vae_base"], z_dim=16, dim_mult=list(arch["vae_mult"]),
                                  num_res_blocks=arch.get("vae_layers", 1),
                                  temperal_downsample=list(arch["vae_time_down"]))


class QwenVideoVAE(family.Family):
    """A family over Qwen-Image's VAE: its latents one frame of it, normalised per channel, 2x2 of them one token (or
    one slot) of its transformer."""

    default_sample_size = None  # the pipeline's latent size when none is given: each family's own

    def native_resolution(self, model_dir):
        """The pipeline's default size (default_sample_size latent pixels x the VAE's downscaling: 1024 px), or the
        sample size a random model built here records in its transformer's config."""
        config = family.part_config(model_dir, self.denoiser)
        return config.get("sample_size", self.default_sample_size) * self.vae_scale(model_dir)

    def size_multiple(self, model_dir):
        """The VAE's downscaling times 2: 2x2 latents are one token (Qwen-Image 2.1's: one slot) of the transformer."""
        return self.vae_scale(model_dir) * 2

    def vae_class(self):
        from diffusers import AutoencoderKLQwenImage

        return AutoencoderKLQwenImage

    def vae_downscale(self, vae_config):
        return 2 ** len(vae_config["temperal_downsample"])

    def latent_channels(self, vae_config):
        return vae_config["z_dim"]

    def latent_posterior(self, vae, pixels):
        """The posterior of (B, C, H, W) pixels as one frame, its frame axis dropped: (B, z_dim, h, w) latents."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        parameters = vae.encode(pixels.to(vae.dtype).unsqueeze(2)).latent_dist.parameters
        return DiagonalGaussianDistribution(parameters.squeeze(2))

    def scale_latents(self, vae, latents):
        mean, std = self._latent_stats(vae, latents)
        return (latents - mean) / std

    def decode_latents(self, vae, latents):
        """Pixels of latents (scale_latents undone), decoded as one frame: (B, 3, H, W), or the RGBA (B, 4, H, W)
        of Qwen-Image 2.1's VAE, as the pipelines draw them."""
        mean, std = self._latent_stats(vae, latents)
        return vae.decode((latents * std + mean).to(vae.dtype).unsqueeze(2)).sample[:, :, 0]

    @staticmethod
    def _latent_stats(vae, latents):
        import torch

        shape = (1, vae.config.z_dim, 1, 1)
        return (torch.tensor(vae.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape),
                torch.tensor(vae.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape))


class MaskedPrompts:
    """A family's text side as Qwen-Image's pipelines take it (before the Family it is mixed into): the prompt states
    with their mask (N, L), encode_text's second value in the place of a pooled embedding."""

    def meta_side_input(self, denoiser_config, tensor_options):
        return None  # (no mask: every text token is read)

    def pipeline_text(self, states, side, negative, negative_side):
        return dict(prompt_embeds=states, prompt_embeds_mask=side, negative_prompt_embeds=negative,
                    negative_prompt_embeds_mask=negative_side)

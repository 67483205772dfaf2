"""Qwen-Image's VAE, shared by the families drawn over it (Qwen-Image, Krea 2): a causal video VAE
(AutoencoderKLQwenImage) drawn one frame at a time, its latents normalised per channel by its config's means and
deviations."""

from dreambooth.families.shared import family


class QwenVideoVAE(family.Family):
    """A family over Qwen-Image's VAE: its latents one frame of it, normalised per channel."""

    def vae_class(self):
        from diffusers import AutoencoderKLQwenImage

        return AutoencoderKLQwenImage

    def vae_downscale(self, vae_config):
        return 2 ** len(vae_config["temperal_downsample"])

    def latent_channels(self, vae_config):
        return vae_config["z_dim"]

    def latent_posterior(self, vae, pixels):
        """The posterior of (B, 3, H, W) pixels as one frame, its frame axis dropped: (B, 16, h, w) latents."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        parameters = vae.encode(pixels.to(vae.dtype).unsqueeze(2)).latent_dist.parameters
        return DiagonalGaussianDistribution(parameters.squeeze(2))

    def scale_latents(self, vae, latents):
        mean, std = self._latent_stats(vae, latents)
        return (latents - mean) / std

    def decode_latents(self, vae, latents):
        mean, std = self._latent_stats(vae, latents)
        return vae.decode((latents * std + mean).to(vae.dtype).unsqueeze(2)).sample[:, :, 0]

    @staticmethod
    def _latent_stats(vae, latents):
        import torch

        shape = (1, vae.config.z_dim, 1, 1)
        return (torch.tensor(vae.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape),
                torch.tensor(vae.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape))

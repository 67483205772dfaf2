"""How a family's models with random weights are built: the real diffusers and transformers classes at the
widths of models/random_models.py's MODEL_SIZES, or of a family's own full sizes. cache_model.py --tiny and
--random_model write them, the tests and the GPU benchmarks train them, and memory.py counts a released model's
parameters on the meta device through them. A run never builds one: it loads the folder these wrote, through
the family's own interface (family.Family), which knows nothing of this one.

Each family module has one subclass of RandomModels, its Family's `random`.
"""


class RandomModels:
    """What a family's random models are and how each network is built; the methods that raise
    NotImplementedError are the ones a family must give."""

    arch = ""  # the --arch name of its random models (families.ARCHS)
    note = ""  # what they are, for cache_model.py --help
    changes = {}  # what they change around random_models.MODEL_SIZES' widths (also in their revision)
    own_sizes = {}  # its full-size models' shapes ({--random_model name: spec}) beside random_models.MODEL_SIZES

    def text_encoders(self, spec, tokenizer):
        """({subfolder: random text encoder}, the denoiser's text width, the denoiser's extra config) for a
        random_models.MODEL_SIZES spec."""
        raise NotImplementedError

    def denoiser(self, spec, latent_size, text_width, extra):
        """A random denoiser of a spec for latent_size latents, reading text states text_width wide, with extra
        config from text_encoders."""
        raise NotImplementedError

    def vae_config(self):
        """What its random VAE changes in AutoencoderKL's config."""
        return {}

    def vae(self, spec, latent_size):
        """A random VAE of a spec whose latents are latent_size wide (AutoencoderKL, vae_config's changes)."""
        from diffusers import AutoencoderKL

        blocks = len(spec["vae_channels"])
        return AutoencoderKL(block_out_channels=spec["vae_channels"], layers_per_block=spec["vae_layers"],
                             down_block_types=("DownEncoderBlock2D",) * blocks,
                             up_block_types=("UpDecoderBlock2D",) * blocks,
                             sample_size=latent_size * 2 ** (blocks - 1),
                             **{"latent_channels": 4, **self.vae_config()})

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        """The family's pipeline of the random networks nets, with its released models' scheduler."""
        raise NotImplementedError

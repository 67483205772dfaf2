"""A base model the suite knows by short name (sd14 ... sd35-large): each family lists its own
(Family.known_models), pinned to a commit, with what the preflight needs before the files are here
(resolution, download size), and whether the hub serves it only with a token (gated)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A base model by short name, pinned to a commit: changing the name never keeps another's revision."""

    short_name: str
    hub_name: str
    revision: str
    resolution: int  # what it was trained at, the default --resolution
    prediction_type: str
    weights_gb: float  # the safetensors of its diffusers folders, what cache_model.py fetches
    family: str = ""  # the family that lists it (families.FAMILIES' name): known before the files are here
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

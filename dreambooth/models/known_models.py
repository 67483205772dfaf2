"""The base models the suite knows by short name (sd14 ... sd35-large), as the families list them
(families/shared/known.py): found by any of their names, and what a gated one needs before its download."""

import difflib
import os

from dreambooth import errors
from dreambooth import families

KNOWN_MODELS = families.KNOWN_MODELS  # (each family lists its own: Family.known_models)


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


def check_name(model_name, variable="ORIG_MODEL_NAME"):
    """UserError for a model name that is neither a short name, a hub name (owner/name) nor a folder here: a typo
    of a short name (sd-14) said before anything is fetched, with the nearest short names."""
    if known_model(model_name) or "/" in model_name or os.path.isdir(model_name) or model_name == "tiny":
        return
    names = [m.short_name for m in KNOWN_MODELS]
    close = list(dict.fromkeys([n for n in names if n.startswith(model_name.lower())]
                               + difflib.get_close_matches(model_name.lower(), names, n=2, cutoff=0.6)))[:2]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise errors.UserError(f"{variable}={model_name} is not a short name ({', '.join(names)}) nor a hub name "
                           f"(owner/name): {hint}(README, 'Models')")

"""The Hugging Face hub and the libraries around it: downloads in one line per failure, a reachability
check, quiet loading, and optional packages kept out of a process that does not use them."""

import os
import sys

from dreambooth import errors


def skip_unused_imports(lora=False, eight_bit=False):
    """In a process of its own (a Ray actor or worker, a script's main), hide peft and bitsandbytes
    from diffusers and transformers when this process will not use them: both import every
    optional package they find installed (bitsandbytes pulls in torch's inductor), 1.4 s of each
    process that imports diffusers. A None entry in sys.modules is Python's own mark for "not
    importable". Call before the first import of diffusers; never in a process that may need them
    later (the test suite's own)."""
    for name, needed in (("peft", lora), ("bitsandbytes", eight_bit)):
        if not needed and name not in sys.modules:
            sys.modules[name] = None


def hub_reachable():
    """Whether the hub (HF_ENDPOINT, else huggingface.co) takes a connection within 3 s."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except (OSError, ValueError):
        return False
    return True


def hub_download(what, offline_hint, refused=None, **snapshot_args):
    """huggingface_hub.snapshot_download(**snapshot_args), every failure one errors.UserError line (refused: the line
    for a gated repository the hub refuses, else a general one).

    An uncached file with the hub out of reach raises LocalEntryNotFoundError on hub 0.x
    and OfflineModeIsEnabled on 1.x with HF_HUB_OFFLINE set; both say what to do instead.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.errors import OfflineModeIsEnabled

    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes", "on") and not hub_reachable():
        # the cache alone, at once: the hub's client would retry five times (about 20 s, a line each) first
        snapshot_args["local_files_only"] = True
    try:
        return snapshot_download(**snapshot_args)
    except GatedRepoError as err:
        if refused:
            raise errors.UserError(f"the hub refused {what} ({type(err).__name__}): {refused}") from None
        raise errors.UserError(f"cannot fetch {what}: the hub refused it ({type(err).__name__}): it is gated; accept its "
                        "license on its hub page and give this machine a token (`hf auth login` or HF_TOKEN)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        raise errors.UserError(f"{what} is not in the cache {snapshot_args.get('cache_dir') or 'of the hub'} and the hub "
                        f"cannot be reached ({type(err).__name__}); "
                        f"{offline_hint}") from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise errors.UserError(f"cannot fetch {what}: {type(err).__name__}: {first}") from None


def quiet_hf_logging():
    """Silence per-component loading bars and the missing-accelerate notice in workers, and diffusers' own
    deprecation note about its own Chroma transformer's FluxPosEmbed (once a process builds one)."""
    import warnings

    import diffusers
    import transformers

    warnings.filterwarnings("ignore", message="`FluxPosEmbed` is deprecated", category=FutureWarning)

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

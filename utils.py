"""What every script shares (one-line errors and the exit, atomic writes, hub downloads) is
dreambooth/utils.py; this module hands it on under the name Ray's example uses."""

from dreambooth.utils import *  # noqa: F401,F403

"""What every script shares, under the name Ray's example uses: one-line errors and the exit
(dreambooth/errors.py), files and atomic writes (dreambooth/files.py), the hub (dreambooth/hub.py)
and this machine (dreambooth/machine.py)."""

from dreambooth.errors import *  # noqa: F401,F403
from dreambooth.files import *  # noqa: F401,F403
from dreambooth.hub import *  # noqa: F401,F403
from dreambooth.machine import *  # noqa: F401,F403

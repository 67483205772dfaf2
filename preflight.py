"""Before Step 1 of dreambooth_run.sh: everything that would fail hours later, checked in seconds.

The script; its code is dreambooth/preflight.py. `python preflight.py --help` lists its flags.
"""

from dreambooth import preflight
from dreambooth import utils

if __name__ == "__main__":
    utils.run_main(preflight.main)

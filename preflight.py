"""Before Step 1 of dreambooth_run.sh: everything that would fail hours later, checked in seconds.

The script; its code is dreambooth/commands/preflight.py. `python preflight.py --help` lists its flags.
"""

from dreambooth import errors
from dreambooth.commands import preflight

if __name__ == "__main__":
    errors.run_main(preflight.main)

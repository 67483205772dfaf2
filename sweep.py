"""Find the best fine-tune: a Ray Tune sweep of train.py scored by evaluate.py, for one subject or many.

The script; its code is dreambooth/commands/sweep.py. `python sweep.py --help` lists its flags.
"""

from dreambooth import errors
from dreambooth.commands import sweep

if __name__ == "__main__":
    errors.run_main(sweep.main)

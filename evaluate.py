"""Step 6: does it look like the subject? Score a tuned model the way the DreamBooth paper does.

The script; its code is dreambooth/commands/evaluate.py. `python evaluate.py --help` lists its flags.
"""

from dreambooth import errors
from dreambooth.commands import evaluate

if __name__ == "__main__":
    errors.run_main(evaluate.main)

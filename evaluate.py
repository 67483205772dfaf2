"""Step 6: does it look like the subject? Score a tuned model the way the DreamBooth paper does.

The script; its code is dreambooth/evaluate.py. `python evaluate.py --help` lists its flags.
"""

from dreambooth import evaluate
from dreambooth import utils

if __name__ == "__main__":
    utils.run_main(evaluate.main)

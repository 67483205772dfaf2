"""Step 4: DreamBooth fine-tuning of UNet + text encoder on Ray Train workers.

The script; its code is dreambooth/commands/train.py. `python train.py --help` lists its flags.
"""

from dreambooth import errors
from dreambooth.commands import train
from dreambooth.training.worker import train_fn  # noqa: F401 (each worker's loop, where Ray's example has it)

if __name__ == "__main__":
    errors.run_main(train.main)

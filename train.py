"""Step 4: DreamBooth fine-tuning of UNet + text encoder on Ray Train workers.

The script; its code is dreambooth/train.py. `python train.py --help` lists its flags.
"""

from dreambooth import train, utils

if __name__ == "__main__":
    utils.run_main(train.main)

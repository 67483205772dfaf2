"""Step 2 (example): fetch the example dog photos into a folder.

The script; its code is dreambooth/commands/download_example_dataset.py. `python download_example_dataset.py --help` lists its flags.
"""

from dreambooth import errors
from dreambooth.commands import download_example_dataset

if __name__ == "__main__":
    errors.run_main(download_example_dataset.main)

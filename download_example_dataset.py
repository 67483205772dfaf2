"""Step 2 (example): fetch the example dog photos into a folder.

The script; its code is dreambooth/download_example_dataset.py. `python download_example_dataset.py --help` lists its flags.
"""

from dreambooth import download_example_dataset
from dreambooth import errors

if __name__ == "__main__":
    errors.run_main(download_example_dataset.main)

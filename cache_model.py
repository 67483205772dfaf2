"""Step 1: fetch a pinned Stable Diffusion revision into a hub-layout cache folder.

The script; its code is dreambooth/commands/cache_model.py. `python cache_model.py --help` lists its flags.
"""

from dreambooth import errors
from dreambooth import hub
from dreambooth.commands import cache_model

if __name__ == "__main__":
    hub.skip_unused_imports()  # building or fetching a model uses neither
    errors.run_main(cache_model.main)

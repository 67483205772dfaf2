"""Generate images with a Stable Diffusion model on a Ray Data actor pool.

The script; its code is dreambooth/commands/generate.py. `python generate.py --help` lists its flags.
"""

from dreambooth import errors
from dreambooth.commands import generate

if __name__ == "__main__":
    errors.run_main(generate.main)

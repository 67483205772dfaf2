"""Serve every trained subject over HTTP from one pool of replicas (Ray Serve).

The script; its code is dreambooth/commands/serve.py. `python serve.py --help` lists its flags.
"""

from dreambooth import errors
from dreambooth.commands import serve

if __name__ == "__main__":
    errors.run_main(serve.main)

"""Export a tuned model as one .safetensors file for AUTOMATIC1111, ComfyUI and other SD tools.

The script; its code is dreambooth/commands/export.py. `python export.py --help` lists its flags.
"""

from dreambooth import errors
from dreambooth.commands import export

if __name__ == "__main__":
    errors.run_main(export.main)

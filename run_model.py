"""Generate images with a Stable Diffusion model: the name Ray's AIR DreamBooth example uses.

Same flags as generate.py (this is generate.py under another name), so the AIR commands run
unchanged:

    python run_model.py --model_dir=$TUNED_MODEL_DIR --output_dir=$IMAGES_NEW_DIR \\
        --prompts="photo of unqtkn dog in a bucket" --num_samples_per_prompt=5
"""

from dreambooth import errors
from dreambooth.commands import generate

main = generate.main

if __name__ == "__main__":
    errors.run_main(main)

"""Step 4: DreamBooth fine-tuning of UNet + text encoder on Ray Train workers.

    python train.py --model_dir=$ORIG_MODEL_PATH --output_dir=$TUNED_MODEL_DIR \\
        --instance_images_dir=$IMAGES_OWN_DIR --instance_prompt="photo of unqtkn dog" \\
        --class_images_dir=$IMAGES_REG_DIR --class_prompt="photo of a dog" \\
        --train_batch_size=2 --lr=5e-6 --max_train_steps=200 --num_workers=2

The driver (training/driver.py) checks the inputs, plans the steps (planning/), builds the Ray Data pipeline
and runs `worker.train_fn` on Ray Train's workers; each worker wires the step math of training/steps.py to Ray
Train (training/worker.py). Models and their options are in models/networks.py, the checkpoint's contents in
training/checkpoint.py. fp32 master weights with autocast (bf16 by default on GPUs that have
it): 5e-6 AdamW updates vanish when the weights themselves are bf16.
"""


from dreambooth.planning import planning
from dreambooth.training import driver


def main(argv=None):
    return driver.run(planning.parse_args(argv, __doc__.splitlines()[0]))

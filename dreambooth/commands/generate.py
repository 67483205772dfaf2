"""Generate images with a Stable Diffusion model on a Ray Data actor pool.

Before training it makes the class (regularisation) images; after, images of your subject:

    python generate.py --model_dir=$ORIG_MODEL_PATH --output_dir=$IMAGES_REG_DIR \\
        --prompts="photo of a dog" --num_samples_per_prompt=200
    python generate.py --model_dir=$TUNED_MODEL_DIR --output_dir=$IMAGES_NEW_DIR \\
        --prompts="photo of unqtkn dog in a bucket" --num_samples_per_prompt=5

After `train.py --use_lora`, $TUNED_MODEL_DIR holds adapters only: pass it as --model_dir (the base model is
read from its record) or as --lora_dir beside the base --model_dir; either may be a bucket's (s3://…).

Image i of a prompt is '<prompt-slug>-<i:05d>.png', drawn from a seed derived from --seed, the prompt and i:
a rerun keeps what exists and makes only what is missing, and gives the same pixels an uninterrupted run
would. The folder's record (dreambooth_images.json) names the model and the settings that drew it: a run with another
model, prompt, resolution, seed, step count or guidance stops with one line instead of mixing its images in
(--force replaces them). Several prompts: repeat the value (--prompts 'a dog, oil painting' 'a cat') or
--prompts_file; commas stay inside a prompt. A contact sheet of them all: <output_dir>/grid/grid.png.

Class images come from the base model without its safety checker (a flagged image would be saved black and
trained on as a dog); images from a tuned model are checked, and a flagged one is not saved:
'<name>.png.flagged' marks it as done, and a line says so.
"""

import os
import sys

from dreambooth import families
from dreambooth import files
from dreambooth import storage
from dreambooth.config import flags
from dreambooth.generation import drawing
from dreambooth.generation import image_records
from dreambooth.generation import imaging
from dreambooth.generation import prompts
from dreambooth.models import outputs
from dreambooth.planning import model_flags


def main(argv=None):
    parser = flags.make_parser(
        __doc__.splitlines()[0],
        ["model_dir", "output_dir", "prompts", "prompts_file", "num_samples_per_prompt", "batch_size",
         "num_inference_steps", "guidance_scale", "negative_prompt", "seed", "resolution",
         "lora_dir", "lora_scale", "num_actors", "safety_checker", "force", "class_images", "use_ray_data",
         "allow_unsafe_weights"],
        config=True, types={"output_dir": flags.storage_location},
        helps={"output_dir": "Where the images go: a folder, or a bucket's (s3://bucket/prefix, gs://…), filled "
                             "through this node's copy of it (docs/CLUSTER.md, Object storage)."},
    )
    args = model_flags.resolve_models(parser.parse_args(argv))
    texts = prompts.prompts_of(args.prompts, args.prompts_file)
    model = outputs.resolve_model(args.model_dir, args.lora_dir, args.lora_scale)
    families.check_model_dir(model.model_dir, args.allow_unsafe_weights)
    tuned = outputs.read_output(model.lora_dir or model.model_dir)
    if tuned and (warning := prompts.without_the_subject(texts, tuned.record.instance_prompt,
                                                          tuned.record.class_prompt)):
        print(warning, file=sys.stderr)
    files.check_output_path(args.output_dir, "--output_dir", [("--model_dir", model.model_dir),
                                                              ("--lora_dir", model.lora_dir)])
    settings = drawing.settings_for(drawing.ImageSettings(args.num_inference_steps, args.guidance_scale, args.negative_prompt,
                                                          args.resolution, args.seed, args.allow_unsafe_weights),
                                    families.family_of(model.model_dir), model.model_dir)  # (a refusal before any folder)
    remedy = "pass --force to delete those images and draw these" + (
        " (dreambooth_run.sh: set IMAGES_REG_DIR to another folder, or delete this one)" if args.class_images else "")
    with storage.output_folder(args.output_dir) as folder:  # (a bucket's: filled here, copied there)
        job = drawing.top_up(folder, model, texts, args.num_samples_per_prompt, settings,
                             drawing.use_safety_checker(args.safety_checker, model), on_mismatch="force" if args.force else "error",
                             remedy=remedy, class_images=args.class_images, where=args.output_dir)
        flags.write_config(os.path.join(folder, image_records.IMAGES_CONFIG), flags.config_text(parser, args))
        drawing.make_images_of([job], settings, args.batch_size, args.num_actors)
        wanted = [p for paths in drawing.wanted_files(folder, texts, args.num_samples_per_prompt).values() for p in paths]
        imaging.write_grid(os.path.join(folder, drawing.GRID_DIR, "grid.png"), wanted)
    all_files = [os.path.basename(p) for p in wanted]
    grid = storage.join(args.output_dir, drawing.GRID_DIR, "grid.png")
    print(f"{len(all_files)} images in {args.output_dir}; contact sheet {grid}", file=sys.stderr)
    return all_files



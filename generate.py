"""Generate images with a Stable Diffusion model on a Ray Data actor pool.

Before training it makes the class (regularisation) images; after, images of your subject:

    python generate.py --model_dir=$ORIG_MODEL_PATH --output_dir=$IMAGES_REG_DIR \\
        --prompts="photo of a dog" --num_samples_per_prompt=200
    python generate.py --model_dir=$TUNED_MODEL_DIR --output_dir=$IMAGES_NEW_DIR \\
        --prompts="photo of unqtkn dog in a bucket" --num_samples_per_prompt=5

Image i of a prompt is '<prompt-slug>-<i:05d>.png', drawn from a seed derived from
--seed, the prompt and i: a rerun keeps what exists and makes only what is missing,
and gives the same pixels an uninterrupted run would. A contact sheet of all the
requested images is written to <output_dir>/grid/grid.png.
"""

import math
import os
import sys

import flags
import utils


def plan_images(prompts, num_per_prompt, seed, output_dir):
    """Rows for the images still missing in output_dir, and the file names of all requested.

    Returns (missing_rows, all_files); a row is {"prompt", "seed", "file"}.
    """
    rows, all_files, slugs = [], [], {}
    for prompt in prompts:
        slug = utils.slugify(prompt)
        if slugs.setdefault(slug, prompt) != prompt:
            raise utils.UserError(f"prompts {slugs[slug]!r} and {prompt!r} would share file names; make them differ")
        for index in range(num_per_prompt):
            name = utils.image_file_name(prompt, index)
            all_files.append(name)
            if not os.path.exists(os.path.join(output_dir, name)):
                rows.append({"prompt": prompt, "seed": utils.image_seed(seed, prompt, index), "file": name})
    return rows, all_files


def make_grid(images, thumb_size=128):
    """Contact sheet: images (PIL, any size) as thumb_size squares in a near-square grid."""
    from PIL import Image

    cols = max(1, math.ceil(math.sqrt(len(images))))
    rows = max(1, math.ceil(len(images) / cols))
    sheet = Image.new("RGB", (cols * thumb_size, rows * thumb_size), "white")
    for k, image in enumerate(images):
        thumb = image.convert("RGB").resize((thumb_size, thumb_size))
        sheet.paste(thumb, ((k % cols) * thumb_size, (k // cols) * thumb_size))
    return sheet


def write_grid(output_dir, files):
    from PIL import Image

    images = []
    for name in files:
        with Image.open(os.path.join(output_dir, name)) as image:
            images.append(image.copy())
    os.makedirs(os.path.join(output_dir, utils.GRID_DIR), exist_ok=True)
    path = os.path.join(output_dir, utils.GRID_DIR, "grid.png")
    utils.save_image_atomic(make_grid(images), path)
    return path


def load_pipeline(model_dir, device, allow_unsafe_weights=False):
    """The SD pipeline in fp16 on GPU, fp32 on CPU; safetensors weights only unless allowed, no remote code."""
    import torch
    from diffusers import StableDiffusionPipeline

    utils.quiet_hf_logging()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    pipe = StableDiffusionPipeline.from_pretrained(model_dir, dtype=dtype,
                                                   use_safetensors=utils.safetensors_only(allow_unsafe_weights))
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def generate_batch(pipe, prompts, seeds, settings):
    """Run the pipeline once for a batch. One CPU generator per image: the noise of an
    image depends on its seed alone, not on the batch it lands in or the device."""
    import torch

    generators = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
    negative = settings.get("negative_prompt")
    resolution = settings.get("resolution")
    return pipe(
        prompt=list(prompts),
        negative_prompt=[negative] * len(prompts) if negative else None,
        num_inference_steps=settings["num_inference_steps"],
        guidance_scale=settings["guidance_scale"],
        height=resolution,
        width=resolution,
        generator=generators,
    ).images


class ImageGenerator:
    """Ray Data actor: loads the pipeline once, turns each batch of rows into PNG files.

    Batch in: {"prompt": (B,) str, "seed": (B,) int, "file": (B,) str}. Batch out: {"file": (B,)}.
    """

    def __init__(self, model_dir, output_dir, settings):
        import torch

        device = utils.torch_device()
        if device.type == "cpu":
            # Ray sets OMP_NUM_THREADS to the actor's one reserved CPU; CPU actors share the cores.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings["num_actors"]))
        self.pipe = load_pipeline(model_dir, device, settings["allow_unsafe_weights"])
        self.output_dir = output_dir
        self.settings = settings

    def __call__(self, batch):
        images = generate_batch(self.pipe, batch["prompt"], batch["seed"], self.settings)
        for image, name in zip(images, batch["file"]):
            utils.save_image_atomic(image, os.path.join(self.output_dir, str(name)))
        return {"file": batch["file"]}


def run_actor_pool(rows, args, num_actors):
    """Fan rows out to the actor pool; yields file names as images land."""
    import ray

    num_gpus = 1 if utils.cluster_gpus() else 0
    settings = {
        "num_inference_steps": args.num_inference_steps,
        "guidance_scale": args.guidance_scale,
        "negative_prompt": args.negative_prompt,
        "resolution": args.resolution,
        "allow_unsafe_weights": args.allow_unsafe_weights,
        "num_actors": num_actors,
    }
    ds = ray.data.from_items(rows).map_batches(
        ImageGenerator,
        fn_constructor_args=(args.model_dir, args.output_dir, settings),
        batch_size=args.batch_size,
        compute=ray.data.ActorPoolStrategy(size=num_actors),
        num_gpus=num_gpus,
    )
    for batch in ds.iter_batches(batch_size=None):
        yield from batch["file"]


def default_num_actors():
    """One actor per GPU of the cluster; one CPU actor where there are none."""
    return max(1, utils.cluster_gpus())


def main(argv=None):
    parser = flags.make_parser(
        __doc__.splitlines()[0],
        ["model_dir", "output_dir", "prompts", "num_samples_per_prompt", "batch_size",
         "num_inference_steps", "guidance_scale", "negative_prompt", "seed", "resolution",
         "num_actors", "use_ray_data", "allow_unsafe_weights"],
    )
    args = parser.parse_args(argv)
    prompts = list(dict.fromkeys(p for group in args.prompts for p in group))
    utils.check_model_dir(args.model_dir, args.allow_unsafe_weights)
    os.makedirs(args.output_dir, exist_ok=True)
    utils.remove_temp_files(args.output_dir)
    rows, all_files = plan_images(prompts, args.num_samples_per_prompt, args.seed, args.output_dir)
    print(f"{len(all_files) - len(rows)} of {len(all_files)} images already in {args.output_dir}; "
          f"generating {len(rows)}", file=sys.stderr)
    if rows:
        from tqdm import tqdm

        ray = utils.init_ray()
        ray.data.DataContext.get_current().enable_progress_bars = False
        num_actors = args.num_actors or default_num_actors()
        try:
            with tqdm(total=len(rows), desc=f"generating on {num_actors} actor(s)", unit="img") as bar:
                for _ in run_actor_pool(rows, args, num_actors):
                    bar.update(1)
        except KeyboardInterrupt:
            print("stopped; the images written so far are complete: rerun the same command to make "
                  "the rest", file=sys.stderr)
            raise
    grid = write_grid(args.output_dir, all_files)
    print(f"{len(all_files)} images in {args.output_dir}; contact sheet {grid}", file=sys.stderr)
    return all_files


if __name__ == "__main__":
    utils.run_main(main)

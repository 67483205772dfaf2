"""Generate images with a Stable Diffusion model on a Ray Data actor pool.

Before training it makes the class (regularisation) images; after, images of your subject:

    python generate.py --model_dir=$ORIG_MODEL_PATH --output_dir=$IMAGES_REG_DIR \\
        --prompts="photo of a dog" --num_samples_per_prompt=200
    python generate.py --model_dir=$TUNED_MODEL_DIR --output_dir=$IMAGES_NEW_DIR \\
        --prompts="photo of unqtkn dog in a bucket" --num_samples_per_prompt=5

After `train.py --use_lora`, $TUNED_MODEL_DIR holds adapters only: pass it as --model_dir
(the base model is read from its record) or as --lora_dir beside the base --model_dir.

Image i of a prompt is '<prompt-slug>-<i:05d>.png', drawn from a seed derived from
--seed, the prompt and i: a rerun keeps what exists and makes only what is missing,
and gives the same pixels an uninterrupted run would. A contact sheet of all the
requested images is written to <output_dir>/grid/grid.png.

Class images come from the base model without its safety checker (a flagged image
would be saved black and trained on as a dog); images from a tuned model are checked,
and a flagged one is not saved: '<name>.png.flagged' marks it as done, and a line says so.
"""

import hashlib
import math
import os
import sys

import cache_model
import flags
import utils

FLAGGED_SUFFIX = ".flagged"  # beside the name of an image the safety checker withheld
GRID_DIR = "grid"  # the contact sheet's folder inside --output_dir


def image_file_name(prompt, index):
    """Stable file name of the index-th image of a prompt: '<slug>-<index:05d>.png'."""
    return f"{utils.slugify(prompt)}-{index:05d}{utils.IMAGE_SUFFIX}"


def image_seed(base_seed, prompt, index):
    """Deterministic 31-bit seed for one image, from the run seed, its prompt and index.

    Independent of batch size, actor count and which images already exist, so a rerun
    that tops up a folder draws exactly the images an uninterrupted run would.
    """
    key = f"{base_seed}:{prompt}:{index}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") & 0x7FFFFFFF


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
            name = image_file_name(prompt, index)
            all_files.append(name)
            path = os.path.join(output_dir, name)
            if not os.path.exists(path) and not os.path.exists(path + FLAGGED_SUFFIX):
                rows.append({"prompt": prompt, "seed": image_seed(seed, prompt, index), "file": name})
    return rows, all_files


def make_grid(images, thumb_size=128, columns=None):
    """Contact sheet: images (PIL, any size) as thumb_size squares, columns to a row
    (default: a near-square grid)."""
    from PIL import Image

    cols = columns or max(1, math.ceil(math.sqrt(len(images))))
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
        if not os.path.exists(os.path.join(output_dir, name)):
            continue  # withheld by the safety checker
        with Image.open(os.path.join(output_dir, name)) as image:
            images.append(image.copy())
    os.makedirs(os.path.join(output_dir, GRID_DIR), exist_ok=True)
    path = os.path.join(output_dir, GRID_DIR, "grid.png")
    utils.save_image_atomic(make_grid(images), path)
    return path


def use_safety_checker(setting, model_dir, lora_dir=None):
    """--safety_checker auto|on|off -> bool. auto: on only for a model or adapters train.py wrote."""
    if setting == "auto":
        return any(d and os.path.isfile(os.path.join(d, utils.OUTPUT_MARKER)) for d in (model_dir, lora_dir))
    return setting == "on"


def resolve_lora(model_dir, lora_dir):
    """(base model folder, LoRA folder or None) of --model_dir/--lora_dir. A LoRA output of
    train.py given as --model_dir stands for its base model with its adapters."""
    if lora_dir is None and os.path.isfile(os.path.join(model_dir, utils.LORA_WEIGHTS_FILE)):
        record = os.path.join(model_dir, utils.OUTPUT_MARKER)
        if not os.path.isfile(record):
            raise utils.UserError(f"{model_dir} holds LoRA adapters: pass the base model as --model_dir and "
                                  f"this folder as --lora_dir")
        model_dir, lora_dir = utils.read_json(record)["base_model"], model_dir
        print(f"LoRA adapters of {lora_dir} on their base model {model_dir}", file=sys.stderr)
    if lora_dir and not os.path.isfile(os.path.join(lora_dir, utils.LORA_WEIGHTS_FILE)):
        raise utils.UserError(f"--lora_dir {lora_dir} has no {utils.LORA_WEIGHTS_FILE}")
    return model_dir, lora_dir


def load_pipeline(model_dir, device, allow_unsafe_weights=False, safety_checker=False, lora_dir=None,
                  lora_scale=1.0):
    """The SD pipeline in fp16 on GPU, fp32 on CPU; safetensors weights only unless allowed, no remote code.

    Without safety_checker the model's checker is not even loaded. LoRA adapters from
    lora_dir are fused into the weights at lora_scale: generation runs at the base model's speed.
    """
    import torch
    from diffusers import StableDiffusionPipeline

    import models

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    kwargs = {} if safety_checker else {"safety_checker": None, "requires_safety_checker": False}
    pipe = models.from_pretrained(StableDiffusionPipeline, model_dir, allow_unsafe_weights, dtype=dtype, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    if lora_dir:
        pipe.load_lora_weights(lora_dir, weight_name=utils.LORA_WEIGHTS_FILE)
        pipe.fuse_lora(lora_scale=lora_scale)
        pipe.unload_lora_weights()  # the fused weights stay; the adapter layers go
    return pipe.to(device)


def generate_batch(pipe, prompts, seeds, settings):
    """Run the pipeline once for a batch. One CPU generator per image: the noise of an
    image depends on its seed alone, not on the batch it lands in or the device."""
    import torch

    generators = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
    negative = settings.get("negative_prompt")
    resolution = settings.get("resolution")
    out = pipe(
        prompt=list(prompts),
        negative_prompt=[negative] * len(prompts) if negative else None,
        num_inference_steps=settings["num_inference_steps"],
        guidance_scale=settings["guidance_scale"],
        height=resolution,
        width=resolution,
        generator=generators,
    )
    return out.images, list(out.nsfw_content_detected or [False] * len(out.images))


class ImageGenerator:
    """Ray Data actor: turns each batch of rows into PNG files, for one model or several.

    models: [{"model_dir", "output_dir", "lora_dir", "lora_scale", "safety_checker"}].
    Batch in: {"model": (B,) index into models, "prompt": (B,) str, "seed": (B,) int, "file": (B,) str}.
    Batch out: {"model", "file", "flagged": (B,) bool (withheld by the safety checker)}.
    The actor holds one pipeline at a time and loads another when the rows' model changes;
    rows arrive grouped by model, so that happens about once per model.
    """

    def __init__(self, models, settings):
        self.device = utils.torch_device()
        if self.device.type == "cpu":
            utils.share_cpu_threads(settings["num_actors"])
        self.models, self.settings = models, settings
        self.loaded, self.pipe = None, None
        self.pipeline(0)

    def pipeline(self, index):
        if index != self.loaded:
            model = self.models[index]
            self.pipe = None  # the previous model's memory goes before the next one loads
            self.pipe = load_pipeline(model["model_dir"], self.device, self.settings["allow_unsafe_weights"],
                                      model["safety_checker"], model.get("lora_dir"), model.get("lora_scale", 1.0))
            self.loaded = index
        return self.pipe

    def __call__(self, batch):
        import numpy as np

        flagged = np.zeros(len(batch["file"]), dtype=bool)
        for index in dict.fromkeys(batch["model"].tolist()):
            rows = np.flatnonzero(batch["model"] == index)
            images, bad = generate_batch(self.pipeline(index), batch["prompt"][rows], batch["seed"][rows],
                                         self.settings)
            for row, image, is_bad in zip(rows, images, bad):
                path = os.path.join(self.models[index]["output_dir"], str(batch["file"][row]))
                if is_bad:
                    open(path + FLAGGED_SUFFIX, "w").close()
                else:
                    utils.save_image_atomic(image, path)
                flagged[row] = is_bad
        return {"model": batch["model"], "file": batch["file"], "flagged": flagged}


def model_spec(model_dir, output_dir, settings):
    """The model entry ImageGenerator takes: a model folder, where its images go, and from
    settings its LoRA adapters (lora_dir, lora_scale) and safety_checker."""
    return {"model_dir": model_dir, "output_dir": output_dir, "lora_dir": settings.get("lora_dir"),
            "lora_scale": settings.get("lora_scale", 1.0), "safety_checker": settings["safety_checker"]}


def run_actor_pool(jobs, settings, batch_size, num_actors):
    """Fan the rows of every job [(rows, model_spec)] out to one actor pool; yields (job index,
    file name, flagged) as images land.

    settings: num_inference_steps, guidance_scale, negative_prompt, resolution, allow_unsafe_weights.
    """
    import ray

    rows = [{**row, "model": index} for index, (job_rows, _) in enumerate(jobs) for row in job_rows]
    ds = ray.data.from_items(rows).map_batches(
        ImageGenerator,
        fn_constructor_args=([model for _, model in jobs], {**settings, "num_actors": num_actors}),
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=num_actors),
        num_gpus=actor_num_gpus(),
    )
    for batch in ds.iter_batches(batch_size=None):
        yield from zip(batch["model"], batch["file"], batch["flagged"])


def actor_num_gpus():
    """GPUs each actor of a pool reserves: a whole one where the cluster has GPUs."""
    return 1 if utils.cluster_resources()[1] else 0


def default_num_actors():
    """One actor per GPU of the cluster; one CPU actor where there are none."""
    return max(1, utils.cluster_resources()[1])


def main(argv=None):
    parser = flags.make_parser(
        __doc__.splitlines()[0],
        ["model_dir", "output_dir", "prompts", "num_samples_per_prompt", "batch_size",
         "num_inference_steps", "guidance_scale", "negative_prompt", "seed", "resolution",
         "lora_dir", "lora_scale", "num_actors", "safety_checker", "use_ray_data", "allow_unsafe_weights"],
    )
    args = parser.parse_args(argv)
    prompts = list(dict.fromkeys(p for group in args.prompts for p in group))
    model_dir, lora_dir = resolve_lora(args.model_dir, args.lora_dir)
    utils.check_model_dir(model_dir, args.allow_unsafe_weights)
    os.makedirs(args.output_dir, exist_ok=True)
    utils.remove_temp_files(args.output_dir)
    rows, all_files = plan_images(prompts, args.num_samples_per_prompt, args.seed, args.output_dir)
    print(f"{len(all_files) - len(rows)} of {len(all_files)} images already in {args.output_dir}; "
          f"generating {len(rows)}", file=sys.stderr)
    settings = {"num_inference_steps": args.num_inference_steps, "guidance_scale": args.guidance_scale,
                "negative_prompt": args.negative_prompt, "resolution": args.resolution,
                "allow_unsafe_weights": args.allow_unsafe_weights, "lora_dir": lora_dir,
                "lora_scale": args.lora_scale,
                "safety_checker": use_safety_checker(args.safety_checker, model_dir, lora_dir)}
    make_images(rows, model_dir, args.output_dir, settings, args.batch_size, args.num_actors)
    grid = write_grid(args.output_dir, all_files)
    print(f"{len(all_files)} images in {args.output_dir}; contact sheet {grid}", file=sys.stderr)
    return all_files


def make_images(rows, model_dir, output_dir, settings, batch_size=4, num_actors=None):
    """Draw the images of rows (plan_images') with one model into output_dir. settings: see
    run_actor_pool, plus safety_checker (bool) and optionally lora_dir and lora_scale."""
    make_images_of([(rows, model_spec(model_dir, output_dir, settings))], settings, batch_size, num_actors)


def make_images_of(jobs, settings, batch_size=4, num_actors=None):
    """Draw the rows of every job [(rows, model_spec)] on one actor pool, with a progress bar
    and one line for the images the safety checker withheld."""
    jobs = [(rows, model) for rows, model in jobs if rows]
    if not jobs:
        return
    from tqdm import tqdm

    if any(cache_model.has_random_weights(model["model_dir"]) for _, model in jobs):
        print("note: this model has random weights (cache_model.py --tiny / --random_model): its images are "
              "noise, as expected; the pipeline around them is real", file=sys.stderr)
    ray = utils.init_ray()
    ray.data.DataContext.get_current().enable_progress_bars = False
    num_actors = num_actors or default_num_actors()
    flagged = []
    several = len(jobs) > 1  # then a withheld image is named with its model's folder
    what = f"generating for {len(jobs)} models" if several else "generating"
    try:
        with tqdm(total=sum(len(rows) for rows, _ in jobs), desc=f"{what} on {num_actors} actor(s)", unit="img") as bar:
            for index, name, bad in run_actor_pool(jobs, settings, batch_size, num_actors):
                if bad:
                    flagged.append(os.path.join(jobs[index][1]["output_dir"], str(name)) if several else str(name))
                bar.update(1)
    except KeyboardInterrupt:
        print("stopped; the images written so far are complete: rerun the same command to make "
              "the rest", file=sys.stderr)
        raise
    if flagged:
        print(f"{len(flagged)} image(s) flagged by the safety checker were not saved (marked "
              f"'{FLAGGED_SUFFIX}'; --safety_checker off keeps them): {', '.join(flagged[:5])}", file=sys.stderr)


if __name__ == "__main__":
    utils.run_main(main)

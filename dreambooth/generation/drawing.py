"""Drawing images on a Ray Data actor pool, for every script that draws: generate.py, the class images
train.py tops up, evaluate.py's images of each model, validation samples.

Image i of a prompt is '<prompt-slug>-<i:05d>.png' from a seed derived from the run's seed, the prompt and i,
so a rerun draws only what is missing and gives the pixels an uninterrupted run would; a folder's record
names the model and settings that drew it (top_up refuses to mix another's in). One actor per GPU (or a
few on CPU) loads the pipeline once and draws batches of jobs, each job a model (adapters, checker) and
its prompts."""

import dataclasses
import hashlib
import os
import sys

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import hub
from dreambooth import machine
from dreambooth import storage
from dreambooth.cluster import raycluster
from dreambooth.generation import image_records
from dreambooth.models import adapters
from dreambooth.models import modelcache
from dreambooth.models import networks
from dreambooth.models import outputs

FLAGGED_SUFFIX = ".flagged"  # beside the name of an image the safety checker withheld


GRID_DIR = "grid"  # the contact sheet's folder inside --output_dir


def image_file_name(prompt, index):
    """Stable file name of the index-th image of a prompt: '<slug>-<index:05d>.png'."""
    return f"{files.slugify(prompt)}-{index:05d}{files.IMAGE_SUFFIX}"


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
        slug = files.slugify(prompt)
        if slugs.setdefault(slug, prompt) != prompt:
            raise errors.UserError(f"prompts {slugs[slug]!r} and {prompt!r} would share file names; make them differ")
        for index in range(num_per_prompt):
            name = image_file_name(prompt, index)
            all_files.append(name)
            path = os.path.join(output_dir, name)
            if not os.path.exists(path) and not os.path.exists(path + FLAGGED_SUFFIX):
                rows.append({"prompt": prompt, "seed": image_seed(seed, prompt, index), "file": name})
    return rows, all_files


def use_safety_checker(setting, model):
    """--safety_checker auto|on|off -> bool. auto: on only for a model or adapters train.py wrote."""
    return model.trained if setting == "auto" else setting == "on"


def load_pipeline(model_dir, device, allow_unsafe_weights=False, safety_checker=False, lora_dir=None,
                  lora_scale=1.0, family=None):
    """The SD pipeline in the device's low precision (train.py's rule: bf16 where the GPU has it, else fp16;
    fp32 on CPU); safetensors weights only unless allowed, no remote code.

    Without safety_checker the model's checker is not even loaded. LoRA adapters from
    lora_dir are fused into the weights at lora_scale: generation runs at the base model's speed.
    """
    import diffusers
    import torch


    dtype = machine.amp_dtype(None, device) or torch.float32
    storage.ensure_local(model_dir, lora_dir)  # (a bucket's, cached on the driver's node: this node's copy too)
    family = family or families.family_of(model_dir)
    # (a family without a safety checker, SDXL, has none to leave out)
    kwargs = {} if safety_checker or not family.safety_checker else {"safety_checker": None,
                                                                      "requires_safety_checker": False}
    with files.unchanged_while(model_dir, lora_dir):
        pipe = networks.from_pretrained(getattr(diffusers, family.pipeline), model_dir, allow_unsafe_weights,
                                        dtype=dtype, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        if lora_dir:
            adapters.fuse(pipe, lora_dir, lora_scale)
    return pipe.to(device)


@dataclasses.dataclass(frozen=True)
class ImageSettings:
    """How images are drawn, whatever the model: every setting that changes their pixels."""

    num_inference_steps: int = 50
    guidance_scale: float | None = None  # None: the model family's (family.guidance_scale)
    negative_prompt: str | None = None
    resolution: int | None = None  # None: the model's native size
    seed: int = 0
    allow_unsafe_weights: bool = False


def settings_for(settings, family, model_dir):
    """settings as the model in model_dir (of family) draws them: the family's guidance and the model's native
    size where none is given (a pipeline's own default size may not be the model's: FluxPipeline's is fixed);
    a UserError for a negative prompt that its pipeline would ignore (Flux.1 dev is guidance-distilled)."""
    if settings.negative_prompt and not family.negative_prompt:
        raise errors.UserError(f"{family.label} draws without a negative prompt (its guidance is an input of the "
                               "model, --guidance_scale): leave out --negative_prompt")
    return dataclasses.replace(settings, guidance_scale=family.guidance(settings.guidance_scale),
                               negative_prompt=settings.negative_prompt or family.default_negative_prompt,
                               resolution=settings.resolution or family.native_resolution(model_dir))


@dataclasses.dataclass(frozen=True)
class DrawJob:
    """One model's images to draw into one folder. rows: ({"prompt", "seed", "file"}, ...)."""

    model: outputs.ModelRef
    output_dir: str
    safety_checker: bool
    rows: tuple = ()


def generate_batch(pipe, prompts, seeds, settings, call_kwargs=None, guidance_argument="guidance_scale", size=None):
    """Run the pipeline once for a batch (settings: settings_for's; a guidance of None: the pipeline's default;
    call_kwargs: family.pipeline_kwargs, as it trains; guidance_argument: the family's name for the guidance
    value; size: (width, height), else settings' square resolution). One CPU generator per image: the noise of an
    image depends on its seed alone, not on the batch it lands in or the device."""
    import torch

    generators = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
    negative = settings.negative_prompt
    guidance = {} if settings.guidance_scale is None else {guidance_argument: settings.guidance_scale}
    out = pipe(
        prompt=list(prompts),
        **({"negative_prompt": [negative] * len(prompts)} if negative else {}),  # (FLUX.2 [klein]'s takes none)
        num_inference_steps=settings.num_inference_steps,
        **guidance,
        width=size[0] if size else settings.resolution,
        height=size[1] if size else settings.resolution,
        generator=generators,
        **(call_kwargs or {}),
    )
    # (a pipeline without a safety checker, SDXL's, has no such field)
    return out.images, list(getattr(out, "nsfw_content_detected", None) or [False] * len(out.images))


class ImageGenerator:
    """Ray Data actor: turns each batch of rows into PNG images, for one model or several.

    jobs: [DrawJob] (their rows travel as the batches). settings: ImageSettings.
    Batch in: {"job": (B,) index into jobs, "prompt": (B,) str, "seed": (B,) int, "file": (B,) str}.
    Batch out: {"job", "file", "flagged": (B,) bool (withheld by the safety checker), "png": (B,) bytes
    (empty where flagged)}.
    The actor holds one pipeline at a time and loads another when the rows' job changes;
    rows arrive grouped by job, so that happens about once per model.
    """

    def __init__(self, jobs, settings, num_actors, own_process=True):
        if own_process:  # (not in a process that may draw with adapters later: draw_here's)
            hub.skip_unused_imports(lora=any(job.model.lora_dir for job in jobs))
        self.device = machine.torch_device()
        if self.device.type == "cpu":
            raycluster.share_cpu_threads(num_actors)
        self.jobs, self.settings = jobs, settings
        self.loaded, self.pipe, self.broken, self.call_kwargs, self.job_settings = None, None, None, {}, settings
        try:
            self.pipeline(0)
        except errors.UserError as err:
            # Raised from the first batch instead: an actor that dies in its constructor has Ray print
            # the traceback on the user's terminal, and retry it.
            self.broken = err

    def pipeline(self, index):
        if index != self.loaded:
            job = self.jobs[index]
            self.pipe = None  # the previous model's memory goes before the next one loads
            try:
                storage.ensure_local(job.model.model_dir, job.model.lora_dir)  # (a bucket's: this node's copy)
                family = families.family_of(job.model.model_dir)
                self.pipe = load_pipeline(job.model.model_dir, self.device, self.settings.allow_unsafe_weights,
                                          job.safety_checker, job.model.lora_dir, job.model.lora_scale, family)
            except (OSError, MemoryError):
                raise
            except Exception as err:
                errors.write_error_log(job.output_dir, "loading the model", err)
                remedy = ("were the adapters trained on this base model? Else fetch or copy the files again"
                          if job.model.lora_dir else "its files do not fit together: fetch or copy it again")
                failure = errors.load_failure(f"loading the model {job.model.describe()}", err, remedy)
                raise errors.UserError(f"{failure} (traceback in {os.path.join(job.output_dir, errors.ERRORS_LOG)})") \
                    from err
            self.loaded = index
            self.call_kwargs = dict(call_kwargs=family.pipeline_kwargs(), guidance_argument=family.guidance_argument)
            self.job_settings = settings_for(self.settings, family, job.model.model_dir)
        return self.pipe

    def __call__(self, batch):
        import numpy as np

        if self.broken:
            raise self.broken
        flagged = np.zeros(len(batch["file"]), dtype=bool)
        png = np.full(len(batch["file"]), b"", dtype=object)
        for index in dict.fromkeys(batch["job"].tolist()):
            rows = np.flatnonzero(batch["job"] == index)
            images, bad = generate_batch(self.pipeline(index), batch["prompt"][rows], batch["seed"][rows],
                                         self.job_settings, **self.call_kwargs)  # (the pipeline first: it sets both)
            for row, image, is_bad in zip(rows, images, bad):
                flagged[row] = is_bad
                if not is_bad:
                    png[row] = files.png_bytes(image)
        return {"job": batch["job"], "file": batch["file"], "flagged": flagged, "png": png}


def run_actor_pool(jobs, settings, batch_size, num_actors):
    """Fan the rows of every DrawJob out to one actor pool; the images are written into their job's folder
    here, as they land (the actors may run on other nodes, which do not see this node's disk); yields
    (job index, file name, flagged) for each."""
    import ray

    rows = [{**row, "job": index} for index, job in enumerate(jobs) for row in job.rows]
    ds = ray.data.from_items(rows).map_batches(
        ImageGenerator,
        fn_constructor_args=([dataclasses.replace(job, rows=()) for job in jobs], settings, num_actors),
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=num_actors),
        num_gpus=actor_num_gpus(),
    )
    yield from written(jobs, ds.iter_batches(batch_size=None))


def written(jobs, batches):
    """Each image of ImageGenerator's batches written into its job's folder (a withheld one marked): yields (job
    index, file name, flagged) for each."""
    for batch in batches:
        for index, name, bad, png in zip(batch["job"], batch["file"], batch["flagged"], batch["png"]):
            path = os.path.join(jobs[index].output_dir, str(name))
            if bad:
                open(path + FLAGGED_SUFFIX, "w").close()
            else:
                files.write_bytes_atomic(bytes(png), path)
            yield index, name, bad


def draw_here(jobs, settings, batch_size):
    """run_actor_pool's images drawn in this process by an ImageGenerator of its own, in the same batches (a scoring
    task's, which holds the resources an actor would: no process started, none of its imports paid again)."""
    import numpy as np

    generator = ImageGenerator([dataclasses.replace(job, rows=()) for job in jobs], settings, 1, own_process=False)
    rows = [{**row, "job": index} for index, job in enumerate(jobs) for row in job.rows]
    chunks = (rows[start:start + batch_size] for start in range(0, len(rows), batch_size))
    yield from written(jobs, (generator({
        "job": np.array([row["job"] for row in chunk]), "seed": np.array([row["seed"] for row in chunk]),
        **{key: np.array([row[key] for row in chunk], dtype=object) for key in ("prompt", "file")}}) for chunk in chunks))


def actor_num_gpus():
    """GPUs each actor of a pool reserves: a whole one where the cluster has GPUs."""
    return 1 if raycluster.cluster_resources()[1] else 0


def default_num_actors():
    """One actor per GPU of the cluster; one CPU actor where there are none."""
    return max(1, raycluster.cluster_resources()[1])


def wanted_files(folder, prompts, count):
    """{prompt: [paths of its images 0..count-1 in folder]}."""
    return {p: [os.path.join(folder, image_file_name(p, i)) for i in range(count)] for p in prompts}


def top_up(folder, model, prompts, count, settings, safety_checker, on_mismatch="error",
           remedy="pass --force to delete those images and draw these", label=None, class_images=False, where=None,
           donors=()):
    """The DrawJob that fills folder up to count images of each prompt, keeping the images already
    there only when the folder's record says the same model drew them with the same settings.

    The one place a folder of generated images is filled (generate.py, class images for train.py
    and the sweep, evaluate.py's images). On a mismatch: on_mismatch "error" raises a UserError
    naming what differs and remedy (how to discard them); "redraw" and "force" (generate.py
    --force) delete them, say so, and draw them again. class_images: only ImageRecord.CLASS_IMAGE_FIELDS
    must match (others differing: kept, with a line). The record is written before drawing: a run
    cut short leaves images that its record describes. where: the folder as the user named it (a bucket's,
    filled through this node's copy folder). donors: other folders of images (a bucket's too) whose images are copied
    in, those missing here, where their record is this one (image_records.take_drawn)."""
    where = where or folder
    os.makedirs(folder, exist_ok=True)
    files.remove_temp_files(folder)
    settings = settings_for(settings, families.family_of(model.model_dir), model.model_dir)
    wanted = image_records.ImageRecord(model.fingerprint(), model.describe(), tuple(prompts), settings.resolution,
                                       settings.seed, settings.num_inference_steps, settings.guidance_scale,
                                       settings.negative_prompt)
    have = image_records.read_image_record(folder)
    drawn = image_records.drawn_images(folder)
    differs = have.differences(wanted) if have else (["record"] if drawn else [])
    if class_images and have and differs and on_mismatch != "force" and not set(differs) & set(
            image_records.ImageRecord.CLASS_IMAGE_FIELDS):
        print(f"{label or where}: keeping the {len(drawn)} class images in {where}, drawn with "
              f"{have.describe(differs)} (not this run's {wanted.describe(differs)}: the same model, prompt and size, "
              f"which is what training reads)", file=sys.stderr)
        wanted = have  # the record goes on describing the images kept
        differs = []
    if differs:
        what = (f"were drawn with {have.describe(differs)}" if have else
                f"have no record ({image_records.IMAGES_RECORD}) of the model and settings that drew them")
        if on_mismatch == "error":
            asked = f"this run's {wanted.describe(differs, after=have)}" if have else f"this run's {wanted.describe()}"
            raise errors.UserError(f"{where}: its {len(drawn)} images {what}, not {asked} (different: "
                                   f"{', '.join(differs)}). Use another folder, or {remedy}")
        now = f", not this run's {wanted.describe(differs, after=have)}" if have else ""
        print(f"{label or where}: the {len(drawn)} images in {where} {what}{now} (different: {', '.join(differs)}); "
              f"replacing them", file=sys.stderr)
        image_records.remove_drawn_images(folder)
    image_records.write_image_record(folder, wanted)
    for donor in donors:  # (the images still missing, and the marks of those the safety checker withheld)
        missing = [name for row in plan_images(prompts, count, settings.seed, folder)[0]
                   for name in (row["file"], row["file"] + FLAGGED_SUFFIX)]
        image_records.take_drawn(folder, donor, wanted, missing, label or where)
    rows, names = plan_images(prompts, count, settings.seed, folder)
    if names and not class_images:  # (class images beyond the count stay: training reads the first --num_class_images)
        remove_beyond(folder, names, count, label or where, where)
    if names:
        print(f"{label or where}: {len(names) - len(rows)} of {len(names)} images already there; generating "
              f"{len(rows)}", file=sys.stderr)
    return DrawJob(model, folder, safety_checker, tuple(rows))


def remove_beyond(folder, names, count, label, where):
    """Delete the images in folder (and the safety checker's marks) of the same model, prompts and settings that an
    earlier run asking for more than count per prompt drew, saying so: the folder then holds what this run names."""
    asked = set(names) | {name + FLAGGED_SUFFIX for name in names}
    beyond = [name for name in image_records.drawn_images(folder) if name not in asked]
    for name in beyond:
        os.remove(os.path.join(folder, name))
    if beyond:
        inside = "" if label == where else f" in {where}"
        print(f"{label}: removed {len(beyond)} image(s){inside} beyond the {count} per prompt asked now (drawn by an "
              "earlier run of this model and settings; asking for more draws the same ones again)", file=sys.stderr)


STARTING = "starting the actors, each loads the model"  # the progress bar's note until the first image
STARTING_HERE = "loading the model"  # (drawn in this process)


def make_images_of(jobs, settings, batch_size=4, num_actors=None, here=False, landing=None):
    """Draw the rows of every DrawJob on one actor pool (settings: ImageSettings), or in this process (here:
    draw_here), with a progress bar and one line for the images the safety checker withheld. landing: (job index,
    file name, flagged) of each image as a task on this node draws them instead (scoring.landed), jobs without rows
    left out."""
    jobs = [job for job in jobs if job.rows]
    if not jobs:
        return
    from tqdm import tqdm

    if any(modelcache.has_random_weights(job.model.model_dir) for job in jobs):
        print("note: this model has random weights (cache_model.py --tiny / --random_model): its images are "
              "noise, as expected; the pipeline around them is real", file=sys.stderr)
    if not (here or landing):  # (the pool's; drawing in this process, or images a task drew, need no Ray)
        ray = raycluster.init_ray()
        ray.data.DataContext.get_current().enable_progress_bars = False
        num_actors = num_actors or default_num_actors()
    flagged = []
    several = len(jobs) > 1  # then a withheld image is named with its model's folder
    what = f"generating for {len(jobs)} models" if several else "generating"
    where = "in this process" if here else "in one task" if landing else f"on {num_actors} actor(s)"
    images = draw_here(jobs, settings, batch_size) if here else landing or run_actor_pool(jobs, settings, batch_size,
                                                                                          num_actors)
    try:
        waiting = STARTING_HERE if here or landing else STARTING
        # (the rate is the images over the whole time: a batch's images land together, so a rate counted from the
        # first of them, or smoothed over the last few, said hundreds of images a second)
        with tqdm(total=sum(len(job.rows) for job in jobs), desc=f"{what} {where}", unit="img",
                  postfix=waiting, smoothing=0) as bar:
            for index, name, bad in images:
                if bad:
                    flagged.append(os.path.join(jobs[index].output_dir, str(name)) if several else str(name))
                if bar.postfix.startswith(waiting):  # the first image
                    ready = "model loaded" if here or landing else "actors ready"
                    bar.set_postfix_str(f"{ready} in {bar.format_interval(bar.format_dict['elapsed'])}",
                                        refresh=False)
                bar.update(1)
    except KeyboardInterrupt:
        print("stopped; the images written so far are complete: rerun the same command to make "
              "the rest", file=sys.stderr)
        raise
    if flagged:
        print(f"{len(flagged)} image(s) flagged by the safety checker were not saved (marked "
              f"'{FLAGGED_SUFFIX}'; --safety_checker off keeps them): {', '.join(flagged[:5])}", file=sys.stderr)

"""The DreamBooth paper's scores of models against subjects: images drawn on one actor pool (drawing.py), embedded
by DINO and CLIP on another (on a one-node cluster: both in one task), then DINO, CLIP-I, CLIP-T, DIV and PRES per
prompt and overall, each subject's scores.json and report.md. evaluate.py and the sweep's trials call run()."""

import contextlib
import dataclasses
import functools
import io
import os
import re
import sys

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import machine
from dreambooth import storage
from dreambooth.cluster import raycluster
from dreambooth.evaluation import eval_report
from dreambooth.evaluation import scores
from dreambooth.generation import drawing
from dreambooth.generation import imagefiles
from dreambooth.generation import imaging
from dreambooth.models import modelcache
from dreambooth.models import outputs

EVAL_PROMPTS_DIR = os.path.join(files.ASSETS_DIR, "eval_prompts")
# The classes scored with the live prompt set (the DreamBooth paper's pets and people), as slugs
LIVE_CLASSES = frozenset((
    "dog", "dogs", "puppy", "cat", "cats", "kitten", "person", "people", "man", "woman", "boy", "girl", "child",
    "baby", "kid", "horse", "pony", "bird", "parrot", "rabbit", "bunny", "hamster", "guinea-pig", "ferret", "fox",
    "teddy-dog", "pet"))


def subject_type_of(class_name):
    """The prompt set of a class when none is given: 'live' for a pet or a person (LIVE_CLASSES), else 'object'."""
    slug = re.sub(r"[^a-z0-9]+", "-", class_name.lower()).strip("-")
    return "live" if slug in LIVE_CLASSES else "object"


def prompt_templates(subject_type, path=None):
    """The prompt set: lines of a file with '{subject}' for "<token> <class>" ('#' lines are comments)."""
    path = path or os.path.join(EVAL_PROMPTS_DIR, f"{subject_type}.txt")
    text = files.read_user_text(path, "--eval_prompts (EVAL_PROMPTS with dreambooth_run.sh)")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    missing = [line for line in lines if "{subject}" not in line]
    if missing or not lines:
        raise errors.UserError(f"{path}: every prompt needs '{{subject}}' (e.g. 'a {{subject}} on a beach'); "
                               f"not: {missing[0] if missing else '(no prompts)'}")
    return lines


def models_to_score(model_dir, lora_dir, base_dir):
    """[(label, outputs.ModelRef)]: the tuned model and, where known, its base model."""
    tuned = outputs.resolve_model(model_dir, lora_dir)
    if base_dir is None:
        output = outputs.read_output(model_dir)
        base_dir = tuned.model_dir if tuned.lora_dir else (output.base_model if output else None)
    return [("tuned", tuned)] + ([("base", outputs.ModelRef(base_dir))] if base_dir else [])


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How images are drawn and scored: the flags of main() that run() reads."""

    eval_models_dir: str
    num_samples_per_prompt: int = 4
    seed: int = 0
    batch_size: int = 4
    num_inference_steps: int = 50
    guidance_scale: float | None = None  # None: the model family's
    resolution: int | None = None
    num_actors: int | None = None
    allow_unsafe_weights: bool = False
    # drawn and embedded in this process, by the actors' own classes, instead of on actor pools: a scoring task's,
    # which holds an actor's resources itself (checkpoint_scores)
    here: bool = False

    @classmethod
    def from_args(cls, args, **overrides):
        return cls(**{**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)},
                      **overrides})

    def images(self):
        """The drawing.ImageSettings of these images (no negative prompt: the paper's protocol)."""
        return drawing.ImageSettings(self.num_inference_steps, self.guidance_scale, None, self.resolution,
                                      self.seed, self.allow_unsafe_weights)


class EmbeddingActor:
    """Ray Data actor (scores.Embedder on each): DINO and CLIP embeddings of image files, CLIP embeddings of their texts.

    Batch in: {"path": (B,) str, "text": (B,) str, "data": (B,) bytes (the file's)}.
    Batch out: {"path", "dino": (B, D), "clip": (B, P), "text_clip": (B, P)}.
    """

    def __init__(self, dino_dir, clip_dir, num_actors, allow_unsafe_weights):
        storage.ensure_local(dino_dir, clip_dir)  # (a bucket's, cached on the driver's node: this node's copy too)
        device = machine.torch_device()
        if device.type == "cpu":
            raycluster.share_cpu_threads(num_actors)
        self.embedder = scores.Embedder(dino_dir, clip_dir, device, allow_unsafe_weights)

    def __call__(self, batch):
        from PIL import Image

        images = []
        for data in batch["data"]:  # (the files' bytes, read on the driver: this node may not see its disk)
            with Image.open(io.BytesIO(data)) as image:  # the subject photos as training read them
                images.append(imagefiles.upright_rgb(image))
        return {"path": batch["path"], "dino": self.embedder.dino_images(images).numpy(),
                "clip": self.embedder.clip_images(images).numpy(),
                "text_clip": self.embedder.clip_texts([str(t) for t in batch["text"]]).numpy()}


@functools.lru_cache(maxsize=1)
def embedder_here(dino_dir, clip_dir, allow_unsafe_weights):
    """An EmbeddingActor of this process's own, kept for its next call (a Ray worker that runs the next scoring task
    has DINO and CLIP loaded already)."""
    return EmbeddingActor(dino_dir, clip_dir, 1, allow_unsafe_weights)


def embed(rows, eval_models_dir, num_actors, allow_unsafe_weights=False, batch_size=16, here=False):
    """{path: {"dino", "clip", "text_clip"} as (D,) arrays} for rows [{"path", "text"}], on an actor pool, or in
    this process (here)."""
    import numpy as np

    ray = raycluster.init_ray()
    dirs = tuple(os.path.join(eval_models_dir, part) for part in modelcache.EVAL_MODEL_PARTS)
    rows = [{**row, "data": storage.read_bytes(row["path"])} for row in rows]
    if here:
        embedder = embedder_here(*dirs, allow_unsafe_weights)
        batches = (embedder({key: np.array([row[key] for row in rows[start:start + batch_size]], dtype=object)
                             for key in ("path", "text", "data")}) for start in range(0, len(rows), batch_size))
    else:
        batches = ray.data.from_items(rows).map_batches(
            EmbeddingActor, fn_constructor_args=(*dirs, num_actors, allow_unsafe_weights), batch_size=batch_size,
            compute=ray.data.ActorPoolStrategy(size=num_actors),
            num_gpus=drawing.actor_num_gpus()).iter_batches(batch_size=None)
    out = {}
    for batch in batches:
        for i, path in enumerate(batch["path"]):
            out[str(path)] = {k: batch[k][i] for k in ("dino", "clip", "text_clip")}
    return out


def score_set(emb, files, real, held_out=()):
    """DINO, CLIP-I, CLIP-T, DIV of one model's images. files: {prompt: [paths]} (images the safety
    checker withheld are absent); real: the subject photos' paths (those trained on). Each image's
    CLIP-T text is the one its row carried (its prompt without the token). DIV is None with one image
    per prompt. With held_out photos (--holdout), also DINO and CLIP-I against them."""
    import numpy as np

    def stack(paths, key):
        return np.stack([emb[p][key] for p in paths])

    every = [p for paths in files.values() for p in paths]
    if not every:
        raise errors.UserError("no images to score: the safety checker withheld all of them")
    groups = [stack(paths, "dino") for paths in files.values() if len(paths) > 1]
    return {"dino": scores.mean_similarity(stack(every, "dino"), stack(real, "dino")),
            "clip_i": scores.mean_similarity(stack(every, "clip"), stack(real, "clip")),
            "clip_t": scores.paired_similarity(stack(every, "clip"), stack(every, "text_clip")),
            "div": scores.diversity(groups) if groups else None,
            **({"dino_holdout": scores.mean_similarity(stack(every, "dino"), stack(held_out, "dino")),
                "clip_i_holdout": scores.mean_similarity(stack(every, "clip"), stack(held_out, "clip"))}
               if held_out else {})}


@dataclasses.dataclass(frozen=True)
class ModelScores:
    """One model's scores on one subject: overall ({score name: value}, scores.SCORE_NAMES, "pres" and with
    --holdout scores.HOLDOUT_NAMES) and per prompt ({prompt: {score name: value}})."""

    overall: dict
    per_prompt: dict


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """The scores of every model on one subject, as scores.json holds them."""

    subject: str  # "<token> <class>"
    num_prompts: int
    num_samples_per_prompt: int
    num_photos: int  # the photos scored against (without the held-out ones)
    prompts: tuple
    models: dict  # {label: ModelScores}
    class_prompt: str = None
    held_out: tuple = ()  # the names of the photos kept out of training (--holdout)
    scored: dict = dataclasses.field(default_factory=dict)  # {label: {"model": its folder (+ adapters), "family"}}

    def overall(self, label):
        return self.models[label].overall

    def to_json(self):
        return {**dataclasses.asdict(self), "prompts": list(self.prompts), "held_out": list(self.held_out)}

    @classmethod
    def from_json(cls, data):
        return cls(**{**data, "prompts": tuple(data["prompts"]), "held_out": tuple(data.get("held_out") or ()),
                      "models": {label: ModelScores(**m) for label, m in data["models"].items()}})


@dataclasses.dataclass(frozen=True)
class Subject:
    """What a model is scored against: the subject's photos, its token and class, a prompt set."""

    name: str
    photos_dir: str
    unique_token: str
    class_name: str
    subject_type: str | None = None  # object or live; None: the class's (subject_type_of)
    eval_prompts: str | None = None  # a file of one's own; default: the subject type's set
    holdout: int = 0  # --holdout: the last photos in name order were kept out of training

    def __post_init__(self):
        if self.subject_type is None:
            object.__setattr__(self, "subject_type", subject_type_of(self.class_name))

    def prompts(self):
        """{prompt: the text CLIP-T compares with (the prompt without the token)}."""
        subject = f"{self.unique_token} {self.class_name}"
        return {t.format(subject=subject): scores.without_token(t.format(subject=subject), self.unique_token)
                for t in prompt_templates(self.subject_type, self.eval_prompts)}

    @property
    def class_prompt(self):
        return f"a {self.class_name}"

    def photos(self):
        """Every photo of the subject (those held out too); a bucket's, in this node's copy of them."""
        folder = storage.cached(self.photos_dir) if storage.is_remote(self.photos_dir) else self.photos_dir
        return imagefiles.list_images(folder, f"photos of {self.name}", also_expected=".txt")

    def split(self):
        """(photos trained on, photos held out): imagefiles.holdout_split, as train.py --holdout made it."""
        return imagefiles.holdout_split(self.photos(), self.holdout)

    def held_out_names(self):
        """The held-out photos' file names, as train.py records them."""
        return imagefiles.held_out_names(self.photos(), self.holdout)


def image_job(label, model, prompt_list, folder, settings, donors=()):
    """What one model (outputs.ModelRef) still has to draw: settings.num_samples_per_prompt images of
    each prompt in folder, keeping those that this model drew with these settings (the folder's
    record) and taking those of donors (image folders) that it drew so; images of another model (a retrained one)
    are drawn again. Returns the DrawJob and {prompt: [paths]} of every image wanted."""
    job = drawing.top_up(folder, model, prompt_list, settings.num_samples_per_prompt, settings.images(),
                          drawing.use_safety_checker("auto", model), on_mismatch="redraw", label=label, donors=donors)
    return job, drawing.wanted_files(folder, prompt_list, settings.num_samples_per_prompt)


def scored_image_folders(model):
    """The image folders of the scores taken while the model (an outputs.ModelRef) trained: train.py --keep_best
    records its run's scores folder (outputs.KEPT_SCORES), where each scored step's images and the base model's lie as
    run() lays them out (<label>/images/<label>). Its best step's and the base model's images are this model's and its
    base model's, drawn as evaluate.py draws them: image_job takes them instead of drawing them again."""
    output = outputs.read_output(model.lora_dir or model.model_dir)
    where = (output.record.kept or {}).get(outputs.KEPT_SCORES) if output else None
    if not where or not storage.isdir(where):
        return []
    return [storage.join(where, label, "images", label) for label in storage.listdir(where)]


def remove_reports(folders):
    """The scores.json and report.md of an earlier run in folders, removed before a run scores again: a run stopped in
    the middle leaves none, not stale ones."""
    for folder in folders:
        for name in ("scores.json", "report.md"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))


def drawn_images(wanted):
    """wanted ({label: {prompt: [paths]}}) without the images the safety checker withheld."""
    return {label: {p: [f for f in fs if os.path.exists(f)] for p, fs in by_prompt.items()}
            for label, by_prompt in wanted.items()}


def embedding_rows(images, texts, photo_rows):
    """embed()'s rows: each image of images (drawn_images') with its prompt's text (texts), then photo_rows, each once."""
    rows = [{"path": f, "text": texts[p]} for by_prompt in images.values() for p, fs in by_prompt.items() for f in fs]
    return list({r["path"]: r for r in rows + photo_rows}.values())


def in_one_task(settings):
    """Whether run() draws and embeds in one Ray task on this node, holding what one actor of its pools would, with one
    actor (a CPU, or one GPU) on a cluster of one node: one process, where two pools start one each (5 to 10 s)."""
    import ray

    return not settings.here and settings.num_actors == 1 and len([n for n in ray.nodes() if n["Alive"]]) == 1


def images_and_embeddings(jobs, settings, wanted, texts, photo_rows):
    """The jobs' images drawn (make_images_of: an actor pool, this process, or with in_one_task a task on this node,
    where the images go, that draw_and_embed's), then they and photo_rows embedded: (drawn_images(wanted), embed()'s)."""
    import ray

    task = landing = None
    if in_one_task(settings):
        drawn = [job for job in jobs if job.rows]
        task = ray.remote(draw_and_embed).options(num_cpus=1, num_gpus=drawing.actor_num_gpus(), max_retries=0,
                                                  scheduling_strategy=raycluster.on_this_node()).remote(
            drawn, settings, wanted, texts, photo_rows)
        landing = landed(drawn, task)
    drawing.make_images_of(jobs, settings.images(), settings.batch_size, settings.num_actors, here=settings.here,
                           landing=landing)
    images = drawn_images(wanted)
    rows = embedding_rows(images, texts, photo_rows)
    where = "in this process" if settings.here else "in the same task" if task else f"on {settings.num_actors} actor(s)"
    print(f"scoring {len(rows)} images {where}", file=sys.stderr)
    return images, ray.get(task) if task else embed(rows, settings.eval_models_dir, settings.num_actors,
                                                    settings.allow_unsafe_weights, here=settings.here)


def landed(jobs, task, every=0.25):
    """(job index, file name, flagged) of each row's image as it lands in its job's folder, drawn by task
    (draw_and_embed, on this node); ends when every image is there, or with the task (its error raised here)."""
    import ray

    pending = {(index, str(row["file"])) for index, job in enumerate(jobs) for row in job.rows}
    try:
        while pending:
            ended = bool(ray.wait([task], timeout=every)[0])
            for index, name in sorted(pending):
                path = os.path.join(jobs[index].output_dir, name)
                if os.path.exists(path) or os.path.exists(path + drawing.FLAGGED_SUFFIX):
                    pending.discard((index, name))
                    yield index, name, not os.path.exists(path)
            if ended:
                ray.get(task)
                return
    except KeyboardInterrupt:
        ray.cancel(task, force=True)
        raise


def draw_and_embed(jobs, settings, wanted, texts, photo_rows):
    """In a Ray task (in_one_task): the jobs' images drawn (in their folders, on this node), then they and the photos
    embedded, both in this process (the pools' actor classes); returns embed()'s."""
    for _ in drawing.draw_here(jobs, settings.images(), settings.batch_size) if jobs else ():
        pass
    rows = embedding_rows(drawn_images(wanted), texts, photo_rows)
    return embed(rows, settings.eval_models_dir, 1, settings.allow_unsafe_weights, here=True)


def run(entries, subjects, settings, output_dir, report_dirs=None):
    """Generate, embed and score the models of entries [(label, outputs.ModelRef)] against
    each of subjects, with one actor pool for the images of every model and subject and one for all
    embeddings (or one task for both: in_one_task). Images go to output_dir/images/<label> (subjects with the same
    prompts share them); each subject's scores.json, report.md and grids to report_dirs[name] (default output_dir).
    Returns {subject name: EvalResult}."""
    import numpy as np

    for _, model in entries:  # before Ray starts
        families.check_model_dir(model.model_dir, settings.allow_unsafe_weights)
    folders = {s.name: (report_dirs or {}).get(s.name, output_dir) for s in subjects}  # (each subject's report's)
    remove_reports(folders.values())
    raycluster.init_ray()
    prompts = {s.name: s.prompts() for s in subjects}
    texts = {p: t for s in subjects for p, t in prompts[s.name].items()}
    texts.update({s.class_prompt: s.class_prompt for s in subjects})
    real, held = {}, {}
    for s in subjects:
        real[s.name], held[s.name] = s.split()
    settings = dataclasses.replace(settings, num_actors=settings.num_actors or drawing.default_num_actors())
    donors = list(dict.fromkeys(folder for _, model in entries for folder in scored_image_folders(model)))
    jobs, wanted = [], {}
    for label, model in entries:
        job, wanted[label] = image_job(label, model, list(texts), os.path.join(output_dir, "images", label), settings,
                                       donors)
        jobs.append(job)
    photo_rows = [{"path": path, "text": s.class_prompt} for s in subjects for path in real[s.name] + held[s.name]]
    images, emb = images_and_embeddings(jobs, settings, wanted, texts, photo_rows)

    results = {}
    random_weights = any(modelcache.has_random_weights(model.model_dir) for _, model in entries)
    for subject in subjects:
        photos, folder = real[subject.name], folders[subject.name]
        models = {}
        for label, _ in entries:
            subject_files = {p: images[label][p] for p in prompts[subject.name]}
            per_prompt = {p: score_set(emb, {p: paths}, photos) for p, paths in subject_files.items() if paths}
            overall = score_set(emb, subject_files, photos, held[subject.name])
            class_images = images[label][subject.class_prompt]
            overall["pres"] = scores.mean_similarity(
                np.stack([emb[p]["dino"] for p in class_images]),
                np.stack([emb[p]["dino"] for p in photos])) if class_images else None
            models[label] = ModelScores(overall, per_prompt)
            imaging.write_prompt_grids(folder, label, {p: images[label][p] for p in [*subject_files, subject.class_prompt]})
        result = EvalResult(f"{subject.unique_token} {subject.class_name}", len(prompts[subject.name]),
                            settings.num_samples_per_prompt, len(photos), tuple(prompts[subject.name]), models,
                            subject.class_prompt, tuple(subject.held_out_names()), eval_report.scored_models(entries))
        os.makedirs(folder, exist_ok=True)
        files.write_json(os.path.join(folder, "scores.json"), result.to_json())
        eval_report.write_report(os.path.join(folder, "report.md"), result, random_weights)
        results[subject.name] = result
    return results

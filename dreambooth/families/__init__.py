"""The model families in one table, and the model folder's own reads and check.

A model's family is found from its folder (model_index.json's pipeline class, and for the
StableDiffusionPipeline the text encoder's activation: OpenAI CLIP's quick_gelu in SD 1.x,
OpenCLIP's gelu in SD 2.x), never from a flag, and carried in the Plan from there. What a family
provides is family.Family; each is one module (family_sd1.py, family_sd2.py, family_sdxl.py,
family_sd3.py, family_flux.py, family_qwen.py, family_flux2.py, family_flux2_dev.py, family_zimage.py,
family_chroma.py). A later family is one more module and one more entry here.
"""

import dataclasses
import os

from dreambooth import errors
from dreambooth import files
from dreambooth.families import family_chroma
from dreambooth.families import family_flux
from dreambooth.families import family_flux2
from dreambooth.families import family_flux2_dev
from dreambooth.families import family_qwen
from dreambooth.families import family_sd1
from dreambooth.families import family_sd2
from dreambooth.families import family_sd3
from dreambooth.families import family_sdxl
from dreambooth.families import family_zimage
from dreambooth.families.family import Family  # noqa: F401 (the interface every entry implements, named beside the table)
from dreambooth.families.family import part_config

FAMILIES = {f.name: f for f in (family_sd1.FAMILY, family_sd2.FAMILY, family_sdxl.FAMILY, family_sd3.FAMILY,
                                      family_flux.FAMILY, family_qwen.FAMILY, family_flux2.FAMILY,
                                      family_flux2_dev.FAMILY, family_zimage.FAMILY, family_chroma.FAMILY)}
ARCHS = {f.random.arch: f for f in FAMILIES.values()}  # the --arch names of the random models built here
DEFAULT = family_sd1.FAMILY  # the default model's (sd14) and --tiny's without --arch
# The base models known by short name: each family's own list (not one it inherits), in the table's order
KNOWN_MODELS = tuple(dataclasses.replace(model, family=name) for name, f in FAMILIES.items()
                     for model in vars(type(f)).get("known_models", ()))
ACTIONS = {"draw": "drawing images with", "train": "training", "export": "exporting",
           "export_lora": "exporting LoRA adapters of"}


def family_of(model_dir):
    """The Family of a diffusers model folder; a UserError for a pipeline of no family here."""
    index_path = os.path.join(model_dir, "model_index.json")
    try:
        pipeline = files.read_json(index_path).get("_class_name")
    except (ValueError, UnicodeDecodeError):
        raise errors.UserError(f"{index_path} is not valid JSON (a cut-short copy?): fetch or copy the model again "
                               "(cache_model.py)") from None
    except OSError as err:
        raise errors.UserError(f"cannot read {index_path}: {err.strerror or err}") from None
    if pipeline is None:
        raise errors.UserError(f"{index_path} names no pipeline class (_class_name): not a diffusers pipeline folder")
    try:
        text_encoder = part_config(model_dir, "text_encoder")
    except (OSError, ValueError):
        text_encoder = {}  # the model check names the missing part
    for family in FAMILIES.values():
        if family.matches(pipeline, text_encoder):
            return family
    supported = ", ".join(f"{f.label} ({f.pipeline})" for f in FAMILIES.values())
    raise errors.UserError(f"{model_dir} is a {pipeline} model; this suite runs {supported}")


def require(model_dir, action):
    """The model's Family, or a UserError when the suite does not do action ("draw", "train",
    "export") with that family yet."""
    family = family_of(model_dir)
    if action not in family.supports:
        able = ", ".join(f.label for f in FAMILIES.values() if action in f.supports)
        raise errors.UserError(f"{ACTIONS[action]} an {family.label} model ({model_dir}) is not supported yet: "
                               f"this version does it for {able}")
    return family


def prediction_type(model_dir):
    """What the model's UNet predicts, from its scheduler's config: "epsilon" or "v_prediction"."""
    path = os.path.join(model_dir, "scheduler", "scheduler_config.json")
    try:
        return files.read_json(path).get("prediction_type", "epsilon")
    except (OSError, ValueError):
        return "epsilon"


# ---------------------------------------------------------------- the model folder

def native_resolution(model_dir):
    """The pixel size the model was trained at (its family reads it from its configs)."""
    return family_of(model_dir).native_resolution(model_dir)


def size_multiple(model_dir):
    """The step every trained height and width of the model must be a multiple of."""
    return family_of(model_dir).size_multiple(model_dir)


def check_model_dir(model_dir, allow_unsafe_weights=False):
    """Fail early, naming what is missing, if model_dir is not a diffusers SD folder.

    Without allow_unsafe_weights, each network must come as safetensors: pickled .bin
    weights can execute code when loaded.
    """
    if not os.path.isdir(model_dir):
        raise errors.UserError(f"model folder not found: {model_dir}")
    index_path = os.path.join(model_dir, "model_index.json")
    again = "fetch or copy the model again (cache_model.py)"
    if os.path.lexists(index_path):  # (a broken link, a folder, an unreadable file: said as such)
        problem = files.model_file_problem(index_path)
        if problem:
            raise errors.UserError(f"{problem}: {again}")
    if not os.path.isfile(index_path):
        raise errors.UserError(f"{model_dir} has no model_index.json: not a diffusers pipeline folder")
    family = family_of(model_dir)  # which parts it must have
    networks = family.networks()
    for part in (*family.parts(), "scheduler"):
        if not os.path.isdir(os.path.join(model_dir, part)):
            raise errors.UserError(f"model folder {model_dir} is missing its '{part}' component")
        files.check_model_files(os.path.join(model_dir, part), again)  # (every file: configs, weights, tokenizer)
    for part in networks:
        names = os.listdir(os.path.join(model_dir, part))
        if not any(n.endswith(".safetensors") for n in names):
            if not any(n.endswith(".bin") for n in names):
                raise errors.UserError(f"model folder {model_dir} has no weights in '{part}'")
            if not allow_unsafe_weights:
                raise errors.UserError(f"'{part}' in {model_dir} has only pickled .bin weights; convert them to "
                                       "safetensors or pass --allow_unsafe_weights if you trust their source")
    family.check_folder(model_dir)

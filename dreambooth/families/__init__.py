"""The model families, each a folder here that registers itself, and the model folder's own reads and check.

A family is a folder (sd1/, sdxl/, flux/, ...) whose __init__.py defines FAMILY, an instance of a subclass of
shared.family.Family; the table below is every such folder, named by it (a family's name is its folder's, and its
random models' --arch is the same unless it says another), in the order the families give. shared/ holds the
interface and what several families share; a new family is one more folder, and every list the suite shows
(--arch, --help, the memory table, export.py's families) is read from this table.

A model's family is found from its folder (model_index.json's pipeline class, and for the
StableDiffusionPipeline the text encoder's activation: OpenAI CLIP's quick_gelu in SD 1.x,
OpenCLIP's gelu in SD 2.x), never from a flag, and carried in the Plan from there.
"""

import dataclasses
import importlib
import os
import pkgutil

from dreambooth import errors
from dreambooth import files
from dreambooth.families.shared.family import Family  # noqa: F401 (the interface every entry implements)
from dreambooth.families.shared.family import part_config

SHARED = "shared"  # the folder of what several families share: not a family


def discover(package_paths=None, package=__name__):
    """{name: Family} of every family folder in package_paths (this package's folders by default), in the families'
    order (Family.order, then name)."""
    found = []
    for module in pkgutil.iter_modules(package_paths or __path__):
        if not module.ispkg or module.name == SHARED or module.name.startswith("_"):
            continue
        family = importlib.import_module(f"{package}.{module.name}").FAMILY
        family.name = module.name
        if family.random is not None and not family.random.arch:
            family.random.arch = module.name
        found.append(family)
    return {f.name: f for f in sorted(found, key=lambda f: (f.order, f.name))}


FAMILIES = discover()
ARCHS = {f.random.arch: f for f in FAMILIES.values()}  # the --arch names of the random models built here
DEFAULT = FAMILIES["sd1"]  # the default model's (sd14) and --tiny's without --arch
# The base models known by short name: each family's own list (not one it inherits), in the table's order
KNOWN_MODELS = tuple(dataclasses.replace(model, family=name) for name, f in FAMILIES.items()
                     for model in vars(type(f)).get("known_models", ()))


def listing():
    """The lines of dreambooth_run.sh --help and docs/FLAGS.md about the families: each --arch with its label, then
    the base models' short names and the gated ones."""
    return ["Families (--tiny --arch NAME builds a tiny random model of one):",
            *(f"  {arch:<10} {f.label}" for arch, f in ARCHS.items()),
            "Base models by short name (ORIG_MODEL_NAME): " + ", ".join(m.short_name for m in KNOWN_MODELS),
            "  gated (a hub token needed): " + ", ".join(m.short_name for m in KNOWN_MODELS if m.gated)]


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

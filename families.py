"""The model families: what differs between SD 1.x, SD 2.x and SDXL, in one table.

A model's family is read from its folder (model_index.json's pipeline class, and for the
StableDiffusionPipeline the text encoder's activation: OpenAI CLIP's quick_gelu in SD 1.x,
OpenCLIP's gelu in SD 2.x), never from a flag. What a model decides for itself (its prediction
type, its native resolution) is read from its own configs; the family holds what its configs do
not say: which text encoders and pipeline it has, the original single-file layout, whether
this suite trains it yet. A later family is one more entry here.
"""

import dataclasses
import json
import os

import utils


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # "sd1", "sd2", "sdxl"
    label: str  # as the README and error lines say it
    pipeline: str  # the diffusers pipeline class in model_index.json
    text_encoders: tuple  # the text encoder subfolders, in the order the pipeline concatenates them
    # The original single-file layout of the text encoder: "clip" (cond_stage_model.transformer.*,
    # OpenAI CLIP as transformers names it) or "open_clip" (cond_stage_model.model.*, OpenCLIP's names).
    single_file_text_encoder: str
    trained: bool  # train.py, generate.py and the rest support it today
    released_resolutions: tuple  # of the released models, for the README (a model's config decides)


FAMILIES = {f.name: f for f in (
    Family("sd1", "SD 1.x", "StableDiffusionPipeline", ("text_encoder",), "clip", True, (512,)),
    Family("sd2", "SD 2.x", "StableDiffusionPipeline", ("text_encoder",), "open_clip", True, (512, 768)),
    Family("sdxl", "SDXL", "StableDiffusionXLPipeline", ("text_encoder", "text_encoder_2"), "sdxl", False, (1024,)),
)}


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def family_of(model_dir):
    """The Family of a diffusers model folder; a UserError for a pipeline of no family here."""
    index_path = os.path.join(model_dir, "model_index.json")
    try:
        pipeline = _read_json(index_path).get("_class_name")
    except (OSError, ValueError) as err:
        raise utils.UserError(f"cannot read {index_path}: {getattr(err, 'strerror', None) or err}") from None
    if pipeline == "StableDiffusionXLPipeline":
        return FAMILIES["sdxl"]
    if pipeline == "StableDiffusionPipeline":
        try:
            activation = _read_json(os.path.join(model_dir, "text_encoder", "config.json")).get("hidden_act")
        except (OSError, ValueError):
            activation = None  # the model check names the missing part
        return FAMILIES["sd2" if activation == "gelu" else "sd1"]
    supported = ", ".join(f"{f.label} ({f.pipeline})" for f in FAMILIES.values() if f.trained)
    raise utils.UserError(f"{model_dir} is a {pipeline} model; this suite trains {supported}")


def check_trained(model_dir):
    """The model's Family, or a UserError when the suite does not train and draw that family yet."""
    family = family_of(model_dir)
    if not family.trained:
        supported = ", ".join(f.label for f in FAMILIES.values() if f.trained)
        raise utils.UserError(f"{model_dir} is an {family.label} model ({family.pipeline}): not supported yet "
                              f"(this version runs {supported}); pass an SD 1.x or 2.x model")
    return family


def prediction_type(model_dir):
    """What the model's UNet predicts, from its scheduler's config: "epsilon" or "v_prediction"."""
    path = os.path.join(model_dir, "scheduler", "scheduler_config.json")
    try:
        return _read_json(path).get("prediction_type", "epsilon")
    except (OSError, ValueError):
        return "epsilon"

"""What serve.py can serve: the subjects under the store's subjects folder (a folder, or a bucket's), each a model
train.py saved in <subject>/model-tuned with its record, read again whenever it is asked for.

A subject is named by its record's model id, never by a file's time: a subject retrained to a new model has a new
id, so a request for it never reaches the adapter of the model before. Subjects are grouped by the base model that
draws them: the adapters of a LoRA (DoRA, LoHa, LoKr) run share their base; a full fine-tune is a base of its own."""

import dataclasses
import datetime
import hashlib
import os

from dreambooth import files
from dreambooth import storage
from dreambooth.models import outputs

MODEL_FOLDER = "model-tuned"  # a subject's model inside its folder (dreambooth_run.sh's TUNED_MODEL_DIR)
EVAL_SCORES = ("eval", "scores.json")  # its scores, where evaluate.py (Step 6) wrote them
EVAL_IMAGES = ("eval", "images", "tuned")  # the images they scored, whose record names the model that drew them
SCORE_KEYS = ("dino", "clip_i", "clip_t")
SUBJECT_MARK = "/"  # between a subject's name and its model id in the id a request is routed by


@dataclasses.dataclass(frozen=True)
class Subject:
    """A subject's model as its record says: the folder that holds it, the base model that draws it and the id the
    record gives it."""

    name: str
    folder: str  # the model's folder: the adapters of a LoRA run, or a whole pipeline
    base_model: str  # the model folder that draws it: the recorded base model, or the folder itself (a full model)
    model_id: str
    adapter: str | None  # "lora", "dora", "loha", "lokr"; None: a full fine-tune
    trained: str | None = None  # when its record was written (ISO 8601, UTC), where the store says
    scores: dict | None = None  # DINO, CLIP-I, CLIP-T of evaluate.py's report, or of the step --keep_best kept

    @property
    def routing_id(self):
        """The id Serve's multiplexing routes this subject's requests by: its name and its model's id."""
        return f"{self.name}{SUBJECT_MARK}{self.model_id}"

    @property
    def base_key(self):
        """Which base deployment draws it: the base model's folder (a full model's own, with its id)."""
        key = self.base_model if self.adapter else f"{self.folder}@{self.model_id}"
        return "painter-" + hashlib.sha256(key.encode()).hexdigest()[:12]

    def describe(self):
        """The subject as GET /v1/subjects lists it."""
        return {"subject": self.name, "base_model": self.base_model, "mode": "adapter" if self.adapter else "full",
                "adapter": self.adapter, "model_id": self.model_id, "trained": self.trained, "scores": self.scores}


def split_routing_id(routing_id):
    """(subject name, model id) of Subject.routing_id."""
    name, _, model_id = routing_id.rpartition(SUBJECT_MARK)
    return name, model_id


def subject_names(root):
    """The names of the folders under root that hold a model train.py saved, sorted."""
    if not storage.isdir(root):
        return []
    return sorted(name for name in storage.listdir(root)
                  if storage.isfile(storage.join(root, name, MODEL_FOLDER, files.OUTPUT_MARKER)))


def find(root, name, details=True):
    """The Subject of root/name as its record says now, or None where there is none (no such folder, no model saved,
    a name that is not one folder's). details: also when it was trained and its scores (what routing needs not)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        return None
    folder = storage.join(root, name, MODEL_FOLDER)
    try:
        output = outputs.read_output(folder)
    except (OSError, ValueError):  # (a record cut short or being written: not servable yet)
        return None
    if output is None or not output.model_id:
        return None
    lora = output.lora
    return Subject(name, folder, output.base_model if lora else folder, output.model_id,
                   lora.adapter if lora else None, *((trained_at(folder), scores_of(root, name, output)) if details
                                                     else ()))


def scan(root, details=True):
    """{name: Subject} of every subject under root (details: find's)."""
    found = {name: find(root, name, details) for name in subject_names(root)}
    return {name: subject for name, subject in found.items() if subject is not None}


def trained_at(folder):
    """When folder's record was written (ISO 8601, UTC), or None where the store does not say."""
    try:
        seconds = storage.mtime(storage.join(folder, files.OUTPUT_MARKER))
    except (OSError, AttributeError, TypeError):
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="seconds")


def scores_of(root, name, output):
    """The subject's scores: evaluate.py's (Step 6) where the images it scored were drawn by this very model (their
    record names the model's id), else those of the step --keep_best kept; None without either."""
    from dreambooth.generation import image_records

    report, drawn_by = storage.join(root, name, *EVAL_SCORES), storage.join(root, name, *EVAL_IMAGES,
                                                                            image_records.IMAGES_RECORD)
    try:
        tuned = storage.read_json(report)["models"]["tuned"]["overall"]
        model = str(storage.read_json(drawn_by).get("model"))
    except (OSError, ValueError, KeyError, TypeError):
        tuned, model = None, ""
    if tuned and outputs.trained_fingerprint(output.model_id) in model:
        return {key: tuned.get(key) for key in SCORE_KEYS}
    kept = (output.record.kept or {}).get("scores")
    return {key: kept.get(key) for key in SCORE_KEYS} if kept else None


def private_copy(subject, into):
    """subject's adapter file and record copied into the folder into (a bucket's too), read back: the TrainRecord the
    copy holds. The replica draws from its own copy, which a retraining that writes the subject's folder again never
    changes under it."""
    os.makedirs(into, exist_ok=True)
    record = storage.join(subject.folder, files.OUTPUT_MARKER)
    before = storage.read_bytes(record)
    weights = storage.read_bytes(storage.join(subject.folder, files.LORA_WEIGHTS_FILE))
    after = storage.read_bytes(record)
    files.write_bytes_atomic(weights, os.path.join(into, files.LORA_WEIGHTS_FILE))
    files.write_bytes_atomic(after, os.path.join(into, files.OUTPUT_MARKER))
    copied = outputs.read_output(into).record
    # (saved again while it was read: the weights may be the other model's; the caller asks again)
    return copied if before == after else dataclasses.replace(copied, model_id=None)

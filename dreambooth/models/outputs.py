"""What a folder the suite wrote holds, and what made it.

One reader for train.py's outputs (a full pipeline, or LoRA adapters on a base model) and one
fingerprint per model, so that anything reused later (class images, evaluation images) is reused
only when it was drawn by the same model with the same settings:

    ref = outputs.resolve_model(model_dir, lora_dir)   # a LoRA output stands for base + adapters
    ref.fingerprint()                                  # 'trained:<id>', 'org/name@<commit>', 'files:<hash>'
    outputs.read_output(folder)                        # TrainedOutput or None

train.py's outputs are written here too (`save_pipeline`, `save_lora`; a checkpoint as a model: `checkpoint.save_as_model`).
Generated image folders carry a record (generation/image_records.py) naming the model fingerprinted here and the
settings that drew them; drawing.top_up decides from it whether a folder's images can be kept.
"""

import dataclasses
import hashlib
import os
import re
import sys
import tempfile
import uuid

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import storage
from dreambooth.config import flags
from dreambooth.models import networks
from dreambooth.storage import runfiles

TRAIN_CONFIG = "train_config.toml"  # in a run folder and its model: train.py --config FILE repeats the run
_SNAPSHOT = re.compile(r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<revision>[0-9a-f]{40})/?$")
_SAMPLE_BYTES = 1 << 20  # read from each end of a weights file for a folder's content fingerprint


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """The shape of a run's adapters (train.py --use_lora, --rank, --lora_alpha, --adapter), as a model record holds
    it under "lora" ({"rank", "lora_alpha"}, and "adapter" when not LoRA's); a full fine-tune has none."""

    rank: int
    alpha: float
    adapter: str = "lora"  # "lora", "dora", "loha" or "lokr"

    @classmethod
    def of(cls, use_lora, rank, alpha, adapter=None):
        """Those of --use_lora, --rank, --lora_alpha and --adapter, or None without --use_lora."""
        return cls(rank, alpha, adapter or "lora") if use_lora else None

    @classmethod
    def from_record(cls, record):
        lora = record.get("lora")
        return cls(lora["rank"], lora["lora_alpha"], lora.get("adapter", "lora")) if lora else None

    def to_record(self):
        return {"rank": self.rank, "lora_alpha": self.alpha, **({"adapter": self.adapter} if self.adapter != "lora" else {})}


# TrainRecord.kept's entry for the run's scores folder (a bucket's too), where evaluate.py finds the images drawn already
KEPT_SCORES = "scores_dir"


@dataclasses.dataclass(frozen=True)
class TrainRecord:
    """What made a model train.py saved: its record (files.OUTPUT_MARKER, JSON) beside the weights."""

    base_model: str  # the model folder it was trained from
    steps: int = None
    instance_prompt: str = None
    class_prompt: str = None
    vae: str = None  # --pretrained_vae_model_name_or_path's folder, when one was trained with
    lora: LoraSettings = None  # a LoRA output's adapters; None for a full model
    ema_decay: float = None  # --use_ema: the weights are the moving average
    held_out: tuple = ()  # the photos --holdout kept out of its training
    model_id: str = None  # made when it was saved (new_model_id); None in records older than the id
    run_name: str = None
    identity: dict = None  # run_identity.of_run: what decided its weights
    trackers: dict = None  # the W&B/MLflow runs it was logged to (runfiles.RECORD), for evaluate.py's scores
    kept: dict = None  # --keep_best: the step whose model this is, of how many, its scores and why it was kept

    @classmethod
    def of_plan(cls, plan):
        """The record of a model saved now at the plan's end step, with a new model id."""
        return cls(plan.model_dir, plan.total_steps, plan.instance_prompt, plan.class_prompt, plan.vae_dir,
                   LoraSettings.of(plan.use_lora, plan.lora_rank, plan.lora_alpha, plan.adapter),
                   plan.ema_decay if plan.use_ema else None, tuple(plan.held_out),
                   new_model_id(), plan.run_name, plan.identity,
                   runfiles.read_record(plan.run_dir) or None)

    @classmethod
    def from_json(cls, data):
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        return cls(**{**values, "base_model": data.get("base_model", ""), "lora": LoraSettings.from_record(data),
                      "held_out": tuple(data.get("held_out") or ())})

    def to_json(self):
        return {**dataclasses.asdict(self), "lora": self.lora.to_record() if self.lora else None,
                "held_out": list(self.held_out)}


@dataclasses.dataclass(frozen=True)
class TrainedOutput:
    """train.py's output folder and its TrainRecord."""

    folder: str
    record: TrainRecord

    @property
    def base_model(self):
        return self.record.base_model

    @property
    def model_id(self):
        return self.record.model_id

    @property
    def lora(self):
        """Its LoraSettings, or None for a full model."""
        return self.record.lora


def holds_lora(folder):
    """True when folder (or a bucket's) holds LoRA adapters (train.py --use_lora's output) rather than a pipeline."""
    return storage.isfile(storage.join(folder, files.LORA_WEIGHTS_FILE))


def read_output(folder):
    """The TrainedOutput of folder (or a bucket's), or None when train.py did not write it."""
    path = storage.join(folder, files.OUTPUT_MARKER)
    if not storage.isfile(path):
        return None
    return TrainedOutput(folder, TrainRecord.from_json(storage.read_json(path)))


def new_model_id():
    """The id a saved model carries in its record: a retrained model never shares it."""
    return uuid.uuid4().hex


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """What draws images: a pipeline folder, and LoRA adapters fused onto it at lora_scale."""

    model_dir: str
    lora_dir: str | None = None
    lora_scale: float = 1.0

    @property
    def trained(self):
        """True when train.py made the weights (the model, or the adapters on it)."""
        return read_output(self.lora_dir or self.model_dir) is not None

    def fingerprint(self):
        base = model_fingerprint(self.model_dir)
        if not self.lora_dir:
            return base
        return f"{base}+lora:{model_fingerprint(self.lora_dir)}@{self.lora_scale:g}"

    def describe(self):
        return f"{self.model_dir} + LoRA {self.lora_dir}" if self.lora_dir else self.model_dir


def resolve_model(model_dir, lora_dir=None, lora_scale=1.0):
    """The ModelRef of --model_dir/--lora_dir. A LoRA output of train.py given as --model_dir
    stands for its base model with its adapters. A bucket's model and adapters are copied here first (storage.cached:
    the ModelRef names this node's copies, which a Ray actor on another node fetches with storage.ensure_local)."""
    if lora_dir is None and holds_lora(model_dir):
        output = read_output(model_dir)
        if output is None:
            raise errors.UserError(f"{model_dir} holds LoRA adapters: pass the base model as --model_dir and "
                                   f"this folder as --lora_dir")
        model_dir, lora_dir = output.base_model, model_dir
        print(f"LoRA adapters of {lora_dir} on their base model {model_dir}", file=sys.stderr)
    lora_dir = storage.cached(lora_dir) if storage.is_remote(lora_dir) else lora_dir
    model_dir = storage.cached(model_dir) if storage.is_remote(model_dir) else model_dir  # (a sweep's trial model)
    if lora_dir:  # (a broken link, a folder of a file's name, an empty or cut-short file: said as such)
        files.check_model_files(lora_dir, "train or copy the adapters again")
    if lora_dir and not holds_lora(lora_dir):
        raise errors.UserError(f"--lora_dir {lora_dir} has no {files.LORA_WEIGHTS_FILE}")
    if lora_dir:
        check_lora_fits(model_dir, lora_dir)
    return ModelRef(model_dir, lora_dir, lora_scale)


def lora_width(lora_dir):
    """The width of the text states the adapters' cross-attention reads (768 SD 1.x, 1024 SD 2.x, 2048
    SDXL), from the file's header alone; None when it holds no cross-attention adapter."""
    from safetensors import safe_open

    with safe_open(os.path.join(lora_dir, files.LORA_WEIGHTS_FILE), "pt") as weights:
        for key in weights.keys():
            if "attn2.to_k" in key and any(down in key for down in ("lora_A", "lora_down", "lora.down")):
                return weights.get_slice(key).get_shape()[-1]
    return None


def check_lora_fits(model_dir, lora_dir):
    """UserError, before any actor loads them, when the adapters of lora_dir were trained on a model of
    another shape than model_dir (SDXL adapters on an SD 1.x model): one line naming both families."""
    family = families.family_of(model_dir)
    width = families.part_config(model_dir, family.denoiser).get("cross_attention_dim")
    adapters = lora_width(lora_dir)
    if adapters is None or not isinstance(width, int) or adapters == width:
        return
    output = read_output(lora_dir)
    base = output.base_model if output is not None else ""
    made_for = (f"an {families.family_of(base).label} model ({base})" if base and os.path.isdir(base)
                else f"a model whose text states are {adapters} wide")
    raise errors.UserError(f"the LoRA adapters in {lora_dir} were trained on {made_for} and {model_dir} is an "
                           f"{family.label} model ({width} wide): pass the base model they "
                           f"were trained on as --model_dir")


def trained_fingerprint(model_id):
    """model_fingerprint of a model train.py saved with model_id."""
    return f"trained:{model_id}"


def model_fingerprint(folder):
    """A short string that changes whenever the weights in folder do.

    train.py's outputs carry an id made when they were saved; a hub snapshot is named by its
    commit; any other folder is fingerprinted from its files (names, sizes, and the first and
    last MiB of every weights file: enough to tell two trainings apart, in milliseconds)."""
    output = read_output(folder)
    if output is not None and output.model_id:
        return trained_fingerprint(output.model_id)
    match = _SNAPSHOT.search(os.path.abspath(folder))
    if match and output is None:
        return f"{match['owner']}/{match['name']}@{match['revision']}"
    digest = hashlib.sha256()
    for root, dirs, names in sorted(os.walk(folder)):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            digest.update(f"{os.path.relpath(path, folder)}:{size}\n".encode())
            if name.endswith((".safetensors", ".bin", ".json")):
                with open(path, "rb") as f:
                    digest.update(f.read(_SAMPLE_BYTES))
                    if size > 2 * _SAMPLE_BYTES:
                        f.seek(-_SAMPLE_BYTES, os.SEEK_END)
                        digest.update(f.read())
    return f"files:{digest.hexdigest()[:16]}"


# ---------------------------------------------------------------- writing train.py's outputs


def check_output_dir(output_dir, overwrite):
    """Refuse to replace a non-empty folder (or a bucket's) that is not a previous output of ours."""
    if overwrite or not storage.listdir(output_dir):
        return
    if not storage.isfile(storage.join(output_dir, files.OUTPUT_MARKER)):
        raise errors.UserError(f"--output_dir {output_dir} is not empty and was not written by train.py; "
                               "pass --overwrite to replace it")


def save_pipeline(nets, plan):
    """Write the result to output_dir, whole or not at all: the fine-tuned pipeline, or with
    LoRA the adapters as pytorch_lora_weights.safetensors (diffusers' LoRA format, with their
    rank and alpha) for StableDiffusionPipeline.load_lora_weights on the base model."""
    import diffusers

    denoiser = networks.unwrap(nets.denoiser)
    text_encoders = {name: networks.unwrap(model) for name, model in zip(plan.family.text_encoders, nets.text_encoders())}
    record = TrainRecord.of_plan(plan)

    def write(tmp):
        if plan.use_lora:
            trained = {name: text_encoders[name] for name in plan.family.trainable_text_encoders if name in text_encoders}
            save_lora(tmp, plan.family, denoiser, trained if plan.train_text_encoder else {})
        else:
            pipeline = getattr(diffusers, plan.family.pipeline)
            # a VAE trained with (--pretrained_vae_model_name_or_path) stays with the model
            vae = {"vae": nets.vae} if plan.vae_dir else {}
            pipe = networks.from_pretrained(pipeline, plan.model_dir, plan.allow_unsafe_weights,
                                            **{plan.family.denoiser: denoiser}, **text_encoders, **vae)
            pipe.save_pretrained(tmp, safe_serialization=True)
        files.write_json(os.path.join(tmp, files.OUTPUT_MARKER), record.to_json())
        if plan.settings_toml:
            flags.write_config(os.path.join(tmp, TRAIN_CONFIG), plan.settings_toml)

    write_output(plan.output_dir, write)


def write_output(output_dir, write):
    """output_dir (or a bucket's) replaced whole by what write(folder) writes in a folder, or left as it was."""
    if storage.is_remote(output_dir):  # written here, then copied to the bucket, its record last
        with tempfile.TemporaryDirectory(prefix="dreambooth-model-") as tmp:
            write(tmp)
            storage.replace_folder(tmp, output_dir, last=files.OUTPUT_MARKER)
    else:
        files.atomic_write_dir(output_dir, write)


def expected_bytes(nets, lora):
    """About the size of save_pipeline's output: the adapters (LoRA), else every network's weights."""
    modules = [nets.denoiser, *nets.text_encoders()] + ([] if lora or nets.vae is None else [nets.vae])
    return sum(p.numel() * p.element_size() for m in modules for p in networks.unwrap(m).parameters()
               if not lora or p.requires_grad)


def save_lora(folder, family, denoiser, text_encoders=None):
    """files.LORA_WEIGHTS_FILE in folder, written by the family's pipeline's save_lora_weights.
    text_encoders: {"text_encoder"[, "text_encoder_2"]: model} with adapters, or {}."""
    import diffusers
    from peft.utils import get_peft_model_state_dict

    def layers(model):
        peft_layers = get_peft_model_state_dict(model, save_embedding_layers=False)
        # (LoHa's and LoKr's in peft's own names: diffusers' names are LoRA's)
        return peft_layers if model.peft_config["default"].peft_type in ("LOHA", "LOKR") else \
            family.lora_file_layers(peft_layers)

    text_encoders = text_encoders or {}
    parts = {family.denoiser: denoiser, **text_encoders}
    getattr(diffusers, family.pipeline).save_lora_weights(
        folder, weight_name=files.LORA_WEIGHTS_FILE,
        **{f"{name}_lora_layers": layers(model) for name, model in parts.items()},
        **{f"{name}_lora_adapter_metadata": adapter_metadata(model) for name, model in parts.items()})


def adapter_metadata(model):
    """The adapters' peft config as the file's metadata, its sets (the target modules) sorted: in the order of a set
    they would change with each process's hash seed, and the same adapters would not be the same file."""
    return {key: sorted(value) if isinstance(value, (set, frozenset)) else value
            for key, value in model.peft_config["default"].to_dict().items()}



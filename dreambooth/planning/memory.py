"""How much GPU memory a training run needs per worker, before it starts: one table for the
preflight, docs/MEMORY.md and `python -m dreambooth.planning.memory`.

    python -m dreambooth.planning.memory   the tables of docs/MEMORY.md (markdown)

The figure is computed, not guessed from a tiny model:
- **Parameters** of each network: the released models' counts (RELEASED; tests/unit/test_memory.py
  checks SD 1.x's and SDXL's against the architectures built on torch's meta device), or a cached
  model's own, read from its safetensors headers.
- **Bytes per parameter**: a trained one holds its fp32 weight, its fp32 gradient and AdamW's two
  fp32 moments (16 bytes; 10 with 8-bit Adam, whose moments take 1 byte each), plus an fp32 copy
  with --use_ema; a frozen one sits in the autocast dtype (2 bytes; 4 without mixed precision). LoRA
  adapters are about 0.1 % of their network's parameters at rank 4.
- **Activations**, measured: SD 1.x at 512 px with bf16 autocast on an H100 (benchmarks/bench.py) peaked at
  18.0 GiB (full fine-tune), 15.2 GiB (with gradient checkpointing) and 16.8 GiB (UNet only, latents
  cached); less the weights and optimizer state that leaves about 0.95 GiB per image in the step
  (instance + class rows) without gradient checkpointing and 0.11 GiB with it. Other families and
  sizes are scaled by the UNet's parameter count and the pixel count (attention runs in PyTorch's
  memory-efficient kernels, linear in the pixels); fp32 activations take twice as much.
  The flow-matching transformers (SD 3.5, Flux.1) are not scaled from the UNet: their activations are
  counted on the meta device for their own shapes and resolution and calibrated on SD 1.x's measurement
  (activations.py says how and what that assumes).
- **Frozen text encoders** (--no-train_text_encoder) are on the GPU only while the prompts' states are
  computed, before the denoiser arrives (models.setup_models' before_denoiser): the start's peak is the text
  side alone. SD 3.5's and Flux.1's T5 is never trained, so with --train_text_encoder it stays.
- **A quantised frozen base** (--base_precision, LoRA): int8 weights take 1 byte a parameter, nf4 half a
  byte plus one fp32 scale per 64 (bitsandbytes' blocks); the frozen text encoders likewise with
  --text_encoder_precision.
- **Validation samples** (--validation_prompt) draw with the trained networks, except where a family's pipeline
  draws with one more (Ideogram 4's unconditional transformer): that one is counted, frozen, beside the denoiser.
- **The card** keeps RESERVE_GIB for the CUDA context, cuDNN's workspace and the allocator's cache.
"""

import dataclasses
import functools
import sys

from dreambooth import families
from dreambooth.planning import activations

GIB = 2 ** 30
RESERVE_GIB = 1.0
LORA_SHARE = 0.001  # adapter parameters per network parameter at rank 4 (SD 1.x's UNet: 0.8 M of 860 M)
ACTIVATION_GIB = 0.95  # per image, SD 1.x's UNet at 512 px, autocast
CHECKPOINTED_GIB = 0.11  # the same with gradient checkpointing
REFERENCE_UNET, REFERENCE_PIXELS = 859.52e6, 512 * 512
BASE_BYTES = {"int8": 1.0, "nf4": 0.5 + 4 / 64}  # --base_precision, --text_encoder_precision: bytes per parameter
CARDS_GIB = (16, 24, 48, 80)  # the flow table's cards

# Parameter counts of the released models' networks (diffusers' folders), as each family says them
RELEASED = {name: family.released_params for name, family in families.FAMILIES.items() if family.released_params}
# the table's resolution of each family: its released models' largest
DEFAULT_RESOLUTION = {name: max(families.FAMILIES[name].released_resolutions) for name in RELEASED}


# Optimizer state per trained parameter, bytes: AdamW's two fp32 moments, bitsandbytes' 8-bit ones (1 byte each
# and a scale per block), Prodigy's moments, its s and its copy of the starting weights, schedule-free AdamW's z
# and second moment
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2, "prodigy": 16, "adamw_schedulefree": 8}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What decides a worker's memory: train.py's flags that matter, and the images in a step."""

    lora: bool = False
    rank: int = 4
    train_text_encoder: bool = True
    gradient_checkpointing: bool = False
    use_8bit_adam: bool = False
    optimizer: str = "adamw"  # --optimizer (adamw8bit: use_8bit_adam)
    use_ema: bool = False
    batch: int = 2  # instance images per worker and step (--train_batch_size)
    class_images: bool = True  # as many class images in the step (prior preservation with class images)
    prior_prediction: bool = False  # the frozen base UNet's prediction instead (a second forward pass)
    resolution: int = 512
    half: bool = True  # bf16/fp16 autocast (on every GPU but with --mixed_precision no)
    gpus_per_worker: int = 1
    base_precision: str = None  # --base_precision int8|nf4 (LoRA): the frozen denoiser's weights
    text_encoder_precision: str = None  # --text_encoder_precision int8|nf4 (LoRA): the frozen text encoders' weights
    shards: int = 1  # --fsdp over this many workers: the denoiser's weights, gradients and AdamW state split
    validation: bool = False  # --validation_prompt: the networks only drawing reads too (family.drawing_params)

    def flags(self):
        """The train.py flags of this setup, as a user types them."""
        words = ["--use_lora"] * self.lora
        words += ["--gradient_checkpointing"] * self.gradient_checkpointing + ["--use_8bit_adam"] * self.use_8bit_adam
        words += ["--optimizer", self.optimizer] * (self.optimizer not in ("adamw", "adamw8bit"))
        if not self.train_text_encoder:
            words.append("--no-train_text_encoder")
        if self.base_precision:
            words += ["--base_precision", self.base_precision]
        if self.text_encoder_precision:
            words += ["--text_encoder_precision", self.text_encoder_precision]
        if self.shards > 1:
            words += ["--fsdp", "--num_workers", str(self.shards)]
        return words


# Measured peaks (GiB, torch.cuda.max_memory_allocated) of the table's setups; the rest is computed
# (each family's own measurements, not those of the family it builds on)
MEASURED = {(name, Setup(**setup)): gib for name, f in families.FAMILIES.items()
            for setup, gib in vars(type(f)).get("measured_memory", ())}


@dataclasses.dataclass(frozen=True)
class Need:
    """GiB per worker: on the denoiser's card, and on the second card with --gpus_per_worker 2."""

    static: float  # weights, gradients, optimizer and EMA state
    activations: float
    second_card: float = 0.0
    at_start: float = 0.0  # the text side alone at the start: frozen encoders computing the prompts' states, released
    # before the denoiser arrives

    @property
    def total(self):
        return max(self.static + self.activations, self.at_start)


def need(family, setup, params=None, source=None):
    """The Need of setup for a model of family ("sd1", "sdxl", "flux", ...); params: its networks' parameter
    counts ({"unet": n, "text_encoder": n, ...}; default: the released model's); source: for the flow-matching
    families, the model folder or own size whose activations are counted (default: the released model's)."""
    spec = families.FAMILIES[family]
    params = params or RELEASED[family]
    denoiser = params[spec.denoiser]
    frozen_bytes = 2 if setup.half else 4
    optimizer = "adamw8bit" if setup.use_8bit_adam else setup.optimizer
    trained_bytes = 4 + 4 + OPTIMIZER_BYTES[optimizer] + (4 if setup.use_ema else 0)
    encoders = {name: n for name, n in params.items() if name.startswith("text_encoder")}
    # (a family without trainable text encoders, Qwen-Image, trains none and releases its frozen one either way)
    setup = dataclasses.replace(setup, train_text_encoder=spec.trains_text_encoder(setup.train_text_encoder))
    trained = sum(n for name, n in encoders.items() if name in spec.trainable_text_encoders) \
        if setup.train_text_encoder else 0
    frozen = sum(encoders.values()) - trained
    if setup.lora:
        adapters = LORA_SHARE * setup.rank / 4 * (denoiser + trained)
        denoiser_side = adapters * trained_bytes + denoiser * BASE_BYTES.get(setup.base_precision, frozen_bytes)
        aux = trained * frozen_bytes
    else:
        denoiser_side = denoiser * trained_bytes / setup.shards
        aux = trained * trained_bytes
        if setup.prior_prediction:
            denoiser_side += denoiser * frozen_bytes  # the frozen base denoiser
    if setup.validation:  # (frozen beside the denoiser, in the base's precision: validation.Sampler)
        denoiser_side += spec.drawing_params(params) * BASE_BYTES.get(setup.base_precision, frozen_bytes)
    vae = params.get("vae", 0) * frozen_bytes
    aux += vae
    # frozen encoders: released after the first states, before the denoiser arrives, unless a trained one needs
    # them every step
    frozen_encoder_bytes = BASE_BYTES.get(setup.text_encoder_precision, frozen_bytes) if setup.lora else frozen_bytes
    kept, at_start = ((frozen * frozen_encoder_bytes, 0.0) if setup.train_text_encoder
                      else (0.0, frozen * frozen_encoder_bytes + vae))
    aux += kept
    images = setup.batch * (2 if setup.class_images else 1)
    if spec.flow_matching:
        per_image = activations.per_image_gib(family, source or spec.released_size, setup.resolution,
                                              setup.gradient_checkpointing) * (1 if setup.half else 2)
    else:
        per_image = (CHECKPOINTED_GIB if setup.gradient_checkpointing else ACTIVATION_GIB) * (
            denoiser / REFERENCE_UNET * setup.resolution ** 2 / REFERENCE_PIXELS * (1 if setup.half else 2))
    activation = per_image * images * (1.5 if setup.prior_prediction else 1)
    if setup.gpus_per_worker == 2:
        return Need(denoiser_side / GIB, activation, max(aux, at_start) / GIB)
    return Need((denoiser_side + aux) / GIB, activation, at_start=at_start / GIB)


def fixes(family, setup, free_gib, params=None, source=None):
    """The first change that makes setup fit a card with free_gib free, trying the ones that keep the
    result first (gradient checkpointing, 8-bit Adam), then those that change what is trained
    (the text encoder frozen, LoRA; for a flow-matching transformer also LoRA over an int8 or nf4 base),
    then smaller steps and images: (flags to add, the Setup, its Need), or None."""
    def cumulative(ladder):  # each step of a ladder with every step before it
        changes = {}
        return [changes := {**changes, **change} for change in ladder]

    smaller = max(256, setup.resolution * 3 // 4 // 64 * 64)
    lora = [dict(lora=True), dict(gradient_checkpointing=True)]
    if families.FAMILIES[family].flow_matching:  # (T5 released, then the base quantised, then the text encoders)
        lora += [dict(train_text_encoder=False), dict(base_precision="int8"), dict(base_precision="nf4"),
                 dict(text_encoder_precision="int8"), dict(text_encoder_precision="nf4")]
    candidates = cumulative([dict(gradient_checkpointing=True), dict(use_8bit_adam=True),
                             dict(train_text_encoder=False)]) + cumulative(lora + [dict(batch=1),
                                                                                   dict(resolution=smaller)])
    for change in candidates:
        if all(getattr(setup, k) == v for k, v in change.items()):
            continue
        if setup.lora and not change.get("lora"):
            continue  # (8-bit Adam and a frozen encoder save next to nothing on adapters)
        candidate = dataclasses.replace(setup, **change)
        result = need(family, candidate, params, source)
        if fits(result, free_gib):
            words = [w for w in candidate.flags() if w not in setup.flags()]
            if candidate.batch != setup.batch:
                words.append(f"--train_batch_size {candidate.batch}")
            if candidate.resolution != setup.resolution:
                words.append(f"--resolution {candidate.resolution}")
            return words, candidate, result
    return None


def fits(result, free_gib):
    return max(result.total, result.second_card) + RESERVE_GIB <= free_gib


# ---------------------------------------------------------------- the table (docs/MEMORY.md, --help of preflight)

TABLE_ROWS = (
    ("full: UNet + text encoder(s) (default)", Setup()),
    ("full, `--gradient_checkpointing`", Setup(gradient_checkpointing=True)),
    ("full, `--gradient_checkpointing --use_8bit_adam`", Setup(gradient_checkpointing=True, use_8bit_adam=True)),
    ("UNet only, `--gradient_checkpointing --use_8bit_adam --no-train_text_encoder`",
     Setup(gradient_checkpointing=True, use_8bit_adam=True, train_text_encoder=False)),
    ("LoRA, `--use_lora`", Setup(lora=True)),
    ("LoRA, `--use_lora --gradient_checkpointing`", Setup(lora=True, gradient_checkpointing=True)),
    ("LoRA, `--use_lora --gradient_checkpointing --train_batch_size 1`",
     Setup(lora=True, gradient_checkpointing=True, batch=1)),
)


def table():
    """docs/MEMORY.md's memory table of the UNet families: GiB per worker for each mode and family at its
    resolution, two instance + two class images a step (dreambooth_run.sh's batch) unless the row says
    otherwise."""
    names = [name for name in RELEASED if not families.FAMILIES[name].flow_matching]
    head = "| mode (train.py flags) | " + " | ".join(
        f"{families.FAMILIES[f].label}, {DEFAULT_RESOLUTION[f]} px" for f in names) + " |"
    lines = [head, "| --- |" + " ---: |" * len(names)]
    for label, setup in TABLE_ROWS:
        cells = []
        for family in names:
            row = dataclasses.replace(setup, resolution=DEFAULT_RESOLUTION[family])
            cell = f"{need(family, row).total:.1f}"
            if (family, row) in MEASURED:
                cell += f" ({MEASURED[family, row]:.1f} measured)"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The flow-matching transformers' rows: (model, family, own size, resolution, setup): LoRA (as people train
# them) with gradient checkpointing, one photo + one class image a step, T5 released (--no-train_text_encoder),
# over a bf16, int8 or nf4 base (and nf4 text encoders, where they are the larger part: flow_table); and the full
# fine-tunes that fit one card at best.
_LORA = Setup(lora=True, gradient_checkpointing=True, batch=1, train_text_encoder=False)
_FULL = Setup(gradient_checkpointing=True, use_8bit_adam=True, batch=1, train_text_encoder=False)
# The models are those each family names (Family.memory_rows).
_MODELS = [(model, name, size, sizes, shards) for name, f in families.FAMILIES.items()
           for model, size, sizes, shards in f.memory_rows]
FLOW_ROWS = tuple(
    [(model, family, size, px, dataclasses.replace(_LORA, base_precision=base, text_encoder_precision=encoders))
     for model, family, size, sizes, _ in _MODELS for px in sizes
     for base, encoders in ((None, None), ("int8", None), ("nf4", None), ("nf4", "nf4"))]
    + [(model, family, size, 1024, _FULL) for model, family, size, _, _ in _MODELS]
    + [(model, family, size, 1024, dataclasses.replace(_FULL, shards=count, use_8bit_adam=False))
       for model, family, size, _, shards in _MODELS for count in shards])


@functools.lru_cache(maxsize=8)
def size_params(family, size):
    """{network: parameter count} of one of family's own full sizes, built on the meta device."""
    from dreambooth.models import random_models

    return random_models.parameter_counts(size, families.FAMILIES[family].random.arch)


def flow_table():
    """docs/MEMORY.md's table of the flow-matching transformers: GiB per worker of each row of FLOW_ROWS, and
    whether it fits each card of CARDS_GIB (with RESERVE_GIB kept). A row with quantised text encoders only where
    they need less than the row before (where the text encoders, not the transformer, decide the figure)."""
    lines = ["| model, px | train.py flags | GiB | " + " | ".join(f"{card} GB" for card in CARDS_GIB) + " |",
             "| --- | --- | ---: |" + " :---: |" * len(CARDS_GIB)]
    before = None
    for model, family, size, px, setup in FLOW_ROWS:
        result = need(family, dataclasses.replace(setup, resolution=px), size_params(family, size), size)
        if setup.text_encoder_precision and round(result.total, 1) >= round(before.total, 1):
            continue
        before = result
        marks = " | ".join("fits" if fits(result, card * 10 ** 9 / GIB) else "-" for card in CARDS_GIB)
        batch = [f"--train_batch_size {setup.batch}"] if setup.batch != Setup.batch else []
        lines.append(f"| {model}, {px} | `{' '.join(setup.flags() + batch)}` | {result.total:.1f} | {marks} |")
    return "\n".join(lines)


def main():
    """`python -m dreambooth.planning.memory`: both tables, as docs/MEMORY.md shows them."""
    sys.stdout.write(table() + "\n\n" + flow_table() + "\n")


if __name__ == "__main__":
    main()

"""How much GPU memory a training run needs per worker, before it starts: one table for the
preflight, the README and `python -m dreambooth.memory`.

    python -m dreambooth.memory   the README's table (markdown)

The figure is computed, not guessed from a tiny model:
- **Parameters** of each network: the released models' counts (RELEASED; tests/test_memory.py
  checks SD 1.x's and SDXL's against the architectures built on torch's meta device), or a cached
  model's own, read from its safetensors headers.
- **Bytes per parameter**: a trained one holds its fp32 weight, its fp32 gradient and AdamW's two
  fp32 moments (16 bytes; 10 with 8-bit Adam, whose moments take 1 byte each), plus an fp32 copy
  with --use_ema; a frozen one sits in the autocast dtype (2 bytes; 4 without mixed precision). LoRA
  adapters are about 0.1 % of their network's parameters at rank 4.
- **Activations**, measured: SD 1.x at 512 px with bf16 autocast on an H100 (BENCHMARKS.md) peaked at
  18.0 GiB (full fine-tune), 15.2 GiB (with gradient checkpointing) and 16.8 GiB (UNet only, latents
  cached); less the weights and optimizer state that leaves about 0.95 GiB per image in the step
  (instance + class rows) without gradient checkpointing and 0.11 GiB with it. Other families and
  sizes are scaled by the UNet's parameter count and the pixel count (attention runs in PyTorch's
  memory-efficient kernels, linear in the pixels); fp32 activations take twice as much.
- **The card** keeps RESERVE_GIB for the CUDA context, cuDNN's workspace and the allocator's cache.
"""

import dataclasses
import glob
import os
import sys

from dreambooth import families
from dreambooth import utils

GIB = 2 ** 30
RESERVE_GIB = 1.0
LORA_SHARE = 0.001  # adapter parameters per network parameter at rank 4 (SD 1.x's UNet: 0.8 M of 860 M)
ACTIVATION_GIB = 0.95  # per image, SD 1.x's UNet at 512 px, autocast
CHECKPOINTED_GIB = 0.11  # the same with gradient checkpointing
REFERENCE_UNET, REFERENCE_PIXELS = 859.52e6, 512 * 512

# Parameter counts of the released models' networks (diffusers' folders), as each family says them
RELEASED = {name: family.released_params for name, family in families.FAMILIES.items() if family.released_params}
# the table's resolution of each family: its released models' largest
DEFAULT_RESOLUTION = {name: max(families.FAMILIES[name].released_resolutions) for name in RELEASED}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What decides a worker's memory: train.py's flags that matter, and the images in a step."""

    lora: bool = False
    rank: int = 4
    train_text_encoder: bool = True
    gradient_checkpointing: bool = False
    use_8bit_adam: bool = False
    use_ema: bool = False
    batch: int = 2  # instance images per worker and step (--train_batch_size)
    class_images: bool = True  # as many class images in the step (prior preservation with class images)
    prior_prediction: bool = False  # the frozen base UNet's prediction instead (a second forward pass)
    resolution: int = 512
    half: bool = True  # bf16/fp16 autocast (on every GPU but with --mixed_precision no)
    gpus_per_worker: int = 1

    def flags(self):
        """The train.py flags of this setup, as a user types them."""
        words = ["--use_lora"] * self.lora
        words += ["--gradient_checkpointing"] * self.gradient_checkpointing + ["--use_8bit_adam"] * self.use_8bit_adam
        if not self.train_text_encoder:
            words.append("--no-train_text_encoder")
        return words


# Measured peaks (GiB, torch.cuda.max_memory_allocated) of the table's setups; the rest is computed
MEASURED = {("sd1", Setup()): 18.0, ("sd1", Setup(gradient_checkpointing=True)): 15.2}


@dataclasses.dataclass(frozen=True)
class Need:
    """GiB per worker: on the UNet's card, and on the second card with --gpus_per_worker 2."""

    static: float  # weights, gradients, optimizer and EMA state
    activations: float
    second_card: float = 0.0

    @property
    def total(self):
        return self.static + self.activations


def need(family, setup, params=None):
    """The Need of setup for a model of family ("sd1", "sd2", "sdxl"); params: its networks' parameter
    counts ({"unet": n, "text_encoder": n, ...}; default: the released model's)."""
    params = params or RELEASED[family]
    frozen_bytes = 2 if setup.half else 4
    trained_bytes = 4 + 4 + (2 if setup.use_8bit_adam else 8) + (4 if setup.use_ema else 0)
    encoders = sum(n for name, n in params.items() if name.startswith("text_encoder"))
    if setup.lora:
        adapters = LORA_SHARE * setup.rank / 4 * (params["unet"] + (encoders if setup.train_text_encoder else 0))
        unet_side = adapters * trained_bytes + params["unet"] * frozen_bytes
        aux = encoders * frozen_bytes
    else:
        unet_side = params["unet"] * trained_bytes
        aux = encoders * (trained_bytes if setup.train_text_encoder else frozen_bytes)
        if setup.prior_prediction:
            unet_side += params["unet"] * frozen_bytes  # the frozen base UNet
    aux += params.get("vae", 0) * frozen_bytes
    images = setup.batch * (2 if setup.class_images else 1)
    per_image = CHECKPOINTED_GIB if setup.gradient_checkpointing else ACTIVATION_GIB
    scale = params["unet"] / REFERENCE_UNET * setup.resolution ** 2 / REFERENCE_PIXELS * (1 if setup.half else 2)
    activations = per_image * images * scale * (1.5 if setup.prior_prediction else 1)
    if setup.gpus_per_worker == 2:
        return Need(unet_side / GIB, activations, aux / GIB)
    return Need((unet_side + aux) / GIB, activations)


def fixes(family, setup, free_gib, params=None):
    """The first change that makes setup fit a card with free_gib free, trying the ones that keep the
    result first (gradient checkpointing, 8-bit Adam), then those that change what is trained
    (the text encoder frozen, LoRA), then smaller steps and images: (flags to add, the Setup, its
    Need), or None."""
    ladder = [dict(gradient_checkpointing=True), dict(use_8bit_adam=True), dict(train_text_encoder=False)]
    candidates, changes = [], {}
    for change in ladder:
        changes = {**changes, **change}
        candidates.append(dict(changes))
    smaller = max(256, setup.resolution * 3 // 4 // 64 * 64)
    candidates += [dict(lora=True), dict(lora=True, gradient_checkpointing=True),
                   dict(lora=True, gradient_checkpointing=True, batch=1),
                   dict(lora=True, gradient_checkpointing=True, batch=1, resolution=smaller)]
    for change in candidates:
        if all(getattr(setup, k) == v for k, v in change.items()):
            continue
        if setup.lora and not change.get("lora"):
            continue  # (8-bit Adam and a frozen encoder save next to nothing on adapters)
        candidate = dataclasses.replace(setup, **change)
        result = need(family, candidate, params)
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


def safetensors_params(model_dir):
    """{network: parameter count} of a cached model, from its safetensors headers (no weights read)."""
    counts = {}
    for path in glob.glob(os.path.join(model_dir, "*", "*.safetensors")):
        part = os.path.basename(os.path.dirname(path))
        header = utils.safetensors_header(path)[1]
        total = 0
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
        counts[part] = counts.get(part, 0) + total
    return {k: v for k, v in counts.items() if k == "unet" or k == "vae" or k.startswith("text_encoder")}


# ---------------------------------------------------------------- the table (README, --help of preflight)

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
    """The README's memory table: GiB per worker for each mode and family at its resolution, two
    instance + two class images a step (dreambooth_run.sh's batch) unless the row says otherwise."""
    names = list(RELEASED)
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


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")

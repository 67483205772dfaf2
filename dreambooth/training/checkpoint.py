"""The training checkpoint format, in one place: save, load, complete-or-not, find, resolve.

A checkpoint folder holds:
    unet.safetensors          the denoiser's weights (with LoRA: its adapters only), named as its
                              subfolder (SD 3.5: transformer.safetensors)
    text_encoder.safetensors  text-encoder weights (only when it is trained; adapters with LoRA),
                              and each other text encoder's likewise, named as its subfolder
                              (SDXL: text_encoder_2.safetensors)
    ema.safetensors           the moving average of the trained weights (with --use_ema), in the
                              order of steps.trained_parameters
    optimizer.pt              optimizer, LR schedule, grad scaler, every rank's RNG streams
    train_state.json          step, epoch, world size, the run's identity (run_identity.py: what
                              decides its weights) and each file's size, written last: a folder
                              copied or written only in part is recognised as incomplete and
                              never resumed from.
"""

import dataclasses
import json
import os
import sys

from dreambooth import filemodes
from dreambooth import files
from dreambooth import storage
from dreambooth.models import networks
from dreambooth.models import outputs
from dreambooth.models import sharding
from dreambooth.planning import checkpoints
from dreambooth.planning import planning

OPTIMIZER_FILE = "optimizer.pt"
EMA_FILE = "ema.safetensors"


# ---------------------------------------------------------------- RNG streams


def rng_state():
    """This process's torch RNG streams: the CPU generator and every visible GPU's."""
    import torch

    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    import torch

    torch.set_rng_state(state["cpu"].cpu())
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def gather_rng_states():
    """Every rank's rng_state(), in rank order (a collective: all ranks call it together)."""
    import torch.distributed as dist

    local = rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, local)
    return states


# ---------------------------------------------------------------- save and load


def save(state, folder, epoch, rng_states, train_text_encoder, identity=None, gathered=None):
    """Write state (a steps.TrainState) into folder; rng_states from gather_rng_states(); identity:
    the run's (plan.identity), which decides what may resume from it; gathered: a sharded denoiser's
    (weights, optimizer state) from sharding.gather, written in place of this rank's shards."""
    import torch
    from safetensors.torch import save_file

    denoiser_file = f"{state.models.family.denoiser}.safetensors"
    names = [denoiser_file, OPTIMIZER_FILE]
    weights, optimizer = gathered or (networks.trained_state_dict(state.models.denoiser), state.optimizer.state_dict())
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, denoiser_file))
    if train_text_encoder:
        for k, text_encoder in state.models.trainable():
            name = text_encoder_files(state.models.family)[k]
            save_file(networks.trained_state_dict(text_encoder), os.path.join(folder, name))
            names.append(name)
    if state.ema is not None:
        save_file(state.ema.state_dict(), os.path.join(folder, EMA_FILE))
        names.append(EMA_FILE)
    torch.save({"optimizer": optimizer, "sharded": gathered is not None, "lr_scheduler": state.lr_scheduler.state_dict(),
                "scaler": state.scaler.state_dict(), "rng": rng_states, "skipped_steps": state.skipped_steps},
               os.path.join(folder, OPTIMIZER_FILE))
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in names}
    files.write_json(os.path.join(folder, checkpoints.STATE_FILE),
                     {"step": state.step, "epoch": epoch, "world_size": len(rng_states), "identity": identity,
                      "sizes": sizes})


def keep_in_run(folder, run_folder, limit=None):
    """A checkpoint folder's files moved into run_folder (a folder, or in a bucket) as Ray Train names its own
    (checkpoint_<time>), its state file last (complete only once every file is there), then the oldest beyond limit
    (--checkpoints_total_limit) removed: a run in one process (--num_workers 0, Ray Train's local mode) keeps its
    checkpoints itself."""
    import datetime
    import shutil

    target = storage.join(run_folder, datetime.datetime.now().strftime("checkpoint_%Y-%m-%d_%H-%M-%S.%f"))
    for name in sorted(os.listdir(folder), key=lambda n: n == checkpoints.STATE_FILE):
        if storage.is_remote(target):
            storage.upload_file(os.path.join(folder, name), storage.join(target, name))
        else:
            os.makedirs(target, exist_ok=True)
            shutil.move(os.path.join(folder, name), os.path.join(target, name))  # (renamed where it can be)
    if not storage.is_remote(target):  # (safetensors wrote them for their owner only; Ray Train's copies follow the umask)
        filemodes.follow_umask(target)
    if limit:
        for old in sorted(checkpoints.run_checkpoints(run_folder), key=checkpoints.saved_step)[:-limit]:
            storage.remove_tree(old)


def text_encoder_files(family):
    """The checkpoint's file of each of the family's text encoders, in order: text_encoder.safetensors, ..."""
    return [f"{name}.safetensors" for name in family.text_encoders]


def load_weights(nets, folder):
    """The checkpoint's trained weights into nets (a networks.Models): UNet, and the text encoders if trained."""
    from safetensors.torch import load_file

    networks.load_trained_state_dict(nets.denoiser, load_file(os.path.join(folder, f"{nets.family.denoiser}.safetensors")))
    for name, text_encoder in zip(text_encoder_files(nets.family), nets.text_encoders()):
        if os.path.isfile(os.path.join(folder, name)):
            networks.load_trained_state_dict(text_encoder, load_file(os.path.join(folder, name)))


def load_ema(targets, folder):
    """The checkpoint's moving average copied into targets (an EMA's shadow, or the trained parameters
    themselves, in steps.trained_parameters' order); False when it has none (a run started without
    --use_ema)."""
    from safetensors.torch import load_file

    from dreambooth.training import steps  # (here: it imports torch, 2 s --help never waits for)

    path = os.path.join(folder, EMA_FILE)
    if not os.path.isfile(path):
        return False
    steps.load_average(targets, load_file(path))
    return True


def load(state, folder, rank):
    """Restore what save wrote into state; rank continues its own RNG stream. Returns the epoch."""
    import torch
    from safetensors.torch import load_file

    extra = torch.load(os.path.join(folder, OPTIMIZER_FILE), map_location="cpu", weights_only=True)
    if sharding.is_sharded(state.models.denoiser):  # every rank reads the whole files and keeps its shards
        if not extra.get("sharded"):
            raise ValueError(f"{folder} is a checkpoint of a run without --fsdp: continue it without --fsdp")
        weights = load_file(os.path.join(folder, f"{state.models.family.denoiser}.safetensors"))
        sharding.restore(state.models.denoiser, state.optimizer, weights, extra["optimizer"])
    else:
        if extra.get("sharded"):
            raise ValueError(f"{folder} is a checkpoint of a run with --fsdp: continue it with --fsdp")
        load_weights(state.models, folder)
        state.optimizer.load_state_dict(extra["optimizer"])
    if state.ema is not None and not load_ema(state.ema.shadow, folder):
        state.ema.restart(state.params)  # from the restored weights
        if rank == 0:
            print(f"{folder} holds no moving average (its run had no --use_ema): the average starts from "
                  "its weights", file=sys.stderr)
    # (torch.load above with weights_only: a checkpoint cannot execute code when it is loaded; the
    # optimizer moves its state onto each parameter's device itself)
    state.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    state.scaler.load_state_dict(extra["scaler"])
    state.skipped_steps = extra.get("skipped_steps", 0)
    streams = extra["rng"]
    if rank < len(streams):
        set_rng_state(streams[rank])
    else:
        # More workers than the run that saved: a new rank gets a fresh stream of its own.
        torch.manual_seed(hash((len(streams), rank, extra["lr_scheduler"]["last_epoch"])) & 0x7FFFFFFF)
    with open(os.path.join(folder, checkpoints.STATE_FILE)) as f:
        info = json.load(f)
    state.step = info["step"]
    return info["epoch"]


# ---------------------------------------------------------------- finding checkpoints


# The settings of a run (a Plan, or train.py's flags) that shape the model a checkpoint of it becomes
MODEL_FIELDS = ("model_dir", "vae_dir", "use_lora", "lora_rank", "lora_alpha", "train_text_encoder",
                "allow_unsafe_weights", "instance_prompt", "class_prompt", "use_ema", "ema_decay", "optimizer", "adapter")


def step_model_plan(run, output_dir, step, held_out):
    """The plan save_as_model writes a checkpoint of run's step with (run: its Plan or train.py's flags): its model
    in output_dir, recorded as trained for step steps, on the CPU in fp32."""
    return planning.offline_plan(**{name: getattr(run, name) for name in MODEL_FIELDS}, output_dir=output_dir,
                                 total_steps=step, mixed_precision="no", held_out=tuple(held_out))


def save_as_model(checkpoint_dir, plan):
    """The weights of a checkpoint written as train.py's output (plan.output_dir), as if the run had
    ended at that step: intermediate checkpoints become models to sample from (sweep.py)."""
    import torch

    from dreambooth.training import steps  # (here: it imports torch, 2 s --help never waits for)

    cpu = torch.device("cpu")
    nets = networks.setup_models(dataclasses.replace(plan, fsdp=False), cpu, cpu, distributed=False)  # (whole files)
    load_weights(nets, checkpoint_dir)
    trained = steps.trained_parameters(nets, plan.train_text_encoder)
    if plan.optimizer == "adamw_schedulefree":  # its model is the average it keeps beside the training weights
        optimizer = steps.make_optimizer(trained, plan)
        optimizer.load_state_dict(torch.load(os.path.join(checkpoint_dir, OPTIMIZER_FILE), map_location="cpu",
                                             weights_only=True)["optimizer"])
        optimizer.eval()
    if plan.use_ema:  # the model of a run with --use_ema is its moving average, at any step
        load_ema(trained, checkpoint_dir)
    outputs.save_pipeline(nets, plan)

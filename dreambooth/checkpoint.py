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
import glob
import json
import os
import re
import sys

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import models
from dreambooth import outputs
from dreambooth import run_identity
from dreambooth import sharding
from dreambooth import storage

STATE_FILE = "train_state.json"
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
    weights, optimizer = gathered or (models.trained_state_dict(state.models.denoiser), state.optimizer.state_dict())
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, denoiser_file))
    if train_text_encoder:
        for k, text_encoder in state.models.trainable():
            name = text_encoder_files(state.models.family)[k]
            save_file(models.trained_state_dict(text_encoder), os.path.join(folder, name))
            names.append(name)
    if state.ema is not None:
        save_file(state.ema.state_dict(), os.path.join(folder, EMA_FILE))
        names.append(EMA_FILE)
    torch.save({"optimizer": optimizer, "sharded": gathered is not None, "lr_scheduler": state.lr_scheduler.state_dict(),
                "scaler": state.scaler.state_dict(), "rng": rng_states, "skipped_steps": state.skipped_steps},
               os.path.join(folder, OPTIMIZER_FILE))
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in names}
    files.write_json(os.path.join(folder, STATE_FILE),
                     {"step": state.step, "epoch": epoch, "world_size": len(rng_states), "identity": identity,
                      "sizes": sizes})


def expected_bytes(params, with_ema):
    """About the size of a checkpoint of the trained params: the weights, AdamW's two moments of each
    (an upper bound: 8-bit Adam's are smaller) and the moving average's copy."""
    weights = sum(p.numel() * p.element_size() for p in params)
    return weights * (3 + (1 if with_ema else 0))


LORA_BYTES = 200e6  # a LoRA checkpoint or model (adapters and their optimizer state), rounded up


TRAINED_BYTES = 12  # a checkpoint's bytes per trained parameter: its fp32 weight and AdamW's two fp32 moments


def trained_networks(family, names, train_text_encoder):
    """Of names (a model's networks), those a full fine-tune of family trains: the denoiser, and the text encoders
    the family trains (not T5) when train_text_encoder."""
    return {name for name in names
            if name == family.denoiser or (train_text_encoder and name in family.trainable_text_encoders)}


def disk_bytes(model_dir, lora, train_text_encoder):
    """(a checkpoint's bytes, a saved model's bytes) of a run training model_dir: a checkpoint holds the trained
    networks' fp32 weights and AdamW's two moments (counted from the weight files' parameters, whatever their
    dtype: a bf16 Flux file holds half the bytes it trains in), a full model the trained networks in fp32 and
    the others as their files are; LoRA's are a few MB."""

    if lora:
        return LORA_BYTES, LORA_BYTES
    family, counts = families.family_of(model_dir), files.safetensors_params(model_dir)
    trained = trained_networks(family, counts, train_text_encoder)
    kept = sum(os.path.getsize(path) for path in glob.glob(os.path.join(model_dir, "*", "*.safetensors"))
               if os.path.basename(os.path.dirname(path)) not in trained)
    trained_count = sum(counts[name] for name in trained)
    return TRAINED_BYTES * trained_count, kept + 4 * trained_count


def text_encoder_files(family):
    """The checkpoint's file of each of the family's text encoders, in order: text_encoder.safetensors, ..."""
    return [f"{name}.safetensors" for name in family.text_encoders]


def load_weights(nets, folder):
    """The checkpoint's trained weights into nets (a models.Models): UNet, and the text encoders if trained."""
    from safetensors.torch import load_file

    models.load_trained_state_dict(nets.denoiser, load_file(os.path.join(folder, f"{nets.family.denoiser}.safetensors")))
    for name, text_encoder in zip(text_encoder_files(nets.family), nets.text_encoders()):
        if os.path.isfile(os.path.join(folder, name)):
            models.load_trained_state_dict(text_encoder, load_file(os.path.join(folder, name)))


def load_ema(targets, folder):
    """The checkpoint's moving average copied into targets (an EMA's shadow, or the trained parameters
    themselves, in steps.trained_parameters' order); False when it has none (a run started without
    --use_ema)."""
    from safetensors.torch import load_file

    from dreambooth import steps  # (here: it imports torch, 2 s --help never waits for)

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
    with open(os.path.join(folder, STATE_FILE)) as f:
        info = json.load(f)
    state.step = info["step"]
    return info["epoch"]


# ---------------------------------------------------------------- finding checkpoints


def is_complete(folder):
    """True when folder (a folder, or in a bucket) holds every checkpoint file at the size recorded when it
    was saved."""
    try:
        sizes = storage.read_json(storage.join(folder, STATE_FILE))["sizes"]
        return all(storage.size(storage.join(folder, name)) == size for name, size in sizes.items())
    except (OSError, ValueError, KeyError):
        return False


def remove_incomplete(run_dir):
    """Delete the checkpoint folders of run_dir that a failed write left incomplete (never resumed
    from, they only hold space): call only while no checkpoint of the run is being written."""
    import shutil

    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else ():
        folder = os.path.join(run_dir, name)
        if name.startswith("checkpoint_") and os.path.isdir(folder) and not is_complete(folder):
            shutil.rmtree(folder, ignore_errors=True)


def remove_all(run_dir):
    """Delete every checkpoint folder of run_dir (a folder, or in a bucket; its model is saved; the rest of
    the run folder, metrics and samples, stays): (folders removed, bytes freed)."""
    removed, freed = 0, 0
    for name in storage.listdir(run_dir):
        folder = storage.join(run_dir, name)
        if name.startswith("checkpoint_") and storage.isdir(folder):
            freed += sum(storage.size(storage.join(folder, f)) for f in storage.listdir(folder))
            storage.remove_tree(folder)
            removed += 1
    return removed, freed


def is_run_of(run, run_prefix):
    """True when run is the name of a run of run_prefix: '<run_prefix>-<YYYYMMDD-HHMMSS>' exactly (the
    runs of 'model-tuned' are not those of 'model-tuned-bella')."""
    return re.fullmatch(re.escape(run_prefix) + r"-\d{8}-\d{6}", run) is not None


def complete_checkpoints(storage_path, run_prefix):
    """The complete checkpoint folders of every run named '<run_prefix>-<time>' under storage_path,
    runs in name order (their names end in their start time); storage_path may be a bucket's."""
    for run in storage.listdir(storage_path):
        if not is_run_of(run, run_prefix):
            continue
        run_dir = storage.join(storage_path, run)
        for name in storage.listdir(run_dir):
            folder = storage.join(run_dir, name)
            if name.startswith("checkpoint_") and is_complete(folder):
                yield folder


def newest_first(storage_path, run_prefix):
    """The complete checkpoint folders of the runs of run_prefix, the newest (last saved) first."""
    return sorted(complete_checkpoints(storage_path, run_prefix),
                  key=lambda f: storage.mtime(storage.join(f, STATE_FILE)), reverse=True)


def find_latest(storage_path, run_prefix):
    """Newest complete checkpoint folder of any run named '<run_prefix>-<time>' under storage_path, or None."""
    return next(iter(newest_first(storage_path, run_prefix)), None)


def by_step(storage_path, run_prefix):
    """{step: folder} of the complete checkpoints of runs named '<run_prefix>-*' (the newest run's, for a step in several)."""
    return {saved_step(folder): folder for folder in complete_checkpoints(storage_path, run_prefix)}


def saved_step(folder):
    return storage.read_json(storage.join(folder, STATE_FILE))["step"]


def saved_identity(folder):
    """The identity of the run that wrote the checkpoint in folder (None: written before runs recorded it)."""
    return storage.read_json(storage.join(folder, STATE_FILE)).get("identity")


def newest_of_identity(storage_path, run_prefix, identity):
    """(folder, continued): the newest complete checkpoint of the runs of run_prefix whose identity is
    identity (None: any), or that this run continues (run_identity.continuation: only its step count
    raised); (None, False) when none is. When a newer checkpoint is of another run, a line says what differs."""
    if identity is None:
        return find_latest(storage_path, run_prefix), False
    for rank, folder in enumerate(newest_first(storage_path, run_prefix)):
        saved = saved_identity(folder)
        differs = run_identity.differences(saved, identity)
        if not differs:
            return folder, False
        longer = run_identity.continuation(saved, identity)
        if longer:
            print(longer, file=sys.stderr)
            return folder, True
        if rank == 0:
            print(f"not resuming {folder}: it is of another run ({'; '.join(differs)})", file=sys.stderr)
    return None, False


def resolve_resume(resume_flag, storage_path, run_prefix, output_dir=None, identity=None):
    """--resume_from_checkpoint latest|auto|PATH -> a checkpoint folder, or None to start fresh.

    latest|auto: the newest checkpoint of a run of the same identity (run_identity.py; None: any);
    auto: only if its run did not finish, i.e. it is not the run whose model output_dir holds
    (train.py's record names the run that wrote it). PATH of another identity: a UserError naming
    what differs."""
    if resume_flag in ("latest", "auto"):
        path, continued = newest_of_identity(storage_path, run_prefix, identity)
        if path is not None and resume_flag == "auto" and not continued:
            output = outputs.read_output(output_dir) if output_dir else None
            run = os.path.basename(os.path.dirname(path))
            if output is not None and output.record.run_name == run:
                print(f"the newest run ({run}) finished: starting afresh", file=sys.stderr)
                return None
        if path is None:
            print(f"no checkpoint of this run ('{run_prefix}', these settings and files) in {storage_path}: "
                  f"starting fresh", file=sys.stderr)
        else:
            print(f"resuming from {path}", file=sys.stderr)
        return path
    if resume_flag and not is_complete(resume_flag):
        raise errors.UserError(f"{resume_flag} is not a complete checkpoint of train.py")
    if resume_flag and identity is not None:
        saved = saved_identity(resume_flag)
        longer = run_identity.continuation(saved, identity)
        if longer:
            print(longer, file=sys.stderr)
        else:
            run_identity.check_same(f"checkpoint {resume_flag}", saved, identity,
                                    "resume it with the flags and files it was trained with, or start afresh "
                                    "(leave out --resume_from_checkpoint)")
    return resume_flag


def save_as_model(checkpoint_dir, plan):
    """The weights of a checkpoint written as train.py's output (plan.output_dir), as if the run had
    ended at that step: intermediate checkpoints become models to sample from (sweep.py)."""
    import torch

    from dreambooth import steps  # (here: it imports torch, 2 s --help never waits for)

    cpu = torch.device("cpu")
    nets = models.setup_models(dataclasses.replace(plan, fsdp=False), cpu, cpu, distributed=False)  # (whole files)
    load_weights(nets, checkpoint_dir)
    if plan.use_ema:  # the model of a run with --use_ema is its moving average, at any step
        load_ema(steps.trained_parameters(nets, plan.train_text_encoder), checkpoint_dir)
    outputs.save_pipeline(nets, plan)

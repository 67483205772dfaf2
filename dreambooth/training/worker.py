"""What each Ray Train worker runs (train_fn): the networks on its devices, the checkpoint it
continues, the step loop with its reports, checkpoints and validation samples, and (rank 0) the
saved model. train.py's driver hands it the Plan.
"""

import contextlib
import os
import shutil
import tempfile
import time

from dreambooth import errors
from dreambooth import files
from dreambooth import hub
from dreambooth import storage
from dreambooth.cluster import raycluster
from dreambooth.generation import prompts
from dreambooth.models import networks
from dreambooth.models import outputs
from dreambooth.models import sharding
from dreambooth.planning import checkpoints
from dreambooth.planning import disk
from dreambooth.storage import runfiles
from dreambooth.training import checkpoint
from dreambooth.training import checkpoint_scores
from dreambooth.training import runlog
from dreambooth.training import stall
from dreambooth.training import validation


def train_fn(config):
    """Per-worker entry point. Reads only config["plan"] (a plan.Plan); data comes from the "train"
    dataset shard. A failure's traceback goes to the run folder's errors.log (failures.py)."""
    import ray.train

    plan = config["plan"]
    try:
        train_worker(plan, config.get("stop_flag"))
    except Exception as err:
        errors.write_error_log(plan.run_dir, f"worker {ray.train.get_context().get_world_rank()}", err)
        runfiles.sync_up(plan.storage_path, plan.run_name)
        raise


def train_worker(plan, stop_flag=None):
    """One worker's whole run: models, checkpoint, the step loop, reports, the saved model (not when the
    driver asked for a stop through stop_flag, the run's key of stopping.make_flag: then the current step's
    checkpoint)."""
    if not plan.in_process:  # (a process of its own: the driver's may import them later)
        hub.skip_unused_imports(lora=plan.use_lora,
                                eight_bit=plan.use_8bit_adam or bool(plan.base_precision or plan.text_encoder_precision))
    import ray.train

    from dreambooth.training import failures  # here, not at the top: it imports ray.train (1.2 s)

    storage.ensure_local(plan.model_dir, plan.vae_dir)  # (a bucket's, cached on the driver's node: this node's too)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    batches = stall.Prefetched(ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=plan.train_batch_size),
                               stall.Clock(plan.stall_timeout), lambda: newest_checkpoint(plan))
    try:
        nets, state, step_prompts, sampler = prepare_worker(plan, rank, world, ctx.get_local_world_size())
        from dreambooth.training import stopping

        stopped = run_steps(plan, state, step_prompts, batches, rank, world, sampler,
                            stopping.StopPoll(stop_flag, world, rank))
    finally:  # (the rest of the stream is not read)
        batches.close()
    if stopped:
        return  # stopped at a checkpoint
    if plan.fsdp:  # the whole weights on rank 0, as an unsharded denoiser to save (every rank gathers)
        weights = sharding.gather_weights(nets.denoiser)
        if rank == 0:
            nets.denoiser = sharding.plain(plan.family, plan.model_dir, weights)
    if rank == 0:
        with averaged_weights(state), failures.stops_when_disk_full("the trained model", plan.output_dir,
                                                                     outputs.expected_bytes(nets, plan.use_lora)):
            outputs.save_pipeline(nets, plan)


def prepare_worker(plan, rank, world, local_world_size):
    """(networks.Models, steps.TrainState, conditioning.StepPrompts, validation.Sampler or None) of this worker:
    the networks on its devices, the optimizer, the prompts, the validation sampler, and the state of the
    checkpoint it continues, if any."""
    import ray.train
    import torch

    from dreambooth import machine

    # here, not at the top: they import ray.train (1.2 s) and torch (2 s a --help or a one-line error never waits for)
    from dreambooth.training import conditioning
    from dreambooth.training import failures
    from dreambooth.training import steps

    denoiser_device, aux_device = worker_devices(plan.gpus_per_worker, None if plan.in_process else local_world_size)
    if plan.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(plan.seed + rank)  # (new weights: DDP gives every rank rank 0's; noise: steps.block_seed)
    model_error = "its files do not fit together: fetch or copy it again (cache_model.py)"
    with failures.cannot_be_retried(f"loading the tokenizers of {plan.model_dir}", model_error):
        ids = prompts.run_prompt_ids(plan)
    text = {}

    def encode(nets):
        """The prompts' states, from the text encoders as loaded, before the denoiser arrives (and before any
        checkpoint's weights: the class prompt as the base model reads it), and the sampler, which encodes its
        own prompts now when the encoders are frozen: then they leave the device."""
        text_encoders = [networks.unwrap(te) for te in nets.text_encoders()]
        text["prompts"] = conditioning.step_prompts(plan.family, text_encoders, plan, ids, aux_device)
        if plan.prior_prediction:
            text["prompts"] = conditioning.with_base_class(text["prompts"], plan.family, text_encoders, ids,
                                                           aux_device)
        amp = machine.amp_dtype(plan.mixed_precision, denoiser_device)
        text["sampler"] = validation.Sampler(nets, plan, amp) if plan.validation_prompts else None
        if plan.text_encoded_once:
            nets.release_text_encoders()

    nets = networks.setup_models(plan, denoiser_device, aux_device, distributed=world > 1,
                                 load_guard=model_loading(plan, model_error), before_denoiser=encode)
    state = steps.make_train_state(nets, plan)
    step_prompts = text["prompts"]
    # Ray's own checkpoint (a restarted worker group) wins over the one the run started from.
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as folder, failures.cannot_be_retried(
                "loading the run's newest checkpoint", "rerun with --resume_from_checkpoint and an earlier one"):
            checkpoint.load(state, folder, rank)
    elif plan.resume_path:
        with failures.cannot_be_retried(f"loading the checkpoint {plan.resume_path}",
                                        "pass another to --resume_from_checkpoint"):
            with storage.local_copy(plan.resume_path) as folder, \
                    files.unchanged_while(folder, what="loading the checkpoint", suffixes=None):  # (a bucket's: downloaded)
                checkpoint.load(state, folder, rank)
    if rank == 0:
        released = " (the frozen text encoders left it once the prompts were encoded)" if plan.text_encoded_once else ""
        base = f" ({plan.base_precision})" if plan.base_precision else ""
        encoders = f" (the frozen ones {plan.text_encoder_precision})" if plan.text_encoder_precision else ""
        print(f"worker devices: {plan.family.denoiser_label}{base} on {denoiser_device}, text encoders{encoders} and VAE "
              f"on {aux_device}{released}; autocast {state.amp_dtype or 'off (fp32)'}", flush=True)
    return nets, state, step_prompts, text["sampler"]


@contextlib.contextmanager
def model_loading(plan, remedy):
    """Around the loading of the run's model: what the files' errors are (a restart meets them again: they stop the
    run with remedy), and a file of the model (or of its VAE) rewritten while it was read, a line naming it."""
    from dreambooth.training import failures

    with failures.cannot_be_retried(f"loading the model {plan.model_dir}", remedy), \
            files.unchanged_while(plan.model_dir, plan.vae_dir):
        yield


def step_inputs(plan, batches, rank, world, start):
    """(micro-batches, their seeds) of this worker for each step from start to plan.total_steps. The stream is the same
    on every run, and a step trains the same blocks of it on any number of workers (steps.step_batches; a resumed
    worker skips the steps before its checkpoint's), each block with its own noise (steps.block_seed)."""
    from dreambooth.training import steps

    per_step = plan.num_workers * plan.gradient_accumulation_steps
    if plan.min_workers and rank == 0:
        print(f"training on {world} of {plan.num_workers} workers (elastic, at least {plan.min_workers}) from step "
              f"{start}: each step still trains {per_step} batches", flush=True)
    for blocks in steps.step_batches(batches, rank, world, per_step, start, plan.total_steps):
        yield [batch for _, batch in blocks], [steps.block_seed(plan.seed, block) for block, _ in blocks]


def run_steps(plan, state, step_prompts, batches, rank, world, sampler=None, stop=None):
    """The step loop to plan.total_steps: a step per plan.gradient_accumulation_steps micro-batches (steps.step_batches),
    a report (metrics, checkpoint) every --logging_steps/--checkpointing_steps, validation samples
    (sampler's, a validation.Sampler) every --validation_steps. True when it stopped early at a
    checkpoint of the current step because stop (a stopping.StopPoll) said so."""
    from ray.experimental import tqdm_ray

    # here, not at the top: they import ray.train (1.2 s) and torch (2 s a --help or a one-line error never waits for)
    from dreambooth.training import failures
    from dreambooth.training import steps

    total = plan.total_steps
    bar = tqdm_ray.tqdm(total=total, desc="training") if rank == 0 and plan.progress_bar else None
    log = runlog.RunLog(plan, start_step=state.step) if rank == 0 else None
    if bar and state.step:
        bar.update(state.step)
    window = runlog.ReportWindow(world, elastic=bool(plan.min_workers))
    watch = checkpoint_scores.ScoreWatch(plan.run_name) if log and plan.score_steps else None
    first_step, stop_now = state.step, False
    clock = getattr(batches, "clock", None) or stall.Clock(0)  # (stall.Prefetched's: a stall ends the run in one line)
    clock.restart(state.step)
    share = world / (plan.num_workers * plan.gradient_accumulation_steps)  # (of each block in a step's gradient)
    for micro_batches, seeds in step_inputs(plan, batches, rank, world, state.step):
        try:
            loss, _, _ = steps.train_step(state, micro_batches, step_prompts, plan.prior_loss_weight, plan.max_grad_norm,
                                          seeds=seeds, share=share)
        except Exception as err:
            fatal = failures.out_of_memory(err, state.step, first_step)
            if fatal:
                raise fatal from err
            raise
        state.step += 1
        window.add(loss, micro_batches)
        if bar:
            bar.update(1)
        event = stop.check() if stop is not None and state.step < total else None
        stop_now = event == "stop"
        if plan.is_report_step(state.step) or event:
            score = plan.is_score_step(state.step)
            if watch:  # (before this report: Ray Train has taken the earlier ones, so asking it waits on none)
                score = scores_arrived(watch, log, state.step, score, state.step == total or state.step in plan.score_at)
            seconds = report_window(window, log, state, rank, plan, checkpoint_now=bool(event), score=score)
            if event and rank == 0:
                print(f"stopped at step {state.step} of {total} ({stop.reason() or 'a signal'}): the checkpoint took "
                      f"{seconds:.1f} s" if stop_now else
                      f"{stop.describe_drain()}: step {state.step} checkpointed in {seconds:.1f} s; training goes on "
                      "(when the node leaves, Ray Train restarts the workers from this step)", flush=True)
        if stop_now:
            break
        if plan.is_validation_step(state.step):
            sample(plan, state, sampler, rank, world, window, log)
        clock.stepped(state.step)
    end_loop(plan, bar, log, watch, stop_now)
    if stop_now:
        return True
    if state.step < total:
        raise RuntimeError(f"the data stream ended at step {state.step} of {total}")
    return False


def end_loop(plan, bar, log, watch, stopped):
    """Rank 0's bar and run log closed; where the training ended with steps still being scored, a line says the run
    waits for them (Ray Train holds it until they end)."""
    if bar:
        bar.close()
    if log:
        log.close()
        runfiles.sync_up(plan.storage_path, plan.run_name)
    if watch and not stopped and watch.sent - watch.said:
        checkpoint_scores.note_waiting(plan.run_name, watch.sent - watch.said)
        print(checkpoint_scores.waiting_line(sorted(watch.sent - watch.said), plan), flush=True)


def newest_checkpoint(plan):
    """The step of the run's newest checkpoint (this run's, or the one it resumed), or None."""
    latest = checkpoints.find_latest(plan.storage_path, os.path.basename(plan.output_dir))
    return checkpoints.saved_step(latest) if latest else None


def sample(plan, state, sampler, rank, world, window, log):
    """A validation round of every rank (sampler's, with the averaged weights where there are), its time not counted
    as training time; rank 0 logs its images."""
    with window.paused(), averaged_weights(state):
        drawn = validation.run_round(sampler, state.step, rank, world, plan.run_dir)
    runfiles.sync_up(plan.storage_path, plan.run_name)  # (every rank drew some)
    if log:
        log.write_images(state.step, *drawn)
        print(f"validation images of step {state.step}: {validation.step_folder(plan.run_dir, state.step)} (all "
              f"steps: {drawn[0]})", flush=True)


def scores_arrived(watch, log, step, due, always):
    """The scores Ray Train's validation has finished since the last call (never waited for): logged and said.
    Whether step, due to be scored, is: one scoring at a time (each keeps its checkpoint until it ends), but always
    (the last step, a sweep's step counts) queued behind the one running."""
    for scored, scores in watch.new_rows():
        log.write_scores(scored, scores)
        print(checkpoint_scores.describe(scored, scores, during_run=True), flush=True)
    if due and watch.pending and not always:
        print(checkpoint_scores.skip_line(step, watch.pending), flush=True)
        return False
    if due:
        watch.sent.add(step)
    return due


def report_window(window, log, state, rank, plan, checkpoint_now=False, score=False):
    """The window's metrics logged (rank 0: metrics.jsonl, trackers, a printed line) and reported with
    report() (score: rank 0's checkpoint to be scored); the seconds the report (with its checkpoint) took."""
    metrics = window.metrics(state, plan.steps_per_epoch)
    if log:
        log.write(metrics)
        runfiles.sync_up(plan.storage_path, plan.run_name)
    checkpointing = checkpoint_now or plan.is_checkpoint_step(state.step)
    began = time.perf_counter()
    report(state, metrics, rank, plan, checkpointing, score)
    seconds = time.perf_counter() - began
    if checkpointing:
        window.checkpoint_s = seconds  # (said with the next window's metrics)
    if rank == 0:
        print(" ".join(f"{name}={v:.4g}" if isinstance(v, float) else f"{name}={v}" for name, v in metrics.items()),
              flush=True)
    return seconds


@contextlib.contextmanager
def averaged_weights(state):
    """For the duration (validation samples, the saved model): with --use_ema the moving average in the trained
    weights, with --optimizer adamw_schedulefree its averaged weights; else nothing changes."""
    from dreambooth.training import steps  # (here: it imports torch, 2 s --help never waits for)

    with steps.evaluation_weights(state.optimizer), (
            state.ema.applied(state.params) if state.ema is not None else contextlib.nullcontext()):
        yield


def worker_devices(gpus_per_worker, local_world_size):
    """(denoiser device, text-encoder + VAE device) of this worker.

    With --gpus_per_worker 2 the text encoder and VAE go to the worker's second GPU, so
    the denoiser's fp32 weights, gradients and AdamW state have the first to themselves. On
    CPU both are the CPU, and the same code path runs.
    """
    import ray.train.torch
    import torch

    devices = ray.train.torch.get_devices()
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])
        return devices[0], devices[min(gpus_per_worker, len(devices)) - 1]
    if local_world_size:  # (None: the driver's own process, whose threads stay as they are)
        raycluster.share_cpu_threads(local_world_size)
    cpu = torch.device("cpu")
    return cpu, cpu


def report(state, metrics, rank, plan, checkpointing=False, score=False):
    """ray.train.report from every rank; with checkpointing (a checkpointing step, or a stop's or drain's), rank 0
    attaches a checkpoint with every rank's RNG streams (gathered from all ranks, a collective), for Ray Train's
    validation to score with score (--score_steps)."""
    import ray.train

    # In the background (--checkpoint_upload): a checkpoint uploads in Ray Train's thread, and every later report
    # waits for its turn there too (Ray keeps them in order), so neither stops the steps.
    mode = {"checkpoint_upload_mode": ray.train.CheckpointUploadMode.ASYNC} if plan.uploads_in_background() else {}
    if not checkpointing:
        ray.train.report(metrics, **mode)
        return
    rng_states = checkpoint.gather_rng_states()
    gathered = sharding.gather(state.models.denoiser, state.optimizer) if plan.fsdp else None  # (all ranks)
    if rank != 0:
        ray.train.report(metrics, **mode)
        return
    from dreambooth.training import failures  # here, not at the top: it imports ray.train (1.2 s)

    needed = disk.expected_bytes(state.params, state.ema is not None)
    folder = tempfile.mkdtemp(prefix="dreambooth-checkpoint-")  # (in the background: Ray removes it once uploaded)
    handed_over = False
    try:
        with failures.stops_when_disk_full(f"the checkpoint of step {state.step}", folder, needed):
            checkpoint.save(state, folder, metrics["epoch"], rng_states, plan.train_text_encoder, plan.identity,
                            gathered)
        run_dir = plan.run_dir  # (a full disk there: in a bucket's run, this node's cache)
        with failures.stops_when_disk_full(f"the checkpoint of step {state.step}", run_dir, needed,
                                           cleanup=lambda: checkpoints.remove_incomplete(run_dir)):
            if plan.in_process:  # (Ray Train's local mode keeps none: written into the run folder here)
                checkpoint.keep_in_run(folder, storage.join(plan.storage_path, plan.run_name),
                                       plan.checkpoints_total_limit)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder),
                             validation=score, **mode)  # (--score_steps: scored while it trains)
            handed_over = bool(mode)
    finally:
        if not handed_over:
            shutil.rmtree(folder, ignore_errors=True)

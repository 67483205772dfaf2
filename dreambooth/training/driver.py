"""The driver of a training run: class images topped up, the plan made (planning.py) and printed, the
Ray Data stream built, worker.train_fn run by Ray Train over torch.distributed (restarts from the newest checkpoint,
a stop request checkpointing the step each worker is on), then the model saved and the run's records
written. train.py and the sweep's trials call run()."""

import dataclasses
import functools
import gc
import os
import signal
import sys
import threading
import time

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import storage
from dreambooth.cluster import nodes
from dreambooth.cluster import raycluster
from dreambooth.config import flags
from dreambooth.generation import drawing
from dreambooth.generation import image_records
from dreambooth.models import outputs
from dreambooth.planning import checkpoints
from dreambooth.planning import planning
from dreambooth.storage import notify
from dreambooth.storage import runfiles
from dreambooth.training import checkpoint_scores
from dreambooth.training import dataset
from dreambooth.training import runlog
from dreambooth.training import score_record
from dreambooth.training import trackers
from dreambooth.training import worker


def run(args):
    """A training run of parsed flags (plan.parse_args): class images topped up, the plan made and
    printed, train_fn on Ray Train's workers; --notify_url told when it starts, finishes or fails. sweep.py's
    trials call it directly."""
    trackers.check_installed(args.report_to)
    if args.score_steps:
        checkpoint_scores.check_inputs(args)
    began = time.time()
    try:
        result, plan = train_planned(args, lambda text, **fields: notify.send(
            args.notify_url, "started", text, **fields))
    except (Exception, KeyboardInterrupt) as err:
        cause = notify.cause_of(err)
        notify.send(args.notify_url, "failed", f"DreamBooth training of {args.output_dir} failed: {cause}",
                    output_dir=args.output_dir, cause=cause)
        raise
    if plan is not None:
        loss = (result.metrics or {}).get("loss")
        notify.send(args.notify_url, "finished",
                    f"DreamBooth run {plan.run_name} finished: {plan.total_steps} steps in {time.time() - began:.0f} s"
                    + (f", final loss {loss:.4f}" if loss is not None else "") + f"; model in {plan.output_dir}",
                    run=plan.run_name, steps=plan.total_steps, loss=loss, output_dir=plan.output_dir,
                    seconds=round(time.time() - began, 1))
    return result


def announce(plan, started):
    """The run said before it starts (after a check that the cluster holds its --resources_per_worker: else Ray waits
    for them, silently): its plan, its settings file (written; returned, a bucket's or the file itself), and
    started(text, **fields)."""
    if plan.resources_per_worker:
        nodes.check_resources_held(plan.own_resources(), plan.min_workers or plan.num_workers)
    print(plan.describe(), file=sys.stderr)
    flags.write_config(os.path.join(plan.run_dir, outputs.TRAIN_CONFIG), plan.settings_toml)
    runfiles.sync_up(plan.storage_path, plan.run_name)
    shown = storage.join(plan.storage_path, plan.run_name, outputs.TRAIN_CONFIG)
    print(f"settings: {shown} (python train.py --config {shown} repeats this run)", file=sys.stderr)
    started(f"DreamBooth run {plan.run_name} started: {plan.total_steps} steps on {plan.workers_said()}"
            f"{', resumed from ' + plan.resume_path if plan.resume_path else ''}; model to {plan.output_dir}",
            run=plan.run_name, steps=plan.total_steps, workers=plan.num_workers, output_dir=plan.output_dir)
    return shown


def train_planned(args, started):
    """(result, plan) of run's training, (None, None) when its model is trained; started(text, **fields) once planned."""
    def draw():
        top_up_class_images(args.model_dir, args.class_data_dir, args.class_prompt, args.num_class_images,
                            args.seed, args.resolution, args.allow_unsafe_weights)

    try:
        plan = planning.plan_run(args, cluster_resources=start_ray,
                                 draw_class_images=draw if args.num_class_images else None)
    except planning.AlreadyTrained as done:
        print(done, file=sys.stderr)
        return None, None
    shown = announce(plan, started)
    if plan.score_steps and plan.resume_path:
        score_record.carry_over(plan)
    base_task = checkpoint_scores.start_base(plan) if plan.score_steps else None  # (beside the training)
    try:
        stream = train_dataset(plan)
        changed = files.changed_since(plan.input_stamps)  # (read, and their digest made, while one was rewritten)
        if changed:
            raise errors.UserError(changed)
        result = (run_in_process if plan.in_process else run_trainer)(plan, stream)
    except KeyboardInterrupt:
        latest = checkpoints.find_latest(plan.storage_path, os.path.basename(plan.output_dir))
        reached = checkpoints.saved_step(latest) if latest else None
        if plan.score_steps and latest:  # (the scores of the steps it reached: kept with the run, which resumes them)
            for line in checkpoint_scores.finish(plan, last_step=reached, base_task=base_task):
                print(line, file=sys.stderr)
            runfiles.sync_up(plan.storage_path, plan.run_name)
        where = f" (newest checkpoint: {latest}, step {reached})" if latest else \
            " (no checkpoint was written yet: it starts again from step 0)"
        again = "" if args.resume_from_checkpoint in ("latest", "auto") else " with --resume_from_checkpoint latest"
        command = f", that is: python train.py --config {shown} --resume_from_checkpoint latest" if again else ""
        print(f"stopped; rerun the same command{again} to continue{where}{command}", file=sys.stderr)
        raise errors.Stopped from None
    metrics = result.metrics or {}  # none when a resumed run had no step left to train
    loss = f"final loss {metrics['loss']:.4f}" if "loss" in metrics else "no step left to train after the checkpoint"
    run_folder = storage.join(plan.storage_path, plan.run_name)  # (result.path: the same, without a bucket's scheme)
    saved = (f"the model goes to {plan.output_dir} (--keep_best: the best-scored step's, named below)" if plan.keep_best
             else f"model saved to {plan.output_dir}")
    print(f"trained {plan.total_steps} steps; {loss}; {saved}; checkpoints and {runlog.METRICS_FILE} in {run_folder}",
          file=sys.stderr)
    if plan.score_steps:  # (every scoring task has ended: Ray Train waits for them before fit returns, or a signal
        # cut them short)
        for line in checkpoint_scores.finish(plan, base_task=base_task,
                                             cut=result.waiting if isinstance(result, ScoringCut) else None):
            print(line, file=sys.stderr)
        runfiles.sync_up(plan.storage_path, plan.run_name)
    if not plan.keep_checkpoints:
        remove_checkpoints(plan, args.resume_from_checkpoint, run_folder)
    plot = runlog.plot_metrics(storage.fetch(run_folder, runlog.METRICS_FILE, plan.run_dir))
    if plot:
        runfiles.sync_up(plan.storage_path, plan.run_name)
        print(f"loss and learning rate plotted in {storage.join(run_folder, os.path.basename(plot))}", file=sys.stderr)
    return result, plan


def remove_checkpoints(plan, resume, run_folder):
    """Once the model is saved: the run's checkpoints, those of its past (the stopped run it continued, found under
    --storage_path, and the earlier attempts of the same run, whose checkpoints carry its identity), and, with
    --resume_from_checkpoint auto (the script's: one model a subject), those of stopped runs of other settings into
    the same output (never resumed now: their model would replace this one), each group said in one line."""
    removed, freed = checkpoints.remove_all(run_folder)
    prefix = os.path.basename(plan.output_dir)
    past = set()
    if resume in ("latest", "auto"):
        past = set(checkpoints.runs_of_identity(plan.storage_path, prefix, plan.identity))
        past |= {runfiles.run_of_checkpoint(plan.resume_path)} - {None}
        for run in sorted(past - {run_folder}):
            more, more_bytes = checkpoints.remove_all(run)
            removed, freed = removed + more, freed + more_bytes
    if removed:
        print(f"removed the run's {removed} checkpoint(s) ({files.size_text(freed)}) now that its model is saved "
              "(--keep_checkpoints keeps them, to continue this run with more steps later)", file=sys.stderr)
    # (only under the output's own --storage_path: a shared one may hold another output of the same name's runs)
    if resume != "auto" or plan.storage_path != os.path.join(os.path.dirname(plan.output_dir), "ray_results"):
        return
    others = {runfiles.run_of_checkpoint(f) for f in checkpoints.complete_checkpoints(plan.storage_path, prefix)}
    removed, freed = 0, 0
    for run in sorted(others - past - {run_folder, None}):
        more, more_bytes = checkpoints.remove_all(run)
        removed, freed = removed + more, freed + more_bytes
    if removed:
        print(f"removed {removed} checkpoint(s) ({files.size_text(freed)}) of stopped runs of other settings into "
              f"{plan.output_dir}: its model is now this run's", file=sys.stderr)


def start_ray():
    """(CPUs, GPUs, each node's CPUs) of the Ray cluster, started or joined here."""
    ray = raycluster.init_ray()
    ray.data.DataContext.get_current().enable_progress_bars = False
    return (*raycluster.cluster_resources(), nodes.node_cpus())


def top_up_class_images(model_dir, class_dir, class_prompt, count, seed=0, resolution=None,
                        allow_unsafe_weights=False):
    """diffusers' --num_class_images: draw class images with the base model (generate.py's
    actor pool, seeded by seed) until class_dir holds count, counting class images of the user's
    own already there (diffusers does). Images drawn by another model, prompt or resolution are
    an error (drawing.top_up), never trained on beside these. A bucket's class_dir is filled through this
    node's copy of it (storage.output_folder)."""
    families.check_model_dir(model_dir, allow_unsafe_weights)
    with storage.output_folder(class_dir) as folder:
        os.makedirs(folder, exist_ok=True)
        drawn = set(image_records.drawn_images(folder))
        own = [n for n in os.listdir(folder) if n.lower().endswith(files.IMAGE_EXTENSIONS) and n not in drawn]
        settings = drawing.ImageSettings(resolution=resolution, seed=seed, allow_unsafe_weights=allow_unsafe_weights)
        have = image_records.read_image_record(folder)
        if have:  # (drawn by generate.py: Step 3's steps and guidance, which train.py has no flag for, go on)
            settings = dataclasses.replace(settings, num_inference_steps=have.num_inference_steps,
                                           guidance_scale=have.guidance_scale, negative_prompt=have.negative_prompt,
                                           seed=have.seed)
        remedy = "delete its images to draw these (generate.py --force does)"
        if own:
            print(f"{class_dir}: {len(own)} class images of your own count toward --num_class_images {count}",
                  file=sys.stderr)
        job = drawing.top_up(folder, outputs.ModelRef(model_dir), [class_prompt], max(0, count - len(own)), settings,
                              class_images=True,
                              safety_checker=False, remedy=remedy, label=f"class images of {class_prompt!r}",
                              where=class_dir)
        drawing.make_images_of([job], settings)


def train_dataset(plan):
    """The run's whole training stream (dataset.py), every worker's rows for every step."""
    latent_cache = None
    if plan.cache_latents:
        latent_cache = dataset.LatentCache(plan.model_dir, raycluster.cluster_resources()[1],
                                           plan.allow_unsafe_weights, plan.vae_dir)
    return dataset.build_train_dataset(
        list(plan.instance_images), list(plan.class_images) or None, plan.resolution, plan.center_crop,
        plan.random_flip, latent_cache, num_epochs=plan.stream_epochs, seed=plan.seed,
        batch_size=plan.train_batch_size, with_time_ids=plan.family.time_ids,
        mask_sources=list(plan.instance_masks) if plan.masked_loss else None,
        buckets=list(plan.buckets) if plan.enable_bucket else None, num_workers=plan.num_workers)


def run_trainer(plan, train_ds):
    """Ray Train's fit() of train_fn over the plan's workers; KeyboardInterrupt when stopped early."""
    import ray.data
    import ray.train

    from dreambooth.training import failures  # here, not at the top: it imports ray.train (1.2 s)
    from dreambooth.training import stopping

    run_dir = plan.run_dir
    resources = {"CPU": plan.cpus_per_worker, **plan.own_resources()}
    if plan.use_gpu:
        resources["GPU"] = plan.gpus_per_worker
    trainer = stopping.trainer_class()(
        worker.train_fn, trained=functools.partial(only_scoring_left, plan),
        train_loop_config={"plan": plan, "stop_flag": stopping.make_flag()},
        scaling_config=ray.train.ScalingConfig(
            num_workers=(plan.min_workers, plan.num_workers) if plan.min_workers else plan.num_workers,
            use_gpu=plan.use_gpu, resources_per_worker=resources,
            elastic_resize_monitor_interval_s=plan.elastic_resize_interval),
        run_config=ray.train.RunConfig(
            name=plan.run_name,
            # (a bucket: its path and a pyarrow filesystem set up as AWS tools would be)
            **dict(zip(("storage_path", "storage_filesystem"), storage.ray_storage(plan.storage_path))),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=plan.checkpoints_total_limit),
            failure_config=failure_config(plan),
            callbacks=[failures.FailureWatch(run_dir, plan.max_failures, plan.storage_path, plan.run_name,
                                             resumed=plan.resume_path is not None,
                                             max_preemption_failures=plan.max_preemption_failures,
                                             min_workers=plan.min_workers)],
            logging_config=ray.train.LoggingConfig(log_level=failures.RAY_TRAIN_LOG_LEVEL),
        ),
        datasets={"train": train_ds},
        dataset_config=data_config(plan),
        validation_config=checkpoint_scores.validation_config(plan) if plan.score_steps else None,
    )
    main_thread = threading.current_thread() is threading.main_thread()  # (a sweep's trials run in threads)
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) if main_thread else None
    try:
        result = trainer.fit()
    except (ray.train.ControllerError, ray.train.WorkerGroupError) as err:
        raise errors.UserError(f"training failed: {failure_cause(err)} (tracebacks in "
                               f"{os.path.join(run_dir, errors.ERRORS_LOG)})") from None
    except SystemExit:
        # fit() installs its own Ctrl-C handler: it aborts the run, then exits.
        if only_scoring_left(plan):  # (its scoring cut short)
            return ScoringCut(plan)
        raise KeyboardInterrupt from None
    finally:  # (fit's handlers, and ours for a stop at the current step, end with it)
        if plan.score_steps:
            checkpoint_scores.forget(plan.run_name)
        if handlers:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
        stopping.forget(trainer.train_loop_config["stop_flag"])  # (a sweep runs many trials in one driver)
    if (result.metrics or {}).get("step", 0) < plan.total_steps and not saved_by(plan):
        raise KeyboardInterrupt  # an aborted run returns a partial result
    return result


def only_scoring_left(plan):
    """Whether the workers have ended and saved the model, the run waiting only for its steps' scoring."""
    return bool(plan.score_steps) and saved_by(plan)


class ScoringCut:
    """The result of a run whose model was saved and whose steps' scoring a signal cut short (fit() returned none):
    its last logged metrics, its run folder, the steps rank 0 was waiting on (read before the run's keys go)."""

    def __init__(self, plan):
        rows = runlog.read_rows(storage.fetch(storage.join(plan.storage_path, plan.run_name), runlog.METRICS_FILE,
                                              plan.run_dir), "loss")
        self.metrics, self.path, self.checkpoint = rows[-1] if rows else None, result_path(plan), None
        self.waiting = checkpoint_scores.waiting_on(plan.run_name)


def result_path(plan):
    """The run folder as Ray Train's Result names it (a bucket's without its scheme)."""
    folder = storage.join(plan.storage_path, plan.run_name)
    return folder.partition("://")[2] if storage.is_remote(folder) else folder


def run_in_process(plan, train_ds):
    """--num_workers 0: Ray Train's fit() in local mode, train_fn in this process as the one worker (no controller, no
    worker group: the loop writes its checkpoints itself, checkpoint.keep_in_run); the data stream still runs on
    the cluster, in order as the workers' split is. A stop signal checkpoints the step it is on, as with workers;
    an error is one line, its traceback in the run's errors.log. KeyboardInterrupt when stopped early."""
    import ray.data
    import ray.train

    from dreambooth.training import stopping

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    flag = stopping.make_flag()
    trainer = stopping.trainer_class()(
        worker.train_fn, train_loop_config={"plan": plan, "stop_flag": flag},
        scaling_config=ray.train.ScalingConfig(num_workers=0), run_config=ray.train.RunConfig(name=plan.run_name),
        datasets={"train": train_ds})
    handlers, threads = None, set(threading.enumerate())
    if threading.current_thread() is threading.main_thread():
        handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        stopping.install_handlers(flag, signal.default_int_handler)
    try:
        result = trainer.fit()
    except Exception as err:  # (a UserError as it says itself, anything else in its one line)
        cause = err if isinstance(err, errors.UserError) else errors.one_line(err)
        raise errors.UserError(f"training failed: {cause} (traceback in "
                               f"{os.path.join(plan.run_dir, errors.ERRORS_LOG)})") from None
    finally:
        if handlers:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
        stopping.forget(flag)
        # The data stream's iterators, unreachable now, collected while Ray is connected, and the threads they
        # started given a moment to end (one that touched Ray after the script had left it ended the process with
        # exit 1; Ray Data's block prefetcher waits, idle, until the process ends)
        gc.collect()
        deadline = time.monotonic() + 5
        for thread in set(threading.enumerate()) - threads:
            if thread.name != "Prefetcher":
                thread.join(max(0.0, deadline - time.monotonic()))
    if (result.metrics or {}).get("step", 0) < plan.total_steps and not saved_by(plan):
        raise KeyboardInterrupt  # stopped at a checkpoint of its step
    result.path = result_path(plan)  # (local mode names none)
    result.checkpoint = None  # (the one reported was moved into the run folder)
    return result


def data_config(plan):
    """How the stream reaches the workers. Ordered execution makes it deterministic: each worker gets the same rows on
    every run of the same command, which resuming mid-run relies on (set here: Train's controller configures the
    stream, and does not see our DataContext). Split across the workers (a coordinator actor hands out each block)
    only where there are several: one worker, never resized, reads the whole stream itself, the same rows in the
    same order, without the coordinator's process and its calls at every step."""
    import ray.data
    import ray.train

    split = "all" if plan.min_workers or plan.num_workers > 1 else []
    return ray.train.DataConfig(datasets_to_split=split,
                                execution_options=ray.data.ExecutionOptions(preserve_order=True))


def failure_config(plan):
    """Ray Train's restarts of a run: --max_failures for real failures (a worker's error, a lost node), and
    --max_preemption_failures, a budget of their own, for preemptions (a spot reclaim: a drained node that left)."""
    import ray.train

    return ray.train.FailureConfig(max_failures=plan.max_failures,
                                   max_preemption_failures=plan.max_preemption_failures)


def saved_by(plan):
    """Whether output_dir holds the model this run saved (a resumed run with no step left saves it without a
    step's metrics); the model of an earlier run there, which this one replaces when it ends, does not count."""
    output = outputs.read_output(plan.output_dir)
    return output is not None and output.record.run_name == plan.run_name


def failure_cause(err):
    """The cause of a failed fit() in one line: the first failed worker's rank and the last line of
    its error (the exception itself, not Ray's "Training failed due to worker errors")."""
    from dreambooth.training import failures  # here, not at the top: it imports ray.train (1.2 s)

    stopped = getattr(err, "controller_failure", None)
    if isinstance(stopped, failures.RunStopped):
        return str(stopped)
    worker_failures = getattr(err, "worker_failures", None) or {}
    if worker_failures:
        rank, failure = min(worker_failures.items(), key=lambda item: item[0])
        lines = [line.strip() for line in str(failure).splitlines() if line.strip()]
        return f"worker {rank}: {lines[-1] if lines else type(failure).__name__}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__

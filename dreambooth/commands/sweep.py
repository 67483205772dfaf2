"""Find the best fine-tune: a Ray Tune sweep of train.py scored by evaluate.py, for one subject or many.

    python sweep.py --model_dir=$ORIG_MODEL_PATH --output_dir=$TUNED_MODEL_DIR \\
        --instance_data_dir=$IMAGES_OWN_DIR --unique_token=unqtkn --class_name=dog --subject_type=live \\
        --eval_models_dir=$EVAL_MODELS_DIR --num_class_images=100 \\
        --sweep_learning_rate=2e-6,5e-6 --sweep_max_train_steps=200,400,800 [train.py's flags]

    python sweep.py ... --subjects_dir=$SUBJECTS_DIR    (one sub-folder + subject.json per subject)

Each trial (a Tune trial running a Ray Train run of its own) trains once, to the largest step count; the checkpoint
of each step count becomes a model that is scored as evaluate.py scores it (generation and embedding on Ray Data
actor pools; on a one-node cluster in the scoring task itself) while the training goes on (train.py's scores while
training), and Tune hears each step count's scores as they arrive: with --early_stopping, a trial behind the others
at a step count is stopped there (ASHA). The base model is scored once per subject.
The best (step count, trial) of each subject has the highest DINO among those whose CLIP-T is at
most --clip_t_margin below the base model's (with train.py's --holdout N, the DINO against the N
photos every trial was trained without); it is copied to --output_dir (with --subjects_dir:
--output_dir/<subject>). Beside it, in --sweep_dir: trials.md and trials.csv (every trial, failed
ones with their error), sweep.png (DINO against CLIP-T) and report.md (each subject's best beside
its base model). Class images are drawn once per class and shared. A failed trial does not end the
sweep; rerunning the same command after a crash continues it (Tune's restore; unfinished and failed
trials resume from their own newest checkpoint before a step count not yet scored).
"""

import dataclasses
import math
import os
import sys

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import storage
from dreambooth.cluster import raycluster
from dreambooth.config import flags
from dreambooth.evaluation import eval_report
from dreambooth.evaluation import scoring
from dreambooth.generation import imagefiles
from dreambooth.models import modelcache
from dreambooth.models import outputs
from dreambooth.planning import disk
from dreambooth.planning import model_flags
from dreambooth.planning import planning
from dreambooth.sweep import sweep_files
from dreambooth.sweep import sweep_rows
from dreambooth.sweep import sweep_trial
from dreambooth.training import checkpoint_scores
from dreambooth.training import driver

SWEEP_FLAGS = [
    "model_dir", "output_dir", "instance_data_dir", "subjects_dir", "unique_token", "class_name", "subject_type",
    "eval_prompts", "eval_models_dir", "num_class_images", "sweep_learning_rate", "sweep_max_train_steps",
    "sweep_rank", "sweep_train_text_encoder", "search", "num_trials", "early_stopping", "clip_t_margin", "sweep_dir",
    "max_concurrent_trials", "eval_images_per_prompt", "num_inference_steps", "guidance_scale", "batch_size"]
# The train.py flags the sweep sets in each trial itself (every spelling of them is refused).
SET_BY_SWEEP = flags.option_strings(["learning_rate", "max_train_steps", "lora_rank", "train_text_encoder",
                                     "checkpointing_steps", "checkpoints_total_limit", "resume_from_checkpoint",
                                     "storage_path", "instance_prompt", "class_prompt", "class_data_dir",
                                     "num_class_images", "score_steps", "keep_best"])  # (its trials are scored by the sweep)




def parse_args(argv=None):
    """(sweep flags, the trials' train.py flags checked as train.py checks them)."""
    parser = flags.make_parser(
        __doc__.splitlines()[0], SWEEP_FLAGS, optional=("instance_data_dir", "class_name"), config=True,
        helps={"output_dir": "Where the best model goes (with --subjects_dir: one sub-folder per subject).",
               "num_class_images": "Class images per class for the prior-preservation loss, drawn once "
                                   "with the base model and shared by the subjects of that class."},
        types=dict.fromkeys(("output_dir", "sweep_dir", "subjects_dir", "instance_data_dir", "eval_models_dir"),
                            flags.storage_location))
    parser.set_defaults(num_class_images=100)
    parser.epilog = ("Every other flag is train.py's (see python train.py --help) and goes to every trial, e.g. "
                     "--use_lora, --num_workers, --mixed_precision. The sweep itself sets the learning rate, steps, "
                     "rank and text-encoder switch (the --sweep_* flags), the checkpoints, storage, prompts "
                     "('photo of <token> <class>', 'photo of a <class>') and class images.")
    parser.config_fallback = planning.train_parser()  # a config file may hold train.py's flags too
    args, train_flags = parser.parse_known_args(argv)
    model_flags.resolve_models(args)
    if (args.subjects_dir is None) == (args.instance_data_dir is None):
        parser.error("give --instance_data_dir (one subject) or --subjects_dir (many)")
    if args.instance_data_dir and not args.class_name:
        parser.error("--instance_data_dir needs --class_name")
    taken = [f for f in train_flags if flags.normalize_option(f).split("=")[0] in SET_BY_SWEEP]
    if taken:
        parser.error(f"{taken[0]} is set by the sweep (use the --sweep_* flags)")
    # One worker per trial unless given: train.py's own default (every GPU) would leave none for the others.
    train_flags = ["--num_workers", "1", *train_flags]
    train_args = planning.parse_args(trial_base_argv(args, train_flags), "train.py's flags for every trial")
    if train_args.num_workers == 0:
        parser.error("--num_workers 0 trains in this process: a sweep's trials run side by side on Ray Train's "
                     "workers; give 1 or more")
    args.sweep_dir = args.sweep_dir or args.output_dir.rstrip(os.sep) + "-sweep"
    args.sweep_max_train_steps = sorted(args.sweep_max_train_steps or [400])
    if train_args.prior_prediction and "num_class_images" in parser.typed:
        parser.error("--num_class_images: --prior_preservation prior_prediction trains without class images")
    if args.sweep_rank and not train_args.use_lora:
        parser.error("--sweep_rank needs --use_lora")
    if args.search == "random" and args.sweep_learning_rate and len(args.sweep_learning_rate) not in (1, 2):
        parser.error("with --search random, --sweep_learning_rate is a range: LOW,HIGH")
    # The config file repeats the sweep: its own flags, and the train.py flags given for every trial.
    given = {parser.config_fallback._action_for(flags.normalize_option(t).split("=")[0].removeprefix("--no-")
                                                .removeprefix("--")) for t in train_flags if t.startswith("--")}
    trial_settings = {k: v for k, v in flags.config_values(parser.config_fallback, train_args).items()
                      if k in {a.dest for a in given if a is not None}}
    args.settings_toml = flags.config_text(parser, args, {**trial_settings, **flags.config_values(parser, args)})
    return args, train_flags, train_args


def trial_base_argv(args, train_flags):
    """train.py's flags for every trial, with the ones each trial sets for itself held by the sweep's own (the
    class prompt too where the trials' prior needs one: each trial's own is 'photo of a <class>')."""
    argv = ["--model_dir", args.model_dir, "--output_dir", args.output_dir, "--instance_data_dir", args.model_dir,
            "--instance_prompt", "x", *train_flags]
    if planning.train_parser().parse_known_args(argv)[0].prior_preservation == "prior_prediction":
        argv += ["--class_prompt", "x"]
    return argv


def read_subjects(args):
    """{name: scoring.Subject}: the one of the flags, or one per sub-folder of --subjects_dir."""
    if args.instance_data_dir:
        name = os.path.basename(args.instance_data_dir.rstrip("/"))  # (a bucket's path too)
        return {name: scoring.Subject(name, args.instance_data_dir, args.unique_token, args.class_name,
                                      args.subject_type, args.eval_prompts)}
    if not storage.isdir(args.subjects_dir):
        raise errors.UserError(f"--subjects_dir not found: {args.subjects_dir}")
    subjects = {}
    for name in storage.listdir(args.subjects_dir):  # (a bucket's: its photos are read through this node's copy)
        folder = storage.join(args.subjects_dir, name)
        if name.startswith(".") or not storage.isdir(folder):
            continue
        path = storage.join(folder, imagefiles.SUBJECT_FILE)
        if not storage.isfile(path):
            raise errors.UserError(f"{folder} has no {imagefiles.SUBJECT_FILE} (e.g. {{\"class_name\": \"dog\"}})")
        try:
            info = storage.read_json(path)
            subjects[name] = scoring.Subject(name, folder, info.get("unique_token", args.unique_token),
                                             info["class_name"], info.get("subject_type", args.subject_type),
                                             args.eval_prompts)
        except (ValueError, KeyError, AttributeError) as err:
            raise errors.UserError(f"{path}: needs a JSON object with \"class_name\" ({type(err).__name__}: {err})") \
                from None
        if subjects[name].subject_type not in ("object", "live"):
            raise errors.UserError(f"{path}: subject_type must be object or live")
    if not subjects:
        raise errors.UserError(f"{args.subjects_dir} has no subject folders")
    return subjects


def search_values(args, train_args):
    """{setting: the values the sweep tries}: the --sweep_* lists, or train.py's one value."""
    return {"learning_rate": args.sweep_learning_rate or [train_args.learning_rate],
            "rank": args.sweep_rank or [train_args.lora_rank],
            "train_text_encoder": args.sweep_train_text_encoder or [train_args.train_text_encoder]}


def trials_per_subject(args, train_args):
    """--num_trials draws, or the grid's combinations."""
    return args.num_trials if args.search == "random" else math.prod(map(len, search_values(args, train_args).values()))


def param_space(args, subjects, train_args):
    """Tune's search space: the subjects always a grid; the rest a grid or random draws."""
    from ray import tune

    values = search_values(args, train_args)
    lrs = values["learning_rate"]
    if args.search == "grid":
        space = {k: tune.grid_search(v) if len(v) > 1 else v[0] for k, v in values.items()}
    else:
        space = {k: tune.choice(v) for k, v in values.items()}
        if len(lrs) == 2:
            space["learning_rate"] = tune.loguniform(*lrs)
    return {**space, "use_lora": train_args.use_lora,
            "subject": tune.grid_search(list(subjects)) if len(subjects) > 1 else next(iter(subjects))}


def check_disk(args, train_args, num_trials, concurrency):
    """The sweep's disk, estimated before any trial: the checkpoints of the trials running at once, and
    a model per trial and step count; a UserError when --sweep_dir's disk has not that much free (a
    bucket's is not checked: its size is the bucket's business)."""
    from dreambooth.training import failures  # here, not at the top: it imports ray.train (1.2 s)

    steps, values = args.sweep_max_train_steps, search_values(args, train_args)
    per_checkpoint, per_model = disk.disk_bytes(args.model_dir, train_args.use_lora, any(values["train_text_encoder"]),
                                                rank=max(values["rank"]), adapter=train_args.adapter)
    needed = concurrency * (sweep_trial.checkpoints_kept(steps) + 1) * per_checkpoint + num_trials * len(steps) * per_model
    what = (f"{num_trials} trial(s) x {len(steps)} step count(s) x a model of {files.size_text(per_model)}, and "
            f"the checkpoints of {concurrency} trial(s) at once, {files.size_text(per_checkpoint)} each")
    if storage.is_remote(args.sweep_dir):
        return f"about {files.size_text(needed)} in the bucket ({what})"
    free = failures.free_bytes(args.sweep_dir)
    if free < needed:
        raise errors.UserError(f"the sweep needs about {files.size_text(needed)} under --sweep_dir {args.sweep_dir} "
                               f"({what}) but {files.size_text(free)} is free there: fewer trials or step counts, "
                               "--use_lora, or a --sweep_dir on a larger disk")
    return f"about {files.size_text(needed)} of disk ({what})"


def max_concurrent(args, train_args):
    """Trials at once: as many as the cluster's GPUs hold with one GPU left for their scoring (a step count is scored
    while its trial trains on); one on CPUs (each already uses every core)."""
    if args.max_concurrent_trials:
        return args.max_concurrent_trials
    gpus = raycluster.cluster_resources()[1]
    return max(1, (gpus - 1) // (train_args.num_workers * train_args.gpus_per_worker)) if gpus else 1


def prepare_class_images(args, subjects, train_args):
    """{class name: folder}: each class's images, drawn once (train.py's --num_class_images top-up); none with
    --prior_preservation prior_prediction (the base model's own predictions keep each class's prior)."""
    dirs = {}
    if train_args.prior_prediction:
        return dirs
    for class_name in sorted({s.class_name for s in subjects.values()}):
        dirs[class_name] = storage.join(args.sweep_dir, "class-images", files.slugify(class_name))
        driver.top_up_class_images(args.model_dir, dirs[class_name], f"photo of a {class_name}", args.num_class_images,
                                   train_args.seed, train_args.resolution, train_args.allow_unsafe_weights)
    return dirs


def run_tune(job, space, concurrency, num_samples):
    """tuner.fit() of the trials; a sweep folder with Tune's state is resumed, not started again.
    With job.early_stopping, Tune's ASHA scheduler stops the trials whose score (rank_score) is in the
    bottom half at a step count (its rungs: the step counts from the smallest, doubling)."""
    from ray import tune

    trainable = tune.with_resources(tune.with_parameters(sweep_trial.trial_fn, job=job), {"CPU": 0, "memory": 1})
    path, storage_path, fs = sweep_files.tune_storage(job.sweep_dir)
    if tune.Tuner.can_restore(path, storage_filesystem=fs):
        print(f"resuming the sweep in {storage.join(job.sweep_dir, 'tune')}: finished trials are kept, the others "
              "run", file=sys.stderr)
        tuner = tune.Tuner.restore(path, trainable, resume_unfinished=True, restart_errored=True, storage_filesystem=fs)
    else:
        tuner = tune.Tuner(trainable, param_space=space,
                           tune_config=tune.TuneConfig(num_samples=num_samples, max_concurrent_trials=concurrency,
                                                       scheduler=scheduler(job)),
                           run_config=tune.RunConfig(name="tune", storage_path=storage_path, storage_filesystem=fs,
                                                     verbose=1,
                                                     failure_config=tune.FailureConfig(max_failures=0)))
    return tuner.fit()


def scheduler(job):
    """ASHA over the step counts within each subject (early stopping), or None: every trial runs to
    the end."""
    if not job.early_stopping:
        return None
    from dreambooth.sweep.sweep_scheduler import SubjectASHA  # here, not at the top: it imports ray.tune (1.1 s)

    return SubjectASHA(time_attr="step", metric="score", mode="max", max_t=job.steps[-1],
                       grace_period=job.steps[0], reduction_factor=2)


def wants_early_stopping(args, num_trials):
    """--early_stopping as decided: auto is on for random search and for grids of more than 4 trials
    per subject; it needs 2 or more step counts (UserError when asked for with one)."""
    if len(args.sweep_max_train_steps) < 2:
        if args.early_stopping == "on":
            raise errors.UserError("--early_stopping on needs 2 or more --sweep_max_train_steps (where to stop)")
        return False
    if args.early_stopping != "auto":
        return args.early_stopping == "on"
    return args.search == "random" or num_trials > 4


def target_dir(args, name):
    """Where a subject's best model goes: --output_dir, or with --subjects_dir its sub-folder."""
    return args.output_dir if args.instance_data_dir else storage.join(args.output_dir, name)


def score_base(args, subjects, eval_settings):
    """{name: the base model's overall scores on each subject}: all subjects in one evaluation (one
    actor pool for the images, one for the embeddings); a rerun with the same prompts reads them back."""
    folder = storage.join(args.sweep_dir, "base")
    base, todo = {}, []
    for subject in subjects.values():
        saved = storage.join(folder, subject.name, "scores.json")
        result = scoring.EvalResult.from_json(storage.read_json(saved)) if storage.isfile(saved) else None
        if result and result.prompts == tuple(subject.prompts()) and \
                result.num_samples_per_prompt == eval_settings.num_samples_per_prompt:
            base[subject.name] = result.overall("base")
        else:
            todo.append(subject)
    if todo:
        with storage.output_folder(folder) as local:  # (a bucket's: filled here, copied there)
            results = scoring.run([("base", outputs.ModelRef(args.model_dir))], todo, eval_settings, local,
                                  {s.name: os.path.join(local, s.name) for s in todo})
        for name, result in results.items():
            base[name] = result.overall("base")
            print(f"base model on {name}: {eval_report.summary(base[name])}", file=sys.stderr)
    return {name: base[name] for name in subjects}


def main(argv=None):
    args, train_flags, train_args = parse_args(argv)
    early_stopping = wants_early_stopping(args, trials_per_subject(args, train_args))
    # --holdout (train.py's flag, for every trial): the same photos kept out of training and scored apart
    subjects = {name: dataclasses.replace(s, holdout=train_args.holdout) for name, s in read_subjects(args).items()}
    # A bucket's scoring models: this node's copy (a trial's actors fetch theirs); the config keeps the bucket's path.
    if storage.is_remote(args.eval_models_dir):
        args.eval_models_dir = storage.cached(args.eval_models_dir)
    check_inputs(args, train_args, subjects)
    sweep_files.set_aside_another_sweep(args.sweep_dir, args.settings_toml)
    config = sweep_files.write_text(args.sweep_dir, sweep_files.CONFIG_FILE, args.settings_toml)
    print(f"settings: {config} (sweep.py --config {config} repeats this sweep)", file=sys.stderr)
    raycluster.init_ray()
    # (the trials' checkpoints are scored with evaluate.py's seed, as train.py scores them while training: so is the
    # base model they are held to)
    eval_settings = scoring.EvalSettings(
        args.eval_models_dir, args.eval_images_per_prompt, checkpoint_scores.EVAL_SEED, args.batch_size,
        args.num_inference_steps, args.guidance_scale, train_args.resolution, None, train_args.allow_unsafe_weights)
    class_dirs = prepare_class_images(args, subjects, train_args)
    base = score_base(args, subjects, eval_settings)
    rank_against = {name: (s["clip_t"] - args.clip_t_margin, sweep_rows.ranking_dino(s)) for name, s in base.items()}
    parser, given = planning.parse_given(trial_base_argv(args, train_flags))  # parsed once, for every trial
    job = sweep_trial.SweepJob(subjects, args.sweep_dir, tuple(args.sweep_max_train_steps), class_dirs, given,
                               frozenset(parser.given), frozenset(parser.typed), args.model_dir, eval_settings,
                               early_stopping, base, rank_against, train_args.keep_checkpoints)
    concurrency = max_concurrent(args, train_args)
    num_samples = args.num_trials if args.search == "random" else 1
    disk = check_disk(args, train_args, len(subjects) * trials_per_subject(args, train_args), concurrency)
    stopping = "; trials behind at a step count stop there (ASHA)" if early_stopping else ""
    print(f"sweep: {len(subjects)} subject(s), steps {args.sweep_max_train_steps}, {args.search} search, "
          f"{concurrency} trial(s) at once{stopping}; {disk}; working folder {args.sweep_dir}", file=sys.stderr)
    results = run_tune(job, param_space(args, subjects, train_args), concurrency, num_samples)
    expected = len(subjects) * trials_per_subject(args, train_args)
    unfinished = sweep_files.unfinished_trials(args.sweep_dir, expected)
    if unfinished:  # (Ctrl-C: Tune stopped the trials and saved its state)
        print(f"stopped with {unfinished} of {expected} trial(s) unfinished; rerun the same command to continue "
              f"(the sweep's state: {storage.join(args.sweep_dir, 'tune')})", file=sys.stderr)
        raise errors.Stopped
    rows = sweep_rows.collect(results, args.sweep_max_train_steps[-1])
    failed = {sweep_trial.trial_label(row.config()) for row in rows if not row.scored}
    for trial in sweep_files.trial_storage_paths(args.sweep_dir):
        label_dir = os.path.dirname(trial.rstrip("/"))
        sweep_trial.remove_output(label_dir)  # (a trial stopped early trained on past its step count: not in the table)
        if not job.keep_checkpoints and os.path.basename(label_dir) not in failed:  # (a failed trial's: its rerun's)
            sweep_trial.remove_checkpoints(trial)
    return finish(args, subjects, rows, base)


def check_inputs(args, train_args, subjects):
    """What would fail in a trial, checked before the first: each subject's photos and prompts, the
    base and scoring models, the output folders."""
    with sweep_files.scratch(args.sweep_dir, "converted-images") as converted:
        for subject in subjects.values():  # a missing or corrupt photo or a bad prompt file fails now, not in a trial
            imagefiles.inspect_images(subject.photos(), 0, converted)
            subject.prompts()
    families.check_model_dir(args.model_dir, train_args.allow_unsafe_weights)
    families.require(args.model_dir, "train")
    modelcache.check_eval_models_dir(args.eval_models_dir)
    inputs = [("--model_dir", args.model_dir), ("--instance_data_dir", args.instance_data_dir),
              ("--subjects_dir", args.subjects_dir)]
    for flag, path in (("--output_dir", args.output_dir), ("--sweep_dir", args.sweep_dir)):
        files.check_output_path(path, flag, inputs)
    for name in subjects:
        outputs.check_output_dir(target_dir(args, name), train_args.overwrite)


def finish(args, subjects, rows, base):
    """Each subject's best model copied to its target, the table, plot and report written, and the
    outcome in a few lines; {"rows", "best", "base", "copied_to"}. UserError when every trial failed."""
    for row in rows:
        if row.note:
            print(f"{row.subject}: trial lr {row.learning_rate:.3g} {row.note}", file=sys.stderr)
    best = sweep_rows.choose(rows, base, args.clip_t_margin)
    copied_to = {}
    for name, choice in best.items():
        copied_to[name] = target_dir(args, name)
        sweep_files.copy_model(choice.row.model, copied_to[name])
    written = sweep_files.write_reports(args.sweep_dir, rows, base, best, args.clip_t_margin)
    failed = sum(not r.scored for r in rows)
    for name in subjects:
        if name not in best:
            print(f"{name}: every trial failed; see {written['table']}", file=sys.stderr)
            continue
        row = best[name].row
        note = "" if best[name].within_margin else f" (no trial kept CLIP-T within {args.clip_t_margin} of the base)"
        print(f"{name}: best lr {row.learning_rate:.3g}, {row.step} steps, DINO {row.dino:.3f}, "
              f"CLIP-T {row.clip_t:.3f}{note} -> {copied_to[name]}", file=sys.stderr)
    # (a row per trial and step count: a trial scored at 2 step counts is 2 models)
    print(f"{len(rows) - failed} model(s) scored (a trial's at each step count), {failed} failed trial(s); "
          f"{written['table']}, {written['plot']}, "
          f"{written['report']}", file=sys.stderr)
    if not best:
        raise errors.UserError("every trial failed: see the table for each error")
    return {"rows": rows, "best": best, "base": base, "copied_to": copied_to}

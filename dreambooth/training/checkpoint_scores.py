"""Scores while training (train.py --score_steps): each checkpoint of a scored step is handed to Ray Train's
validation (ray.train.ValidationConfig), which runs score_checkpoint as a task of its own while the workers go on
training. There the checkpoint becomes a model in the run folder's scores/step-N/ and is scored as evaluate.py scores
a model (scoring.run: the same drawing, embedding and scores, evaluate.py's seed; the held-out photos apart); its
scores go back to Ray Train with the checkpoint and into Ray's key-value store, where rank 0 reads them as they
arrive (ScoreWatch); the driver adds those that came after the last step (finish).

Ray Train's validation API is alpha in Ray 2.60: tests/unit/test_checkpoint_scores.py pins what this module relies on.
"""

import contextlib
import dataclasses
import functools
import json
import os
import shutil

from dreambooth import errors
from dreambooth import files
from dreambooth import storage
from dreambooth.cluster import raycluster
from dreambooth.evaluation import scoring
from dreambooth.models import outputs
from dreambooth.planning import checkpoints
from dreambooth.storage import runfiles
from dreambooth.training import checkpoint
from dreambooth.training import score_record

NAMESPACE = "dreambooth-scores"  # of Ray's key-value store: each scored step's scores, until rank 0 has logged them
SCORING_LOG = "scoring.log"  # in scores/step-N: what the scoring task said
SUBJECT = "subject"  # the one subject a run is scored against
# evaluate.py's seed of the images it scores (its --seed default): a step's images are those evaluate.py would draw
EVAL_SEED = scoring.EvalSettings.seed
# the actors of each pool a scoring task starts on a cluster of several nodes (drawing, then embedding): one, beside
# the training (a GPU's each where the cluster has them), not one per GPU of the cluster as evaluate.py's
SCORING_ACTORS = 1


def subject_of(run, holdout=0):
    """The scoring.Subject of a run (its Plan, or train.py's flags): its photos (the last holdout of them held out),
    token, class and prompt set."""
    return scoring.Subject(SUBJECT, run.instance_data_dir, run.unique_token, run.class_name, run.subject_type,
                           run.eval_prompts, holdout=holdout)


def settings_of(plan, here):
    """How a scored step's images are drawn: evaluate.py's way at the run's resolution and guidance, with
    --eval_images_per_prompt images of each prompt and --validation_inference_steps steps (here: in the task's own
    process, scores_here)."""
    return scoring.EvalSettings(plan.eval_models_dir, num_samples_per_prompt=plan.eval_images_per_prompt,
                                seed=EVAL_SEED, num_inference_steps=plan.validation_inference_steps,
                                guidance_scale=plan.guidance_scale, resolution=plan.resolution,
                                num_actors=SCORING_ACTORS, allow_unsafe_weights=plan.allow_unsafe_weights, here=here)


def scores_here(plan):
    """Whether the scoring tasks draw and embed in their own process (scoring.EvalSettings.here: the classes of the
    pools' actors), holding what one such actor holds: on a cluster of one node, where the actors would run beside the
    task anyway, with no actor process to start (and import torch and diffusers in) per scored step, and a Ray worker
    that scored one step scoring the next with DINO and CLIP loaded; and for a bucket's run, whose files and step
    models are on this node's disk only. Else (several nodes, a shared disk or a sweep trial's step models in the
    bucket) the task stays on the driver's node and its actor pools go wherever the cluster has room. UserError where
    the task would wait forever: here, on a node without the GPU the cluster's actors would hold."""
    import ray

    from dreambooth.generation import drawing

    nodes = [node for node in ray.nodes() if node["Alive"]]
    if len(nodes) == 1:
        return True
    if not storage.is_remote(plan.storage_path) or plan.step_models:
        return False
    this = ray.get_runtime_context().get_node_id()
    if drawing.actor_num_gpus() and not next(n for n in nodes if n["NodeID"] == this)["Resources"].get("GPU"):
        raise errors.UserError("--score_steps with --storage_path in a bucket scores each step on this node, which "
                               "holds the step's files, and this node has no GPU: run train.py on a node with one, or "
                               "score the saved model afterwards with evaluate.py (dreambooth_run.sh: SCORE_STEPS=0)")
    return True


def task_resources(here):
    """What a scoring task holds, on the driver's node (raycluster.on_this_node): here, what an actor of evaluate.py's
    pools holds (a CPU, and a GPU where the cluster has them); else nothing (it waits on the actor pools it starts, which
    hold theirs)."""
    from dreambooth.generation import drawing

    held = {"num_cpus": 1, "num_gpus": drawing.actor_num_gpus()} if here else {"num_cpus": 0}
    return {**held, "scheduling_strategy": raycluster.on_this_node()}


def check_inputs(args):
    """UserError before Ray starts for what a scoring task would fail on only after its step was trained: the scoring
    models' folder (a bucket's: args.eval_models_dir becomes this node's copy), the evaluation prompts (each with
    '{subject}'), the photos."""
    from dreambooth.models import modelcache

    if storage.is_remote(args.eval_models_dir):  # (a bucket's: this node's copy, where the scoring tasks run)
        args.eval_models_dir = storage.cached(args.eval_models_dir)
    modelcache.check_eval_models_dir(args.eval_models_dir)
    subject = subject_of(args)
    subject.prompts()
    subject.photos()


def validation_config(plan):
    """Ray Train's validation of the scored checkpoints: score_checkpoint as a task of task_resources()."""
    import ray.train

    here = scores_here(plan)
    return ray.train.ValidationConfig(functools.partial(score_checkpoint, plan=plan, here=here),
                                      ray_remote_kwargs=task_resources(here))


def score_checkpoint(checkpoint_ref, plan, here=False):
    """A scored step's checkpoint as a model in scores/step-N/model, scored there; the model goes afterwards (the
    images, scores.json and report.md stay). Returns its scores ({score_record.SCORE_KEYS: value}) for Ray Train's
    record."""
    with checkpoint_ref.as_directory() as folder:
        step = files.read_json(os.path.join(folder, checkpoints.STATE_FILE))["step"]
        where = os.path.join(plan.run_dir, score_record.SCORES_FOLDER, f"step-{step}")
        model = kept_model(plan, step) or os.path.join(where, "model")
        checkpoint.save_as_model(folder, checkpoint.step_model_plan(plan, model, step, plan.held_out))
    label = f"step-{step}"
    try:
        result = scored(plan, label, outputs.resolve_model(model), where, here)
    except BaseException:
        if not kept_model(plan, step):
            shutil.rmtree(model, ignore_errors=True)
        raise
    best = score_record.best_step(plan.run_dir, plan.clip_t_margin)[0] if plan.keep_best else None
    if best is not None or not plan.keep_best:  # (--keep_best before the base model's scores: all kept until then)
        score_record.keep_models(plan.run_dir, best)
    runfiles.sync_up(plan.storage_path, plan.run_name)  # (a bucket's run: its scores there too)
    values = score_record.score_values(result[SUBJECT].overall(label))
    # (for rank 0, on whichever node: Ray Train's own record of a checkpoint goes with it when the checkpoint
    # limit removes it, which can be as soon as its scores are in)
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(score_key(plan.run_name, step), json.dumps(values), namespace=NAMESPACE)
    return values


def kept_model(plan, step):
    """Where a sweep's trial keeps a scored step's model (plan.step_models' model-step-N: a bucket's, or a folder every
    node reads), or None: the step's model is made in the run folder and removed once scored."""
    return storage.join(plan.step_models, f"model-step-{step}") if plan.step_models and step in plan.score_at else None


def scored(plan, label, model, where, here):
    """scoring.run of one model (a scoring.ModelRef) into where, as evaluate.py scores it; what it says as it goes
    (evaluate.py's lines and bars) in where's log: the run's output is the training's, and one line of scores."""
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, SCORING_LOG), "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        return scoring.run([(label, model)], [subject_of(plan, len(plan.held_out))], settings_of(plan, here),
                           where)


def start_base(plan):
    """The base model's scoring (score_base) as a task of its own from the run's start, beside the training and the
    steps' scoring, unless the run has its scores (a resumed run's, carried over): its ObjectRef, or None."""
    import ray

    # (a sweep's: scored once per subject)
    if plan.base_scores is not None and score_record.base_scores(plan.run_dir) is None:
        os.makedirs(os.path.join(plan.run_dir, score_record.SCORES_FOLDER), exist_ok=True)
        files.write_bytes_atomic(json.dumps(score_record.score_values(plan.base_scores)).encode(),
                                 os.path.join(plan.run_dir, score_record.SCORES_FOLDER, score_record.BASE_SCORES))
    if score_record.base_scores(plan.run_dir) is not None:
        return None
    here = scores_here(plan)
    return ray.remote(**task_resources(here))(score_base).remote(plan, here)


def score_base(plan, here=False):
    """The base model scored as each step is (scores/base/: images, scores.json, report.md; the scores in
    score_record.BASE_SCORES): the best step's CLIP-T is held to its."""
    where = os.path.join(plan.run_dir, score_record.SCORES_FOLDER, score_record.BASE)
    result = scored(plan, score_record.BASE, outputs.resolve_model(plan.model_dir), where, here)
    values = score_record.score_values(result[SUBJECT].overall(score_record.BASE))
    files.write_bytes_atomic(json.dumps(values).encode(),
                             os.path.join(plan.run_dir, score_record.SCORES_FOLDER, score_record.BASE_SCORES))
    runfiles.sync_up(plan.storage_path, plan.run_name)


def wait_base(task, stopped=False):
    """The base model's scoring (start_base's task) ended: None, or the line of one that failed. A stopped run does
    not wait for it (its resume scores the base model again)."""
    import ray

    if task is None:
        return None
    if stopped and not ray.wait([task], timeout=0)[0]:
        ray.cancel(task, force=True)
        return None
    try:
        ray.get(task)
    except Exception as err:  # (whatever the scoring met: said, the run's model and scores stand)
        log = os.path.join(score_record.SCORES_FOLDER, score_record.BASE, SCORING_LOG)
        return (f"the base model's scoring failed ({errors.one_line(err)[:200]}; its log: {log} in the run folder): no "
                "best step can be named")
    return None


def forget(run_name):
    """The run's scores left in Ray's key-value store removed (its scoring tasks have ended)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(f"{run_name}/", del_by_prefix=True, namespace=NAMESPACE)


def score_key(run_name, step):
    """The key of a scored step's scores in Ray's key-value store."""
    return f"{run_name}/step-{step}"


def note_waiting(run_name, steps):
    """Rank 0, its steps trained: the steps sent for scoring whose scores it has not seen, for the driver to name if a
    signal cuts their scoring short (waiting_on), begun or not."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(f"{run_name}/waiting", json.dumps(sorted(steps)), namespace=NAMESPACE)


def waiting_on(run_name):
    """The steps note_waiting recorded for run_name ([] if none)."""
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(f"{run_name}/waiting", namespace=NAMESPACE)
    return json.loads(value) if value else []


class ScoreWatch:
    """Rank 0's view of the scoring: the steps it sent (sent), the one Ray Train is still scoring (pending), and
    each step's scores once (new_rows), from Ray's key-value store, where the scoring task puts them."""

    def __init__(self, run_name):
        self.run_name = run_name
        self.sent, self.said = set(), set()  # the steps sent for scoring; those whose scores (or failure) were logged
        self.pending = None  # a step whose scoring Ray Train had not finished at the last call, if any

    def new_rows(self):
        """[(step, {score_record.SCORE_KEYS: value}) or (step, None) for a scoring task that failed or timed out], in
        step order, for the sent steps whose scoring has ended since the last call."""
        import ray.train
        from ray.experimental import internal_kv

        committed = ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        newest = max((reported.metrics.get("step") for reported in committed), default=0)
        # (a step after the newest committed one is still uploading, --checkpoint_upload: Ray commits them in order)
        pending = sorted([reported.metrics.get("step") for reported in committed
                          if reported.status is ray.train.ReportedCheckpointStatus.PENDING_VALIDATION] +
                         [step for step in self.sent - self.said if step > newest])
        self.pending = pending[0] if pending else None
        rows = []
        for step in sorted(self.sent - self.said):
            key = score_key(self.run_name, step)
            value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
            if value is None and step in pending:
                continue
            rows.append((step, json.loads(value) if value is not None else None))  # (ended without: it failed)
            self.said.add(step)
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)
        return rows


def skip_line(step, pending):
    """Why a step due to be scored is not: one scoring at a time (their checkpoints are kept until scored)."""
    return (f"step {step} is not scored: step {pending}'s scoring has not finished (a scoring takes longer than "
            "--score_steps steps here; the next due step after it is scored, and the last always)")


def waiting_line(steps, plan):
    """What rank 0 says when the training has ended with steps still being scored (or queued for it): the run ends
    after them, and a scoring is slower than the training's steps can make it look."""
    each = ""
    with contextlib.suppress(Exception):  # (a prompt file this node cannot read: the line without the count, never
        # an error in the worker before it saves the model)
        each = f", {plan.eval_images_per_prompt * (len(subject_of(plan).prompts()) + 1)} images each"  # (PRES's too)
    return (f"trained to step {plan.total_steps}; the run ends once the scoring of step(s) {', '.join(map(str, steps))} "
            f"has ended (one at a time{each}: --eval_images_per_prompt, --eval_prompts)")


def describe(step, values, during_run=False):
    """The output's line of a scored step (during_run: said by rank 0 while the run goes on)."""
    if values is None:
        return (f"scores of step {step}: its scoring task failed (its error: the run folder's "
                f"{score_record.SCORES_FOLDER}/step-{step}/{SCORING_LOG}, and Ray's log)"
                + ("; the training goes on" if during_run else ""))
    return f"scores of step {step}: " + ", ".join(f"{key.upper().replace('_', '-')} {values[key]:.3f}"
                                                  for key in score_record.SCORE_KEYS)


def keep_best(plan, step, why):
    """--keep_best at the end of the run: plan.output_dir's model (the last step's; a bucket's too) replaced by step's,
    kept in the scores folder; its record says which step, its scores and why. The line that says what was saved."""
    output = outputs.read_output(plan.output_dir)
    last = step == plan.total_steps
    source = score_record.model_of(plan.run_dir, step)
    if output is None or (not last and not os.path.isdir(source)):
        return (f"--keep_best: step {step}'s model is not on this node (its scoring ran on another): the last step's "
                f"model is saved in {plan.output_dir}")
    kept = {"step": step, "of_steps": plan.total_steps, "scores": score_record.scores_on_disk(plan.run_dir)[step],
            "why": why, outputs.KEPT_SCORES: storage.join(plan.storage_path, plan.run_name, score_record.SCORES_FOLDER)}
    # the scored model's id where the saved weights are its (copied from it; the last step's, where its files hold the
    # same tensors): evaluate.py then takes the images its scoring drew (scoring.scored_image_folders)
    scored = outputs.read_output(source) if os.path.isdir(source) else None
    same = bool(scored and scored.model_id) and (not last or score_record.same_weights(source, plan.output_dir))
    record = dataclasses.replace(output.record, steps=step, model_id=scored.model_id if same else outputs.new_model_id(),
                                 kept=kept)
    marker = storage.join(plan.output_dir, files.OUTPUT_MARKER)
    if last:  # the saved model is the best step's already: its record says so (written whole, as a bucket's object)
        data = json.dumps(record.to_json(), indent=2, sort_keys=True).encode()
        if storage.is_remote(marker):
            storage.write_bytes(marker, data)
        else:
            files.write_bytes_atomic(data, marker)
        score_record.keep_models(plan.run_dir, None)
        return f"saved: the last step's model, the best scored, in {plan.output_dir} (--keep_best)"
    config = storage.join(plan.output_dir, outputs.TRAIN_CONFIG)
    config = storage.read_bytes(config) if storage.isfile(config) else None

    def write(tmp):
        for name in os.listdir(source):
            path = os.path.join(source, name)
            if name != files.OUTPUT_MARKER:
                (shutil.copytree if os.path.isdir(path) else shutil.copy2)(path, os.path.join(tmp, name))
        if config is not None:
            files.write_bytes_atomic(config, os.path.join(tmp, outputs.TRAIN_CONFIG))
        files.write_json(os.path.join(tmp, files.OUTPUT_MARKER), record.to_json())

    outputs.write_output(plan.output_dir, write)
    score_record.keep_models(plan.run_dir, None)
    return f"saved: step {step}'s model, the best scored, in {plan.output_dir} instead of step {plan.total_steps}'s (--keep_best)"


def finish(plan, last_step=None, base_task=None, cut=None):
    """At the end of a run, or when it stopped at last_step (its scoring tasks over): the scores rank 0 had not
    seen yet, which arrived after its last report, added to metrics.jsonl; the lines that say them (and a step due
    to be scored without scores), then every scored step's, in step order; the best-scored step and, at the end,
    which model was saved (--keep_best: the best step's, among those scored). cut: when a signal ended the scoring
    after the training, the steps rank 0 was waiting on (waiting_on); each step without scores among them, the last
    and any whose scoring had begun is said to be cut short."""
    from dreambooth.training import runlog

    failed = wait_base(base_task, stopped=last_step is not None or cut is not None)
    # (a bucket's run: rank 0's metrics.jsonl from there, whichever node wrote it, before the late scores join it: this
    # node's copy, if any, may be another node's older one, and the driver's sync_up puts this one back)
    metrics_file = storage.fetch(storage.join(plan.storage_path, plan.run_name), runlog.METRICS_FILE, plan.run_dir)
    logged, found = runlog.scored_steps(metrics_file), score_record.scores_on_disk(plan.run_dir)
    first = checkpoints.saved_step(plan.resume_path) + 1 if plan.resume_path else 1
    lines = []
    for step in range(first, (last_step or plan.total_steps) + 1):
        if step in found and step not in logged:
            runlog.append_scores(metrics_file, step, found[step])
            lines.append(describe(step, found[step]))
            logged.add(step)
        elif cut is not None and step not in found and step not in logged and (
                step == plan.total_steps or step in cut or os.path.isdir(
                os.path.join(plan.run_dir, score_record.SCORES_FOLDER, f"step-{step}"))):  # (the last, sent or begun)
            lines.append(f"step {step} not scored: its scoring was cut short (evaluate.py scores a saved model)")
        elif step == plan.total_steps and step not in found:
            lines.append(describe(step, None))  # (the last step is always scored: its task failed or timed out)
    scored = sorted(logged)  # (a resumed run's: the earlier run's too)
    step, within, ranked_by = score_record.best_step(plan.run_dir, plan.clip_t_margin)
    if scored:
        base = score_record.base_scores(plan.run_dir)
        best = (step, "kept" if plan.keep_best and last_step is None else "best") if step is not None else None
        plot = runlog.plot_scores(metrics_file, base and base["clip_t"], plan.clip_t_margin, best)
        run_folder = storage.join(plan.storage_path, plan.run_name)  # (a bucket's: the driver copies them there)
        lines.append(f"scored steps: {', '.join(map(str, scored))}, plotted in "
                     f"{storage.join(run_folder, os.path.basename(plot))} (images and report.md of each in "
                     f"{storage.join(run_folder, score_record.SCORES_FOLDER)})")
    elif last_step is not None and not any(plan.is_score_step(step) for step in range(first, last_step + 1)):
        due = next(step for step in range(last_step + 1, plan.total_steps + 1) if plan.is_score_step(step))
        lines.append(f"no step was scored: the run stopped at step {last_step}, before step {due}, the first due to be "
                     f"scored (--score_steps {plan.score_steps})")
    elif cut is not None:
        lines.append("no step was scored: their scoring was cut short")
    else:
        lines.append(f"no step was scored (--score_steps {plan.score_steps}): each scored step's "
                     f"{score_record.SCORES_FOLDER}/step-N/{SCORING_LOG} in the run folder says why, and Ray's log")
    lines += [failed] if failed else []
    if step is None and last_step is None:  # (no base model's scores: the last step's model stands)
        score_record.keep_models(plan.run_dir, None)
        if plan.keep_best and not plan.step_models:
            lines.append(f"saved: the last step's model in {plan.output_dir} (--keep_best had no scores to choose by)")
    if step is not None:
        lines.append(score_record.best_line(plan, step, within, ranked_by))
        if last_step is None and not plan.step_models:  # (the run's end: a stopped run saved no model; a sweep's
            # trial keeps every step count's model, and the sweep picks among them)
            lines.append(keep_best(plan, step, lines[-1]) if plan.keep_best else
                         f"saved: the last step's model in {plan.output_dir} (--keep_best saves the best step's instead)")
    return lines

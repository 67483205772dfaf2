"""--report_to's experiment trackers (diffusers' names): TensorBoard events in the run folder, a W&B run
(offline when there is no key or no network: `wandb sync` later) and an MLflow run (MLFLOW_TRACKING_URI,
by default a SQLite store under --storage_path). Each gets the run's settings, the logged windows' loss,
learning rate and images/s, and the validation images; the run's trackers.json names the W&B and MLflow
runs, so that a resumed run goes on in them and evaluate.py adds its scores to them (the model's record
carries the same names)."""

import importlib.util
import netrc
import os
import socket
import sys
import time

import tomllib

from dreambooth import errors
from dreambooth import files
from dreambooth.storage import runfiles

TRACKERS = ("tensorboard", "wandb", "mlflow")
CHOICES = ("none", *TRACKERS, "all")
# {tracker: (the module it needs, what to install)}
PACKAGES = {"tensorboard": ("tensorboardX", "tensorboardX"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny sqlalchemy alembic")}
WANDB_HOST = "api.wandb.ai"


def chosen(report_to):
    """The trackers of a --report_to value."""
    if report_to in (None, "none"):
        return ()
    return TRACKERS if report_to == "all" else (report_to,)


def check_installed(report_to):
    """UserError naming the pip command when a chosen tracker's package is missing (before Ray starts)."""
    for name in chosen(report_to):
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise errors.UserError(f"--report_to {name} needs the {module} package: pip install {package}")


def wandb_mode():
    """(mode, why): WANDB_MODE when set; else online with an API key (WANDB_API_KEY or ~/.netrc, as
    `wandb login` leaves it) and a reachable W&B host, otherwise offline (the user syncs later)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], "WANDB_MODE"
    base = os.environ.get("WANDB_BASE_URL", f"https://{WANDB_HOST}")
    host = base.split("://", 1)[-1].split("/", 1)[0]
    if not os.environ.get("WANDB_API_KEY"):
        try:
            if netrc.netrc().authenticators(host.split(":")[0]) is None:
                return "offline", "no W&B API key"
        except (OSError, netrc.NetrcParseError):
            return "offline", "no W&B API key"
    name, _, port = host.partition(":")
    try:
        socket.create_connection((name, int(port or 443)), timeout=3).close()
    except OSError:
        return "offline", f"{host} cannot be reached"
    return "online", "API key found"


DEFAULT_PROJECT = "dreambooth"  # the W&B project and MLflow experiment without --tracker_project_name or their variable
PROJECT_VARIABLES = {"wandb": "WANDB_PROJECT", "mlflow": "MLFLOW_EXPERIMENT_NAME"}


def project_of(name, given):
    """The W&B project or MLflow experiment (name) of a run: --tracker_project_name, else the tracker's own variable,
    else DEFAULT_PROJECT."""
    return given or os.environ.get(PROJECT_VARIABLES.get(name, "")) or DEFAULT_PROJECT


def mlflow_uri(storage_path):
    """MLFLOW_TRACKING_URI, or a SQLite store shared by the runs under storage_path."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.join(storage_path, 'mlflow.db')}"


def settings_of(settings_toml):
    """The run's settings as flat {flag: value} for a tracker's config (lists as text)."""
    values = tomllib.loads(settings_toml) if settings_toml else {}
    return {k: (", ".join(map(str, v)) if isinstance(v, list) else v) for k, v in values.items()}


class TensorBoard:
    def __init__(self, folder, **_):
        from tensorboardX import SummaryWriter

        events = os.path.join(folder, "tensorboard")
        self.writer = SummaryWriter(events)
        print(f"TensorBoard events in {events} (to browse them: tensorboard --logdir {events})", file=sys.stderr)

    def scalars(self, step, values):
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def images(self, step, images):
        import numpy as np

        for name, image in images.items():
            self.writer.add_image(name, np.asarray(image), step, dataformats="HWC")
        self.writer.flush()

    def close(self):
        self.writer.close()


SCORE_STEP = "scores/step"  # W&B's x axis of the scores/ charts: the step scored


class WandB:
    """A W&B run in the run folder's wandb/ (WANDB_DIR's when set); resumed (same id) when the record names one."""

    def __init__(self, folder, project, run_name, settings, previous=None):
        wandb = import_wandb(folder)
        from wandb.sdk.lib import runid

        self.wandb = wandb
        self.folder = folder
        mode, why = wandb_mode()
        run_id = (previous or {}).get("id") or runid.generate_id()
        where = os.environ.get("WANDB_DIR") or folder
        os.makedirs(where, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, id=run_id, resume="allow", dir=where, mode=mode,
                              config=settings, settings=wandb.Settings(silent=True, console="off"))
        self.record = {"id": run_id, "project": project, "dir": where}
        # A step's scores (--score_steps) arrive steps later, and W&B drops a value logged at a step before its
        # last: they are plotted against a step of their own instead.
        self.run.define_metric(SCORE_STEP)
        self.run.define_metric("scores/*", step_metric=SCORE_STEP)
        if mode == "offline":
            print(f"W&B run {run_id} of project {project!r} offline ({why}): wandb sync {self.run.dir.rsplit(os.sep, 1)[0]} "
                  "uploads it", flush=True)

    def scalars(self, step, values):
        if all(name.startswith("scores/") for name in values):  # (at the step W&B is at: SCORE_STEP says whose)
            self.run.log({**values, SCORE_STEP: step})
        else:
            self.run.log(values, step=step)

    def images(self, step, images):
        self.run.log({name: self.wandb.Image(image) for name, image in images.items()}, step=step)

    def close(self):
        self.run.finish()
        # Its service process ends now (with its socket's folder in the system's temp folder), not at an exit
        # that a train worker, ended by Ray, never reaches; a later W&B run in this process starts another.
        self.wandb.teardown()
        # Its staging folders (see import_wandb) go too: nothing of W&B's own is left in the run folder.
        for held in wandb_staging():
            held.cleanup()
        try:
            os.rmdir(os.path.join(self.folder, WANDB_STAGING))
        except OSError:
            pass


WANDB_STAGING = "wandb-tmp"


def import_wandb(folder):
    """wandb, with its two staging folders (media, artifacts) in folder/wandb-tmp: wandb makes them in the
    system's temp folder when imported and only a normal exit removes them, and a train worker is ended by Ray
    (they stayed in /tmp after every run). WandB.close() removes them; a later run in this process gets new
    ones in its own folder."""
    import tempfile

    staging = os.path.join(folder, WANDB_STAGING)
    os.makedirs(staging, exist_ok=True)
    if "wandb" not in sys.modules:
        saved = tempfile.tempdir
        tempfile.tempdir = staging
        try:
            importlib.import_module("wandb")
        finally:
            tempfile.tempdir = saved
    else:
        for held in wandb_staging():
            if not os.path.isdir(held.name):  # (removed by the close of this process's last run)
                held.name = tempfile.mkdtemp(dir=staging)
    return sys.modules["wandb"]


def wandb_staging():
    """wandb's staging folders (tempfile.TemporaryDirectory objects); none that this wandb does not have."""
    held = []
    for module, owner, name in (("wandb.sdk.data_types._private", None, "MEDIA_TMP"),
                                ("wandb.sdk.artifacts.artifact", "Artifact", "_TMP_DIR")):
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        found = getattr(found, owner, None) if owner else found
        if hasattr(found, name):
            held.append(getattr(found, name))
    return held


class MLflow:
    """An MLflow run in the run's experiment (--tracker_project_name); resumed when the record names one."""

    def __init__(self, folder, project, run_name, settings, previous=None, storage_path=None):
        # (MLflow's usage telemetry off, as Ray's: it also wrote ~/.config/mlflow/telemetry.json)
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        # (its INFO lines, "Creating initial MLflow database tables...", are about its store, not the run)
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        import mlflow

        self.uri = (previous or {}).get("tracking_uri") or mlflow_uri(storage_path)
        self.client = mlflow.MlflowClient(self.uri)
        run_id = (previous or {}).get("run_id")
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                project, artifact_location=self.artifacts_location())
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in settings.items()]
            for start in range(0, len(params), 100):  # (MLflow takes 100 parameters a call)
                self.client.log_batch(run_id, params=params[start:start + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.record = {"run_id": run_id, "tracking_uri": self.uri}
        of = f" of experiment {project!r}" if project else ""  # (evaluate.py's scores: the run's own)
        print(f"MLflow run {run_id}{of} in {self.uri} (to browse it: mlflow ui --backend-store-uri {self.uri})",
              file=sys.stderr)

    def artifacts_location(self):
        """Beside a local SQLite store (mlruns/), else the server's default."""
        if self.uri.startswith("sqlite:///"):
            return "file://" + os.path.join(os.path.dirname(self.uri[len("sqlite:///"):]), "mlruns")
        return None

    def scalars(self, step, values):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def images(self, step, images):
        for name, image in images.items():
            self.client.log_image(self.run_id, image, key=name, step=step)

    def close(self):
        self.client.set_terminated(self.run_id)


KINDS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def open_trackers(plan, folder, previous_record=None):
    """{name: tracker} of plan.report_to, writing their names to folder's trackers.json; previous_record
    (the record of the run this one continues) resumes the same W&B and MLflow runs."""
    previous_record = previous_record or {}
    opened = {}
    for name in chosen(plan.report_to):
        extra = {"storage_path": os.path.dirname(folder)} if name == "mlflow" else {}  # (on a disk, beside the run)
        kwargs = dict(project=project_of(name, plan.tracker_project_name), run_name=plan.run_name,
                      settings=settings_of(plan.settings_toml), previous=previous_record.get(name), **extra)
        opened[name] = KINDS[name](folder, **({} if name == "tensorboard" else kwargs))
    record = {name: t.record for name, t in opened.items() if hasattr(t, "record")}
    if record:
        files.write_json(os.path.join(folder, runfiles.RECORD), record)
    return opened


def log_scores(record, step, scores, label):
    """evaluate.py's scores ({name: value}) into the W&B and MLflow runs a model's record names, at its
    final step; one line for each (a tracker whose package is missing is said and skipped)."""
    values = {f"eval/{k}": float(v) for k, v in scores.items() if v is not None}
    for name, run in (record or {}).items():
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            print(f"{label}'s scores not sent to {name}: pip install {package}", file=sys.stderr)
            continue
        if name == "wandb":  # (a resumed W&B run's steps go on after its last: the scores are its summary)
            tracker = WandB(run["dir"], run["project"], None, {}, previous=run)
            tracker.run.summary.update(values)
        else:
            tracker = MLflow(None, None, None, {}, previous=run)
            tracker.scalars(step, values)
        tracker.close()
        print(f"{label}'s scores added to its {name} run {run.get('id') or run.get('run_id')}", file=sys.stderr)

"""Ray for the suite's scripts: start a local cluster or join the one RAY_ADDRESS names (and only
that one), always with Ray's token authentication; the head a script or the test suite starts; the
cluster's resources (its quiet logs: raylogs)."""

import os
import re
import shutil
import sys
import tempfile

from dreambooth import errors
from dreambooth import files
from dreambooth import storage
from dreambooth.cluster import nodes
from dreambooth.cluster import raylogs


def ray_token_path():
    """The file Ray reads its authentication token from (RAY_AUTH_TOKEN_PATH, else Ray's documented
    ~/.ray/auth_token), or None when the token is in RAY_AUTH_TOKEN itself."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def ensure_ray_token():
    """Turn on Ray's token authentication for this process and the ones it starts, unless the user
    turned it off (RAY_AUTH_MODE=disabled), and make sure a token exists: the one already in
    RAY_AUTH_TOKEN or its file (reused, as `ray get-auth-token --generate` does), else a new random
    one in a file only its owner can read (Ray writes its own readable by every local user).

    Why a token even on one machine: Ray 2.60 cannot be bound to loopback (it replaces 127.0.0.1
    with the node's address and its servers listen on every interface, measured), so the token is
    what keeps another host, or another user of this one, from running code as you.
    Returns the token file, or None (token in RAY_AUTH_TOKEN, or authentication off)."""
    import secrets

    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray" in sys.modules:  # Ray read its settings when imported: have it read the mode again (as its
            from ray._raylet import Config  # own ray.init does when it turns token mode on by default)

            Config.initialize("")
    if os.environ["RAY_AUTH_MODE"].lower() != "token":
        return None
    path = ray_token_path()
    if path is None:
        return None
    if os.path.isfile(path):
        if os.stat(path).st_mode & 0o077:  # a token other local users can read protects nothing from them
            os.chmod(path, 0o600)
        return path
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:  # O_EXCL: never through a link planted at that name, never over a token another process just made
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, the form of Ray's own
    return path


def ray_auth_note():
    """How this process authenticates to Ray, in a few words for the line that names the cluster."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ("token authentication OFF (RAY_AUTH_MODE=" + os.environ.get("RAY_AUTH_MODE", "") +
                "): anyone who can reach this machine's Ray ports can run code as you")
    path = ray_token_path()
    return "token authentication, token in " + (path if path else "RAY_AUTH_TOKEN")


# With ray[default] installed (its prometheus_client), each node's dashboard agent and the head's
# dashboard and autoscaler monitor serve Prometheus metrics over HTTP on every interface, and no token is
# asked there: turned off for the clusters we start (a user who sets these variables gets Ray's behaviour).
# A port of -1: that server fails to start (a line in that process's own log) and the process goes on.
CLOSED_METRICS = {"RAY_enable_metrics_collection": "0", "AUTOSCALER_METRIC_PORT": "-1",
                  "DASHBOARD_METRIC_PORT": "-1"}


# Ray starts as many idle Python workers as the node has CPUs when a cluster's first driver connects: default
# workers, which never run a task of ours (our jobs carry a runtime environment: job_runtime_env), so each is a
# process started for nothing, 96 of them on a 96-CPU node. Off for the clusters we start (Ray's system config,
# which the nodes that join take from the head).
SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def head_start_options():
    """The options of `ray start --head` for a cluster of ours beside its port and temp folder (start_ray_head's and
    dreambooth_run.sh's): no usage statistics, no dashboard, SYSTEM_CONFIG."""
    import json

    return ["--disable-usage-stats", "--include-dashboard=false", f"--system-config={json.dumps(SYSTEM_CONFIG)}"]


def close_metrics_ports():
    """Ray's unauthenticated metrics servers off for a cluster this process starts (CLOSED_METRICS)."""
    for name, value in CLOSED_METRICS.items():
        os.environ.setdefault(name, value)


def closed_metrics_exports():
    """CLOSED_METRICS as bash export lines that keep a value already set (dreambooth_run.sh's own head)."""
    return "\n".join(f'export {name}="${{{name}:-{value}}}"' for name, value in CLOSED_METRICS.items())


# The trackers' own settings (W&B's, MLflow's), read where the trackers run, in rank 0's worker: a cluster started
# elsewhere does not have the shell's environment of the script.
TRACKER_VARIABLES = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY",
                     "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TRACKING_USERNAME",
                     "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def job_runtime_env():
    """The runtime environment of our Ray jobs: the project's code (the checkout as the working folder, or an
    installed package alone; none when a Ray Job's own runtime env ships it), the quiet-logs hook and the
    settings every worker needs."""
    code = ({"working_dir": files.REPO_DIR, "excludes": [".venv", "venv", ".git", "tests", "images", "benchmarks",
                                                         "**/__pycache__", "*.png", "*.jpg"]}
            if files.IN_CHECKOUT else {"py_modules": [files.PACKAGE_DIR], "excludes": ["**/__pycache__"]})
    runtime_env = {
        **code,
        "worker_process_setup_hook": "dreambooth.cluster.raylogs.quiet_ray_worker",
        "env_vars": {
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"],
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_DATA_LOG_LEVEL": os.environ["RAY_DATA_LOG_LEVEL"],
            "RAY_DATA_AUTOSCALING_REQUEST_EXPIRE_TIME_S": os.environ["RAY_DATA_AUTOSCALING_REQUEST_EXPIRE_TIME_S"],
            "RAY_USAGE_STATS_ENABLED": os.environ["RAY_USAGE_STATS_ENABLED"],
            # Ray Train routes a worker's print() through its logger and also to the original
            # stream: every line twice on the driver's terminal. Plain print is what we want.
            "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
            # transformers warns, in every process that imports diffusers, that torchvision is
            # missing for image processors we never use; errors still show.
            "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error"),
            # A bucket is reached from every worker as from here (credentials, profile, endpoint).
            **{name: os.environ[name] for name in storage.AWS_VARIABLES if name in os.environ},
            **{name: os.environ[name] for name in TRACKER_VARIABLES if name in os.environ},
            # torch's CPU threads where the user chose them (share_cpu_threads keeps them)
            **{name: os.environ[name] for name in ("OMP_NUM_THREADS",) if name in os.environ},
        },
    }
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # a Ray Job's driver: the job's runtime env ships the code
        for key in code:
            del runtime_env[key]
        # (and its OMP_NUM_THREADS is Ray's own, 1, its job supervisor's: not a choice of the user's)
        runtime_env["env_vars"].pop("OMP_NUM_THREADS", None)
    return runtime_env


def ray_settings():
    """Ray's settings for our scripts, in this process's environment (the user's own win), before Ray starts or is
    joined."""
    # Train's controller polls workers every 2 s by default, which adds ~1.5 s to
    # every ray.train.report; 0.2 s keeps reporting cheap.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    # Our excludes (job_runtime_env) name Ray's defaults (.git, .venv, ...); without this Ray warns about each.
    os.environ.setdefault("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", "")
    # Ray Data's INFO lines (each dataset's start, plan and finish) are for debugging Ray Data.
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")
    # No usage statistics from our jobs (the clusters we start are closed to the network; `ray start` gets
    # --disable-usage-stats): also spares every cluster Ray Data's usage-collection actor, a process of its own.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray Data's streams share the cluster through a coordinator that keeps a stream's request for 180 s: a stream
    # that died with its train worker kept its CPUs that long, and the restarted worker's stream, left none, spun and
    # trickled its batches (that run, and the next ones on the cluster, slowed down). A live stream renews its
    # request every 10 s (RAY_DATA_MIN_GAP_BETWEEN_AUTOSCALING_REQUESTS): 30 s frees a dead one's soon after.
    os.environ.setdefault("RAY_DATA_AUTOSCALING_REQUEST_EXPIRE_TIME_S", "30")
    # Ray colours the "(RayTrainWorker pid=...)" prefix of each worker line it prints here: only for a person
    # at a terminal, never into a log file or a pipe (and not with NO_COLOR set, the common convention).
    if os.environ.get("NO_COLOR") or not errors.on_terminal():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def init_ray():
    """Start a local Ray cluster of this script's own, or join the cluster RAY_ADDRESS names (and
    only then: never the one Ray's temp folder names, which any `ray start` on this node writes),
    with token authentication (ensure_ray_token); one line says which. The project's modules travel
    as the runtime environment's working_dir, the same mechanism a multi-node cluster needs; all
    paths passed to workers are absolute.
    """
    import ray

    ray_settings()
    if ray.is_initialized():
        return ray
    ensure_ray_token()
    raylogs.quiet_ray_logs()
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address:
        close_metrics_ports()
        # A cluster of this script's own is this machine alone and ends with the script: none of its nodes is ever
        # drained or preempted, so Ray Train's preemption watcher (an actor process a run) would watch nothing.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    try:
        if address:
            check_cluster(address)
        # "local": a new cluster even when Ray's temp folder names another (a script of the user's
        # running beside this one, or a cluster someone else pointed that world-writable file at)
        ray.init(address=address or "local", runtime_env=job_runtime_env(), log_to_driver=True, configure_logging=False,
                 include_dashboard=False, _system_config=None if address else SYSTEM_CONFIG)
    except (ConnectionError, ray.exceptions.AuthenticationError) as err:
        raise errors.UserError(f"could not join the Ray cluster at RAY_ADDRESS={address}: "
                               f"{errors.shorten(errors.one_line(err))} (a cluster with token authentication needs its "
                               f"token: RAY_AUTH_TOKEN, or the file ~/.ray/auth_token copied from its head)") from err
    raylogs.hide_harmless_ray_lines()
    # Once this script leaves Ray, a call of Ray's from a thread still running (a data stream that stalled, ended by
    # --stall_timeout) raises, instead of Ray's automatic ray.init() joining RAY_ADDRESS's cluster, or starting one,
    # as the script exits
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False
    where = ray.get_runtime_context().gcs_address
    if address:
        if os.environ.get("DREAMBOOTH_RAY_SAID") != address:  # (dreambooth_run.sh said it once for its steps)
            print(f"Ray: joined the cluster at {where} (RAY_ADDRESS); {ray_auth_note()}", file=sys.stderr)
            for host, folder, count in nodes.shared_temp_folders(ray.nodes()):
                print(f"note: {count} nodes of this cluster on {host} share one Ray temp folder ({folder}): Ray prints "
                      "each worker line once per node there; give each node of a machine a folder of its own (ray "
                      "start --temp-dir=…)", file=sys.stderr)
    else:
        print(f"Ray: started a local cluster for this script at {where} (set RAY_ADDRESS to use a running one); "
              f"{ray_auth_note()}", file=sys.stderr)
    return ray


def check_cluster(address, timeout=5):
    """At once, a UserError when nothing answers at a host:port RAY_ADDRESS (ray.init waits minutes there, a warning
    every 5 s), and Ray's AuthenticationError when its head refuses this machine's token (ray.init retries for 20 s
    first). Other forms of the address ("auto", ray://...) are left to ray.init."""
    import socket

    match = re.fullmatch(r"\[?([^\]/]+?)\]?:(\d+)", address)
    if not match:
        return
    try:
        socket.create_connection((match[1], int(match[2])), timeout=timeout).close()
    except OSError as err:
        raise errors.UserError(f"could not join the Ray cluster at RAY_ADDRESS={address}: nothing answers there "
                               f"({err.strerror or err}); is its head running, at that address?") from None
    import ray.exceptions
    from ray._raylet import GcsClient  # (Ray's own client: the token is checked as it connects)

    try:
        GcsClient(address=address)
    except ray.exceptions.RpcError as err:  # (something else listens there: no Ray head's GCS answered)
        raise errors.UserError(f"could not join the Ray cluster at RAY_ADDRESS={address}: no Ray head answers there "
                               f"({errors.shorten(errors.one_line(err))})") from None


# The ports a Ray node takes by default whatever --port says (its dashboard agent's HTTP server, the dashboard,
# GCS's default, Ray Client): a head started on one of them fails ("... is trying to use a port number 52365 that
# is used by other components"), and 52365 is in the system's range of free ports handed out.
RAY_DEFAULT_PORTS = frozenset({52365, 8265, 6379, 10001})


def free_port(pick=None):
    """A TCP port nothing listens on now, for a head of ours (dreambooth_run.sh's, the tests'), never one of
    RAY_DEFAULT_PORTS. pick: () -> a free port (default: the system's)."""
    import socket

    def system_port():
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    while (port := (pick or system_port)()) in RAY_DEFAULT_PORTS:
        pass
    return port


def start_ray_head(log_path, port=None, extra=(), env=None):
    """A local Ray cluster as dreambooth_run.sh starts one (`ray start --head --block` in the
    background, token authentication, its temp folder a private one so that its address is not
    published as this node's default, no 30 s drain when stopped), for the test suite and the
    benchmarks: (process, address for RAY_ADDRESS) once it is up; stop it with stop_ray_head.
    env: variables for the head's processes beyond this one's (RAY_TMPDIR among them: where its folder goes)."""
    import subprocess
    import time

    ensure_ray_token()
    close_metrics_ports()
    # A folder of its own in Ray's temp folder (RAY_TMPDIR, else /tmp; short: Ray's socket paths must fit
    # 108 characters)
    environ = dict(os.environ, **(env or {}), RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    temp_dir = tempfile.mkdtemp(prefix="dreambooth-ray-", dir=environ.get("RAY_TMPDIR") or "/tmp")
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", *head_start_options(),
               f"--temp-dir={temp_dir}"] + ([f"--port={port}"] if port else []) + list(extra)
    with open(log_path, "w") as log:
        head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environ)
    head.temp_dir = temp_dir
    deadline = time.time() + 120
    while "block forever" not in (text := open(log_path).read()):
        if head.poll() is not None or time.time() > deadline:
            head.kill()
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise RuntimeError(f"ray start failed ({log_path}): {text[-2000:]}")
        time.sleep(0.2)
    return head, re.search(r"ray start --address='([^']+)'", text)[1]


def stop_ray_head(head):
    """Stop a start_ray_head cluster and remove its temp folder."""
    head.terminate()
    head.wait(timeout=60)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def share_cpu_threads(processes_per_node, env_vars=None):
    """Give this process its share of the node's cores for torch's CPU kernels.

    Ray sets OMP_NUM_THREADS to a task's CPU reservation (a fraction becomes 1 thread);
    CPU workers and actors on one node share its cores instead, unless the user chose the count:
    OMP_NUM_THREADS where the script ran, which job_runtime_env hands to every worker
    (env_vars: those of the job, job_env_vars()).
    """
    import torch

    if "OMP_NUM_THREADS" in (job_env_vars() if env_vars is None else env_vars):
        return  # (torch read it at its start)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes_per_node))


def job_env_vars():
    """The environment variables our job hands its workers (job_runtime_env's env_vars), read in a Ray worker or
    driver; outside Ray, this process's environment."""
    import ray

    if not ray.is_initialized():
        return os.environ
    return ray.get_runtime_context().runtime_env.get("env_vars") or {}


def on_this_node():
    """A task's scheduling on the driver's node, where the run's files are (a bucket's run: this node's copies of
    its photos, and its own files before they are copied there)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def cluster_resources():
    """(CPUs, GPUs) of the Ray cluster this process is connected to."""
    import ray

    resources = ray.cluster_resources()
    return float(resources.get("CPU", 0)), int(resources.get("GPU", 0))

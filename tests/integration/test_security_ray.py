"""Ray closed to the network: every port of the session's head and of a script's own cluster refuses a caller without
the token; a script joins only the cluster it is given, never the one Ray's temp folder names; train flags reach
train.py as typed."""

import glob
import http.client
import os
import subprocess
import sys
import urllib.error
import urllib.request

from support import ray_temp

from dreambooth.cluster import raycluster
from dreambooth.files import REPO_DIR

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost")
# One real method of each kind of Ray gRPC server: a server checks the token before it runs a method
# it has, and answers UNIMPLEMENTED (not UNAUTHENTICATED) for one it lacks.
GRPC_METHODS = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetNodeStats",
                "/ray.rpc.CoreWorkerService/GetCoreWorkerStats", "/ray.rpc.ObjectManagerService/Pull",
                "/ray.rpc.RayletDriver/ClusterInfo",
                # (with ray[default]: each node's dashboard agent, and its event aggregator)
                "/ray.rpc.ReporterService/GetTraceback", "/ray.rpc.events.EventAggregatorService/AddEvents")


def node_address():
    """This machine's address as another host reaches it (what Ray itself advertises)."""
    import ray._private.services

    return ray._private.services.get_node_ip_address()


def listening_ports(pids):
    """[(host, port, process name)] of the TCP ports that the processes pids listen on (ss)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        owners = " ".join(fields[5:])
        if not any(f"pid={pid}," in owners for pid in pids):
            continue
        host, port = fields[3].rsplit(":", 1)
        found.append((host.strip("[]"), int(port), owners.split('"')[1] if '"' in owners else "?"))
    return found


def answer_without_token(address, port):
    """What a port answers a caller with no token: 'refused' (a gRPC UNAUTHENTICATED or HTTP 401),
    or what it answered instead."""
    import grpc

    answers = []
    with grpc.insecure_channel(f"{address}:{port}") as channel:
        for method in GRPC_METHODS:
            try:
                channel.unary_unary(method)(b"", timeout=5)
                return f"{method} answered"
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                    return "refused"
                answers.append(f"{method}: {err.code().name}")
    try:  # Ray's HTTP servers (the runtime-env agent)
        urllib.request.urlopen(f"http://{address}:{port}/", timeout=5)
        answers.append("HTTP 200")
    except urllib.error.HTTPError as err:
        if err.code == 401:
            return "refused"
        answers.append(f"HTTP {err.code}")
    except (OSError, http.client.HTTPException) as err:  # (a gRPC-only port answers HTTP/1 with HTTP/2 frames)
        answers.append(f"HTTP: {type(err).__name__}")
    return "; ".join(answers)


def assert_closed_without_token(root_pids):
    """Every port the Ray processes under root_pids listen on is on loopback or refuses a caller
    with no token, reached through this machine's network address as another host would."""
    import psutil

    pids = set()
    for pid in root_pids:
        process = psutil.Process(pid)
        pids |= {pid, *(child.pid for child in process.children(recursive=True))}
    ports = listening_ports(pids)
    names = {name for _, _, name in ports}
    assert {"gcs_server", "raylet"} <= names, ports  # the cluster's own servers were found
    address = node_address()
    open_ports = [(host, port, name, answer) for host, port, name in ports if host not in LOOPBACK
                  for answer in [answer_without_token(address, port)] if answer != "refused"]
    assert open_ports == [], open_ports
    return ports


def test_a_scripts_own_cluster_opens_no_port_without_the_token(tmp_path):
    """A script run with no RAY_ADDRESS starts a cluster of its own (raycluster.init_ray): tried as an
    attacker on the network would, no port of it lets a caller without the token in."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    code = ("import os, sys, time; from dreambooth.cluster import raycluster; ray = raycluster.init_ray(); "
            "pids = ray.get([ray.remote(lambda: (time.sleep(0.5), os.getpid())[1]).remote() for _ in range(2)]); "
            "print('READY', ray._private.worker._global_node.get_session_dir_path(), "
            "ray.get_runtime_context().get_job_id(), os.environ['RAY_TRAIN_ENABLE_PREEMPTION_WATCHER'], *pids, "
            "flush=True); "
            "sys.stdin.read()")
    script = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_DIR, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, session, job, watcher, *pids = script.stdout.readline().split()
        assert ready == "READY", script.stderr.read()[-2000:]
        assert watcher == "0"  # (one node, gone with the script: Ray Train's preemption watcher left out of its runs)
        ports = assert_closed_without_token([script.pid])
        assert len(ports) >= 4  # GCS, the raylet's two, a worker's
        # Ray's worker processes were all the job's: none started idle, of no job, for the first driver
        # (raycluster.SYSTEM_CONFIG; Ray's default starts one per CPU, which never runs a task of a job with a
        # runtime environment)
        started = [name.split("-")[2:] for name in os.listdir(os.path.join(session, "logs"))
                   if name.startswith("worker-") and name.endswith(".out")]
        assert {j for j, _ in started} == {job} and set(pids) <= {p.split(".")[0] for _, p in started}, (started, job)
    finally:
        script.stdin.close()
        script.wait(timeout=60)
    said = script.stderr.read()
    assert "Ray: started a local cluster for this script at" in said
    assert f"token authentication, token in {os.environ['RAY_AUTH_TOKEN_PATH']}" in said
    assert open(os.environ["RAY_AUTH_TOKEN_PATH"]).read() not in said  # the token itself is never shown


def test_the_shared_head_opens_no_port_without_the_token(ray_session, shared_ray_cluster):
    """The head dreambooth_run.sh starts for its steps (raycluster.start_ray_head is the same command),
    with this process joined to it as a driver: no port without the token."""
    import psutil

    host, port = shared_ray_cluster.rsplit(":", 1)
    heads = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
             if p.info["cmdline"] and "start" in p.info["cmdline"] and f"--port={port}" in p.info["cmdline"]]
    assert len(heads) == 1
    assert_closed_without_token([heads[0], os.getpid()])
    # and its address is not published where a later plain ray.init() on this node would find it
    for current in glob.glob(os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "ray_current_cluster")):
        assert open(current).read().strip() != shared_ray_cluster


def test_a_script_never_joins_the_cluster_named_in_rays_temp_folder(shared_ray_cluster, toy_images, tmp_path):
    """Ray's temp folder (world-writable /tmp/ray) names a running cluster, here the session's: a
    script given no RAY_ADDRESS starts its own instead of joining it, and says so."""
    temp = ray_temp()  # Ray's temp folder of this test's own
    try:
        os.makedirs(os.path.join(temp, "ray"))
        with open(os.path.join(temp, "ray", "ray_current_cluster"), "w") as f:
            f.write(shared_ray_cluster)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["RAY_TMPDIR"] = temp
        proc = subprocess.run([sys.executable, "preflight.py", "--photos_dir", toy_images, "--class_name", "toy",
                               "--data_prefix", str(tmp_path), "--tiny"], cwd=REPO_DIR, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Ray: started a local cluster for this script at" in proc.stderr
        assert shared_ray_cluster.rsplit(":", 1)[1] not in proc.stderr.split("started a local cluster")[1].split()[4]
        # told an address, it joins that one, and says so
        proc = subprocess.run([sys.executable, "preflight.py", "--photos_dir", toy_images, "--class_name", "toy",
                               "--data_prefix", str(tmp_path), "--tiny"], cwd=REPO_DIR,
                              env=dict(env, RAY_ADDRESS=shared_ray_cluster), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"Ray: joined the cluster at {shared_ray_cluster} (RAY_ADDRESS)" in proc.stderr
    finally:
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def test_train_args_reach_train_py_as_typed_never_as_file_names(tmp_path, toy_images):
    """TRAIN_ARGS is split as a shell splits words (a quoted prompt with commas is one word) and never
    glob-expanded: '*.md' is refused as the flag it is, before Step 1, not sent as this folder's files."""
    env = dict(os.environ, PYTHON=sys.executable, DATA_PREFIX=str(tmp_path), TRAIN_ARGS="--seed 1 *.md")
    proc = subprocess.run(["bash", "dreambooth_run.sh", "--tiny"], cwd=REPO_DIR, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "*.md" in output and "README.md" not in output
    assert "Step 1" not in output  # refused at Step 0
    env["TRAIN_ARGS"] = "--validation_prompt 'a unqtkn toy, on a beach *' --seed"
    proc = subprocess.run(["bash", "dreambooth_run.sh", "--tiny"], cwd=REPO_DIR, env=env, capture_output=True,
                          text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "--seed" in output.splitlines()[-1] and "Step 1" not in output
    env["TRAIN_ARGS"] = "--validation_prompt 'unclosed"
    proc = subprocess.run(["bash", "dreambooth_run.sh", "--tiny"], cwd=REPO_DIR, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "TRAIN_ARGS has an unclosed quote" in proc.stderr


def test_a_script_without_the_clusters_token_is_refused_in_one_line(shared_ray_cluster, toy_images, tmp_path):
    """Another token than the cluster's (a worker machine whose token file was not copied): one line
    naming the cluster and where the token goes, no traceback; an address where nothing listens (a mistyped
    port): one line at once, where ray.init would wait for minutes. (Ray retried the refused token for 20 s.)"""

    def preflight(address, **env):
        proc = subprocess.run([sys.executable, "preflight.py", "--photos_dir", toy_images, "--class_name", "toy",
                               "--data_prefix", str(tmp_path), "--tiny"], cwd=REPO_DIR, capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, RAY_ADDRESS=address, **env))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        return proc.stderr.strip().splitlines()[-1]

    last = preflight(shared_ray_cluster, RAY_AUTH_TOKEN="0" * 64)
    assert last.startswith(f"error: could not join the Ray cluster at RAY_ADDRESS={shared_ray_cluster}: ")
    assert "needs its token: RAY_AUTH_TOKEN, or the file ~/.ray/auth_token" in last
    nowhere = f"127.0.0.1:{raycluster.free_port()}"
    assert preflight(nowhere) == f"error: could not join the Ray cluster at RAY_ADDRESS={nowhere}: nothing answers " \
                                 "there (Connection refused); is its head running, at that address?"



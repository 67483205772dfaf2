"""Serve every trained subject over HTTP from one pool of replicas (Ray Serve).

Each base model is loaded once per replica; each subject's adapters (LoRA, DoRA, LoHa, LoKr) are attached to it
as requests for that subject arrive, up to --adapters_per_replica a replica, and requests are routed to a replica
that already holds their subject. A full fine-tune is a model of its own. A subject that finishes training while
this runs is served at once; one retrained is served with its new model as soon as it is saved.

    python serve.py --data_prefix "$DATA_PREFIX"
    curl -s localhost:8000/v1/subjects
    curl -s localhost:8000/v1/images -H 'Accept: image/png' -o dog.png \\
        -d '{"subject": "example-dog", "prompt": "a photo of unqtkn dog, on the beach", "seed": 1}'

POST /v1/images takes {subject, prompt, seed, steps, guidance_scale, width, height, n}: image i of a request is
generate.py's image i of that prompt with --seed seed (the prompt names the subject's token, as in generate.py);
the answer is JSON with base64 PNGs, or the PNG itself with 'Accept: image/png' (n = 1). GET /healthz answers a
load balancer. The server listens on 127.0.0.1 unless --host says otherwise; --api_key (or DREAMBOOTH_API_KEY)
makes every request carry 'Authorization: Bearer <key>'. It joins only the Ray cluster RAY_ADDRESS names.
Ctrl-C stops it.
"""

import hashlib
import ipaddress
import os
import socket
import sys
import time

from dreambooth import errors
from dreambooth import storage
from dreambooth.config import flags
from dreambooth.serving import catalog

SUBJECTS = "subjects"  # under DATA_PREFIX, as dreambooth_run.sh writes them
FLAG_NAMES = ["serve_data_prefix", "host", "port", "api_key", "adapters_per_replica", "min_replicas", "max_replicas",
              "gpus_per_replica", "max_images_per_request", "max_batch_size", "rescan_interval", "safety_checker"]


def parse_args(argv=None):
    """serve.py's flags, with DATA_PREFIX and DREAMBOOTH_API_KEY where the flags leave them out; the parser's error
    (exit 2) for flags that cannot work together."""
    parser = flags.make_parser(__doc__.splitlines()[0], FLAG_NAMES, helps={
        "safety_checker": "Run the model's safety checker (if it has one) on every image; a flagged image is withheld "
                          "(auto and on: on, as generate.py does for a trained model)."})
    args = parser.parse_args(argv)
    args.data_prefix = args.data_prefix or (flags.storage_location(os.environ["DATA_PREFIX"])
                                            if os.environ.get("DATA_PREFIX") else None)
    args.api_key = args.api_key or os.environ.get("DREAMBOOTH_API_KEY") or None
    if not args.data_prefix:
        parser.error("--data_prefix is required (or set DATA_PREFIX): where dreambooth_run.sh wrote the subjects")
    if args.max_replicas < args.min_replicas:
        parser.error(f"--max_replicas {args.max_replicas} is below --min_replicas {args.min_replicas}")
    if args.port > 65535:
        parser.error(f"--port {args.port}: a TCP port is at most 65535")
    return args


def main(argv=None):
    args = parse_args(argv)
    root = storage.join(args.data_prefix, SUBJECTS)
    if not storage.isdir(root):
        raise errors.UserError(f"{root} does not exist: --data_prefix (or DATA_PREFIX) is where dreambooth_run.sh "
                               f"wrote the subjects, each in {root}/<SUBJECT>/model-tuned")
    from dreambooth.cluster import raycluster

    raycluster.init_ray()
    errors.stop_on_sigterm()  # (ray.init put Ray's own handler in its place)
    from ray import serve

    from dreambooth.serving import app

    gpus = raycluster.cluster_resources()[1]
    if args.gpus_per_replica and args.gpus_per_replica > gpus:
        raise errors.UserError(f"--gpus_per_replica {args.gpus_per_replica:g}: the Ray cluster has " + (
            f"{gpus} GPU(s): ask for at most {gpus}" if gpus else "no GPU (leave it out to draw on CPUs)"))
    start_serve(args.host, args.port)
    settings = app.ServeSettings(
        root, args.adapters_per_replica, args.min_replicas, args.max_replicas,
        args.gpus_per_replica if args.gpus_per_replica is not None else (1 if gpus else 0),
        args.max_images_per_request, args.max_batch_size, safety_checker=args.safety_checker != "off",
        api_key_sha256=key_hash(args.api_key))
    bases = Bases(settings)
    try:  # (from here on, a stop takes down what this run deployed on a cluster of the user's)
        serve.run(app.Ingress.bind(settings), name=app.INGRESS_APP, route_prefix="/", logging_config=app.QUIET)
        bases.update(catalog.scan(root, details=False))
        print(reach_line(args.host, args.port, bool(args.api_key)), file=sys.stderr, flush=True)
        found = len(catalog.subject_names(root))
        print(f"serving the {found} subject(s) in {root} (new ones as they are saved); Ctrl-C stops" if found else
              f"serving the subjects in {root} as they are saved (none yet); Ctrl-C stops", file=sys.stderr,
              flush=True)
        while True:
            time.sleep(args.rescan_interval)
            bases.update(catalog.scan(root, details=False))
    finally:
        if os.environ.get("RAY_ADDRESS", "").strip():  # (a cluster of this script's own goes with it)
            bases.close()


class Bases:
    """The base models' Serve applications serve.py has deployed ({base_key: base model}), kept to what the subjects
    need; one that failed to start is tried again only when its subjects change."""

    def __init__(self, settings):
        self.settings, self.deployed, self.failed, self.said, self.deploying = settings, {}, {}, {}, None

    def update(self, subjects):
        import ray
        from ray import serve

        from dreambooth.serving import app

        wanted = {}
        for subject in subjects.values():
            wanted.setdefault(subject.base_key, (subject.base_model, []))[1].append(subject)
        for key, (base, served) in wanted.items():
            names = ", ".join(subject.name for subject in served)
            ids = tuple(sorted(subject.routing_id for subject in served))
            if key in self.deployed or self.failed.get(key) == ids:
                continue
            if not storage.is_remote(base) and not storage.isdir(base):
                self.fail(key, ids, names, f"its base model {base} is not on this node")
                continue
            short = self.short_of(base, ray.available_resources())
            if short:  # (tried again at the next look: a replica of another base may have gone, a node come)
                self.fail(key, None, names, short)
                continue
            print(f"loading {base} for {names}", file=sys.stderr, flush=True)
            began = time.perf_counter()
            self.deploying = key  # (taken down by close too, if a stop comes while it loads)
            try:
                serve.run(app.painter_app(self.settings, base), name=key, route_prefix=None, logging_config=app.QUIET)
            except Exception as err:  # (its replicas failed to start: the others keep being served)
                self.fail(key, ids, names,
                          f"its base model {base} did not load: {errors.shorten(errors.one_line(err))}")
                serve.delete(key, _blocking=False)
                self.deploying = None
                continue
            self.deployed[key], self.deploying = base, None
            self.failed.pop(key, None)
            self.said.pop(key, None)
            app.mark_not_served(key, None)
            print(f"ready in {time.perf_counter() - began:.1f} s: {names}", file=sys.stderr, flush=True)
        for key in [key for key in self.deployed if key not in wanted]:  # (a full model saved anew, a subject gone)
            serve.delete(key, _blocking=False)
            del self.deployed[key]

    def fail(self, key, ids, names, why):
        """A base model's application that could not be deployed: said here (once), and to its subjects' requests.
        ids: its subjects' routing ids (tried again when they change), None: tried again at every look."""
        from dreambooth.serving import app

        if self.said.get(key) != why:
            print(f"not served: {names} ({why})", file=sys.stderr, flush=True)
            self.said[key] = why
        if ids is not None:
            self.failed[key] = ids
        app.mark_not_served(key, why)

    def short_of(self, base, free):
        """Why the cluster cannot place --min_replicas replicas of base with free ({resource: amount} it has free now),
        or None: never a deployment that waits for room without a word."""
        gpus, count = self.settings.gpus_per_replica, self.settings.min_replicas
        kind, need = ("GPU", gpus * count) if gpus else ("CPU", count)
        if free.get(kind, 0) + 1e-9 >= need:
            return None
        return (f"{count} replica(s) of {base} need {need:g} {kind}(s) and the cluster has {free.get(kind, 0):g} free: "
                "fewer base models at once, or more nodes")

    def close(self, wait_s=60):
        """Our applications taken down, and Serve itself where no other application is left (on a cluster of the
        user's, Serve goes on serving others'). A stop never waits on Serve for more than wait_s: what is left is
        said in one line, and Serve goes on taking it down."""
        import threading

        said = []
        closing = threading.Thread(target=self.take_down, args=(said,), name="serve-close", daemon=True)
        closing.start()
        closing.join(wait_s)
        if closing.is_alive():
            said.append(f"note: Ray Serve had not taken down this run's applications after {wait_s} s; it goes on "
                        "doing so on the cluster")
        for line in said:
            print(line, file=sys.stderr, flush=True)

    def take_down(self, said):
        from ray import serve

        from dreambooth.serving import app

        try:
            for key in self.said:
                app.mark_not_served(key, None)
            for key in dict.fromkeys([*self.deployed, *([self.deploying] if self.deploying else []), app.INGRESS_APP]):
                serve.delete(key)
            if not serve.status().applications:
                serve.shutdown()
        except Exception as err:  # (Ray gone already: Ctrl-C reached its processes too)
            said.append(f"note: Ray Serve was not stopped cleanly ({errors.shorten(errors.one_line(err))})")


def start_serve(host, port):
    """Ray Serve started on the cluster, its HTTP server on the head node at host:port; where it runs already (another
    serve.py's, or the user's), a UserError unless it listens there."""
    import logging

    from ray import serve
    from ray.serve.context import _get_global_client

    from dreambooth.serving.app import QUIET

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # (this process's own INFO lines of Serve)

    client = _get_global_client(raise_if_no_controller_running=False)
    running = client.http_config if client is not None else None
    if running is not None:
        if (running.host, running.port) != (host, port):
            raise errors.UserError(f"Ray Serve already runs on this cluster, listening on {running.host}:{running.port}"
                                   f"; it cannot move to {host}:{port}: pass --host {running.host} --port "
                                   f"{running.port}, or stop it first (serve shutdown)")
        return
    check_port(host, port)
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port}, logging_config=QUIET)


def check_port(host, port):
    """A UserError now when host:port cannot be listened on (taken, or not an address of this machine)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        raise errors.UserError(f"cannot listen on {host}:{port} ({err.strerror or err}): pick another --port, or "
                               "stop what uses it") from None


def key_hash(api_key):
    """What the ingress keeps of the API key (None: no key asked): its SHA-256, never the key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else None


def reach_line(host, port, keyed):
    """One line saying where the API is and who can reach it."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if host in ("0.0.0.0", "::"):  # (every interface: shown by the address others reach this machine at)
        host = this_machine()
    shown = f"[{host}]" if ":" in host else host
    key = " Every request must carry the API key (Authorization: Bearer)." if keyed else ""
    if loopback:
        return (f"API at http://{shown}:{port}/v1/images: this machine only (--host 0.0.0.0 opens it to the "
                f"network).{key}")
    return (f"API at http://{shown}:{port}/v1/images: anyone who can reach this machine on port {port} can draw with "
            "these subjects" + (f".{key}" if keyed else "; no key is asked (--api_key or DREAMBOOTH_API_KEY)."))


def this_machine():
    """The address other hosts reach this machine at (Ray's own choice of it)."""
    try:
        import ray._private.services

        return ray._private.services.get_node_ip_address()
    except Exception:  # (no route out: the name of the machine)
        return socket.gethostname()

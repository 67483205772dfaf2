"""serve.py's Ray Serve applications: one ingress that answers HTTP (the API, the key, the subjects' lookup), and one
application per base model whose replicas keep the base loaded and hold up to K subjects' adapters each, routed there
by Serve's model multiplexing (a request carries its subject's routing id) and drawn in batches (Serve's batching).

    POST /v1/images   {"subject", "prompt", "seed", "steps", "guidance_scale", "width", "height", "n"} -> PNGs
    GET  /v1/subjects what can be served
    GET  /healthz     for a load balancer (no key asked)
"""

import asyncio
import contextvars
import dataclasses
import hashlib
import hmac
import json
import os
import shutil
import tempfile
import time

from ray import serve

from dreambooth import errors
from dreambooth.serving import catalog
from dreambooth.serving import requests
from dreambooth.serving.requests import RequestError

INGRESS_APP = "dreambooth"
ROUTES = {"/v1/images": "POST", "/v1/subjects": "GET, HEAD", "/healthz": "GET, HEAD"}  # path: its methods
ASKING = contextvars.ContextVar("asking", default=None)  # the request a replica is answering (in its own task)
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Serve's logging: no line per request, no INFO


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """serve.py's settings that its deployments read (each flag's help says what it does)."""

    subjects_dir: str
    adapters_per_replica: int = 4
    min_replicas: int = 1
    max_replicas: int = 1
    gpus_per_replica: float = 0
    max_images_per_request: int = 4
    max_batch_size: int = 4
    batch_wait_s: float = 0.05
    safety_checker: bool = True
    api_key_sha256: str | None = None  # the key's hash: the key itself is never in Serve's config
    request_timeout_s: float = 300


def painter_app(settings, base_model):
    """The Serve application of one base model (a full model's folder is one): its Painter deployment bound."""
    return painter_deployment(settings).bind(base_model, settings)


def painter_deployment(settings):
    """Painter as a deployment for settings: K adapters a replica (Serve's multiplexing), requests in batches (Serve's
    batching), replicas scaled on the queue, GPUs as asked (a CPU replica reserves a CPU)."""
    autoscaling = {"min_replicas": settings.min_replicas, "max_replicas": settings.max_replicas,
                   "initial_replicas": settings.min_replicas, "target_ongoing_requests": 2}

    class Deployed(Painter):  # (each wrapped method under its own name: Serve finds `self` by it)
        load_adapter = serve.multiplexed(max_num_models_per_replica=settings.adapters_per_replica)(Painter.load_adapter)
        draw_batch = serve.batch(max_batch_size=settings.max_batch_size,
                                 batch_wait_timeout_s=settings.batch_wait_s)(Painter.draw_batch)

    return serve.deployment(name="Painter", autoscaling_config=autoscaling, max_ongoing_requests=16,
                            ray_actor_options={"num_gpus": settings.gpus_per_replica,
                                               "num_cpus": 0 if settings.gpus_per_replica else 1})(Deployed)


class Painter:
    """A replica: the base pipeline loaded once (painter.SharedBase), subjects' adapters attached and evicted by Serve's
    multiplexing (the least recently used goes: load_adapter), requests drawn one batch at a time (draw_batch). Both
    are wrapped by painter_deployment with the settings' sizes."""

    def __init__(self, base_model, settings):
        from dreambooth import machine
        from dreambooth.cluster import raycluster
        from dreambooth.serving import painter

        device = machine.torch_device()
        if device.type == "cpu":
            raycluster.share_cpu_threads(1)
        self.settings = settings
        self.base = painter.SharedBase(base_model, device, settings.safety_checker)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.held = tempfile.mkdtemp(prefix="dreambooth-serve-")
        self.loads, self.evicted, self.drawing = {}, [], asyncio.Lock()

    async def load_adapter(self, routing_id):
        """The subject routing_id names, attached to the base (a private copy of its adapters): a painter.Adapter."""
        name, model_id = catalog.split_routing_id(routing_id)
        subject = await asyncio.to_thread(catalog.find, self.settings.subjects_dir, name, False)
        if subject is None:
            raise RequestError(404, f"no subject {name!r} in {self.settings.subjects_dir}")
        if subject.model_id != model_id:
            raise RequestError(409, f"{name} was saved again; ask again")
        into = os.path.join(self.held, f"{name}-{model_id}-{time.monotonic_ns()}")
        adapter = await asyncio.to_thread(self.base.attach, subject, into)
        adapter.evicted = self.evicted  # (Serve calls its __del__ as it evicts it)
        adapter.loaded_for = ASKING.get()  # (the request that waited for this load; others found it held)
        self.loads[routing_id] = self.loads.get(routing_id, 0) + 1
        return adapter

    async def draw(self, request):
        """A request (requests.ImageRequest) of the subject Serve routed here: (pngs, flagged, served), or (None, None,
        {"error": (status, line, retry after)}) for one refused (returned, not raised: a refusal is an answer, not a
        failure of the replica for Serve to log)."""
        routing_id, asking = serve.get_multiplexed_model_id(), object()
        ASKING.set(asking)
        began = time.perf_counter()
        try:
            adapter = await self.load_adapter(routing_id)
            self.base.check(request)
            answer = await self.draw_batch((adapter, request))
            if isinstance(answer, RequestError):
                raise answer
        except RequestError as err:
            return None, None, {"error": (err.status, err.message, err.retry_after)}
        pngs, flagged, together = answer
        loaded = adapter.folder is not None and adapter.loaded_for is asking  # (a full model has no adapters)
        return pngs, flagged, {"replica": self.replica, "adapter_loaded": loaded, "drawn_together": together,
                               "seconds": round(time.perf_counter() - began, 3),
                               "replica_loads": sum(self.loads.values()), "replica_evictions": len(self.evicted)}

    async def draw_batch(self, items):
        """[(Adapter, ImageRequest)] drawn in one go (Serve's batch): one batch at a time on the base, whose weights
        hold one subject's adapters at a time."""
        async with self.drawing:
            return await asyncio.to_thread(self.base.draw, items)

    def __del__(self):
        shutil.rmtree(getattr(self, "held", ""), ignore_errors=True)


@serve.deployment(name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0})
class Ingress:
    """The HTTP API: checks the key, reads the subject's record (its base model and model id now) and hands the
    request to its base's application with the subject's routing id."""

    def __init__(self, settings):
        self.settings, self.handles = settings, {}

    def handle(self, name, key):
        """The handle of the base model's application key (kept once found); RequestError 503 while serve.py has not
        deployed it yet, or with the reason it could not."""
        if key not in self.handles:
            try:
                self.handles[key] = serve.get_app_handle(key)
            except Exception:
                why = not_served(key)
                raise RequestError(503, f"{name}: " + (f"not served ({why})" if why else "its base model is being "
                                                       "loaded; ask again in a few seconds"), retry_after=5) from None
        return self.handles[key]

    async def __call__(self, request):
        from starlette.responses import JSONResponse
        from starlette.responses import Response

        try:
            return await self.answer(request)
        except RequestError as err:
            headers = {"Retry-After": str(err.retry_after)} if err.retry_after else {}
            if err.status == 401:
                headers["WWW-Authenticate"] = "Bearer"
            if err.status == 405:
                headers["Allow"] = ROUTES[request.url.path.rstrip("/")]
            return JSONResponse({"error": err.message}, status_code=err.status, headers=headers or None)
        except Exception as err:  # (one line for the caller; the traceback in the replica's log)
            return Response(json.dumps({"error": f"internal error: {errors.shorten(errors.one_line(err))}"}),
                            status_code=500, media_type="application/json")

    async def answer(self, request):
        from starlette.responses import JSONResponse
        from starlette.responses import Response

        path, method = request.url.path.rstrip("/") or "/", request.method
        if path in ROUTES and method not in ROUTES[path].split(", "):
            raise RequestError(405, f"{method} {path}: use {ROUTES[path]}")
        if path == "/healthz":
            return Response("ok\n", media_type="text/plain")
        self.check_key(request.headers.get("authorization", ""))
        if path == "/v1/subjects":
            found = await asyncio.to_thread(catalog.scan, self.settings.subjects_dir)
            return JSONResponse({"subjects": [subject.describe() for subject in found.values()]})
        if path == "/v1/images":
            asked = requests.parse_image_request(await request.body(), self.settings.max_images_per_request,
                                                 request.headers.get("accept", ""))
            pngs, flagged, served = await self.draw(asked)
            if asked.response_format == "png":
                if flagged[0]:
                    raise RequestError(422, "the image was flagged by the model's safety checker and is withheld")
                return Response(pngs[0], media_type="image/png",
                                headers={f"x-{key.replace('_', '-')}": value if isinstance(value, str) else
                                         json.dumps(value) for key, value in served.items()})
            return JSONResponse(requests.images_json(asked.subject, pngs, flagged, served))
        raise RequestError(404, f"no such path {path}: POST /v1/images, GET /v1/subjects, GET /healthz")

    def check_key(self, header):
        want = self.settings.api_key_sha256
        if want is None:
            return
        scheme, _, key = header.partition(" ")
        given = hashlib.sha256(key.strip().encode()).hexdigest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, want):
            raise RequestError(401, "this server asks for its API key: 'Authorization: Bearer <key>'")

    async def draw(self, asked, tries=2):
        """The request drawn by its subject's base application: (pngs, flagged, served); the subject looked up again
        when it was saved anew meanwhile."""
        for attempt in range(tries):
            subject = await asyncio.to_thread(catalog.find, self.settings.subjects_dir, asked.subject, False)
            if subject is None:  # (or its folder being replaced by a new save, missing for an instant)
                await asyncio.sleep(0.2)
                subject = await asyncio.to_thread(catalog.find, self.settings.subjects_dir, asked.subject, False)
            if subject is None:
                raise RequestError(404, f"no subject {asked.subject!r}: GET /v1/subjects lists them")
            handle = self.handle(asked.subject, subject.base_key)
            try:
                response = handle.options(multiplexed_model_id=subject.routing_id).draw.remote(asked)
                pngs, flagged, served = await asyncio.wait_for(response, self.settings.request_timeout_s)
                if "error" in served:
                    raise RequestError(*served["error"])
                return pngs, flagged, {**served, "model_id": subject.model_id}
            except asyncio.TimeoutError:
                raise RequestError(503, f"{asked.subject}: no answer in {self.settings.request_timeout_s:g} s; ask "
                                        "again", retry_after=5) from None
            except Exception as err:
                cause = cause_of(err)
                if isinstance(cause, RequestError):
                    if cause.status == 409 and attempt + 1 < tries:
                        continue
                    raise cause from None
                self.handles.pop(subject.base_key, None)  # (found again: its application may be gone)
                raise RequestError(503, f"{asked.subject}: the replica drawing it stopped "
                                        f"({errors.shorten(errors.one_line(cause))}); ask again",
                                   retry_after=5) from None
        raise RequestError(503, f"{asked.subject} is being saved again; ask again", retry_after=5)


def cause_of(err):
    """The exception a replica raised, out of Ray's wrapping of it."""
    seen = set()
    while getattr(err, "cause", None) is not None and id(err) not in seen:
        seen.add(id(err))
        err = err.cause
    return err


NOT_SERVED = "dreambooth-serve"  # Ray's key-value store's namespace of the base models serve.py could not deploy


def mark_not_served(key, why):
    """Say (why: one line) or unsay (None) that the base model's application key could not be deployed: the ingress
    answers its subjects with that line."""
    from ray.experimental import internal_kv

    if why:
        internal_kv._internal_kv_put(key, why.encode(), namespace=NOT_SERVED)
    else:
        internal_kv._internal_kv_del(key, namespace=NOT_SERVED)


def not_served(key):
    """The line mark_not_served left for key, or None."""
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(key, namespace=NOT_SERVED)
    return value.decode() if value else None

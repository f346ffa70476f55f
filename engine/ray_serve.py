"""Scale-out on Ray Serve: N engine replicas, a document kept on one replica, a dead replica's work redone.

- ``EngineReplica`` (a Serve deployment) holds one engine (``make_engine``: a ``LocalEngine`` today;
  any object with the engine interface of engine/api.py will do) and streams its deltas.
- Routing: Ray Serve's consistent-hash router keyed on the request's ``session_id``, which
  ``RayEngine`` sets to the document key (``"<session id>\\x00<uri>"``, engine/process.py's
  ``document_id``). A document's requests, pre-warms and ``forget`` therefore reach the same replica
  and its KV cache stays warm; replicas coming and going move only their own documents.
- ``RayEngine`` is the client side, with the same calls as ``EngineProcess``: whatever serves editors
  (``fimble lsp``, the ``fimble serve`` daemon) uses it as its engine. A request whose replica died
  (killed, crashed node) is sent again; Serve replaces the replica and the router sends the document
  to a live one, which prefills it. Text already delivered is not repeated: greedy decoding gives
  the same text again (lossless), and only what follows it is passed on.

Ray is an optional dependency (``pip install '.[ray]'``): this module imports it only when used.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.api import CompletionRequest, CompletionResult, CompletionStream, Delta, Unwatched
from engine.errors import FimbleError

log = logging.getLogger(__name__)

APP = "fimble"
DEPLOYMENT = "EngineReplica"
ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
# Sends of one request to replicas that keep dying, and the wait before each: about 20 s in all, time
# for Serve to see the death and for the router to drop the replica from its ring.
RETRY_BACKOFF_S = (0.0, 0.25, 0.5, 1.0, 2.0, 2.0, 4.0, 4.0, 4.0)
RETRIES = len(RETRY_BACKOFF_S)


@dataclass(frozen=True)
class RayOptions:
    """What ``fimble serve --ray`` deploys."""

    replicas: int = 2
    address: str | None = None  # a running cluster ("auto", "ray://host:10001"); None: a local ray.init()
    engine: dict = field(default_factory=dict)  # make_engine's keyword arguments (model, draft, device, ...)
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    max_ongoing: int = 64  # per replica: above it the router would send a document elsewhere
    local_cpus: int | None = None  # num_cpus of a local ray.init() (None: Ray counts them)


def _require_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise FimbleError("--ray needs Ray Serve: pip install 'fimble[ray]' (or pip install 'ray[serve]')") from None
    return ray, serve


def make_engine(engine: dict) -> Any:
    """The engine a replica runs: ``fimble serve``'s batching engine (engine/serve/scheduler.py), its decode
    loop in a thread of its own (a replica's main thread is Ray's), or with ``kind: local`` a LocalEngine."""
    common = {"device": engine.get("device", "cpu"), "use_draft": not engine.get("no_draft", False)}
    threads = engine.get("threads") or None
    if engine.get("kind", "serve") == "local":
        from engine.local import open_engine

        if threads:
            import torch

            torch.set_num_threads(int(threads))
        return open_engine(engine.get("model"), engine.get("draft"), start_thread=True, **common)
    from engine.serve.scheduler import open_serve_engine

    served = open_serve_engine(
        engine.get("model"),
        engine.get("draft"),
        batch=engine.get("batch", True),
        max_active=engine.get("max_active", 64),
        threads=threads,
        kv_budget_bytes=engine.get("kv_budget_bytes"),
        **common,
    )
    threading.Thread(target=served.serve_forever, name="fimble-replica-engine", daemon=True).start()
    return served


class EngineReplica:
    """One engine in a Serve replica. Every message it yields names the replica (for affinity checks)."""

    def __init__(self, engine: dict):
        from ray import serve

        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        import ray

        self.actor_name = ray.get_runtime_context().get_actor_name()
        self.engine = make_engine(engine)
        self.documents: dict[str, int] = {}  # document key -> requests served here

    async def generate(self, request: dict):
        from engine.wire import request_from_dict

        try:
            req = request_from_dict(request)
        except (TypeError, KeyError, ValueError) as exc:
            yield {"replica": self.replica_id, "delta": asdict(Delta("", True, "error", f"bad request: {exc}"))}
            return
        key = req.document_id or ""
        self.documents[key] = self.documents.get(key, 0) + 1
        stream = self.engine.submit(req)
        finished = False
        try:
            async for delta in _deltas(stream):
                finished = delta.finished
                msg = {"replica": self.replica_id, "delta": asdict(delta)}
                if finished and stream.result is not None:
                    msg["result"] = asdict(stream.result)
                yield msg
        finally:
            if not finished:  # the caller went away (Serve cancels this generator): stop the decode
                stream.cancel()

    def prewarm(self, request: dict) -> None:
        from engine.wire import request_from_dict

        self.engine.prewarm(request_from_dict(request))

    def forget(self, document_id: str) -> None:
        self.documents.pop(document_id, None)
        self.engine.forget(document_id)

    def counters(self, document_id: str | None = None) -> dict:
        out = {"replica": self.replica_id, "actor": self.actor_name, "pid": os.getpid(), **self.engine.counters()}
        out["documents"] = len(self.documents)
        if document_id is not None:
            out["document_requests"] = self.documents.get(document_id, 0)
        return out

    def info(self) -> dict:
        return {"replica": self.replica_id, **self.engine.info()}

    def __del__(self) -> None:
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()


async def _deltas(stream: CompletionStream):
    """A stream's deltas with errors as deltas (they cross to the client as data, not exceptions)."""
    try:
        async for delta in stream:
            yield delta
    except FimbleError as exc:
        yield Delta("", True, "error", str(exc), type(exc).__name__)


def deploy(options: RayOptions) -> Any:
    """Start (or join) the cluster and deploy the replicas; returns the deployment's handle."""
    ray, serve = _require_ray()
    from ray.serve.config import ProxyLocation, RequestRouterConfig

    if not 1 <= options.replicas <= 1024:
        raise FimbleError("--replicas must be from 1 to 1024")
    if not ray.is_initialized():
        kwargs: dict = {"include_dashboard": False, "log_to_driver": False}
        if options.address:
            kwargs["address"] = options.address
        elif options.local_cpus:
            kwargs["num_cpus"] = options.local_cpus
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise FimbleError(f"could not start or join the Ray cluster: {str(exc).splitlines()[0][:200]}") from None
    # Serve logs every deployment step at INFO in this process: quiet unless fimble's own log level asks.
    quiet = logging.getLogger().getEffectiveLevel() > logging.INFO
    if quiet:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    logs = {"log_level": "WARNING" if quiet else "INFO"}
    serve.start(proxy_location=ProxyLocation.Disabled, logging_config=logs)  # editors reach replicas by handle
    deployment = serve.deployment(
        EngineReplica,
        name=DEPLOYMENT,
        num_replicas=options.replicas,
        max_ongoing_requests=options.max_ongoing,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER,
            # No fallback: a busy replica queues the request (the engine orders its own queue) rather
            # than sending the document to a replica whose cache does not hold it.
            request_router_kwargs={"num_virtual_nodes": 100, "num_fallback_replicas": 0},
        ),
    )
    return serve.run(deployment.bind(options.engine), name=APP, route_prefix=None, logging_config=logs)


def _is_replica_death(exc: BaseException) -> bool:
    """A failure that sending the request to another replica can fix (the replica, not the request)."""
    from ray import exceptions as rex

    kinds = tuple(
        k
        for k in (
            getattr(rex, n, None)
            for n in (
                "RayActorError",
                "ActorDiedError",
                "ActorUnavailableError",
                "ActorUnschedulableError",
                "WorkerCrashedError",
                "NodeDiedError",
                "OwnerDiedError",
            )
        )
        if k
    )
    return isinstance(exc, kinds)


class RayEngine(Unwatched):
    """The replicas as one ``Engine`` (engine/api.py): submit, cancel, prewarm, forget, counters. Nothing to watch
    here (``Unwatched``): Ray replaces replicas that die."""

    error: str | None = None  # replicas die and are replaced; this engine stays up

    def __init__(self, handle: Any, replicas: int = 0):
        self._handle = handle
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._counters = {"submitted": 0, "completed": 0, "cancelled": 0, "errors": 0, "replica_retries": 0}
        self._info = {"backend": "ray-serve", "app": APP, "replicas": replicas}
        self._closed = threading.Event()
        self.started_at = time.monotonic()

    @classmethod
    def deploy(cls, options: RayOptions) -> RayEngine:
        engine = cls(deploy(options), options.replicas)
        try:  # the model's facts, from any replica (the daemon announces and reports them)
            engine._info.update(
                {
                    k: v
                    for k, v in engine._handle.info.remote().result(timeout_s=120).items()
                    if k not in ("replica", "backend")
                }
            )
        except Exception as exc:  # the deployment is up; its info is only for show
            log.warning("could not read a replica's info: %s", type(exc).__name__)
        return engine

    def info(self) -> dict:
        return dict(self._info)

    def _routed(self, document_id: str | None) -> Any:
        # Requests without a document hash on a fresh id: spread over the replicas.
        return self._handle.options(session_id=document_id or f"anon-{next(self._ids)}")

    # -- Engine API ------------------------------------------------------------------------
    def submit(self, request: CompletionRequest, on_delta=None) -> CompletionStream:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        rid = next(self._ids)
        call = _RayCall(self, request)
        stream = CompletionStream(rid, loop, on_delta, on_cancel=call.cancel)
        call.stream = stream
        self._count("submitted")
        threading.Thread(target=call.run, name=f"fimble-ray-{rid}", daemon=True).start()
        return stream

    def prewarm(self, request: CompletionRequest) -> None:
        self._routed(request.document_id).prewarm.remote(request.to_dict())

    def forget(self, document_id: str) -> None:
        self._routed(document_id).forget.remote(document_id)

    def counters(self, timeout: float = 5.0) -> dict:
        with self._lock:
            return dict(self._counters)

    def replica_counters(self, document_id: str, timeout: float = 30.0) -> dict:
        """The counters of the replica that serves ``document_id`` (its id, its requests for the document)."""
        return self._routed(document_id).counters.remote(document_id).result(timeout_s=timeout)

    def serve_forever(self) -> None:
        """Block until close() (the daemon's main thread; the decoding happens in the replicas)."""
        while not self._closed.wait(0.5):  # (a timed wait: signals still reach the main thread)
            pass
        try:  # here, not in close(): close() runs in a signal handler, where calling into Ray may hang
            _require_ray()[1].delete(APP)
        except Exception as exc:
            log.warning("could not remove the Ray Serve app: %s", type(exc).__name__)

    def close(self) -> None:
        self._closed.set()  # the deployment outlives this client; shutdown() ends it

    def _count(self, key: str) -> None:
        with self._lock:
            self._counters[key] += 1


class _RayCall:
    """One request: stream it from its document's replica; on a replica's death, send it again."""

    def __init__(self, engine: RayEngine, request: CompletionRequest):
        self.engine, self.request = engine, request
        self.stream: CompletionStream | None = None
        self._cancel = threading.Event()
        self._gen: Any = None
        self.sent = ""  # text already pushed to the caller
        self.replicas: list[str] = []  # replicas that served (or began to serve) this request

    def cancel(self) -> None:
        self._cancel.set()
        gen = self._gen
        if gen is not None:
            gen.cancel()  # Serve cancels the replica's generator, which cancels the decode

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # never a traceback into the editor
            log.exception("ray completion failed")
            self._end(Delta("", True, "error", f"Ray Serve: {type(exc).__name__}: {str(exc)[:200]}"))

    def _run(self) -> None:
        body = self.request.to_dict()
        last = ""
        for attempt in range(RETRIES):
            if self._cancel.is_set():
                return self._end(Delta("", True, "cancelled"))
            time.sleep(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)])
            text = ""  # this attempt's text
            try:
                self._gen = self.engine._routed(self.request.document_id).options(stream=True).generate.remote(body)
                for msg in self._gen:
                    if not self.replicas or self.replicas[-1] != msg["replica"]:
                        self.replicas.append(msg["replica"])
                    delta = Delta(**msg["delta"])
                    text += delta.text
                    if not self._pass_on(text, delta):
                        return self._end(Delta("", True, "stop"))  # a retry that began to differ: keep what was shown
                    if delta.finished:
                        result = msg.get("result")
                        if result is not None and self.stream is not None:
                            self.stream.result = CompletionResult(
                                **{
                                    **result,
                                    "stats": {**result["stats"], "replica": msg["replica"], "attempts": attempt + 1},
                                }
                            )
                        return self._end(delta, pushed=True)
                last = "the replica's stream ended without a last delta"
            except Exception as exc:
                if self._cancel.is_set() or _is_cancelled(exc):
                    return self._end(Delta("", True, "cancelled"))
                if not _is_replica_death(exc):
                    raise
                last = f"{type(exc).__name__}"
            self.engine._count("replica_retries")
            log.warning("replica died serving a request (%s); sending it again", last)
        self._end(Delta("", True, "error", f"Ray Serve: no replica could serve the request ({last})"))

    def _pass_on(self, text: str, delta: Delta) -> bool:
        """Push what ``text`` adds beyond what was already sent; False if it disagrees with it."""
        if not text.startswith(self.sent[: len(text)]):
            return False
        new = text[len(self.sent) :]
        if new or delta.finished:
            assert self.stream is not None
            if delta.finished:
                self.sent += new
                return True  # the last delta (with the new text) is pushed by _end
            self.stream.push(Delta(new))
            self.sent += new
        return True

    def _end(self, delta: Delta, pushed: bool = False) -> None:
        stream = self.stream
        assert stream is not None
        if pushed:  # the replica's last delta: its text beyond what was sent
            delta = Delta(self.sent[len(stream.text) :], True, delta.finish_reason, delta.error, delta.error_type)
        key = {"error": "errors", "cancelled": "cancelled"}.get(delta.finish_reason or "", "completed")
        self.engine._count(key)
        stream.push(delta)


def _is_cancelled(exc: BaseException) -> bool:
    from ray import exceptions as rex

    return isinstance(
        exc,
        tuple(k for k in (getattr(rex, "TaskCancelledError", None), getattr(rex, "RequestCancelledError", None)) if k),
    ) or type(exc).__name__ in ("RequestCancelledError", "TaskCancelledError", "CancelledError")


def shutdown() -> None:
    ray, serve = _require_ray()
    serve.shutdown()
    ray.shutdown()


def open_ray_engine(args: Any) -> RayEngine:
    """``fimble serve --ray``'s engine, from its command line (options checked here, before Ray starts)."""
    if not 1 <= args.replicas <= 1024:
        raise FimbleError("--replicas must be from 1 to 1024")
    if not 0 <= args.replica_cpus <= 1024 or not 0 <= args.replica_gpus <= 64:
        raise FimbleError("--replica-cpus must be from 0 to 1024 and --replica-gpus from 0 to 64")
    if args.ray_address is not None and not 0 < len(args.ray_address) <= 500:
        raise FimbleError("--ray-address must be 1-500 characters")
    _require_ray()
    engine = {
        "model": args.model,
        "draft": args.draft,
        "device": args.device,
        "no_draft": args.no_draft,
        "batch": not args.no_batch,
        "max_active": args.max_active,
        "threads": args.threads or None,
        "kv_budget_bytes": args.kv_budget_mb << 20 if args.kv_budget_mb else None,
    }
    return RayEngine.deploy(
        RayOptions(
            replicas=args.replicas,
            address=args.ray_address,
            engine=engine,
            replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus,
        )
    )

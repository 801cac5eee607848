"""kvserve as a Ray Serve application: N replicas, each a full server (engine + OpenAI app).

    HTTP -> Ray Serve proxy -> KVServeIngress --(DeploymentHandle, PrefixAffinityRouter)--> KVServeReplica x N
                                    |  GET /metrics                                          | pushes its /metrics
                                    +-------------------> KVServeMetrics <-------------------+

`KVServeIngress` is a thin proxy: it reads the request, hashes the prompt's first characters
(`server.ray_router`) and forwards method, path, headers and body to a replica, whose own
FastAPI app (`server.app.create_app`, the same one `kvserve serve` runs) answers, streaming
included. The router sends a request to the replica that served its prefix (prefix cache hits)
unless that one is busy. `/metrics` answers every live replica's `kvserve:` metrics, each
sample labelled `replica`. Python entry: `build_app`; `serve run`/KubeRay: `app_builder`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvserve.server.config import ServerConfig
from kvserve.server.errors import error_body, error_bytes
from kvserve.server.ray_options import RayServeOptions
from kvserve.server.ray_router import ROUTED_PATHS, PrefixAffinity, prefix_hashes, routing_text
from kvserve.server.streaming import DONE_EVENT, sse_event

logger = logging.getLogger("kvserve.ray")

METRICS_PUSH_INTERVAL_S = 1.0
METRICS_STALE_AFTER_S = 10.0  # a replica silent this long is gone from /metrics
REPLICA_HEADER = "x-kvserve-replica"  # which replica answered (debugging, tests)
_HOP_BY_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve's side of `server.ray_router.PrefixAffinity`: queue lengths come from Serve's
    cache (probed when missing); the prefix hashes from the request's `prefix_hashes` kwarg.
    The state lives in the router's process (the ingress): one ingress replica sees it all."""

    def initialize_state(self, max_imbalance: int, max_entries: int = 100_000) -> None:
        self._affinity = PrefixAffinity(max_imbalance=max_imbalance, max_entries=max_entries)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        queue_lens: dict[ReplicaID, int | None] = {}
        missing = []
        for replica in candidate_replicas:
            queue_lens[replica.replica_id] = self._replica_queue_len_cache.get(replica.replica_id)
            if queue_lens[replica.replica_id] is None:
                missing.append(replica)
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                queue_lens[replica.replica_id] = queue_len
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        hashes = _hashes_of(pending_request)
        ranks = self._affinity.rank(list(by_id), queue_lens, hashes)
        if hashes and ranks:
            # Recorded now (Serve takes the first of the first rank unless it is full), so that
            # a burst of requests sharing a new prefix does not spread before the first is sent.
            self._affinity.record(hashes, ranks[0][0])
        return [[by_id[replica_id] for replica_id in rank] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self._affinity.record(_hashes_of(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._affinity.forget(replica_id)


def _hashes_of(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None:
        return []
    return list(pending_request.kwargs.get("prefix_hashes") or ())


class KVServeReplica:
    """One full kvserve server (AsyncLLM engine core + the OpenAI FastAPI app), fed raw HTTP
    requests by the ingress through the app's ASGI interface."""

    async def __init__(
        self, config: ServerConfig, metrics_sink: DeploymentHandle[Any] | None = None
    ) -> None:
        from kvserve.server.app import create_app

        self._app = create_app(config)
        self._lifespan = self._app.router.lifespan_context(self._app)
        await self._lifespan.__aenter__()  # builds the engine and waits until it is ready
        self._is_dead = False
        self._app.state.request_exit = self._mark_dead
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._background: set[asyncio.Task[Any]] = set()
        self._sink = metrics_sink
        if metrics_sink is not None:
            self._spawn(self._push_metrics())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _mark_dead(self) -> None:
        """The app found its engine dead: fail the health check so Serve replaces this replica."""
        self._is_dead = True

    def check_health(self) -> None:
        if self._is_dead or not self._app.state.kv.engine.is_healthy:
            raise RuntimeError("the kvserve engine of this replica is dead")

    async def _push_metrics(self) -> None:
        while True:
            try:
                text = self._app.state.kv.metrics.render().decode()
                await self._sink.push.remote(self.replica_id, text)
            except Exception:  # the sink restarting: try again next time
                logger.debug("metrics push failed", exc_info=True)
            await asyncio.sleep(METRICS_PUSH_INTERVAL_S)

    async def handle_http(
        self, request: dict[str, Any], prefix_hashes: list[int] | None = None
    ) -> AsyncIterator[dict[str, Any] | bytes]:
        """Run one HTTP request through the app: yields {status, headers}, then body chunks."""
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        left = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            messages.put_nowait(message)

        task = asyncio.get_running_loop().create_task(self._app(_scope(request), receive, send))
        self._background.add(task)
        task.add_done_callback(lambda t: (self._background.discard(t), messages.put_nowait(None)))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [
                        (k.decode("latin-1"), v.decode("latin-1"))
                        for k, v in message.get("headers", ())
                        if k.lower() not in _HOP_BY_HOP
                    ]
                    yield {
                        "status": message["status"],
                        "headers": headers + [(REPLICA_HEADER, self.replica_id)],
                    }
                elif message["type"] == "http.response.body":
                    body, is_last = _coalesce(message, messages)
                    if body:
                        yield body
                    if is_last:
                        break
        finally:
            left.set()  # the client left (or the response is done): the app aborts what is still running

    async def __del__(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self._lifespan.__aexit__(None, None, None)


def _coalesce(
    message: dict[str, Any], messages: asyncio.Queue[dict[str, Any] | None]
) -> tuple[bytes, bool]:
    """This body message and the ones already queued behind it, as one chunk: under load a
    stream then crosses to the ingress once per engine step or so, not once per SSE event."""
    parts = [message.get("body", b"")]
    is_last = not message.get("more_body", False)
    while not is_last and not messages.empty():
        queued = messages.get_nowait()
        if queued is None or queued["type"] != "http.response.body":
            messages.put_nowait(queued)  # (only None can follow the body: the app finished)
            break
        parts.append(queued.get("body", b""))
        is_last = not queued.get("more_body", False)
    return b"".join(parts), is_last


def _scope(request: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request["method"],
        "scheme": "http",
        "path": request["path"],
        "raw_path": request["path"].encode(),
        "query_string": request["query_string"],
        "root_path": "",
        "client": request.get("client"),
        "server": None,
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
    }


def merge_replica_metrics(texts: Mapping[str, str]) -> bytes:
    """One Prometheus exposition of several replicas' /metrics, every sample labelled `replica`."""
    families: dict[str, Metric] = {}
    for replica_id, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            for sample in family.samples:
                merged.add_sample(
                    sample.name,
                    {**sample.labels, "replica": replica_id},
                    sample.value,
                    sample.timestamp,
                )

    class _Families:
        def collect(self) -> Any:
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families())
    return generate_latest(registry)


class KVServeMetrics:
    """The replicas' latest /metrics texts (pushed every second), served merged by the ingress."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}

    def push(self, replica_id: str, text: str) -> None:
        self._texts[replica_id] = (time.monotonic(), text)

    def render(self) -> bytes:
        now = time.monotonic()
        self._texts = {
            r: (t, text) for r, (t, text) in self._texts.items() if now - t < METRICS_STALE_AFTER_S
        }
        return merge_replica_metrics({r: text for r, (_, text) in self._texts.items()})


class KVServeIngress:
    """The HTTP entry: forwards each request to a replica (routed by its prompt's prefix)."""

    def __init__(
        self, replicas: DeploymentHandle[Any], metrics: DeploymentHandle[Any], max_body_bytes: int
    ) -> None:
        self._replicas = replicas.options(stream=True)
        self._metrics = metrics
        self._max_body_bytes = max_body_bytes

    async def __call__(self, http_request: Request) -> Response:
        path = http_request.url.path
        if http_request.method == "GET" and path == "/metrics":
            return Response(
                await self._metrics.render.remote(), media_type="text/plain; version=0.0.4"
            )
        if int(http_request.headers.get("content-length") or 0) > self._max_body_bytes:
            return _error(
                413, f"request body is larger than {self._max_body_bytes} bytes", "body_too_large"
            )
        body = await http_request.body()
        if len(body) > self._max_body_bytes:
            return _error(
                413, f"request body is larger than {self._max_body_bytes} bytes", "body_too_large"
            )
        hashes = (
            _request_hashes(body) if http_request.method == "POST" and path in ROUTED_PATHS else []
        )
        request = {
            "method": http_request.method,
            "path": path,
            "query_string": http_request.url.query.encode(),
            "headers": list(http_request.headers.items()),
            "body": body,
            "client": list(http_request.client) if http_request.client else None,
        }
        stream = self._replicas.handle_http.remote(request, prefix_hashes=hashes)
        try:
            start = await stream.__anext__()
        except Exception as exc:  # the replica died (or was cancelled) before answering
            logger.warning("replica failed before answering %s: %r", path, exc)
            return _error(
                503, "the replica serving this request failed; retry the request", "replica_failed"
            )
        headers = dict(start["headers"])
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                _relay_stream(stream), status_code=start["status"], headers=headers
            )
        try:
            content = b"".join([chunk async for chunk in stream])
        except Exception as exc:
            logger.warning("replica failed while answering %s: %r", path, exc)
            return _error(
                503, "the replica serving this request failed; retry the request", "replica_failed"
            )
        return Response(content, status_code=start["status"], headers=headers)


def _request_hashes(body: bytes) -> list[int]:
    try:
        return prefix_hashes(routing_text(json.loads(body)))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return []  # not JSON: the replica answers the 400


async def _relay_stream(stream: Any) -> AsyncIterator[bytes]:
    """The SSE body; a replica that dies mid-stream ends it with an error event, like any failure."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception as exc:
        logger.warning("replica failed mid-stream: %r", exc)
        yield sse_event(
            error_body(
                "the replica serving this request failed", "server_error", code="replica_failed"
            )
        ).encode()
        yield DONE_EVENT.encode()


def _error(status: int, message: str, code: str) -> Response:
    return Response(
        error_bytes(status, message, code), status_code=status, media_type="application/json"
    )


def build_app(config: ServerConfig, options: RayServeOptions | None = None) -> serve.Application:
    """The bound Serve application (for `serve.run`, or to compose into your own Serve app)."""
    options = options or RayServeOptions()
    tp = int(getattr(config, "tensor_parallel_size", 1) or 1)
    num_gpus = options.num_gpus_per_replica
    if num_gpus is None:
        num_gpus = float(tp) if _uses_cuda(config.device) else 0.0
    actor_options: dict[str, Any] = {"num_cpus": options.num_cpus_per_replica, "num_gpus": num_gpus}
    if not num_gpus and options.num_cpus_per_replica >= 1:
        # torch's CPU threads (the engine core inherits them) = the CPUs Ray gave the replica
        actor_options["runtime_env"] = {
            "env_vars": {"OMP_NUM_THREADS": str(int(options.num_cpus_per_replica))}
        }
    max_ongoing = options.max_ongoing_requests or config.max_num_seqs
    log_level = config.log_level.upper()  # --log-level applies to Serve's logs of these deployments
    replica_settings: dict[str, Any] = {
        "ray_actor_options": actor_options,
        "max_ongoing_requests": max_ongoing,
        "health_check_period_s": 2.0,
        "graceful_shutdown_timeout_s": 5.0,
        "logging_config": {"log_level": log_level},
    }
    if options.is_autoscaling:
        replica_settings["autoscaling_config"] = AutoscalingConfig(
            min_replicas=options.min_replicas if options.min_replicas is not None else 1,
            max_replicas=options.max_replicas
            if options.max_replicas is not None
            else max(options.num_replicas, 1),
            initial_replicas=options.num_replicas,
            target_ongoing_requests=options.target_ongoing_requests or max(1, max_ongoing // 4),
        )
    else:
        replica_settings["num_replicas"] = options.num_replicas
    if options.routing == "prefix":
        replica_settings["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"max_imbalance": options.max_imbalance},
        )
    metrics = serve.deployment(
        KVServeMetrics,
        name="KVServeMetrics",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        logging_config={"log_level": log_level, "enable_access_log": False},
    ).bind()
    replicas = serve.deployment(KVServeReplica, name="KVServeReplica", **replica_settings).bind(
        config, metrics
    )
    ingress = serve.deployment(
        KVServeIngress,
        name="KVServeIngress",
        num_replicas=options.num_ingress_replicas,
        max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0},
        logging_config={"log_level": log_level},
    )
    return ingress.bind(replicas, metrics, int(config.max_body_bytes))


def _uses_cuda(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For `serve run kvserve.server.ray_serve:app_builder model=... num_replicas=2` and KubeRay's
    RayService (`import_path` + `args`): `ServerConfig` fields and `RayServeOptions` fields,
    as strings or values (both are read as the flags are)."""
    from kvserve.server.ray_options import RayOptions

    names = set(RayOptions.model_fields)
    options = RayOptions(**{k: v for k, v in args.items() if k in names})
    config = ServerConfig(**{k: v for k, v in args.items() if k not in names})
    return build_app(config, options.to_dataclass())

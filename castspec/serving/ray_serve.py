"""castspec on Ray Serve: engine replicas behind one OpenAI-compatible ingress (`castspec serve-ray`).

Three deployments make the application:
- `EngineReplica` (N of them, or autoscaled): one engine, one continuous-batching scheduler and the very app of
  `castspec serve` (server.create_app) on a loopback port of the replica's own process. A request reaches it as
  raw HTTP (method, path, body) and goes through that app, so routes, validation, error messages and SSE are
  those of `castspec serve` by construction; the replica streams the answer back event by event.
- `Ingress` (the HTTP entry, FastAPI behind Serve's proxy): relays each request to a replica through a
  DeploymentHandle. It holds back what a replica sends until the first event that carries a token (or the end):
  if the replica's process dies before that, nothing was streamed and the request is retried on another replica;
  after that, the stream gets an error event and ends. Serve's controller restarts the dead replica.
  Serve's router balances load (power of two choices), or with `--routing prefix` sends a request to the replica
  that served the longest start of its prompt (Ray's PrefixCacheAffinityRouter), so that a conversation's next
  turn finds its earlier turns in that replica's prefix cache, balancing only where loads differ by a batch.
- `Board`: each replica reports its metrics snapshot every REPORT_PERIOD_S; the ingress's /metrics and /health
  add them up over all replicas.

This is the only module that imports ray, so the plain install never needs it.
"""
import asyncio
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field

import httpx
import ray
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

try:
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter
except ImportError:  # that package imports ray[llm]'s extras (pyarrow), the router itself needs none (ray is pinned)
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

from ..engine import load
from .frontend import ServerConfig
from .live import KEEP_ALIVE_S, LOOPBACK, LiveServer
from .metrics import prometheus
from .protocol import ApiError, error_response
from .scheduler import SchedulerConfig
from .server import create_app, read_body

log = logging.getLogger("castspec.ray")

APP_NAME = "castspec"
REPORT_PERIOD_S = 0.5
STALE_AFTER_S = 5.0  # a replica silent this long no longer counts as live in /health
REPLICA_HEADER = "x-castspec-replica"
ATTEMPTS_HEADER = "x-castspec-attempts"
# the replica died, or Serve could not reach it: nothing of the request's answer exists anywhere any more
REPLICA_LOST = (RayActorError, ReplicaUnavailableError)
ROUTINGS = ("prefix", "balance")


@dataclass
class ReplicaOptions:
    """What every engine replica loads and runs: the model and scheduler options of `castspec serve`."""

    target: str | None = None
    drafter: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    method: str = "cast"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    threads: int = 1  # torch threads per replica (one per CPU the replica reserves)


@dataclass
class ScaleConfig:
    """How many replicas, on what, and how the ingress retries."""

    replicas: int = 1
    min_replicas: int | None = None  # both set: autoscaling between them instead of a fixed `replicas`
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0  # autoscaling: ongoing requests per replica Serve aims for
    upscale_delay_s: float | None = None  # autoscaling: how long load must call for more replicas (None: Serve's)
    downscale_delay_s: float | None = None  # ... and for fewer
    cpus_per_replica: float = 1.0
    gpus_per_replica: float | None = None  # None: one per replica on CUDA, none on the CPU (replica_gpus)
    attempts: int = 4  # replicas a request may be tried on before the ingress answers 503
    router_queue: int = 64  # requests waiting in Serve's router for a free replica slot, beyond that 429
    # "balance": Serve's power of two choices; "prefix": to the replica that served the longest start of the prompt
    # (its prefix cache holds it) while the replicas' ongoing requests differ by at most one batch. Not the default:
    # Serve's router learns replicas' loads late, and a burst piles up on one replica more often than it does now
    routing: str = "balance"

    def __post_init__(self):
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both --min-replicas and --max-replicas (autoscaling) or neither")
        if self.autoscaling and not (0 <= self.min_replicas <= self.max_replicas and self.max_replicas >= 1):
            raise ValueError("autoscaling needs 0 <= min-replicas <= max-replicas and max-replicas >= 1")
        if self.replicas < 1 or self.cpus_per_replica < 0 or (self.gpus_per_replica or 0) < 0 or self.attempts < 1:
            raise ValueError("replicas and attempts must be >= 1; CPUs and GPUs per replica >= 0")
        if self.target_ongoing_requests <= 0 or self.router_queue < 0:
            raise ValueError("the target of ongoing requests must be > 0 and the router queue >= 0")
        if any(d is not None and d < 0 for d in (self.upscale_delay_s, self.downscale_delay_s)):
            raise ValueError("the upscale and downscale delays must be >= 0 seconds")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r} (choose from {', '.join(ROUTINGS)})")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None


def replica_gpus(device: str, gpus: float | None) -> float:
    """The GPUs one replica reserves for `device`: as given, else one on CUDA and none on the CPU.

    Ray hides every GPU from an actor that reserves none (CUDA_VISIBLE_DEVICES is empty there), and shows one that
    reserves some only those, numbered from 0: a CUDA replica without GPUs, or one asking for a device number it
    cannot see, would fail in every replica after the cluster started, so both are refused here."""
    cuda = re.fullmatch(r"cuda(?::(\d+))?", device)
    if gpus is None:
        return 1.0 if cuda else 0.0
    if cuda and gpus == 0:
        raise ValueError(f"--device {device} needs --gpus-per-replica > 0: Ray hides the GPUs from a replica "
                         "that reserves none")
    if cuda and cuda.group(1) is not None and int(cuda.group(1)) >= math.ceil(gpus):
        raise ValueError(f"--device {device}: a replica sees only the {math.ceil(gpus)} GPU(s) it reserves, "
                         "numbered from 0 (use --device cuda)")
    return float(gpus)  # GPUs with another device: reserved (say, to place replicas on GPU nodes), unused


def engine_options(options: ReplicaOptions, scale: ScaleConfig) -> dict:
    """The options of the EngineReplica deployment (Deployment.options): resources, replica count or autoscaling,
    and how many requests a replica and Serve's router take."""
    sched = options.scheduler
    out = dict(ray_actor_options={"num_cpus": scale.cpus_per_replica,
                                  "num_gpus": replica_gpus(options.device, scale.gpus_per_replica)},
               # a replica takes what its scheduler batches and queues; Serve's router holds the rest
               max_ongoing_requests=sched.max_batch + sched.max_queue, max_queued_requests=scale.router_queue)
    if scale.autoscaling:
        auto = {"min_replicas": scale.min_replicas, "max_replicas": scale.max_replicas,
                "target_ongoing_requests": scale.target_ongoing_requests}
        for key in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(scale, key) is not None:
                auto[key] = getattr(scale, key)
        out["autoscaling_config"] = auto
    else:
        out["num_replicas"] = scale.replicas
    if scale.routing == "prefix":
        # the router keeps a tree of the prompts it routed (evicted past its default size) and matches each new
        # one against it; imbalanced_threshold is in ongoing requests per replica
        out["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixCacheAffinityRouter,
            request_router_kwargs={"imbalanced_threshold": sched.max_batch, "do_eviction": True})
    return out


@dataclass(frozen=True)
class RoutingKey:
    """The text Ray's PrefixCacheAffinityRouter matches (it reads a `prompt` attribute from a call's arguments,
    and sends a request to the replica that served the longest start of it). Built so that a request that extends
    another's prompt extends its text: a conversation's messages each end with a record separator (the next turn
    starts with the turn before), token ids each end with a space ("3 4 " starts "3 4 5 ", not "3 45 "). No JSON
    around them: text every request shares would count as a match."""

    prompt: str

    @classmethod
    def of(cls, path: str, body: bytes) -> "RoutingKey":
        try:
            obj = json.loads(body) if body else None
        except ValueError:  # the replica answers 400 for it; any replica will do
            obj = None
        text = ""
        if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            text = "".join(_text(m.get("content") if isinstance(m, dict) else m) + "\x1e" for m in obj["messages"])
        elif isinstance(obj, dict):
            prompt = obj.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]  # a batch of prompts: the first
            text = prompt if isinstance(prompt, str) else (
                "".join(f"{t} " for t in prompt) if isinstance(prompt, list) else "")
        return cls(text or path)


def _text(content) -> str:
    return content if isinstance(content, str) else json.dumps(content)


def commits(event: str) -> bool:
    """True for an SSE event that carries a token, a finish reason or an error: once one reached the client,
    the request can no longer move to another replica."""
    if not event.startswith("data: ") or event.strip() == "data: [DONE]":
        return False
    obj = json.loads(event[len("data: "):])
    if "error" in obj:
        return True
    return any(c.get("text") or (c.get("delta") or {}).get("content") or c.get("finish_reason")
               for c in obj.get("choices", []))


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  logging_config={"enable_access_log": False})
class Board:
    """The latest metrics snapshot of every replica that ever reported (a dead replica's counters still count)."""

    def __init__(self):
        self.reports: dict[str, dict] = {}

    def report(self, replica: str, report: dict) -> None:
        self.reports[replica] = {**report, "seen": time.time()}

    def collect(self) -> dict[str, dict]:
        return self.reports


@serve.deployment
class EngineReplica:
    """One engine + scheduler + `castspec serve`'s app on a loopback port of this process."""

    def __init__(self, options: ReplicaOptions, board):
        torch.set_num_threads(max(1, options.threads))
        engine = load(target=options.target, drafter=options.drafter, device=options.device, dtype=options.dtype)
        self.scheduler = engine.scheduler(options.scheduler, options.method)
        self.server = LiveServer(create_app(engine, self.scheduler, options.server))
        self.url = self.server.__enter__()
        self.id = serve.get_replica_context().replica_id.unique_id
        self.node = ray.util.get_node_ip_address()
        self.board = board
        self.client: httpx.AsyncClient | None = None  # made on first use, on the loop that serves requests
        self.stop = threading.Event()
        threading.Thread(target=self._report_loop, name="castspec-report", daemon=True).start()

    def _report_loop(self) -> None:
        """Report what this replica's own /metrics says (JSON), so the ingress sums what `castspec serve` shows."""
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.stop.wait(REPORT_PERIOD_S):
                try:
                    snap = client.get("/metrics", params={"format": "json"}).json()
                    self.board.report.remote(self.id, {"pid": os.getpid(), "node": self.node, "metrics": snap})
                except Exception:  # noqa: BLE001 - the board restarting, or a slow answer: the next report goes through
                    log.debug("castspec: metrics report failed", exc_info=True)

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica."""
        if not self.server.thread.is_alive():
            raise RuntimeError("the replica's HTTP server stopped")

    async def forward(self, method: str, path: str, query: str, body: bytes, content_type: str | None,
                      key: RoutingKey | None = None):
        """Run one HTTP request through this replica's app. Yields the head {status, content_type, replica},
        then (bytes, commits) pieces: SSE events one by one, any other body whole at the end. (`key` is for
        Serve's router, which chose this replica by it.)"""
        if self.client is None:
            self.client = httpx.AsyncClient(base_url=self.url, timeout=None,
                                            limits=httpx.Limits(keepalive_expiry=KEEP_ALIVE_S / 2))
        headers = {"content-type": content_type} if content_type else {}
        async with self.client.stream(method, path, params=query or None, content=body, headers=headers) as r:
            kind = r.headers.get("content-type", "")
            yield {"status": r.status_code, "content_type": kind, "replica": self.id}
            if kind.startswith("text/event-stream"):
                pending = ""
                async for text in r.aiter_text():
                    pending += text
                    while "\n\n" in pending:
                        event, pending = pending.split("\n\n", 1)
                        yield (event + "\n\n").encode(), commits(event)
            else:
                yield self._tag(await r.aread(), r.status_code), True

    def _tag(self, body: bytes, status: int) -> bytes:
        """Name this replica in the response's `castspec` extension object."""
        if status != 200:
            return body
        obj = json.loads(body)
        if isinstance(obj, dict) and isinstance(obj.get("castspec"), dict):
            obj["castspec"]["replica"] = self.id
            return json.dumps(obj).encode()
        return body

    def __del__(self):  # Serve calls it when it stops the replica
        if hasattr(self, "server"):
            self.stop.set()
            self.server.__exit__(None, None, None)


GAUGES = ("active", "queued", "rss_bytes")  # the state of a live process: summed over live replicas only


def merge_snapshots(every: list[dict], live: list[dict]) -> dict:
    """One /metrics snapshot (server.py's JSON form) for the whole application: counters and histograms summed
    over every replica that ever reported (a dead one's work still happened), gauges over the live ones, and the
    ratios recomputed from the sums."""
    out: dict = {}
    for s in every:
        for key, value in s.items():
            if key in GAUGES:
                continue
            if isinstance(value, dict):  # histograms and counts by reason; JSON made their int keys strings
                merged = out.setdefault(key, {})
                for k, v in value.items():
                    k = int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k
                    merged[k] = merged.get(k, 0) + v
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
    for key in GAUGES:
        out[key] = sum(s.get(key, 0) for s in live)
    for key in ("acceptance_histogram", "batch_size_histogram"):
        out[key] = dict(sorted(out.get(key, {}).items()))
    hist = out["acceptance_histogram"]
    out["mean_committed_per_round"] = sum((k + 1) * v for k, v in hist.items()) / max(sum(hist.values()), 1)
    out["uptime_s"] = max((s.get("uptime_s", 0.0) for s in every), default=0.0)
    out["goodput_tokens_per_s"] = out.get("goodput_tokens", 0) / out["uptime_s"] if out["uptime_s"] > 0 else 0.0
    return out


# serve.ingress pickles this app (and the routes' functions, by value) where the class below is defined: what
# the routes use must be defined above it, and annotations must be real objects (no postponed evaluation)
api = FastAPI(title="castspec on Ray Serve")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
@serve.ingress(api)
class Ingress:
    """The HTTP entry: the routes of `castspec serve`, relayed to engine replicas with retries."""

    def __init__(self, engine, board, scale: ScaleConfig, engine_name: str, max_body_bytes: int):
        self.engine, self.board, self.scale, self.engine_name = engine, board, scale, engine_name
        self.max_body_bytes = max_body_bytes  # the replicas' limit, applied before the body crosses the cluster

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.relay(request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.relay(request)

    @api.get("/v1/models")
    async def models(self, request: Request):
        return await self.relay(request)

    @api.get("/health")
    async def health(self):
        replicas = await self.replica_states()
        live = await self.live_reports()
        running = replicas.get("RUNNING", 0)
        body = {"status": "ok" if running else "unavailable", "replicas": replicas,
                "active": sum(r["metrics"]["active"] for r in live.values()),
                "queued": sum(r["metrics"]["queued"] for r in live.values()),
                "per_replica": {k: {"pid": r["pid"], "node": r["node"], "active": r["metrics"]["active"],
                                    "queued": r["metrics"]["queued"]} for k, r in live.items()}}
        return JSONResponse(body, status_code=200 if running else 503)

    @api.get("/metrics")
    async def metrics(self, format: str = "prometheus"):
        reports = await self.board.collect.remote()
        live = await self.live_reports(reports)
        snap = merge_snapshots([r["metrics"] for r in reports.values()], [r["metrics"] for r in live.values()])
        if format == "json":
            return {**snap, "replicas": {k: r["metrics"] for k, r in reports.items()}, "live_replicas": len(live)}
        states = await self.replica_states()
        lines = ["# HELP castspec_replicas Engine replicas by state (Ray Serve).", "# TYPE castspec_replicas gauge"]
        lines += [f'castspec_replicas{{state="{k.lower()}"}} {v}' for k, v in sorted(states.items())]
        return PlainTextResponse(prometheus(snap) + "\n".join(lines) + "\n")

    async def live_reports(self, reports: dict | None = None) -> dict:
        reports = await self.board.collect.remote() if reports is None else reports
        now = time.time()
        return {k: r for k, r in reports.items() if now - r["seen"] < STALE_AFTER_S}

    async def replica_states(self) -> dict[str, int]:
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(APP_NAME)
        dep = app.deployments.get(self.engine_name) if app is not None else None
        return {str(getattr(k, "value", k)): v for k, v in (dep.replica_states if dep is not None else {}).items()}

    async def relay(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.max_body_bytes)
        except ApiError as e:
            return error_response(e.status, e.message, e.kind)
        args = (request.method, request.url.path, request.url.query, body, request.headers.get("content-type"),
                RoutingKey.of(request.url.path, body))
        last = "no replica answered"
        for attempt in range(1, self.scale.attempts + 1):
            stream = self.engine.options(stream=True).forward.remote(*args)
            try:
                head = await stream.__anext__()
                held, ended = [], True
                async for piece, final in stream:
                    held.append(piece)
                    if final:
                        ended = False
                        break
            except REPLICA_LOST as e:  # nothing reached the client: try another replica
                last = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                log.warning("castspec: replica lost before answering (attempt %d): %s", attempt, last)
                await asyncio.sleep(0.1 * 2 ** attempt)
                continue
            except BackPressureError:
                return error_response(429, "all replicas are busy and the router queue is full", "rate_limit_error")
            except DeploymentUnavailableError as e:
                return error_response(503, e.message, "unavailable_error")
            headers = {REPLICA_HEADER: head["replica"], ATTEMPTS_HEADER: str(attempt)}
            if ended or not head["content_type"].startswith("text/event-stream"):
                return Response(b"".join(held), status_code=head["status"], headers=headers,
                                media_type=head["content_type"] or None)
            return StreamingResponse(self.rest(stream, held), status_code=head["status"], headers=headers,
                                     media_type=head["content_type"])
        return error_response(503, f"no replica could serve the request after {self.scale.attempts} tries "
                                   f"({last})", "unavailable_error")

    @staticmethod
    async def rest(stream, held: list[bytes]):
        """The held events, then the rest of the stream; a replica lost now ends it with an error event."""
        done = False
        try:
            for piece in held:
                yield piece
            async for piece, _ in stream:
                yield piece
            done = True
        except REPLICA_LOST as e:
            done = True
            message = f"generation failed: the replica serving this request was lost ({type(e).__name__})"
            yield ("data: " + json.dumps({"error": {"message": message, "type": "server_error", "code": 500}})
                   + "\n\ndata: [DONE]\n\n").encode()
        finally:
            if not done:  # the client went away: cancel the request on its replica too
                stream.cancel()


def build_app(options: ReplicaOptions, scale: ScaleConfig):
    """The Serve application: Ingress -> EngineReplica x N, both reporting to / reading from one Board."""
    engine = EngineReplica.options(**engine_options(options, scale))
    board = Board.bind()
    return Ingress.bind(engine.bind(options, board), board, scale, "EngineReplica", options.server.max_body_bytes)


def connect(address: str | None, num_cpus: int | None = None, object_store_mb: int | None = None) -> bool:
    """Join the cluster at `address` (or RAY_ADDRESS), else start a local one. Returns True if it started one.

    A local cluster gets the node address 127.0.0.1, and then every Ray process of it listens on loopback only,
    only if Ray was imported in its single-node mode (`castspec serve-ray` sets that up: cli/serve_ray.py)."""
    if ray.is_initialized():
        return False
    started = not (address or os.environ.get("RAY_ADDRESS"))
    if started:
        # "local": a new cluster of this process's own, never one some other command left running here
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 object_store_memory=object_store_mb * 2 ** 20 if object_store_mb else None)
        node = ray.util.get_node_ip_address()
        if node not in LOOPBACK:
            log.warning("castspec: the local Ray cluster has the node address %s: its processes listen on every "
                        "interface of this machine (docs/scale-out.md)", node)
    else:
        ray.init(address=address)
    return started


def deploy(options: ReplicaOptions, scale: ScaleConfig, host: str = "127.0.0.1", port: int = 8000) -> str:
    """Deploy the application on the connected cluster and wait for it; returns the ingress URL."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(options, scale), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def shutdown(started_cluster: bool) -> None:
    serve.delete(APP_NAME)
    if started_cluster:
        serve.shutdown()
        ray.shutdown()

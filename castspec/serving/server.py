"""OpenAI-compatible HTTP server (FastAPI) over the continuous-batching scheduler.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON or SSE streaming), GET /v1/models,
GET /health, GET /metrics (Prometheus text; ?format=json for JSON). The scheduler runs rounds on its own thread;
each request gets an asyncio queue that the scheduler feeds through the event loop, so a slow or vanished
client only ever affects its own request.

A request body becomes (token ids, DecodeConfig) in `Frontend.prepare` (frontend.py), a plain blocking call that
any ingress can run (here: on a worker thread, so that parsing, tokenizing and template rendering never hold up the
event loop). Every check that can refuse a request runs there, before admission. This module holds the rest of the
HTTP side: the bridge from scheduler callbacks to the event loop (`Handle`), the answers (JSON or SSE) built from
what a request's handle receives, the shutdown drain (`InFlight` ends what is still running when the deadline
passes) and uvicorn (`run_server`). The wire format is in protocol.py, /metrics in metrics.py.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from ..config import ConfigError
from ..sequence import ContextLengthError
from .frontend import Frontend, Prepared, ServerConfig
from .metrics import prometheus, resident_bytes
from .protocol import ApiError, error_body, error_response
from .scheduler import QueueFull, Request as SchedRequest, Scheduler, ShuttingDown
from .textstream import TextStream

log = logging.getLogger("castspec.server")


class Mailbox:
    """Carries what the scheduler thread hands over into the event loop's queues: callbacks only collect
    (`put`), and `wake` (the scheduler's after-callbacks hook) hands a whole round's items over with one wakeup
    of the loop. A wakeup per item (call_soon_threadsafe writes the loop's self-pipe) is a system call that lets
    the loop's thread take the GIL in the middle of the round's deliveries, every time."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, tuple]] = []

    def put(self, queue: asyncio.Queue, item: tuple) -> None:
        with self._lock:
            self._items.append((queue, item))

    def wake(self) -> None:
        with self._lock:
            if not self._items:
                return
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


class Handle:
    """Bridges one scheduler request to the event loop: the scheduler thread pushes, the handler awaits."""

    def __init__(self, mailbox: Mailbox):
        self.mailbox = mailbox
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_tokens(self, tokens: list[int]) -> None:
        self.mailbox.put(self.queue, ("tokens", list(tokens)))

    def on_logprobs(self, logprobs: list) -> None:
        self.mailbox.put(self.queue, ("logprobs", logprobs))

    def on_done(self, reason: str, error: str | None) -> None:
        self.mailbox.put(self.queue, ("done", (reason, error)))

    def end(self, message: str) -> None:
        """End the request now (on the event loop): its handler answers 503 or an SSE error event."""
        self.queue.put_nowait(("done", ("shutdown", message)))


@dataclass(eq=False)
class Choice:
    """One continuation of a request: its scheduler request, the handle it reports through, its text."""

    index: int
    handle: Handle
    req: SchedRequest
    text: TextStream


class InFlight:
    """The requests this server is answering, and the shutdown drain: once `drain` is called new requests
    get 503 at once, and when the deadline passes every request still running is ended with a clean error."""

    def __init__(self):
        # handle -> its scheduler request; kept here, not on the handle, because the request already points
        # at the handle (its callbacks): a cycle would keep a finished request's caches until a full GC
        self.handles: dict[Handle, SchedRequest] = {}
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.mailbox: Mailbox | None = None  # the scheduler thread's way into that loop (set with it)
        self._timer: asyncio.TimerHandle | None = None

    def check_open(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", "unavailable_error")

    def drain(self, timeout_s: float) -> None:
        """Begin shutting down; safe from any thread and from a signal handler."""
        self.draining = True
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._arm, timeout_s)

    def _arm(self, timeout_s: float) -> None:
        if self._timer is not None:  # a second call only ever brings the deadline forward
            if self._timer.when() <= self.loop.time() + timeout_s:
                return
            self._timer.cancel()
        self._timer = self.loop.call_later(timeout_s, self.expire)

    def expire(self) -> None:
        for handle, request in list(self.handles.items()):
            request.cancel()
            handle.end("the server shut down before this request finished (shutdown deadline reached)")
        self.handles.clear()


async def read_body(http: Request, limit: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `limit` bytes."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body ({int(declared)} bytes) exceeds this server's limit of {limit} bytes "
                            "(--max-body-bytes)", "request_too_large")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
                           "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(engine, scheduler: Scheduler, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    created = int(time.time())
    frontend = Frontend(engine, scheduler.method, config)
    inflight = InFlight()
    preparing = ThreadPoolExecutor(config.prepare_threads, thread_name_prefix="castspec-prepare")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        inflight.loop = asyncio.get_running_loop()
        inflight.mailbox = Mailbox(inflight.loop)
        scheduler.after_callbacks.append(inflight.mailbox.wake)
        stop = scheduler.start()
        try:
            yield
        finally:
            inflight.expire()
            scheduler.close(stop)
            preparing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="castspec", lifespan=lifespan)
    app.state.inflight = inflight
    app.state.config = config

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.kind)

    @app.get("/health")
    async def health():
        return {"status": "draining" if inflight.draining else "ok", "active": scheduler.active,
                "queued": scheduler.queue_length}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": created,
                                            "owned_by": "castspec"}]}

    @app.get("/metrics")
    async def metrics(format: str = "prometheus"):
        snap = scheduler.metrics.snapshot()
        snap.update(active=scheduler.active, queued=scheduler.queue_length, rss_bytes=resident_bytes())
        if format == "json":
            return snap
        return PlainTextResponse(prometheus(snap))

    def submit(job: Prepared) -> list[Choice]:
        """Admit the request's n continuations (the first reads the prompt, the others fork from it); all or
        none: a refusal of any of them withdraws the others."""
        inflight.check_open()
        choices: list[Choice] = []
        try:
            for i, cfg in enumerate(job.choice_configs()):
                handle = Handle(inflight.mailbox)
                req = SchedRequest(job.ids, cfg, handle.on_tokens, handle.on_done,
                                   on_logprobs=handle.on_logprobs if cfg.logprobs is not None else None,
                                   fork_of=choices[0].req if choices else None)
                scheduler.submit(req)
                choices.append(Choice(i, handle, req, frontend.text_stream(job)))
                inflight.handles[handle] = req
        except (ConfigError, ContextLengthError, ValueError, QueueFull, ShuttingDown) as e:
            for c in choices:
                c.req.cancel()
                inflight.handles.pop(c.handle, None)
            if isinstance(e, QueueFull):
                raise ApiError(429, str(e), "rate_limit_error") from None
            if isinstance(e, ShuttingDown):
                raise ApiError(503, str(e), "unavailable_error") from None
            raise ApiError(400, str(e)) from None
        return choices

    async def serve(http: Request, chat: bool):
        inflight.check_open()
        raw = await read_body(http, config.max_body_bytes)
        job = await asyncio.get_running_loop().run_in_executor(preparing, frontend.prepare, raw, chat)
        choices = submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "created": int(time.time()), "model": config.model_name}
        if job.stream:
            return StreamingResponse(stream_events(choices, job, meta, frontend, inflight),
                                     media_type="text/event-stream")
        watcher = asyncio.create_task(cancel_on_disconnect(http, [c.req for c in choices]))
        try:
            results = await asyncio.gather(*(collect(c) for c in choices))
        finally:
            watcher.cancel()
            for c in choices:
                inflight.handles.pop(c.handle, None)
        for pieces, _, reason in results:
            if reason == "shutdown":
                raise ApiError(503, pieces[-1], "unavailable_error")
            if reason == "error":
                raise ApiError(500, f"generation failed: {pieces[-1] if pieces else ''}", "server_error")
        out = []
        for c, (pieces, lps, reason) in zip(choices, results):
            content = "".join(pieces)
            choice = {"index": c.index, "finish_reason": reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": content}
                choice["logprobs"] = frontend.chat_logprobs(lps) if job.cfg.logprobs is not None else None
            else:
                choice.update(text=content, logprobs=frontend.completion_logprobs(lps)
                              if job.cfg.logprobs is not None else None)
            out.append(choice)
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": out,
                "usage": usage(job, choices), "castspec": castspec_stats(choices)}

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await serve(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        return await serve(http, chat=True)

    return app


def usage(job: Prepared, choices: list[Choice]) -> dict:
    """OpenAI's usage: the prompt counted once, every continuation's tokens, and (as OpenAI and vLLM report it)
    how many prompt tokens were copied from a kept prefix instead of read (castspec.prefix_cache)."""
    n, out = len(job.ids), sum(c.req.tokens for c in choices)
    return {"prompt_tokens": n, "completion_tokens": out, "total_tokens": n + out,
            "prompt_tokens_details": {"cached_tokens": choices[0].req.cached_tokens if choices else 0}}


def castspec_stats(choices: list[Choice]) -> dict:
    rounds, tokens = sum(c.req.rounds for c in choices), sum(c.req.tokens for c in choices)
    return {"rounds": rounds, "mean_committed_per_round": tokens / max(rounds, 1)}


async def collect(choice: Choice) -> tuple[list[str], list, str | None]:
    """A whole continuation: (text pieces, TokenLogprobs, finish reason)."""
    pieces, lps, reason = [], [], None
    async for piece, reason, lp in events(choice.handle, choice.req, choice.text):
        pieces.append(piece)
        lps.extend(lp)
    return pieces, lps, reason


async def events(handle: Handle, req: SchedRequest, text: TextStream):
    """Yield (text delta, None, log-probabilities of the tokens behind it) while tokens arrive, then
    ("", finish reason, []); errors yield (message, "error", []), a shutdown (message, "shutdown", [])."""
    pending: list = []  # log-probabilities of the next chunk of tokens (they arrive just before it)
    while True:
        kind, payload = await handle.queue.get()
        if kind == "logprobs":
            pending = payload
        elif kind == "tokens":
            delta, lps, pending = text.add(payload), pending, []
            if text.stopped:
                req.finish("stop")
                yield delta, None, lps
                yield "", "stop", []
                return
            if delta or lps:
                yield delta, None, lps
        else:
            reason, error = payload
            if reason in ("error", "shutdown"):
                yield error or "", reason, []
                return
            yield text.add([], final=True), None, []
            yield "", reason, []
            return


async def cancel_on_disconnect(http: Request, reqs: list[SchedRequest]) -> None:
    while True:
        if await http.is_disconnected():
            for req in reqs:
                req.cancel()
            return
        await asyncio.sleep(0.1)


PLACEHOLDER = "\0castspec text\0"  # where a chunk's text goes in its JSON template


async def merge_events(choices: list[Choice]):
    """(choice index, *item) for every item of the choices' `events`, as they come: one choice's directly (a
    stream's every token passes here), several through a queue that a task per choice fills."""
    if len(choices) == 1:
        async for item in events(choices[0].handle, choices[0].req, choices[0].text):
            yield (choices[0].index, *item)
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        async for item in events(c.handle, c.req, c.text):
            await merged.put((c.index, *item))

    pumps = [asyncio.create_task(pump(c)) for c in choices]
    try:
        while True:
            yield await merged.get()
    finally:
        for task in pumps:
            task.cancel()


class Chunks:
    """The SSE chunks of one streamed request, each naming its choice's index. Most carry only text, so the
    rest of their JSON is made once per choice and the text's JSON put in it (the bytes json.dumps gives)."""

    def __init__(self, job: Prepared, meta: dict, frontend: Frontend, choices: int):
        self.job, self.meta, self.frontend = job, meta, frontend
        self.obj = "chat.completion.chunk" if job.chat else "text_completion"
        self.offsets = [0] * choices  # characters sent per choice (completions' text_offset)
        self._around: dict[int, tuple[str, str]] = {}  # choice index: a text-only chunk before and after its text

    def __call__(self, i: int, delta: str | None, reason: str | None, lps: list, role: bool = False) -> str:
        chat, logprobs = self.job.chat, None
        if self.job.cfg.logprobs is not None and lps:
            logprobs = (self.frontend.chat_logprobs(lps) if chat else
                        self.frontend.completion_logprobs(lps, self.offsets[i]))
        if not chat:
            self.offsets[i] += len(delta or "")
        if delta is not None and reason is None and logprobs is None and not role:
            before, after = self._around.get(i) or self._template(i)
            return before + json.dumps(delta) + after
        if chat:
            text = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
        else:
            text = delta or ""
        return self._sse(i, text, logprobs, reason)

    def _sse(self, i: int, text, logprobs, reason: str | None) -> str:
        """One SSE chunk: choice i's delta (chat) or text (completions), its log-probabilities and finish reason."""
        choice = {"index": i, "delta" if self.job.chat else "text": text, "logprobs": logprobs, "finish_reason": reason}
        return "data: " + json.dumps({**self.meta, "object": self.obj, "choices": [choice]}) + "\n\n"

    def _template(self, i: int) -> tuple[str, str]:
        whole = self._sse(i, {"content": PLACEHOLDER} if self.job.chat else PLACEHOLDER, None, None)
        before, _, after = whole.rpartition(json.dumps(PLACEHOLDER))  # the placeholder is its last string
        self._around[i] = before, after
        return before, after


async def stream_events(choices: list[Choice], job: Prepared, meta: dict, frontend: Frontend, inflight: InFlight):
    """SSE chunks of every continuation as they come (each chunk names its choice's index)."""
    chat = job.chat
    chunk = Chunks(job, meta, frontend, len(choices))
    merged = merge_events(choices)
    try:
        if chat:
            for c in choices:
                yield chunk(c.index, None, None, [], role=True)
        finished = 0
        while finished < len(choices):
            i, delta, reason, lps = await anext(merged)
            if reason in ("error", "shutdown"):
                err = (error_body(503, delta, "unavailable_error") if reason == "shutdown" else
                       error_body(500, f"generation failed: {delta}", "server_error"))
                yield "data: " + json.dumps(err) + "\n\n"
                break
            if reason is not None:
                finished += 1
                yield chunk(i, None if chat else "", reason, lps)
            elif delta or lps:
                yield chunk(i, delta, None, lps)
        if job.include_usage:
            body = {**meta, "object": chunk.obj, "choices": [], "usage": usage(job, choices)}
            yield "data: " + json.dumps(body) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or we are done): free the requests' slots at the next round
        await merged.aclose()
        for c in choices:
            inflight.handles.pop(c.handle, None)
            c.req.cancel()


class GracefulServer(uvicorn.Server):
    """uvicorn with a shutdown deadline. The first SIGINT/SIGTERM stops new requests at once (503 while the
    listening socket closes) and gives the ones in flight `config.shutdown_timeout_s` before they are ended with
    a clean error; a second signal ends them and exits at once."""

    def __init__(self, config: uvicorn.Config, inflight: InFlight, timeout_s: float):
        super().__init__(config)
        self.inflight, self.timeout_s = inflight, timeout_s

    def handle_exit(self, sig, frame) -> None:
        again = self.should_exit
        super().handle_exit(sig, frame)
        if again:
            self.force_exit = True
            self.inflight.drain(0.0)
        else:
            log.warning("castspec: shutting down; requests in flight have %.1f s to finish", self.timeout_s)
            self.inflight.drain(self.timeout_s)


def run_server(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    """Serve `app` (from create_app) with uvicorn until a signal, then shut down within the app's deadline."""
    timeout = app.state.config.shutdown_timeout_s
    # uvicorn's own limit is the backstop for connections the drain cannot end (a client that stopped reading)
    cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                         timeout_graceful_shutdown=math.ceil(timeout) + 2)
    GracefulServer(cfg, app.state.inflight, timeout).run()

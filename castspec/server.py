"""OpenAI-compatible HTTP server (FastAPI) over the continuous-batching scheduler.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON or SSE streaming), GET /v1/models,
GET /health, GET /metrics (Prometheus text; ?format=json for JSON). The scheduler runs rounds on its own thread;
each request gets an asyncio queue that the scheduler feeds through the event loop, so a slow or vanished
client only ever affects its own request.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from .config import ConfigError, DecodeConfig
from .scheduler import QueueFull, Request as SchedRequest, Scheduler, ShuttingDown
from .sequence import ContextLengthError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are rejected so that a typo is not silently ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)  # extension (vLLM-style); 0 = off
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=1)
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)


class CompletionBody(SamplingFields):
    prompt: str | list[StrictInt]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    chat_template_kwargs: dict | None = None  # extension, e.g. {"enable_thinking": false}


@dataclass
class ServerConfig:
    model_name: str = "castspec"
    default_max_tokens: int = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class TextStream:
    """Incremental detokenization with stop strings: returns only text that can no longer change (an
    unfinished UTF-8 sequence, or a tail that could be the start of a stop string, waits for more tokens)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def add(self, tokens: list[int], final: bool = False) -> str:
        self.ids.extend(tokens)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stops:
            idx = text.find(s, max(0, self.sent - len(s) + 1))
            if idx >= 0:
                text, self.stopped, final = text[:idx], True, True
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end -= 1
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            end = max(self.sent, min(end, len(text) - hold))
        delta = text[self.sent:end]
        self.sent = end
        return delta


class Handle:
    """Bridges one scheduler request to the event loop: the scheduler thread pushes, the handler awaits."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request: SchedRequest | None = None

    def on_tokens(self, tokens: list[int]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("tokens", list(tokens)))

    def on_done(self, reason: str, error: str | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("done", (reason, error)))


def create_app(engine, scheduler: Scheduler, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stop = scheduler.start()
        try:
            yield
        finally:
            scheduler.close(stop)

    app = FastAPI(title="castspec", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(400, f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.kind)

    @app.get("/health")
    async def health():
        return {"status": "ok", "active": scheduler.active, "queued": scheduler.queue_length}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": created,
                                            "owned_by": "castspec"}]}

    @app.get("/metrics")
    async def metrics(format: str = "prometheus"):
        snap = scheduler.metrics.snapshot()
        snap.update(active=scheduler.active, queued=scheduler.queue_length)
        if format == "json":
            return snap
        return PlainTextResponse(prometheus(snap))

    def submit(ids: list[int], body: SamplingFields, handle: Handle) -> SchedRequest:
        if body.model not in (None, config.model_name):
            raise ApiError(404, f"model {body.model!r} not found; this server serves {config.model_name!r}",
                           "not_found_error")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            cfg = DecodeConfig(method=scheduler.method, max_new_tokens=config.default_max_tokens if limit is None
                               else limit, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                               seed=body.seed, stop_token_ids=engine.stop_ids())
            return scheduler.submit(SchedRequest(ids, cfg, handle.on_tokens, handle.on_done))
        except (ConfigError, ContextLengthError, ValueError) as e:
            raise ApiError(400, str(e)) from None
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error") from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), "unavailable_error") from None

    def encode(**kw) -> list[int]:
        try:
            return engine.encode(**kw)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except Exception as e:  # noqa: BLE001 - e.g. a chat template error on odd messages
            raise ApiError(400, f"could not tokenize the request: {e}") from None

    async def run(http: Request, body: SamplingFields, ids: list[int], chat: bool):
        loop = asyncio.get_running_loop()
        handle = Handle(loop)
        req = submit(ids, body, handle)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        text = TextStream(engine.tokenizer, stops)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "created": int(time.time()), "model": config.model_name}
        if body.stream:
            return StreamingResponse(stream_events(handle, req, text, meta, chat, body, len(ids)),
                                     media_type="text/event-stream")
        watcher = asyncio.create_task(cancel_on_disconnect(http, req))
        try:
            pieces, reason = [], None
            async for piece, reason in events(handle, req, text):
                pieces.append(piece)
        finally:
            watcher.cancel()
        if reason == "error":
            raise ApiError(500, f"generation failed: {pieces[-1] if pieces else ''}", "server_error")
        content = "".join(p for p in pieces)
        usage = {"prompt_tokens": len(ids), "completion_tokens": req.tokens, "total_tokens": len(ids) + req.tokens}
        choice = {"index": 0, "finish_reason": reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice.update(text=content, logprobs=None)
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": usage, "castspec": {"rounds": req.rounds,
                                             "mean_committed_per_round": req.tokens / max(req.rounds, 1)}}

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionBody):
        ids = encode(input_ids=body.prompt) if isinstance(body.prompt, list) else encode(prompt=body.prompt)
        return await run(http, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, body: ChatBody):
        messages = [m.model_dump() for m in body.messages]
        ids = encode(messages=messages, chat_template_kwargs=body.chat_template_kwargs)
        return await run(http, body, ids, chat=True)

    return app


async def events(handle: Handle, req: SchedRequest, text: TextStream):
    """Yield (text delta, None) while tokens arrive, then ("", finish reason); errors yield (message, "error")."""
    while True:
        kind, payload = await handle.queue.get()
        if kind == "tokens":
            delta = text.add(payload)
            if text.stopped:
                req.finish("stop")
                yield delta, None
                yield "", "stop"
                return
            if delta:
                yield delta, None
        else:
            reason, error = payload
            if reason == "error":
                yield error or "", "error"
                return
            yield text.add([], final=True), None
            yield "", reason
            return


async def cancel_on_disconnect(http: Request, req: SchedRequest) -> None:
    while True:
        if await http.is_disconnected():
            req.cancel()
            return
        await asyncio.sleep(0.1)


async def stream_events(handle: Handle, req: SchedRequest, text: TextStream, meta: dict, chat: bool,
                        body: SamplingFields, prompt_tokens: int):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, reason: str | None, role: bool = False) -> str:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
            choice = {"index": 0, "delta": d, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        return "data: " + json.dumps({**meta, "object": obj, "choices": [choice]}) + "\n\n"

    try:
        if chat:
            yield chunk(None, None, role=True)
        async for delta, reason in events(handle, req, text):
            if reason == "error":
                yield "data: " + json.dumps({"error": {"message": f"generation failed: {delta}",
                                                       "type": "server_error", "code": 500}}) + "\n\n"
                break
            if reason is not None:
                yield chunk(None if chat else "", reason)
            elif delta:
                yield chunk(delta, None)
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": req.tokens,
                     "total_tokens": prompt_tokens + req.tokens}
            yield "data: " + json.dumps({**meta, "object": obj, "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or we are done): free the request's slot at the next round
        req.cancel()


def prometheus(snap: dict) -> str:
    """Prometheus text exposition of a metrics snapshot."""
    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]):
        lines.append(f"# HELP castspec_{name} {help_}")
        lines.append(f"# TYPE castspec_{name} {kind}")
        lines.extend(f"castspec_{name}{labels} {value}" for labels, value in samples)

    metric("requests_total", "counter", "Finished requests by reason.",
           [(f'{{reason="{k}"}}', v) for k, v in snap["requests"].items()])
    metric("rejected_total", "counter", "Requests refused because the queue was full.", [("", snap["rejected"])])
    metric("generated_tokens_total", "counter", "Tokens sent to clients.", [("", snap["tokens"])])
    metric("goodput_tokens_per_second", "gauge", "Tokens of normally finished requests per second of uptime.",
           [("", snap["goodput_tokens_per_s"])])
    metric("rounds_total", "counter", "Batched decoding rounds.", [("", snap["rounds"])])
    metric("mean_committed_tokens_per_round", "gauge", "Mean tokens a request commits per verify round (R).",
           [("", snap["mean_committed_per_round"])])
    metric("prefill_tokens_total", "counter", "Prompt tokens prefilled.", [("", snap["prefill_tokens"])])
    metric("active_requests", "gauge", "Requests decoding now.", [("", snap["active"])])
    metric("queued_requests", "gauge", "Requests waiting for a batch slot.", [("", snap["queued"])])
    for name, key, help_ in (("accepted_tokens", "acceptance_histogram", "Accepted drafted tokens per request-round."),
                             ("batch_size", "batch_size_histogram", "Requests verified together per round.")):
        hist = snap[key]
        samples, total, acc = [], 0, 0
        for k in sorted(hist):
            acc += hist[k]
            samples.append((f'_bucket{{le="{k}"}}', acc))
            total += k * hist[k]
        samples += [('_bucket{le="+Inf"}', acc), ("_sum", total), ("_count", acc)]
        metric(name, "histogram", help_, samples)
    return "\n".join(lines) + "\n"

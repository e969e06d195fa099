"""OpenAI-compatible HTTP server (FastAPI) over the continuous-batching scheduler.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON or SSE streaming), GET /v1/models,
GET /health, GET /metrics (Prometheus text; ?format=json for JSON). The scheduler runs rounds on its own thread;
each request gets an asyncio queue that the scheduler feeds through the event loop, so a slow or vanished
client only ever affects its own request.

A request body becomes (token ids, DecodeConfig) in `Frontend.prepare`, a plain blocking call that any ingress
can run (here: on a worker thread, so that parsing, tokenizing and template rendering never hold up the event
loop). Every check that can refuse a request runs there, before admission; `InFlight` ends what is still
running when a shutdown deadline passes.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from .config import ConfigError, DecodeConfig
from .sampling import choice_seed
from .scheduler import QueueFull, Request as SchedRequest, Scheduler, ShuttingDown
from .sequence import ContextLengthError, check_request
from .textstream import TextStream

log = logging.getLogger("castspec.server")

INT64 = 2 ** 63


def finite_logprob(value: float) -> float:
    """JSON has no -Infinity: a token outside the processed law's support reports -9999, as vLLM does."""
    return value if math.isfinite(value) else -9999.0


def finite(default: float, **bounds):
    """A float field that must be a finite number (JSON parsers accept NaN and Infinity)."""
    return Field(default=default, allow_inf_nan=False, **bounds)


MAX_LOGPROBS = 20  # alternatives per token a request may ask for (vLLM's default limit)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]  # json_object / json_schema would need constrained decoding: refused with a clear 400


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are rejected so that a typo is not silently ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = finite(1.0, ge=0.0, le=2.0)
    top_p: float = finite(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)  # extension (vLLM-style); 0 = off
    seed: StrictInt | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1)  # continuations of the prompt (ServerConfig.max_n)
    user: str | None = None
    # applied to the target's logits at every tree node exactly as at an `ar` step (castspec.sampling)
    presence_penalty: float = finite(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = finite(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = finite(1.0, gt=0.0, le=10.0)  # extension (vLLM-style)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI's API) -> bias in [-100, 100]
    min_tokens: StrictInt = Field(default=0, ge=0)  # extension: stop tokens are masked until this many are out
    stop_token_ids: list[StrictInt] | None = None  # extension: more tokens that end the output (and are kept)
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"biases must be finite numbers in [-100, 100], got {bias} for token {key}")
        return value


class CompletionBody(SamplingFields):
    prompt: str | list[StrictInt]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]  # images, audio, files: this server serves a text-only model
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart]

    def for_template(self) -> dict:
        """The message as the chat template reads it: text parts joined with newlines (as vLLM does)."""
        out = self.model_dump()
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        return out


class ChatBody(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    chat_template_kwargs: dict | None = None  # extension: chat template variables, e.g. {"enable_thinking": false}
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


@dataclass
class ServerConfig:
    """What one server accepts. Every limit is checked before a request is tokenized or admitted."""

    model_name: str = "castspec"
    default_max_tokens: int = 256
    max_body_bytes: int = 8 * 2 ** 20  # larger bodies get 413 before they are read in full
    max_prompt_chars: int | None = None  # characters of prompt text (all messages together); None: 32 per token
    max_messages: int = 1024  # of the model's context
    max_stop_strings: int = 16
    max_stop_chars: int = 1024  # per stop string
    max_n: int = 16  # continuations per request
    logprobs_mode: str = "raw"  # log-probabilities of the target's logits ("raw") or of the sampling law ("processed")
    allow_request_chat_template: bool = False  # run Jinja templates sent in chat_template_kwargs.chat_template
    shutdown_timeout_s: float = 10.0  # in-flight requests get this long after a shutdown signal
    # threads that parse and tokenize requests: bounds the CPU a flood of large prompts takes from decoding, and
    # the allocator arenas those threads create (docs/serving.md, memory)
    prepare_threads: int = 2

    def __post_init__(self):
        for name in ("default_max_tokens", "max_body_bytes", "max_messages", "max_stop_chars", "prepare_threads",
                     "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if not (math.isfinite(self.shutdown_timeout_s) and self.shutdown_timeout_s >= 0):
            raise ValueError(f"shutdown_timeout_s must be a finite number >= 0, got {self.shutdown_timeout_s}")

    def prompt_char_limit(self, context_tokens: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else 32 * context_tokens


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status)


def validation_message(errors: list[dict]) -> str:
    """One line for pydantic's first error: `field.path: what is wrong`."""
    first = errors[0] if errors else {}
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def text_chars(value, where: str) -> int:
    """Characters in the string values of a parsed JSON value; text that is not valid Unicode (JSON allows a
    lone surrogate escape such as "\\ud800"), in a value or a key, is refused with the field's name."""
    total, stack = 0, [(value, True)]
    while stack:  # iterative: nesting depth is the client's choice
        v, counted = stack.pop()
        if isinstance(v, str):
            total += len(v) if counted else 0
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ApiError(400, f"{where}: text is not valid Unicode (lone surrogate "
                                        f"{ascii(v[e.start])} at character {e.start})") from None
        elif isinstance(v, dict):
            stack.extend((k, False) for k in v)
            stack.extend((x, True) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, True) for x in v)
    return total


@dataclass
class Prepared:
    """A validated request, ready to submit: what `Frontend.prepare` returns."""

    chat: bool
    ids: list[int]
    cfg: DecodeConfig
    stops: list[str]
    stream: bool
    include_usage: bool
    n: int = 1  # continuations: the first with cfg, the others forked from it with their own seeds

    def choice_configs(self) -> list[DecodeConfig]:
        return [self.cfg if i == 0 else replace(self.cfg, seed=choice_seed(self.cfg.seed, i)) for i in range(self.n)]


class Frontend:
    """Request body -> (token ids, DecodeConfig), with every limit and check of this server. Blocking (JSON
    parsing, tokenization, chat templates): an ingress runs `prepare` off its event loop."""

    def __init__(self, engine, method: str, config: ServerConfig):
        self.engine, self.method, self.config = engine, method, config
        self.context = engine.target.cfg.max_positions
        self._template_vars: dict[str, frozenset[str]] = {}
        self._token_texts: dict[int, str] = {}
        self.reserved = self._reserved_names()

    def _reserved_names(self) -> frozenset[str]:
        """Names a request may not set through chat_template_kwargs: apply_chat_template's own options
        (tokenize, return_tensors, padding, ...), the conversation itself, the special tokens and the helpers
        transformers hands to every template."""
        names = {"conversation", "messages", "raise_exception", "strftime_now"}
        tok = self.engine.tokenizer
        if tok is not None:
            names |= {p.name for p in inspect.signature(tok.apply_chat_template).parameters.values()
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
            names |= set(getattr(tok, "special_tokens_map", {}))
        names.discard("chat_template")  # refused separately, with its own message
        return frozenset(names)

    # -- the whole step --------------------------------------------------------------------------------------
    def prepare(self, raw: bytes | str | dict, chat: bool) -> Prepared:
        body = self.parse(raw, chat)
        ids = self.tokenize(body)
        cfg = self.decode_config(body, ids)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return Prepared(chat, ids, cfg, stops, body.stream, include_usage, body.n)

    def text_stream(self, job: Prepared) -> TextStream:
        """Detokenizer and stop strings for one continuation of `job`."""
        return TextStream(self.engine.tokenizer, job.stops)

    def token_text(self, token: int) -> str:
        """A token as log-probabilities name it: its text (token_id:N for a target without a tokenizer)."""
        text = self._token_texts.get(token)
        if text is None:
            tok = self.engine.tokenizer
            text = self._token_texts[token] = f"token_id:{token}" if tok is None else tok.decode([token])
        return text

    def chat_logprobs(self, lps: list) -> dict:
        """OpenAI's chat `logprobs` object for TokenLogprobs."""
        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                            for x in lps], "refusal": None}

    def completion_logprobs(self, lps: list, offset: int = 0) -> dict:
        """OpenAI's legacy completions `logprobs` object; text offsets count from `offset` characters."""
        tokens = [self.token_text(x.token) for x in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [finite_logprob(x.logprob) for x in lps],
                "top_logprobs": [{self.token_text(t): finite_logprob(lp) for t, lp in x.top} for x in lps],
                "text_offset": offsets}

    def parse(self, raw: bytes | str | dict, chat: bool) -> CompletionBody | ChatBody:
        """JSON -> the endpoint's body model, with the limits that need no tokenizer (400/404 otherwise)."""
        data = raw
        if isinstance(raw, (bytes, bytearray, str)):
            try:
                data = json.loads(raw)
            except UnicodeDecodeError:
                raise ApiError(400, "the request body is not valid UTF-8") from None
            except json.JSONDecodeError as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}") from None
            except RecursionError:
                raise ApiError(400, "the request body is nested too deeply") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        chars = {key: text_chars(value, key) for key, value in data.items()}
        text_chars(list(data), "the request body's field names")
        try:
            body = (ChatBody if chat else CompletionBody).model_validate(data)
        except ValidationError as e:
            raise ApiError(400, validation_message(e.errors())) from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        if body.model not in (None, self.config.model_name):
            raise ApiError(404, f"model {body.model!r} not found; this server serves {self.config.model_name!r}",
                           "not_found_error")
        self.check_limits(body, chars.get("messages" if chat else "prompt", 0))
        return body

    def check_limits(self, body, prompt_chars: int) -> None:
        cfg = self.config
        if body.n > cfg.max_n:
            raise ApiError(400, f"n: {body.n} continuations; this server makes at most {cfg.max_n} per request (--max-n)")
        if body.response_format is not None and body.response_format.type != "text":
            raise ApiError(400, f"response_format: type {body.response_format.type!r} is not supported (castspec "
                                "does no constrained decoding); use 'text'")
        if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true")
        if isinstance(body, ChatBody) and len(body.messages) > cfg.max_messages:
            raise ApiError(400, f"{len(body.messages)} messages; this server takes at most {cfg.max_messages} "
                                "(--max-messages)")
        limit = cfg.prompt_char_limit(self.context)
        if isinstance(body, ChatBody) or isinstance(body.prompt, str):
            if prompt_chars > limit:
                raise ApiError(400, f"the prompt is {prompt_chars} characters; this server takes at most {limit} "
                                    "(--max-prompt-chars)")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > cfg.max_stop_strings:
            raise ApiError(400, f"stop: {len(stops)} stop strings; this server takes at most "
                                f"{cfg.max_stop_strings} (--max-stop-strings)")
        longest = max(map(len, stops), default=0)
        if longest > cfg.max_stop_chars:
            raise ApiError(400, f"stop: a stop string of {longest} characters; this server takes at most "
                                f"{cfg.max_stop_chars} per string (--max-stop-chars)")

    # -- tokens ----------------------------------------------------------------------------------------------
    def template_kwargs(self, kwargs: dict | None) -> dict | None:
        """chat_template_kwargs as passed to the template: the operator's flag gates a request's own template;
        tokenizer and rendering options are refused; variables the template does not read are dropped."""
        if not kwargs:
            return None
        own = kwargs.get("chat_template")
        if own is not None and not self.config.allow_request_chat_template:
            raise ApiError(400, "chat_template_kwargs.chat_template: this server does not run chat templates sent "
                                "by clients (the operator can allow them with --allow-request-chat-template)")
        if own is not None and not isinstance(own, str):
            raise ApiError(400, "chat_template_kwargs.chat_template must be a string")
        refused = sorted(k for k in kwargs if k in self.reserved)
        if refused:
            raise ApiError(400, f"chat_template_kwargs.{refused[0]}: not a chat template variable (tokenizer and "
                                "rendering options cannot be set by a request)")
        used = self.template_variables(own)
        keep = {k: v for k, v in kwargs.items() if k in used}
        if own is not None:
            keep["chat_template"] = own
        return keep

    def template_variables(self, template: str | None) -> frozenset[str]:
        """The variables a chat template reads (the tokenizer's own when `template` is None)."""
        key = template if template is not None else ""
        if key not in self._template_vars:
            import jinja2
            from jinja2 import meta

            tok = self.engine.tokenizer
            sources = [template] if template is not None else (
                list(tok.chat_template.values()) if isinstance(getattr(tok, "chat_template", None), dict)
                else [getattr(tok, "chat_template", None) or ""])
            env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
            names: set[str] = set()
            for src in sources:
                try:
                    names |= meta.find_undeclared_variables(env.parse(src))
                except jinja2.TemplateSyntaxError as e:
                    raise ApiError(400, f"the chat template does not parse: {e}") from None
            found = frozenset(names - set(env.globals))
            if template is not None:
                return found  # a request's own template is not cached: each one is different
            self._template_vars[key] = found
        return self._template_vars[key]

    def tokenize(self, body) -> list[int]:
        try:
            if isinstance(body, ChatBody):
                ids = self.engine.encode(messages=[m.for_template() for m in body.messages],
                                         chat_template_kwargs=self.template_kwargs(body.chat_template_kwargs))
            elif isinstance(body.prompt, list):
                ids = self.engine.encode(input_ids=body.prompt)
            else:
                ids = self.engine.encode(prompt=body.prompt)
        except ApiError:
            raise
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except Exception as e:  # noqa: BLE001 - e.g. a chat template that raises on odd messages
            raise ApiError(400, f"could not tokenize the request: {type(e).__name__}: {e}") from None
        if not all(type(t) is int for t in ids):  # a template or tokenizer option that returned something else
            raise ApiError(400, "the chat template did not produce a list of token ids")
        return ids

    def decode_config(self, body, ids: list[int]) -> DecodeConfig:
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_new = self.config.default_max_tokens if limit is None else limit
        vocab = self.engine.target.cfg.vocab_size
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        for name, ids_ in (("logit_bias", bias), ("stop_token_ids", body.stop_token_ids or ())):
            bad = [t for t in ids_ if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"{name}: token id {bad[0]} is outside the vocabulary (size {vocab})")
        if body.min_tokens > max_new:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_new})")
        if isinstance(body, ChatBody):
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        try:
            check_request(ids, max_new, self.context, "max_tokens")
            return DecodeConfig(method=self.method, max_new_tokens=max_new, temperature=body.temperature,
                                top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                stop_token_ids=tuple(sorted({*self.engine.stop_ids(), *(body.stop_token_ids or ())})),
                                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                repetition_penalty=body.repetition_penalty, logit_bias=bias,
                                min_tokens=body.min_tokens, logprobs=logprobs,
                                logprobs_mode=self.config.logprobs_mode)
        except (ConfigError, ContextLengthError, ValueError) as e:
            raise ApiError(400, str(e)) from None


class Handle:
    """Bridges one scheduler request to the event loop: the scheduler thread pushes, the handler awaits."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_tokens(self, tokens: list[int]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("tokens", list(tokens)))

    def on_logprobs(self, logprobs: list) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("logprobs", logprobs))

    def on_done(self, reason: str, error: str | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("done", (reason, error)))

    def end(self, message: str) -> None:
        """End the request now (on the event loop): its handler answers 503 or an SSE error event."""
        self.queue.put_nowait(("done", ("shutdown", message)))


class InFlight:
    """The requests this server is answering, and the shutdown drain: once `drain` is called new requests
    get 503 at once, and when the deadline passes every request still running is ended with a clean error."""

    def __init__(self):
        # handle -> its scheduler request; kept here, not on the handle, because the request already points
        # at the handle (its callbacks): a cycle would keep a finished request's caches until a full GC
        self.handles: dict[Handle, SchedRequest] = {}
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
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

    def submit(job: Prepared, loop: asyncio.AbstractEventLoop) -> list[Choice]:
        """Admit the request's n continuations (the first reads the prompt, the others fork from it); all or
        none: a refusal of any of them withdraws the others."""
        inflight.check_open()
        choices: list[Choice] = []
        try:
            for i, cfg in enumerate(job.choice_configs()):
                handle = Handle(loop)
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
        choices = submit(job, asyncio.get_running_loop())
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


@dataclass(eq=False)
class Choice:
    """One continuation of a request: its scheduler request, the handle it reports through, its text."""

    index: int
    handle: Handle
    req: SchedRequest
    text: TextStream


def usage(job: Prepared, choices: list[Choice]) -> dict:
    """OpenAI's usage: the prompt counted once, every continuation's tokens."""
    n, out = len(job.ids), sum(c.req.tokens for c in choices)
    return {"prompt_tokens": n, "completion_tokens": out, "total_tokens": n + out}


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


async def stream_events(choices: list[Choice], job: Prepared, meta: dict, frontend: Frontend, inflight: InFlight):
    """SSE chunks of every continuation as they come (each chunk names its choice's index)."""
    chat = job.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    offsets = [0] * len(choices)  # characters sent per choice (completions' text_offset)

    def chunk(i: int, delta: str | None, reason: str | None, lps: list, role: bool = False) -> str:
        logprobs = None
        if job.cfg.logprobs is not None and lps:
            logprobs = frontend.chat_logprobs(lps) if chat else frontend.completion_logprobs(lps, offsets[i])
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
            choice = {"index": i, "delta": d, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": i, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
            offsets[i] += len(delta or "")
        return "data: " + json.dumps({**meta, "object": obj, "choices": [choice]}) + "\n\n"

    merged: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        async for item in events(c.handle, c.req, c.text):
            await merged.put((c.index, *item))

    pumps = [asyncio.create_task(pump(c)) for c in choices]
    try:
        if chat:
            for c in choices:
                yield chunk(c.index, None, None, [], role=True)
        finished = 0
        while finished < len(choices):
            i, delta, reason, lps = await merged.get()
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
            yield "data: " + json.dumps({**meta, "object": obj, "choices": [], "usage": usage(job, choices)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or we are done): free the requests' slots at the next round
        for task in pumps:
            task.cancel()
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


def resident_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def prometheus(snap: dict) -> str:
    """Prometheus text exposition of a metrics snapshot."""
    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]], prefix: str = "castspec_"):
        lines.append(f"# HELP {prefix}{name} {help_}")
        lines.append(f"# TYPE {prefix}{name} {kind}")
        lines.extend(f"{prefix}{name}{labels} {value}" for labels, value in samples)

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
    metric("process_resident_memory_bytes", "gauge", "Resident memory of the server process.",
           [("", snap["rss_bytes"])], prefix="")
    return "\n".join(lines) + "\n"

"""Request body -> (token ids, DecodeConfig): every limit and check of a server, as one blocking call that any ingress
(the FastAPI app in server.py, the Ray Serve ingress in ray_serve.py) runs off its event loop.

`ServerConfig` holds what a server accepts; `Frontend.prepare` parses the JSON (protocol.py's models), checks the
limits, tokenizes (chat templates included) and builds the DecodeConfig; a refusal is an `ApiError` with its
HTTP status. The frontend also turns log-probabilities into OpenAI's JSON shapes.
"""
from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, replace

import jinja2
from jinja2 import meta
from pydantic import ValidationError

from ..config import ConfigError, DecodeConfig
from ..sampling import choice_seed
from ..sequence import ContextLengthError, check_request
from .protocol import ApiError, ChatBody, CompletionBody, finite_logprob, text_chars, validation_message
from .textstream import TextStream


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

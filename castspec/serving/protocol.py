"""The OpenAI wire format this server speaks: the request bodies it accepts (pydantic models that refuse unknown
fields), its error answers (`ApiError` and OpenAI's error JSON), and the checks on raw JSON that pydantic cannot make
(text that is not valid Unicode, its length before tokenizing)."""
from __future__ import annotations

import math
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator


INT64 = 2 ** 63  # seeds are 64-bit signed integers
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (vLLM's default limit)


def finite_logprob(value: float) -> float:
    """JSON has no -Infinity: a token outside the processed law's support reports -9999, as vLLM does."""
    return value if math.isfinite(value) else -9999.0


def finite(default: float, **bounds):
    """A float field that must be a finite number (JSON parsers accept NaN and Infinity)."""
    return Field(default=default, allow_inf_nan=False, **bounds)


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


class ApiError(Exception):
    """A refused request: its HTTP status, the message for the client and OpenAI's error type."""

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

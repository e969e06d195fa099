"""`castspec serve` driven by the official `openai` Python client over loopback: every supported parameter,
streamed and not, log-probabilities, seeds, n > 1, penalties, content parts, and the 4xx of what is not
supported."""
import math

import openai
import pytest

from castspec.config import DecodeConfig
from castspec.decode import decode
from castspec.engine import Engine
from castspec.serving.live import LiveServer
from castspec.sampling import choice_seed
from castspec.serving.scheduler import SchedulerConfig
from castspec.serving.frontend import ServerConfig
from castspec.serving.server import create_app
from conftest import llama_config, make_hf, native, random_drafter, tiny_tokenizer

MSGS = [{"role": "user", "content": "w3 w4 w5 w6"}]


@pytest.fixture(scope="module")
def engine():
    target = native(make_hf(llama_config(vocab=24, max_position_embeddings=256), seed=1))
    return Engine(target, tiny_tokenizer(24), random_drafter(target, block_size=8, seed=2))


@pytest.fixture(scope="module")
def client(engine):
    sched = engine.scheduler(SchedulerConfig(max_batch=8, policy="shared", width=16), "cast")
    with LiveServer(create_app(engine, sched, ServerConfig(model_name="tiny"))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ar(engine, ids, n, **kw):
    kw.setdefault("stop_token_ids", engine.stop_ids())
    cfg = DecodeConfig(method="ar", max_new_tokens=n, **kw)
    lps = [] if kw.get("logprobs") is not None else None
    return [t for c in decode(engine.target, None, ids, cfg, logprobs=lps) for t in c], lps


def text(engine, ids):
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_plain_and_streamed_equal_ar(client, engine):
    ids = engine.encode(messages=MSGS)
    truth, _ = ar(engine, ids, 16)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == text(engine, truth)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(truth)
    stream = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text(engine, truth)
    assert chunks[-1].usage.completion_tokens == len(truth)


def test_chat_logprobs_are_the_targets(client, engine):
    ids = engine.encode(messages=MSGS)
    truth, lps = ar(engine, ids, 10, logprobs=3)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(truth)
    for got, want in zip(content, lps):
        assert got.token == engine.tokenizer.decode([want.token])
        assert math.isclose(got.logprob, want.logprob, abs_tol=1e-4)
        assert [t.token for t in got.top_logprobs] == [engine.tokenizer.decode([t]) for t, _ in want.top]
        assert got.bytes == list(got.token.encode())
    # streamed: the same entries, spread over the chunks
    stream = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completions_logprobs_shape(client, engine):
    prompt = [4, 5, 6, 7]
    truth, lps = ar(engine, prompt, 8, logprobs=2)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [engine.tokenizer.decode([x.token]) for x in lps]
    assert all(math.isclose(a, b.logprob, abs_tol=1e-4) for a, b in zip(lp.token_logprobs, lps))
    assert all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_seed_reproduces_and_n_gives_independent_choices(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=12, temperature=1.0)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert a == b
    r = client.chat.completions.create(seed=7, n=4, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].message.content == a  # the first continuation keeps the request's seed
    assert len({c.message.content for c in r.choices}) > 1
    # each continuation is the single request with its own seed; usage counts the prompt once
    singles = [client.chat.completions.create(seed=choice_seed(7, i), **kw) for i in range(4)]
    assert [c.message.content for c in r.choices] == [x.choices[0].message.content for x in singles]
    assert r.usage.completion_tokens == sum(x.usage.completion_tokens for x in singles)
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    again = client.chat.completions.create(seed=7, n=4, **kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    stream = client.chat.completions.create(seed=7, n=4, stream=True, **kw)
    parts = {i: "" for i in range(4)}
    for c in stream:
        for ch in c.choices:
            parts[ch.index] += ch.delta.content or ""
    assert [parts[i] for i in range(4)] == [c.message.content for c in r.choices]


def test_penalties_bias_and_stop_tokens_apply(client, engine):
    ids = engine.encode(messages=MSGS)
    truth, _ = ar(engine, ids, 14, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={9: 5.0}, min_tokens=3)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=14, temperature=0,
                                       presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"9": 5.0},
                                       extra_body={"min_tokens": 3})
    assert r.choices[0].message.content == text(engine, truth)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=14, temperature=0,
                                       extra_body={"repetition_penalty": 1.5, "stop_token_ids": [truth[1]]})
    rep, _ = ar(engine, ids, 14, repetition_penalty=1.5, stop_token_ids=tuple(sorted({*engine.stop_ids(), truth[1]})))
    assert r.choices[0].message.content == text(engine, rep)


def test_content_parts_and_max_completion_tokens(client, engine):
    parts = [{"role": "user", "content": [{"type": "text", "text": "w3 w4"}, {"type": "text", "text": "w5 w6"}]}]
    joined = [{"role": "user", "content": "w3 w4\nw5 w6"}]
    r = client.chat.completions.create(model="tiny", messages=parts, max_completion_tokens=9, temperature=0)
    truth, _ = ar(engine, engine.encode(messages=joined), 9)
    assert r.choices[0].message.content == text(engine, truth)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens == len(truth)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, response_format={"type": "text"})
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("kw,needle", [
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     "messages.0.content"),
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(n=99), "n:"),
    (dict(logit_bias={"99999": 1.0}), "logit_bias"),
    (dict(logit_bias={"3": 500.0}), "logit_bias"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
    (dict(extra_body={"min_tokens": 100}, max_tokens=5), "min_tokens"),
    (dict(extra_body={"best_of": 2}), "best_of"),
])
def test_unsupported_or_invalid_parameters_are_clear_400s(client, kw, needle):
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert e.value.status_code == 400
    assert needle in e.value.body["message"] if isinstance(e.value.body, dict) else needle in str(e.value)

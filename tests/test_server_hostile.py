"""Hostile and careless input: every case gets its 4xx with a message that names the problem, /health keeps
answering within a second while the bad request is handled, and other requests' outputs stay exact."""
import asyncio
import gc
import json
import random
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from castspec.config import DecodeConfig
from castspec.decode import decode
from castspec.engine import Engine
from castspec.sequence import Sequence
from castspec.serving.live import LiveServer
from castspec.serving.scheduler import Request, Scheduler, SchedulerConfig
from castspec.serving.frontend import ServerConfig
from castspec.serving.server import create_app
from castspec.serving.textstream import Detokenizer, StopMatcher, TextStream
from conftest import llama_config, make_hf, native, random_drafter, tiny_tokenizer

HEALTH_S = 1.0  # the longest /health may take while a bad request is being handled


@pytest.fixture(scope="module")
def engine():
    target = native(make_hf(llama_config(vocab=24, max_position_embeddings=256), seed=1))
    return Engine(target, tiny_tokenizer(24), random_drafter(target, block_size=8, seed=2))


def serve(engine, **limits):
    sched = engine.scheduler(SchedulerConfig(max_batch=4, policy="shared", width=16), "cast")
    return LiveServer(create_app(engine, sched, ServerConfig(model_name="tiny", **limits)))


@pytest.fixture(scope="module")
def url(engine):
    with serve(engine, max_body_bytes=2 ** 20) as u:
        yield u


def ar_text(engine, ids, n):
    cfg = DecodeConfig(method="ar", max_new_tokens=n, stop_token_ids=engine.stop_ids())
    return engine.tokenizer.decode([t for c in decode(engine.target, None, ids, cfg) for t in c],
                                   skip_special_tokens=True)


def while_health(url, send):
    """Run send() on a thread and poll /health until it returns: (send's result, slowest /health in s)."""
    box = {}

    def run():
        try:
            box["result"] = send()
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    slowest = 0.0
    with httpx.Client(base_url=url, timeout=10) as client:
        while thread.is_alive():
            t = time.perf_counter()
            assert client.get("/health").status_code == 200
            slowest = max(slowest, time.perf_counter() - t)
            time.sleep(0.02)
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"], slowest


def post(url, path, content, **kw):
    if not isinstance(content, (bytes, str)) and not callable(content):
        content = json.dumps(content)  # ASCII escapes, so a lone surrogate travels as JSON allows
    return httpx.post(url + path, content=content() if callable(content) else content,
                      headers={"content-type": "application/json"}, timeout=60, **kw)


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "w3 w4"}]


def chunked_body():
    yield b'{"prompt": "'
    for _ in range(200):
        yield b"w1 " * 10_000
    yield b'"}'


HOSTILE = [  # (id, endpoint, body, status, what the message must say)
    ("body-over-limit", COMP, b'{"prompt": "' + b"w1 " * 1_000_000 + b'"}', 413, "exceeds this server's limit"),
    ("chunked-body-over-limit", COMP, chunked_body, 413, "exceeds this server's limit"),
    ("prompt-chars", COMP, {"prompt": "w1 " * 5000}, 400, "characters"),
    ("chat-prompt-chars", CHAT, {"messages": [{"role": "user", "content": "w2 " * 5000}]}, 400, "characters"),
    ("many-stop-strings", COMP, {"prompt": "w1", "max_tokens": 8, "stop": ["w5" * 2500] * 100}, 400, "stop strings"),
    ("long-stop-string", COMP, {"prompt": "w1", "max_tokens": 8, "stop": ["w5" * 2500]}, 400, "per string"),
    ("many-messages", CHAT, {"messages": MSG * 2000}, 400, "messages"),
    ("request-chat-template", CHAT, {"messages": MSG, "chat_template_kwargs": {
        "chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"}},
     400, "--allow-request-chat-template"),
    ("tokenizer-option", CHAT, {"messages": MSG, "chat_template_kwargs": {"return_tensors": "pt"}}, 400,
     "return_tensors"),
    ("seed-2^64", COMP, {"prompt": "w1", "seed": 2 ** 64}, 400, "seed"),
    ("max_tokens-0", COMP, {"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ("nan-temperature", COMP, b'{"prompt": "w1", "temperature": NaN}', 400, "temperature: input should be a finite"),
    ("infinite-top_p", COMP, b'{"prompt": "w1", "top_p": Infinity}', 400, "top_p: input should be a finite"),
    ("lone-surrogate", COMP, {"prompt": "w1 \ud800"}, 400, "prompt: text is not valid unicode"),
    ("lone-surrogate-chat", CHAT, {"messages": [{"role": "user", "content": "\udc00"}]}, 400, "not valid unicode"),
    ("not-utf8", COMP, b'{"prompt": "w1 \xff\xfe"}', 400, "not valid utf-8"),
    ("nested-too-deep", COMP, b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
]


@pytest.mark.parametrize("path, body, status, needle", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_request_gets_a_4xx_and_health_stays_responsive(engine, url, path, body, status, needle):
    r, slowest = while_health(url, lambda: post(url, path, body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower() and err["code"] == status
    assert "\n" not in err["message"]
    assert slowest < HEALTH_S
    ok = post(url, COMP, {"prompt": [3, 4], "max_tokens": 3})  # and the server still works
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_hostile_requests_beside_running_ones_leave_their_outputs_exact(engine, url):
    prompts = [[4, 5, 6], [7, 8], [9, 10, 11, 12]]
    truth = [ar_text(engine, p, 40) for p in prompts]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def good(p):
                r = await client.post(COMP, json={"prompt": p, "max_tokens": 40, "temperature": 0})
                return r.json()["choices"][0]["text"]

            async def bad(path, body):
                content = (b"".join(body()) if callable(body) else body if isinstance(body, bytes)
                           else json.dumps(body))
                return (await client.post(path, content=content)).status_code

            return await asyncio.gather(*(good(p) for p in prompts), *(bad(h[1], h[2]) for h in HOSTILE))

    results = asyncio.run(main())
    assert results[:3] == truth
    assert results[3:] == [h[3] for h in HOSTILE]


def test_tokenizing_a_long_prompt_does_not_block_other_clients(engine):
    """A prompt at a (raised) character limit is tokenized on a worker thread: /health answers meanwhile."""
    with serve(engine, max_body_bytes=16 * 2 ** 20, max_prompt_chars=4_000_000) as u:
        r, slowest = while_health(u, lambda: post(u, COMP, {"prompt": "w1 w2 " * 600_000, "max_tokens": 4}))
    assert r.status_code == 400 and "exceeds the model's context" in r.json()["error"]["message"]
    assert slowest < HEALTH_S


def slow_template(engine, seconds: float) -> tuple[str, float]:
    """A chat template whose render takes at least `seconds` on this machine, and the time one render took."""
    outer = 1000
    while True:
        # jinja's sandbox refuses a range of more than 100,000 items: the outer count goes in two loops
        reps, per = -(-outer // 100_000), min(outer, 100_000)
        slow = ("{% for h in range(" + str(reps) + ") %}{% for i in range(" + str(per) + ") %}"
                "{% for j in range(1000) %}{% endfor %}{% endfor %}{% endfor %}"
                "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}<assistant>")
        t = time.perf_counter()
        engine.encode(messages=MSG, chat_template_kwargs={"chat_template": slow})
        took = time.perf_counter() - t
        if took >= seconds:
            return slow, took
        outer = int(outer * min(8.0, 1.2 * seconds / max(took, 1e-3)))


def test_request_chat_templates_run_off_the_event_loop_when_the_operator_allows_them(engine):
    # sized on the machine that runs the test: a fixed loop count renders too fast on a fast CPU to tell a
    # blocked /health from a free one
    slow, render_s = slow_template(engine, seconds=3 * HEALTH_S)
    with serve(engine, allow_request_chat_template=True) as u:
        t = time.perf_counter()
        r, slowest = while_health(u, lambda: post(u, CHAT, {"messages": MSG, "max_tokens": 4, "temperature": 0,
                                                            "chat_template_kwargs": {"chat_template": slow}}))
        took = time.perf_counter() - t
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(engine.encode(messages=MSG))
        # the server rendered it (the request lasted about one render) and /health did not wait for the render
        assert took > render_s / 2 and slowest < HEALTH_S and slowest < took / 3
        bad = post(u, CHAT, {"messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 1 / 0 }}"}})
        assert bad.status_code == 400 and "could not tokenize" in bad.json()["error"]["message"]
        bad = post(u, CHAT, {"messages": MSG, "chat_template_kwargs": {"chat_template": "{% for %}"}})
        assert bad.status_code == 400 and "does not parse" in bad.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template_and_nothing_else(engine):
    tok = tiny_tokenizer(24)
    tok.chat_template = ("{% if enable_thinking %}w9 {% endif %}{% for m in messages %}<user> {{ m['content'] }} "
                         "{% endfor %}<assistant>")
    thinking = Engine(engine.target, tok, engine.drafter)
    sched = thinking.scheduler(SchedulerConfig(max_batch=2, policy="fixed", width=4), "cast")
    with LiveServer(create_app(thinking, sched)) as u:
        def prompt_tokens(kwargs):
            r = post(u, CHAT, {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": kwargs})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        base = prompt_tokens({})
        assert prompt_tokens({"enable_thinking": True}) == base + 1
        assert prompt_tokens({"enable_thinking": False, "unused_variable": 1}) == base  # unread: dropped
        for option in ("tokenize", "padding", "return_dict", "add_generation_prompt", "messages", "eos_token"):
            r = post(u, CHAT, {"messages": MSG, "chat_template_kwargs": {option: True}})
            assert r.status_code == 400 and f"chat_template_kwargs.{option}" in r.json()["error"]["message"]


def test_a_failing_sequence_inside_a_batched_round_fails_alone(engine):
    """A request whose rows break the shared forward (here a prompt holding a tensor, what `return_tensors`
    used to let through) gets an error; the others in its round keep their exact outputs."""
    sched = Scheduler(engine.target, engine.drafter, SchedulerConfig(max_batch=4, policy="shared", width=12))
    prompts = [[4, 5, 6], [7, 8], [9, 10, 11]]
    truth = [engine.tokenizer.encode(ar_text(engine, p, 20)) for p in prompts]
    outs = {i: [] for i in range(4)}
    reasons = {}
    for i, p in enumerate(prompts[:2] + [[torch.tensor([1, 2, 3])]] + prompts[2:]):
        sched.submit(Request(p, DecodeConfig(max_new_tokens=20, stop_token_ids=engine.stop_ids()), outs[i].extend,
                             lambda r, e, i=i: reasons.setdefault(i, (r, e))))
    for _ in range(200):
        if not sched.step():
            break
    assert reasons[2][0] == "error" and outs[2] == []
    for i, j in ((0, 0), (1, 1), (3, 2)):
        assert engine.tokenizer.decode(outs[i], skip_special_tokens=True) == \
            engine.tokenizer.decode(truth[j], skip_special_tokens=True)
        assert reasons[i][0] in ("stop", "length")


# -- text out: linear stop strings, incremental detokenization ---------------------------------------------------

class Letters:
    """A tokenizer whose token i is the letter chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def first_stop(text, stops):
    """Reference: the text before the first stop string to appear in full (the longest if several end there)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            return text[:end - len(max(done, key=len))], True
    return text, False


def test_stop_strings_match_the_reference_in_any_chunking():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 4))]
        ids = [rng.randint(0, 2) for _ in range(rng.randint(0, 20))]
        ts, out, i = TextStream(Letters(), stops), "", 0
        while i < len(ids) and not ts.stopped:
            k = rng.randint(1, 3)
            out += ts.add(ids[i:i + k])
            i += k
        if not ts.stopped:
            out += ts.add([], final=True)
        assert (out, ts.stopped) == first_stop("".join(chr(97 + t) for t in ids), stops), (stops, ids)


def test_stop_matching_is_linear_in_the_text():
    """16 stop strings of 1024 characters that the text keeps almost matching: the old tail check cost
    O(stops x length^2) per token; the automaton costs O(1) per character."""
    stops = ["a" * 1023 + chr(98 + i % 4) + "a" * (i // 4) for i in range(16)]
    m = StopMatcher(stops)
    ts = TextStream(Letters(), ["a" * 1023 + "b"])
    t = time.perf_counter()
    assert m.feed("a" * 50_000) is None and m.partial == 1023
    sent = "".join(ts.add([0]) for _ in range(5000))
    took = time.perf_counter() - t
    assert sent == "a" * (5000 - 1023) and not ts.stopped  # the tail that could start the stop string waits
    assert took < 2.0
    assert m.feed("f") is None and m.partial == 0 and m.feed("a" * 1023 + "c") == 1024 and m.matched == 1024


def test_incremental_detokenization_equals_decoding_everything(engine):
    tok = engine.tokenizer
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(24) for _ in range(rng.randint(0, 30))]
        d, out, i = Detokenizer(tok), "", 0
        while i < len(ids):
            k = rng.randint(1, 4)
            out += d.add(ids[i:i + k])
            i += k
        out += d.add([], final=True)
        assert out == tok.decode(ids, skip_special_tokens=True)


def test_server_config_refuses_nonsense_limits():
    for bad, needle in (({"max_body_bytes": 0}, "max_body_bytes"), ({"max_prompt_chars": 0}, "max_prompt_chars"),
                        ({"max_stop_strings": -1}, "max_stop_strings"),
                        ({"shutdown_timeout_s": float("nan")}, "shutdown_timeout_s")):
        with pytest.raises(ValueError, match=needle):
            ServerConfig(**bad)
    assert ServerConfig().prompt_char_limit(8192) == 32 * 8192
    assert ServerConfig(max_prompt_chars=10).prompt_char_limit(8192) == 10


def test_finished_requests_free_their_caches_without_waiting_for_the_garbage_collector(engine):
    """No reference cycle holds a finished request's Sequence (and its KV caches): with the cyclic collector off,
    20 finished requests leave at most the last one behind."""
    sched = engine.scheduler(SchedulerConfig(max_batch=4, policy="shared", width=16), "cast")
    gc.collect()
    gc.disable()
    try:
        with TestClient(create_app(engine, sched)) as client:
            for i in range(20):
                r = client.post(COMP, json={"prompt": "w1 w2", "max_tokens": 8, "stream": i % 2 == 0})
                assert r.status_code == 200
            live = sum(isinstance(o, Sequence) for o in gc.get_objects())
    finally:
        gc.enable()
    assert live <= 1

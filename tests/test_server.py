"""The OpenAI-compatible HTTP API: schema, exact outputs, streaming chunks, validation, 429, disconnects."""
import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from castspec.config import DecodeConfig
from castspec.decode import decode
from castspec.engine import Engine
from castspec.serving.live import LiveServer
from castspec.cli.loadtest import parse_spec
from castspec.serving.loadtest import chat_body, one_request, run_conversations, run_load, session, summarize
from castspec.serving.scheduler import Request, SchedulerConfig
from castspec.serving.frontend import ServerConfig
from castspec.serving.server import Chunks, Mailbox, TextStream, create_app
from conftest import llama_config, make_hf, native, random_drafter, tiny_tokenizer


@pytest.fixture(scope="module")
def engine():
    target = native(make_hf(llama_config(vocab=24, max_position_embeddings=256), seed=1))
    return Engine(target, tiny_tokenizer(24), random_drafter(target, block_size=8, seed=2))


def make_app(engine, **kw):
    cfg = SchedulerConfig(**{"max_batch": 4, "policy": "shared", "width": 16, **kw})
    return create_app(engine, engine.scheduler(cfg, "cast"), ServerConfig(model_name="tiny"))


def ar_tokens(engine, ids, n):
    cfg = DecodeConfig(method="ar", max_new_tokens=n, stop_token_ids=engine.stop_ids())
    return [t for c in decode(engine.target, None, ids, cfg) for t in c]


def sse(lines):
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_prompt_read_before_is_copied_and_says_so(engine):
    """The same prompt twice, then a next turn (prompt, answer, more): the later requests copy what was read
    (usage.prompt_tokens_details.cached_tokens, as OpenAI and vLLM report it) and answer exactly as alone."""
    with TestClient(make_app(engine)) as client:
        prompt = [4, 5, 6, 7, 8, 9, 10, 11]
        first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
        again = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
        answer = ar_tokens(engine, prompt, 12)
        assert first["choices"][0]["text"] == again["choices"][0]["text"]
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) - 1}
        turn = prompt + answer + [12, 13]
        nxt = client.post("/v1/completions", json={"prompt": turn, "max_tokens": 12, "temperature": 0}).json()
        assert nxt["choices"][0]["text"] == engine.tokenizer.decode(ar_tokens(engine, turn, 12),
                                                                    skip_special_tokens=True)
        assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) + len(answer) - 1
        snap = client.get("/metrics?format=json").json()
        assert snap["prefix_hits"] == 2 and snap["prefix_hit_tokens"] >= 2 * len(prompt) + len(answer) - 2


def test_completions_chat_models_health_metrics(engine):
    with TestClient(make_app(engine)) as client:
        assert client.get("/health").json()["status"] == "ok"
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        prompt = [4, 5, 6, 7]
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        truth = ar_tokens(engine, prompt, 20)
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == engine.tokenizer.decode(truth, skip_special_tokens=True)
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": len(truth), "total_tokens": 4 + len(truth),
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert body["choices"][0]["finish_reason"] in ("stop", "length")

        msgs = [{"role": "user", "content": "w3 w4 w5"}]
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        ids = engine.encode(messages=msgs)
        assert r.json()["choices"][0]["message"] == {
            "role": "assistant", "content": engine.tokenizer.decode(ar_tokens(engine, ids, 12), skip_special_tokens=True)}

        text = client.get("/metrics").text
        assert 'castspec_requests_total{reason="length"}' in text or 'castspec_requests_total{reason="stop"}' in text
        assert "castspec_accepted_tokens_bucket" in text and "castspec_batch_size_bucket" in text
        snap = client.get("/metrics?format=json").json()
        assert snap["tokens"] == len(truth) + r.json()["usage"]["completion_tokens"]
        assert snap["mean_committed_per_round"] >= 1.0


def test_streaming_chunks_concatenate_to_the_full_answer(engine):
    with TestClient(make_app(engine)) as client:
        body = {"messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 16, "temperature": 0}
        full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        with client.stream("POST", "/v1/chat/completions",
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks = sse(list(r.iter_lines()))
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == full
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finals[-1] in ("stop", "length") and all(f is None for f in finals[:-1])
        assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[-1]["object"] == "chat.completion.chunk"

        with client.stream("POST", "/v1/completions", json={"prompt": "w1 w2", "max_tokens": 10, "stream": True,
                                                            "temperature": 0}) as r:
            chunks = sse(list(r.iter_lines()))
        full = client.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 10, "temperature": 0}).json()
        assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


@pytest.mark.parametrize("body, status, needle", [
    ("{not json", 400, "JSON"),
    ({"prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 10 ** 6}, 400, "context"),
    ({"prompt": [1, 2], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 4, "bogus": 1}, 400, "bogus"),
    ({"prompt": [1, 2], "n": 2}, 400, "n"),
    ({"prompt": [1, 99]}, 400, "vocabulary"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1, 2], "model": "gpt-9"}, 404, "gpt-9"),
])
def test_bad_requests_get_4xx_with_a_message(engine, body, status, needle):
    with TestClient(make_app(engine)) as client:
        if isinstance(body, str):
            r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        else:
            r = client.post("/v1/completions", json=body)
        assert r.status_code == status, r.text
        assert needle.lower() in r.json()["error"]["message"].lower()
        # and the server still works
        assert client.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 3}).status_code == 200


def test_chat_validation(engine):
    with TestClient(make_app(engine)) as client:
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
        assert client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}).status_code == 400


def test_full_queue_answers_429_and_closed_answers_503(engine):
    scheduler = engine.scheduler(SchedulerConfig(max_batch=1, max_queue=1, policy="fixed", width=4), "cast")
    client = TestClient(create_app(engine, scheduler))  # no lifespan: no rounds run, the queue stays full
    scheduler.submit(Request([1, 2], DecodeConfig(max_new_tokens=2), lambda t: None, lambda r, e: None))
    r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 429 and "queue is full" in r.json()["error"]["message"]
    scheduler.close(threading.Event())
    r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 503


def test_stop_strings_cut_the_text():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    ts = TextStream(Tok(), ["cde"])
    assert ts.add([0, 1]) == "ab"
    assert ts.add([2]) == ""  # "c" may start the stop string: it waits
    assert ts.add([3, 4, 5]) == "" and ts.stopped
    ts = TextStream(Tok(), ["cx"])
    assert ts.add([0, 1, 2]) == "ab" and ts.add([3]) == "cd" and not ts.stopped
    assert ts.add([], final=True) == ""


def test_concurrent_requests_are_exact_and_disconnects_cancel(engine):
    scheduler = engine.scheduler(SchedulerConfig(max_batch=3, policy="shared", width=16), "cast")
    app = create_app(engine, scheduler, ServerConfig(model_name="tiny"))
    prompts = [[4, 5, 6], [7, 8], [9, 10, 11, 12, 13], [14], [15, 16, 17]]
    tokens = [ar_tokens(engine, p, 24) for p in prompts]
    truth = [engine.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    abandoned = [5, 5]
    # the abandoned request must still be running when its client leaves: greedy, no EOS within its budget, and
    # its rounds slowed down, so the test does not race the tiny model against disconnect detection
    assert len(ar_tokens(engine, abandoned, 200)) == 200
    plain_round = scheduler._round

    def slow_round(batch):
        plain_round(batch)
        if any(r.prompt == abandoned and not r.cancelled for r in batch):
            time.sleep(0.05)

    scheduler._round = slow_round
    with LiveServer(app) as url:
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                async def one(p):
                    r = await client.post("/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0})
                    return r.json()["choices"][0]["text"]

                async def abandon():
                    async with client.stream("POST", "/v1/completions",
                                             json={"prompt": abandoned, "max_tokens": 200, "temperature": 0,
                                                   "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                break  # the client goes away after the first chunk

                results = await asyncio.gather(*(one(p) for p in prompts), abandon())
                return results[:-1]

        assert asyncio.run(main()) == truth
        for _ in range(100):
            snap = httpx.get(f"{url}/metrics?format=json").json()
            if snap["requests"]["cancelled"] >= 1 and snap["active"] == 0:
                break
            time.sleep(0.05)
        assert snap["requests"]["cancelled"] == 1 and snap["active"] == 0
        assert snap["tokens"] < sum(map(len, tokens)) + 200  # the abandoned request stopped early


def test_loadtest_against_a_live_server(engine):
    msgs = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(1, 6)]
    results = []
    for spec in ("chain", "fixed:4", "shared:8"):
        method, policy, width = parse_spec(spec)
        sched = engine.scheduler(SchedulerConfig(max_batch=2, policy=policy, width=width), method)
        with LiveServer(create_app(engine, sched)) as url:
            res = asyncio.run(run_load(url, msgs, concurrency=2, requests=5, max_tokens=8))
        assert res["ok"] == 5 and res["errors"] == [] and res["tokens"] > 0
        assert res["p99_latency_s"] >= res["p50_latency_s"] > 0 and res["mean_committed_per_round"] >= 1
        assert 0 < res["client_cpu_s"] <= res["wall_s"]
        results.append({"policy": spec, "concurrency": 2, **res})
    with LiveServer(make_app(engine)) as url:  # a refused request is reported, with the server's message
        async def refused():
            async with session(url) as client:
                return await one_request(client, chat_body(msgs[0], max_tokens=0))
        res = asyncio.run(refused())
    assert res["error"].startswith("HTTP 400: ") and "max_tokens" in res["error"] and res["tokens"] == 0
    summary = summarize(results)["2"]
    assert summary["best_static"]["policy"] == "fixed:4" and "shared:8" in summary["vs_best_static"]
    with pytest.raises(ValueError, match="width"):
        parse_spec("fixed")
    with pytest.raises(ValueError, match="unknown"):
        parse_spec("widest")


def test_two_turn_chats_copy_the_first_turn_when_the_prefix_cache_is_on(engine):
    """The load test's --conversations: a second turn sends the first turn and its answer again; with kept prefixes
    the server copies them (usage's cached tokens), without it reads everything."""
    convs = [("w3 w4 w5 w6", "w7 w8"), ("w9 w10 w11", "w12")]
    for mb, copied in ((256.0, True), (0.0, False)):
        sched = engine.scheduler(SchedulerConfig(max_batch=2, policy="fixed", width=4, prefix_cache_mb=mb), "cast")
        with LiveServer(create_app(engine, sched)) as url:
            res = asyncio.run(run_conversations(url, convs, concurrency=2, max_tokens=6))
        first, second = res["turn1"], res["turn2"]
        assert res["conversations"] == 2 and first["ok"] == second["ok"] == 2 and second["errors"] == []
        assert second["prompt_tokens"] > first["prompt_tokens"]
        assert (second["cached_tokens"] >= first["prompt_tokens"]) if copied else second["cached_tokens"] == 0


def test_the_load_tests_load_a_running_server_by_url(engine, tmp_path):
    """`castspec loadtest --url` and `--conversations --url`: a server they did not start, at two levels."""
    from castspec.cli import main

    common = ["--url", None, "--requests", "2", "--concurrency", "1,2", "--max-tokens", "3", "--out", str(tmp_path)]
    with LiveServer(make_app(engine, max_batch=2)) as url:
        common[1] = url
        assert main(["loadtest", "--conversations"] + common) == 0
        assert main(["loadtest"] + common) == 0
    chats = json.loads((tmp_path / "conversations.json").read_text())["results"]
    assert [(r["policy"], r["concurrency"]) for r in chats] == [("external", 1), ("external", 2)]
    for res in chats:
        assert res["turn1"]["ok"] == res["turn2"]["ok"] == 2
        assert res["turn2"]["cached_tokens"] >= res["turn1"]["prompt_tokens"]
    loads = json.loads((tmp_path / "loadtest.json").read_text())["results"]
    assert [(r["policy"], r["concurrency"], r["ok"]) for r in loads] == [("external", 1, 2), ("external", 2, 2)]


def test_the_mailbox_wakes_the_loop_once_per_burst_and_keeps_each_queue_in_order():
    """Scheduler callbacks only collect; the after-callbacks hook hands a whole round over with one wakeup."""
    loop = asyncio.new_event_loop()
    try:
        box = Mailbox(loop)
        wakeups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda fn, *a: (wakeups.append(fn), original(fn, *a))[1]
        queues = [asyncio.Queue() for _ in range(3)]
        box.wake()  # nothing collected: no wakeup
        feeder = threading.Thread(target=lambda: ([box.put(q, ("tokens", [i, k])) for k in range(4)
                                                   for i, q in enumerate(queues)], box.wake()))
        feeder.start()
        feeder.join()
        assert len(wakeups) == 1 and all(q.empty() for q in queues)  # nothing delivered before the loop runs
        loop.run_until_complete(asyncio.sleep(0))
        for i, q in enumerate(queues):
            assert [q.get_nowait() for _ in range(q.qsize())] == [("tokens", [i, k]) for k in range(4)]
        box.wake()
        assert len(wakeups) == 1  # the burst was handed over: nothing to wake for
    finally:
        loop.close()


@pytest.mark.parametrize("chat", [True, False])
def test_a_text_chunk_made_from_its_template_is_the_chunk_json_makes(chat):
    job = SimpleNamespace(chat=chat, cfg=SimpleNamespace(logprobs=None))
    meta = {"id": "chatcmpl-1", "created": 7, "model": 'a "model"\0'}
    chunks = Chunks(job, meta, frontend=None, choices=2)
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent = 0
    for i, delta in [(0, "hi"), (1, ""), (0, 'q"uo\\te\n\0'), (1, "é€😀"), (0, "\u2028")]:
        key = ("delta", {"content": delta}) if chat else ("text", delta)
        choice = {"index": i, key[0]: key[1], "logprobs": None, "finish_reason": None}
        assert chunks(i, delta, None, []) == "data: " + json.dumps({**meta, "object": obj, "choices": [choice]}) + "\n\n"
        sent += len(delta) if i == 0 else 0
    assert chat or chunks.offsets[0] == sent  # completions count the characters sent per choice

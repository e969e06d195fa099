"""A real `castspec serve` process: SIGTERM with requests in flight ends within the deadline with clean client
errors, a second signal exits at once; `castspec loadtest --soak` against such a process."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from castspec.serving.live import free_port
from conftest import llama_config, make_hf, tiny_tokenizer

LONG = 20_000  # tokens a request asks for: far more than the tiny model makes before the deadline


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """A tiny HF target without tokenizer files (token-id prompts, no EOS: requests run to max_tokens)."""
    d = tmp_path_factory.mktemp("tiny-serve")
    make_hf(llama_config(vocab=32, max_position_embeddings=LONG + 64), seed=3).save_pretrained(d)
    return d


def start(target, *flags):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "castspec", "serve", "--target", str(target), "--method", "ar",
                             "--dtype", "fp32", "--host", "127.0.0.1", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail("castspec serve did not start")


def in_flight(url, n_plain, n_stream):
    """Start long requests on threads; returns (threads, results) once the server runs all of them."""
    results = {}

    def plain(i):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": LONG}, timeout=120)
        results[f"plain{i}"] = (r.status_code, r.json())

    def stream(i):
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={"prompt": [4, 5], "max_tokens": LONG, "stream": True}) as r:
            results[f"stream{i}"] = (r.status_code, [line for line in r.iter_lines() if line.startswith("data: ")])

    threads = [threading.Thread(target=plain, args=(i,)) for i in range(n_plain)]
    threads += [threading.Thread(target=stream, args=(i,)) for i in range(n_stream)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while httpx.get(f"{url}/health").json()["active"] < n_plain + n_stream:
        assert time.time() < deadline, "the requests never all ran"
        time.sleep(0.05)
    return threads, results


def test_sigterm_gives_requests_the_deadline_then_ends_them_cleanly(plain_dir):
    proc, url = start(plain_dir, "--shutdown-timeout", "3", "--max-batch", "4")
    try:
        threads, results = in_flight(url, n_plain=2, n_stream=2)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # a new request is refused at once: 503 while the socket closes, then no connection at all
            late = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=5)
            assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        except httpx.ConnectError:
            pass
        proc.wait(timeout=30)
        took = time.perf_counter() - t0
        for t in threads:
            t.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert 2.5 < took < 3 + 4, took  # the requests got the deadline; the process did not outlive it by much
    for i in range(2):
        status, body = results[f"plain{i}"]
        assert status == 503 and "shutdown deadline" in body["error"]["message"]
        status, lines = results[f"stream{i}"]
        assert status == 200 and lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][len("data: "):])["error"]
        assert err["code"] == 503 and "shutdown deadline" in err["message"]


def test_a_second_signal_exits_at_once(plain_dir):
    proc, url = start(plain_dir, "--shutdown-timeout", "60", "--max-batch", "2")
    try:
        threads, results = in_flight(url, n_plain=1, n_stream=1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # the first signal waits for the requests (up to 60 s)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.perf_counter() - t0 < 3
        for t in threads:
            t.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_bad_serve_flag_exits_2_with_one_line_before_loading(plain_dir):
    r = subprocess.run([sys.executable, "-m", "castspec", "serve", "--target", str(plain_dir / "missing"),
                        "--shutdown-timeout", "-1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "shutdown_timeout_s must be a finite number >= 0" in r.stderr


def test_soak_command_against_a_serve_process(tmp_path):
    """`castspec loadtest --soak`: mixed streaming/non-streaming with abandoned streams against a real server
    process; nothing left running, memory samples taken, the server exits on SIGTERM within its deadline."""
    d = tmp_path / "chatty"
    make_hf(llama_config(vocab=32, max_position_embeddings=2048), seed=4).save_pretrained(d)
    tiny_tokenizer(32).save_pretrained(d)
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, "-m", "castspec", "loadtest", "--soak", "--target", str(d), "--policies",
                        "ar", "--dtype", "fp32", "--requests", "40", "--concurrency", "6", "--max-tokens", "12",
                        "--abandon", "0.5", "--max-batch", "4", "--sample-every", "0.2", "--per-domain", "4",
                        "--time-limit", "120", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((out / "soak.json").read_text())
    assert rep["requests"] == 40 and rep["errors"] == 0, rep["error_samples"]
    assert rep["ok"] + rep["abandoned"] + rep["rejected_429"] == 40 and rep["abandoned"] >= 1
    assert 0 < rep["streamed"] < 40 and rep["p99_latency_s"] >= rep["p50_latency_s"] > 0
    assert rep["after"] == {"active": 0, "queued": 0}
    assert rep["server_requests"]["cancelled"] <= rep["abandoned"] and rep["server_requests"]["error"] == 0
    assert len(rep["samples"]) >= 2 and rep["rss_mb"]["max"] > 50
    assert rep["shutdown_s"] is not None and rep["shutdown_s"] < 10 + 5
    assert (out / "soak.png").stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "castspec", "loadtest", "--soak", "--url",
                          "http://10.0.0.1:8000", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "this machine" in bad.stderr

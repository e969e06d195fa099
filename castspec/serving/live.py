"""A server to talk to on this machine: an ASGI app in this process on a free loopback port (`LiveServer`: load
tests, the serving tax, the tests) or `castspec serve` as a child process (`ServeProcess`: the soak test).
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import uvicorn

from ..native.threads import release_workers


def free_port() -> int:
    """A loopback port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# how long a LiveServer keeps an idle connection open; a client that reuses connections must give them up
# sooner, or it may send a request on one the server is closing at that moment and read nothing back
KEEP_ALIVE_S = 5  # seconds: uvicorn's default, set here so that clients of a LiveServer (Ray replicas) stay under it


class LiveServer:
    """Serve an ASGI app with uvicorn on a free loopback port in a background thread."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    timeout_keep_alive=KEEP_ALIVE_S))
        self.thread = threading.Thread(target=self.server.run, name="castspec-live-server", daemon=True)

    def __enter__(self) -> str:
        # the app's scheduler computes on a thread of its own from now on: this thread (which loaded the models)
        # hands its OpenMP workers back, or the two pools would slow every forward down (native/threads.py)
        release_workers()
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_loopback(url: str) -> str:
    """Load tests only ever talk to this machine."""
    host = urlsplit(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"--url must point at this machine ({', '.join(LOOPBACK)}), got host {host!r}")
    return url.rstrip("/")


class ServeProcess:
    """`castspec serve` in a child process on a free loopback port; leaving the block sends SIGTERM and
    records how long the process took to exit (`shutdown_s`)."""

    def __init__(self, serve_args: list[str], log_path: Path, start_timeout: float = 600.0):
        self.port = free_port()
        self.args = [sys.executable, "-m", "castspec", "serve", "--host", "127.0.0.1", "--port",
                     str(self.port), *serve_args]
        self.log_path, self.start_timeout = log_path, start_timeout
        self.proc: subprocess.Popen | None = None
        self.shutdown_s: float | None = None

    def __enter__(self) -> str:
        url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + self.start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"castspec serve exited with status {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"castspec serve did not answer /health within {self.start_timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            t = time.perf_counter()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
                self.shutdown_s = time.perf_counter() - t
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

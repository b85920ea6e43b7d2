"""A local server child for benchmarks and tests: a free port, whether it is healthy (and, for
mlxserve, warmed up), and a child process that serves on it (`mlxserve serve` or another
OpenAI-compatible server) with its log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(base_url: str) -> bool:
    """Whether the server at `base_url` (no /v1) answers /health with 200; False while it cannot be reached."""
    try:
        return httpx.get(base_url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


class ChildServer:
    """A server command run as a child; its stdout and stderr go to a log file that outlives it."""

    def __init__(self, command: list[str], port: int, env: dict | None = None, name: str = "server"):
        self.command = command
        self.base_url = f"http://127.0.0.1:{port}"
        fd, self.log = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float, ready=None) -> float:
        """Seconds from now until `ready(base_url)` (default: a healthy /health); RuntimeError (with
        the log's tail) if the child exits first or is not ready within `timeout`."""
        ready = ready or healthy
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode} while starting (log: {self.log}); "
                                   f"its log ends:\n{self.log_tail()}")
            if ready(self.base_url):
                return time.monotonic() - start
            time.sleep(0.5)
        raise RuntimeError(f"not healthy within {timeout:.0f} s (log: {self.log}); its log ends:\n{self.log_tail()}")

    def log_tail(self, n: int = 15) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self, grace: float = 30) -> int:
        """SIGTERM (servers shut down cleanly on it), SIGKILL after `grace` seconds; the exit status.
        It returns once the process is gone, so the next server gets the device to itself."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def warmed(base_url: str) -> bool:
    """Whether the server at `base_url` is healthy and every loaded model's warm-up is over
    (engine/warmup.py: its phases run while the engine is idle, so a benchmark that starts its
    load before would have them between its requests, or after them)."""
    try:
        r = httpx.get(base_url + "/health", timeout=5)
    except httpx.HTTPError:
        return False
    if r.status_code != 200:
        return False
    body = r.json()
    infos = body["models"].values() if "models" in body else [body]
    return all(i.get("warmup", {}).get("state") not in ("pending", "running") for i in infos)

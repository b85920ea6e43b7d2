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
from pathlib import Path

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


def checkout_env() -> dict:
    """This process's environment with this checkout first on PYTHONPATH: a child `python -m
    mlxserve.cli` then runs the same code as this process, not an installed copy."""
    import mlxserve

    root = str(Path(mlxserve.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


class ChildServer:
    """A server command run as a child; its stdout and stderr go to a log file that outlives it
    (`log`, appended to, or a new temporary file named after `name`)."""

    stop_signal = signal.SIGTERM  # what stop() sends first: servers shut down cleanly on it
    stop_grace = 30.0  # seconds stop() waits for that before SIGKILL
    start_error = RuntimeError  # what wait_healthy raises (SystemExit: a failed start ends the command)

    def __init__(self, command: list[str], port: int, env: dict | None = None, name: str = "server",
                 log: str | Path | None = None):
        self.command, self.port = command, port
        self.base_url = f"http://127.0.0.1:{port}"
        if log is None:
            fd, log = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
            os.close(fd)
        self.log = str(log)
        self.started = time.monotonic()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_healthy(self, timeout: float, ready=None) -> float:
        """Seconds from launch until `ready(base_url)` (default: a healthy /health; `warmed` waits
        for mlxserve's warm-up too); `start_error` (with the log's tail) if the child exits first or
        is not ready within `timeout` seconds from now."""
        ready = ready or healthy
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.start_error(f"exited with {self.proc.returncode} while starting (log: {self.log}); "
                                       f"its log ends:\n{self.log_tail()}")
            if ready(self.base_url):
                return time.monotonic() - self.started
            time.sleep(0.1)
        raise self.start_error(f"not ready within {timeout:.0f} s (log: {self.log}); its log ends:\n{self.log_tail()}")

    def log_lines(self) -> list[str]:
        """The log's lines so far, without their line ends."""
        with open(self.log, errors="replace") as f:
            return f.read().splitlines()

    def log_tail(self, n: int = 15) -> str:
        return "".join(line + "\n" for line in self.log_lines()[-n:])

    def stop(self) -> int:
        """`stop_signal`, SIGKILL after `stop_grace` seconds; the exit status. It returns once the
        process is gone, so the next server gets the device to itself."""
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(self.stop_grace)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL (it ends a stopped process too), then reap it: an unreaped child still holds its
        pid, as if it were alive; the exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()


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

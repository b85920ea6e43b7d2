"""A local `mlxserve serve` child for benchmarks and tests: a free port, whether it is healthy, and warmed up."""

from __future__ import annotations

import socket

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

"""A local `mlxserve serve` child for benchmarks and tests: a free port, and whether it is healthy."""

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

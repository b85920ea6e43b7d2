"""The servers `mlxserve bench serve --start` can run on one model folder: mlxserve and its peers.

Each is started as a child on a free port in its best mode for many concurrent streams, measured,
and stopped before the next starts, so no two share the device. A peer may live in its own
folder of packages (`--peer-path NAME=DIR`, put first on the child's PYTHONPATH): vllm-mlx pins
an older mlx-lm than mlxserve, so it is installed apart (see .gpu-peers/setup.sh in the README).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from typing import Callable

from mlxserve.bench.local import ChildServer, free_port, healthy, warmed


@dataclass(frozen=True)
class Peer:
    name: str
    module: str  # run as `python -m MODULE`
    args: tuple[str, ...]  # before --host/--port; {model} is the model folder
    packages: tuple[str, ...]  # whose versions the result records
    model: str | None = None  # the name to request; None: the server's first /v1/models entry
    honours_ignore_eos: bool = True
    note: str = ""
    env: dict = field(default_factory=dict)
    ready: Callable[[str], bool] = healthy  # when to start the load (its base URL, no /v1)


PEERS = {p.name: p for p in (
    # Its warm-up runs while the engine is idle: the load starts after it, as a user's would.
    Peer("mlxserve", "mlxserve.cli", ("serve", "{model}"), ("mlxserve", "mlx", "mlx-lm"), ready=warmed),
    # Batches concurrent requests by default (--decode-concurrency 32, --prompt-concurrency 8).
    Peer("mlx_lm", "mlx_lm.server", ("--model", "{model}"), ("mlx-lm", "mlx"), model="default_model",
         honours_ignore_eos=False, note="batches by default (--decode-concurrency 32)"),
    # Without --continuous-batching it serves one request at a time.
    Peer("vllm-mlx", "vllm_mlx.cli", ("serve", "{model}", "--continuous-batching"),
         ("vllm-mlx", "mlx-lm", "mlx"), honours_ignore_eos=False,
         note="--continuous-batching (without it, one request at a time)"),
)}


def peer_of(label: str) -> Peer | None:
    """The peer a `--start` label names: `NAME`, or `NAME@VARIANT` (the same server started again,
    with its own --peer-args, e.g. mlxserve@paged), None if NAME is no known peer."""
    return PEERS.get(label.partition("@")[0])


def parse_pairs(values: list[str] | None, what: str) -> dict[str, str]:
    """`LABEL=VALUE` flags (given several times) as a dict, each LABEL a known peer (`NAME` or
    `NAME@VARIANT`)."""
    out = {}
    for v in values or []:
        name, sep, value = v.partition("=")
        if not sep or peer_of(name) is None:
            raise SystemExit(f"--{what}: expected NAME=VALUE with NAME one of {', '.join(PEERS)} "
                             f"(or NAME@VARIANT); got {v!r}")
        out[name] = value
    return out


def child_env(peer: Peer, path: str | None, home: str) -> dict:
    from mlxserve._cuda import without_our_defaults

    env = without_our_defaults(os.environ)  # a peer runs on MLX's own settings, not mlxserve's
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.expanduser(path), env.get("PYTHONPATH")) if p)
    if peer.name == "vllm-mlx":
        # vllm-mlx keeps its prefix cache in ~/.cache/vllm-mlx across restarts, keyed by the model's
        # path, and the benchmark's prompts repeat from run to run (seeded): a fresh HOME keeps an
        # earlier run's cache from turning misses into hits.
        env["HOME"] = home
    return env


def versions(peer: Peer, env: dict) -> dict:
    """The peer's package versions as its child will import them; RuntimeError if it cannot import."""
    code = ("import importlib, importlib.metadata as md, json, sys\n"
            f"importlib.import_module({peer.module.split('.')[0]!r})\n"
            "def version(p):\n"
            "    try:\n"
            "        return md.version(p)\n"
            "    except md.PackageNotFoundError:  # run from a source tree (PYTHONPATH), not installed\n"
            "        return getattr(importlib.import_module(p.replace('-', '_')), '__version__', 'unknown')\n"
            f"print(json.dumps({{p: version(p) for p in {list(peer.packages)!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"cannot import {peer.module} ({last}); give its packages with "
                           f"--peer-path {peer.name}=DIR")
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


class Started:
    """`with Started(peer, model_dir, ...) as s:` a healthy peer at s.url (its /v1), stopped on exit."""

    def __init__(self, peer: Peer, model_dir: str, path: str | None = None, extra_args: str = "",
                 timeout: float = 300):
        self.peer, self.timeout = peer, timeout
        self.home = tempfile.mkdtemp(prefix=f"{peer.name}-home-")
        self.env = child_env(peer, path, self.home)
        self.port = free_port()
        self.command = [sys.executable, "-m", peer.module, *(a.format(model=model_dir) for a in peer.args),
                        "--host", "127.0.0.1", "--port", str(self.port), *shlex.split(extra_args)]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.child = None
        self.versions: dict = {}
        self.startup_s = 0.0

    def __enter__(self):
        self.versions = versions(self.peer, self.env)
        print(f"starting {self.peer.name}: {shlex.join(self.command)}", file=sys.stderr)
        self.child = ChildServer(self.command, self.port, self.env, self.peer.name)
        try:
            self.startup_s = self.child.wait_healthy(self.timeout, self.peer.ready)
        except BaseException:
            self.child.stop()
            raise
        return self

    def __exit__(self, *exc):
        if self.child is not None:
            self.child.stop()
        import shutil

        shutil.rmtree(self.home, ignore_errors=True)

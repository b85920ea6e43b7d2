"""One model served by several processes (ranks) with MLX's own distributed engine.

Started by `mlx.launch` (ring over TCP, JACCL over Thunderbolt 5, MPI, or NCCL on CUDA),
every rank loads its part of the model through mlx-lm's own sharding
(models/sharding.py) and runs the same engine: scheduler, runner, prefix cache
bookkeeping and samplers, step for step. Rank 0 alone serves HTTP, tokenizes and
detokenizes. Before each step it sends the other ranks the step's plan: the
commands its engine applies (adds with token ids and sampling settings, aborts,
named operations, stop) and its clock (what the admission window measures). Given
the same plan, the ranks make the same decisions and, as a sharded model's ranks
compute the same logits (its partial sums are added with `all_sum`), sample the same
tokens: a request runs exactly as on one device.

What could differ between the ranks is decided once for all of them: a request's
seed (drawn on rank 0 when it names none), the admission clock, the KV memory budget
(the tightest rank's), and what the disk tier holds (each rank's writer thread runs at
its own pace: a block counts as on disk only where every rank has it, `AgreedDisk`).
Each rank keeps the blocks of its own part of the model under the same block hashes,
its disk tier in a folder of its own.

A rank that dies breaks the next collective (the ring backend raises): rank 0 then
fails its requests as the engine being dead (HTTP 503) and /health says why. A rank
that hangs holds rank 0's step, which the watchdog (--step-timeout) reports as stalled
(503 too). Collectives run on the engine thread's generation stream, in the same order
as the model's own, so they never interleave differently on different ranks.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import queue
import time
from pathlib import Path

from mlxserve.engine.collectives import engine_stream, all_max, all_min, gather, group, share
from mlxserve.engine.engine import AsyncEngine, EngineDeadError

log = logging.getLogger("mlxserve.distributed")


class _NoInbox:
    """A worker rank's command queue: nothing arrives here (its commands are rank 0's plans),
    so the loop never waits on it and goes straight to the next plan."""

    def put(self, item):
        pass

    def get(self, timeout=None):
        raise queue.Empty

    def get_nowait(self):
        raise queue.Empty

    def empty(self) -> bool:
        return True


class DistributedEngine(AsyncEngine):
    """An AsyncEngine that runs its steps on every rank: rank 0's takes requests and sends each
    step's plan; the others' (`run_worker`) apply the plans they receive."""

    def __init__(self, loaded, config, sharding, channel):
        from mlxserve.config import with_backend_defaults

        self.sharding = sharding
        self.channel = channel  # the plans' socket(s) (engine/plans.py)
        self._scheduler = None
        self._stop_sent = False
        self.rank = sharding.rank
        config = with_backend_defaults(config)
        if config.warmup:  # its phases run when the engine idles: a time no two ranks share
            log.info("the warm-up is off across processes (it runs while idle, which the ranks time apart)")
        # kv_layout: auto means contiguous here (ranks.load_rank refuses paged), as the GPUs were measured.
        changes = {"warmup": 0.0, "speculative": None, "kv_layout": "contiguous"}
        if config.disk_cache_dir:  # each rank's blocks hold its own slice of the KV
            changes["disk_cache_dir"] = str(Path(config.disk_cache_dir).expanduser()
                                             / f"rank{self.rank}-of-{sharding.size}")
        super().__init__(loaded, dataclasses.replace(config, **changes))
        self._plan_now = time.perf_counter()
        self._llg = None
        if self.rank != 0:
            self._commands = _NoInbox()

    # ---- caller side ----
    def call(self, fn):
        raise TypeError("a distributed engine runs its operations by name on every rank: use on_mlx_thread()")

    async def on_mlx_thread(self, method: str, *args):
        import asyncio

        self.method(method)  # AttributeError now for a wrong name, not on every rank
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(EngineDeadError(self.fatal_error or "engine is not running"))
        elif self.watchdog.stalled:
            future.set_exception(self._stalled_error())
        else:
            self._commands.put(("named", (method, args, future)))
        return await asyncio.wrap_future(future)

    def health(self) -> dict:
        out = super().health()
        out["distributed"] = {"ranks": self.sharding.size, "parallel": self.sharding.mode}
        return out

    # ---- MLX thread ----
    def _setup(self):
        scheduler = self._scheduler = super()._setup()
        scheduler.clock = lambda: self._plan_now  # rank 0's clock of this step, on every rank
        scheduler.step = self._guarded(scheduler.step)
        stream = engine_stream()
        self._agree_kv_budget(scheduler, stream)
        pc = self.prefix_cache
        if pc is not None and pc.disk is not None:
            pc.disk = AgreedDisk(pc.disk, stream)
        if pc is not None and self.sharding.mode == "pipeline":
            # A stage's blocks hold its own layers' KV, which may weigh more or less than another
            # stage's: every rank counts a block at the heaviest stage's bytes, so the pools evict alike.
            pc.pool._sizeof = _agreed_size(pc.pool._sizeof, stream)
        # A cache decides by the kinds of layers it holds (a recurrent state is kept only at
        # checkpoints, a window's blocks expire): pipeline stages of a hybrid model hold different
        # kinds and would decide apart, so such a split runs uncached, as does one a rank cannot cache.
        from mlxserve.cache.layers import describe_specs

        kinds = None if pc is None or pc.disabled else sorted(describe_specs(pc.specs or ()))
        every = gather(kinds, stream)
        if pc is not None and not pc.disabled and any(k != kinds for k in every):
            pc._disable("the ranks' parts of the model hold different kinds of layers (or one cannot be "
                        f"cached: {every}), so their caches would decide apart")
        return scheduler

    def _agree_kv_budget(self, scheduler, stream) -> None:
        """Every rank admits by the rank with the least room (its footprint and budget)."""
        budgets = gather(self.kv_budget, stream)
        if any(b is None for b in budgets):
            chosen = None
        else:
            chosen = min(budgets, key=lambda b: b.footprint.most_tokens(b.budget, 1 << 24))
        self.kv_budget = scheduler.kv_budget = chosen

    def _guarded(self, step):
        def guarded():
            try:
                return step()
            except Exception as e:  # noqa: BLE001
                # The same failure on every rank (a request's bad setting): fail the batch, as one
                # device would. A lost rank, or a failure here alone: fatal. (After the backend
                # lost a peer no collective is tried: the ring backend may wait on it for good.)
                everywhere = False
                if not _peer_lost(e):
                    try:
                        everywhere = int(all_min([1], engine_stream())[0]) == 1
                    except Exception:  # noqa: BLE001
                        pass
                if everywhere:
                    raise
                self._lost(f"a rank failed during an engine step: {e}")
                return []
        return guarded

    def _lost(self, message: str) -> None:
        if self._stop_sent:  # the ranks end because rank 0 told them to
            return
        if self.fatal_error is None:
            self.fatal_error = message
            log.error("%s", message)
        self._fail_all(message, EngineDeadError)

    def _agree(self, commands: list) -> list:
        if self.fatal_error is not None:
            return [("stop", None)]
        if self.rank == 0:
            plan, local = [], []
            for kind, arg in commands:
                if kind == "named":
                    method, args, future = arg
                    local.append(("call", (self._named(method, args, future), concurrent.futures.Future())))
                    plan.append(("named", (method, args)))
                    continue
                local.append((kind, arg))
                if kind == "add":
                    request, max_tokens = arg
                    if request.params.seed is None:  # drawn once, here: every rank samples alike
                        request.params.seed = int.from_bytes(os.urandom(8), "little")
                    arg = (_portable(request), max_tokens)
                plan.append((kind, arg))
            payload = (time.perf_counter(), plan)
            self._stop_sent = any(kind == "stop" for kind, _ in plan)
        else:
            payload = None
        try:
            if self._scheduler.has_work():  # the same on every rank: their states are the same
                # Busy: over the plan socket, which waits for no device (engine/plans.py).
                if self.rank == 0:
                    self.channel.send(payload)
                    now, plan = payload
                else:
                    now, plan = self.channel.recv()
            else:
                # Idle: as a collective, which a hung rank holds, so the watchdog tells (health).
                wd = self.watchdog
                last = wd.last_step_s
                wd.begin()
                try:
                    now, plan = share(payload, self.rank, engine_stream())
                finally:
                    wd.end()
                    wd.last_step_s = last
        except Exception as e:  # noqa: BLE001 - a closed socket, or the ring backend's lost peer
            self._lost(f"lost contact with the other ranks: {e}")
            return [("stop", None)]
        self._plan_now = now
        if self.rank == 0:
            return local
        return [self._received(kind, arg) for kind, arg in plan]

    def _named(self, method: str, args, future: concurrent.futures.Future):
        fn = self.method(method)

        def run():  # runs on every rank whatever the caller does with its future
            try:
                result = fn(*args)
            except Exception as e:  # noqa: BLE001 - the caller's
                if future.set_running_or_notify_cancel():
                    future.set_exception(e)
                return None
            if future.set_running_or_notify_cancel():
                future.set_result(result)
            return result
        return run

    def _received(self, kind: str, arg):
        if kind == "named":
            method, args = arg
            fn = self.method(method)
            return "call", (lambda: fn(*args), concurrent.futures.Future())
        if kind == "add":
            request, max_tokens = arg
            if request.params.grammar_text is not None:
                request.params.grammar = self._matcher(request.params.grammar_text)
            return "add", (request, max_tokens)
        return kind, arg

    def _matcher(self, grammar: str):
        from llguidance import LLMatcher

        from mlxserve.engine.grammar import llg_tokenizer

        if self._llg is None:
            self._llg = llg_tokenizer(self.tokenizer, self.loaded.vocab_size)
        return LLMatcher(self._llg, grammar, log_level=0)

    def _cache_stats(self) -> dict:
        """Rank 0's counters (every rank's are the same: they decide alike) with the bytes held
        summed over the ranks, and each rank's own numbers under `distributed`."""
        mine = super()._cache_stats()
        pc = self.prefix_cache
        if pc is not None:  # which blocks it holds: the same tokens on every rank, if they agree
            digest = hashlib.sha256(b"".join(sorted(b.hash for b in pc.pool.blocks()))).hexdigest()[:16]
            mine["prefix_cache"]["blocks_digest"] = digest
        every = gather(mine, engine_stream())
        if self.rank != 0:
            return mine
        out = json.loads(json.dumps(every[0]))
        for other in every[1:]:
            _add_bytes(out, other)
        out["distributed"] = {"ranks": self.sharding.size, "parallel": self.sharding.mode,
                              "per_rank": [_rank_summary(s) for s in every]}
        return out


def _peer_lost(error: Exception) -> bool:
    """Whether MLX's distributed backend raised this for a peer it lost (ring: "[ring] connection
    to a peer was lost"; the others name themselves the same way)."""
    text = str(error).lower()
    return any(f"[{b}]" in text for b in ("ring", "jaccl", "mpi", "nccl")) or "peer" in text


def _portable(request):
    """The request as the plan carries it: its llguidance matcher (no pickle) rebuilt from text."""
    if request.params.grammar is None:
        return request
    return dataclasses.replace(request, params=dataclasses.replace(request.params, grammar=None))


def _add_bytes(out: dict, other: dict) -> None:
    """Sum into `out` the byte counts of `other` (the same structure)."""
    for key, value in out.items():
        theirs = other.get(key) if isinstance(other, dict) else None
        if isinstance(value, dict) and isinstance(theirs, dict):
            _add_bytes(value, theirs)
        elif ("bytes" in key or key in ("active", "cache", "peak")) and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and isinstance(theirs, (int, float)):
            out[key] = value + theirs


def _rank_summary(stats: dict) -> dict:
    pc = stats.get("prefix_cache", {})
    keep = ("blocks", "bytes", "tokens", "hits", "queries", "hit_tokens", "blocks_digest")
    out = {k: pc.get(k) for k in keep if k in pc}
    if isinstance(pc.get("disk"), dict):
        out["disk"] = {k: pc["disk"].get(k) for k in ("files", "bytes", "reads", "writes") if k in pc["disk"]}
    return out


def _agreed_size(sizeof, stream):
    def agreed(payload) -> int:
        return int(all_max([sizeof(payload)], stream)[0])
    return agreed


class AgreedDisk:
    """A DiskTier whose answers about what it holds are every rank's: a block is on disk, and
    read back, only where every rank has it (each rank's writer thread runs at its own pace, so
    one may not have written yet what another has). Everything else is the rank's own tier."""

    def __init__(self, disk, stream):
        self._disk = disk
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._disk, name)

    def _everywhere(self, flags) -> list[bool]:
        return [bool(f) for f in all_min([int(bool(f)) for f in flags], self._stream)] if flags else []

    def __contains__(self, key: bytes) -> bool:
        return self._everywhere([key in self._disk])[0]

    def children(self, parent, limit: int) -> list[bytes]:
        keys = share(self._disk.children(parent, limit) if _rank() == 0 else None, _rank(), self._stream)
        held = self._everywhere([k in self._disk for k in keys])
        return [k for k, ok in zip(keys, held) if ok]

    def peek(self, key: bytes):
        got = self._disk.peek(key)
        return got if self._everywhere([got is not None])[0] else None

    def load(self, key: bytes):
        got = self._disk.load(key)
        return got if self._everywhere([got is not None])[0] else None


def _rank() -> int:
    g = group()
    return g.rank() if g is not None else 0

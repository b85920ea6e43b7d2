"""What keeps the engine serving under load: memory-aware admission and the step watchdog.

`KVBudget`: a request runs only when the KV cache of the running batch, with it, fits in
what MLX may use (`--kv-memory`), each request counted at its full length (prompt +
max_tokens), so a burst of long requests waits instead of the process running out of
memory mid-decode; a request that could not fit even alone is refused at once (HTTP 503).

`Watchdog`: a thread of its own times the MLX thread's steps. A step that runs past
`--step-timeout` cannot be interrupted (MLX has no way to cancel queued work), but its
clients need not wait for it: the requests in flight are failed at once, new ones are
refused while it lasts, and /health says "stalled". When the step returns, the engine
drops the failed requests and serves again.
"""

from __future__ import annotations

import logging
import threading
import weakref
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plain Python here: the API layer imports this module's errors
    from mlxserve.cache.sizes import KVFootprint

log = logging.getLogger("mlxserve.engine")


class InsufficientMemoryError(RuntimeError):
    """The request's KV cache could not fit in the memory budget even if it ran alone."""


def gb(n: int) -> str:
    return f"{n / 2**30:.2f} GB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MB"


class KVBudget:
    """Bytes the running requests' KV cache may take, and who fits in them."""

    def __init__(self, footprint: KVFootprint, budget: int, per_row: bool = False):
        """per_row: rows cost their own length (--kv-layout paged: a row holds the blocks its
        tokens fill), not the longest row's."""
        self.footprint = footprint
        self.budget = max(budget, 0)
        self.per_row = per_row

    def need(self, lengths: list[int]) -> int:
        """The KV bytes of a batch of sequences of these full lengths. mlx-lm's batch caches
        are padded to their longest row, so there every row costs the longest one's bytes."""
        if not lengths:
            return 0
        if self.per_row:
            return sum(self.footprint.bytes(n) for n in lengths)
        return len(lengths) * self.footprint.bytes(max(lengths))

    def admits(self, running: list[int], length: int) -> bool:
        """Whether a sequence of `length` tokens may join the running ones now. Alone it always
        may: `check` let it in only if it fits alone, and the queue must move."""
        return not running or self.need([*running, length]) <= self.budget

    def check(self, num_prompt: int, max_tokens: int, explicit: bool) -> int:
        """The request's output budget; raises if it cannot fit even alone. A request that named
        no max_tokens gets what fits (as it gets what fits in the context)."""
        if self.footprint.bytes(num_prompt + max_tokens) <= self.budget:
            return max_tokens
        most = self.footprint.most_tokens(self.budget, num_prompt + max_tokens) - num_prompt
        if not explicit and most >= (0 if max_tokens == 0 else 1):
            return most
        raise InsufficientMemoryError(
            f"This request's KV cache would take about {gb(self.footprint.bytes(num_prompt + max_tokens))} "
            f"({num_prompt} prompt + {max_tokens} output tokens), more than the {gb(self.budget)} "
            "this server gives running requests (--kv-memory). Lower max_tokens or shorten the prompt."
        )


def kv_budget_for(model, config, dequantize_kv: bool, prefix_cache, vision_cache,
                  per_row: bool = False) -> KVBudget | None:
    """The engine's budget (on the MLX thread, once the weights and caches exist); None when the
    model's cache cannot be measured: then admission counts slots only."""
    import mlx.core as mx

    from mlxserve.cache.quantized import make_cache
    from mlxserve.cache.sizes import device_memory_limit, kv_footprint

    try:
        footprint = kv_footprint(model, make_cache(model, config.kv_bits, dequantize=dequantize_kv),
                                 config.prefill_chunk_size)
    except Exception as e:  # noqa: BLE001 - a model the estimate does not know must still be served
        log.warning("cannot estimate this model's KV cache size (%r): memory-aware admission is off", e)
        return None
    caches = (prefix_cache.pool.budget if prefix_cache is not None else 0) + \
        (vision_cache.budget if vision_cache is not None else 0)
    # The weights are loaded and evaluated by now: MLX's active memory is mostly them.
    return kv_budget(footprint, config.kv_memory, memory=device_memory_limit(), weights=mx.get_active_memory(),
                     caches=caches, per_row=per_row)


def kv_budget(footprint: KVFootprint, setting: str, *, memory: int, weights: int, caches: int,
              per_row: bool = False) -> KVBudget:
    """The budget for `--kv-memory`: a size, or auto: `memory` (what MLX may use) less the
    weights and the caches' budgets (prefix and vision caches)."""
    from mlxserve.cache.sizes import parse_size

    if str(setting).strip().lower() != "auto":
        budget = KVBudget(footprint, parse_size(setting), per_row)
    else:
        budget = KVBudget(footprint, memory - weights - caches, per_row)
        if budget.budget <= 0:
            log.warning("no memory left for running requests' KV cache: MLX may use %s, the weights take %s "
                        "and the caches' budgets %s; every request will be refused (set --kv-memory, or "
                        "lower --cache-memory / --vision-cache-memory)", gb(memory), gb(weights), gb(caches))
    per_token = footprint.bytes(footprint.step * 64) // (footprint.step * 64)
    log.info("KV budget for running requests: %s (about %d bytes per token; one request of at most %d tokens)",
             gb(budget.budget), per_token, footprint.most_tokens(budget.budget, 1 << 40))
    return budget


class Watchdog:
    """Times the MLX thread's steps; calls `on_stall(seconds)` once per step past `timeout_s`
    (from the watchdog's thread). timeout_s 0: no watchdog."""

    def __init__(self, timeout_s: float, on_stall):
        self.timeout_s = timeout_s
        # Weakly: the engine holds its watchdog, and a cycle back to it would keep a stopped
        # engine (and its model's arrays) alive until the collector runs, at exit, where MLX aborts.
        self.on_stall = weakref.WeakMethod(on_stall) if hasattr(on_stall, "__self__") else lambda: on_stall
        self.started: float | None = None  # time.monotonic() when the running step began
        self.last_step_s: float | None = None  # how long the last finished step took
        self.stalls = 0  # steps that ran past the limit
        self._fired = False  # on_stall was called for the running step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.timeout_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mlx-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    # Called by the MLX thread around each step: two clock reads, nothing more.
    def begin(self) -> None:
        self._fired = False
        self.started = time.monotonic()

    def end(self) -> None:
        started, self.started = self.started, None
        if started is not None:
            self.last_step_s = time.monotonic() - started
            if self._fired:
                log.warning("the stalled engine step ended after %.1f s; serving again", self.last_step_s)

    def running_s(self) -> float | None:
        started = self.started
        return None if started is None else time.monotonic() - started

    @property
    def stalled(self) -> bool:
        running = self.running_s()
        return self.timeout_s > 0 and running is not None and running > self.timeout_s

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            running = self.running_s()
            if running is not None and running > self.timeout_s and not self._fired:
                self._fired = True
                self.stalls += 1
                on_stall = self.on_stall()
                if on_stall is None:  # the engine is gone
                    return
                try:
                    on_stall(running)
                except Exception:  # noqa: BLE001 - the watchdog must keep watching
                    log.exception("failing the requests of a stalled step")

"""Warm-up: each serving path once, right after start, so that users' first requests
do not pay for compiling kernels.

On a GPU, MLX builds kernels on first use: MLX-CUDA compiles (NVRTC) the fused kernels
of mx.compile'd functions (per graph and dtype: mlx-lm's activations, the samplers'
top-k/top-p/min-p), gathers (per dtype and index count: a quantized embedding's lookup,
top logprobs, prompt scoring) and its quantized matmuls: up to 7 rows take a precompiled
matrix-vector kernel, more a CUTLASS kernel compiled per dtype, bits, group size and
row-count class (16, 32, 64+ rows: a 9-token continuation compiles one, a 24-token one
another, a full chunk a third); cuDNN builds an attention graph per shape, and each new
graph of kernels is captured once. A fresh machine's first agent turns took 8-44 s
(issue 17); warm, 0.1-0.4 s. What a kernel is compiled for depends on dtypes, layouts and
size classes, not on each length, so one pass of each real path covers it: the lone
("solo") path's chunked prefill (a full chunk, then a shorter one that gives the first
token) and decoding; prefix-cache restores of full and partial blocks with 24- and 9-token
continuations; sampling with top-k/top-p/min-p, penalties and logprobs; a scored prompt;
a lone request moved into a batch; and batches of each size class up to --max-num-seqs
(8 and more decoding rows switch the quantized matmuls to the matrix kernel; attention
graphs are per size). The dense prefill layers' matmuls cost 1-8 ms more per weight shape at a
row count met for the first time: they pad their rows to few counts (models/dense.py), and a
first phase runs each of them.

It runs on the MLX thread through a private runner and scheduler (the engine's own
settings) with a private prefix cache, one phase at a time while the engine is idle: a
request that arrives waits for the phase under way at most, and nothing of the warm-up
(cache blocks, hit counters, steps, request metrics) is left for a user to see. The phases
stop once their time (--warmup seconds) is spent. On the CPU three short phases build what
is built there (see `full_plan`).
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections import deque

log = logging.getLogger("mlxserve.engine")


def batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to warm: 2 (a lone request joined by another), 3, 4 (below the 8-row
    switch of the quantized matmuls), then powers of two from 8 and the largest batch
    (attention graphs are built per size)."""
    sizes = {2, 3, 4, max_num_seqs} | {1 << k for k in range(3, max_num_seqs.bit_length())}
    return sorted(s for s in sizes if 2 <= s <= max_num_seqs)


def full_plan() -> bool:
    """Every phase on a GPU (Metal too: it builds kernels per type and tile); on the CPU, where
    only mx.compile'd functions are built (with the C++ compiler: ~1 s each), the solo pass,
    sampling (after a restore) and a batch of 2 build them all, and a full plan would take
    20 s with a 0.5B model on 2 cores."""
    import mlx.core as mx

    return mx.default_device().type == mx.gpu


class Warmup:
    """The phases still to run, and what ran: `run_next()` runs one (on the MLX thread)."""

    def __init__(self, budget_s: float, make_scheduler, *, vocab_size: int, chunk: int, max_num_seqs: int,
                 full: bool, max_len: int | None = None, dense_rows=None):
        self.budget_s = budget_s
        self._make_scheduler = make_scheduler  # (chunk) -> a private Scheduler
        self._scheduler = None
        # On the CPU nothing depends on lengths: short prompts, two prefill passes still.
        self.chunk = chunk if full else min(chunk, 16)
        if max_len:  # the longest conversation (about 1.5 chunks + 80 tokens) fits the context
            self.chunk = max(4, min(self.chunk, int((max_len - 80) / 1.5)))
        self.decode = 8 if full else 2
        self.rng = random.Random(0)
        self.vocab = vocab_size
        self.state = "pending"  # pending, running, done, stopped (budget), failed
        self.seconds = 0.0
        self.done: list[tuple[str, float]] = []
        self.skipped: list[str] = []
        self._history: list[int] = []  # the conversation of the prefix-cache phases
        phases = [("solo prefill+decode", self._solo)]
        if full and dense_rows is not None:  # each padded row count of the dense prefill layers
            phases.insert(0, ("dense row counts", dense_rows))
        if full:
            phases += [("prefix restore +24", lambda: self._turn(24)), ("prefix restore +9", lambda: self._turn(9))]
        phases.append(("sampling+logprobs", self._sampling))
        if full:
            phases.append(("prompt logprobs", self._prompt_logprobs))
        if max_num_seqs >= 2:
            phases.append(("solo->batch handover", self._handover))
        if full:
            phases += [(f"batch {b}", lambda b=b: self._batch(b)) for b in batch_sizes(max_num_seqs)[1:]]
        self.phases = deque(phases)

    @property
    def pending(self) -> bool:
        return bool(self.phases) and self.state in ("pending", "running")

    def status(self) -> dict:
        return {"state": self.state, "seconds": round(self.seconds, 3), "phases": len(self.done),
                "skipped": len(self.skipped)}

    def run_next(self) -> None:
        """Run the next phase; after the last one (or past the budget, or on an error) free
        the private runner and log what was done."""
        if self.state == "pending":
            self.state = "running"
            log.info("warm-up: %d phases (budget %.0f s) while idle: %s", len(self.phases), self.budget_s,
                     ", ".join(name for name, _ in self.phases))
        name, phase = self.phases.popleft()
        start = time.perf_counter()
        try:
            if self._scheduler is None:
                self._scheduler = self._make_scheduler(self.chunk)
            phase()
        except Exception as e:  # noqa: BLE001 - a warm-up never stops the engine
            self.seconds += time.perf_counter() - start
            log.warning("warm-up: phase %r failed (%r); the rest is skipped", name, e)
            self.state = "failed"
            self._finish()
            return
        took = time.perf_counter() - start
        self.seconds += took
        self.done.append((name, took))
        log.debug("warm-up: %s in %.2f s", name, took)
        if self.phases and self.seconds >= self.budget_s:
            self.state = "stopped"
            self._finish()
        elif not self.phases:
            self.state = "done"
            self._finish()

    def _finish(self) -> None:
        import mlx.core as mx

        left = [name for name, _ in self.phases]
        self.skipped += left
        self.phases.clear()
        self._scheduler = None  # its runner, generator and prefix cache: nothing stays cached
        gc.collect()
        mx.clear_cache()
        parts = ", ".join(f"{name} {took:.2f}s" for name, took in self.done)
        why = {"stopped": f"; budget of {self.budget_s:.0f} s spent, skipped: {', '.join(left)}",
               "failed": f"; skipped: {', '.join(left) or 'nothing'}"}.get(self.state, "")
        log.info("warm-up %s in %.1f s: %s%s", "done" if self.state == "done" else self.state, self.seconds,
                 parts, why)

    # ---- phases ----
    def _tokens(self, n: int) -> list[int]:
        lo = min(1000, self.vocab // 4)  # past the special tokens of most vocabularies
        return [self.rng.randrange(lo, self.vocab) for _ in range(n)]

    def _run(self, arrivals, join_after: int = 0, together: int = 1) -> dict[str, list[int]]:
        """Run requests to their end: the first `together` at once, the others once the first
        emitted `join_after` tokens (0: all at once). Returns each request's tokens."""
        from mlxserve.engine.request import Request, SamplingParams

        sched = self._scheduler
        tokens: dict[str, list[int]] = {}
        waiting = []
        for prompt, settings in arrivals:
            params = SamplingParams(**{"temperature": 0.0, "max_tokens": self.decode, "ignore_eos": True, **settings})
            waiting.append(Request(prompt, params))
        first = waiting[0]
        for r in waiting[:together]:
            sched.add(r, r.params.max_tokens)
        waiting = waiting[together:]
        if not join_after:
            for r in waiting:
                sched.add(r, r.params.max_tokens)
            waiting = []
        while sched.has_work():
            for ev in sched.step():
                tokens.setdefault(ev.seq.request_id, []).append(ev.token)
            if sched.runner.failed:
                raise RuntimeError(sched.runner.failed[0][1])
            if waiting and len(tokens.get(first.request_id, ())) >= join_after:
                for r in waiting:
                    sched.add(r, r.params.max_tokens)
                waiting = []
        return {r: t for r, t in tokens.items()}

    def _solo(self) -> None:
        """A prompt of a full chunk and more, alone: a full prefill pass, a short last one, decoding."""
        prompt = self._tokens(self.chunk + max(self.chunk // 2, 2) + 7)
        (out,) = self._run([(prompt, {})]).values()
        self._history = prompt + out

    def _turn(self, new: int) -> None:
        """The conversation's next turn: its history restored from the (private) prefix cache,
        full blocks and the partial one after them, then `new` tokens prefilled and decoding."""
        prompt = self._history + self._tokens(new)
        (out,) = self._run([(prompt, {})]).values()
        self._history = prompt + out

    def _sampling(self) -> None:
        """Sampling with every filter (each an mx.compile'd function), penalties and logprobs."""
        settings = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5,
                    "repetition_penalty": 1.1, "logprobs": True, "top_logprobs": 5, "seed": 0}
        self._run([(self._history + self._tokens(5), settings)])

    def _handover(self) -> None:
        """A lone request joined by another while decoding: it moves into a batch of 2 with its
        cache; the newcomer (sampled) restores a cached prefix."""
        self._run([(self._tokens(12), {"max_tokens": self.decode + 1}),
                   (self._history + self._tokens(3), {"temperature": 1.0, "seed": 1})], join_after=1)

    def _batch(self, size: int) -> None:
        """`size` short prompts of different lengths (a padded prefill), the last one joining the
        others' decoding; rows end at different steps (the batch drops them)."""
        self._run([(self._tokens(4 + i % 13), {"max_tokens": 2 + i % 3}) for i in range(size)],
                  join_after=1, together=size - 1)

    def _prompt_logprobs(self) -> None:
        """A prompt scored (prompt_logprobs): its own prefill path, which gathers each token's logprob."""
        self._run([(self._tokens(self.chunk // 2 + 3), {"prompt_logprobs": 2, "max_tokens": 1})])


def make_warmup(cfg, loaded, prefix_cache, max_num_seqs: int, max_len: int, make_scheduler) -> Warmup:
    """The engine's warm-up. `make_scheduler(prefix_cache, chunk)` builds a private scheduler
    on the engine's settings; it gets a prefix cache of its own (the engine's block size and
    layout, no disk tier) where the engine has one, dropped with it when the warm-up ends."""
    def private_scheduler(chunk: int):
        cache = None
        if prefix_cache is not None and not prefix_cache.disabled:
            from mlxserve.cache import BlockPool, PrefixCache

            cache = PrefixCache(BlockPool(prefix_cache.pool.budget), prefix_cache.block_size,
                                prefix_cache.fingerprint + "/warmup", model=loaded.model,
                                checkpoint_interval=prefix_cache.checkpoint_interval)
        return make_scheduler(cache, chunk)

    from mlxserve.models.dense import padded_layers, served_models, warm_row_counts

    padded = [layer for model in served_models(loaded) for layer in padded_layers(model)]
    dense_rows = (lambda: warm_row_counts(padded, cfg.prefill_chunk_size)) if padded else None
    return Warmup(cfg.warmup, private_scheduler, vocab_size=loaded.vocab_size or 1000,
                  chunk=cfg.prefill_chunk_size, max_num_seqs=max_num_seqs, full=full_plan(), max_len=max_len,
                  dense_rows=dense_rows)

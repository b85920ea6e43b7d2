"""Constrained decoding: only tokens a grammar accepts next can be sampled.

llguidance (the grammar engine vLLM and SGLang use too) keeps each row's
parser state in an `LLMatcher` and writes the allowed tokens as a bitmask.
A constrained row carries a `GrammarProcessor` among its logits processors,
so constrained and free rows share one batch and the prefix cache stays on.

The mask for step t depends on the token sampled at step t-1, so it cannot be
computed ahead; it can be computed beside the step's other work. In a batch
(`ConstrainedGenerationBatch`) the step builds the forward pass's graph, reads
the last sampled tokens, hands every constrained row's mask to a helper thread
(llguidance consumes and fills in parallel, with the GIL released; no MLX
there), dispatches the forward pass meanwhile, then applies all masks to the
batch's logits at once.
For a small model a step is bound by such host work, so the overlap is what
keeps constrained rows near free ones. The lone path fills its one mask while
the forward pass runs.
"""

from __future__ import annotations

import importlib
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par
from mlx_lm.models.cache import BatchKVCache, KVCache


class MaskStats:
    """Host time spent filling masks, for `mlxserve bench grammar`."""

    def __init__(self):
        self.seconds = 0.0
        self.masks = 0

    def reset(self) -> None:
        self.seconds, self.masks = 0.0, 0


mask_stats = MaskStats()
# The module, not the function of the same name that mlx_lm's package exports over it.
_generate = importlib.import_module("mlx_lm.generate")
_executor: LLExecutor | None = None
_pool: ThreadPoolExecutor | None = None


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> mx.array:
    """llguidance's packed bitmask (one bit per token, 32 per int32) as booleans, one row per row."""
    words = mx.array(bitmask)
    bits = (words[..., None] >> mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(mx.bool_)


class GrammarProcessor:
    """One row's constraint. Called once per sampled token, in order.

    The first call comes with the prompt's last token fed; every later call
    with the token sampled after the call before, which the matcher consumes
    before it computes the next mask.
    """

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_ids):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.calls = 0
        self.bitmask = allocate_token_bitmask(1, vocab_size)  # the lone path's, refilled each call

    def advance(self, previous: int) -> None:
        """Consume the token sampled under the last mask (nothing before the first mask)."""
        if self.calls:
            self.matcher.consume_token(previous)
        self.calls += 1

    def check(self, bitmask_row: np.ndarray) -> None:
        if not bitmask_row.any():
            # A matcher in an error state allows nothing; ending the row is the honest way out.
            words = bitmask_row.view(np.uint32)
            for t in self.eos_token_ids:
                words[t // 32] |= np.uint32(1 << (t % 32))

    def __call__(self, fed: mx.array, logits: mx.array) -> mx.array:
        """The lone path: `fed` is what this forward pass takes (the last sampled token)."""
        mx.async_eval(logits)
        self.advance(int(fed.item()) if self.calls else 0)  # fed is already queued: no new kernel
        start = time.perf_counter()
        fill_next_token_bitmask(self.matcher, self.bitmask)  # mx.array copies it below
        self.check(self.bitmask[0])
        mask_stats.seconds += time.perf_counter() - start
        mask_stats.masks += 1
        return mx.where(allowed_tokens(self.bitmask, logits.shape[-1]), logits, -mx.inf)


def llg_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the model's tokenizer (~1 s to build); ValueError for a slow one."""
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids))


def grammar_of(processors) -> GrammarProcessor | None:
    """A row's grammar: the last of its processors, where make_processors puts it."""
    return processors[-1] if processors and isinstance(processors[-1], GrammarProcessor) else None


def fill_masks(grammars: list[GrammarProcessor | None], previous: list[int], vocab_size: int) -> np.ndarray:
    """(B, words) bitmask: each constrained row's allowed tokens, all tokens for free rows.

    Host only (numpy and llguidance, no MLX), so it runs on a helper thread;
    llguidance consumes and fills in parallel with the GIL released.
    """
    global _executor
    start = time.perf_counter()
    if _executor is None:
        _executor = LLExecutor()
    bitmask = allocate_token_bitmask(len(grammars), vocab_size)  # all ones: free rows
    rows, consumed = [], []
    for e, g in enumerate(grammars):
        if g is not None:
            rows.append((g.matcher, e))
            if g.calls:
                consumed.append((g.matcher, previous[e]))
            g.calls += 1
    if consumed:
        _executor.consume_token_par(consumed)
    fill_next_token_bitmask_par(_executor, rows, bitmask)
    for _, e in rows:
        grammars[e].check(bitmask[e])
    mask_stats.seconds += time.perf_counter() - start
    mask_stats.masks += len(rows)
    return bitmask


class ConstrainedGenerationBatch(_generate.GenerationBatch):
    """mlx-lm's GenerationBatch, whose step masks constrained rows as one batch (see the module
    doc), hands out per-row logprobs only while some row wants them, and a finished row's KV
    as views.

    mlx-lm splits the step's (B, vocab) logprobs into B arrays and evaluates them every step,
    whether or not anyone reads them: host time per step that grows with the batch. The runner
    turns `row_logprobs` off while no request of its batch asks for logprobs; the rows' logprobs
    are None then. A step with row logprobs and no constrained row is mlx-lm's own.
    """

    row_logprobs = True  # mlx-lm's behaviour, for any BatchGenerator but the runner's

    def _step(self):
        grammars = [grammar_of(p) for p in self.logits_processors] if self.logits_processors else []
        constrained = any(grammars)
        if not constrained and self.row_logprobs:
            return super()._step()
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs = self._current_tokens
        # The forward pass's graph is built while the accelerator still runs the last step;
        # then, with the last step's tokens read, the masks are filled on a helper thread
        # while this one dispatches the forward pass (both are host work, and a small model's
        # step is bound by it).
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        if constrained:
            previous = inputs.tolist()
            masks = _mask_thread().submit(fill_masks, grammars, previous, logits.shape[-1])
            mx.async_eval(logits)
            allowed = allowed_tokens(masks.result(), logits.shape[-1])

        token_context = []
        if any(len(p or ()) > (g is not None) for p, g in zip(self.logits_processors or (), grammars)):
            rows = []
            for e, processors in enumerate(self.logits_processors):
                row = logits[e:e + 1]
                others = processors[:-1] if grammars[e] is not None else processors or ()
                if others:
                    context = self._token_context[e].update_and_fetch(inputs[e:e + 1])
                    token_context.append(context)
                    for processor in others:
                        row = processor(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        if constrained:  # after the penalties and biases, so none of them can lift a token the grammar rules out
            logits = mx.where(allowed, logits, -mx.inf)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)

        samplers = [self.fallback_sampler if s is None else s
                    for s in (self.samplers or [None] * len(self.uids))]
        if all(s is samplers[0] for s in samplers):
            sampled = samplers[0](logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e:e + 1]) for e, s in enumerate(samplers)], axis=0)
        self._next_tokens = sampled
        self._next_logprobs = list(logprobs) if self.row_logprobs else [None] * len(self.uids)
        mx.async_eval(self._next_tokens, self._next_logprobs if self.row_logprobs else [], token_context)
        # Rows that joined under row logprobs (or before they were turned off) still carry theirs.
        current = [a for a in self._current_logprobs if a is not None]
        if constrained:
            mx.eval(current)
        else:
            mx.eval(inputs, current)
            previous = inputs.tolist()
        for tokens, token in zip(self.tokens, previous):
            tokens.append(token)
        return previous, self._current_logprobs

    def extract_cache(self, idx: int) -> list:
        """A finished row's cache, as mlx-lm's, but a plain KV layer's row is a view of the batch's
        buffers where mlx-lm queues a copy per layer: the prefix cache, its one reader, copies
        it into blocks anyway (the view keeps the old buffers until those copies have run).

        The row's KV is its last `len(tokens)` positions (rows are right-aligned, and `tokens`
        holds what the cache holds): mlx-lm reads each layer's left padding instead, a device
        read that waits for the step already queued, so the host could not build the next one
        meanwhile."""
        n = len(self.tokens[idx])
        return [_row_view(c, idx, n) if type(c) is BatchKVCache else c.extract(idx) for c in self.prompt_cache]


def _row_view(c, idx: int, n: int) -> KVCache:
    row = KVCache()
    row.keys = c.keys[idx:idx + 1, :, c._idx - n:c._idx]
    row.values = c.values[idx:idx + 1, :, c._idx - n:c._idx]
    row.offset = n
    return row


def _mask_thread() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="mlxserve-masks")
    return _pool


def install() -> None:
    """Make mlx-lm's BatchGenerator build ConstrainedGenerationBatch (it names the class at call time)."""
    _generate.GenerationBatch = ConstrainedGenerationBatch

"""Prompt logprobs (the completions API's echo with logprobs; lm-eval's loglikelihood).

A request with `prompt_logprobs` runs its prompt but its last token through
the model with a cache of its own, one chunk per engine step, and keeps, for
each position, the logprob of the prompt's next token and the k best. The
cache it leaves holds all of the prompt but the last token: the request then
starts as a prefix-cache hit of that much would (solo or in the batch), so
its last prompt token's pass gives the first output token and no prompt token
is computed twice. With max_tokens 0 it ends there (finish_reason "length").

Cost: the logits of cached tokens are not kept, so a request with prompt
logprobs computes its whole prompt even when the prefix cache holds it. It
stores its blocks as it goes, so requests without prompt logprobs hit them.

The logprobs are the model's own (log-softmax of its logits in float32),
before any logit bias, penalty or temperature: what scoring a text means.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxserve.engine.request import TokenLogprob

# At most this many positions per pass: each keeps a row of logits over the
# vocabulary (150k floats for Qwen: 600 KB), several times over while scoring.
SCORE_CHUNK = 256


def score_positions(logits: mx.array, targets: list[int], k: int) -> list[TokenLogprob]:
    """Per row of `logits` (positions, vocab): the logprob of its target token and the k best."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
    if k:
        best = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(logprobs, best, axis=-1)
        mx.eval(chosen, best, values)
        tops = [sorted(zip(b, v), key=lambda p: -p[1]) for b, v in zip(best.tolist(), values.tolist())]
    else:
        mx.eval(chosen)
        tops = [[] for _ in targets]
    return [TokenLogprob(t, c, top) for t, c, top in zip(targets, chosen.tolist(), tops)]


class PromptScorer:
    """The scoring pass of one sequence: `step()` until `finished`, then hand over `cache`."""

    def __init__(self, model, seq, chunk_size: int, cache, prefix_cache=None):
        self.model = model
        self.seq = seq
        self.chunk_size = min(chunk_size, SCORE_CHUNK)
        self.cache = cache  # fresh: made by the runner
        self.prefix_cache = prefix_cache
        self.prompt = list(seq.request.prompt_token_ids)
        self.k = seq.request.params.prompt_logprobs or 0
        self.end = len(self.prompt) - 1  # the last token's pass is the first decode step's
        self.done = 0
        self.logprobs: list[TokenLogprob | None] = [None]  # the first token has no context
        if prefix_cache is not None:
            seq.checkpoints = prefix_cache.checkpoints(0, len(self.prompt))

    @property
    def finished(self) -> bool:
        return self.done >= self.end

    def step(self) -> None:
        """Score one chunk of the prompt (cut at the prefix cache's checkpoints)."""
        n = self.seq.cut(self.done, min(self.chunk_size, self.end - self.done))
        tokens = self.prompt[self.done : self.done + n]
        with mx.stream(generation_stream):
            logits = self.model(mx.array(tokens)[None], cache=self.cache)[0]
            self.logprobs += score_positions(logits, self.prompt[self.done + 1 : self.done + n + 1], self.k)
            mx.eval([c.state for c in self.cache])
        self.done += n
        self.store_blocks(finished=False)

    def store_blocks(self, finished: bool) -> None:
        """As SoloDecoder.store_blocks: full blocks, the tail when done or at the prompt's tail end."""
        pc = self.prefix_cache
        if pc is None:
            return
        tail = finished or self.done == pc.prompt_tail_end(len(self.prompt))
        pc.store_from_cache(self.cache, self.prompt, self.done, self.seq.extra_keys, hashes=self.seq.block_hashes,
                            finished=tail, state=finished or self.done in self.seq.checkpoints)

    def finish(self) -> list[TokenLogprob | None]:
        """The prompt's logprobs, also set on the sequence (its first event carries them)."""
        self.seq.prompt_logprobs = self.logprobs
        return self.logprobs

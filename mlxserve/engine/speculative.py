"""Speculative decoding on the lone request's path (`SoloDecoder` in engine/runner.py).

A proposer guesses the next few tokens; one forward pass of the model over
the last sampled token and the guesses (a verify pass) gives the logits of
every position, each position's token is sampled exactly as a one-token step
would sample it, and the run of guesses that equal the sampled tokens is kept
with the first sampled token after them. The cache is then trimmed by the
rejected guesses (mlx-lm's `trim_prompt_cache`).

Proposers:
- `NgramProposer` (prompt lookup, `--speculative ngram`): the tokens that
  followed the most recent earlier occurrence of the last n tokens, in the
  prompt or the output. Editing code or JSON repeats long spans of the prompt.
- `DraftProposer` (`--draft-model`): a smaller model of the same vocabulary
  drafts greedily, on its own cache, rewound like the target's.

Exactness: every emitted token is the target's own sample at its position
(greedy: the argmax; sampled: a draw with the key the request's n-th token
uses, see `Sampler.draws`), with penalties applied over the same context, so
the tokens equal non-speculative decoding's, seeded sampling included. For a
proposal that is one fixed token this accepts with probability p(token), what
rejection sampling accepts too; a sampled draft would accept more often under
rejection sampling but give other tokens than the same seed without it.
Requests with a grammar decode without speculation (its matcher consumes each
token as it is sampled and would need rolling back).

Only the lone request speculates: in a batch the step is already wide, and
mlx-lm's BatchGenerator has no verify step. When a second request arrives the
solo sequence is handed over at a token boundary, after the rejected tokens
are trimmed, so the batch continues from exactly the state non-speculative
decoding would have reached.

Caches must be trimmable: recurrent layers (Qwen3.5, LFM2, Mamba hybrids:
`ArraysCache`) cannot be rewound, nor Llama 4's chunked layers across a chunk
boundary; speculation is off for such models (said at start-up). Sliding-window
layers (`RotatingKVCache`) can be rewound until the window is full, so a
request speculates only while a verify pass stays inside it.

Compared with mlx-lm's `speculative_generate_step`, which does the same
verify-and-trim for a draft model: it is a generator that owns the whole
generation (its own prefill, no prefix cache, no stopping at a token boundary
to hand the sequence over); its logits processors see only the tokens since
it started, not the prompt; and it samples all positions with one key and
drafts with the request's sampler, so seeded output differs from decoding
without it. Hence this module: the same logic (rewind the target by the
rejected count, the draft by one less), driven one step at a time.
"""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx_lm.models.cache import CacheList, ChunkedKVCache, RotatingKVCache, make_prompt_cache, trim_prompt_cache

from mlxserve.engine.grammar import grammar_of

log = logging.getLogger("mlxserve.engine")

MODES = ("ngram", "draft")


class SpecStats:
    """Counters of the verify passes (plain ints: /metrics reads them from another thread)."""

    def __init__(self):
        self.passes = 0  # verify passes run
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of those, emitted (equal to the target's own token)
        self.emitted = 0  # tokens emitted by verify passes (accepted drafts + one per pass)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @classmethod
    def summed(cls, many) -> "SpecStats":
        total = cls()
        for s in many:
            total.passes, total.drafted = total.passes + s.passes, total.drafted + s.drafted
            total.accepted, total.emitted = total.accepted + s.accepted, total.emitted + s.emitted
        return total

    def as_dict(self) -> dict:
        return {"verify_passes": self.passes, "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                "emitted_tokens": self.emitted, "acceptance_rate": self.acceptance_rate}


def _layers(cache) -> list:
    out = []
    for c in cache:
        out += _layers(c.caches) if isinstance(c, CacheList) else [c]
    return out


def rewind_blocker(model) -> str | None:
    """Why the model's cache cannot drop a verify pass's rejected tokens, or None if it can
    (sliding-window layers can, until their window is full: see `window_room`)."""
    bad = sorted({type(c).__name__ for c in _layers(make_prompt_cache(model))
                  if not c.is_trimmable() or isinstance(c, ChunkedKVCache)})
    if not bad:
        return None
    return (f"its {', '.join(bad)} layers cannot be rewound past rejected draft tokens "
            "(recurrent state, or chunked attention across a chunk boundary)")


def window_room(cache) -> int | None:
    """Tokens a verify pass may add to `cache` and still be trimmed after: sliding-window layers
    can be rewound only while they hold fewer tokens than their window. None: no limit."""
    rooms = [c.max_size - 1 - c.offset for c in _layers(cache) if isinstance(c, RotatingKVCache)]
    return min(rooms) if rooms else None


class NgramProposer:
    """Prompt lookup: propose what followed the last `n` tokens' most recent earlier occurrence.

    The index maps each n-gram to where its latest occurrence ended, and grows
    with the tokens: a lookup costs a dict access, so a sequence with nothing
    to repeat pays almost nothing for it.
    """

    def __init__(self, n: int):
        self.n = n
        self.index: dict[tuple, int] = {}
        self.indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        n, end = self.n, len(tokens)
        if end <= n or k <= 0:
            return []
        # Every n-gram but the last (the one to look up) points at the token after it.
        for stop in range(max(self.indexed, n), end):
            self.index[tuple(tokens[stop - n:stop])] = stop
        self.indexed = end
        start = self.index.get(tuple(tokens[end - n:]))
        return [] if start is None else tokens[start:start + k]

    def expects(self, tokens: list[int]) -> bool:
        """Whether the next step is likely a verify pass (the lookup would hit now)."""
        return bool(self.propose(tokens, 1))


class DraftProposer:
    """A draft model's greedy continuation, on its own cache.

    The cache holds `held`: a prefix of the sequence's tokens, then the drafts
    of the last proposal but the last one. Each proposal first trims it back
    to what the target kept, then feeds the tokens the draft has not seen:
    one chunk per step while it catches up on a prompt (restored from the
    prefix cache or prefilled without it), then all of them and k drafts.
    """

    def __init__(self, model, chunk_size: int, vocab_rows: int):
        self.model = model
        self.cache = make_prompt_cache(model)
        self.chunk_size = chunk_size
        self.vocab_rows = vocab_rows  # the target's: a draft beyond them ends the proposal
        self.held: list[int] = []
        self.base = 0  # held[:base] is certainly the sequence's; past it, drafts the target may have rejected
        # A draft with sliding-window layers stops for good once what it would feed no longer
        # fits their window: past it, its cache could not be rewound.
        self.full = False

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if self.full:
            return []
        keep = self.base
        while keep < min(len(self.held), len(tokens)) and self.held[keep] == tokens[keep]:
            keep += 1
        trim_prompt_cache(self.cache, len(self.held) - keep)
        del self.held[keep:]
        todo = tokens[keep:]
        room = window_room(self.cache)
        if room is not None:  # the cache grows by todo and k - 1 drafts, and must trim after
            if len(todo) > room:
                self.full = True
                return []
            k = min(k, room - len(todo) + 1)
        if len(todo) > self.chunk_size:
            chunk = todo[:self.chunk_size]
            self.model(mx.array(chunk)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.held += chunk
            self.base = len(self.held)
            return []
        if k <= 0 or not todo:
            return []
        y = mx.array(todo)
        drafts = []
        for _ in range(k):
            logits = self.model(y[None], cache=self.cache)[:, -1, :]
            y = mx.argmax(logits, axis=-1)
            mx.async_eval(y)  # the next draft pass's graph is built while this one runs
            drafts.append(y)
        drafts = mx.concatenate(drafts).tolist()
        self.held += todo + drafts[:-1]  # the last draft was never fed
        self.base = len(tokens)
        for i, t in enumerate(drafts):
            if t >= self.vocab_rows:
                return drafts[:i]
        return drafts

    def expects(self, tokens: list[int]) -> bool:
        return not self.full  # a draft model proposes at every step while it can


class SequenceSpeculation:
    """One sequence's proposer, how many tokens it may draft, and the shared counters."""

    def __init__(self, proposer, num_draft_tokens: int, stats: SpecStats):
        self.proposer = proposer
        self.k = num_draft_tokens
        self.stats = stats

    def drafts(self, tokens: list[int], budget: int, cache) -> list[int]:
        """Up to k proposed tokens after `tokens`, fewer where `budget` (output tokens left
        after the one the pass gives anyway) or a sliding window's room allow fewer."""
        room = window_room(cache)
        k = min(self.k, budget, self.k if room is None else room - 1)
        return self.proposer.propose(tokens, k) if k > 0 else []

    def expects(self, tokens: list[int]) -> bool:
        return self.proposer.expects(tokens)

    def count(self, drafted: int, accepted: int, emitted: int) -> None:
        s = self.stats
        s.passes += 1
        s.drafted += drafted
        s.accepted += accepted
        s.emitted += emitted


def verify(model, cache, fed: list[int], seq, penalties, context):
    """One forward pass over `fed` (the last sampled token, then the drafts): the token the
    sequence samples at each position, as a one-token step would sample it there.

    Returns (tokens, logprobs rows, sampler keys or None, the penalties' context
    with every fed token). Nothing is read back but the tokens.
    """
    fed_arr = mx.array(fed)
    logits = model(fed_arr[None], cache=cache)[0]
    if penalties:
        # Row i is sampled after fed[:i + 1]: each row gets the context a one-token step would have.
        context = fed_arr if context is None else mx.concat([context, fed_arr])
        base = context.size - len(fed)
        rows = []
        for i in range(len(fed)):
            row = logits[i:i + 1]
            for processor in penalties:
                row = processor(context[:base + i + 1], row)
            rows.append(row)
        logits = mx.concatenate(rows)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if seq.sampler is None:
        tokens, keys = mx.argmax(logprobs, axis=-1), None
    else:
        tokens, keys = seq.sampler.draws(logprobs)
    return tokens.tolist(), logprobs, keys, context


class Speculation:
    """The engine's speculative decoding: settings, the draft model, counters."""

    def __init__(self, mode: str, num_draft_tokens: int, ngram_size: int, chunk_size: int,
                 draft_model=None, vocab_rows: int = 0):
        self.mode = mode
        self.k = num_draft_tokens
        self.ngram_size = ngram_size
        self.chunk_size = chunk_size
        self.draft_model = draft_model
        self.vocab_rows = vocab_rows
        self.stats = SpecStats()

    def describe(self) -> str:
        how = (f"prompt lookup ({self.ngram_size}-grams)" if self.mode == "ngram" else "a draft model")
        return (f"speculative decoding: {how}, up to {self.k} draft tokens per pass, for a request that runs "
                "alone (greedy or sampled, no grammar); batched requests decode one token per step")

    def for_sequence(self, seq) -> SequenceSpeculation | None:
        """The sequence's speculation, or None: grammar-constrained requests decode without it."""
        if grammar_of(seq.processors) is not None:
            return None
        if self.mode == "ngram":
            proposer = NgramProposer(self.ngram_size)
        else:
            proposer = DraftProposer(self.draft_model, self.chunk_size, self.vocab_rows)
        return SequenceSpeculation(proposer, self.k, self.stats)


def make_speculation(cfg, loaded, *, solo_path: bool) -> Speculation | None:
    """The engine's Speculation from its settings, or None when off (and why, logged).

    Raises ValueError for settings that cannot work (a draft mode without a draft model).
    """
    mode = cfg.speculative
    draft = getattr(loaded, "draft", None)
    if mode is None and draft is not None:
        mode = "draft"
    if mode is None:
        return None
    if mode not in MODES:
        raise ValueError(f"--speculative must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "draft" and draft is None:
        raise ValueError("--speculative draft needs --draft-model")
    if mode == "ngram" and draft is not None:
        raise ValueError("--speculative ngram and --draft-model exclude each other: pick one")
    if cfg.num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be at least 1, not {cfg.num_draft_tokens}")
    if cfg.ngram_size < 1:
        raise ValueError(f"--ngram-size must be at least 1, not {cfg.ngram_size}")
    if draft is not None:
        blocker = rewind_blocker(draft.model)
        if blocker:
            raise ValueError(f"--draft-model {draft.source}: {blocker}")
    why_off = None
    if not solo_path:
        why_off = "it runs on the lone request's path, which --no-solo-fast-path turns off"
    elif loaded.vision is not None:
        why_off = "vision-language models are not covered (their text half runs through mlx-vlm)"
    else:
        blocker = rewind_blocker(loaded.model)
        if blocker:
            why_off = f"this model's cache cannot be rewound: {blocker}"
    if why_off:
        log.warning("speculative decoding off: %s", why_off)
        return None
    spec = Speculation(mode, cfg.num_draft_tokens, cfg.ngram_size, cfg.prefill_chunk_size,
                       draft.model if draft is not None else None, loaded.vocab_size or (1 << 62))
    log.info("%s", spec.describe())
    if any(isinstance(c, RotatingKVCache) for c in _layers(make_prompt_cache(loaded.model))):
        log.info("speculative decoding: the model has sliding-window layers; a request speculates only "
                 "while its tokens fit their window")
    return spec

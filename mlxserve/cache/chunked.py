"""Chunked attention (Llama 4) in batches and in cached blocks.

Llama 4's chunked layers let the token at position p attend only to the
tokens of its own `attention_chunk_size` (C) chunk: positions p // C * C to
p. mlx-lm 0.32 keeps such a layer in a `ChunkedKVCache`, which holds the
keys from some point before the chunk start (it keeps the last C before each
forward pass and masks the rest away) and has no batched form: without a
`merge`, BatchGenerator cannot batch the model.

`BatchChunkedKVCache` is mlx-lm's `BatchKVCache` (rows left-padded and
right-aligned at `_idx`) with two differences:

- its mask keeps every query inside its own row's chunk. Chunk boundaries sit
  at absolute positions, which differ per row; column j of row b holds
  position `j - _idx + offset[b]` (the invariant BatchKVCache's updates,
  `finalize`, `filter` and `extend` all keep), so the mask reads nothing
  but `offset` and `_idx`;
- it drops columns no row can read any more. Every row ends at `_idx` and
  its next query reads at most C - 1 positions back, so the columns before
  `_idx - (C - 1)` can go; they go a chunk at a time (each drop costs a copy
  of what is left at the next write), so the cache holds fewer than 2C
  columns plus what the current pass adds (mlx-lm's single cache: C plus the
  pass), not every token as full attention does. `left_padding` is the
  first column holding a key of the row (what `extract` and block
  extraction read from): after a drop it is clamped at 0, and after
  `finalize` it also covers the columns its roll wraps to the front.

Blocks keep a chunked layer's KV for their tokens while the cache still holds
them (`single_runs`, `row_runs`); `restore.py` rebuilds a `ChunkedKVCache`
holding the tokens from the current chunk start, all any later query reads.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, ChunkedKVCache


class BatchChunkedKVCache(BatchKVCache):
    def __init__(self, chunk_size: int, left_padding: list[int]):
        super().__init__(left_padding)
        self.chunk_size = chunk_size

    def maybe_trim_front(self) -> None:
        """Drop the columns no row reads any more (Llama 4's forward calls it before each pass)."""
        # Not inside a right-padded prefill: its rows end before `_idx` until `finalize`.
        if self.keys is None or self._right_padding is not None:
            return
        drop = self._idx - (self.chunk_size - 1)
        if drop < self.chunk_size:
            return
        self.keys = self.keys[..., drop:, :]
        self.values = self.values[..., drop:, :]
        self._idx -= drop
        self.left_padding = mx.maximum(self.left_padding - drop, 0)

    def prepare(self, **kwargs):
        # BatchGenerator right-pads every prefill pass of rows of unequal lengths, and the
        # pass's forward cannot drop columns then: drop them here, while rows still end at `_idx`.
        if self._right_padding is None:
            self.maybe_trim_front()
        super().prepare(**kwargs)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        """(B, 1, N, _idx + N): query i of row b, at position offset[b] + i, sees the
        row's keys at positions of its own chunk up to its own.

        A row's unreadable columns (left padding, what `finalize` rolls in) hold
        positions before its first key, which is at or before its chunk start
        (no row ever lacks a key it reads), so the chunk rule hides them too.
        """
        C = self.chunk_size
        keys = mx.arange(self._idx + N)[None] + (self.offset - self._idx)[:, None]  # (B, S) positions
        queries = self.offset[:, None] + mx.arange(N)[None]  # (B, N)
        keys, queries = keys[:, None, :], queries[:, :, None]
        return ((keys <= queries) & (keys // C == queries // C))[:, None]

    def extract(self, idx: int) -> ChunkedKVCache:
        """Row `idx` as mlx-lm's single-sequence cache, with every token the row holds."""
        pad, end = self.left_padding[idx].item(), self.offset[idx].item()
        held = max(self._idx - pad, 0)
        c = ChunkedKVCache(self.chunk_size)
        c.offset, c.start_position = end, end - held
        if held:
            c.keys = mx.contiguous(self.keys[idx : idx + 1, :, pad : self._idx])
            c.values = mx.contiguous(self.values[idx : idx + 1, :, pad : self._idx])
        return c

    @classmethod
    def merge(cls, caches) -> "BatchChunkedKVCache":
        """A batch of single-sequence ChunkedKVCaches (fresh, restored or mlx-lm's own)."""
        held = [0 if c.keys is None else c.offset - c.start_position for c in caches]
        longest = max(held)
        cache = cls(caches[0].chunk_size, [longest - n for n in held])
        cache.offset = mx.array([c.offset for c in caches])  # absolute positions: rope reads them
        if longest == 0:
            return cache
        like = next(c for c, n in zip(caches, held) if n)
        _, heads, _, k_dim = like.keys.shape
        keys = mx.zeros((len(caches), heads, longest, k_dim), like.keys.dtype)
        values = mx.zeros((len(caches), heads, longest, like.values.shape[3]), like.values.dtype)
        for i, (n, c) in enumerate(zip(held, caches)):
            if n:
                keys[i : i + 1, :, longest - n :] = c.keys[..., :n, :]
                values[i : i + 1, :, longest - n :] = c.values[..., :n, :]
        cache.keys, cache.values, cache._idx = keys, values, longest
        return cache


def _merge(_, caches):
    return BatchChunkedKVCache.merge(caches)


def install() -> None:
    """Give mlx-lm's ChunkedKVCache the `merge` BatchGenerator batches caches with."""
    ChunkedKVCache.merge = classmethod(_merge)


# ---- blocks ----


def single_runs(c: ChunkedKVCache, start: int, end: int):
    """Buffer slices holding tokens [start, end) of a ChunkedKVCache; None if it no longer holds them all."""
    if c.keys is None or start < c.start_position or end > c.offset:
        return None
    return [(start - c.start_position, end - c.start_position)]


def row_runs(c: BatchChunkedKVCache, row: int, start: int, end: int, seen: dict):
    """Buffer slices holding tokens [start, end) of one row of a BatchChunkedKVCache; None if
    the row no longer holds them all. `seen` keeps each cache's row numbers for the call
    (one device sync per layer, not per block)."""
    if c.keys is None:
        return None
    if id(c) not in seen:
        seen[id(c)] = (c.offset[row].item(), c.left_padding[row].item())
    n, readable = seen[id(c)]
    first = c._idx - n + start  # the column of token `start`
    if end > n or first < readable:
        return None
    return [(first, first + end - start)]


def oldest_held(c, row: int | None = None) -> int:
    """The first token a chunked cache (a row of a batched one) still holds."""
    if isinstance(c, BatchChunkedKVCache):
        if row is None:
            return 0
        n = c.offset[row].item()
        return n if c.keys is None else n - max(c._idx - c.left_padding[row].item(), 0)
    return c.offset if c.keys is None else c.start_position


def restore_range(chunk_size: int, num_tokens: int) -> tuple[int, int]:
    """Tokens a chunked layer restored at `num_tokens` holds: from the current chunk's start,
    all that any later query of the layer reads."""
    return num_tokens // chunk_size * chunk_size, num_tokens

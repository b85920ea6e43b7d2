"""Prefix caching over the block pool: the calls the runner makes.

    match = cache.match(prompt)              # at admission; acquires blocks
    caches = cache.restore(model, match)     # None: run uncached
    cache.release(match)                     # restore copied what it needed
    ... prefill prompt[match.num_tokens:] in chunks; after each chunk:
    cache.store_from_cache(caches, tokens_in_cache, len(tokens_in_cache), hashes=match.hashes)
    ... and once more when the request ends, with finished=True (its partial last block too)

A match takes whole blocks by their chained keys, then goes on token by
token into the best cached continuation of the last one (a block that
parts from the prompt midway, or a finished request's partial last block),
so hits are exact to the token as in a radix tree, with vLLM-style hashed
blocks underneath.

Every entry point catches its own errors: a cache fault is counted (with
its reason) and the request runs uncached, it never fails.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.cache.blocks import block_key, content_key, extra_at, hash_blocks, overlap
from mlxserve.cache.from_disk import read_chain, read_children
from mlxserve.cache.layers import (
    KIND_NAMES,
    describe_specs,
    extract_blocks,
    extract_blocks_from_batch,
    fill_missing,
    flat_entries,
    missing_leaves,
    flat_specs,
    layer_specs,
    needed_blocks,
    oldest_window_token,
    spec_kinds,
    unsupported_layers,
)
from mlxserve.cache.payload import payload_buffers
from mlxserve.cache.restore import restore_cache
from mlxserve.cache.pool import BlockPool

log = logging.getLogger(__name__)

# no_match: never stored; evicted: stored, pushed out by the budget; model_mismatch:
# stored under another model fingerprint; too_short: no full block before the
# last token; unrestorable: blocks are cached but lack a layer's payload where a
# restore would read it; unsupported: the model has cache layers blocks cannot hold;
# damaged: the first block was on disk, but its file failed its check (and is gone).
MISS_REASONS = ("no_match", "evicted", "model_mismatch", "too_short", "unrestorable", "unsupported", "damaged")

# Cached children of the last matched block compared token by token with the
# rest of the prompt (the most recently stored or used ones).
PARTIAL_CANDIDATES = 16


@dataclass
class PrefixMatch:
    blocks: list = field(default_factory=list)  # acquired: release after restore
    num_tokens: int = 0  # tokens the restored cache holds; 0 means run uncached
    hashes: list = field(default_factory=list)  # keys of the prompt's full blocks, for store_*
    miss: str | None = None  # why nothing matched (MISS_REASONS), when nothing did
    partial: bool = False  # the hit ends inside a block


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, fingerprint: str, *, model=None, disk=None,
                 checkpoint_interval: int = 4):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0, not {checkpoint_interval}")
        self.pool = pool
        self.checkpoint_interval = checkpoint_interval
        self.disk = disk  # a DiskTier (cache/disk.py), or None
        # A paged batch's block pool (cache/paged.py), set by its runner: blocks stored from a single
        # sequence keep their full-attention KV there too, so that the batch takes them by reference.
        self.kv_pool = None
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.disabled: str | None = None  # why this model cannot be cached, if it cannot
        if model is not None:
            cache_layers = make_prompt_cache(model)
            unsupported = unsupported_layers(cache_layers)
            try:
                if unsupported:
                    raise ValueError(f"blocks cannot hold {unsupported}; requests run uncached")
                self._check_specs(layer_specs(cache_layers))
            except ValueError as e:
                self._disable(str(e))
        self.queries = 0
        self.hits = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.partial_hits = 0  # hits that end inside a block (a cached block used in part, or a tail)
        self.misses = dict.fromkeys(MISS_REASONS, 0)
        self.faults: dict[str, int] = {}

    @property
    def specs(self):
        """Layer specs of this fingerprint's blocks (known once a model or a store told)."""
        return self.pool.layouts.get(self.fingerprint)

    def _check_specs(self, specs):
        if None in specs:
            raise ValueError("the model has cache layers that blocks cannot hold")
        known = self.pool.layouts.setdefault(self.fingerprint, specs)
        if known != specs:
            raise ValueError(f"cache layout {specs} differs from the model's {known}")

    def describe(self) -> str:
        """What this cache keeps of the model's layers, for the start-up log."""
        if self.disabled:
            return f"prefix cache off for this model: {self.disabled}"
        counts = describe_specs(self.specs or ())
        text = ", ".join(f"{n} {KIND_NAMES[k]}" for k, n in counts.items())
        text = f"prefix cache: {self.block_size}-token blocks over {text} layers"
        if "state" in counts:
            every = f"every {self.checkpoint_interval} blocks and " if self.checkpoint_interval else ""
            text += (f"; recurrent states kept {every}at each prompt's last block end and last token but one "
                     "(hits resume only there)")
        return text

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        log.warning("prefix cache disabled: %s", reason)

    def _fault(self, where: str, error: Exception) -> None:
        key = f"{where}: {type(error).__name__}"
        first = key not in self.faults
        self.faults[key] = self.faults.get(key, 0) + 1
        (log.warning if first else log.debug)("prefix cache %s failed, running uncached: %s", where, error)

    # ---- lookup ----

    def match(self, token_ids, extra_keys=None, whole=()) -> PrefixMatch:
        """The longest restorable cached prefix of `token_ids`, its blocks acquired.

        Leaves at least one token to prefill (the model must compute the
        logits of the last prompt token), and ends inside none of the `whole`
        token ranges (images whose tokens attend to each other both ways: the
        rest of one would be prefilled without its start).
        """
        self.queries += 1
        self.queried_tokens += len(token_ids)
        if self.disabled:
            match = PrefixMatch(miss="unsupported")
        else:
            try:
                match = self._match(token_ids, extra_keys, whole=whole)
            except Exception as e:  # noqa: BLE001 - a cache fault must not fail the request
                self._fault("match", e)
                return PrefixMatch()
        if match.miss:
            self.misses[match.miss] += 1
        else:
            self.hits += 1
            self.hit_tokens += match.num_tokens
            self.partial_hits += match.partial
        return match

    def _match(self, token_ids, extra_keys, from_disk: bool = True, whole=()) -> PrefixMatch:
        """`match` without counting it: a hit ending inside a `whole` range is matched again, up to its start."""
        usable = len(token_ids) - 1
        while True:
            match = self._match_upto(token_ids, extra_keys, usable, from_disk)
            inside = next((start for start, end in whole if start < match.num_tokens < end), None)
            if inside is None:
                return match
            self.pool.release(match.blocks)
            usable = inside

    def _match_upto(self, token_ids, extra_keys, usable: int, from_disk: bool) -> PrefixMatch:
        """The longest restorable cached prefix of at most `usable` tokens."""
        bs = self.block_size
        hashes = hash_blocks(token_ids, bs, fingerprint=self.fingerprint, extra_keys=extra_keys)
        drops = self.disk.drops if self.disk is not None else 0
        specs = self.specs
        has_state = self._has_state(specs)
        if has_state:  # recurrent states exist at block ends only
            best = min(len(hashes), usable // bs) * bs
        else:  # attention layers restore at any token: the last block may be cut
            best = min(len(hashes) * bs, usable)
        blocks = self._lookup(hashes[: -(-best // bs)], from_disk) if best > 0 else []
        found = len(blocks)
        partial = False
        try:
            num = self._restorable(blocks, specs, best) if blocks else 0
            keep, tail = -(-num // bs), None
            # Past a block end at or after `num`, the best cached continuation, token by token
            # (a block that parts from the prompt midway, a prompt's or a finished request's
            # partial last block). Block ends from the last one found back to `num`: with
            # recurrent layers only a whole tail serves (its state sits at its end), and the
            # one that does may be blocks back, as turn 1's prompt tail is from turn 2, whose
            # blocks of turn 1's answer were stored without states.
            for k in range(found, keep - 1, -1):
                got = self._tail_at(blocks, hashes, k, token_ids, usable, extra_keys, specs, has_state,
                                    from_disk, skip=hashes[k] if k < found else None)
                if got is not None:
                    tail, n = got
                    keep, num = k, k * bs + n
                    break
            self.pool.release(blocks[keep:])
            blocks = blocks[:keep]
            if tail is not None:
                blocks += self.pool.lookup([tail.hash])
                self.pool.touch_child(tail)
                partial = True
        except Exception:
            self.pool.release(blocks)
            raise
        if num == 0:
            if found == 0 and self.disk is not None and self.disk.drops > drops:
                return PrefixMatch([], 0, hashes, miss="damaged")
            return PrefixMatch([], 0, hashes, miss=self._miss_reason(token_ids, extra_keys, hashes, best, found))
        return PrefixMatch(blocks, num, hashes, partial=partial)

    def _tail_at(self, blocks, hashes, k: int, token_ids, usable: int, extra_keys, specs, has_state: bool,
                 from_disk: bool, skip=None):
        """(block, n): the cached child of block k - 1 (a first block if k is 0) whose first n
        tokens continue the prompt from token k * block_size, restorable there after the
        prompt's `blocks` 0..k-1, the furthest such; None if none. `skip`: the prompt's own
        block k, whose end the caller has tried already."""
        start = k * self.block_size
        if start >= usable:
            return None
        parent, rest = hashes[k - 1] if k else None, token_ids[start:usable]
        extra = extra_at(extra_keys, k)
        children = self._partial_children(parent, rest, extra, skip)
        if from_disk and self._read_children(parent, rest, extra, children, has_state):
            children = self._partial_children(parent, rest, extra, skip)
        for child, n in children:
            if has_state and n != len(child.token_ids):
                continue
            if self._restorable(blocks[:k] + [child], specs, start + n, state_end=start + n) == start + n:
                return child, n
        return None

    def _lookup(self, hashes, from_disk: bool = True) -> list:
        """The longest run of cached blocks from the start of `hashes`, acquired: the hot
        tier's, continued from the disk tier (its blocks read back into the hot tier)."""
        blocks = self.pool.lookup(hashes)
        if self.disk is None or not from_disk:
            return blocks
        try:
            return read_chain(self.pool, self.disk, hashes, blocks, self.kv_pool)
        except Exception as e:  # noqa: BLE001 - the blocks found so far still serve
            self._fault("disk", e)
        return blocks

    def _read_children(self, parent, rest, extra, children, has_state: bool) -> int:
        """Read from disk the children of `parent` that continue `rest` further than the
        hot tier's `children` do; how many."""
        if self.disk is None:
            return 0
        try:
            have = max((n for c, n in children if not has_state or n == len(c.token_ids)), default=0)
            return read_children(self.pool, self.disk, parent, rest, extra, have=have,
                                 limit=PARTIAL_CANDIDATES, block_size=self.block_size,
                                 fingerprint=self.fingerprint, whole_only=has_state, kv_pool=self.kv_pool)
        except Exception as e:  # noqa: BLE001 - memory's children still serve
            self._fault("disk", e)
            return 0

    def covered_tokens(self, token_ids, extra_keys=None) -> int:
        """How many leading tokens of `token_ids` a match would restore now from memory.

        A peek: it counts no query, holds no block and reads nothing from disk.
        """
        if self.disabled:
            return 0
        try:
            match = self._match(token_ids, extra_keys, from_disk=False)
        except Exception as e:  # noqa: BLE001
            self._fault("peek", e)
            return 0
        self.release(match)
        return match.num_tokens

    def _miss_reason(self, token_ids, extra_keys, hashes, best: int, found: int) -> str:
        if best <= 0:
            return "too_short"
        if found:
            return "unrestorable"
        if self.pool.was_evicted(hashes[0]):
            return "evicted"
        owner = self.pool.root_owner(content_key(token_ids, self.block_size, extra_keys))
        if owner is not None and owner != self.fingerprint:
            return "model_mismatch"
        return "no_match"

    def checkpoints(self, start: int, end: int) -> list[int]:
        """Token counts in (start, end] where a prefill of tokens [start, end) stops and
        keeps the recurrent state (the runner cuts prefill passes there).

        A recurrent layer's state exists only where the cache ends, so a restore
        can start only where a prefill pass once stopped: every
        `checkpoint_interval` blocks, at the last block end before `end`, and at
        the prompt's tail (`prompt_tail_end`), where a repeat of the prompt or an
        agent's next turn (which drops this turn's reasoning) continues from.
        Empty for models without recurrent layers, whose every block can be
        restored anywhere.
        """
        if self.disabled or not self._has_state(self.specs):
            return []
        bs = self.block_size
        points = set()
        if self.checkpoint_interval:
            step = self.checkpoint_interval * bs
            points.update(range((start // step + 1) * step, end, step))
        last = (end - 1) // bs * bs
        if last > start:
            points.add(last)
        tail = self.prompt_tail_end(end)
        if tail > start:
            points.add(tail)
        if end % bs == 0:
            points.add(end)  # no pause: the prefill ends there, and the state is kept
        return sorted(points)

    def prompt_tail_end(self, prompt_len: int) -> int | None:
        """Where a prompt's partial last block is worth storing as soon as prefill reaches
        it (`finished=True` then), or None.

        With recurrent layers: at the prompt's last token but one, with the state
        there, so a repeat of the prompt (which must leave one token to compute)
        and an agent's next turn (which parts from this one where its reasoning
        began) restore all of it. With sliding-window (or chunked) layers: at its
        end, since by the time decoding completes that block its first tokens have
        left the window (the chunk), and a repeat could only restore up to the
        block before.
        """
        kinds = spec_kinds(self.specs or ())
        if self.disabled or not {"window", "chunk", "state"} & kinds:
            return None
        return prompt_len - 1 if "state" in kinds else prompt_len

    @staticmethod
    def _has_state(specs) -> bool:
        return specs is not None and "state" in spec_kinds(specs)

    def _keyed_here(self, block) -> bool:
        """Whether a first block's key is what this cache (fingerprint) gives its tokens.

        Blocks of every model share the pool, and first blocks share one parent
        (none); a later block's parent key already commits to the fingerprint.
        """
        return block_key(block.token_ids, self.block_size, fingerprint=self.fingerprint,
                         extra=block.extra) == block.hash

    def _partial_children(self, parent, rest, extra, skip=None) -> list:
        """[(block, n)]: the cached children of `parent` but `skip` whose first n >= 1 tokens
        (and the media among them) are the first n of `rest`, longest first. (A block completed
        after a sliding window moved on may lack layers that a shorter tail holds.)"""
        found, ids = [], None
        for child in self.pool.children(parent, PARTIAL_CANDIDATES):
            if child.hash == skip or child.token_ids is None or (parent is None and not self._keyed_here(child)):
                continue
            if ids is None:  # most block ends have one child, the prompt's own block: `skip`
                ids = np.asarray(rest[: self.block_size], dtype=np.int32)
            n = overlap(child.token_ids, child.extra, ids, extra)
            if n > 0:
                found.append((child, n))
        return sorted(found, key=lambda cn: -cn[1])

    def _restorable(self, blocks, specs, best: int, state_end: int | None = None) -> int:
        """The largest p <= best that every layer can be restored at from `blocks`; 0 if none.

        Blocks may lack a layer's payload (sliding-window tokens stored after
        the window had moved on; recurrent states between chunk ends), so p
        walks back from the end to the last position whose reads are all there.
        """
        bs = self.block_size
        top = min(len(blocks) * bs, best)
        leaf_specs = flat_specs(specs)
        gaps = [missing_leaves(b.payload, specs) for b in blocks]
        if not any(gaps):
            candidates = [top]
        else:
            candidates = [top] + [k * bs for k in range(top // bs, 0, -1) if k * bs < top]
        # Per layer with gaps, a running count of blocks lacking it.
        missing = {}
        for i in sorted({i for g in gaps for i in g}):
            counts = [0]
            for g in gaps:
                counts.append(counts[-1] + (i in g))
            missing[i] = counts
        for p in candidates:
            for i, spec in enumerate(leaf_specs):
                ranges = needed_blocks(spec, p, bs, state_end)
                if ranges is None:
                    break
                counts = missing.get(i)
                if counts is not None and any(counts[b] - counts[a] for a, b in ranges):
                    break
            else:
                return p
        return 0

    def restore(self, model, match: PrefixMatch, full_from: int = 0):
        """A fresh prompt cache holding `match.num_tokens` tokens, or None (run uncached).
        `full_from`: restore_cache's (its full-attention layers only from that token)."""
        if match.num_tokens <= 0 or not match.blocks:
            return None
        try:
            payloads = [b.payload for b in match.blocks]
            blocks = match.blocks
            state_end = (len(blocks) - 1) * self.block_size + blocks[-1].num_tokens  # a tail ends early
            caches = restore_cache(model, payloads, match.num_tokens, block_size=self.block_size,
                                   state_end=state_end, full_from=full_from)
            mx.eval([v for _, v in tree_flatten([c.state for c in caches]) if isinstance(v, mx.array)])
            return caches
        except Exception as e:  # noqa: BLE001
            self.hit_tokens -= match.num_tokens  # counted at match, never served
            self.hits -= 1
            self._fault("restore", e)
            return None

    # ---- pins ----

    def pin(self, token_ids) -> tuple[list, int]:
        """Pin the cached blocks that hold `token_ids` from its start: its full blocks (from
        disk too), then the cached block that continues them furthest into the rest (a
        finished prompt's tail), and those a prompt going on from this one restores from.
        Returns (the blocks, how many tokens of `token_ids` they hold); give them back with
        `unpin`. Unlike `match`, nothing is held back for the last token: a pinned prefix is
        the start of later prompts, not a prompt."""
        if self.disabled:
            raise ValueError(f"the prefix cache is off for this model: {self.disabled}")
        bs = self.block_size
        hashes = hash_blocks(token_ids, bs, fingerprint=self.fingerprint)
        blocks = self._lookup(hashes)
        restored = []
        try:
            num = len(blocks) * bs
            if len(blocks) == len(hashes) and num < len(token_ids):
                found = self._partial_children(hashes[-1] if hashes else None, token_ids[num:], None)
                if found:
                    child, n = found[0]
                    blocks += self.pool.lookup([child.hash])
                    num += n
            # And the blocks a prompt that goes on from this one restores from: with recurrent
            # layers that may be a shorter tail, blocks back, where a state was kept.
            restored = self._match_upto(token_ids, None, len(token_ids), from_disk=True).blocks
            have = {b.hash for b in blocks}
            pinned = blocks + [b for b in restored if b.hash not in have]
            self.pool.pin(pinned)
        finally:
            self.pool.release(blocks)  # the pins hold their own references
            self.pool.release(restored)
        return pinned, num

    def unpin(self, blocks) -> None:
        self.pool.unpin(blocks)

    def release(self, match: PrefixMatch) -> None:
        """Give the match's blocks back (idempotent)."""
        blocks, match.blocks = match.blocks, []
        try:
            self.pool.release(blocks)
        except Exception as e:  # noqa: BLE001
            self._fault("release", e)

    # ---- store ----

    def store_from_cache(self, cache_layers, token_ids, upto_tokens: int, extra_keys=None, *, hashes=None,
                         finished: bool = False, state: bool = True) -> int:
        """Store every full block of `token_ids[:upto_tokens]` not stored yet, from a single-sequence cache.

        `upto_tokens` is how many tokens the cache holds. With `finished` (the
        sequence is done), the tokens after its last full block are stored too,
        as a tail that the next turn of a conversation can continue from.
        `state`: keep the recurrent state where the cache ends, if that is a
        block end (callers keep it at checkpoints only: each costs memory).
        Returns how many blocks were stored or completed.
        """
        try:
            return self._store(cache_layers, None, token_ids, upto_tokens, extra_keys, hashes, finished, state)
        except Exception as e:  # noqa: BLE001
            self._fault("store", e)
            return 0

    def store_from_batch(
        self, batch_cache, row: int, token_ids, upto_tokens: int, extra_keys=None, *, hashes=None,
        finished: bool = False, state: bool = True,
    ) -> int:
        """`store_from_cache` for one row of a BatchGenerator's batched cache."""
        try:
            return self._store(batch_cache, row, token_ids, upto_tokens, extra_keys, hashes, finished, state)
        except Exception as e:  # noqa: BLE001
            self._fault("store", e)
            return 0

    def _hashes(self, token_ids, n_full, extra_keys, hashes):
        bs = self.block_size
        have = list(hashes[:n_full]) if hashes else []
        if len(have) < n_full:
            have += hash_blocks(
                token_ids[len(have) * bs : n_full * bs],
                bs,
                fingerprint=self.fingerprint,
                extra_keys=extra_keys[len(have) :] if extra_keys else None,
                parent=have[-1] if have else None,
            )
        return have

    def _store(self, layers, row, token_ids, upto_tokens, extra_keys, hashes, finished, state) -> int:
        bs = self.block_size
        upto = min(upto_tokens, len(token_ids))
        n_full = upto // bs
        if self.disabled or (n_full == 0 and not finished):
            return 0
        specs = layer_specs(layers)
        if None in specs:
            self._disable("the model has cache layers that blocks cannot hold")
            return 0
        self._check_specs(specs)
        hashes = self._hashes(token_ids, n_full, extra_keys, hashes)
        leaf_specs = flat_specs(specs)

        def extract(start, n, only=None, size=bs, states=state):
            if row is None:
                payloads = extract_blocks(layers, start, size, n, num_tokens=upto_tokens, layers=only, states=states,
                                          pool=self.kv_pool)
            else:
                payloads = extract_blocks_from_batch(layers, row, start, size, n, num_tokens=upto_tokens,
                                                     layers=only, states=states)
            # Queued, not waited for: the copies run after the decode step already queued, and
            # waiting here would leave the accelerator idle while the host builds the next step
            # (a read of a payload, e.g. by the disk tier, waits for it then).
            mx.async_eval([a for p in payloads for a in payload_buffers(p)])
            for j, payload in enumerate(payloads):
                for spec, e in zip(leaf_specs, flat_entries(payload, specs)):
                    if only is None and spec[0] == "full" and e is None:
                        end = start + (j + 1) * size
                        raise ValueError(f"the cache does not hold tokens {end - size}-{end}")
            return payloads

        # Blocks that may still get a missing payload from this cache: the
        # block ending where the cache ends (recurrent state) and those whose
        # tokens every sliding-window and chunked layer still holds.
        has_window = bool({"window", "chunk"} & spec_kinds(specs))
        fill_from = -(-oldest_window_token(layers, row) // bs) if has_window else n_full - 1
        pool = self.pool
        done = 0
        k = 0
        while k < n_full:
            block = pool.get(hashes[k])
            if block is not None:
                if k >= fill_from and missing_leaves(block.payload, specs):
                    done += self._fill(block, specs, k, upto_tokens if state else None, extract)
                k += 1
                continue
            end = k + 1
            while end < n_full and hashes[end] not in pool:
                end += 1
            for j, payload in enumerate(extract(k * bs, end - k), start=k):
                tokens = np.asarray(token_ids[j * bs : (j + 1) * bs], dtype=np.int32)
                block = pool.store(hashes[j], hashes[j - 1] if j else None, payload, num_tokens=bs,
                                   token_ids=tokens, extra=extra_at(extra_keys, j))
                if block is None:
                    return done  # later blocks would be unreachable orphans
                if self.disk is not None:
                    self.disk.save(block)
                if j == 0:
                    pool.note_root(content_key(token_ids, bs, extra_keys), self.fingerprint)
                done += 1
            k = end
        if finished and upto > n_full * bs:
            tail = upto - n_full * bs  # its recurrent state, if any, is where the cache ends: at its end
            done += self._store_tail(hashes[n_full - 1] if n_full else None, token_ids[n_full * bs : upto],
                                     extra_at(extra_keys, n_full),
                                     lambda: extract(n_full * bs, 1, size=tail, states=True)[0])
        return done

    def _store_tail(self, parent, tokens, block_extra, extract) -> int:
        """Store a finished sequence's last, partial block under its last full block."""
        if parent is not None and parent not in self.pool:
            return 0
        extra = tuple(e for e in block_extra or () if e[1] < len(tokens)) or None  # media in the tail
        key = block_key(tokens, self.block_size, fingerprint=self.fingerprint, extra=extra, parent=parent)
        if key in self.pool:
            return 0
        stored = self.pool.store(key, parent, extract(), num_tokens=len(tokens),
                                 token_ids=np.asarray(tokens, dtype=np.int32), extra=extra)
        if stored is not None and self.disk is not None:
            self.disk.save(stored)  # a restarted server continues from it as this one does
        return int(stored is not None)

    def _fill(self, block, specs, k, upto_tokens, extract) -> int:
        """Extract the layers a cached block lacks, where this cache can give them
        (a recurrent state only if the cache ends at the block's end, `upto_tokens`)."""
        end = (k + 1) * self.block_size
        only = set()
        for i, (e, spec) in enumerate(zip(block.payload, specs)):
            leaves = zip(flat_entries([e], [spec]), flat_specs([spec]))
            if any(le is None and ls[0] != "positions" and (ls[0] != "state" or end == upto_tokens)
                   for le, ls in leaves):
                only.add(i)
        if not only:
            return 0
        merged = fill_missing(block.payload, extract(k * self.block_size, 1, only)[0])
        if merged is None or not self.pool.update(block.hash, merged):
            return 0
        if self.disk is not None:
            self.disk.save(block, update=True)  # the file lacks what memory now has
        return 1

    # ---- reporting ----

    def stats(self) -> dict:
        s = self.pool.stats()
        s.update(
            block_size=self.block_size,
            queries=self.queries,
            hits=self.hits,
            queried_tokens=self.queried_tokens,
            hit_tokens=self.hit_tokens,
            hit_rate=self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
            partial_hits=self.partial_hits,
            misses=dict(self.misses),
            faults=dict(self.faults),
            disabled=self.disabled,
            layers=describe_specs(self.specs or ()),
            checkpoint_interval=self.checkpoint_interval,
        )
        if self.disk is not None:
            s["disk"] = self.disk.stats()
        return s

    def reset(self) -> None:
        """Drop every cached block not in use, in memory and on disk."""
        self.pool.reset()
        if self.disk is not None:
            self.disk.clear()

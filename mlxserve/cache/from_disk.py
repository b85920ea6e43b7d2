"""Reading the disk tier back into the hot tier while a prompt is matched.

Two reads, so that a server restarted from its disk tier hits as far as it
did from memory: the chain of a prompt's full blocks past those in memory
(`read_chain`), and, past the last whole block that matched, the cached
children of that block that continue the prompt for some tokens: a block that
parts from the prompt midway, or a finished request's partial last block
(`read_children`). What is read is stored in the hot tier, where the match
then finds it as if it had never left memory.
"""

from __future__ import annotations

from mlxserve.cache.blocks import block_key, overlap

# Disk children read per match, at most: each that continues the prompt further than
# memory's best is read whole (and checked) to be tried.
MAX_CHILD_READS = 4


def _store(pool, disk, key: bytes, parent: bytes | None, kv_pool=None) -> bool:
    """Read one block file into the hot tier (not acquired). `kv_pool`: a paged batch's block pool
    (cache/paged.py), which then keeps the block's full-attention KV, so that hits on it take it
    by reference as on any block stored from the batch."""
    got = disk.load(key)
    if got is None:
        return False
    on_disk_parent, payload, num_tokens, token_ids, extra = got
    if on_disk_parent != parent:
        return False
    if kv_pool is not None:
        payload = kv_pool.pool_blocks([payload], [0], None)[0]
    return pool.store(key, parent, payload, num_tokens=num_tokens, token_ids=token_ids, extra=extra) is not None


def read_chain(pool, disk, hashes, blocks: list, kv_pool=None) -> list:
    """`blocks` (the hot tier's run from the start of `hashes`, acquired) continued with the
    blocks of `hashes` read from disk, acquired too; stops at the first one missing,
    damaged, or with no room in the hot tier."""
    for key in hashes[len(blocks):]:
        if key not in disk or not _store(pool, disk, key, blocks[-1].hash if blocks else None, kv_pool):
            break
        blocks += pool.lookup([key])
    return blocks


def read_children(pool, disk, parent: bytes | None, rest, rest_extra, *, have: int, limit: int,
                  block_size: int, fingerprint: str, whole_only: bool, kv_pool=None) -> int:
    """Read into the hot tier the children of `parent` on disk (the `limit` most recently
    used ones not in memory) that serve more leading tokens of `rest` than `have` (memory's
    best); with `whole_only`, only children that `rest` holds whole (a recurrent state sits
    at a block's end). Returns how many were read."""
    found = []
    for key in disk.children(parent, limit):
        if key in pool:
            continue
        got = disk.peek(key)
        if got is None:
            continue
        tokens, extra = got
        # A first block's parent (none) is every model's: only this model's key will do.
        if parent is None and block_key(tokens, block_size, fingerprint=fingerprint, extra=extra) != key:
            continue
        n = overlap(tokens, extra, rest, rest_extra)
        if n > have and (not whole_only or n == len(tokens)):
            found.append((n, key))
    read = 0
    for _, key in sorted(found, key=lambda nk: -nk[0])[:MAX_CHILD_READS]:
        read += _store(pool, disk, key, parent, kv_pool)
    return read

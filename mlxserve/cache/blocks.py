"""Block keys: a chained sha256 over fixed-size token blocks.

A block's key commits to everything that decides its KV state: every token
before it (through the parent key), its own tokens, the extra keys of the
media whose placeholder tokens fall in it, and the model fingerprint
(weights, quantization, KV dtype). Keys are cryptographic because they will
name files of a disk tier that outlives the process: a collision there would
silently serve another prompt's state.

Full blocks get chained keys; a finished sequence's partial last block (its
"tail") gets a key of its own kind (`tail_key`), which no prompt's full-block
lookup can ever produce.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

# Bump when the byte layout below changes: keys on disk then stop matching,
# which is what must happen.
_VERSION = b"mlxserve-kv-block-v1\0"
_ROOT = bytes(32)  # parent key of a prompt's first block


def _encode(x) -> bytes:
    """A typed, length-prefixed encoding of an extra key.

    Not `repr`/`pickle`: the bytes must stay the same across Python versions
    and processes, and ("a", "b") must differ from ("ab",).
    """
    if x is None:
        return b"n"
    if isinstance(x, bool):
        return b"t" if x else b"f"
    if isinstance(x, int):
        s = str(x).encode()
        return b"i" + struct.pack("<I", len(s)) + s
    if isinstance(x, float):
        return b"d" + struct.pack("<d", x)
    if isinstance(x, str):
        s = x.encode()
        return b"s" + struct.pack("<I", len(s)) + s
    if isinstance(x, (bytes, bytearray, memoryview)):
        s = bytes(x)
        return b"b" + struct.pack("<I", len(s)) + s
    if isinstance(x, (tuple, list)):
        return b"(" + struct.pack("<I", len(x)) + b"".join(_encode(i) for i in x) + b")"
    raise TypeError(f"extra key of type {type(x).__name__} cannot be hashed stably")


def _tokens(token_ids) -> np.ndarray:
    # int64 little-endian whatever the platform, so keys are portable.
    return np.asarray(token_ids, dtype="<i8").reshape(-1)


def hash_blocks(
    token_ids,
    block_size: int,
    *,
    fingerprint: str,
    extra_keys=None,
    parent: bytes | None = None,
) -> list[bytes]:
    """One 32-byte key per FULL block of `token_ids`, each chained on the one before.

    `extra_keys[i]` holds the extra keys of block i (a tuple, e.g.
    `((media_hash, offset),)`; None or missing entries mean none).
    `parent` continues a chain: hashing tokens[k*bs:] with parent=keys[k-1]
    gives keys[k:].
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    tokens = _tokens(token_ids)
    fp = fingerprint.encode()
    prefix = _VERSION + struct.pack("<I", len(fp)) + fp
    prev = _ROOT if parent is None else bytes(parent)
    keys = []
    for i in range(len(tokens) // block_size):
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        h = hashlib.sha256(prefix)
        h.update(prev)
        h.update(tokens[i * block_size : (i + 1) * block_size].tobytes())
        h.update(_encode(tuple(extra) if extra else ()))
        prev = h.digest()
        keys.append(prev)
    return keys


def tail_key(parent: bytes | None, token_ids, *, fingerprint: str, extra=None) -> bytes:
    """The key of a partial block: the tokens after a sequence's last full block (`parent`)."""
    tokens = _tokens(token_ids)
    fp = fingerprint.encode()
    h = hashlib.sha256(_VERSION + b"tail\0" + struct.pack("<I", len(fp)) + fp)
    h.update(_ROOT if parent is None else bytes(parent))
    h.update(struct.pack("<I", len(tokens)))
    h.update(tokens.tobytes())
    h.update(_encode(tuple(extra) if extra else ()))
    return h.digest()


def content_key(token_ids, block_size: int, extra_keys=None) -> bytes | None:
    """A key of the first block's content without the model fingerprint.

    Lets the cache tell "this prompt was cached, but for another model"
    (a model mismatch) from a plain miss. None if there is no full block.
    """
    tokens = _tokens(token_ids)
    if len(tokens) < block_size:
        return None
    extra = extra_keys[0] if extra_keys else None
    h = hashlib.sha256(_VERSION + b"content\0")
    h.update(tokens[:block_size].tobytes())
    h.update(_encode(tuple(extra) if extra else ()))
    return h.digest()


def extra_at(extra_keys, j: int):
    """Block j's extra keys (its media), or None."""
    return extra_keys[j] if extra_keys and j < len(extra_keys) else None


def block_key(token_ids, block_size: int, *, fingerprint: str, extra=None, parent: bytes | None = None) -> bytes:
    """The key a block holding `token_ids` after `parent` gets: a full block's chained key,
    or a partial block's `tail_key`."""
    if len(token_ids) == block_size:
        return hash_blocks(token_ids, block_size, fingerprint=fingerprint, extra_keys=[extra], parent=parent)[0]
    return tail_key(parent, token_ids, fingerprint=fingerprint, extra=extra)


def overlap(tokens: np.ndarray, extra, rest: np.ndarray, rest_extra) -> int:
    """How many leading tokens of `rest` (with media `rest_extra`) a block holding `tokens`
    (with media `extra`) can serve: their common run, cut where the media in it differ
    (equal placeholder tokens stand for equal pixels only when the images are too)."""
    n = min(len(tokens), len(rest))
    differ = np.flatnonzero(tokens[:n] != rest[:n])
    n = int(differ[0]) if len(differ) else n

    def starting_before(keys):  # media are (hash, offset) pairs
        return {k for k in keys or () if k[1] < n}

    differ = starting_before(extra) ^ starting_before(rest_extra)
    return min([n] + [max(0, k[1]) for k in differ])


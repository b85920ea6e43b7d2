"""Paged prefix cache: KV (and recurrent state) of shared prompt prefixes, kept in fixed-size token blocks.

- `blocks`: block keys (chained sha256 of tokens, extra keys, model fingerprint).
- `layers`: per-layer payloads; extraction from mlx-lm caches (single or one
  row of a batch) and restore into fresh single-sequence caches.
- `pool`: `BlockPool`, ref counts, leaf-first LRU eviction within a byte budget.
- `prefix`: `PrefixCache`, the runner-facing API (match / restore / release / store).
- `sizes`: byte budgets (4GB, 512MB, 20%), the memory MLX may use, and what it holds now.
"""

from mlxserve.cache.blocks import hash_blocks
from mlxserve.cache.layers import extract_blocks, extract_blocks_from_batch, payload_nbytes
from mlxserve.cache.restore import restore_cache
from mlxserve.cache.pool import Block, BlockPool
from mlxserve.cache.prefix import PrefixCache, PrefixMatch
from mlxserve.cache.sizes import parse_size

__all__ = [
    "Block",
    "BlockPool",
    "PrefixCache",
    "PrefixMatch",
    "extract_blocks",
    "extract_blocks_from_batch",
    "hash_blocks",
    "parse_size",
    "payload_nbytes",
    "restore_cache",
]

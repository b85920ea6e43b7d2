"""The engine's caches, built on its MLX thread at start: the prefix cache (with its disk tier),
the vision cache, and where the running batch keeps its KV (`--kv-layout`). Imports run down
from here: engine -> cache, multimodal."""

from __future__ import annotations

import logging

log = logging.getLogger("mlxserve.engine")


def kv_layout(cfg, loaded) -> str:
    """contiguous or paged, for --kv-layout (auto: paged where it was measured faster: CUDA, its
    decode kernel; on Metal its decode would take the gather path, as the Metal kernel has never
    run, and on the CPU that path measured slower). Raises for an explicit paged it cannot run."""
    from mlxserve.cache import paged_batch

    pageable = not cfg.kv_bits and loaded.vision is None and paged_batch.attends_through_mlx_lm(loaded.model)
    if cfg.kv_layout == "paged" and not pageable:
        raise ValueError("--kv-layout paged takes mlx-lm's text models without --kv-bits (paged KV is not "
                         "quantized, and mlx-vlm's models, vision-language or text, attend their own way)")
    if cfg.kv_layout != "auto":
        return cfg.kv_layout
    return "paged" if pageable and paged_batch.decode_kernel() == "cuda" else "contiguous"


def prefix_cache(cfg, loaded, dequantize_kv: bool):
    """The prefix cache (None with --no-prefix-cache), its disk tier where --disk-cache-dir is set."""
    if not cfg.prefix_cache:
        return None
    from mlxserve.cache import BlockPool, PrefixCache, parse_size

    # Blocks hold KV as the engine computes it: quantized KV, and how attention
    # reads it (which changes later layers' KV), is another fingerprint.
    kv = f"/kv{cfg.kv_bits}{'d' if dequantize_kv else 'q'}" if cfg.kv_bits else ""
    fingerprint = loaded.fingerprint + kv + runtime()
    disk = None
    if cfg.disk_cache_dir:
        from mlxserve.cache.disk import DiskTier

        disk = DiskTier(cfg.disk_cache_dir, parse_size(cfg.disk_cache_size),
                        write_rate=parse_size(cfg.disk_cache_write_rate) or None,
                        daily_writes=parse_size(cfg.disk_cache_daily_writes) or None)
    cache = PrefixCache(BlockPool(parse_size(cfg.cache_memory)), cfg.block_size, fingerprint,
                        model=loaded.model, disk=disk, checkpoint_interval=cfg.checkpoint_interval)
    log.info("%s", cache.describe())
    return cache


def vision_cache(cfg, loaded):
    """A vision-language model's cache of image embeddings (None for a text model, or a 0 budget);
    its tower is made pausable, so that a tower pass may yield to decoding."""
    if loaded.vision is None:
        return None
    from mlxserve.cache import parse_size
    from mlxserve.engine.stepwise import make_pausable
    from mlxserve.multimodal.vision_cache import VisionCache

    budget = parse_size(cfg.vision_cache_memory)
    scope = (loaded.fingerprint, loaded.vision.settings_key())
    make_pausable(loaded.vision.tower_blocks())
    return VisionCache(budget, scope) if budget > 0 else None


def runtime() -> str:
    """The libraries that compute the KV: blocks kept on disk across an upgrade of them must
    not be reused (the same model could give slightly different KV)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "?"

    return "".join(f"/{p}{of(p)}" for p in ("mlx", "mlx-lm", "mlx-vlm", "mlxserve"))

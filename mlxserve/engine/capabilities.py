"""How a model is served, in words a client can read: its cache layers' kinds, and whether
its requests batch, hit the prefix cache and survive a restart (the disk tier). The engine
works it out at start (`AsyncEngine.serving`, in /v1/models); docs/architectures.md's
table is the same facts for every mlx-lm model type (docs/architectures.py)."""

from __future__ import annotations

from mlx_lm.models.cache import CacheList, make_prompt_cache

from mlxserve.cache.layers import KIND_NAMES, layer_spec
from mlxserve.models.families import prefill_batch_size, unbatchable_layers


def layer_kinds(model) -> dict[str, int]:
    """{kind in words: cache layers}, CacheLists opened up; classes blocks cannot hold by name."""
    counts: dict[str, int] = {}

    def add(caches):
        for c in caches:
            if isinstance(c, CacheList):
                add(c.caches)
                continue
            spec = layer_spec(c)
            if spec is None or spec[0] != "positions":
                kind = KIND_NAMES[spec[0]] if spec is not None else type(c).__name__
                counts[kind] = counts.get(kind, 0) + 1

    add(make_prompt_cache(model))
    return counts


def capabilities(model, config: dict, *, cache_off: str | None, disk: bool, images: bool = False) -> dict:
    """The model's serving facts. `cache_off`: why the prefix cache is off for it (None: on);
    `disk`: a disk tier is configured; `images`: it is served with its vision tower."""
    limits = []
    if "vision_config" in config and not images:
        limits.append("text only: a vision-language model whose images mlxserve has no adapter for "
                      "(docs/architectures.md); requests with images are refused")
    unbatchable = unbatchable_layers(model)
    if unbatchable:
        limits.append(f"one request at a time: mlx-lm cannot batch its {', '.join(unbatchable)} layers")
    elif prefill_batch_size(config, 2) == 1:
        limits.append("prompts are prefilled one at a time (its recurrent layers would take a batch's "
                      "padding into their state); decoding batches")
    if cache_off:
        limits.append(f"no prefix cache: {cache_off}")
    elif not disk:
        limits.append("no disk tier configured (--disk-cache-dir): cached prefixes end with the process")
    return {
        "model_type": config.get("model_type"),
        "images": images,
        "layer_kinds": layer_kinds(model),
        "batches": not unbatchable,
        "caches": cache_off is None,
        "survives_restart": cache_off is None and disk,
        "limits": limits,
    }

"""Writes docs/architectures.md: every text model type of the installed mlx-lm, how mlxserve
serves it, and the model types it refuses, with why.

    python3 docs/architectures.py

Each type's tiny config (mlxserve/models/tiny.py) is built without weights; its cache
layers, batching and prefix cache are what the engine reports at start and in /v1/models
(mlxserve/engine/capabilities.py). tests/test_architectures.py checks every served type
(tests/test_families.py the ones it covers): same greedy tokens alone, in batches, on cache
hits and after a restart from the disk tier.
"""

import logging
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxserve.engine.runner  # noqa: E402,F401 - installs mlxserve's fixes of mlx-lm, as serving does
from mlxserve.cache import BlockPool, PrefixCache  # noqa: E402
from mlxserve.engine.capabilities import capabilities  # noqa: E402
from mlxserve.models.architectures import REFUSED, build_text_model, text_architectures  # noqa: E402
from mlxserve.models.shapes import SHAPES  # noqa: E402
from mlxserve.models.tiny import tiny_config  # noqa: E402
from vlm_architectures import section as vlm_section  # noqa: E402 - docs/vlm_architectures.py

def family_test_types() -> set:
    """The model types tests/test_families.py covers (its hand-written configs and shapes)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_families import CONFIGS, SHAPES as FAMILY_SHAPES

    return {c["model_type"] for c in CONFIGS.values()} | {SHAPES[s]["model_type"] for s in FAMILY_SHAPES}


def state(model_type: str) -> dict:
    config = tiny_config(model_type)
    model = build_text_model(config, model_type)
    cache = PrefixCache(BlockPool(1 << 20), 16, "docs", model=model)
    return capabilities(model, config, cache_off=cache.disabled, disk=True)


def yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def table() -> str:
    families = family_test_types()
    rows = ["| model type | cache layers (tiny config) | batches | prefix cache | after a restart | tested by "
            "| notes |", "|---|---|---|---|---|---|---|"]
    for t in text_architectures():
        if t in REFUSED:
            rows.append(f"| `{t}` | | refused | | | test_architectures (refused) | {REFUSED[t]} |")
            continue
        s = state(t)
        kinds = ", ".join(f"{n} {k}" for k, n in s["layer_kinds"].items())
        test = "test_families" if t in families else "test_architectures"
        notes = "; ".join(s["limits"])
        rows.append(f"| `{t}` | {kinds} | {yes(s['batches'])} | {yes(s['caches'])} | "
                    f"{yes(s['survives_restart'])} | {test} | {notes} |")
    return "\n".join(rows)


def page() -> str:
    refused = "\n".join(f"- `{t}`: {why}" for t, why in sorted(REFUSED.items())) or "- none"
    return f"""# Architectures

Every text model type of mlx-lm {version("mlx-lm")} (its `mlx_lm/models/` modules), and how
mlxserve serves it. Written by `python3 docs/architectures.py` on this machine; run it again
after upgrading mlx-lm. Vision-language models (mlx-vlm) are [below](#vision-language-models-mlx-vlm-{version("mlx-vlm").replace(".", "")});
how images are handled is in [images-video.md](images-video.md).

Each served type is tested on a tiny random-weight config built from its `ModelArgs`
(`mlxserve/models/tiny.py`; serve one with `mlxserve serve MODEL_TYPE --load-format dummy`):
greedy tokens alone, in batches of 2 and 3 prompts of different lengths, cold, on a full
and a partial prefix-cache hit, with the cache off and after a restart from the disk tier
must all be the same (`tests/test_architectures.py`, or `tests/test_families.py` with
hand-written configs). A running server says the same per model in `/v1/models`
(`serving`: `layer_kinds`, `batches`, `caches`, `survives_restart`, `limits`).

- **batches**: requests decode together in one batch. Where mlx-lm cannot merge a layer's
  cache into a batch, the model serves one request at a time (said at start and in
  `/v1/models`), never with other tokens. Some recurrent models prefill prompts one at a
  time and batch the decoding (notes).
- **prefix cache**: repeated and shared prompt prefixes are restored, not recomputed (hits
  on recurrent layers resume at block ends). Where blocks cannot hold a layer's cache,
  requests run uncached.
- **after a restart**: with `--disk-cache-dir`, cached prefixes come back after a restart.
- **cache layers**: the kinds of the tiny config's cache layers; a real config may mix them
  in other proportions.

mlx-lm's model code that changed tokens in a batch or on a cache hit is patched narrowly
in `mlxserve/models/mlx_lm_fixes.py` and `llama4_batch.py` (Gemma 2, Phi-3-small, AFM 7,
GPT-BigCode, Nemotron-NAS, PLaMo 3, Llama 4).

## Refused model types

The server refuses these at load with the reason below (a one-line error):

{refused}

## All model types

{table()}

{vlm_section()}"""


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # each uncacheable type's start-up warning
    out = ROOT / "docs" / "architectures.md"
    out.write_text(page())
    print(f"wrote {out}")

"""The vision-language section of docs/architectures.md (docs/architectures.py writes the page):
every package of the installed mlx-vlm, how mlxserve serves it (with images, as text
through mlx-lm, or refused with why), and for those served with images what the engine
reports at start (mlxserve/engine/capabilities.py), from each type's tiny config
(mlxserve/models/tiny_vlm.py). tests/test_vlm_architectures.py checks every row.
"""

import json
import tempfile
from importlib.metadata import version
from pathlib import Path

from mlxserve.cache import BlockPool, PrefixCache
from mlxserve.engine.capabilities import capabilities
from mlxserve.models.load import load
from mlxserve.models.tiny_vlm import tiny_vlm_config
from mlxserve.models.vlm_architectures import is_vlm, state, vlm_packages
from mlxserve.models.vlm_text import REFUSED_CONFIGS


def served(model_type: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(tiny_vlm_config(model_type)))
        loaded = load(str(path), load_format="dummy", progress=False)
    cache = PrefixCache(BlockPool(1 << 20), 16, "docs", model=loaded.model)
    return capabilities(loaded.model, loaded.config, cache_off=cache.disabled, disk=True, images=True)


def yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def table() -> str:
    rows = ["| model type | served | cache layers (tiny config) | batches | prefix cache | after a restart | notes |",
            "|---|---|---|---|---|---|---|"]
    for package in vlm_packages():
        if not is_vlm(package):
            continue
        kind, detail = state(package)
        if kind == "images":
            s = served(package)
            kinds = ", ".join(f"{n} {k}" for k, n in s["layer_kinds"].items())
            rows.append(f"| `{package}` | with images ({detail}) | {kinds} | {yes(s['batches'])} | "
                        f"{yes(s['caches'])} | {yes(s['survives_restart'])} | {'; '.join(s['limits'])} |")
        elif kind == "text":
            rows.append(f"| `{package}` | text only, as mlx-lm's `{detail}` (see above) | | | | | images refused |")
        else:
            rows.append(f"| `{package}` | **refused** | | | | | {detail} |")
    return "\n".join(rows)


def served_text(model_type: str) -> dict:
    """What the engine reports for one of mlx-vlm's own text models (models/vlm_text.py)."""
    loaded = load(model_type, load_format="dummy", progress=False)
    cache = PrefixCache(BlockPool(1 << 20), 16, "docs", model=loaded.model)
    return capabilities(loaded.model, loaded.config, cache_off=cache.disabled, disk=True)


def others() -> str:
    """mlx-vlm's packages that are not vision-language models: served as text, or refused."""
    text, own, refused = [], [], []
    for package in vlm_packages():
        if is_vlm(package):
            continue
        kind, detail = state(package)
        if kind == "text":
            text.append(f"`{package}`" + (f" (`{detail}`)" if detail != package else ""))
        elif kind == "vlm text":
            s = served_text(package)
            kinds = ", ".join(f"{n} {k}" for k, n in s["layer_kinds"].items())
            config_refusal = REFUSED_CONFIGS.get(package)
            refused_configs = [f"refused at load as {config_refusal[1]}"] if config_refusal else []
            own.append(f"| `{package}` | {kinds} | {yes(s['batches'])} | {yes(s['caches'])} | "
                       f"{yes(s['survives_restart'])} | {'; '.join(s['limits'] + refused_configs)} |")
        else:
            refused.append(f"- `{package}`: {detail}")
    header = "| model type | cache layers (tiny config) | batches | prefix cache | after a restart | notes |"
    own_table = "\n".join([header, "|---|---|---|---|---|---|", *own])
    return (f"Served as text through mlx-lm (the table above): {', '.join(text)}.\n\n"
            "Served as text through mlx-vlm's own model classes (`mlxserve/models/vlm_text.py`: text models "
            "mlx-lm does not have), each tested as mlx-lm's types are on a 2-layer tiny config built from its "
            "`ModelConfig` (`tests/test_vlm_text.py`); `mlxserve serve klear --load-format dummy` serves one:\n\n"
            f"{own_table}\n\nRefused at load, with why:\n\n" + "\n".join(refused))


def section() -> str:
    return f"""## Vision-language models (mlx-vlm {version("mlx-vlm")})

Every package of mlx-vlm's `mlx_vlm/models/` whose config has a vision tower and whose model
merges image features into its language model's input (`get_input_embeddings`). A type is
served **with images** by a hand-written adapter (`mlxserve/models/vlm.py`: Qwen2-VL,
Qwen2.5-VL, Gemma 3, LLaVA) or the generic one (`mlxserve/models/vlm_generic.py`, one
`FAMILIES` entry per type: its image processor and the tokens around an image); **text
only** where mlx-lm has the model type (its language model, images refused with a 400);
otherwise **refused** at load with the reason given.

Each type served with images is tested on a tiny random-weight config built from mlx-vlm's
config classes (`mlxserve/models/tiny_vlm.py`), an image in every prompt: greedy tokens
alone, in batches of 2 and 3 prompts of different lengths, cold, from a full hit (the
image's KV reused) and a partial one, with the cache off and after a restart from the disk
tier are all the same, and are mlx-vlm's own whole-prompt pass's; the image darkened gives
other tokens, so the image's rows count (`tests/test_vlm_architectures.py`). A running
server says the same per model in `/v1/models` (`serving.images` too). To serve a tiny
one: write its config (`python3 -c "import json; from mlxserve.models.tiny_vlm import tiny_vlm_config;
print(json.dumps(tiny_vlm_config('glm4v')))" > glm4v.json`) and run
`mlxserve serve glm4v.json --load-format dummy`; a bare type that mlx-lm does not have
(`mlxserve serve glm4v --load-format dummy`) is its tiny VLM directly.

{table()}

### Other mlx-vlm packages

{others()}
"""

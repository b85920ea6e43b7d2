"""mlx-vlm's text-only model types that mlx-lm does not have, served as text models through
mlx-vlm's own classes (issue 33): one path for every such type, no file per type.

mlx-vlm ships decoder-only language models of its own (`cohere2_moe`, `klear`, `qwen3_5_text`,
...): a package whose `Model` is a `language_model` and nothing else, its config one flat
`ModelConfig`. mlxserve builds that Model and serves it like an mlx-lm model:

- `VLMText` is the model the engine sees: the Model's children under their own names (so
  weights load, save and quantize as mlx-vlm's checkpoints name them), called through its
  language model for logits, its caches made as mlx-lm's classes where mlx-vlm's are copies of
  them (BatchGenerator merges only mlx-lm's, the prefix cache stores only those);
- a layer cache of a class mlx-lm has no copy of (Z1T's pooled AFT state, DeepSeek-V4's
  PoolingCache) keeps mlx-vlm's own classes for the whole model: the engine then runs it one
  request at a time, uncached, and says so at start and in /v1/models (engine/capabilities.py);
- PATCHES mend mlx-vlm code that gives a batch row other tokens than the row alone, per
  package, each saying why; REFUSED_CONFIGS refuse at load what cannot be served causally;
- `tiny_text_config`: a tiny random-weight config from the package's `ModelConfig`, filled
  by models/tiny.py's size rules, 2 layers; what names cannot tell is in OVERRIDES.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json

import mlx.nn as nn

LAYERS = 2  # the generated test's configs: 2 layers (both kinds, where a type has two)

# mlx-vlm cache subclasses that are its KVCache in all the engine relies on, by name.
# Hunyuan V4's HyV4KVCache: the same keys and values (its own growth step, values as wide as
# they come), and twice the bytes a token in its memory profile (an estimate mlxserve does not
# read); mlx-lm's KVCache stores keys and values of different widths the same way.
SAME_AS_KVCACHE = frozenset({"HyV4KVCache"})


@functools.lru_cache(maxsize=None)
def is_vlm_text(model_type: str) -> bool:
    """Whether `model_type` is one of mlx-vlm's text-only packages mlx-lm lacks and mlxserve
    serves through this module (not refused: vlm_architectures.VLM_REFUSED)."""
    from mlxserve.models.architectures import is_text_architecture
    from mlxserve.models.vlm_architectures import VLM_REFUSED, is_vlm, package_of, text_type, vlm_packages

    if not isinstance(model_type, str) or is_text_architecture(model_type):
        return False
    package = package_of(model_type)
    if package not in vlm_packages() or package in VLM_REFUSED or is_vlm(package) or text_type(package):
        return False
    module = _module(package)
    return module is not None and hasattr(module, "Model") and hasattr(module, "ModelConfig")


def _module(package: str):
    try:
        return importlib.import_module(f"mlx_vlm.models.{package}")
    except Exception:  # noqa: BLE001 - a package that cannot be imported here is not served
        return None


# Configs mlxserve cannot serve with mlx-vlm's tokens, by package: (the config refused, why).
# HRM-Text with prefix_lm (its default): its processor marks every prompt token as prefix
# (token_type_ids 1), and the model attends both ways over the prefix in a pass from the start,
# and over all it has cached in every later pass: a prompt's tokens depend on where prefill
# chunks and cache hits cut it. Served causally (prefix_lm false) it would not be that model.
PREFIX_LM = ("a prefix LM (prefix_lm true): its processor marks the whole prompt as prefix and the model attends "
             "both ways over it, so a prompt cut into prefill chunks or continued from cached blocks would change "
             "its tokens; mlxserve serves text models causally (a config with prefix_lm false is served)")
REFUSED_CONFIGS = {"hrm_text": (lambda config: config.get("prefix_lm", True), PREFIX_LM)}

# Packages whose code reads its layers' weight matrices directly, so quantized layers (--quantize)
# would not be used as layers: their first pass fails.
NOT_QUANTIZABLE = {
    "limite": ("Limite reads its projections' weight matrices directly (a learned scale folded into each) and "
               "its head is the embedding's matrix transposed, so quantized layers would not work; serve it "
               "unquantized"),
}


def check_text_config(config: dict, source: str) -> None:
    """A one-line ModelLoadError for a config of a served type that cannot be served exactly."""
    from mlxserve.models.files import ModelLoadError
    from mlxserve.models.vlm_architectures import package_of

    refused, why = REFUSED_CONFIGS.get(package_of(config["model_type"]), (lambda config: False, ""))
    if refused(config):
        raise ModelLoadError(f"{source}: model type {config['model_type']!r} cannot be served: {why}")


def build_vlm_text(config: dict, source: str = "config") -> "VLMText":
    """mlx-vlm's model for a text-only `config` (weights not loaded), wrapped for the engine."""
    from mlxserve.models.vlm_architectures import package_of

    check_text_config(config, source)
    package = package_of(config["model_type"])
    module = _module(package)
    PATCHES.get(package, lambda: None)()
    return VLMText(module.Model(module.ModelConfig.from_dict(dict(config))))


def load_vlm_text(folder, source: str) -> "VLMText":
    """A text-only mlx-vlm model folder, its weights read by mlx-vlm's loader (its `sanitize`)."""
    from pathlib import Path

    from mlx_vlm.utils import load_model

    from mlxserve.models.vlm_architectures import package_of

    config = json.loads((Path(folder) / "config.json").read_text())
    check_text_config(config, source)
    PATCHES.get(package_of(config["model_type"]), lambda: None)()
    return VLMText(load_model(Path(folder)))


def _lm_cache(c):
    """mlx-lm's cache object for mlx-vlm's `c`, or None where mlx-lm has no copy of its class."""
    from mlx_lm.models import cache as lm
    from mlx_vlm.models import cache as vlm

    kind = type(c)
    if kind is vlm.KVCache or kind.__name__ in SAME_AS_KVCACHE and isinstance(c, vlm.KVCache):
        return lm.KVCache()
    if kind is vlm.RotatingKVCache:
        return lm.RotatingKVCache(max_size=c.max_size, keep=c.keep)
    if kind is vlm.ArraysCache:
        return lm.ArraysCache(len(c.cache))
    if kind is vlm.CacheList:
        parts = [_lm_cache(part) for part in c.caches]
        return None if None in parts else lm.CacheList(*parts)
    return None


class VLMText(nn.Module):
    """A text-only mlx-vlm Model, shaped like an mlx-lm model for the engine (see the module doc)."""

    def __init__(self, model):
        super().__init__()
        for name, child in model.items():  # the Model's modules and arrays, under their names
            self[name] = child
        object.__setattr__(self, "config", model.config)
        object.__setattr__(self, "model_type", model.config.model_type)
        from mlxserve.models.vlm_patches import _PATCHES as LANGUAGE_PATCHES

        # mlx-vlm code that meets mlx-lm's batch caches, mended as for the VLMs built on it (Qwen3.5's rows).
        for module in {klass.__module__ for klass in type(model.language_model).__mro__} & LANGUAGE_PATCHES.keys():
            LANGUAGE_PATCHES[module]()
        made = model.language_model.make_cache()
        mapped = [_lm_cache(c) for c in made]
        # A class mlx-lm lacks: all layers keep mlx-vlm's own classes, which work together. mlx-vlm's
        # merge makes its own batch classes, which mlx-lm's BatchGenerator does not drive (a padded
        # row's tokens change: DeepSeek-V4's), so the engine runs such a model one request at a time
        # (families.unbatchable_layers reads `own_cache_classes`) and the prefix cache holds none of them.
        object.__setattr__(self, "own_caches", None in mapped)
        object.__setattr__(self, "own_cache_classes", sorted({name for c in made for name in _unmapped(c)}))
        if not self.own_caches and any(_has_arrays(c) for c in mapped):
            from mlxserve.models.vlm import add_recurrent_cache_methods

            add_recurrent_cache_methods()  # mlx-vlm's Gated-DeltaNet calls them (models/vlm.py)

    def random_weights(self, weights: dict) -> dict:
        """Random weights (models/dummy.py init_weights) with each one-number parameter 1: the
        classes leave such learned gains at 0 (Limite's projection scales and residual lambdas),
        which would zero every layer's output."""
        import mlx.core as mx

        return {name: mx.ones_like(w) if w.ndim == 0 and mx.issubdtype(w.dtype, mx.floating) else w
                for name, w in weights.items()}

    def check_quantizable(self, source: str) -> None:
        """A one-line ModelLoadError where quantizing this model's layers would break it."""
        from mlxserve.models.files import ModelLoadError
        from mlxserve.models.vlm_architectures import package_of

        why = NOT_QUANTIZABLE.get(package_of(self.model_type))
        if why is not None:
            raise ModelLoadError(f"{source}: cannot quantize a {self.model_type} model: {why}")

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self) -> list:
        made = self.language_model.make_cache()
        return made if self.own_caches else [_lm_cache(c) for c in made]

    def __call__(self, inputs, cache=None, **kwargs):
        return self.language_model(inputs, cache=cache, **kwargs).logits


def _unmapped(c) -> list[str]:
    """The classes in mlx-vlm's cache `c` that mlx-lm has no copy of (a CacheList's parts)."""
    from mlx_vlm.models.cache import CacheList

    if type(c) is CacheList:
        return [name for part in c.caches for name in _unmapped(part)]
    return [] if _lm_cache(c) is not None else [type(c).__name__]


def _has_arrays(c) -> bool:
    from mlx_lm.models.cache import ArraysCache, CacheList

    return isinstance(c, ArraysCache) or isinstance(c, CacheList) and any(_has_arrays(p) for p in c.caches)


def tiny_text_config(model_type: str) -> dict:
    """A small random-weight-ready config of mlx-vlm's text-only `model_type` (models/tiny.py's
    size rules over its ModelConfig, LAYERS layers); a one-line ModelLoadError if refused."""
    from mlxserve.models.architectures import check_served
    from mlxserve.models.tiny import _fill, _merge
    from mlxserve.models.vlm_architectures import package_of

    check_served({"model_type": model_type}, model_type)
    args_class = _module(package_of(model_type)).ModelConfig
    config = _fill(args_class, model_type)
    for f in dataclasses.fields(args_class):
        if f.name in ("num_hidden_layers", "num_layers", "n_layers", "n_layer"):
            config[f.name] = LAYERS
    config["tie_word_embeddings"] = False
    _merge(config, copy.deepcopy(OVERRIDES.get(model_type, {})))
    return config


def _hy_v4_indexer_uncompiled() -> None:
    """Hunyuan V4's indexer picks each query's top keys through `mx.compile(shapeless=True)`
    around `argpartition(kth=-top_k)`: a shapeless trace keeps the kth it resolved for the
    first key count, so once the keys grow (every decode step) it partitions at the wrong place
    and the last top_k are not the top keys; the tokens then depend on which shapes the
    function met first (a batch's, or a lone prompt's). The same scores, uncompiled."""
    import mlx.core as mx
    from mlx_vlm.models.hy_v4 import indexer

    @functools.lru_cache(maxsize=None)
    def partition_scores(top_k, masked):
        def partition(q, k, weights, mask=None):
            scores = mx.maximum(q @ k.swapaxes(-1, -2), 0) * weights.swapaxes(-1, -2)[..., None]
            scores = scores.sum(axis=1, keepdims=True)
            if masked:
                scores = mx.where(mask, scores, -float("inf"))
            return mx.argpartition(scores, kth=-top_k, axis=-1)

        return partition

    indexer._partition_scores = partition_scores


def _limite_batch_rows() -> None:
    """Limite builds its rotary positions as `arange(offset, ...)` and its attention mask from the
    offset alone (a causal window), both for one row: in an mlx-lm batch the offset is an array
    of each row's, and a row's left padding must be masked. For a batch (an array offset) each
    row's positions come from its own offset and the mask is the batch cache's (its padding and
    Limite's window: window + 1 keys, the query's own included); a lone row is unchanged."""
    import mlx.core as mx
    from mlx_vlm.models.limite import language

    if getattr(language, "_mlxserve_batch_rows", False):
        return
    model_call, attention_call, window_mask = (language.LimiteModel.__call__, language.Attention.__call__,
                                               language._causal_window_mask)
    batch_masks = []  # the mask of the attention call under way (one thread runs the model)

    def limite_call(self, inputs, cache=None, positions=None):
        offset = cache[0].offset if cache is not None and cache[0] is not None else 0
        if positions is None and isinstance(offset, mx.array):
            positions = offset[:, None] + mx.arange(inputs.shape[1])[None]
        return model_call(self, inputs, cache=cache, positions=positions)

    def attention(self, attn_in, ve_rows, positions, cache=None):
        if cache is None or not isinstance(cache.offset, mx.array):
            return attention_call(self, attn_in, ve_rows, positions, cache)
        window = None if self.window is None else self.window + 1
        batch_masks.append(cache.make_mask(attn_in.shape[1], return_array=True, window_size=window))
        try:
            return attention_call(self, attn_in, ve_rows, positions, cache)
        finally:
            batch_masks.pop()

    def mask(q_len, offset, window, dtype):
        return batch_masks[-1] if isinstance(offset, mx.array) else window_mask(q_len, offset, window, dtype)

    language.LimiteModel.__call__, language.Attention.__call__, language._causal_window_mask = (
        limite_call, attention, mask)
    language._mlxserve_batch_rows = True


def _deepseek_v4_freqs_evaluated() -> None:
    """DeepSeek-V4's rotary embedding keeps the frequencies it derives per head size in a dict,
    made lazily on first use. An MLX array belongs to the stream of the thread that made it: an
    entry made in one thread and never evaluated there (its first use a branch whose result is
    dropped) fails in the next thread that runs the model ("There is no Stream(cpu, 0) in current
    thread": an engine started after a check in another thread, or an engine restarted). Each
    entry is evaluated as it is made."""
    import mlx.core as mx
    from mlx_vlm.models.deepseek_v4 import language

    get_freqs = language.DeepseekV4RoPE._get_freqs
    if getattr(get_freqs, "mlxserve", False):
        return

    def evaluated(self, head_dim, inverse):
        freqs = get_freqs(self, head_dim, inverse)
        mx.eval(freqs)
        return freqs

    evaluated.mlxserve = True
    language.DeepseekV4RoPE._get_freqs = evaluated


# mlx-vlm behaviours mended per package, applied before its model is built (each says why).
PATCHES = {"deepseek_v4": _deepseek_v4_freqs_evaluated, "hy_v4": _hy_v4_indexer_uncompiled,
           "limite": _limite_batch_rows}


# What the field names cannot tell, per model type.
SLIDING = ["sliding_attention", "full_attention"]
OVERRIDES: dict[str, dict] = {
    # A local (sliding) layer and a compressed one (4 tokens a pooled key, its sparse indexer); one
    # layer routed by token hash; 3 of its hyper-connections' normalising passes (20: the same code).
    "deepseek_v4": {"compress_ratios": [0, 4], "o_groups": 2, "num_hash_layers": 1, "index_block": 8,
                    "index_keep": 4, "hc_sinkhorn_iters": 3},
    # Its H and L stacks, each run twice a pass (8 cache layers); causal (see REFUSED_CONFIGS).
    "hrm_text": {"L_cycles": 1, "prefix_lm": False},
    "hy_v4": {"indexer_types": ["full", "shared"]},  # a layer with its own indexer, one reusing its picks
    "kolibri1": {"layer_types": SLIDING},
    "xing4_0": {"hc_sinkhorn_iters": 3},  # (its hyper-connections' normalising passes: 20, the same code)
    # Rotary over 8 of a head's 16 dims; layer 1 global (no window), value embeddings in it, mixing
    # the embeddings' and layer 0's outputs (MUDD); its sigmoid head's logits not all 0 (a = 0 unset).
    "limite": {"rope_n_pairs": 4, "global_layers": [1], "ve_layers": [1], "ve_dim": 16, "xsa_layers": [0, 1],
               "attn_gate_channels": 16, "mudd_layers": [1], "mudd_tap_idx": {"1": [0, 1]}, "mudd_taps": 2,
               "softcap_logits": {"kind": "sigmoid", "a": 30.0, "b": 0.0, "c": 16.0}},
}

"""Random-weight models of real architectures, for benchmarks and tests
(`--load-format dummy`, as vLLM's): any config mlx-lm or mlx-vlm can build."""

import copy
import json
import math
import zlib
from pathlib import Path

from mlxserve.models.shapes import SHAPES, text_config

# Logit standard deviation the output layer is scaled to. Random models have
# nearly flat logits, where greedy argmax flips on rounding noise (e.g. batched
# vs unbatched runs). With std 12 over 151936 tokens the top-1/top-2 gap is
# about 2.5 on average, and below 1e-3 about once in 2500 steps.
LOGIT_STD = 12.0

# Bump when `init_weights` changes, so fingerprints of dummy models change too.
INIT_VERSION = 6


def resolve_config(config_or_shape) -> dict:
    """A named shape, a config dict, a path to config.json (or its folder), an mlx-lm model
    type (a tiny config of it, models/tiny.py) or an mlx-vlm one (models/tiny_vlm.py)."""
    if isinstance(config_or_shape, dict):
        return copy.deepcopy(config_or_shape)
    if config_or_shape in SHAPES:
        return copy.deepcopy(SHAPES[config_or_shape])
    path = Path(config_or_shape).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        # Real weights' quantization does not apply to random ones.
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        return config
    from mlxserve.models.architectures import text_architectures

    if config_or_shape in text_architectures():  # a bare mlx-lm model type: its tiny config
        from mlxserve.models.tiny import tiny_config

        return tiny_config(config_or_shape)
    from mlxserve.models.architectures import check_served
    from mlxserve.models.vlm_architectures import is_vlm
    from mlxserve.models.vlm_text import is_vlm_text

    if is_vlm_text(config_or_shape):  # mlx-vlm's text-only types mlx-lm lacks (models/vlm_text.py)
        from mlxserve.models.vlm_text import tiny_text_config

        return tiny_text_config(config_or_shape)

    if is_vlm(config_or_shape):  # a bare mlx-vlm model type: its tiny config (models/tiny_vlm.py)
        from mlxserve.models.tiny_vlm import tiny_vlm_config

        return tiny_vlm_config(config_or_shape)
    check_served({"model_type": config_or_shape}, config_or_shape)  # a type mlxserve refuses: say why
    raise KeyError(config_or_shape)


def uniform(seed: int, name: str, shape, std: float, dtype=None):
    """Random weights for one parameter, keyed by (seed, name) so they do not
    depend on parameter order. Uniform: the sums a layer computes are near-normal
    either way. Drawn by MLX, lazily: nothing is made until it is evaluated, so a
    tensor-parallel rank evaluates each weight's slice of its own and holds the
    whole weight only while slicing it (a model larger than one GPU, split across
    two, never exists whole on either)."""
    import mlx.core as mx

    half_width = std * math.sqrt(3)
    key = mx.random.key(((seed % 2**32) << 32) | zlib.crc32(name.encode()))
    # Drawn in the model's dtype: a float32 draw of a large embedding would double its peak.
    return mx.random.uniform(-half_width, half_width, shape, dtype=dtype or mx.float32, key=key)


def _vocab_modules(model, vocab: int):
    """(input embedding paths, output head paths): modules whose weight has `vocab` rows."""
    import mlx.nn as nn

    embeds, heads = set(), set()
    for path, m in model.named_modules():
        w = getattr(m, "weight", None) if isinstance(m, nn.Module) else None
        if w is None or w.ndim != 2 or w.shape[0] != vocab:
            continue
        (embeds if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)) else heads).add(path)
    return embeds, heads


def _norm_offsets(model) -> set:
    """Paths of norm modules that scale by (1 + weight), as Gemma 2/3 do, found by
    running each with a zero weight: such a norm still passes its input on."""
    import mlx.core as mx
    import mlx.nn as nn

    offset = set()
    for path, m in model.named_modules():
        w = m.get("weight") if isinstance(m, nn.Module) and "norm" in type(m).__name__.lower() else None
        if not isinstance(w, mx.array) or w.ndim != 1:
            continue
        saved = m.weight
        try:
            m.weight = mx.zeros_like(saved)
            out = m(mx.linspace(-1.0, 2.0, w.shape[0]).astype(saved.dtype)[None])
            if mx.abs(out).max().item() > 0.5:
                offset.add(path)
        except Exception:  # noqa: BLE001 - norms with extra inputs (gated): plain scale
            pass
        finally:
            m.weight = saved
    return offset


def init_weights(model, config: dict, seed: int, dtype) -> dict:
    """Deterministic random weights for every parameter the model has, scaled so
    activations stay O(1) and logits are peaked.

    Logits get std LOGIT_STD, from the output layer (untied) or from the
    final norm's gain (tied). With tied embeddings the output layer is the
    embedding table, so a large table would put the current token's own
    embedding into the last hidden state and make the token win its own
    logit: the model would repeat one token forever. A small table plus a
    large final-norm gain keeps logits peaked but driven by the context.

    Weights are made in the model's own parameter layout (stacked experts,
    fused projections), so no checkpoint `sanitize` step applies; the
    vocabulary-sized modules and (1 + w) norms are found from the modules
    themselves, not from names.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    tc = text_config(config)
    vocab = tc.get("vocab_size") or tc["num_vocab"]  # (Phixtral's name for it)
    # Soft-capped logits (cap * tanh(x / cap): Gemma 2/4) squash large ones together; the
    # top-1/top-2 gap after the cap is widest near std 0.17 * cap.
    logit_std = min(LOGIT_STD, 0.17 * (tc.get("final_logit_softcapping") or math.inf))
    embeds, heads = _vocab_modules(model, vocab)
    # The residual width; where a config names it otherwise (n_embd, d_model, ...), the input embedding's.
    hidden = tc.get("hidden_size") or dict(model.named_modules())[min(embeds)].weight.shape[-1]
    tied = not heads
    offsets = _norm_offsets(model)
    # Gemma multiplies embeddings by sqrt(hidden) (PaliGemma's language model too: its text config's type).
    gemma = any(str(t).startswith("gemma") for t in (config["model_type"], tc.get("model_type")))
    input_scale = math.sqrt(hidden) if gemma else 1.0
    if tied:
        embed_std = 1 / (math.sqrt(hidden) * input_scale)  # the token enters the residual at 1/sqrt(hidden)
        final_gain = logit_std / (math.sqrt(hidden) * embed_std)
    else:
        embed_std = 1 / input_scale
        final_gain = 1.0
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        module = name.rsplit(".", 1)[0]
        if not mx.issubdtype(p.dtype, mx.floating):
            w = p  # packed integer weights (a pre-quantized layer): the class's own, zeros
        elif module in embeds and name.endswith(".weight"):
            w = uniform(seed, name, p.shape, embed_std, dtype)
        elif module in heads and name.endswith(".weight"):
            w = uniform(seed, name, p.shape, logit_std / math.sqrt(p.shape[-1]), dtype)
        elif p.ndim >= 2:
            # Fan-in: the last axis of linear and stacked-expert weights; kernel x
            # channels for convolutions, which MLX stores (out, kernel, in).
            fan_in = math.prod(p.shape[1:]) if "conv" in name else p.shape[-1]
            w = uniform(seed, name, p.shape, 1 / math.sqrt(fan_in), dtype)
        elif name.endswith(".bias"):
            w = uniform(seed, name, p.shape, 0.1, dtype)
        elif name.startswith(("vision_tower.", "multi_modal_projector.")) and "norm" in name:
            # The vision side's LayerNorms and RMSNorms; only Gemma's projector norm has the (1 + w) form.
            w = mx.full(p.shape, 0.0 if "mm_soft_emb_norm" in name else 1.0)
        elif "norm" in module.rsplit(".", 1)[-1] and name.endswith(".weight"):
            gain = 1.0 if ".layers." in name else final_gain
            w = mx.full(p.shape, gain - 1 if module in offsets else gain)
        else:
            w = p  # other parameters (recurrent decay rates, sinks, scales): the class's own init
        # Lazy: build_dummy evaluates the parameters one at a time once they are quantized and
        # sharded, so peak memory stays this rank's part in `dtype` plus one whole weight.
        weights[name] = w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w
    return weights


def build_dummy(config_or_shape, *, dtype: str | None = None, quantize_bits: int | None = None, seed: int = 0,
                source: str | None = None, sharding=None):
    """An mlx-lm model with random weights: (model, config).

    `config_or_shape` is a name from `SHAPES`, a config dict in mlx-lm's
    config.json format, or a path to a config.json (or a folder holding one).
    Weights are a pure function of (config, seed). `quantize_bits` (4 or 8)
    quantizes linear and embedding layers with group size 64, as mlx-lm does.
    `sharding` (models/sharding.py): this rank's part only; a pipeline stage's weights are
    those of the whole model's layers it keeps (they are keyed by name), so every split
    computes what one process would.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlxserve.models.architectures import build_text_model

    config = resolve_config(config_or_shape)
    source = source or (config_or_shape if isinstance(config_or_shape, str) else "config")
    if dtype is None:
        from mlxserve.models.embedded import default_dtype

        dtype = default_dtype()
    if quantize_bits not in (None, 4, 8):
        raise ValueError(f"quantize_bits must be 4 or 8, not {quantize_bits}")
    config.pop("preprocessor_config", None)
    # Parameters init_weights leaves to the class (recurrent decay rates: Qwen3.5's A_log) come
    # from MLX's global generator: seed it, or the same fingerprint would name other weights
    # in each process (and a disk tier would serve KV of other weights after a restart).
    mx.random.seed(seed)
    from mlxserve.models.vlm import is_vlm_config
    from mlxserve.models.vlm_text import build_vlm_text, is_vlm_text

    if is_vlm_config(config):  # served with images; other VLMs' configs build their text model (mlx-lm's)
        from mlxserve.models.vlm import build_vlm

        model = build_vlm(config)
    elif is_vlm_text(config.get("model_type")):  # mlx-vlm's text-only types mlx-lm lacks
        model = build_vlm_text(config, source)
    else:
        model = build_text_model(config, source)
    if sharding is not None:
        sharding.before_weights(model, config.get("model_type", "?"))
    weights = init_weights(model, config, seed, getattr(mx, dtype))
    if hasattr(model, "random_weights"):  # mlx-vlm's text models: gains their classes leave at 0 (models/vlm_text.py)
        weights = model.random_weights(weights)
    model.load_weights(list(weights.items()))
    if quantize_bits:
        if hasattr(model, "check_quantizable"):  # mlx-vlm's text models (models/vlm_text.py)
            model.check_quantizable(source)
        group_size = 64
        nn.quantize(
            model,
            group_size=group_size,
            bits=quantize_bits,
            # The vision tower stays unquantized, as mlx-vlm's converter leaves it.
            class_predicate=lambda path, m: (
                hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0
                and not path.startswith(("vision_tower", "multi_modal_projector"))
            ),
        )
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits, "mode": "affine"}
        config["quantization_config"] = config["quantization"]
    if sharding is not None:
        sharding.after_weights(model)
    model.eval()
    # One array at a time: each is still lazy (init_weights), so evaluating it draws its weight, casts,
    # quantizes and slices it, and frees the rest. The peak is this rank's model plus one whole weight,
    # not the dense and the quantized model together (a 32B model's 65 + 18 GB in bfloat16 did not fit
    # an 80 GB GPU), nor the whole model on every tensor-parallel rank (an 89 GB model on two GPUs).
    for _, p in tree_flatten(model.parameters()):
        mx.eval(p)
    return model, config

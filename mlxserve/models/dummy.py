"""Random-weight models of real architectures, for benchmarks and tests.

Every shape uses the default model's vocabulary (Qwen2.5, 151936 rows) so
the default model's tokenizer works with all of them, offline. The real-size
shapes keep their published hyperparameters otherwise.
"""

import copy
import json
import math
import zlib
from pathlib import Path

# Logit standard deviation the output layer is scaled to. Random models have
# nearly flat logits, where greedy argmax flips on rounding noise (e.g. batched
# vs unbatched runs). With std 12 over 151936 tokens the top-1/top-2 gap is
# about 2.5 on average, and below 1e-3 about once in 2500 steps.
LOGIT_STD = 12.0

QWEN_VOCAB = 151936

# Bump when `init_weights` changes, so fingerprints of dummy models change too.
INIT_VERSION = 2

SHAPES = {
    # The embedded default model's architecture (Qwen2.5-Coder-0.5B-Instruct),
    # for benchmarks where its 491 MB GGUF cannot travel.
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {
        "model_type": "qwen3",
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": QWEN_VOCAB,  # real: 128256
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
    "gemma3-270m": {
        "model_type": "gemma3_text",
        "hidden_size": 640,
        "num_hidden_layers": 18,
        "intermediate_size": 2048,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,  # real: 262144
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,  # 5 local layers, then 1 global
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    # Tiny shapes for tests: untied output layer, so the next token depends
    # on the context and not mostly on the current token's own embedding.
    "llama-tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 10_000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "qwen2-tiny": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "qwen3-tiny": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "gemma3-tiny": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": 16,
        "sliding_window_pattern": 4,  # layers 0-2 local (window 16), layer 3 global
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    # Hybrid: short gated convolutions (a recurrent state) in 3 layers, attention in 1.
    "lfm2-tiny": {
        "model_type": "lfm2",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "norm_eps": 1e-5,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "conv"],
        "tie_word_embeddings": True,  # LFM2 always ties
    },
    # Vision-language shapes (mlx-vlm). `preprocessor_config` is what a real
    # folder's preprocessor_config.json holds.
    "qwen2.5-vl-3b": {
        "model_type": "qwen2_5_vl",
        "hidden_size": 2048,
        "num_hidden_layers": 36,
        "intermediate_size": 11008,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 128000,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": True,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "out_hidden_size": 2048,
            "num_heads": 16,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "in_channels": 3,
        },
        "preprocessor_config": {
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
    },
    # For CPU benchmarks: the default model's text size (Qwen2.5-0.5B) and an
    # 8-block Qwen2.5-VL tower, so a cold 1024 px turn is compute-bound (tens
    # of seconds here, as on a Mac) without the 3B model's minutes.
    "qwen2.5-vl-mid": {
        "model_type": "qwen2_5_vl",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 32768,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": True,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 8,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "out_hidden_size": 896,
            "num_heads": 16,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [3, 7],
            "in_channels": 3,
        },
        "preprocessor_config": {
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
    },
    "qwen2.5-vl-tiny": {
        "model_type": "qwen2_5_vl",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 32768,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "in_channels": 3,
        },
        # Small images: at most 8x8 patches, 16 tokens.
        "preprocessor_config": {"min_pixels": 3136, "max_pixels": 112 * 112, "patch_size": 14,
                                "merge_size": 2, "temporal_patch_size": 2},
    },
    "llava-tiny": {
        "model_type": "llava",
        "image_token_index": 151655,  # the Qwen vocabulary's <|image_pad|> stands in for <image>
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": QWEN_VOCAB,
            "rope_theta": 10_000.0,
            "max_position_embeddings": 4096,
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "num_hidden_layers": 3,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
            "projection_dim": 32,
        },
        "preprocessor_config": {},
    },
    "gemma3-vl-tiny": {
        "model_type": "gemma3",
        # The Qwen vocabulary's vision tokens stand in for Gemma's
        # <start_of_image>, <image_soft_token> and <end_of_image>.
        "image_token_index": 151655,
        "boi_token_index": 151652,
        "eoi_token_index": 151653,
        "mm_tokens_per_image": 16,
        "tie_word_embeddings": False,
        # mlx-vlm divides image features by sqrt of this top-level size (default 2048), where
        # Hugging Face's Gemma 3 leaves them unscaled, i.e. sqrt(text hidden) here; setting it
        # makes the two agree (mlxserve's adapter always uses the text hidden size).
        "hidden_size": 64,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "rms_norm_eps": 1e-6,
            "vocab_size": QWEN_VOCAB,
            "rope_global_base_freq": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "sliding_window": 16,
            "sliding_window_pattern": 4,
            "mm_tokens_per_image": 16,
            "max_position_embeddings": 4096,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 8,
            "image_size": 64,
        },
        "preprocessor_config": {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    },
}

DESCRIPTIONS = {
    "qwen2.5-0.5b": "Qwen2.5-0.5B (the default model's architecture)",
    "qwen3-0.6b": "Qwen3-0.6B",
    "qwen3-4b": "Qwen3-4B",
    "llama-3.2-1b": "Llama-3.2-1B (Qwen vocabulary)",
    "gemma3-270m": "Gemma-3-270M (Qwen vocabulary)",
    "llama-tiny": "tiny Llama for tests",
    "qwen2-tiny": "tiny Qwen2 (attention biases) for tests",
    "qwen3-tiny": "tiny Qwen3 for tests",
    "gemma3-tiny": "tiny Gemma 3, sliding window 16 on 3 of 4 layers, for tests",
    "lfm2-tiny": "tiny LFM2 hybrid (3 short-convolution layers, 1 attention layer), for tests",
    "qwen2.5-vl-3b": "Qwen2.5-VL-3B (vision-language: 32-block ViT, M-RoPE)",
    "qwen2.5-vl-mid": "Qwen2.5-VL, 0.5B text model and an 8-block tower (CPU benchmarks)",
    "qwen2.5-vl-tiny": "tiny Qwen2.5-VL for tests (images up to 112x112 px, 16 tokens)",
    "llava-tiny": "tiny LLaVA-1.5 for tests (56 px CLIP, 16 tokens)",
    "gemma3-vl-tiny": "tiny Gemma 3 vision-language for tests (64 px SigLIP, 16 tokens, window 16)",
}


def text_config(c: dict) -> dict:
    """The language model's settings (nested under `text_config` in some VLM configs)."""
    return {**c, **c.get("text_config", {})}


def list_shapes() -> list[tuple[str, str]]:
    """(name, description) of every named shape, for `mlxserve shapes`."""
    rows = []
    for name, c in SHAPES.items():
        tower = "vision_config" in c
        c = text_config(c)
        extra = ""
        if "sliding_window" in c:
            extra = f", sliding window {c['sliding_window']}"
        if tower:
            extra += ", plus a vision tower (text model counted)"
        rows.append(
            (
                name,
                f"{DESCRIPTIONS[name]}: {c['model_type']}, ~{param_count(c) / 1e6:,.0f}M params, "
                f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                f"{c['num_attention_heads']}/{c['num_key_value_heads']} q/kv heads{extra}",
            )
        )
    return rows


def param_count(c: dict) -> int:
    h, v = c["hidden_size"], c["vocab_size"]
    i = c.get("intermediate_size") or c["block_ff_dim"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    attn = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    per_layer = attn + 3 * h * i
    return c["num_hidden_layers"] * per_layer + v * h * (1 if c.get("tie_word_embeddings", True) else 2)


def resolve_config(config_or_shape) -> dict:
    """A named shape, a config dict, or a path to config.json (or its folder)."""
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
    raise KeyError(config_or_shape)


def uniform(seed: int, name: str, shape, std: float):
    """Random weights for one parameter, keyed by (seed, name) so they do not
    depend on parameter order. Uniform, not normal: numpy draws it ~10x
    faster, which matters for multi-billion-parameter shapes, and the sums
    a layer computes are near-normal either way."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng([seed % 2**64, zlib.crc32(name.encode())])
    half_width = std * math.sqrt(3)
    return mx.array(rng.random(shape, dtype=np.float32)) * (2 * half_width) - half_width


def init_weights(model, config: dict, seed: int, dtype) -> dict:
    """Deterministic random weights, scaled so activations stay O(1) and logits are peaked.

    Logits get std LOGIT_STD, from the output layer (untied) or from the
    final norm's gain (tied). With tied embeddings the output layer is the
    embedding table, so a large table would put the current token's own
    embedding into the last hidden state and make the token win its own
    logit: the model would repeat one token forever. A small table plus a
    large final-norm gain keeps logits peaked but driven by the context.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    hidden = text_config(config)["hidden_size"]
    tied = config.get("tie_word_embeddings", True)
    # Gemma multiplies embeddings by sqrt(hidden) and its norms by (1 + w).
    gemma = config["model_type"].startswith("gemma")
    input_scale = math.sqrt(hidden) if gemma else 1.0
    if tied:
        embed_std = 1 / (math.sqrt(hidden) * input_scale)  # the token enters the residual at 1/sqrt(hidden)
        final_gain = LOGIT_STD / (math.sqrt(hidden) * embed_std)
    else:
        embed_std = 1 / input_scale
        final_gain = 1.0
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        if tied and name.endswith("lm_head.weight"):
            continue  # classes that always build lm_head drop it in sanitize
        if name.endswith("embed_tokens.weight"):
            w = uniform(seed, name, p.shape, embed_std)
        elif name.endswith("lm_head.weight"):
            w = uniform(seed, name, p.shape, LOGIT_STD / math.sqrt(hidden))
        elif p.ndim >= 2:
            w = uniform(seed, name, p.shape, 1 / math.sqrt(math.prod(p.shape[1:])))
        elif name.endswith(".bias"):
            w = uniform(seed, name, p.shape, 0.1)
        elif name.startswith(("vision_tower.", "multi_modal_projector.")) and "norm" in name:
            # The vision side's LayerNorms and RMSNorms; only Gemma's projector norm has the (1 + w) form.
            w = mx.full(p.shape, 0.0 if "mm_soft_emb_norm" in name else 1.0)
        elif "norm" in name:
            gain = 1.0 if ".layers." in name else final_gain
            w = mx.full(p.shape, gain - 1 if gemma else gain)
        else:
            w = p  # other 1-D parameters (recurrent decay rates etc.): the class's own init
        # Evaluate one at a time so peak memory stays one model in `dtype`.
        weights[name] = w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w
        mx.eval(weights[name])
    return weights


def build_dummy(config_or_shape, *, dtype: str | None = None, quantize_bits: int | None = None, seed: int = 0):
    """An mlx-lm model with random weights: (model, config).

    `config_or_shape` is a name from `SHAPES`, a config dict in mlx-lm's
    config.json format, or a path to a config.json (or a folder holding one).
    Weights are a pure function of (config, seed). `quantize_bits` (4 or 8)
    quantizes linear and embedding layers with group size 64, as mlx-lm does.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    config = resolve_config(config_or_shape)
    if dtype is None:
        from mlxserve.models.embedded import default_dtype

        dtype = default_dtype()
    if quantize_bits not in (None, 4, 8):
        raise ValueError(f"quantize_bits must be 4 or 8, not {quantize_bits}")
    config.pop("preprocessor_config", None)
    vlm = "vision_config" in config
    if vlm:
        from mlxserve.models.vlm import build_vlm

        model = build_vlm(config)
    else:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    weights = init_weights(model, config, seed, getattr(mx, dtype))
    if hasattr(model, "sanitize") and not vlm:
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    if quantize_bits:
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
    model.eval()
    mx.eval(model.parameters())
    return model, config

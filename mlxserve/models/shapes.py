"""Named model shapes for `--load-format dummy`: real architectures' configs.

Every shape uses the default model's vocabulary (Qwen2.5, 151936 rows) so
the default model's tokenizer works with all of them, offline. The real-size
shapes keep their published hyperparameters otherwise.
"""

QWEN_VOCAB = 151936

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
    # Today's families at realistic sizes (dummy weights, for benchmarks). Published
    # hyperparameters as far as known; the Qwen vocabulary replaces each real one.
    # Qwen3.5 hybrid: Gated DeltaNet layers (a recurrent state) with full attention every 4th.
    "qwen3.5-9b": {
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "intermediate_size": 12288,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "rms_norm_eps": 1e-6,
            "vocab_size": QWEN_VOCAB,  # real: 248320
            "max_position_embeddings": 262144,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
        },
    },
    # Gemma 4 E4B: 5 sliding-window layers (512) per global one, per-layer input
    # embeddings, and the last 18 layers reading KV of earlier ones.
    "gemma4-e4b": {
        "model_type": "gemma4_text",
        "hidden_size": 2560,
        "num_hidden_layers": 42,
        "intermediate_size": 10240,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_kv_shared_layers": 18,
        "hidden_size_per_layer_input": 256,
        "vocab_size": QWEN_VOCAB,  # real: 262144
        "vocab_size_per_layer_input": QWEN_VOCAB,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
    # gpt-oss-20b: 32 experts (4 active), attention sinks, sliding (128) and full layers alternating.
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": 24,
        "intermediate_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "rms_norm_eps": 1e-5,
        "vocab_size": QWEN_VOCAB,  # real: 201088
        "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    # Tiny versions for trying the families out and for tests.
    "qwen3.5-tiny": {
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2,
            "rms_norm_eps": 1e-6,
            "vocab_size": QWEN_VOCAB,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                                "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
        },
    },
    "gemma4-tiny": {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size": QWEN_VOCAB,
        "vocab_size_per_layer_input": QWEN_VOCAB,
        "sliding_window": 16,
        "sliding_window_pattern": 3,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "gpt-oss-tiny": {
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": QWEN_VOCAB,
        "rope_theta": 150000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
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
    "qwen3.5-9b": "Qwen3.5-9B-like hybrid (24 Gated DeltaNet + 8 attention layers)",
    "gemma4-e4b": "Gemma-4-E4B-like (sliding window 512 on 5 of 6 layers, 18 KV-sharing layers)",
    "gpt-oss-20b": "gpt-oss-20b-like (32 experts, 4 active; sinks; sliding 128 / full alternating)",
    "qwen3.5-tiny": "tiny Qwen3.5 hybrid (2 Gated DeltaNet, 2 attention layers), for tests",
    "gemma4-tiny": "tiny Gemma 4 (window 16, KV shared by the last 2 of 6 layers), for tests",
    "gpt-oss-tiny": "tiny gpt-oss (4 experts, sinks, window 16 / full), for tests",
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
        t = text_config(c)
        extra = f", sliding window {t['sliding_window']}" if t.get("sliding_window") else ""
        if tower:
            extra += ", plus a vision tower"
        rows.append((name, f"{DESCRIPTIONS[name]}: {t['model_type']}, ~{param_count(c) / 1e6:,.0f}M params, "
                           f"{t['num_hidden_layers']} layers, hidden {t['hidden_size']}{extra}"))
    return rows


def param_count(config: dict) -> int:
    """Parameters of a shape's model, counted on its modules (MLX builds them lazily:
    no weights are computed)."""
    from mlx.utils import tree_flatten

    if "vision_config" in config:
        from mlxserve.models.vlm import build_vlm

        model = build_vlm({k: v for k, v in config.items() if k != "preprocessor_config"})
    else:
        from mlxserve.models.architectures import build_text_model

        model = build_text_model(config)
    return sum(p.size for _, p in tree_flatten(model.parameters()))

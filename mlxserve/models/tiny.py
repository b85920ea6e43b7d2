"""Tiny configs of any mlx-lm model type, built from its `ModelArgs`: a few layers, a small
width and the default tokenizer's vocabulary, for random-weight tests of every architecture
(`--load-format dummy` with a bare model type, e.g. `mlxserve serve gemma2 --load-format dummy`).

Fields are filled by name, the same rule for every type that has them (a hidden size is 64
whatever the class calls it); what a name cannot tell (the strings of a layer-type list, a
nested layout) is in `OVERRIDES`, per type.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import types

from mlxserve.models.shapes import QWEN_VOCAB

LAYERS = 4  # enough for two kinds of layer, each twice (sliding and full, recurrent and attention)
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
FFN = 128
EXPERTS = 4
EXPERT_FFN = 32
WINDOW = 16  # a sliding window shorter than the tests' prompts, so it slides

# Field names -> tiny value, the same for every model type. Values replace the class's
# defaults too: those are a real model's sizes.
SIZES = {
    # width
    ("hidden_size", "n_embd", "d_model", "dim", "model_dim", "hidden_dim", "block_dim"): HIDDEN,
    # depth
    ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_transformer_layers"): LAYERS,
    # attention heads
    ("num_attention_heads", "n_head", "n_heads", "num_heads", "swa_num_attention_heads",
     "num_swa_attention_heads", "index_n_heads"): HEADS,
    ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "num_attention_groups",
     "swa_num_key_value_heads", "num_swa_key_value_heads", "num_global_key_value_heads"): KV_HEADS,
    ("head_dim", "kv_channels", "hidden_size_per_head", "swa_head_dim", "v_head_dim", "swa_v_head_dim",
     "qk_nope_head_dim", "index_head_dim", "global_head_dim", "mamba_d_head", "mamba_head_dim",
     "linear_key_head_dim", "linear_value_head_dim"): HEAD_DIM,
    ("qk_rope_head_dim", "rotary_dim"): 8,
    ("kv_lora_rank", "q_lora_rank", "o_lora_rank"): 32,
    ("a_low_rank_dim", "v_low_rank_dim", "gate_low_rank_dim", "decay_low_rank_dim"): 16,
    # feed-forward
    ("intermediate_size", "n_inner", "ffn_hidden_size", "ff_intermediate_size", "intermediate_size_mlp",
     "shared_intermediate_size", "block_ff_dim"): FFN,
    ("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
     "moe_shared_expert_intermediate_size", "share_expert_dim"): EXPERT_FFN,
    # experts
    ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"): EXPERTS,
    ("num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k", "top_k_experts",
     "num_experts_per_token"): 2,
    ("n_shared_experts", "num_shared_experts", "num_shared_expert", "moe_num_shared_experts"): 1,
    ("n_group", "topk_group", "num_expert_group"): 1,
    ("first_k_dense_replace", "num_dense_layers"): 1,
    # vocabulary and positions
    ("vocab_size", "num_vocab"): QWEN_VOCAB,
    ("rope_theta",): 10000.0,
    ("max_position_embeddings", "n_positions", "n_ctx", "model_max_length"): 4096,
    ("sliding_window", "sliding_window_size", "attention_window_size", "window_size",
     "attention_chunk_size"): WINDOW,
    # layer patterns: a period of 2 gives both kinds of layer in 4 layers
    ("sliding_window_pattern", "full_attention_interval", "dense_attention_every_n_layers",
     "attn_layer_period", "expert_layer_period", "decoder_sparse_step", "no_rope_layer_interval",
     "interleave_moe_layer_step", "mamba_step", "layer_group_size", "cla_share_factor",
     "num_kv_shared_layers"): 2,
    ("attn_layer_offset", "expert_layer_offset"): 1,
    # recurrent mixers
    ("mamba_d_state", "ssm_state_size", "state_size"): 16,
    ("mamba_d_conv", "conv_kernel", "linear_conv_kernel_dim", "conv1d_width", "short_conv_kernel_size"): 4,
    ("mamba_n_heads", "mamba_num_heads"): 8,
    ("mamba_n_groups", "n_groups"): 1,
    ("mamba_expand", "expand"): 2,
    ("linear_num_key_heads",): 2,
    ("linear_num_value_heads",): 4,
    ("mamba_d_ssm",): 128,
    ("time_step_rank",): 4,
    ("conv_L_cache",): 3,
    ("mamba_chunk_size",): 16,
    # sparse attention indexers: fewer keys than the tests' prompts, so they select
    ("index_topk",): 32,
    ("vocab_size_per_layer_input",): QWEN_VOCAB,
    ("hidden_size_per_layer_input",): 16,
}
VALUES = {name: value for names, value in SIZES.items() for name in names}

# Fields a class requires that no size rule covers, by name: (test, value).
REQUIRED = [
    (lambda n: "eps" in n or n.endswith("epsilon"), 1e-5),
    (lambda n: "theta" in n or n in ("rotary_emb_base", "rope_embedding_base", "rope_freq_constant"), 10000.0),
    (lambda n: n.endswith(("multiplier", "_scale", "scale_emb", "scale_depth", "factor")), 1.0),
    (lambda n: n in ("rotary_pct", "partial_rotary_factor"), 0.5),
    (lambda n: n.endswith("softcapping") or n.endswith("soft_cap") or n == "gegelu_limit", 30.0),
    (lambda n: n == "logits_scaling", 1.0),
    (lambda n: n == "dim_model_base", HIDDEN),
    (lambda n: n in ("hidden_act", "hidden_activation"), "silu"),
    (lambda n: n in ("mlp_only_layers",), []),
]


def model_module(model_type: str) -> types.ModuleType:
    """mlx-lm's module for a model type (its model_type, with mlx-lm's remapping)."""
    from mlx_lm.utils import MODEL_REMAPPING

    return importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")


def text_args_class(module):
    """The dataclass a nested `text_config` is read into: a Text* args class the module
    defines or imports, else the ModelArgs of the first mlx-lm model module it imports."""
    from mlx_lm.models.base import BaseModelArgs

    for name, value in vars(module).items():
        if "Text" in name and inspect.isclass(value) and issubclass(value, BaseModelArgs):
            return value
    for value in vars(module).values():
        # A sibling module it imports, or whose class it imports (Qwen3.5 MoE subclasses Qwen3.5's Model).
        other = value if isinstance(value, types.ModuleType) else inspect.getmodule(value)
        if other is not None and other is not module and other.__name__.startswith("mlx_lm.models.") \
                and hasattr(other, "ModelArgs") and hasattr(other, "Model"):
            nested = text_args_class(other) if _nested(other.ModelArgs) else None
            return nested or other.ModelArgs
    return None


def _nested(args_class) -> bool:
    return "text_config" in {f.name for f in dataclasses.fields(args_class)}


def _fill(args_class, model_type: str) -> dict:
    """A tiny config for one args dataclass: every field the size rules name, and every
    required one."""
    out = {"model_type": model_type}
    for f in dataclasses.fields(args_class):
        if f.name in ("model_type", "text_config", "vision_config"):
            continue
        if f.name in VALUES:
            out[f.name] = VALUES[f.name]
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if not required:
            continue
        for test, value in REQUIRED:
            if test(f.name):
                out[f.name] = copy.deepcopy(value)
                break
        else:
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            out[f.name] = False if "bool" in kind else None  # a flag off; an option left out
    return out


def tiny_config(model_type: str) -> dict:
    """A small random-weight-ready config of mlx-lm's `model_type` (see the module doc); a
    one-line ModelLoadError for a type mlxserve refuses (some cannot even be imported)."""
    from mlxserve.models.architectures import check_served

    check_served({"model_type": model_type}, model_type)
    module = model_module(model_type)
    args_class = module.ModelArgs
    config = _fill(args_class, model_type)
    config["tie_word_embeddings"] = False
    if _nested(args_class):
        inner = text_args_class(module)
        text = _fill(inner, model_type + "_text")
        text["tie_word_embeddings"] = False
        config["text_config"] = text
    _merge(config, OVERRIDES.get(model_type, {}))
    return config


def _merge(config: dict, override: dict) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge(config[key], value)
        else:
            config[key] = copy.deepcopy(value)


SLIDING = ["sliding_attention", "full_attention"] * (LAYERS // 2)
YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
ROPE_PER_KIND = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}

# What the field names cannot tell, per model type: layer-kind lists, nested layouts,
# options that must name one of the class's own choices.
OVERRIDES: dict[str, dict] = {
    "afm7": {"num_kv_reuse_layers": 2},
    "afmoe": {"layer_types": SLIDING, "mup_enabled": False},
    "baichuan_m1": {"sliding_window_layers": [0, 2], "conv_window": 2},
    "bailing_hybrid": {"group_norm_size": 1},
    "bailing_moe_linear": {"group_norm_size": 1},
    "dbrx": {"ffn_config": {"ffn_hidden_size": FFN, "moe_num_experts": EXPERTS, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": KV_HEADS, "clip_qkv": 8.0, "rope_theta": 10000.0}},
    "deepseek_v2": {"rope_scaling": YARN},
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 1024, "short_factor": 1.0,
                                  "long_factor": 1.0}},
    "exaone4": {"sliding_window_pattern": "LG", "rope_scaling": None},
    "exaone_moe": {"layer_types": SLIDING, "is_moe_layer": [False, True, True, True]},
    "gear": {"layer_types": SLIDING},
    "glm4_moe": {"rope_scaling": None},
    "glm_moe_dsa": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"],
                         "mamba_proj_bias": False, "mamba_conv_bias": True},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}, "use_cla": True},
    "gemma3n": {"text_config": {"layer_types": SLIDING, "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
                                "altup_num_inputs": 2, "altup_coef_clip": 120.0, "altup_correct_scale": True,
                                "altup_active_idx": 0, "laurel_rank": 8, "rope_local_base_freq": 10000.0}},
    "kimi_k3": {"text_config": {"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                                                       "num_heads": HEADS, "head_dim": HEAD_DIM,
                                                       "short_conv_kernel_size": 4}}},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": HEADS,
                                           "head_dim": HEAD_DIM, "short_conv_kernel_size": 4}},
    "lfm2": {"layer_types": ["conv", "full_attention"] * 2, "block_multiple_of": 32,
             "block_auto_adjust_ff_dim": False, "block_ffn_dim_multiplier": 1.0},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * 2},
    "lfm2-vl": {"text_config": {"layer_types": ["conv", "full_attention"] * 2, "block_multiple_of": 32,
                                "block_auto_adjust_ff_dim": False, "block_ffn_dim_multiplier": 1.0}},
    "llama4": {"text_config": {"num_experts_per_tok": 1, "no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True}},
    "llama4_text": {"num_experts_per_tok": 1, "no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True},
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity", "zero_expert_num": 2,
                      "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"zero_expert_num": 2, "ngram_vocab_size_ratio": 1, "mla_scale_q_lora": True,
                            "mla_scale_kv_lora": True},
    "mamba2": {"time_step_limit": [0.0, float("inf")]},
    "mellum": {"layer_types": SLIDING, "rope_parameters": ROPE_PER_KIND},
    "mimo_v2_flash": {"hybrid_layer_pattern": [1, 0, 1, 0], "moe_layer_freq": [0, 1, 1, 1],
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid", "partial_rotary_factor": 1},
    "ministral3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                       "original_max_position_embeddings": 1024}},
    "mistral4": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 1024}},
    "muse_spark": {"text_config": {"layer_types": SLIDING, "mlp_layer_types": ["sparse"] * LAYERS,
                                   "num_shared_experts": 0, "moe_hidden_size": EXPERT_FFN,
                                   "layer_rope_theta": [10000.0, 0.0] * (LAYERS // 2),
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
    "nemotron-nas": {"block_configs": [
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"n_heads_in_group": 4}, "ffn": {"no_op": True}},
        {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 1.0}}]},
    "nemotron_h": {"hybrid_override_pattern": "M*M-"},
    "openelm": {"num_query_heads": [HEADS] * LAYERS, "num_kv_heads": [KV_HEADS, 1, KV_HEADS, 1],
                "ffn_multipliers": [2.0] * LAYERS, "ffn_dim_divisor": 16},
    "plamo": {"n_shared_head": 2},
    # A pack of 2-bit Hadamard-rotated layers (here one projection, zeros, unrotated) over
    # inputs of a multiple of 128.
    "prism_hadamard_qwen35": {"schema_version": 1, "tensor_namespace": "mlx-lm-text",
                              "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
                              "modules": [{"path": "model.layers.3.self_attn.q_proj", "embedding": False,
                                           "dtype": "float16", "block": 0}],
                              "text_config": {"hidden_size": 128}},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "spark2_5": {"layer_types": SLIDING, "rope_parameters": ROPE_PER_KIND},
}

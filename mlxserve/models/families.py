"""What mlxserve must know of a model family beyond its config: limits of the libraries
underneath, each found by the family coverage tests (tests/test_families.py)."""

# Recurrent mixers in mlx-lm 0.32.2 that ignore a batch's per-row lengths: a prompt
# padded in a batched prefill carries the padding into its recurrent state, and its
# tokens change (tests/test_families.py shows it for Jamba, OLMo-hybrid and Nemotron-H,
# tests/test_architectures.py for Bailing-MoE-linear, whose linear attention reads no mask;
# the others never read the lengths). Their prompts are prefilled one at a time; decoding
# still batches.
SERIAL_PREFILL = frozenset({"jamba", "olmo_hybrid", "nemotron_h", "mamba", "baichuan_m1", "recurrent_gemma",
                            "rwkv7", "longcat_flash_ngram", "bailing_moe_linear"})


# The same for mlx-vlm's language models (vision-language folders): mlx-vlm 0.7.10's Qwen3.5
# (qwen3_5/language.py), and every type whose language model is built on it (MiniCPM-V 4.6 and
# 4.7), mishandles a right-padded batch. Rows of different cached lengths (a request moved from
# the lone path beside a new one) run row by row (Qwen3_5Model.__call__), each layer's caches
# merged into new objects after: mlx-lm's record of the padding (BatchKVCache.prepare) is lost
# with the old ones, and the shorter row keeps its padding as keys (its offset counts them).
# New rows get no recurrent mask (the all-zero left_padding of their merged ArraysCache hides its
# lengths) and take the padding into their state (tests/test_vlm.py, tests/test_vlm_minicpm.py).
# ZAYA1-VL's CCA attention keeps a conv window and the last token's hidden state per layer, taken
# from a chunk's last positions whatever the batch's lengths: a right-padded row keeps padding
# (tests/test_vlm_architectures.py, zaya1_vl's batch of 3). Nemotron-H Nano Omni's language model
# is Nemotron-H, whose Mamba layers take a right-padded row's padding into their state as mlx-lm's
# nemotron_h does (SERIAL_PREFILL): its batch of 3 changed a row's second token once the random
# weights changed (its earlier weights happened to hide it).
SERIAL_PREFILL_VLM = frozenset({"qwen3_5", "qwen3_5_moe", "indic_ocr",  # (the last two: Qwen3.5's language model)
                                "minicpmv4_6", "minicpmv4_7",  # (Qwen3.5's language model, MiniCPM-V's tower)
                                "zaya1_vl", "nemotron_h_nano_omni"})
# mlx-vlm's text-only Qwen3.5 packages (served through models/vlm_text.py): the same language model.
SERIAL_PREFILL_VLM_TEXT = frozenset({"qwen3_5_text", "qwen3_5_moe_text"})


def prefill_batch_size(config: dict, requested: int) -> int:
    """Prompts prefilled together for this model: `requested`, or 1 where padding breaks it."""
    family = config.get("model_type")
    serial = family in SERIAL_PREFILL or family in SERIAL_PREFILL_VLM_TEXT or (
        "vision_config" in config and family in SERIAL_PREFILL_VLM)
    return 1 if serial else requested


def unbatchable_layers(model) -> list[str]:
    """Cache classes of the model that mlx-lm's BatchGenerator cannot merge into a batch:
    such a model decodes one request at a time. (In 0.32.2 Llama 4's ChunkedKVCache has
    no `merge`; cache/chunked.py gives it one, installed by engine/runner.py.)"""
    from mlx_lm.models.cache import make_prompt_cache

    own = getattr(model, "own_cache_classes", [])  # mlx-vlm's classes mlx-lm has no copy of (models/vlm_text.py)
    return sorted({type(c).__name__ for c in make_prompt_cache(model) if not hasattr(type(c), "merge")} | set(own))

"""What mlxserve must know of a model family beyond its config: limits of the libraries
underneath, each found by the family coverage tests (tests/test_families.py)."""

# Recurrent mixers in mlx-lm 0.32.2 that ignore a batch's per-row lengths: a prompt
# right-padded in a batched prefill carries the padding into its recurrent state, and its
# tokens change (tests/test_families.py shows it for Jamba, OLMo-hybrid and Nemotron-H; the
# others never read the lengths). Their prompts are prefilled one at a time; decoding
# still batches.
SERIAL_PREFILL = frozenset({"jamba", "olmo_hybrid", "nemotron_h", "mamba", "baichuan_m1", "recurrent_gemma",
                            "rwkv7", "longcat_flash_ngram"})


def prefill_batch_size(config: dict, requested: int) -> int:
    """Prompts prefilled together for this model: `requested`, or 1 where padding breaks it."""
    return 1 if config.get("model_type") in SERIAL_PREFILL else requested

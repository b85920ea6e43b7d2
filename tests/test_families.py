"""Every text architecture people run now is served, batched and cached with unchanged tokens.

Tiny random-weight configs of each family (tests/families.json, plus the named
tiny shapes): each loads through `--load-format dummy`, generates alone and in a
batch, keeps a seeded request's tokens beside others, and gives the same greedy
tokens with the cache off, on full and partial hits, inside a batch and after a
restart from the disk tier.
"""

import functools
import json
from pathlib import Path

import pytest

from mlxserve.cache.layers import model_specs, spec_kinds
from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import SamplingParams
from mlxserve.models.families import unbatchable_layers
from mlxserve.models.load import load

from parity import check_hits_give_the_same_tokens, check_restart_from_disk, hit_prompts, prompt_of, run

CONFIGS = json.loads((Path(__file__).parent / "families.json").read_text())
SHAPES = ["qwen3.5-tiny", "gemma4-tiny", "gpt-oss-tiny", "lfm2-tiny"]
# Small blocks and chunks, so 70-token prompts cross several of each; a recurrent
# state at every block end, so hits on hybrids reach the last block end.
SETTINGS = dict(block_size=16, prefill_chunk_size=32, checkpoint_interval=1, warmup=0)  # warm-up: tests/test_warmup.py


@functools.lru_cache(maxsize=None)
def family(name: str, folder: Path):
    if name in SHAPES:
        return load(name, load_format="dummy", progress=False)
    (folder / f"{name}.json").write_text(json.dumps(CONFIGS[name]))
    return load(str(folder / f"{name}.json"), load_format="dummy", progress=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def recurrent(loaded) -> bool:
    return "state" in spec_kinds(model_specs(loaded.model))


@pytest.mark.parametrize("name, layout", [(name, "contiguous") for name in SHAPES + sorted(CONFIGS)]
                         + [("qwen3.5-tiny", "paged")])  # its attention layers' KV in blocks, beside recurrent ones
def test_family_is_served_batched_and_cached(name, layout, folder, tmp_path):
    loaded = family(name, folder)
    settings = dict(SETTINGS, kv_layout=layout)
    stats, reference = check_hits_give_the_same_tokens(loaded, settings, block_granular=recurrent(loaded))
    assert stats["disabled"] is None and stats["misses"]["unrestorable"] == 0
    # The engine (which installs mlxserve's mlx-lm fixes) batches every cache layer of it.
    assert unbatchable_layers(loaded.model) == []
    # Paged: the restarted engine's hit goes through the batch (a lone request runs apart from it).
    # Its prompt is the first above, whose tokens with the cache off are known.
    check_restart_from_disk(loaded, dict(settings, solo_fast_path=layout == "contiguous"), tmp_path / "kv",
                            prompt=hit_prompts()[0], ref=reference[0])

    # Per-request sampling inside a batch: a seeded request draws the same tokens beside others.
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=8, ignore_eos=True)
    engine = AsyncEngine(loaded, EngineConfig(**settings)).start()
    try:
        (alone, _), = run(engine, [prompt_of(20, 7)], seeded)
        together = run(engine, [prompt_of(20, 7), prompt_of(33, 8)], seeded)
    finally:
        engine.stop()
    assert together[0][0] == alone and len(alone) == 8


@pytest.mark.parametrize("solo", [True, False])
@pytest.mark.parametrize("name", ["qwen3.5-tiny", "gemma4-tiny", "gpt-oss-tiny"])
def test_agent_next_turn_without_the_reasoning_restores_the_whole_previous_prompt(name, solo, folder):
    """A reasoning model's template drops earlier turns' reasoning, so turn 2 parts from what
    the cache holds (turn 1's prompt, reasoning, answer) right after turn 1's prompt. Hybrid
    and sliding-window layers cannot be cut back there; the prompt's tail restores it all."""
    loaded = family(name, folder)
    tok = loaded.tokenizer
    turn1 = tok.apply_chat_template([{"role": "system", "content": "You are a coding agent. " * 12},
                                     {"role": "user", "content": "Find the bug in the scheduler."}],
                                    add_generation_prompt=True)
    settings = dict(SETTINGS, solo_fast_path=solo)
    engine = AsyncEngine(loaded, EngineConfig(**settings)).start()
    try:
        (out1, _), = run(engine, [turn1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        # The history keeps the answer (the last 8 tokens) but not the reasoning before it.
        turn2 = turn1 + out1[16:] + tok.encode("<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"
                                               "<|im_start|>assistant\n")
        (out2, cached2), = run(engine, [turn2])
    finally:
        engine.stop()
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, **settings)).start()
    try:
        (reference, _), = run(off, [turn2])
    finally:
        off.stop()
    assert out2 == reference
    assert len(turn1) - 1 <= cached2 <= len(turn1)

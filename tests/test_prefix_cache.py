"""The prefix cache through the engine: a hit never changes a token, and nothing leaks."""

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import SamplingParams
from mlxserve.models.shapes import SHAPES
from mlxserve.models.load import load

from parity import check_hits_give_the_same_tokens, check_restart_from_disk, greedy, prompt_of, run

# (shape, engine settings): gemma3-tiny has a 16-token sliding window on 3 of 4
# layers and lfm2-tiny recurrent (short-conv) layers beside attention, whose
# state exists only at block ends and prompt tails: hits elsewhere are whole blocks.
BLOCK_GRANULAR = {"lfm2-tiny"}
CASES = {
    "llama-tiny": dict(block_size=16, prefill_chunk_size=32),
    "gemma3-tiny": dict(block_size=8, prefill_chunk_size=16),
    "lfm2-tiny": dict(block_size=16, prefill_chunk_size=32, checkpoint_interval=1),
}


@pytest.mark.parametrize("shape, layout", [(shape, "contiguous") for shape in CASES]
                         + [("gemma3-tiny", "paged")])
def test_cache_hits_give_the_same_tokens(tiny, shape, layout, monkeypatch):
    # --kv-layout paged: the batch's full-attention KV in blocks (cache/paged.py), beside gemma3-tiny's
    # sliding-window caches; its attention reads them.
    from mlxserve.cache import paged_batch

    attended = []
    monkeypatch.setattr(paged_batch, "paged_attention_gather", lambda *a, _real=paged_batch.paged_attention_gather,
                        **k: attended.append(1) or _real(*a, **k))  # the CPU's path
    check_hits_give_the_same_tokens(tiny(shape), dict(CASES[shape], kv_layout=layout),
                                    block_granular=shape in BLOCK_GRANULAR)
    assert bool(attended) == (layout == "paged")


@pytest.fixture(scope="module")
def quantizable(tmp_path_factory):
    """qwen3-tiny with 64-wide attention heads: KV quantizes in mlx's groups of 64."""
    folder = tmp_path_factory.mktemp("qwen3-tiny-64")
    (folder / "config.json").write_text(json.dumps(dict(SHAPES["qwen3-tiny"], head_dim=64)))
    return load(str(folder), load_format="dummy", progress=False)


@pytest.fixture(scope="module")
def plain_kv(quantizable):
    """The unquantized run both bit widths compare with: made once."""
    return check_hits_give_the_same_tokens(quantizable, dict(block_size=16, prefill_chunk_size=32))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_hits_give_the_same_tokens(quantizable, bits, quantized_attention_calls, plain_kv):
    settings = dict(block_size=16, prefill_chunk_size=32)
    runs = {}
    for mode in ("quantized", "dequantized"):
        quantized_attention_calls.clear()
        runs[mode] = check_hits_give_the_same_tokens(quantizable, dict(settings, kv_bits=bits, kv_attention=mode))
        # The mode reaches attention on every path the check takes (solo, batch, hits, handovers).
        assert bool(quantized_attention_calls) == (mode == "quantized")
    plain, plain_tokens = plain_kv
    # Both attention modes read the same quantized KV (only rounding differs); 4-bit KV
    # visibly changes this tiny model's output.
    assert runs["quantized"][1] == runs["dequantized"][1]
    assert (runs["quantized"][1] == plain_tokens) == (bits == 8)
    # Blocks hold the quantized KV: f32 is 4 bytes an element, 8 bits 1 + 1/8 (scales and biases).
    for stats, _ in runs.values():
        per_token, plain_per_token = stats["bytes"] / stats["tokens"], plain["bytes"] / plain["tokens"]
        assert per_token == plain_per_token * (bits / 8 + 0.125) / 4


def test_kv_bits_refuses_heads_it_cannot_quantize(tiny):
    engine = AsyncEngine(tiny("llama-tiny"), EngineConfig(kv_bits=8))  # 16-wide heads
    with pytest.raises(RuntimeError, match="kv-bits 8"):
        engine.start()


@pytest.mark.parametrize("solo", [True, False])
def test_second_turn_hits_the_first_turns_prompt_and_answer(tiny, solo):
    loaded = tiny("qwen3-tiny")
    tok = loaded.tokenizer
    turn1 = [{"role": "system", "content": "You are a careful assistant. " * 8},
             {"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
    prompt1 = tok.apply_chat_template(turn1, add_generation_prompt=True)
    engine = AsyncEngine(loaded, EngineConfig(block_size=16, solo_fast_path=solo)).start()
    try:
        (answer, cached1), = run(engine, [prompt1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        # The next turn's prompt continues with exactly the tokens of turn 1 and its answer.
        prompt2 = prompt1 + answer + tok.encode("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n")
        (turn2, cached2), = run(engine, [prompt2])
    finally:
        engine.stop()
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False)).start()
    try:
        (uncached_turn2, _), = run(off, [prompt2])
    finally:
        off.stop()
    assert cached1 == 0
    # Every token of prompt + answer whose KV exists, not just whole blocks: the finished
    # turn left its last partial block. (The solo path never feeds the last answer token;
    # the batch runs a step ahead and has.)
    assert cached2 == len(prompt1) + len(answer) - (1 if solo else 0)
    assert turn2 == uncached_turn2


def test_budget_is_kept_and_nothing_leaks(tiny):
    loaded = tiny("llama-tiny")
    budget = 64 * 1024
    engine = AsyncEngine(loaded, EngineConfig(block_size=16, cache_memory=str(budget), max_num_seqs=8)).start()
    try:
        rng = random.Random(0)
        prefixes = [prompt_of(48, s) for s in range(20)]
        prompts = [rng.choice(prefixes) + prompt_of(rng.randrange(1, 40), 1000 + i) for i in range(300)]
        for i in range(0, len(prompts), 30):
            run(engine, prompts[i:i + 30], greedy(2))
        stats = asyncio.run(engine.cache_stats())["prefix_cache"]
        assert 0 < stats["bytes"] <= budget
        assert stats["evictions"] > 0
        assert stats["in_use_blocks"] == 0  # every request ended: only free cached blocks remain
        assert stats["free_bytes"] == stats["bytes"]
        assert stats["hit_tokens"] > 0
        after = asyncio.run(engine.reset_cache())["prefix_cache"]
        assert after["blocks"] == 0 and after["bytes"] == 0
    finally:
        engine.stop()


def test_a_budget_smaller_than_the_prompt_still_serves(tiny):
    loaded = tiny("llama-tiny")
    engine = AsyncEngine(loaded, EngineConfig(block_size=16, cache_memory="4KB")).start()
    try:
        prompt = prompt_of(100, 9)
        (a, _), = run(engine, [prompt])
        (b, cached), = run(engine, [prompt])
        assert a == b and len(a) == 8
        assert cached < 100
    finally:
        engine.stop()


@pytest.mark.parametrize("shape", ["llama-tiny", "gemma3-tiny", "lfm2-tiny", "qwen3-tiny-kv8"])
def test_disk_tier_serves_blocks_after_a_restart(tiny, quantizable, tmp_path, shape):
    """Blocks written to the disk tier come back in a new engine (a restart) and give the same tokens,
    for every payload kind: plain and sliding-window KV, recurrent state, 8-bit KV."""
    if shape.endswith("-kv8"):
        loaded, settings = quantizable, dict(block_size=16, prefill_chunk_size=32, kv_bits=8)
    else:
        loaded, settings = tiny(shape), CASES[shape]
    check_restart_from_disk(loaded, settings, tmp_path / "kv")


# A plain model, a sliding-window one and a hybrid (Gated DeltaNet) one, at the default
# checkpoint interval: recurrent states exist only where a pass stopped.
RESTART_CASES = {"llama-tiny": CASES["llama-tiny"], "gemma3-tiny": CASES["gemma3-tiny"],
                 "qwen3.5-tiny": dict(block_size=16, prefill_chunk_size=32)}


@pytest.mark.parametrize("shape", list(RESTART_CASES))
def test_a_restart_from_disk_hits_as_far_as_memory_did(tiny, tmp_path, shape):
    """After a restart, every prefix of a conversation restores from disk as many tokens as memory
    did before it, to the token: finished requests' partial last blocks are on disk, and so are
    layers filled in later (sliding-window KV, recurrent states). A repeated prompt hits as far
    as in memory, with the same greedy tokens.

    Turn 1's blocks are written before turn 2 runs (as an idle server writes them), so what turn 2
    and a branch parting inside turn 1's answer fill in must be written again."""
    loaded, settings = tiny(shape), RESTART_CASES[shape]
    disk = dict(disk_cache_dir=str(tmp_path / "kv"), **settings)
    turn1 = prompt_of(50, 61)
    first = AsyncEngine(loaded, EngineConfig(**disk)).start()
    try:
        (answer, _), = run(first, [turn1], greedy(40))
        first.call(first.prefix_cache.disk.flush).result()
        turn2 = turn1 + answer + prompt_of(10, 62)
        branch = turn1 + answer[:20] + prompt_of(10, 63)
        run(first, [turn2])
        run(first, [branch])
        (repeat, repeat_cached), = run(first, [turn2])
        probes = [p[:n] + [7] for p in (turn2, branch) for n in range(1, len(p) + 1)]
        in_memory = first.call(lambda: [first.prefix_cache.covered_tokens(q) for q in probes]).result()
    finally:
        first.stop()

    def restored(pc, prompt):
        match = pc.match(prompt)
        pc.release(match)
        return match.num_tokens

    second = AsyncEngine(loaded, EngineConfig(**disk)).start()  # reads only: writes nothing new
    try:
        from_disk = second.call(lambda: [restored(second.prefix_cache, q) for q in probes]).result()
    finally:
        second.stop()
    third = AsyncEngine(loaded, EngineConfig(**disk)).start()
    try:
        (again, again_cached), = run(third, [turn2])
    finally:
        third.stop()
    assert from_disk == in_memory
    assert again == repeat and again_cached == repeat_cached == len(turn2) - 1


def test_disk_tier_keeps_its_budget_and_drops_unreadable_files(tiny, tmp_path):
    loaded = tiny("llama-tiny")
    settings = CASES["llama-tiny"]
    folder = tmp_path / "kv"
    engine = AsyncEngine(loaded, EngineConfig(disk_cache_dir=str(folder), **settings)).start()
    try:
        run(engine, [prompt_of(40, 21)])
    finally:
        engine.stop()
    one_block = max(f.stat().st_size for f in folder.glob("*.safetensors"))
    budget = 5 * one_block
    engine = AsyncEngine(loaded, EngineConfig(disk_cache_dir=str(folder), disk_cache_size=str(budget),
                                              **settings)).start()
    try:
        for seed in range(6):
            run(engine, [prompt_of(40, 30 + seed)])
        engine.call(engine.prefix_cache.disk.flush).result()  # on the engine thread, which owns MLX
        on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        stats = asyncio.run(engine.cache_stats())["prefix_cache"]["disk"]
    finally:
        engine.stop()
    assert on_disk <= budget and stats["bytes"] == on_disk and stats["evictions"] > 0
    # A damaged file: the request runs uncached from that block, with the right tokens.
    prompt = prompt_of(40, 35)  # the last one written, still on disk
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, **settings)).start()
    try:
        (ref, _), = run(off, [prompt])
    finally:
        off.stop()
    for f in folder.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    engine = AsyncEngine(loaded, EngineConfig(disk_cache_dir=str(folder), **settings)).start()
    try:
        (got, cached), = run(engine, [prompt])
        stats = asyncio.run(engine.cache_stats())["prefix_cache"]["disk"]
    finally:
        engine.stop()
    assert got == ref and cached == 0 and stats["dropped"]["unreadable"] >= 1


def _file_holding(folder, tokens):
    """The block file on disk whose tokens are `tokens`."""
    from mlxserve.cache.blockfile import peek_block

    found = [f for f in folder.glob("*.safetensors") if peek_block(f)["token_ids"] == list(tokens)]
    assert len(found) == 1, found
    return found[0]


def _flip_a_data_byte(path):
    """Flip one byte in the middle of a safetensors file's tensor data."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    middle = (start + len(data)) // 2
    data[middle] ^= 0x01
    path.write_bytes(bytes(data))


def test_disk_tier_never_serves_a_damaged_block(tiny, tmp_path):
    """One flipped bit in a block file's KV: a fresh engine on that folder serves the blocks before
    it and computes the rest, with the uncached tokens; the file is deleted and counted (stats,
    Prometheus, and as the miss's reason when it was the prompt's first block)."""
    from prometheus_client.parser import text_string_to_metric_families

    from mlxserve.cache.blockfile import read_block
    from mlxserve.metrics import Metrics

    loaded = tiny("llama-tiny")
    settings = CASES["llama-tiny"]
    folder = tmp_path / "kv"
    prompts = [prompt_of(70, 41), prompt_of(70, 42)]
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, **settings)).start()
    try:
        refs = [tokens for tokens, _ in run(off, prompts)]
    finally:
        off.stop()
    engine = AsyncEngine(loaded, EngineConfig(disk_cache_dir=str(folder), **settings)).start()
    try:
        run(engine, prompts)
    finally:
        engine.stop()
    damaged = [_file_holding(folder, prompts[0][16:32]), _file_holding(folder, prompts[1][:16])]
    for f in damaged:
        _flip_a_data_byte(f)
    damaged_bytes = [f.read_bytes() for f in damaged]
    engine = AsyncEngine(loaded, EngineConfig(disk_cache_dir=str(folder), **settings)).start()
    try:
        got = [run(engine, [p])[0] for p in prompts]
        stats = asyncio.run(engine.cache_stats())["prefix_cache"]
        families = {f.name: f for f in text_string_to_metric_families(Metrics(lambda: [engine]).render().decode())}
    finally:
        engine.stop()
    assert [tokens for tokens, _ in got] == refs
    # The first prompt keeps its first block (read back) and computes from the damaged second;
    # the second prompt's first block is damaged: a miss, for that reason.
    assert [cached for _, cached in got] == [16, 0]
    assert stats["misses"]["damaged"] == 1
    assert stats["disk"]["dropped"] == {"damaged": 2, "unreadable": 0, "old_format": 0}
    dropped = {s.labels["reason"]: s.value for s in families["prefix_cache_disk_dropped"].samples}
    assert dropped == {"damaged": 2, "unreadable": 0, "old_format": 0}
    # The damaged files are gone: the blocks were computed again and written anew, sound.
    for f, bad in zip(damaged, damaged_bytes):
        assert f.read_bytes() != bad
        read_block(f)


def test_disk_tier_refuses_a_folder_it_cannot_write(tiny, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    engine = AsyncEngine(tiny("llama-tiny"), EngineConfig(disk_cache_dir=str(tmp_path / "a-file" / "kv")))
    with pytest.raises(RuntimeError, match="cannot be written"):
        engine.start()


# ---- hybrids resume at the latest recurrent state kept ----

# A tiny Baichuan-M1 (mlx-lm's baichuan_m1 ModelArgs): every layer a CacheList of a short
# convolution's state and attention KV, a sliding window (two blocks) on 2 of 4 layers.
BAICHUAN_M1 = dict(model_type="baichuan_m1", vocab_size=151936, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                   sliding_window=64, sliding_window_layers=[1, 3], conv_window=2, rms_norm_eps=1e-5,
                   tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hybrid(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrids")
    configs = {"baichuan_m1": BAICHUAN_M1,
               "granitemoehybrid": json.loads((Path(__file__).parent / "families.json").read_text())["granitemoehybrid"]}
    loaded = {}

    def get(name):
        if name not in configs:
            return tiny(name)
        if name not in loaded:
            (folder / f"{name}.json").write_text(json.dumps(configs[name]))
            loaded[name] = load(str(folder / f"{name}.json"), load_format="dummy", progress=False)
        return loaded[name]
    return get


@pytest.mark.parametrize("name", ["granitemoehybrid", "baichuan_m1", "qwen3.5-tiny"])
def test_a_hybrids_next_turn_resumes_at_the_latest_state_kept(hybrid, name, tmp_path):
    """An agent's turn 2 goes on from turn 1's prompt and (part of) its answer. Recurrent layers
    restore only where a state was kept: 32-token blocks, a state every 4 blocks, at each prompt's
    last block end and at its last token but one (a tail), none in the answer's blocks. Turn 2
    resumes at the latest such state at or before where it parts from turn 1, with the tokens it
    gives uncached; from memory and, after a restart, from the disk tier."""
    loaded = hybrid(name)
    settings = dict(block_size=32)  # the CPU's default; the default checkpoint interval (4)
    short, exact = prompt_of(337, 71), prompt_of(512, 72)
    runs = {}
    for solo in (True, False):
        disk, restarted = tmp_path / f"kv-{solo}", tmp_path / f"kv-{solo}-restarted"
        on = AsyncEngine(loaded, EngineConfig(solo_fast_path=solo, disk_cache_dir=str(disk), **settings)).start()
        try:
            (answer1, _), = run(on, [short], greedy(25))
            (answer2, _), = run(on, [exact], greedy(20))
            on.call(on.prefix_cache.disk.flush).result()
            shutil.copytree(disk, restarted)  # turn 1's blocks, as a restarted server finds them
            # Parts at 356, inside the answer's first block (352-384): the states at 336 (the
            # prompt's tail), 320 (its last block end), 256 and 128 are before it.
            turn2 = [(short + answer1)[:356] + prompt_of(10, 73),
                     # Parts at 520, in the answer: the prompt's 16 blocks end at 512.
                     exact + answer2[:8] + prompt_of(10, 74)]
            runs[solo, "memory"] = [run(on, [p])[0] for p in turn2]
        finally:
            on.stop()
        again = AsyncEngine(loaded, EngineConfig(solo_fast_path=solo, disk_cache_dir=str(restarted),
                                                 **settings)).start()
        try:
            runs[solo, "disk"] = [run(again, [p])[0] for p in turn2]
        finally:
            again.stop()
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, **settings)).start()
    try:
        reference = [run(off, [p])[0][0] for p in turn2]
    finally:
        off.stop()
    for (solo, tier), got in runs.items():
        assert [tokens for tokens, _ in got] == reference, (solo, tier)
        # The solo path's last prefill pass ends at the 512-token prompt's end and keeps the
        # state there; a batch's prefill stops a token short (the first decode step runs the
        # last token), at the tail it keeps at 511.
        assert [cached for _, cached in got] == [336, 512 if solo else 511], (solo, tier)

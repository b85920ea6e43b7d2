"""The warm-up after start: it runs each path once, says so in the log and /health, leaves
no trace in the prefix cache or the statistics, never changes an answer, and a request
that arrives meanwhile is served."""

import asyncio
import json
import logging
import sys
import threading

import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine import warmup
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import Request, SamplingParams

SETTINGS = dict(max_num_seqs=4, prefill_chunk_size=16, block_size=8)
PROMPT = [(31 * j) % 3000 + 100 for j in range(40)]


async def tokens_of(engine, prompt, params):
    out = []
    async for step in engine.submit(Request(list(prompt), params)):
        out += step.new_token_ids
    return out


async def conversation(engine):
    """Greedy turns that hit the prefix cache, a seeded sampled one, and three at once."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = await tokens_of(engine, PROMPT, greedy)
    second = await tokens_of(engine, PROMPT + first + [7, 8, 9], greedy)
    sampled = await tokens_of(engine, PROMPT + [5], SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=5,
                                                                   ignore_eos=True))
    batch = await asyncio.gather(*(tokens_of(engine, PROMPT[:20 + 5 * i], greedy) for i in range(3)))
    return [first, second, sampled, *batch]


@pytest.mark.parametrize("full", [True, False], ids=["gpu-plan", "cpu-plan"])
def test_warmup_runs_is_logged_and_leaves_nothing(tiny, caplog, monkeypatch, full):
    monkeypatch.setattr(warmup, "full_plan", lambda: full)
    caplog.set_level(logging.INFO, logger="mlxserve.engine")
    engine = AsyncEngine(tiny("qwen3-tiny"), EngineConfig(**SETTINGS)).start()
    try:
        assert engine.warmed.wait(60)
        status = engine.health()["warmup"]
        stats = asyncio.run(engine.cache_stats())["prefix_cache"]
        steps = engine.steps
    finally:
        engine.stop()
    assert status["state"] == "done" and status["skipped"] == 0
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up done")]
    assert len(done) == 1 and "solo prefill+decode" in done[0] and "solo->batch handover" in done[0]
    if full:  # and two restores, prompt logprobs, batches of 3 and 4 (2 is the handover's)
        assert status["phases"] == 8 and "prefix restore +9" in done[0] and "batch 4" in done[0]
    else:
        assert status["phases"] == 3 and "sampling+logprobs" in done[0] and "batch" not in done[0].replace(
            "solo->batch", "")
    assert stats["blocks"] == 0 and stats["stored_blocks"] == 0
    assert stats["queries"] == 0 and stats["hits"] == 0 and stats["hit_tokens"] == 0
    assert steps == 0


def test_answers_are_the_same_with_and_without_warmup(tiny, monkeypatch):
    answers = []
    for seconds, full in ((0, False), (60, False), (60, True)):
        monkeypatch.setattr(warmup, "full_plan", lambda: full)
        engine = AsyncEngine(tiny("qwen3-tiny"), EngineConfig(warmup=seconds, **SETTINGS)).start()
        try:
            assert engine.warmed.wait(60)
            assert engine.health()["warmup"]["state"] == ("off" if seconds == 0 else "done")
            answers.append(asyncio.run(conversation(engine)))
        finally:
            engine.stop()
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][1] and all(len(a) in (5, 6) for a in answers[0])


def test_a_request_during_the_warmup_is_served(tiny, monkeypatch):
    """The first phase waits until a request is queued: it is served after that phase, the
    other phases run once it is done, with the same answer as without a warm-up."""
    queued = threading.Event()
    solo = warmup.Warmup._solo

    def held(self):
        assert queued.wait(30)
        solo(self)

    monkeypatch.setattr(warmup.Warmup, "_solo", held)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold = AsyncEngine(tiny("qwen3-tiny"), EngineConfig(warmup=0, **SETTINGS)).start()
    try:
        expected = asyncio.run(tokens_of(cold, PROMPT, greedy))
    finally:
        cold.stop()
    engine = AsyncEngine(tiny("qwen3-tiny"), EngineConfig(**SETTINGS)).start()
    try:
        async def during():
            stream = tokens_of(engine, PROMPT, greedy)
            task = asyncio.ensure_future(stream)
            await asyncio.sleep(0)  # submitted: the request is in the engine's queue
            state = engine.health()["warmup"]["state"]
            queued.set()
            return state, await task

        state, tokens = asyncio.run(during())
        assert state in ("pending", "running")
        assert tokens == expected
        assert engine.warmed.wait(60)
        assert engine.health()["warmup"]["state"] == "done"
    finally:
        queued.set()
        engine.stop()


def test_warmup_stops_at_its_budget(tiny, caplog):
    caplog.set_level(logging.INFO, logger="mlxserve.engine")
    engine = AsyncEngine(tiny("qwen3-tiny"), EngineConfig(warmup=1e-6, **SETTINGS)).start()
    try:
        assert engine.warmed.wait(60)
        status = engine.health()["warmup"]
    finally:
        engine.stop()
    assert status["state"] == "stopped" and status["phases"] == 1 and status["skipped"] == 2
    assert any("budget of" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)


def test_batch_sizes_cover_the_kernel_size_classes():
    assert warmup.batch_sizes(32) == [2, 3, 4, 8, 16, 32]
    assert warmup.batch_sizes(12) == [2, 3, 4, 8, 12]
    assert warmup.batch_sizes(1) == []


def test_bench_warmup_on_a_fresh_server(tmp_path):
    """`mlxserve bench warmup` on a tiny model: both runs, the warm-up logged and leaving the
    prefix cache empty, every turn timed, the same answers."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "mlxserve.cli", "bench", "warmup", "--model", "dummy:qwen3-tiny",
                          "--turns", "3", "--system-tokens", "100", "--answer-len", "4", "--server-args",
                          "--max-num-seqs 4", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stderr[-2000:]  # 1: a turn past 3x the median (noise on a shared CPU)
    (result,) = tmp_path.glob("warmup-*.json")
    runs = json.loads(result.read_text())["results"]["runs"]
    off, on = runs
    assert (off["mode"], off["warmup"]["state"], on["mode"], on["warmup"]["state"]) == ("off", "off", "on", "done")
    assert any(line.startswith("warm-up done") for line in on["warmup_log"]) and not off["warmup_log"]
    assert on["cache_after_warmup"] == {"blocks": 0, "queries": 0, "hits": 0, "stored_blocks": 0}
    assert [t["answer"] for t in off["turns"]] == [t["answer"] for t in on["turns"]]
    assert [t["turn"] for t in on["turns"]] == [1, 2, 3] and all(t["ttft"] > 0 for t in on["turns"])
    assert on["turns"][1]["cached"] > 0
    assert "Answers the same in both runs: yes" in (tmp_path / result.with_suffix(".md").name).read_text()

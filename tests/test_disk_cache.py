"""The disk tier's files: what a block file holds, the checks a read makes, and what a start
cleans up. (Through the engine: tests/test_prefix_cache.py; a server killed while it
writes: tests/test_crash.py.)"""

import json
import os
import subprocess
import sys
import time

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxserve.cache.disk import DiskTier  # noqa: E402
from mlxserve.cache.layers import KV, Payload  # noqa: E402
from mlxserve.cache.pool import Block  # noqa: E402


def test_disk_tier_round_trips_every_payload_kind(tmp_path):
    """Blocks come back from disk with the same structure, dtypes (bfloat16 too) and values."""
    import numpy as np
    from mlx_lm.models.cache import ArraysCache, KVCache

    from mlxserve.cache.disk import DiskTier
    from mlxserve.cache.layers import KV, Nested, QuantizedKV, State, _stacked
    from mlxserve.cache.pool import Block

    def kv(dtype):
        return KV(mx.random.normal((1, 2, 4, 8)).astype(dtype), mx.random.normal((1, 2, 4, 8)).astype(dtype))

    quantized = QuantizedKV(*(tuple(mx.quantize(mx.random.normal((1, 2, 4, 64)).astype(mx.bfloat16), 64, 8))
                              for _ in range(2)), 64, 8)
    entries = [kv(mx.bfloat16), kv(mx.bfloat16), None, State((mx.arange(6, dtype=mx.int32), None)),
               Nested((kv(mx.float16), None)), quantized]
    layers = [KVCache(), KVCache(), KVCache(), ArraysCache(2), None, None]
    payload = _stacked(entries, layers)
    assert payload.stack_layers == (0, 1)  # the two bf16 KV layers share a stack
    disk = DiskTier(tmp_path, 1 << 30)
    blocks = [Block(bytes([i]) * 32, None if i == 0 else bytes([i - 1]) * 32, payload, 0, 4,
                    token_ids=np.arange(4), extra=(("img", -2),) if i else None) for i in range(2)]
    for b in blocks:
        disk.save(b)
    disk.close()
    again = DiskTier(tmp_path, 1 << 30)  # a restart: the index comes from the folder
    parent, back, num_tokens, token_ids, extra = again.load(blocks[1].hash)
    assert (parent, num_tokens, token_ids.tolist(), extra) == (blocks[0].hash, 4, [0, 1, 2, 3], (("img", -2),))
    assert back.stack_layers == (0, 1) and len(back) == len(payload)

    def same(a, b):
        if isinstance(a, mx.array):
            return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
        if a is None or isinstance(a, int):
            return a == b
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))

    assert all(same(a, b) for a, b in zip(payload, back))
    again.close()


def _chain(n=2):
    """n chained blocks of 4 tokens with a little float32 KV each."""
    blocks = []
    for i in range(n):
        payload = Payload([KV(mx.random.normal((1, 2, 4, 8)), mx.random.normal((1, 2, 4, 8)))])
        blocks.append(Block(bytes([i + 1]) * 32, blocks[-1].hash if blocks else None, payload, 0, 4,
                            token_ids=np.arange(4 * i, 4 * i + 4)))
    return blocks


def _written(folder, blocks):
    disk = DiskTier(folder, 1 << 30)
    for b in blocks:
        disk.save(b)
    disk.close()
    return {b.hash: next(folder.glob(b.hash.hex() + ".*.safetensors")) for b in blocks}


def _rewrite_header(path, change):
    """Rewrite a block file's header through `change(header)`, keeping its data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])


def test_the_checksum_covers_the_description_too(tmp_path):
    """A changed token id in the header (the file still parses) is damage: never matched against."""
    blocks = _chain()
    paths = _written(tmp_path, blocks)

    def other_tokens(header):
        meta = json.loads(header["__metadata__"]["mlxserve"])
        meta["token_ids"][-1] += 1
        header["__metadata__"]["mlxserve"] = json.dumps(meta)

    _rewrite_header(paths[blocks[1].hash], other_tokens)
    disk = DiskTier(tmp_path, 1 << 30)
    assert disk.load(blocks[0].hash) is not None and disk.load(blocks[1].hash) is None
    assert disk.stats()["dropped"] == {"damaged": 1, "unreadable": 0, "old_format": 0}
    assert not paths[blocks[1].hash].exists() and blocks[1].hash not in disk
    disk.close()


def test_files_without_a_checksum_are_misses(tmp_path):
    """Blocks written before checksums are never served: a checksum computed now would vouch for
    whatever bytes are there now, damage included. Named the old way (the key alone) they are
    deleted at start; a file under a new name without one is deleted when read."""
    blocks = _chain(3)
    paths = _written(tmp_path, blocks)
    for path in paths.values():
        _rewrite_header(path, lambda h: h["__metadata__"].pop("checksum"))
    old_name = tmp_path / (blocks[0].hash.hex() + ".safetensors")
    os.replace(paths[blocks[0].hash], old_name)
    unrelated = tmp_path / "notes.safetensors"  # not a block's name: left alone
    unrelated.write_bytes(b"x")
    disk = DiskTier(tmp_path, 1 << 30)
    assert not old_name.exists() and unrelated.exists()
    assert disk.stats()["dropped"]["old_format"] == 1 and len(disk) == 2
    assert disk.load(blocks[1].hash) is None and not paths[blocks[1].hash].exists()
    assert disk.stats()["dropped"] == {"damaged": 0, "unreadable": 0, "old_format": 2}
    disk.close()


def test_a_start_deletes_the_temporary_files_of_dead_writers_only(tmp_path):
    from mlxserve.cache.disk import _tmp_name

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)  # exited and reaped: no process has this id now (unless reused)
    mine = tmp_path / _tmp_name("a" * 64)  # this process is alive: a write in flight
    cut = tmp_path / mine.name.replace(f".{os.getpid()}.", f".{dead_pid}.")
    elsewhere = tmp_path / ("b" * 64 + ".00000000.1.abcdef12.tmp")  # another host's: its pid means nothing here
    stale = tmp_path / ("c" * 64 + ".00000000.1.abcdef12.tmp")
    for f in (mine, cut, elsewhere, stale):
        f.write_bytes(b"half a block")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    disk = DiskTier(tmp_path, 1 << 30)
    assert (mine.exists(), cut.exists(), elsewhere.exists(), stale.exists()) == (True, False, True, False)
    assert disk.stats()["abandoned_tmp"] == 2
    disk.close()


def test_when_too_many_blocks_wait_the_newest_go_never_a_parent(tmp_path, monkeypatch):
    """Blocks are found only through their parents: when more wait than MAX_WAITING (a writer
    that cannot keep up), the newest are skipped, and so is a block whose parent is not written,
    so no file on disk is an orphan that no lookup can reach. Each skip is counted by why."""
    from mlxserve.cache import disk as disk_module

    MAX_WAITING = 64
    monkeypatch.setattr(disk_module, "MAX_WAITING", MAX_WAITING)
    blocks = _chain(MAX_WAITING + 6)
    orphan = Block(b"\x99" * 32, b"\x98" * 32, blocks[0].payload, 0, 4, token_ids=np.arange(4))
    disk = DiskTier(tmp_path, 1 << 30)
    for b in blocks + [orphan]:
        disk.save(b)
    disk.close()
    on_disk = {bytes.fromhex(f.name.split(".")[0]) for f in tmp_path.glob("*.safetensors")}
    assert on_disk == {b.hash for b in blocks[:MAX_WAITING]}
    assert disk.stats()["skipped"] == 7
    # The first past the backlog goes for it; its children after it go as orphans, as does `orphan`.
    assert disk.stats()["skipped_by_reason"] == {"backlog": 1, "orphan": 6, "evicted": 0, "daily_budget": 0}


def test_the_write_budget_paces_seconds_and_refuses_past_the_day():
    from mlxserve.cache.disk import WriteBudget

    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    budget = WriteBudget(per_second=100, per_day=1000, clock=lambda: now[0])
    assert budget.take(100, sleep) and slept == []  # a second's burst is free
    assert budget.take(50, sleep) and slept == [0.5]  # then it waits its turn
    assert budget.take(300, sleep) and slept[-1] == 3.0  # a block larger than a second's worth
    for _ in range(5):
        assert budget.take(100, sleep)
    assert not budget.take(100, sleep)  # 950 of the day's 1000 spent: refused, nothing spent
    assert budget.take(50, sleep)
    now[0] += WriteBudget.DAY_S / 10  # a tenth of a day refills a tenth of its budget
    assert budget.take(100, sleep) and not budget.take(1, sleep)
    unlimited = WriteBudget(None, None, clock=lambda: now[0])
    assert unlimited.take(1 << 40, sleep) and unlimited.waited_s == 0


def test_a_busy_engine_writes_blocks_while_it_decodes(tiny, tmp_path):
    """An engine that never idles still writes: blocks stored while a long request decodes
    reach the disk before it ends (they used to wait for an idle engine)."""
    import asyncio

    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine
    from mlxserve.engine.request import Request, SamplingParams

    engine = AsyncEngine(tiny("qwen3-tiny"), EngineConfig(block_size=16, disk_cache_dir=str(tmp_path))).start()
    disk = engine.prefix_cache.disk

    async def go():
        long = engine.submit(Request(list(range(100, 120)), SamplingParams(max_tokens=2000, ignore_eos=True)))
        first = await long.__anext__()  # decoding now
        short = [[1000 + 97 * i + j for j in range(64)] for i in range(4)]
        for prompt in short:  # each stores 4 full blocks
            async for _ in engine.submit(Request(prompt, SamplingParams(max_tokens=1))):
                pass
        written_while_busy = 0
        async for out in long:
            written_while_busy = max(written_while_busy, disk.writes)
            if out.finished or written_while_busy >= 16:
                break
        return first, written_while_busy

    try:
        first, written = asyncio.run(go())
        assert first.new_token_ids and written >= 16
    finally:
        engine.stop()

"""MLX collectives for a distributed engine's rare agreements (start-up checks, the idle step
plan, disk-tier lookups, cache statistics), and the process's group.

Once the engine runs they go on its thread's generation stream, in the order of the model's
own collectives, so that no rank interleaves them differently (ring runs each CPU stream on a
thread of its own, NCCL orders by stream). Every reduction is an `all_sum` (the one
collective every backend has): a gather is an all_sum of rows each rank fills its own of.
"""

from __future__ import annotations

import os
import pickle

import numpy as np

LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "MLX_IBV_DEVICES", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# `share` sends in a fixed buffer of this many bytes (one collective); a larger object (an idle
# step's plan with a long prompt's token ids) sends the rest in a second one.
PLAN_BYTES = 1024
_HEADER = 4  # the plan's length, little-endian, at the buffer's start

_group = None  # this process's group once init_group() found more than one rank


def launched() -> bool:
    """Whether a launcher started this process as one of several."""
    return any(os.environ.get(name) for name in LAUNCH_ENV)


def init_group(backend: str = "any"):
    """The distributed group of this process when mlx.launch started several, else None."""
    global _group
    if _group is None and launched():
        import mlx.core as mx

        group = mx.distributed.init(strict=True, backend=backend)
        _group = group if group.size() > 1 else None
    return _group


def group():
    """The group init_group() found, or None (one process)."""
    return _group


def engine_stream():
    from mlx_lm.generate import generation_stream

    return generation_stream


def _all(op: str, values, dtype="int64", stream=None) -> np.ndarray:
    import mlx.core as mx

    x = mx.array(np.asarray(values), dtype=getattr(mx, dtype))
    out = getattr(mx.distributed, op)(x, group=_group, stream=stream)
    mx.eval(out)
    return np.array(out)


def _gathered(values, dtype: str, stream) -> np.ndarray:
    """Every rank's `values` as rows, by an all_sum of rows that each rank fills its own of
    (all_sum: the collective every backend has)."""
    rows = np.zeros((_group.size(), len(values)), dtype=dtype)
    rows[_group.rank()] = values
    return _all("all_sum", rows, dtype, stream)


def all_min(flags, stream=None) -> np.ndarray:
    return _gathered(flags, "int32", stream).min(axis=0)


def all_max(values, stream=None) -> np.ndarray:
    return _gathered(values, "int64", stream).max(axis=0)


def gather(obj, stream=None) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = _gathered([len(data)], "int64", stream)[:, 0]
    rows = np.zeros((_group.size(), int(sizes.max())), np.uint8)
    rows[_group.rank(), : len(data)] = data
    rows = _all("all_sum", rows, "uint8", stream)
    return [pickle.loads(rows[r, : int(n)].tobytes()) for r, n in enumerate(sizes)]


def share(obj, rank: int, stream=None):
    """Rank 0's `obj`, on every rank (the others pass None)."""
    import mlx.core as mx

    data = pickle.dumps(obj) if rank == 0 else b""
    head = np.zeros(PLAN_BYTES, np.uint8)
    if rank == 0:
        head[:_HEADER] = np.frombuffer(len(data).to_bytes(_HEADER, "little"), np.uint8)
        first = data[: PLAN_BYTES - _HEADER]
        head[_HEADER: _HEADER + len(first)] = np.frombuffer(first, np.uint8)
    head = _all("all_sum", head, "uint8", stream)
    n = int.from_bytes(head[:_HEADER].tobytes(), "little")
    body = head[_HEADER: _HEADER + n].tobytes()
    rest = n - len(body)
    if rest > 0:  # a plan past the fixed buffer: the rest in one more collective
        tail = np.frombuffer(data[len(body):], np.uint8) if rank == 0 else np.zeros(rest, np.uint8)
        body += _all("all_sum", tail, "uint8", stream).tobytes()
    return pickle.loads(body) if rank != 0 else obj

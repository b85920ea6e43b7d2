"""The cold tier: prefix-cache blocks as safetensors files, found again after a restart.

Every full block the hot tier stores is also written here, one file per block
named by its key (keys hash the model fingerprint, so models never mix). The
engine thread only copies the block's arrays to host memory; a background
thread writes the file (to a temporary name, then renamed, so a crash leaves
no half file under a real name). At start the index is rebuilt from the
folder, so a restart, or a crash, loses only what was not written yet.

A prefix lookup that runs past the hot tier's blocks reads the rest of the
chain from here back into the hot tier. Bounded in bytes: the least recently
used files go first (use is a file's modification time, so the order
survives restarts). A file that cannot be read is deleted and counted; the
request runs with the blocks before it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxserve.cache.layers import KV, Nested, Payload, QuantizedKV, State, _quantized_rows, _row

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
FORMAT = "mlxserve-block-1"


class DiskTier:
    def __init__(self, folder, budget_bytes: int):
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.budget = int(budget_bytes)
        self._lock = threading.Lock()  # the index: the engine thread reads it, the writer adds to it
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._pending: set[bytes] = set()  # queued, not written yet
        self.bytes = 0
        self.reads = 0
        self.writes = 0
        self.evictions = 0
        self.faults = 0
        self._scan()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="mlxserve-disk-cache", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        for tmp in self.folder.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write cut short
        files = []
        for path in self.folder.glob("*" + SUFFIX):
            try:
                key = bytes.fromhex(path.name[: -len(SUFFIX)])
                st = path.stat()
            except (ValueError, OSError):
                continue
            files.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(files):
            self._index[key] = size
            self.bytes += size
        with self._lock:
            self._evict_over_budget()

    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ---- write (engine thread: copy to host; writer thread: the file) ----

    def save(self, block) -> None:
        """Queue a hot-tier block for writing (a no-op if it is on disk or queued)."""
        with self._lock:
            if block.hash in self._index or block.hash in self._pending:
                return
            self._pending.add(block.hash)
        arrays, layers = _encode_payload(block.payload)
        meta = {
            "format": FORMAT,
            "parent": block.parent.hex() if block.parent is not None else "",
            "num_tokens": block.num_tokens,
            "token_ids": [] if block.token_ids is None else np.asarray(block.token_ids).tolist(),
            "extra": [list(e) for e in block.extra] if block.extra else None,
            "layers": layers,
            "stacks": len(block.payload.stacks) if isinstance(block.payload, Payload) else 0,
            "stack_layers": list(getattr(block.payload, "stack_layers", ())),
            "bfloat16": [],
        }
        host = {}
        for name, a in arrays.items():
            if a.dtype == mx.bfloat16:  # numpy has no bfloat16: its bits travel as uint16
                meta["bfloat16"].append(name)
                a = a.view(mx.uint16)
            host[name] = np.array(a)
        self._queue.put((block.hash, host, meta))

    def _write_loop(self) -> None:
        from safetensors.numpy import save_file

        while True:
            job = self._queue.get()
            if job is None:  # close()
                self._queue.task_done()
                return
            key, host, meta = job
            try:
                path = self._path(key)
                tmp = path.with_suffix(".tmp")
                save_file(host, str(tmp), metadata={"mlxserve": json.dumps(meta)})
                os.replace(tmp, path)
                size = path.stat().st_size
                with self._lock:
                    self._index[key] = size
                    self.bytes += size
                    self.writes += 1
                    self._evict_over_budget()
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the server
                with self._lock:
                    self.faults += 1
                log.warning("disk cache: could not write a block: %s", e)
            finally:
                with self._lock:
                    self._pending.discard(key)
                self._queue.task_done()

    def _evict_over_budget(self) -> None:
        while self._index and self.bytes > self.budget:
            key, size = self._index.popitem(last=False)
            self.bytes -= size
            self.evictions += 1
            self._path(key).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    # ---- read (engine thread) ----

    def load(self, key: bytes):
        """(parent, payload, num_tokens, token_ids, extra) of a block on disk, or None."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            arrays, file_meta = mx.load(str(path), return_metadata=True)
            meta = json.loads(file_meta["mlxserve"])
            if meta.get("format") != FORMAT:
                raise ValueError(f"unknown format {meta.get('format')!r}")
            for name in meta["bfloat16"]:
                arrays[name] = arrays[name].view(mx.bfloat16)
            payload = _decode_payload(arrays, meta)
            os.utime(path)  # recently used, across restarts too
        except Exception as e:  # noqa: BLE001 - a bad file is dropped, the request runs uncached from here
            log.warning("disk cache: dropping unreadable %s: %s", path.name, e)
            with self._lock:
                self.faults += 1
                size = self._index.pop(key, None)
                if size is not None:
                    self.bytes -= size
            path.unlink(missing_ok=True)
            return None
        self.reads += 1
        parent = bytes.fromhex(meta["parent"]) if meta["parent"] else None
        extra = tuple(tuple(e) for e in meta["extra"]) if meta["extra"] else None
        return parent, payload, meta["num_tokens"], np.asarray(meta["token_ids"], dtype=np.int32), extra

    def clear(self) -> None:
        """Delete every file (after what is queued is written)."""
        self.flush()
        with self._lock:
            for key in list(self._index):
                self._path(key).unlink(missing_ok=True)
            self._index.clear()
            self.bytes = 0

    def stats(self) -> dict:
        with self._lock:
            return {"folder": str(self.folder), "blocks": len(self._index), "bytes": self.bytes,
                    "budget": self.budget, "reads": self.reads, "writes": self.writes,
                    "evictions": self.evictions, "faults": self.faults}


# ---- a payload as named arrays plus a JSON description ----


def _encode_payload(payload) -> tuple[dict, list]:
    arrays = {}
    stacked = set(getattr(payload, "stack_layers", ()))
    for n, a in enumerate(getattr(payload, "stacks", ())):
        arrays[f"stack{n}"] = a
    layers = []
    for i, e in enumerate(payload):
        if i in stacked:
            q = isinstance(e, QuantizedKV)
            layers.append({"stacked": True, "group_size": e.group_size if q else None, "bits": e.bits if q else None})
        else:
            layers.append(_encode_entry(e, str(i), arrays))
    return arrays, layers


def _encode_entry(e, name: str, arrays: dict):
    if e is None:
        return None
    if isinstance(e, KV):
        arrays[name + ".k"], arrays[name + ".v"] = e.keys, e.values
        return {"kv": True}
    if isinstance(e, QuantizedKV):
        for j, a in enumerate((*e.keys, *e.values)):
            arrays[f"{name}.q{j}"] = a
        return {"qkv": True, "group_size": e.group_size, "bits": e.bits}
    if isinstance(e, State):
        present = []
        for j, a in enumerate(e.arrays):
            present.append(a is not None)
            if a is not None:
                arrays[f"{name}.s{j}"] = a
        return {"state": present}
    if isinstance(e, Nested):
        return {"nested": [_encode_entry(p, f"{name}.{j}", arrays) for j, p in enumerate(e.parts)]}
    raise TypeError(f"cannot write a {type(e).__name__} entry")


def _decode_payload(arrays: dict, meta: dict) -> Payload:
    stacks = tuple(arrays[f"stack{n}"] for n in range(meta["stacks"]))
    stack_layers = tuple(meta["stack_layers"])
    n = len(stack_layers)
    payload = Payload()
    for i, spec in enumerate(meta["layers"]):
        if spec is not None and spec.get("stacked"):
            j = stack_layers.index(i)
            if spec["bits"] is None:
                payload.append(KV(_row(stacks[0], j), _row(stacks[0], n + j)))
            else:
                like = QuantizedKV((), (), spec["group_size"], spec["bits"])
                payload.append(_quantized_rows(stacks, n, j, like))
        else:
            payload.append(_decode_entry(spec, str(i), arrays))
    payload.stacks, payload.stack_layers = stacks, stack_layers
    return payload


def _decode_entry(spec, name: str, arrays: dict):
    if spec is None:
        return None
    if "kv" in spec:
        return KV(arrays[name + ".k"], arrays[name + ".v"])
    if "qkv" in spec:
        q = [arrays[f"{name}.q{j}"] for j in range(6)]
        return QuantizedKV(tuple(q[:3]), tuple(q[3:]), spec["group_size"], spec["bits"])
    if "state" in spec:
        return State(tuple(arrays[f"{name}.s{j}"] if here else None for j, here in enumerate(spec["state"])))
    if "nested" in spec:
        return Nested(tuple(_decode_entry(p, f"{name}.{j}", arrays) for j, p in enumerate(spec["nested"])))
    raise ValueError(f"unknown entry {spec}")

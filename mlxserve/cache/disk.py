"""The cold tier: prefix-cache blocks as safetensors files, found again after a restart.

Every full block the hot tier stores is also written here, one file per block
named by its key (keys hash the model fingerprint, so models never mix).
Writing has two halves. The engine thread copies a block's arrays to host
memory when it has nothing else to do (`copy_pending`, called from its idle
loop), so a prefill never waits for it; a background thread writes the file
(to a temporary name, then renamed, so a crash leaves no half file under a
real name). Blocks wait at most `MAX_WAITING` deep: under load that never
lets the engine idle, the oldest are skipped (counted), never the engine
slowed. At start the index is rebuilt from the folder, so a restart, or a
crash, loses only what was not written yet.

A prefix lookup that runs past the hot tier's blocks reads the rest of the
chain from here back into the hot tier. Bounded in bytes: the least recently
used files go first (use is a file's modification time, so the order
survives restarts). A file that cannot be parsed is deleted and counted; the
request runs with the blocks before it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxserve.cache.layers import KV, Nested, Payload, QuantizedKV, State, _quantized_rows, _row

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
FORMAT = "mlxserve-block-2"
MAX_WAITING = 64  # blocks stored in memory, not yet copied for writing
MAX_QUEUED = 16  # copied blocks waiting for the writer thread (host memory held)
STALE_TMP_S = 600  # a temporary file this old was left by a write that died


class DiskTier:
    def __init__(self, folder, budget_bytes: int):
        self.folder = Path(folder).expanduser()
        try:  # fail at start, with the reason, rather than on every block
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".write-test-{uuid.uuid4().hex}.tmp"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"disk cache folder {str(self.folder)!r} cannot be written: {e}") from None
        self.budget = int(budget_bytes)
        self._lock = threading.Lock()  # the index and counters: the engine thread and the writer share them
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._waiting: OrderedDict[bytes, object] = OrderedDict()  # blocks to copy (engine thread only)
        self._queued: set[bytes] = set()  # copied, not written yet
        self.bytes = 0
        self.reads = 0
        self.writes = 0
        self.evictions = 0
        self.faults = 0
        self.skipped = 0  # blocks never written: the engine was busy for MAX_WAITING blocks
        self._warned = False
        self._scan()
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._writer = threading.Thread(target=self._write_loop, name="mlxserve-disk-cache", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        for tmp in self.folder.glob("*.tmp"):  # writes cut short (not another process's, in flight)
            try:
                if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink(missing_ok=True)
            except OSError:
                pass
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

    # ---- write: save (engine thread), copy_pending (engine thread, idle), the writer thread ----

    def save(self, block) -> None:
        """Note a hot-tier block for writing (a no-op if it is on disk or on its way)."""
        key = block.hash
        with self._lock:
            if key in self._index or key in self._queued:
                return
        if key in self._waiting:
            return
        self._waiting[key] = block
        while len(self._waiting) > MAX_WAITING:
            self._waiting.popitem(last=False)
            self.skipped += 1

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def copy_pending(self, max_blocks: int = 1, block: bool = False) -> int:
        """Copy up to `max_blocks` waiting blocks to host memory and queue them for the writer
        (engine thread); returns how many. Without `block`, stop where the writer's queue is full."""
        copied = 0
        while self._waiting and copied < max_blocks and self._writer.is_alive():
            if not block and self._queue.full():
                break
            key, b = self._waiting.popitem(last=False)
            if not b.cached:  # evicted from memory meanwhile: too cold to be worth writing
                self.skipped += 1
                continue
            try:
                host, meta = _to_host(b)
            except Exception as e:  # noqa: BLE001 - never the engine's failure
                self._fail("copy", e)
                continue
            with self._lock:
                self._queued.add(key)
            self._queue.put((key, host, meta))
            copied += 1
        return copied

    def _fail(self, what: str, error: Exception) -> None:
        with self._lock:
            self.faults += 1
            warn, self._warned = not self._warned, True
        (log.warning if warn else log.debug)("disk cache: could not %s a block: %s", what, error)

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:  # close()
                self._queue.task_done()
                return
            key, host, meta = job
            path = self._path(key)
            tmp = self.folder / f"{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            try:
                _write_safetensors(tmp, host, meta)
                os.replace(tmp, path)
                size = path.stat().st_size
                with self._lock:
                    if size > self.budget:
                        path.unlink(missing_ok=True)
                    else:
                        self._index[key] = size
                        self.bytes += size
                        self.writes += 1
                        self._evict_over_budget()
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the server
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
                self._fail("write", e)
            finally:
                with self._lock:
                    self._queued.discard(key)
                self._queue.task_done()

    def _evict_over_budget(self) -> None:
        while self._index and self.bytes > self.budget:
            key, size = self._index.popitem(last=False)
            self.bytes -= size
            self.evictions += 1
            self._path(key).unlink(missing_ok=True)

    def flush(self) -> None:
        """Write every block noted so far (engine thread)."""
        self.copy_pending(len(self._waiting), block=True)
        if self._writer.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Write what is noted, then stop the writer thread (engine thread)."""
        if self._writer.is_alive():
            self.flush()
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
            # Read now: mx.load is lazy and keeps the file open until the arrays are
            # evaluated, which a restore may never do for some layers.
            mx.eval(list(arrays.values()))
            meta = json.loads(file_meta["mlxserve"])
            if meta.get("format") != FORMAT:
                raise ValueError(f"unknown format {meta.get('format')!r}")
            payload = _decode_payload(arrays, meta)
            parent = bytes.fromhex(meta["parent"]) if meta["parent"] else None
            extra = tuple(tuple(e) for e in meta["extra"]) if meta["extra"] else None
            token_ids = np.asarray(meta["token_ids"], dtype=np.int32)
            num_tokens = int(meta["num_tokens"])
        except Exception as e:  # noqa: BLE001 - the request runs uncached from here
            if not _can_open(path):  # gone (evicted meanwhile) or out of file handles: not the file's fault
                log.debug("disk cache: cannot read %s: %s", path.name, e)
                return None
            log.warning("disk cache: dropping unreadable %s: %s", path.name, e)
            with self._lock:
                self.faults += 1
                size = self._index.pop(key, None)
                if size is not None:
                    self.bytes -= size
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used, across restarts too
        self.reads += 1
        return parent, payload, num_tokens, token_ids, extra

    def clear(self) -> None:
        """Delete every file, and forget what was waiting to be written (engine thread)."""
        self._waiting.clear()
        if self._writer.is_alive():
            self._queue.join()
        with self._lock:
            for key in list(self._index):
                self._path(key).unlink(missing_ok=True)
            self._index.clear()
            self.bytes = 0

    def stats(self) -> dict:
        with self._lock:
            return {"folder": str(self.folder), "blocks": len(self._index), "bytes": self.bytes,
                    "budget": self.budget, "reads": self.reads, "writes": self.writes,
                    "evictions": self.evictions, "faults": self.faults, "skipped": self.skipped,
                    "waiting": len(self._waiting)}


def _can_open(path: Path) -> bool:
    try:
        with open(path, "rb"):
            return True
    except OSError:
        return False


def _to_host(block) -> tuple[dict, dict]:
    """A block's arrays as numpy (bfloat16 as its uint16 bits: numpy has no bfloat16) and its metadata."""
    arrays, layers = _encode_payload(block.payload)
    meta = {
        "format": FORMAT,
        "parent": block.parent.hex() if block.parent is not None else "",
        "num_tokens": block.num_tokens,
        "token_ids": [] if block.token_ids is None else np.asarray(block.token_ids).tolist(),
        "extra": [list(e) for e in block.extra] if block.extra else None,
        "layers": layers,
        "stacks": len(getattr(block.payload, "stacks", ())),
        "stack_layers": list(getattr(block.payload, "stack_layers", ())),
        "bfloat16": [],  # written as BF16 (carried as uint16 bits in numpy)
    }
    host = {}
    for name, a in arrays.items():
        if a.dtype == mx.bfloat16:
            meta["bfloat16"].append(name)
            a = a.view(mx.uint16)
        host[name] = np.array(a)
    return host, meta


_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "uint32": "U32", "int32": "I32",
           "uint16": "U16", "int16": "I16", "uint8": "U8", "int8": "I8", "int64": "I64", "uint64": "U64",
           "bool": "BOOL"}


def _write_safetensors(path: Path, host: dict, meta: dict) -> None:
    """A safetensors file with bfloat16 arrays stored as BF16 (safetensors' numpy writer cannot:
    numpy has no bfloat16), so mx.load gives them back as they were, with no conversion."""
    bf16 = set(meta["bfloat16"])
    header = {"__metadata__": {"mlxserve": json.dumps(meta)}}
    offset = 0
    for name, a in host.items():
        header[name] = {"dtype": "BF16" if name in bf16 else _DTYPES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for a in host.values():
            f.write(np.ascontiguousarray(a).data)


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

"""One prefix-cache block as a safetensors file, with a checksum over everything it says.

The file is plain safetensors (any reader opens it): the payload's arrays, and
in its metadata `mlxserve`, a JSON description (format, key, parent, tokens,
layer layout), and `checksum`, xxh3-128 over the tensor table and that
description (as canonical JSON) and every data byte. A block is read whole and
checked before any array is built from it, so a flipped bit, a torn write or a
file cut short is refused (`BadBlockFile`, with a reason), never served.

xxh3 rather than a cryptographic hash: it guards against damage, not against
someone who can write the folder (who could write any KV anyway), and it runs
at ~9 GB/s on one core where BLAKE2 runs at ~0.6 GB/s: reading back 8k tokens
of a 4B model's KV (1.2 GB) would cost 2 s of BLAKE2, more than recomputing it
on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash

from mlxserve.cache.payload import KV, Nested, Payload, QuantizedKV, State
from mlxserve.cache.stacks import views

# Bump when the layout changes. Files of an older format are misses (and are deleted).
FORMAT = "mlxserve-block-3"
CHECKSUM = "xxh3_128"
MAX_HEADER = 64 << 20  # a longer header is damage, not a block (a block's header is a few KB)

# Why a file is refused (what the disk tier counts): damaged: its checksum does not match;
# unreadable: not a block file this code can parse; old_format: written before checksums.
DROP_REASONS = ("damaged", "unreadable", "old_format")


class BadBlockFile(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "uint32": "U32", "int32": "I32",
           "uint16": "U16", "int16": "I16", "uint8": "U8", "int8": "I8", "int64": "I64", "uint64": "U64",
           "bool": "BOOL"}
_NUMPY = {v: np.dtype(k) for k, v in _DTYPES.items()} | {"BF16": np.dtype(np.uint16)}


def _canonical(tensors: dict, description: str) -> bytes:
    return json.dumps({"tensors": tensors, "mlxserve": description}, sort_keys=True,
                      separators=(",", ":")).encode()


def write_block(path: Path, host: dict, meta: dict) -> None:
    """A safetensors file of `host` (numpy arrays; the names in meta["bfloat16"] hold bfloat16 as
    uint16 bits: numpy has no bfloat16) with `meta` and the checksum."""
    bf16 = set(meta["bfloat16"])
    arrays = {name: np.ascontiguousarray(a) for name, a in host.items()}
    tensors, offset = {}, 0
    for name, a in arrays.items():
        tensors[name] = {"dtype": "BF16" if name in bf16 else _DTYPES[a.dtype.name], "shape": list(a.shape),
                         "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    description = json.dumps(meta)
    digest = xxhash.xxh3_128(_canonical(tensors, description))
    for a in arrays.values():
        digest.update(a.data)
    header = {"__metadata__": {"mlxserve": description, "checksum": f"{CHECKSUM}:{digest.hexdigest()}"},
              **tensors}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for a in arrays.values():
            f.write(a.data)


def _header(buf: bytes) -> tuple[dict, int]:
    if len(buf) < 8:
        raise BadBlockFile("unreadable", "shorter than a safetensors header")
    n = int.from_bytes(buf[:8], "little")
    if n > MAX_HEADER or 8 + n > len(buf):
        raise BadBlockFile("unreadable", f"header length {n} does not fit the file")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadBlockFile("unreadable", f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise BadBlockFile("unreadable", "header is not a JSON object")
    return header, 8 + n


def _description(header: dict) -> tuple[str, str | None]:
    metadata = header.pop("__metadata__", None)
    description = metadata.get("mlxserve") if isinstance(metadata, dict) else None
    if not isinstance(description, str):
        raise BadBlockFile("unreadable", "not an mlxserve block (no 'mlxserve' metadata)")
    return description, metadata.get("checksum")


def read_block(path: Path) -> tuple[dict, dict]:
    """(arrays by name, description) of a block file, checked. OSError if it cannot be
    opened; BadBlockFile if it is not a sound block file of this format."""
    buf = memoryview(path.read_bytes())
    header, start = _header(buf)
    description, checksum = _description(header)
    if checksum is None:
        raise BadBlockFile("old_format", "written without a checksum")
    algorithm, _, expected = str(checksum).partition(":")
    if algorithm != CHECKSUM:
        raise BadBlockFile("unreadable", f"unknown checksum {algorithm!r}")
    digest = xxhash.xxh3_128(_canonical(header, description))
    digest.update(buf[start:])
    if digest.hexdigest() != expected:
        raise BadBlockFile("damaged", "checksum mismatch")
    meta = json.loads(description)
    if meta.get("format") != FORMAT:
        raise BadBlockFile("old_format", f"format {meta.get('format')!r}, not {FORMAT!r}")
    data = buf[start:]
    arrays = {}
    try:
        for name, t in header.items():
            dtype, shape = _NUMPY[t["dtype"]], tuple(t["shape"])
            begin, end = t["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64))
            if not 0 <= begin <= end <= len(data) or end - begin != count * dtype.itemsize:
                raise ValueError(f"{name}: offsets {begin}-{end} do not hold {shape} {t['dtype']}")
            a = mx.array(np.frombuffer(data, dtype=dtype, count=count, offset=begin).reshape(shape))
            arrays[name] = a.view(mx.bfloat16) if t["dtype"] == "BF16" else a
    except (KeyError, TypeError, ValueError) as e:  # a sound checksum over a table this code cannot read
        raise BadBlockFile("unreadable", f"tensor table: {e}") from None
    return arrays, meta


def peek_block(path: Path) -> dict:
    """A block file's description, read from its header only and NOT checked: enough to
    choose which file to read (a read checks everything). OSError or BadBlockFile."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if not 0 < n <= MAX_HEADER:
            raise BadBlockFile("unreadable", f"header length {n}")
        header, _ = _header(head + f.read(n))
    return json.loads(_description(header)[0])


# ---- a block's payload as named arrays plus a JSON description ----


def to_host(block) -> tuple[dict, dict]:
    """A block's arrays as numpy (bfloat16 as its uint16 bits) and its description."""
    arrays, layers = _encode_payload(block.payload)
    meta = {
        "format": FORMAT,
        "key": block.hash.hex(),
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


def decode_payload(arrays: dict, meta: dict) -> Payload:
    stacks = tuple(arrays[f"stack{n}"] for n in range(meta["stacks"]))
    stacked = [spec is not None and spec.get("stacked") for spec in meta["layers"]]
    payload = Payload(None if s else _decode_entry(spec, str(i), arrays)
                      for i, (spec, s) in enumerate(zip(meta["layers"], stacked)))
    like = [(KV((), ()) if spec["bits"] is None else QuantizedKV((), (), spec["group_size"], spec["bits"]))
            if s else None for spec, s in zip(meta["layers"], stacked)]
    return views(payload, stacks, tuple(meta["stack_layers"]), like)


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

"""Quantized KV caches that mlx-lm's BatchGenerator can batch.

mlx-lm 0.32 has `QuantizedKVCache` for one sequence but no batched
counterpart: `BatchGenerator` merges each layer's cache with `merge`, and
the quantized class has none. `BatchQuantizedKVCache` is `BatchKVCache`
with every key and value stored as mlx's (packed, scales, biases) triple.

Every token's K and V are quantized on arrival (no full-precision start), so
a run's cache holds the same values however the prompt was chunked, batched
or restored from blocks: quantized runs give the same tokens cached or not.

Attention runs one of two ways over those values:
- quantized: mlx-lm's (and mlx-vlm's) quantized attention, chosen by the
  cache's `bits`: quantized matmuls read the packed KV. Metal runs them well.
- dequantized: the cache hands attention `mx.dequantize` of its KV and hides
  `bits`, so the model runs its ordinary fused attention. MLX-CUDA 0.32 has no
  quantized matmul for one- or two-token inputs, and on the CPU they are 2-3x
  slower than BLAS on the dequantized values; the cost is one dequantize per
  layer and step, over the whole cache.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll, make_prompt_cache
from mlx_lm.models.cache import QuantizedKVCache as _MlxQuantizedKVCache

KV_BITS = (4, 8)
KV_ATTENTION = ("auto", "quantized", "dequantized")


def dequantized_attention(mode: str = "auto") -> bool:
    """Whether attention should read dequantized KV (see the module doc); "auto": everywhere but Metal."""
    if mode not in KV_ATTENTION:
        raise ValueError(f"kv attention must be one of {KV_ATTENTION}, not {mode!r}")
    if mode == "auto":
        return not (mx.default_device() == mx.gpu and mx.metal.is_available())
    return mode == "dequantized"


class _QuantizedKV:
    """What both quantized caches share: KV stored quantized, read as the attention mode wants."""

    attend_dequantized = False  # per cache; set by make_cache, restores and merges

    # mlx-lm and mlx-vlm run quantized attention for any cache with a `bits`
    # attribute (`hasattr(cache, "bits")`): a dequantizing cache must not have one.
    @property
    def bits(self):
        if self.attend_dequantized:
            raise AttributeError("a dequantizing cache hides `bits` from mlx-lm's attention; see kv_bits")
        return self.kv_bits

    @bits.setter
    def bits(self, value):
        self.kv_bits = value

    def _store(self, prev: int, keys, values) -> None:
        """Quantize `keys` and `values` into slots [prev, prev + n), growing the cache by whole steps."""
        batch, heads, n, k_dim = keys.shape
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            shape = (batch, heads, (self.step + n - 1) // self.step * self.step)
            new_k = _quantized_zeros(shape, k_dim, self.group_size, self.kv_bits, keys.dtype)
            new_v = _quantized_zeros(shape, values.shape[3], self.group_size, self.kv_bits, keys.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys, self.values = (
                    tuple(mx.concatenate([a[..., :prev, :], z], axis=2) for a, z in zip(old, new))
                    for old, new in ((self.keys, new_k), (self.values, new_v))
                )
        for parts, x in ((self.keys, keys), (self.values, values)):
            for a, q in zip(parts, mx.quantize(x, group_size=self.group_size, bits=self.kv_bits)):
                a[..., prev : prev + n, :] = q

    def _for_attention(self, keys, values):
        if not self.attend_dequantized:
            return keys, values
        return (mx.dequantize(*keys, group_size=self.group_size, bits=self.kv_bits),
                mx.dequantize(*values, group_size=self.group_size, bits=self.kv_bits))


class QuantizedKVCache(_QuantizedKV, _MlxQuantizedKVCache):
    """mlx-lm's single-sequence quantized cache, batchable, with either attention."""

    def update_and_fetch(self, keys, values):
        self._store(self.offset, keys, values)
        self.offset += keys.shape[2]
        return self._for_attention(*self.keys_and_values())

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.group_size, self.kv_bits

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.group_size, self.kv_bits = v

    def size(self):
        return self.offset

    def merge(self, caches):
        return BatchQuantizedKVCache.merge(caches)


def _quantized_zeros(shape, dim, group_size, bits, dtype):
    per_word = 32 // bits
    return (mx.zeros((*shape, dim // per_word), mx.uint32),
            mx.zeros((*shape, dim // group_size), dtype),
            mx.zeros((*shape, dim // group_size), dtype))


def _map(fn, parts):
    return tuple(fn(a) for a in parts)


class BatchQuantizedKVCache(_QuantizedKV, BatchKVCache):
    """`BatchKVCache` (left-padded rows) holding quantized keys and values."""

    def __init__(self, left_padding, group_size: int = 64, bits: int = 8, dequantize: bool = False):
        super().__init__(left_padding)
        self.group_size = group_size
        self.kv_bits = bits
        self.attend_dequantized = dequantize

    def update_and_fetch(self, keys, values):
        self._store(self._idx, keys, values)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self._for_attention(*self.keys_and_values())

    def keys_and_values(self):
        return (_map(lambda a: a[..., : self._idx, :], self.keys),
                _map(lambda a: a[..., : self._idx, :], self.values))

    def finalize(self):
        if self._right_padding is not None:
            shift = self._right_padding[:, None]
            self.keys = _map(lambda a: dynamic_roll(a, shift, axis=2), self.keys)
            self.values = _map(lambda a: dynamic_roll(a, shift, axis=2), self.values)
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys = _map(lambda a: a[batch_indices], self.keys)
            self.values = _map(lambda a: a[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())  # drop padding every row has
        if shift > 0:
            if self.keys is not None:
                self.keys = _map(lambda a: a[..., shift:, :], self.keys)
                self.values = _map(lambda a: a[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other

        def aligned(c):
            """c's parts right-aligned at `idx` and `size` slots long; its new left padding."""
            if c.keys is None:
                rows = c.offset.shape[0]
                empty = lambda parts: _map(lambda a: mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype), parts)
                k, v = empty(like.keys), empty(like.values)
            else:
                k, v = c.keys, c.values
            left = idx - c._idx
            right = size - k[0].shape[2] - left

            def fit(a):
                if right < 0:
                    a = a[..., :right, :]
                return mx.pad(a, [(0, 0), (0, 0), (left, max(right, 0)), (0, 0)])

            return _map(fit, k), _map(fit, v), c.left_padding + left

        (k1, v1, p1), (k2, v2, p2) = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate(pair) for pair in zip(k1, k2))
        self.values = tuple(mx.concatenate(pair) for pair in zip(v1, v2))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = idx

    def extract(self, idx):
        pad = self.left_padding.tolist()[idx]
        c = QuantizedKVCache(group_size=self.group_size, bits=self.kv_bits)
        c.attend_dequantized = self.attend_dequantized
        c.keys = _map(lambda a: mx.contiguous(a[idx : idx + 1, :, pad : self._idx]), self.keys)
        c.values = _map(lambda a: mx.contiguous(a[idx : idx + 1, :, pad : self._idx]), self.values)
        c.offset = self._idx - pad
        return c

    @classmethod
    def merge(cls, caches):
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        like = next((c for c in caches if c.keys is not None), None)
        if like is None:
            c = caches[0]
            return cls([0] * len(caches), c.group_size, c.kv_bits, c.attend_dequantized)
        padding = [longest - n for n in lengths]

        def merged(parts_of):
            out = []
            for j, a in enumerate(parts_of(like)):
                rows = mx.zeros((len(caches), a.shape[1], longest, a.shape[3]), a.dtype)
                for i, (p, c) in enumerate(zip(padding, caches)):
                    if c.keys is not None:
                        rows[i : i + 1, :, p:] = parts_of(c)[j][..., : c.offset, :]
                out.append(rows)
            return tuple(out)

        cache = cls(padding, like.group_size, like.kv_bits, like.attend_dequantized)
        cache.keys = merged(lambda c: c.keys)
        cache.values = merged(lambda c: c.values)
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self):
        return 0 if self.keys is None else sum(a.nbytes for a in (*self.keys, *self.values))


def make_cache(model, kv_bits: int | None = None, group_size: int = 64, dequantize: bool | None = None) -> list:
    """The model's fresh prompt cache; with `kv_bits`, its full-attention layers quantized,
    attended to dequantized or not (default: `dequantized_attention()`).

    Sliding-window and recurrent layers stay as they are: mlx-lm has no
    quantized form of them.
    """
    cache = make_prompt_cache(model)
    if kv_bits is None:
        return cache
    if kv_bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {KV_BITS}, not {kv_bits}")
    return set_dequantize([QuantizedKVCache(group_size, kv_bits) if type(c) is KVCache else c for c in cache],
                          dequantized_attention() if dequantize is None else dequantize)


def set_dequantize(cache: list, dequantize: bool) -> list:
    """Set how the quantized layers of a prompt cache (made or restored) are attended to."""
    for c in cache:
        if isinstance(c, _QuantizedKV):
            c.attend_dequantized = dequantize
    return cache


def check_kv_bits(model, kv_bits: int, group_size: int = 64, dequantize: bool | None = None) -> None:
    """Raise a clear ValueError if MLX cannot run this model with quantized KV here.

    Short forward passes find both kinds of failure: heads not divisible into
    quantization groups, and backend gaps (MLX-CUDA 0.32 has no quantized
    matmul for prompts of one or two tokens, so only dequantized attention runs there).
    """
    dequantize = dequantized_attention() if dequantize is None else dequantize
    if not any(isinstance(c, QuantizedKVCache) for c in make_cache(model, kv_bits, group_size)):
        raise ValueError(f"--kv-bits {kv_bits}: this model has no full-attention KV cache to quantize")
    for n in (1, 2, 16):
        try:
            mx.eval(model(mx.zeros((1, n), mx.int32), cache=make_cache(model, kv_bits, group_size, dequantize)))
        except (ValueError, RuntimeError) as e:
            how = "dequantized" if dequantize else "quantized"
            raise ValueError(f"--kv-bits {kv_bits}: MLX cannot run this model's {how} attention on "
                             f"{mx.default_device()} (a {n}-token prompt fails: {e})") from None

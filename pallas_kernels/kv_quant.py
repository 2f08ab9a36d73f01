"""Quantized KV pages (int8, fp8 e4m3, fp8 e5m2): one scale per token and KV head.

A quantized pool half is a `QuantizedPages` pytree in place of the page array:

  data:   [num_kv_heads, num_pages, page_size, head_dim]  int8 / float8_e4m3fn / float8_e5m2
  scales: [num_kv_heads, num_pages, page_size]            bfloat16

so everything that moves pages by index (copy-on-write copies, swap gathers and scatters,
sharding over KV heads) does the same to both leaves with jax.tree.map; `shape` and `dtype`
are the data's, so code reading a pool's geometry needs no change.

Why a scale per token and head (not per page and head): a token's K/V row is written once,
by one functional update inside the step, and its scale is then known from the row alone
(max |x| / the dtype's max); a page scale would grow as later tokens arrive and force the
page's earlier rows to be requantized. It is also the more accurate (docs/memory.md: SmolLM2
perplexity per token against per page). The bfloat16 scale costs 2 bytes per row of head_dim
bytes (3% at head_dim 64), which keeps fp8 at 1.94x the tokens of bfloat16 in equal memory.

Keys are rotated before they are quantized (key_rotation): q and k each times one orthonormal
Hadamard matrix over head_dim, after RoPE, which leaves every q . k (the attention logits)
unchanged. Where a few channels carry a large share of q . k, their rounding errors are
that share's; rotated, every channel carries an even share and the errors of head_dim
channels average out (tests/pallas_kernels/test_kv_quant.py: a large offset shared by 4 of
64 channels, rms logit error int8 0.49 -> 0.17, e4m3 2.41 -> 1.22). Measured on SmolLM2
(2,048 tokens, docs/memory.md), perplexity against the float32 cache: fp8 e4m3 +0.98% ->
-0.00%, int8 +0.22% -> -0.05%, fp8 e5m2 +1.66% -> +1.30%. Values are not rotated: rotating
them as well measured worse (e4m3 +0.28% against -0.00% for keys alone). The kernels see
rotated queries and keys and need no change.

Quantization: scale = bf16(amax / qmax); q = round-or-cast(clip(x / scale, -qmax, qmax))
(int8 rounds half to even; fp8 casts, which rounds to nearest). The clip is what saturates
a value that the rounded scale would push past qmax (fp8 e4m3 has no infinity: an
unclipped 449 would be NaN). A zero row has scale 0 and dequantizes to zeros. A row with a
NaN or infinity gets a NaN scale and dequantizes to NaN (the sequence's attention is NaN, as
an unquantized pool's would be); quantize_checked refuses it where values are concrete.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

SCALE_DTYPE = jnp.bfloat16

_STORAGE = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),  # vLLM's "fp8" is e4m3
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int8": np.dtype(np.int8),
}
QUANTIZED_DTYPES = (_STORAGE["int8"], _STORAGE["fp8_e4m3"], _STORAGE["fp8_e5m2"])


class QuantizedPages(NamedTuple):
    data: jax.Array  # [num_kv_heads, num_pages, page_size, head_dim], a QUANTIZED_DTYPES dtype
    scales: jax.Array  # bfloat16[num_kv_heads, num_pages, page_size]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype


def storage_dtype(kv_cache_dtype: str, activation_dtype) -> np.dtype:
    """The pages' element dtype for a --kv-cache-dtype ("auto": the activations')."""
    if kv_cache_dtype == "auto":
        return np.dtype(activation_dtype)
    if kv_cache_dtype not in _STORAGE:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected auto or one of "
            f"{', '.join(_STORAGE)}"
        )
    return _STORAGE[kv_cache_dtype]


def is_quantized(dtype) -> bool:
    return np.dtype(dtype) in QUANTIZED_DTYPES


def qmax(dtype) -> float:
    """The largest finite value of a quantized dtype (127, 448, 57344)."""
    dtype = np.dtype(dtype)
    if dtype == np.int8:
        return 127.0
    return float(ml_dtypes.finfo(dtype).max)


def bytes_per_token_row(dtype, head_dim: int) -> int:
    """Bytes of one token's K (or V) of one KV head: the row and, quantized, its scale."""
    dtype = np.dtype(dtype)
    scale = np.dtype(SCALE_DTYPE).itemsize if is_quantized(dtype) else 0
    return head_dim * dtype.itemsize + scale


def bytes_per_page(
    dtype, *, num_layers: int, num_kv_heads: int, page_size: int, head_dim: int
) -> int:
    """Bytes of one page of the pool: K and V of every layer and KV head, scales included."""
    return 2 * num_layers * num_kv_heads * page_size * bytes_per_token_row(dtype, head_dim)


@functools.cache
def key_rotation(head_dim: int) -> np.ndarray:
    """float32[head_dim, head_dim]: the orthonormal (Sylvester) Hadamard matrix, symmetric and
    its own inverse; block-diagonal with blocks of the largest power of two dividing head_dim
    when head_dim is not one (96: three 32 x 32 blocks; an odd head_dim: the identity)."""
    block = head_dim & -head_dim  # the largest power of two dividing head_dim
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    out = np.kron(np.eye(head_dim // block), h / np.sqrt(block)).astype(np.float32)
    out.flags.writeable = False
    return out


def rotate_keys(x: jax.Array) -> jax.Array:
    """x [..., D] (queries or keys, after RoPE) times key_rotation(D), in float32."""
    rotation = jnp.asarray(key_rotation(x.shape[-1]))
    return jnp.einsum(
        "...d,de->...e", x.astype(jnp.float32), rotation, precision=jax.lax.Precision.HIGHEST
    )


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (q [..., D] of dtype, bfloat16 scales [...]); see the module docstring."""
    xf = x.astype(jnp.float32)
    limit = qmax(dtype)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = (amax / limit).astype(SCALE_DTYPE)
    s = scale.astype(jnp.float32)[..., None]
    y = jnp.clip(xf / jnp.where(s > 0, s, 1.0), -limit, limit)
    if np.dtype(dtype) == np.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def quantize_checked(x, dtype) -> tuple[jax.Array, jax.Array]:
    """quantize of concrete values, refusing NaN and infinity (ValueError) instead of
    writing a page whose rows dequantize to NaN."""
    bad = ~np.isfinite(np.asarray(x, np.float32))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"refusing to write a non-finite K/V value ({np.asarray(x)[where]} at index "
            f"{where}) to a {np.dtype(dtype).name} KV page: its scale would be NaN"
        )
    return quantize(jnp.asarray(x), dtype)


def dequantize(q: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """q [..., D] and scales [...] -> q * scale [..., D] in dtype."""
    return (q.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


def zeros(shape: tuple[int, ...], dtype, xp=jnp) -> jax.Array | QuantizedPages:
    """A zero pool half [..., page_size, D] of dtype (QuantizedPages when quantized), made
    by xp (jnp, or np for the host swap space)."""
    if is_quantized(dtype):
        return QuantizedPages(xp.zeros(shape, dtype), xp.zeros(shape[:-1], SCALE_DTYPE))
    return xp.zeros(shape, dtype)


# XLA:CPU has no float8 or bfloat16 gather or scatter: its float normalization wraps each
# one in conversions of the whole operand to float16 and back, which for a pool array
# converts every layer's pages at each read and write (measured: SmolLM2 with fp8 pages at
# 20.0 tokens/s against int8's 92.8, docs/benchmarks.md). Pool arrays of those dtypes are moved as
# unsigned integers of the same width ("bits"); a bitcast between them changes no byte.
_BITS = {1: jnp.uint8, 2: jnp.uint16}


def _needs_bits(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype == np.dtype(ml_dtypes.bfloat16) or dtype in QUANTIZED_DTYPES[1:]


def _bits(a: jax.Array) -> jax.Array:
    if not _needs_bits(a.dtype):
        return a
    return jax.lax.bitcast_convert_type(a, _BITS[np.dtype(a.dtype).itemsize])


def _unbits(a: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype != np.dtype(dtype) else a


@jax.tree_util.register_pytree_node_class
class PoolBits:
    """A pool half held as bits inside one CPU step program (to_bits at its start, from_bits
    at its end): data and scales (None for an unquantized pool) as unsigned integers, dtype
    the data's own. take and write read and write it like the pool it stands for; copies by
    index (jax.tree.map over data and scales) are integer gathers and scatters. Bitcasting
    the whole pool once at each end of the step costs two copies of it, against float16
    round trips of the whole pool in every layer (docs/benchmarks.md, "KV cache dtype on the
    CPU", has the figures)."""

    def __init__(self, data: jax.Array, scales: jax.Array | None, dtype):
        self.data, self.scales, self.dtype = data, scales, np.dtype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def tree_flatten(self):
        return (self.data, self.scales), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(*children, dtype)


def to_bits(pages):
    """A pool half (array or QuantizedPages) as PoolBits when its dtype needs it, else as it
    is (float32 and int8 pages with no scales are gathered natively)."""
    if isinstance(pages, QuantizedPages):
        return PoolBits(_bits(pages.data), _bits(pages.scales), pages.dtype)
    if _needs_bits(pages.dtype):
        return PoolBits(_bits(pages), None, pages.dtype)
    return pages


def from_bits(pages):
    """to_bits' inverse."""
    if not isinstance(pages, PoolBits):
        return pages
    data = _unbits(pages.data, pages.dtype)
    if pages.scales is None:
        return data
    return QuantizedPages(data, _unbits(pages.scales, SCALE_DTYPE))


def write(pages, new: jax.Array, slots: jax.Array):
    """pages with new [T, H, D] written into flat slots int32[T] (page * page_size + offset),
    quantized when pages is QuantizedPages, else cast to the pages' dtype."""
    if isinstance(pages, PoolBits):
        if pages.scales is None:
            return PoolBits(
                _write(pages.data, _bits(new.astype(pages.dtype)), slots), None, pages.dtype
            )
        q, scale = quantize(new, pages.dtype)
        return PoolBits(
            _write(pages.data, _bits(q), slots),
            _write(pages.scales, _bits(scale), slots),
            pages.dtype,
        )
    if isinstance(pages, QuantizedPages):
        q, scale = quantize(new, pages.dtype)
        return QuantizedPages(_write(pages.data, q, slots), _write(pages.scales, scale, slots))
    return _write(pages, new.astype(pages.dtype), slots)


def _write(pages: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """new [T, H, ...] into the flat slots of pages [H, N, page_size, ...]."""
    hkv, num_pages, page_size, *rest = pages.shape
    flat = pages.reshape(hkv, num_pages * page_size, *rest)
    flat = flat.at[:, slots].set(jnp.swapaxes(new, 0, 1))
    return flat.reshape(pages.shape)


def take(pages, index) -> jax.Array:
    """pages[:, index] as float32 (dequantized): index any int array -> [H, *index.shape,
    page_size, D]. The gathered bytes are the stored dtype's; dequantization follows."""
    if isinstance(pages, PoolBits):
        data = _unbits(pages.data[:, index], pages.dtype)
        if pages.scales is None:
            return data.astype(jnp.float32)
        return dequantize(data, _unbits(pages.scales[:, index], SCALE_DTYPE))
    if isinstance(pages, QuantizedPages):
        return dequantize(pages.data[:, index], pages.scales[:, index])
    return pages[:, index].astype(jnp.float32)

"""Paged decode attention for GPU: a Pallas kernel lowered through Triton (flash-decoding).

Grid (batch, num_kv_heads, num_splits). One program holds the whole query-head group of one
KV head (padded to >= 16 rows so both dots use tensor cores), so each K/V byte is read once
per group. GPU lowerings have no scalar prefetch: the page-table row is an ordinary input,
and the program loops over its share of the *valid* pages only, `pages_per_block` pages per
iteration, gathering them straight from the pool:

    pages of seq b:  | blk 0 | blk 1 | blk 2 | blk 3 | blk 4 |..unused..|
    split 0 ---------^^^^^^^^^^^^^^^^^^^^^^^ (blocks 0-2)
    split 1 ---------------------------------^^^^^^^^^^^^^^^ (blocks 3-4)
    (the valid blocks are divided evenly among splits, per sequence, at run time)

Each split writes an unnormalised float32 partial (acc, running max m, running sum l); the
wrapper merges splits by their log-sum-exp. Masking never multiplies by garbage: logits past
the length become MASK_VALUE, their probabilities are zeroed and their V rows are zeroed,
so NaN in unused page slots cannot reach the output. Length 0 gives zeros. Attention sinks
(gpt-oss) join the denominators in that merge: the kernel is the same with or without them.

Quantized pages (kv_quant.QuantizedPages: int8 / fp8 codes and a bfloat16 scale per token)
are read as stored, 1 byte per element plus 2 per row: the program gathers the codes and
their scales with the same page ids and dequantizes after the load (common.load_gpu_block).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tuning
from pallas_kernels.common import (
    dot_f32,
    group_queries,
    load_gpu_block,
    merge_decode_splits,
    online_softmax_step,
    pad_page_table,
    split_pools,
    triton_call_kwargs,
)
from pallas_kernels.kv_quant import QuantizedPages
from pallas_kernels.reference import MASK_VALUE

# Pallas's Triton lowering computes a ref's element offsets in int64 when the whole array is
# over 2**32 bytes and in int32 otherwise (jax/_src/pallas/triton/lowering.py,
# _compute_offsets_from_indices, jax 0.10.2 and 0.11.2). int32 offsets reach 2**31 - 1, so an
# array of more than 2**31 elements in at most 2**32 bytes would wrap around: only 1-byte
# pools (int8 / fp8 codes) of 2-4 GiB per half. A larger pool, and every bfloat16 or float32
# pool, is addressed correctly (tests/pallas_kernels/test_sm90_compile.py reads the offsets'
# type in the lowered kernels). The pool holds every layer, so an accelerator's default pool
# is far past 4 GiB.
INT32_OFFSET_ELEMENTS = 2**31
INT64_OFFSET_BYTES = 2**32


def offsets_fit(shape, dtype) -> bool:
    """Whether the Triton lowering addresses every element of an array of this shape and
    dtype (see INT32_OFFSET_ELEMENTS)."""
    elements = math.prod(shape)
    nbytes = elements * np.dtype(dtype).itemsize
    return elements <= INT32_OFFSET_ELEMENTS or nbytes > INT64_OFFSET_BYTES


def supports(q_shape, k_shape, dtype) -> bool:
    """Shapes the Triton kernel takes: loaded tiles are powers of two, and every page of the
    pool has an offset that fits the lowering's offset type (offsets_fit; a quantized pool's
    bfloat16 scales, head_dim times fewer elements at 2 bytes, always fit). dtype: the pages'
    (a QuantizedPages' codes)."""
    _, num_q_heads, head_dim = q_shape
    num_kv_heads, _, page_size, _ = k_shape
    return (
        num_q_heads % num_kv_heads == 0
        and tuning.is_pow2(head_dim)
        and head_dim >= 16
        and tuning.is_pow2(page_size)
        and offsets_fit(k_shape, dtype)
    )


def _decode_kernel(
    lengths_ref,  # int32[1]: this sequence's length
    table_ref,  # int32[pages_per_seq_padded]: this sequence's page-table row
    q_ref,  # [rows, D]
    k_ref,  # [num_pages, page_size, D]: this KV head's pool (codes when quantized)
    v_ref,
    *refs,  # quantized: k, v scales [num_pages, page_size]; then acc f32[rows, D], m, l f32[rows]
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    num_splits: int,
):
    ks_ref, vs_ref = refs[:-3] or (None, None)
    acc_ref, m_ref, l_ref = refs[-3:]
    split = pl.program_id(2)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_tokens = pages_per_block * page_size

    length = lengths_ref[0]
    num_pages = (length + page_size - 1) // page_size
    if sliding_window is None:
        first_page = 0
        window_start = 0
    else:
        window_start = jnp.maximum(length - sliding_window, 0)
        first_page = window_start // page_size
    num_blocks = (num_pages - first_page + pages_per_block - 1) // pages_per_block
    per_split = (num_blocks + num_splits - 1) // num_splits
    blk_lo = jnp.minimum(split * per_split, num_blocks)
    blk_hi = jnp.minimum(blk_lo + per_split, num_blocks)

    q = q_ref[...]

    def body(blk, carry):
        page0 = first_page + blk * pages_per_block
        pages = table_ref[pl.ds(page0, pages_per_block)]
        pos = page0 * page_size + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        k, k_scale = load_gpu_block(k_ref, ks_ref, pages, dtype=q.dtype, written=pos < length)
        v, v_scale = load_gpu_block(v_ref, vs_ref, pages, dtype=q.dtype, written=pos < length)
        s = dot_f32(q, k, trans_b=True) * sm_scale
        if k_scale is not None:
            s = s * k_scale
        valid = (pos < length) & (pos >= window_start)
        pos_r = page0 * page_size + lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
        return online_softmax_step(
            s, valid, v, pos_r < length, carry, soft_cap=soft_cap, v_scale=v_scale
        )

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(blk_lo, blk_hi, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "blocks")
)
def paged_decode_attention(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array | QuantizedPages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array | QuantizedPages,
    lengths: jax.Array,  # int32[batch]
    page_table: jax.Array,  # int32[batch, pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    blocks: tuning.DecodeBlocks | None = None,
    sinks: jax.Array | None = None,  # [num_q_heads]: joins the denominators in the merge
) -> jax.Array:  # [batch, num_q_heads, head_dim], q's dtype
    """Decode attention with the Triton kernel; same contract as reference.paged_decode_attention.

    `blocks` overrides the tuning table (benchmarks and tests only). k_pages and v_pages
    may be kv_quant.QuantizedPages (both or neither); the result is then q's dtype too.
    """
    k_data, v_data, scales = split_pools(k_pages, v_pages)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    group = num_q_heads // num_kv_heads
    if blocks is None:
        blocks = tuning.gpu_decode_blocks(
            batch=batch, num_kv_heads=num_kv_heads, group=group, page_size=page_size,
            pages_per_seq=pages_per_seq, head_dim=head_dim, itemsize=k_pages.dtype.itemsize,
        )
    rows, ppb, splits = blocks.group_rows, blocks.pages_per_block, blocks.num_splits

    table = pad_page_table(page_table, pages_per_block=ppb, sliding_window=sliding_window)
    padded = table.shape[1]
    qg = group_queries(q, num_kv_heads, rows)
    lengths2 = lengths.astype(jnp.int32).reshape(batch, 1)

    kernel = functools.partial(
        _decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        pages_per_block=ppb, num_splits=splits,
    )
    pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, s: (h, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, num_pages, page_size), lambda b, h, s: (h, 0, 0))
    part = (batch, num_kv_heads, splits, rows)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, padded), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pool_spec,
            pool_spec,
        ] + [scale_spec] * len(scales),
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        interpret=interpret,
        name="jpaged_gpu_decode",
        **triton_call_kwargs(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
    )(lengths2, table, qg, k_data, v_data, *scales)

    return merge_decode_splits(acc, m, l, num_q_heads, q.dtype, sinks)

"""Paged decode attention for Hopper GPUs: a Pallas kernel lowered through Mosaic GPU.

The path off the deprecated Pallas Triton backend (jax 0.11 warns that it will be removed);
gpu_decode (Triton) stays the default until the H200 measures this one against it. Same
contract and the same flash-decoding plan as gpu_decode:

    grid (batch, num_kv_heads, num_splits); one warpgroup (128 threads) per program

    q [64, D] --TMA--> SMEM          (the query-head group, padded to the 64 rows of wgmma)
    page-table row, length --TMA--> SMEM (scalars are read there)
    for each block of `pages_per_block` valid pages of this split, two buffers deep:
        page by page --TMA--> K, V SMEM [block_tokens, D]   (next block's copies issued
                                                             before this block is computed)
        s = wgmma(q, K^T) * sm_scale                          [64, block_tokens] f32
        mask past the length / outside the window; online softmax (m, l)
        V rows past the length zeroed in SMEM (the last block only; unwritten slots may
        hold NaN and 0 * NaN would reach the output)
        acc = acc * alpha + wgmma(p, V)
    acc, m, l --TMA--> HBM; the wrapper merges the splits by log-sum-exp (common.merge_splits)

Each TMA copy arrives once on its buffer's barrier, so a K or V barrier expects
`pages_per_block` arrivals. wgmma takes 16-bit operands: bfloat16 and float16 only (float32
stays on the Triton kernel, see `supports`). Block sizes come from tuning.mosaic_decode_blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tuning
from pallas_kernels.common import group_queries, merge_decode_splits, pad_page_table
from pallas_kernels.reference import MASK_VALUE

ROWS = 64  # wgmma's M: the query-head group is padded to one warpgroup tile
# int32s per copied row of scalars: jax 0.10's Mosaic GPU copies whole multiples of 128 bytes
# (the warpgroup size) from GMEM to SMEM.
_SCALAR_ROW = 32


def supports(q_shape, k_shape, dtype) -> bool:
    """Shapes and dtypes the kernel takes: 16-bit operands (wgmma), head_dim a multiple of 64
    (128-byte swizzled tiles), pages of 8..128 tokens (a power of two), groups <= 64."""
    _, num_q_heads, head_dim = q_shape
    num_kv_heads, _, page_size, _ = k_shape
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= ROWS
        and head_dim % 64 == 0
        and head_dim <= 256
        and tuning.is_pow2(page_size)
        and 8 <= page_size <= 128
    )


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _interpret_params():
    """GPU interpret mode: simulates SMEM, TMA, barriers and wgmma on the CPU."""
    plgpu = _plgpu()
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:  # jax 0.10: not exported yet
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


def _kernel(
    lengths_ref,  # GMEM int32[batch, _SCALAR_ROW]: column 0 is the length
    table_ref,  # GMEM int32[batch, width]
    q_ref,  # GMEM [batch, num_kv_heads, ROWS, D]
    k_ref,  # GMEM [num_kv_heads, num_pages, page_size, D]
    v_ref,
    acc_ref,  # GMEM f32[batch, num_kv_heads, splits, ROWS, D]
    m_ref,  # GMEM f32[batch, num_kv_heads, splits, ROWS]
    l_ref,
    q_smem,
    len_smem,
    table_smem,
    k_smem,  # [2, block_tokens, D]
    v_smem,
    p_smem,  # [ROWS, block_tokens]
    acc_smem,
    m_smem,
    l_smem,
    in_barrier,
    k_barriers,
    v_barriers,
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    num_splits: int,
):
    plgpu = _plgpu()
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    split = lax.axis_index("split")
    page_size = k_ref.shape[2]
    head_dim = k_ref.shape[3]
    block_tokens = pages_per_block * page_size
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, in_barrier)
    plgpu.copy_gmem_to_smem(lengths_ref.at[b], len_smem, in_barrier)
    plgpu.copy_gmem_to_smem(table_ref.at[b], table_smem, in_barrier)
    plgpu.barrier_wait(in_barrier)

    length = len_smem[0]
    num_pages = (length + page_size - 1) // page_size
    if sliding_window is None:
        first_page = jnp.int32(0)
        window_start = jnp.int32(0)
    else:
        window_start = jnp.maximum(length - sliding_window, 0)
        first_page = window_start // page_size
    num_blocks = (num_pages - first_page + pages_per_block - 1) // pages_per_block
    per_split = (num_blocks + num_splits - 1) // num_splits
    blk_lo = jnp.minimum(split * per_split, num_blocks)
    blk_hi = jnp.minimum(blk_lo + per_split, num_blocks)

    def issue(blk, slot):
        """Starts the TMA copies of block blk's pages into buffer slot."""
        page0 = first_page + blk * pages_per_block
        for i in range(pages_per_block):
            page = table_smem[page0 + i]
            rows = pl.ds(i * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[h, page], k_smem.at[slot, rows],
                                    k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[h, page], v_smem.at[slot, rows],
                                    v_barriers.at[slot])

    @pl.when(blk_lo < blk_hi)
    def _():
        issue(blk_lo, 0)

    def body(blk, carry):
        acc, m, l = carry
        slot = lax.rem(blk - blk_lo, 2)

        @pl.when(blk + 1 < blk_hi)
        def _():  # the other buffer was last read by the previous block's (waited) wgmmas
            issue(blk + 1, 1 - slot)

        page0 = first_page + blk * pages_per_block
        plgpu.barrier_wait(k_barriers.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, block_tokens), jnp.float32)) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        pos = page0 * page_size + plgpu.broadcasted_iota(
            jnp.int32, (ROWS, block_tokens), 1, layout=wgmma_layout)
        valid = (pos < length) & (pos >= window_start)
        s = jnp.where(valid, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l_new = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        plgpu.barrier_wait(v_barriers.at[slot])
        tail = length - page0 * page_size  # valid rows of this block (all when >= tokens)

        @pl.when(tail < block_tokens)
        def _():  # unwritten slots may hold NaN: zero the rows past the length
            v = v_smem.at[slot][...]  # (plgpu.load with a layout: not in jax 0.10's interpreter)
            row = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=wgmma_layout)
            v_smem.at[slot][...] = jnp.where(row < tail, v, jnp.zeros_like(v))
            plgpu.commit_smem()

        # p goes through SMEM: jax's GPU interpreter runs wgmma with SMEM operands only.
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        # A fresh accumulator (not ACC.init(acc) under run_state): the GPU interpreter runs
        # this form too, at the cost of a second [64, D] f32 register tile.
        acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
        return acc, m_new, l_new

    acc = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), wgmma_layout)
    m = plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
    acc, m, l = lax.fori_loop(blk_lo, blk_hi, body, (acc, m, l))

    acc_smem[...] = acc
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(acc_smem, acc_ref.at[b, h, split])
    plgpu.copy_smem_to_gmem(m_smem, m_ref.at[b, h, split])
    plgpu.copy_smem_to_gmem(l_smem, l_ref.at[b, h, split])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "blocks")
)
def paged_decode_attention(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,
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
    """Decode attention with the Mosaic GPU kernel; contract of reference.paged_decode_attention.

    `interpret` runs it in Pallas's GPU interpreter (SMEM, TMA, barriers and wgmma simulated
    on the CPU). `blocks` overrides the tuning table (tests and benchmarks only).
    """
    plgpu = _plgpu()
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    if not supports(q.shape, k_pages.shape, k_pages.dtype):
        raise ValueError(f"unsupported by the Mosaic GPU decode kernel: q {q.shape}, "
                         f"pages {k_pages.shape} {k_pages.dtype}")
    if blocks is None:
        blocks = tuning.mosaic_decode_blocks(
            batch=batch, num_kv_heads=num_kv_heads, page_size=page_size,
            pages_per_seq=pages_per_seq,
        )
    ppb, splits = blocks.pages_per_block, blocks.num_splits
    block_tokens = ppb * page_size

    # Rows of scalars are copied whole: the table to a multiple of 128 bytes too.
    table = pad_page_table(page_table, pages_per_block=ppb, sliding_window=sliding_window,
                           multiple=_SCALAR_ROW)
    width = table.shape[1]
    lengths_rows = jnp.pad(lengths.astype(jnp.int32).reshape(batch, 1),
                           ((0, 0), (0, _SCALAR_ROW - 1)))
    qg = group_queries(q.astype(k_pages.dtype), num_kv_heads, ROWS)

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    dtype = k_pages.dtype
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        pages_per_block=ppb, num_splits=splits,
    )
    part = (batch, num_kv_heads, splits, ROWS)
    acc, m, l = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((ROWS, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((_SCALAR_ROW,), jnp.int32),
            plgpu.SMEM((width,), jnp.int32),
            plgpu.SMEM((2, block_tokens, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((2, block_tokens, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((ROWS, block_tokens), dtype, transforms=swizzled),
            plgpu.SMEM((ROWS, head_dim), jnp.float32),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.Barrier(num_arrivals=3),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=2),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=2),
        ),
        grid=(batch, num_kv_heads, splits),
        grid_names=("b", "h", "split"),
        interpret=_interpret_params() if interpret else None,
    )(lengths_rows, table, qg, k_pages, v_pages)

    return merge_decode_splits(acc, m, l, num_q_heads, q.dtype, sinks)


"""Ragged paged prefill attention for TPU: a Pallas Mosaic kernel with double-buffered DMAs.

Same ragged contract and row layout as gpu_prefill (see there and common.ragged_layout).
Grid (token_blocks, num_kv_heads), both parallel. Context lengths, query starts, the
flattened page table and each token block's sequence range [lo, hi) are scalar-prefetched
into SMEM; K/V stay in HBM. For each sequence meeting the token block the program streams
the KV pages its rows can see through two VMEM buffers (tpu_decode.PageBlockCopier: the
next block's DMAs start before the current block is computed; one semaphore per buffer and
per K/V). Every DMA started for a sequence is waited for before the next sequence starts,
so the buffers are free at each sequence boundary. Quantized pages (kv_quant.QuantizedPages)
are copied and read as in tpu_decode: codes and scale rows side by side, dequantized after
the wait.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tuning
from pallas_kernels.common import (
    any_memory_space,
    dot_f32,
    idiv,
    online_softmax_step,
    ragged_layout,
    sink_rows,
    split_pools,
    tpu_compiler_params,
    unlayout,
)
from pallas_kernels.gpu_prefill import seq_kv_range, visible
from pallas_kernels.kv_quant import QuantizedPages
from pallas_kernels.reference import MASK_VALUE
from pallas_kernels.tpu_decode import (
    PageBlockCopier,
    block_scratch,
    finish_rows,
    read_block,
    split_refs,
    supports,
)

__all__ = ["paged_prefill_attention", "supports"]


def _prefill_kernel(
    ctx_ref,  # SMEM int32[S]
    qs_ref,  # SMEM int32[S + 1]
    table_ref,  # SMEM int32[S * width]
    lo_ref,  # SMEM int32[token_blocks]
    hi_ref,  # SMEM int32[token_blocks]
    row_seq_ref,  # VMEM int32[R, 1]
    row_pos_ref,  # VMEM int32[R, 1]
    q_ref,  # VMEM [R, D]
    *refs,  # sinks VMEM f32[R, 1] (has_sinks); K, V ANY [Hkv, num_pages, page_size, D]
    #  (codes when quantized); quantized: k, v scales; o VMEM [R, D]; scratch as in
    #  tpu_decode._decode_kernel
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_q: int,
    pages_per_block: int,
    width: int,
    has_sinks: bool = False,
):
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    k_hbm, v_hbm, *refs = refs
    hbm, o_ref, bufs, sems = split_refs(k_hbm, v_hbm, refs)
    i, h = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    page_size = k_hbm.shape[2]
    block_tokens = pages_per_block * page_size
    t_lo = i * block_q
    t_hi = t_lo + block_q

    q = q_ref[...]
    row_seq = row_seq_ref[...]
    row_pos = row_pos_ref[...]

    def seq_body(s, carry):
        start, end = seq_kv_range(ctx_ref[s], qs_ref[s], qs_ref[s + 1], t_lo, t_hi,
                                  sliding_window=sliding_window)
        first_page = idiv(start, page_size)
        num_pages = idiv(end + page_size - 1, page_size)
        num_blocks = idiv(jnp.maximum(num_pages - first_page, 0) + pages_per_block - 1,
                          pages_per_block)
        copier = PageBlockCopier(
            list(zip(hbm, bufs)), sems, table_ref, head=h, table_base=s * width,
            first_page=first_page, num_valid_pages=num_pages,
            pages_per_block=pages_per_block, page_size=page_size,
        )

        @pl.when(num_blocks > 0)
        def _():
            copier.start(0, 0)

        def kv_body(blk, carry):
            slot = lax.rem(blk, 2)
            copier.wait(blk, slot)

            @pl.when(blk + 1 < num_blocks)
            def _():
                copier.start(blk + 1, 1 - slot)

            tok0 = (first_page + blk * pages_per_block) * page_size
            written = tok0 + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1) < end
            k, k_scale = read_block(bufs[0::2], slot, dtype=q.dtype, written=written)
            v, v_scale = read_block(bufs[1::2], slot, dtype=q.dtype, written=written)
            sc = dot_f32(q, k, trans_b=True) * sm_scale
            if k_scale is not None:
                sc = sc * k_scale
            kv_pos = tok0 + lax.broadcasted_iota(jnp.int32, (rows, block_tokens), 1)
            vis = visible(row_seq, row_pos, s, kv_pos, sliding_window=sliding_window)
            kv_row = tok0 + lax.broadcasted_iota(jnp.int32, (block_tokens, head_dim), 0)
            return online_softmax_step(sc, vis, v, kv_row < end, carry, soft_cap=soft_cap,
                                       keepdims=True, v_scale=v_scale)

        return lax.fori_loop(0, num_blocks, kv_body, carry)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )
    acc, m, l = lax.fori_loop(lo_ref[i], hi_ref[i], seq_body, init)
    o_ref[...] = finish_rows(acc, m, l, sink_ref).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "blocks")
)
def paged_prefill_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k_pages: jax.Array | QuantizedPages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array | QuantizedPages,
    context_lens: jax.Array,  # int32[num_seqs]
    page_table: jax.Array,  # int32[num_seqs, pages_per_seq]
    query_start: jax.Array,  # int32[num_seqs + 1]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret=False,
    blocks: tuning.PrefillBlocks | None = None,
    sinks: jax.Array | None = None,  # [num_q_heads]: gpt-oss's sink logits
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim], q's dtype
    """Ragged prefill with the Mosaic TPU kernel; contract of reference.paged_prefill_attention.

    `interpret` may be True or a pltpu InterpretParams (models DMAs and semaphores).
    k_pages and v_pages may be kv_quant.QuantizedPages (both or neither). sinks: one more
    input, each row's head's logit [R, 1] (the same for every token block), read when the
    rows are finished; None: the kernel as without them.
    """
    k_data, v_data, scales = split_pools(k_pages, v_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    _num_seqs, pages_per_seq = page_table.shape
    group = num_q_heads // num_kv_heads
    if blocks is None:
        blocks = tuning.tpu_prefill_blocks(
            num_tokens=num_tokens, group=group, page_size=page_size,
            pages_per_seq=pages_per_seq, head_dim=head_dim, itemsize=k_pages.dtype.itemsize,
        )
    gp, bq, ppb = blocks.group_rows, blocks.block_q, blocks.pages_per_block
    rows = bq * gp
    width = tuning.cdiv(pages_per_seq, ppb) * ppb + (ppb if sliding_window else 0)
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, width - pages_per_seq)))
    q_rows, row_seq, row_pos, blk_lo, blk_hi = ragged_layout(
        q, context_lens, query_start, num_kv_heads=num_kv_heads, group_rows=gp, block_q=bq
    )

    kernel = functools.partial(
        _prefill_kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        block_q=bq, pages_per_block=ppb, width=width, has_sinks=sinks is not None,
    )
    sink_inputs, sink_specs = [], []
    if sinks is not None:
        sink_inputs = [sink_rows(sinks, num_kv_heads, gp, repeat=bq)[..., None]]  # [Hkv, R, 1]
        sink_specs = [pl.BlockSpec((None, rows, 1), lambda i, h, *_: (h, 0, 0))]
    meta_spec = pl.BlockSpec((rows, 1), lambda i, h, *_: (i, 0))
    rows_spec = pl.BlockSpec((None, rows, head_dim), lambda i, h, *_: (h, i, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(blk_lo.shape[0], num_kv_heads),
            in_specs=[
                meta_spec,
                meta_spec,
                rows_spec,
                *sink_specs,
            ] + [pl.BlockSpec(memory_space=any_memory_space())] * (2 + len(scales)),
            out_specs=rows_spec,
            scratch_shapes=block_scratch(k_data, v_data, scales, ppb * page_size),
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=tpu_compiler_params(2),
        interpret=interpret,
        name="jpaged_tpu_prefill",
    )(
        context_lens.astype(jnp.int32), query_start.astype(jnp.int32), table.reshape(-1),
        blk_lo, blk_hi, row_seq[:, None], row_pos[:, None], q_rows, *sink_inputs, k_data,
        v_data, *scales,
    )
    return unlayout(out, num_tokens=num_tokens, group=group, group_rows=gp)

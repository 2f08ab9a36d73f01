"""Ragged paged prefill attention for GPU: a Pallas kernel lowered through Triton.

One call serves a mixed batch (prefill chunks, prefix-cache hits and decode tokens): the
queries of all sequences lie end to end, and sequence s owns rows
[query_start[s], query_start[s+1]), the last tokens of its context_lens[s] cached tokens.

Grid (token_blocks, num_kv_heads). A program holds `block_q` tokens x the padded query-head
group of one KV head as its rows (see common.ragged_layout). A token block can straddle
sequences, so the program loops over the sequences [block_lo, block_hi) that meet it, and
for each over the KV blocks that its rows can see (up to the last row's position; from the
window start with a sliding window). One set of running (acc, m, l) rows serves all those
sequences: a row's logits are masked unless the key belongs to the row's own sequence, so
another sequence's blocks leave the row unchanged (alpha = 1, p = 0).

Quantized pages (kv_quant.QuantizedPages) are gathered as stored, codes and their scales
with the same page ids, and dequantized after the load (common.load_gpu_block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tuning
from pallas_kernels.common import (
    dot_f32,
    finish,
    finish_with_sinks,
    load_gpu_block,
    online_softmax_step,
    ragged_layout,
    sink_rows,
    split_pools,
    triton_call_kwargs,
    unlayout,
)
from pallas_kernels.gpu_decode import supports  # same tile constraints
from pallas_kernels.kv_quant import QuantizedPages
from pallas_kernels.reference import MASK_VALUE

__all__ = ["paged_prefill_attention", "supports"]


def seq_kv_range(ctx, q0, q1, t_lo, t_hi, *, sliding_window):
    """KV token range [start, end) that sequence s's rows inside tokens [t_lo, t_hi) see."""
    end = jnp.where(q1 > q0, ctx - q1 + jnp.minimum(q1, t_hi), 0)
    if sliding_window is None:
        return 0, end
    first_pos = ctx - q1 + jnp.maximum(q0, t_lo)
    return jnp.maximum(first_pos - sliding_window + 1, 0), end


def visible(row_seq, row_pos, s, kv_pos, *, sliding_window):
    """Causal (and windowed) visibility of keys kv_pos [1, L] for rows [R, 1] of sequence s."""
    vis = (row_seq == s) & (kv_pos <= row_pos)
    if sliding_window is not None:
        vis = vis & (kv_pos > row_pos - sliding_window)
    return vis


def _prefill_kernel(
    ctx_ref,  # int32[S]
    qs_ref,  # int32[S + 1]
    table_ref,  # int32[S * width]: flattened padded page table
    lo_ref,  # int32[1]: first sequence meeting this token block
    hi_ref,  # int32[1]: one past the last
    row_seq_ref,  # int32[R]
    row_pos_ref,  # int32[R]
    q_ref,  # [R, D]
    *refs,  # sinks f32[R] (has_sinks); K, V [num_pages, page_size, D] (codes when
    #  quantized); quantized: k, v scales [num_pages, page_size]; then o [R, D]
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_q: int,
    pages_per_block: int,
    width: int,
    has_sinks: bool = False,
):
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    k_ref, v_ref, *refs = refs
    ks_ref, vs_ref = refs[:-1] or (None, None)
    o_ref = refs[-1]
    i = pl.program_id(0)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_tokens = pages_per_block * page_size
    t_lo = i * block_q
    t_hi = t_lo + block_q

    q = q_ref[...]
    row_seq = row_seq_ref[...][:, None]
    row_pos = row_pos_ref[...][:, None]

    def seq_body(s, carry):
        start, end = seq_kv_range(ctx_ref[s], qs_ref[s], qs_ref[s + 1], t_lo, t_hi,
                                  sliding_window=sliding_window)
        first_page = start // page_size
        num_pages = (end + page_size - 1) // page_size
        num_blocks = (jnp.maximum(num_pages - first_page, 0) + pages_per_block - 1) // (
            pages_per_block
        )

        def kv_body(blk, carry):
            page0 = first_page + blk * pages_per_block
            pages = table_ref[pl.ds(s * width + page0, pages_per_block)]
            kv_pos = page0 * page_size + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
            k, k_scale = load_gpu_block(k_ref, ks_ref, pages, dtype=q.dtype, written=kv_pos < end)
            v, v_scale = load_gpu_block(v_ref, vs_ref, pages, dtype=q.dtype, written=kv_pos < end)
            sc = dot_f32(q, k, trans_b=True) * sm_scale
            if k_scale is not None:
                sc = sc * k_scale
            vis = visible(row_seq, row_pos, s, kv_pos, sliding_window=sliding_window)
            kv_row = page0 * page_size + lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
            return online_softmax_step(sc, vis, v, kv_row < end, carry, soft_cap=soft_cap,
                                       v_scale=v_scale)

        return lax.fori_loop(0, num_blocks, kv_body, carry)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(lo_ref[0], hi_ref[0], seq_body, init)
    if sink_ref is None:
        o_ref[...] = finish(acc, l[:, None]).astype(o_ref.dtype)
    else:
        out = finish_with_sinks(acc, m[:, None], l[:, None], sink_ref[...][:, None])
        o_ref[...] = out.astype(o_ref.dtype)


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
    interpret: bool = False,
    blocks: tuning.PrefillBlocks | None = None,
    sinks: jax.Array | None = None,  # [num_q_heads]: gpt-oss's sink logits
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim], q's dtype
    """Ragged prefill with the Triton kernel; contract of reference.paged_prefill_attention.

    k_pages and v_pages may be kv_quant.QuantizedPages (both or neither). sinks: one more
    input, each row's head's logit (common.sink_rows), read when the rows are finished;
    None: the kernel as without them.
    """
    k_data, v_data, scales = split_pools(k_pages, v_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    group = num_q_heads // num_kv_heads
    if blocks is None:
        blocks = tuning.gpu_prefill_blocks(
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
    num_blocks = blk_lo.shape[0]

    def whole(n):
        return pl.BlockSpec((n,), lambda i, h: (0,))

    kernel = functools.partial(
        _prefill_kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        block_q=bq, pages_per_block=ppb, width=width, has_sinks=sinks is not None,
    )
    sink_inputs, sink_specs = [], []
    if sinks is not None:  # one block's rows per KV head: every token block has the same
        sink_inputs = [sink_rows(sinks, num_kv_heads, gp, repeat=bq)]  # [Hkv, rows]
        sink_specs = [pl.BlockSpec((None, rows), lambda i, h: (h, 0))]
    pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda i, h: (h, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, num_pages, page_size), lambda i, h: (h, 0, 0))
    rows_spec = pl.BlockSpec((None, rows, head_dim), lambda i, h: (h, i, 0))
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads),
        in_specs=[
            whole(num_seqs),
            whole(num_seqs + 1),
            whole(num_seqs * width),
            pl.BlockSpec((1,), lambda i, h: (i,)),
            pl.BlockSpec((1,), lambda i, h: (i,)),
            pl.BlockSpec((rows,), lambda i, h: (i,)),
            pl.BlockSpec((rows,), lambda i, h: (i,)),
            rows_spec,
            *sink_specs,
            pool_spec,
            pool_spec,
        ] + [scale_spec] * len(scales),
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        interpret=interpret,
        name="jpaged_gpu_prefill",
        **triton_call_kwargs(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
    )(
        context_lens.astype(jnp.int32), query_start.astype(jnp.int32), table.reshape(-1),
        blk_lo, blk_hi, row_seq, row_pos, q_rows, *sink_inputs, k_data, v_data, *scales,
    )
    return unlayout(out, num_tokens=num_tokens, group=group, group_rows=gp)

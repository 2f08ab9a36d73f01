"""Multi-head latent attention's ragged prefill on the paged pool, in the absorbed form.

The contract is reference.paged_prefill_attention(latent=True): the queries of all
sequences lie end to end (sequence s owns rows [query_start[s], query_start[s+1]), the last
tokens of its context_lens[s] cached tokens, causal within them), every query head attends
over the same latent rows [K half | V half] (2 * D values, mla.py's layout) and the output
is the attention-weighted rows [T, Hq, 2D]. A chunk starting mid-page or after a prefix hit
is the same call: the cached tokens are simply more keys.

Rows of a program: `block_q` tokens x `head_rows` query heads, token-major
(common.ragged_layout with the head blocks in the place of KV heads):

    q [T, Hq, 2D] -> heads padded to head_blocks * head_rows
                  -> q_rows [head_blocks, T_pad * head_rows, 2D]
    program (i, h): tokens [i * block_q, (i + 1) * block_q), heads [h * head_rows, ...)

Each program loops over the sequences meeting its token block and, for each, over the
pages its rows can see (gpu_prefill.seq_kv_range), with one running (acc, m, l) per row;
a row's logits are masked unless the key is its own sequence's and not after it.

GPU (Pallas Triton): the half rows are read as their power-of-two chunks (mla._chunks:
288 = 256 + 32), each chunk's product summed into the scores and each accumulated into its
own slice of the output, as in the latent decode kernel. TPU (Mosaic): the query comes in
as its two halves and leaves as two; each block of pages is copied by tpu_decode's
double-buffered DMAs (PageBlockCopier) into VMEM, both halves as one full-width tile.

Quantized pages (kv_quant.QuantizedPages, a scale per token and half row) are read as
stored and each half's scale applied to its scores and probabilities.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import mla, tuning
from pallas_kernels.common import (
    any_memory_space,
    finish,
    idiv,
    ragged_layout,
    split_pools,
    tpu_compiler_params,
    triton_call_kwargs,
    unlayout,
)
from pallas_kernels.gpu_prefill import seq_kv_range, visible
from pallas_kernels.reference import MASK_VALUE
from pallas_kernels.tpu_decode import PageBlockCopier, block_scratch, read_block

__all__ = [
    "LatentPrefillBlocks", "gpu_blocks", "gpu_paged_prefill_attention", "tpu_blocks",
    "tpu_paged_prefill_attention",
]  # fmt: skip

# Query rows (tokens x heads) one GPU program holds: the latent row is wide (576 values for
# DeepSeek-V3), so the float32 accumulator of 16 rows is already 36 KiB of registers.
GPU_ROWS = 16
# Tokens of one GPU loop iteration (whole pages), as the latent decode kernel.
GPU_BLOCK_TOKENS = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentPrefillBlocks:
    head_rows: int  # query heads per program (a power of two)
    block_q: int  # query tokens per program (rows = block_q * head_rows)
    pages_per_block: int  # pages read per loop iteration
    num_warps: int = 8  # GPU only: 4 spilled registers at DeepSeek-V3's shape (sm_90 compile)

    def __post_init__(self):
        for name in ("head_rows", "block_q", "pages_per_block", "num_warps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def gpu_blocks(*, num_tokens: int, num_q_heads: int, page_size: int,
               pages_per_seq: int) -> LatentPrefillBlocks:  # fmt: skip
    """GPU_ROWS rows: up to 16 heads, the rest tokens (Triton's dots need >= 16 rows)."""
    head_rows = min(GPU_ROWS, tuning.next_pow2(num_q_heads))
    block_q = GPU_ROWS // head_rows
    del num_tokens  # a block of 16 rows pads at most 15 tokens
    ppb = max(1, min(tuning.next_pow2(pages_per_seq), GPU_BLOCK_TOKENS // page_size))
    return LatentPrefillBlocks(head_rows=head_rows, block_q=block_q, pages_per_block=ppb)


def tpu_blocks(*, num_tokens: int, num_q_heads: int, page_size: int,
               pages_per_seq: int) -> LatentPrefillBlocks:  # fmt: skip
    """About 128 rows (the MXU's), a multiple of 8 (a VMEM tile's sublanes)."""
    head_rows = min(128, tuning.next_pow2(num_q_heads))
    block_q = min(max(1, 128 // head_rows), max(8, tuning.next_pow2(num_tokens)))
    block_q = max(block_q, tuning.cdiv(8, head_rows))
    ppb = tuning.next_pow2(max(1, 128 // page_size))
    ppb = max(1, min(ppb, tuning.next_pow2(pages_per_seq)))
    return LatentPrefillBlocks(head_rows=head_rows, block_q=block_q, pages_per_block=ppb)


def _layout(q, context_lens, query_start, blocks: LatentPrefillBlocks):
    """ragged_layout over head blocks (module docstring): (q_rows [Hb, T_pad * hr, 2D],
    row_seq, row_pos, block_lo, block_hi, head_blocks)."""
    num_q_heads = q.shape[1]
    hr = blocks.head_rows
    head_blocks = tuning.cdiv(num_q_heads, hr)
    qp = jnp.pad(q, ((0, 0), (0, head_blocks * hr - num_q_heads), (0, 0)))
    out = ragged_layout(qp, context_lens, query_start, num_kv_heads=head_blocks, group_rows=hr,
                        block_q=blocks.block_q)  # fmt: skip
    return (*out, head_blocks)


def _unlayout(out, *, num_tokens: int, num_q_heads: int, head_rows: int):
    """[Hb, T_pad * hr, 2D] -> [T, Hq, 2D]."""
    rows = unlayout(out, num_tokens=num_tokens, group=head_rows, group_rows=head_rows)
    return rows[:, :num_q_heads]


def _padded_table(page_table, *, pages_per_block: int, sliding_window):
    width = tuning.cdiv(page_table.shape[1], pages_per_block) * pages_per_block
    width += pages_per_block if sliding_window else 0
    return jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, width - page_table.shape[1])))


def _setup(kernel_fn, pick_blocks, q, context_lens, page_table, query_start, page_size, *,
           blocks, sm_scale, soft_cap, sliding_window):  # fmt: skip
    """Both wrappers' set-up: the blocks (pick_blocks' unless given), the page table padded
    to whole blocks of pages, the kernel with its static arguments bound, and the query
    rows' layout (_layout's tuple)."""
    if blocks is None:
        blocks = pick_blocks(num_tokens=q.shape[0], num_q_heads=q.shape[1], page_size=page_size,
                             pages_per_seq=page_table.shape[1])  # fmt: skip
    ppb = blocks.pages_per_block
    table = _padded_table(page_table, pages_per_block=ppb, sliding_window=sliding_window)
    kernel = functools.partial(
        kernel_fn, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        block_q=blocks.block_q, pages_per_block=ppb, width=table.shape[1],
    )  # fmt: skip
    return blocks, table, kernel, _layout(q, context_lens, query_start, blocks)


def _gpu_kernel(ctx_ref, qs_ref, table_ref, lo_ref, hi_ref, row_seq_ref, row_pos_ref, q_ref,
                k_ref, v_ref, *refs, sm_scale, soft_cap, sliding_window, block_q,
                pages_per_block, width):  # fmt: skip
    """One (token block, head block): q_ref [R, 2D]; k_ref, v_ref [num_pages, page_size, D]
    (codes when quantized, then their scales [num_pages, page_size]); out [R, 2D]."""
    ks_ref, vs_ref = refs[:-1] or (None, None)
    o_ref = refs[-1]
    i = pl.program_id(0)
    rows = q_ref.shape[0]
    _, page_size, d = k_ref.shape
    chunks = mla._chunks(d)
    block_tokens = pages_per_block * page_size
    t_lo = i * block_q
    halves = ((k_ref, ks_ref, 0), (v_ref, vs_ref, d))
    qs = [q_ref[:, pl.ds(base + off, w)] for _, _, base in halves for off, w in chunks]
    row_seq = row_seq_ref[...][:, None]
    row_pos = row_pos_ref[...][:, None]

    def seq_body(s, carry):
        start, end = seq_kv_range(ctx_ref[s], qs_ref[s], qs_ref[s + 1], t_lo, t_lo + block_q,
                                  sliding_window=sliding_window)  # fmt: skip
        first_page = start // page_size
        num_pages = (end + page_size - 1) // page_size
        num_blocks = (jnp.maximum(num_pages - first_page, 0) + pages_per_block - 1) // (
            pages_per_block
        )

        def kv_body(blk, carry):
            page0 = first_page + blk * pages_per_block
            pages = table_ref[pl.ds(s * width + page0, pages_per_block)]
            kv_pos = page0 * page_size + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
            vis = visible(row_seq, row_pos, s, kv_pos, sliding_window=sliding_window)
            kv_row = page0 * page_size + lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
            return mla.gpu_latent_block(qs, halves, chunks, pages, kv_pos < end, vis,
                                        kv_row < end, carry, sm_scale=sm_scale,
                                        soft_cap=soft_cap, dtype=q_ref.dtype)  # fmt: skip

        return lax.fori_loop(0, num_blocks, kv_body, carry)

    init = (
        tuple(jnp.zeros((rows, w), jnp.float32) for _ in halves for _, w in chunks),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    accs, _, l = lax.fori_loop(lo_ref[0], hi_ref[0], seq_body, init)
    j = 0
    for _, _, base in halves:
        for off, w in chunks:
            o_ref[:, pl.ds(base + off, w)] = finish(accs[j], l[:, None]).astype(o_ref.dtype)
            j += 1


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "blocks")
)
def gpu_paged_prefill_attention(q, k_pages, v_pages, context_lens, page_table, query_start, *,
                                sm_scale: float, soft_cap=None, sliding_window=None,
                                interpret: bool = False,
                                blocks: LatentPrefillBlocks | None = None):  # fmt: skip
    """paged_prefill_attention's contract with the Triton kernel (module docstring)."""
    k_data, v_data, scales = split_pools(k_pages, v_pages)
    num_tokens, num_q_heads, width2 = q.shape
    _, num_pages, page_size, d = k_data.shape
    num_seqs = page_table.shape[0]
    blocks, table, kernel, layout = _setup(
        _gpu_kernel, gpu_blocks, q, context_lens, page_table, query_start, page_size,
        blocks=blocks, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )  # fmt: skip
    q_rows, row_seq, row_pos, blk_lo, blk_hi, head_blocks = layout
    hr = blocks.head_rows
    rows = blocks.block_q * hr

    def whole(n):
        return pl.BlockSpec((n,), lambda i, h: (0,))

    pool_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda i, h: (0, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, num_pages, page_size), lambda i, h: (0, 0, 0))
    rows_spec = pl.BlockSpec((None, rows, width2), lambda i, h: (h, i, 0))
    out = pl.pallas_call(
        kernel,
        grid=(blk_lo.shape[0], head_blocks),
        in_specs=[
            whole(num_seqs),
            whole(num_seqs + 1),
            whole(table.size),
            pl.BlockSpec((1,), lambda i, h: (i,)),
            pl.BlockSpec((1,), lambda i, h: (i,)),
            pl.BlockSpec((rows,), lambda i, h: (i,)),
            pl.BlockSpec((rows,), lambda i, h: (i,)),
            rows_spec,
            pool_spec,
            pool_spec,
        ] + [scale_spec] * len(scales),
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        interpret=interpret,
        name="jpaged_gpu_mla_prefill",
        **triton_call_kwargs(num_warps=blocks.num_warps, num_stages=2),
    )(
        context_lens.astype(jnp.int32), query_start.astype(jnp.int32), table.reshape(-1),
        blk_lo, blk_hi, row_seq, row_pos, q_rows, k_data, v_data, *scales,
    )  # fmt: skip
    return _unlayout(out, num_tokens=num_tokens, num_q_heads=num_q_heads, head_rows=hr)


def _tpu_kernel(ctx_ref, qs_ref, table_ref, lo_ref, hi_ref, row_seq_ref, row_pos_ref, qk_ref,
                qv_ref, k_hbm, v_hbm, *refs, sm_scale, soft_cap, sliding_window, block_q,
                pages_per_block, width):  # fmt: skip
    """One (token block, head block) on TPU: SMEM ctx, query starts, flat table, block
    sequence ranges; VMEM row_seq, row_pos [R, 1], qk_ref, qv_ref [R, D] the queries'
    halves; K, V halves in HBM [1, num_pages, page_size, D] (then, quantized, their scales);
    outputs ok_ref, ov_ref [R, D]; scratch as tpu_decode.block_scratch."""
    num_scales = (len(refs) - 5) // 2
    hbm = [k_hbm, v_hbm, *refs[:num_scales]]
    ok_ref, ov_ref = refs[num_scales: num_scales + 2]
    bufs, sems = list(refs[num_scales + 2: -1]), refs[-1]
    if not num_scales:
        bufs += [None, None]
    i = pl.program_id(0)
    rows, d = qk_ref.shape
    page_size = k_hbm.shape[2]
    block_tokens = pages_per_block * page_size
    t_lo = i * block_q
    qk, qv = qk_ref[...], qv_ref[...]
    row_seq, row_pos = row_seq_ref[...], row_pos_ref[...]

    def seq_body(s, carry):
        start, end = seq_kv_range(ctx_ref[s], qs_ref[s], qs_ref[s + 1], t_lo, t_lo + block_q,
                                  sliding_window=sliding_window)  # fmt: skip
        first_page = idiv(start, page_size)
        num_pages = idiv(end + page_size - 1, page_size)
        num_blocks = idiv(jnp.maximum(num_pages - first_page, 0) + pages_per_block - 1,
                          pages_per_block)  # fmt: skip
        copier = PageBlockCopier(
            list(zip(hbm, bufs)), sems, table_ref, head=0, table_base=s * width,
            first_page=first_page, num_valid_pages=num_pages,
            pages_per_block=pages_per_block, page_size=page_size,
        )  # fmt: skip

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
            k_block = read_block(bufs[0::2], slot, dtype=qk.dtype, written=written)
            v_block = read_block(bufs[1::2], slot, dtype=qk.dtype, written=written)

            def mask_of(kv_pos):
                return visible(row_seq, row_pos, s, kv_pos, sliding_window=sliding_window)

            return mla.tpu_latent_step(carry, qk, qv, k_block, v_block, tok0, end, mask_of,
                                       sm_scale=sm_scale, soft_cap=soft_cap)  # fmt: skip

        return lax.fori_loop(0, num_blocks, kv_body, carry)

    init = (
        jnp.zeros((rows, d), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )
    acc_k, acc_v, _, l = lax.fori_loop(lo_ref[i], hi_ref[i], seq_body, init)
    ok_ref[...] = finish(acc_k, l).astype(ok_ref.dtype)
    ov_ref[...] = finish(acc_v, l).astype(ov_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "blocks")
)
def tpu_paged_prefill_attention(q, k_pages, v_pages, context_lens, page_table, query_start, *,
                                sm_scale: float, soft_cap=None, sliding_window=None,
                                interpret=False,
                                blocks: LatentPrefillBlocks | None = None):  # fmt: skip
    """paged_prefill_attention's contract with the Mosaic TPU kernel (module docstring).
    `interpret` may be True or a pltpu InterpretParams (models DMAs and semaphores)."""
    k_data, v_data, scales = split_pools(k_pages, v_pages)
    num_tokens, num_q_heads, width2 = q.shape
    d = width2 // 2
    page_size = k_data.shape[2]
    blocks, table, kernel, layout = _setup(
        _tpu_kernel, tpu_blocks, q, context_lens, page_table, query_start, page_size,
        blocks=blocks, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )  # fmt: skip
    q_rows, row_seq, row_pos, blk_lo, blk_hi, head_blocks = layout
    hr, ppb = blocks.head_rows, blocks.pages_per_block
    rows = blocks.block_q * hr
    meta_spec = pl.BlockSpec((rows, 1), lambda i, h, *_: (i, 0))
    half_spec = pl.BlockSpec((None, rows, d), lambda i, h, *_: (h, i, 0))
    out_k, out_v = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(blk_lo.shape[0], head_blocks),
            in_specs=[meta_spec, meta_spec, half_spec, half_spec]
            + [pl.BlockSpec(memory_space=any_memory_space())] * (2 + len(scales)),
            out_specs=[half_spec, half_spec],
            scratch_shapes=block_scratch(k_data, v_data, scales, ppb * page_size),
        ),
        out_shape=[jax.ShapeDtypeStruct((head_blocks, q_rows.shape[1], d), q.dtype)] * 2,
        compiler_params=tpu_compiler_params(2),
        interpret=interpret,
        name="jpaged_tpu_mla_prefill",
    )(
        context_lens.astype(jnp.int32), query_start.astype(jnp.int32), table.reshape(-1),
        blk_lo, blk_hi, row_seq[:, None], row_pos[:, None], q_rows[..., :d], q_rows[..., d:],
        k_data, v_data, *scales,
    )  # fmt: skip
    out = jnp.concatenate([out_k, out_v], axis=-1)
    return _unlayout(out, num_tokens=num_tokens, num_q_heads=num_q_heads, head_rows=hr)


"""Paged decode attention for TPU: a Pallas Mosaic kernel with double-buffered page DMAs.

Grid (batch, num_kv_heads), both parallel. Lengths and the (flattened) page table are
scalar-prefetched into SMEM; K/V stay in HBM (memory space ANY). Each program walks only
the valid pages of its sequence, `pages_per_block` pages per block, copying each page by
async DMA into one of two VMEM buffers; the next block's copies are started before the
current block is computed:

    iter i:   wait(buf i%2)  ->  start(block i+1 -> buf (i+1)%2)  ->  compute(buf i%2)

Every (buffer, K/V) pair has its own DMA semaphore, so a wait can never be satisfied by
another buffer's copy. Pages past the length are not copied; the rows they would fill are
masked (logits, probabilities and V rows), so stale or NaN VMEM never reaches the output.
The page table is flattened to 1-D because SMEM pads 2-D arrays heavily.

Quantized pages (kv_quant.QuantizedPages) are copied as stored: each page's codes into the
data buffer and its bfloat16 scales [1, page_size] into a scale buffer [2, 1, block_tokens]
beside it, each copy with its own semaphore. After the wait the codes are converted to q's
dtype and the scales, a lane row, multiply the logits' and probabilities' columns
(common.token_scales), so no lane-to-sublane relayout is needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_quant, tuning
from pallas_kernels.common import (
    any_memory_space,
    dot_f32,
    finish,
    finish_with_sinks,
    group_queries,
    idiv,
    online_softmax_step,
    pad_page_table,
    sink_rows,
    split_pools,
    token_scales,
    tpu_compiler_params,
    ungroup,
)
from pallas_kernels.reference import MASK_VALUE


def supports(q_shape, k_shape) -> bool:
    _, num_q_heads, _head_dim = q_shape
    num_kv_heads, _, page_size, _ = k_shape
    return num_q_heads % num_kv_heads == 0 and page_size % 8 == 0


class PageBlockCopier:
    """Starts and waits for the DMAs of one block of pages into one VMEM buffer slot.

    pools: (HBM source, VMEM buffer) pairs, copied page by page with semaphore i of the slot
    for pair i: data [Hkv, num_pages, page_size, D] into [2, block_tokens, D], and (quantized
    pages) scales [Hkv, num_pages, page_size] into [2, 1, block_tokens].
    Only pages with index < num_valid_pages are copied (a loop with a dynamic trip count,
    the same on start and wait, so the semaphore counts always balance).
    """

    def __init__(self, pools, sems, table_ref, *, head, table_base, first_page,
                 num_valid_pages, pages_per_block, page_size):
        self.pools, self.sems, self.table_ref, self.head = pools, sems, table_ref, head
        self.table_base, self.first_page = table_base, first_page
        self.num_valid_pages = num_valid_pages
        self.pages_per_block, self.page_size = pages_per_block, page_size

    def _each(self, blk, slot, fn):
        block_first = self.first_page + blk * self.pages_per_block
        count = jnp.clip(self.num_valid_pages - block_first, 0, self.pages_per_block)

        def one_page(j, _):
            page = self.table_ref[self.table_base + block_first + j]
            dst = pl.ds(pl.multiple_of(j * self.page_size, self.page_size), self.page_size)
            for i, (src, buf) in enumerate(self.pools):
                if len(src.shape) == 4:  # a page's rows [page_size, D]
                    src_page, dst_page = src.at[self.head, page], buf.at[slot, dst]
                else:  # its scales as a lane row [1, page_size]
                    src_page = src.at[self.head, pl.ds(page, 1)]
                    dst_page = buf.at[slot, :, dst]
                fn(pltpu.make_async_copy(src_page, dst_page, self.sems.at[slot, i]))
            return 0

        lax.fori_loop(0, count, one_page, 0)

    def start(self, blk, slot):
        self._each(blk, slot, lambda c: c.start())

    def wait(self, blk, slot):
        self._each(blk, slot, lambda c: c.wait())


def block_scratch(k_data, v_data, scales, block_tokens: int) -> list:
    """VMEM scratch for a PageBlockCopier: two slots of K and V (and their scale rows when
    quantized), and a DMA semaphore per slot and per copied pool."""
    head_dim = k_data.shape[-1]
    bufs = [pltpu.VMEM((2, block_tokens, head_dim), x.dtype) for x in (k_data, v_data)]
    bufs += [pltpu.VMEM((2, 1, block_tokens), kv_quant.SCALE_DTYPE) for _ in scales]
    return [*bufs, pltpu.SemaphoreType.DMA((2, len(bufs)))]


def walk_blocks(hbm, bufs, sems, table_ref, *, head, table_base, length, page_size: int,
                pages_per_block: int, sliding_window: int | None, dtype, step, init):  # fmt: skip
    """The double-buffered loop over one sequence's valid blocks of pages (the module
    docstring's order: wait for this block's copies, start the next block's, compute),
    shared by this module's kernel and the latent one (pallas_kernels/mla.py).

    hbm, bufs, sems: split_refs' pools, buffers and semaphores; the sequence's pages are
    table_ref[table_base:], of KV head `head`, its tokens [0, length), the window's last
    sliding_window of them. step(carry, tok0, window_start, k, v) -> carry runs on each block
    after its wait: tok0 the block's first token, k and v read_block's (rows [L, D] in
    dtype where quantized, scales f32[1, L] or None). Returns the last carry (init when the
    sequence has no block: length 0)."""
    block_tokens = pages_per_block * page_size
    num_pages = idiv(length + page_size - 1, page_size)
    window_start = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    first_page = idiv(window_start, page_size)
    num_blocks = idiv(num_pages - first_page + pages_per_block - 1, pages_per_block)
    copier = PageBlockCopier(
        list(zip(hbm, bufs)), sems, table_ref, head=head, table_base=table_base,
        first_page=first_page, num_valid_pages=num_pages, pages_per_block=pages_per_block,
        page_size=page_size,
    )  # fmt: skip

    @pl.when(num_blocks > 0)
    def _():
        copier.start(0, 0)

    def body(blk, carry):
        slot = lax.rem(blk, 2)
        copier.wait(blk, slot)

        @pl.when(blk + 1 < num_blocks)
        def _():
            copier.start(blk + 1, 1 - slot)

        tok0 = (first_page + blk * pages_per_block) * page_size
        written = tok0 + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1) < length
        k = read_block(bufs[0::2], slot, dtype=dtype, written=written)
        v = read_block(bufs[1::2], slot, dtype=dtype, written=written)
        return step(carry, tok0, window_start, k, v)

    return lax.fori_loop(0, num_blocks, body, init)


def read_block(bufs, slot, *, dtype, written):
    """The (K or V) block in buffer slot after its wait: x [L, D] and its per-token scales
    f32[1, L] (None for plain pages). bufs: (data buffer, scale buffer or None)."""
    data_buf, scale_buf = bufs
    x = data_buf[slot]
    if scale_buf is None:
        return x, None
    return x.astype(dtype), token_scales(scale_buf[slot], written)


def split_refs(k_hbm, v_hbm, refs):
    """A kernel's refs after K and V: (HBM pools, output, VMEM buffers, semaphores).

    Pools and buffers come as [k, v] or, quantized, [k, v, k scales, v scales]; bufs[0::2]
    is then (K data, K scales) and bufs[1::2] (V data, V scales), with None for plain pages.
    """
    num_scales = (len(refs) - 4) // 2  # 0, or 2 (scales in, scale buffers in scratch)
    hbm = [k_hbm, v_hbm, *refs[:num_scales]]
    o_ref = refs[num_scales]
    bufs = list(refs[num_scales + 1: -1])
    sems = refs[-1]
    if not num_scales:
        bufs += [None, None]
    return hbm, o_ref, bufs, sems


def _decode_kernel(
    lengths_ref,  # SMEM int32[batch]
    table_ref,  # SMEM int32[batch * pages_per_seq_padded]
    q_ref,  # VMEM [rows, D]
    *refs,  # sinks VMEM f32[rows, 1] (has_sinks); K, V ANY [Hkv, num_pages, page_size, D]
    #  (codes when quantized); quantized: k, v scales ANY [Hkv, num_pages, page_size]; o
    #  VMEM [rows, D]; scratch (block_scratch): k_buf, v_buf VMEM [2, block_tokens, D],
    #  (quantized) their scale buffers [2, 1, block_tokens], DMA semaphores [2 slots, one
    #  per pool]
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    table_width: int,
    has_sinks: bool = False,
):
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    k_hbm, v_hbm, *refs = refs
    hbm, o_ref, bufs, sems = split_refs(k_hbm, v_hbm, refs)
    b, h = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    page_size = k_hbm.shape[2]
    block_tokens = pages_per_block * page_size
    length = lengths_ref[b]
    q = q_ref[...]

    def step(carry, tok0, window_start, k_block, v_block):
        (k, k_scale), (v, v_scale) = k_block, v_block
        s = dot_f32(q, k, trans_b=True) * sm_scale
        if k_scale is not None:
            s = s * k_scale
        pos = tok0 + lax.broadcasted_iota(jnp.int32, (rows, block_tokens), 1)
        valid = (pos < length) & (pos >= window_start)
        pos_r = tok0 + lax.broadcasted_iota(jnp.int32, (block_tokens, head_dim), 0)
        return online_softmax_step(s, valid, v, pos_r < length, carry, soft_cap=soft_cap,
                                   keepdims=True, v_scale=v_scale)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )
    acc, m, l = walk_blocks(
        hbm, bufs, sems, table_ref, head=h, table_base=b * table_width, length=length,
        page_size=page_size, pages_per_block=pages_per_block, sliding_window=sliding_window,
        dtype=q.dtype, step=step, init=init,
    )  # fmt: skip
    o_ref[...] = finish_rows(acc, m, l, sink_ref).astype(o_ref.dtype)


def finish_rows(acc, m, l, sink_ref):
    """The TPU kernels' output rows: acc / l (common.finish), or with each row's sink
    (sink_ref VMEM f32[R, 1]) joining its denominator (common.finish_with_sinks)."""
    if sink_ref is None:
        return finish(acc, l)
    return finish_with_sinks(acc, m, l, sink_ref[...])


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "blocks")
)
def paged_decode_attention(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array | kv_quant.QuantizedPages,  # [num_kv_heads, num_pages, page_size, D]
    v_pages: jax.Array | kv_quant.QuantizedPages,
    lengths: jax.Array,  # int32[batch]
    page_table: jax.Array,  # int32[batch, pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret=False,
    blocks: tuning.DecodeBlocks | None = None,
    sinks: jax.Array | None = None,  # [num_q_heads]: gpt-oss's sink logits
) -> jax.Array:  # [batch, num_q_heads, head_dim], q's dtype
    """Decode attention with the Mosaic TPU kernel; contract of reference.paged_decode_attention.

    `interpret` may be True (Pallas HLO interpreter) or a pltpu InterpretParams (TPU
    interpreter that models DMAs and semaphores and can detect races). k_pages and v_pages
    may be kv_quant.QuantizedPages (both or neither). sinks: one more input, each KV head's
    group's logits [rows, 1] read when the rows are finished; None: the kernel as without.
    """
    k_data, v_data, scales = split_pools(k_pages, v_pages)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    group = num_q_heads // num_kv_heads
    if blocks is None:
        blocks = tuning.tpu_decode_blocks(
            batch=batch, num_kv_heads=num_kv_heads, group=group, page_size=page_size,
            pages_per_seq=pages_per_seq, head_dim=head_dim, itemsize=k_pages.dtype.itemsize,
        )
    rows, ppb = blocks.group_rows, blocks.pages_per_block
    block_tokens = ppb * page_size
    table = pad_page_table(page_table, pages_per_block=ppb, sliding_window=sliding_window)
    width = table.shape[1]
    qg = group_queries(q, num_kv_heads, rows)

    kernel = functools.partial(
        _decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        pages_per_block=ppb, table_width=width, has_sinks=sinks is not None,
    )
    qo_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, *_: (b, h, 0, 0))
    sink_inputs, sink_specs = [], []
    if sinks is not None:
        sink_inputs = [sink_rows(sinks, num_kv_heads, rows)[..., None]]  # [Hkv, rows, 1]
        sink_specs = [pl.BlockSpec((None, rows, 1), lambda b, h, *_: (h, 0, 0))]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_kv_heads),
            in_specs=[qo_spec, *sink_specs]
            + [pl.BlockSpec(memory_space=any_memory_space())] * (2 + len(scales)),
            out_specs=qo_spec,
            scratch_shapes=block_scratch(k_data, v_data, scales, block_tokens),
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=tpu_compiler_params(2),
        interpret=interpret,
        name="jpaged_tpu_decode",
    )(lengths.astype(jnp.int32), table.reshape(-1), qg, *sink_inputs, k_data, v_data, *scales)
    return ungroup(out, num_q_heads)

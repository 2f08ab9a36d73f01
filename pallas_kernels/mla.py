"""Multi-head latent attention's decode on the paged pool (models/mla.py's layout).

Each token's key and value are one row [latent | rotary key] of 2 * D values (D = head_dim),
its first half in k_pages and its second in v_pages ([1, num_pages, page_size, D] each, plain
or kv_quant.QuantizedPages with a scale per half row); every query head attends over the
same rows:

    score(h, s) = q[h, :D] . K[s] * k_scale[s] + q[h, D:] . V[s] * v_scale[s]
    out[h]      = sum_s p(h, s) [K[s] | V[s]]                          [Hq, 2D]

GPU (Pallas Triton): one program per (sequence, block of query heads), looping over the
sequence's valid pages a block at a time. Triton loads power-of-two tiles only, and DeepSeek's
half row is 288 = 256 + 32, so each half is read as its power-of-two chunks (_chunks), every
chunk's product summed into the scores and accumulated into its own slice of the output:

    half row (D = 288):  [ chunk 0: 256 values          | chunk 1: 32 ]
    scores:              q[:, 0:256] . K0  +  q[:, 256:288] . K1  +  (the same over V)

TPU (Pallas Mosaic): tpu_decode's double-buffered page DMAs (PageBlockCopier) copy each
page's two halves into VMEM as they copy K and V; the query comes in as its two halves and
the output leaves as two, so no operand is sliced at a lane offset (288 is not a multiple
of 128), and each half is one full-width tile.

The reference (reference.py, latent=True) serves the CPU and any shape a kernel refuses
(pallas_kernels/__init__.py dispatches: select_backend(latent=True), supports_gpu / supports_tpu).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import gpu_decode, tpu_decode, tuning
from pallas_kernels.common import (
    any_memory_space,
    dot_f32,
    finish,
    pad_page_table,
    split_pools,
    token_scales,
    tpu_compiler_params,
    triton_call_kwargs,
)
from pallas_kernels.reference import MASK_VALUE

# Query heads one GPU program holds (padded to at least 16 rows for the tensor-core dots).
HEAD_ROWS = 16
# Tokens of one loop iteration (whole pages).
BLOCK_TOKENS = 32
# Warps of a GPU program: with 4 the kernel spilled 36 registers at DeepSeek-V3's shape on
# sm_90 (255 per thread); with 8 it needs 168 and spills none (test_sm90_compile.py).
NUM_WARPS = 8


def _chunks(d: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) of d's power-of-two parts, largest first: 288 -> (0, 256), (256, 32)."""
    out, off = [], 0
    for bit in reversed(range(d.bit_length())):
        if d >> bit & 1:
            out.append((off, 1 << bit))
            off += 1 << bit
    return tuple(out)


def supports_gpu(q_shape, k_shape, dtype) -> bool:
    """Shapes the Triton latent kernel takes: one KV head, a half row of power-of-two chunks
    of at least 16 (a multiple of 16), a power-of-two page size, offsets that fit."""
    num_kv_heads, _, page_size, head_dim = k_shape
    return (
        num_kv_heads == 1
        and q_shape[-1] == 2 * head_dim
        and head_dim % 16 == 0
        and tuning.is_pow2(page_size)
        and gpu_decode.offsets_fit(k_shape, dtype)
    )


def supports_tpu(k_shape) -> bool:
    """Shapes the Mosaic latent kernel takes: one KV head, pages of a multiple of 8 tokens."""
    return k_shape[0] == 1 and k_shape[2] % 8 == 0


def gpu_latent_block(qs, halves, chunks, pages, written, valid, row_ok, carry, *, sm_scale,
                     soft_cap, dtype):  # fmt: skip
    """One online-softmax step of the GPU latent kernels (decode here, mla_prefill's) over a
    block of pages: each half row read as its power-of-two chunks, their products summed
    into the scores, each chunk accumulated into its own slice of the output.

    qs: the queries' chunks [R, w] in halves x chunks order; halves: ((pool ref, scale ref or
    None), ...) for K and V, refs [num_pages, page_size, D]; pages int32[P]; written bool[1, L]
    (slots holding a token); valid bool[R, L] or [1, L] (keys each row sees); row_ok bool[L, 1]
    (rows to read as values, the others zeroed); carry (accs, m f32[R], l f32[R])."""
    accs, m, l = carry
    rows, block_tokens = qs[0].shape[0], written.shape[1]
    xs, scales, s = [], [], jnp.zeros((rows, block_tokens), jnp.float32)
    for ref, sref, *_ in halves:
        part = jnp.zeros((rows, block_tokens), jnp.float32)
        scale = None if sref is None else token_scales(
            sref[pages].reshape(1, block_tokens), written)  # fmt: skip
        for off, w in chunks:
            x = ref[pages, :, pl.ds(off, w)].reshape(block_tokens, w)
            if sref is not None:
                x = x.astype(dtype)
            part += dot_f32(qs[len(xs)], x, trans_b=True)
            xs.append(x)
            scales.append(scale)
        s += part if scale is None else part * scale
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1)
    new = []
    for acc, x, scale in zip(accs, xs, scales, strict=True):
        x = jnp.where(row_ok, x, jnp.zeros_like(x))
        pv = p if scale is None else p * scale
        new.append(acc * alpha[:, None] + dot_f32(pv.astype(x.dtype), x))
    return tuple(new), m_new, l_new


def _latent_kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, *refs, sm_scale, soft_cap,
                   sliding_window, pages_per_block):  # fmt: skip
    """One (sequence, head block): q_ref [rows, 2D]; k_ref, v_ref [num_pages, page_size, D]
    (codes when quantized, then their scales [num_pages, page_size]); out [rows, 2D]."""
    ks_ref, vs_ref = refs[:-1] or (None, None)
    out_ref = refs[-1]
    rows = q_ref.shape[0]
    _, page_size, d = k_ref.shape
    chunks = _chunks(d)
    block_tokens = pages_per_block * page_size
    length = lengths_ref[0]
    num_pages = (length + page_size - 1) // page_size
    window_start = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    first_page = window_start // page_size
    num_blocks = (num_pages - first_page + pages_per_block - 1) // pages_per_block
    halves = ((k_ref, ks_ref, 0), (v_ref, vs_ref, d))
    qs = [q_ref[:, pl.ds(base + off, w)] for _, _, base in halves for off, w in chunks]

    def body(blk, carry):
        page0 = first_page + blk * pages_per_block
        pages = table_ref[pl.ds(page0, pages_per_block)]
        pos = page0 * page_size + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        written = pos < length
        row_ok = (page0 * page_size + lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)) < length
        return gpu_latent_block(qs, halves, chunks, pages, written, written & (pos >= window_start),
                                row_ok, carry, sm_scale=sm_scale, soft_cap=soft_cap,
                                dtype=q_ref.dtype)  # fmt: skip

    init = (
        tuple(jnp.zeros((rows, w), jnp.float32) for _ in halves for _, w in chunks),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    accs, _, l = lax.fori_loop(0, num_blocks, body, init)
    i = 0
    for _, _, base in halves:
        for off, w in chunks:
            out_ref[:, pl.ds(base + off, w)] = finish(accs[i], l[:, None]).astype(out_ref.dtype)
            i += 1


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret"))
def gpu_paged_decode_attention(q, k_pages, v_pages, lengths, page_table, *, sm_scale: float,
                               soft_cap=None, sliding_window=None, interpret: bool = False):  # fmt: skip
    """paged_decode_attention's contract with the Triton kernel (module docstring)."""
    k_data, v_data, scales = split_pools(k_pages, v_pages)
    batch, num_q_heads, width = q.shape
    _, num_pages, page_size, d = k_data.shape
    rows = HEAD_ROWS
    head_blocks = -(-num_q_heads // rows)
    ppb = max(1, min(page_table.shape[1], BLOCK_TOKENS // page_size))
    table = pad_page_table(page_table, pages_per_block=ppb, sliding_window=sliding_window)
    qp = jnp.pad(q, ((0, 0), (0, head_blocks * rows - num_q_heads), (0, 0)))
    qp = qp.reshape(batch, head_blocks, rows, width)
    kernel = functools.partial(_latent_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_block=ppb)  # fmt: skip
    pool_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda b, h: (0, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, num_pages, page_size), lambda b, h: (0, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(batch, head_blocks),
        in_specs=[
            pl.BlockSpec((None, 1), lambda b, h: (b, 0)),
            pl.BlockSpec((None, table.shape[1]), lambda b, h: (b, 0)),
            pl.BlockSpec((None, None, rows, width), lambda b, h: (b, h, 0, 0)),
            pool_spec,
            pool_spec,
        ] + [scale_spec] * len(scales),
        out_specs=pl.BlockSpec((None, None, rows, width), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, head_blocks, rows, width), q.dtype),
        interpret=interpret,
        name="jpaged_gpu_mla_decode",
        **triton_call_kwargs(num_warps=NUM_WARPS, num_stages=2),
    )(lengths.astype(jnp.int32).reshape(batch, 1), table, qp, k_data, v_data, *scales)
    return out.reshape(batch, head_blocks * rows, width)[:, :num_q_heads]


def tpu_latent_step(carry, qk, qv, k_block, v_block, tok0, end, mask_of, *, sm_scale,
                    soft_cap):  # fmt: skip
    """One block of latent keys for a TPU kernel's rows (decode's and mla_prefill's): qk, qv
    [rows, D] the queries' halves, k_block, v_block (data [T, D], scale or None) from
    tpu_decode.read_block, the block's first token position tok0 and the sequence's end;
    mask_of(kv positions int32 [rows, T]) -> which the rows see. Returns the carry
    (acc_k, acc_v [rows, D], m, l [rows, 1]) after the online softmax over the block."""
    acc_k, acc_v, m, l = carry
    (k, k_scale), (v, v_scale) = k_block, v_block
    rows, (block_tokens, d) = qk.shape[0], k.shape
    sk, sv = dot_f32(qk, k, trans_b=True), dot_f32(qv, v, trans_b=True)
    if k_scale is not None:
        sk, sv = sk * k_scale, sv * v_scale
    s = (sk + sv) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    valid = mask_of(tok0 + lax.broadcasted_iota(jnp.int32, (rows, block_tokens), 1))
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    row_ok = tok0 + lax.broadcasted_iota(jnp.int32, (block_tokens, d), 0) < end
    out = []
    for acc, x, scale in ((acc_k, k, k_scale), (acc_v, v, v_scale)):
        x = jnp.where(row_ok, x, jnp.zeros_like(x))
        pv = p if scale is None else p * scale
        out.append(acc * alpha + dot_f32(pv.astype(x.dtype), x))
    return out[0], out[1], m_new, l_new


def _tpu_latent_kernel(lengths_ref, table_ref, qk_ref, qv_ref, k_hbm, v_hbm, *refs, sm_scale,
                       soft_cap, sliding_window, pages_per_block, table_width):  # fmt: skip
    """One (sequence, head block) on TPU: qk_ref, qv_ref [rows, D] the queries' halves; K, V
    halves in HBM [1, num_pages, page_size, D] (then, quantized, their scales); outputs
    ok_ref, ov_ref [rows, D]; scratch as tpu_decode.block_scratch."""
    num_scales = (len(refs) - 5) // 2
    hbm = [k_hbm, v_hbm, *refs[:num_scales]]
    ok_ref, ov_ref = refs[num_scales : num_scales + 2]
    bufs, sems = list(refs[num_scales + 2 : -1]), refs[-1]
    if not num_scales:
        bufs += [None, None]
    b = pl.program_id(0)
    rows, d = qk_ref.shape
    page_size = k_hbm.shape[2]
    length = lengths_ref[b]
    qk, qv = qk_ref[...], qv_ref[...]

    def step(carry, tok0, window_start, k_block, v_block):
        def mask_of(pos):
            return (pos < length) & (pos >= window_start)

        return tpu_latent_step(carry, qk, qv, k_block, v_block, tok0, length, mask_of,
                               sm_scale=sm_scale, soft_cap=soft_cap)  # fmt: skip

    init = (
        jnp.zeros((rows, d), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )
    acc_k, acc_v, _, l = tpu_decode.walk_blocks(
        hbm, bufs, sems, table_ref, head=0, table_base=b * table_width, length=length,
        page_size=page_size, pages_per_block=pages_per_block, sliding_window=sliding_window,
        dtype=qk.dtype, step=step, init=init,
    )  # fmt: skip
    ok_ref[...] = finish(acc_k, l).astype(ok_ref.dtype)
    ov_ref[...] = finish(acc_v, l).astype(ov_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret"))
def tpu_paged_decode_attention(q, k_pages, v_pages, lengths, page_table, *, sm_scale: float,
                               soft_cap=None, sliding_window=None, interpret=False):  # fmt: skip
    """paged_decode_attention's contract with the Mosaic TPU kernel (module docstring)."""
    k_data, v_data, scales = split_pools(k_pages, v_pages)
    batch, num_q_heads, width = q.shape
    d = width // 2
    page_size = k_data.shape[2]
    rows = min(128, -(-num_q_heads // 8) * 8)
    head_blocks = -(-num_q_heads // rows)
    ppb = tuning.tpu_decode_blocks(
        batch=batch, num_kv_heads=1, group=num_q_heads, page_size=page_size,
        pages_per_seq=page_table.shape[1], head_dim=d, itemsize=k_data.dtype.itemsize,
    ).pages_per_block  # fmt: skip
    table = pad_page_table(page_table, pages_per_block=ppb, sliding_window=sliding_window)
    qp = jnp.pad(q, ((0, 0), (0, head_blocks * rows - num_q_heads), (0, 0)))
    qp = qp.reshape(batch, head_blocks, rows, width)
    kernel = functools.partial(
        _tpu_latent_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, pages_per_block=ppb, table_width=table.shape[1],
    )  # fmt: skip
    half_spec = pl.BlockSpec((None, None, rows, d), lambda b, h, *_: (b, h, 0, 0))
    out_k, out_v = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, head_blocks),
            in_specs=[half_spec, half_spec]
            + [pl.BlockSpec(memory_space=any_memory_space())] * (2 + len(scales)),
            out_specs=[half_spec, half_spec],
            scratch_shapes=tpu_decode.block_scratch(k_data, v_data, scales, ppb * page_size),
        ),
        out_shape=[jax.ShapeDtypeStruct((batch, head_blocks, rows, d), q.dtype)] * 2,
        compiler_params=tpu_compiler_params(2),
        interpret=interpret,
        name="jpaged_tpu_mla_decode",
    )(lengths.astype(jnp.int32), table.reshape(-1), qp[..., :d], qp[..., d:], k_data, v_data,
      *scales)  # fmt: skip
    out = jnp.concatenate([out_k, out_v], axis=-1).reshape(batch, head_blocks * rows, width)
    return out[:, :num_q_heads]


"""Pieces shared by the Pallas kernels: the online-softmax step, the split merge, reading
quantized pages, and the few API names that differ between the jax versions we support
(0.10.x here, 0.11.x on GPUs).

Everything here is traceable inside a kernel body (Triton or Mosaic) or in plain jnp.
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import kv_quant
from pallas_kernels.reference import MASK_VALUE


def idiv(a, b):
    """a // b for non-negative int32 scalars, as truncating division.

    jnp's floor division emits a `sign` op that Mosaic TPU lowers only when it can query a
    real TPU, so the TPU kernels use this instead (and lowering works on a CPU host).
    """
    return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def dot_f32(a, b, *, trans_b: bool = False):
    """a @ b (or a @ b.T), accumulated in float32.

    Float32 operands are multiplied at full precision: at the default precision Triton
    rounds them to TF32 (`inputPrecision = tf32`, 10 mantissa bits) and Mosaic TPU to bf16
    passes, far outside the 2e-5 the float32 kernels are held to. bf16 operands keep the
    default (native bf16 tensor-core / MXU dots, float32 accumulation).
    """
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def online_softmax_step(s, valid, v, v_valid, carry, *, soft_cap, keepdims=False,
                        v_scale=None):
    """One flash-attention step over a KV block.

    Args:
      s: f32[R, L] scaled logits; valid: bool[R, L] (or broadcastable) visible keys.
      v: [L, D] values; v_valid: bool[L, 1] (or [L, D]) rows that hold written tokens.
      carry: (acc f32[R, D], m, l) with m, l f32[R] (or [R, 1] when keepdims).
      v_scale: f32[1, L], quantized V only (token_scales): each row's scale, applied to the
        probabilities, since p @ (scale * v) = (p * scale) @ v.
    Masked logits become MASK_VALUE and their probabilities exactly 0; unwritten V rows are
    zeroed so 0 * NaN cannot happen.
    """
    acc, m, l = carry
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=keepdims))
    alpha = jnp.exp(m - m_new)
    m_b = m_new if keepdims else m_new[:, None]
    p = jnp.where(valid, jnp.exp(s - m_b), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=keepdims)
    v = jnp.where(v_valid, v, jnp.zeros_like(v))
    alpha_b = alpha if keepdims else alpha[:, None]
    pv = p if v_scale is None else p * v_scale
    acc = acc * alpha_b + dot_f32(pv.astype(v.dtype), v)
    return acc, m_new, l_new


# --- quantized pages (kv_quant.QuantizedPages) inside the kernels ---------------------------
#
# A kernel loads a block of stored codes (int8 / fp8) and their bfloat16 scales with the same
# page indexing, then converts the codes to the compute dtype (q's: float32 or bfloat16; both
# hold every int8, e4m3 and e5m2 value exactly) and applies each token's scale to its column
# of the logits (q @ (s * k)^T = (q @ k^T) * s) and of the probabilities (see
# online_softmax_step): the same products as dequantizing the tile, with R x L multiplies
# instead of L x D, and a scale row [1, L] that needs no relayout on TPU.


def split_pools(k_pages, v_pages):
    """(k data, v data, [k scales, v scales]) for a kernel call: QuantizedPages are passed as
    their two leaves, plain pages as they are. K and V must both be quantized or both not."""
    quantized = isinstance(k_pages, kv_quant.QuantizedPages)
    if quantized != isinstance(v_pages, kv_quant.QuantizedPages):
        raise ValueError("k_pages and v_pages must both be QuantizedPages or both plain arrays, "
                         f"got {type(k_pages).__name__} and {type(v_pages).__name__}")
    if quantized:
        return k_pages.data, v_pages.data, [k_pages.scales, v_pages.scales]
    return k_pages, v_pages, []


def token_scales(scales, written):
    """Per-token scales [1, L] (bfloat16 as stored) -> float32, 0 where no token is written:
    an unwritten slot's stored scale may be NaN, and p * NaN is NaN even where p is 0."""
    return jnp.where(written, scales.astype(jnp.float32), 0.0)


def load_gpu_block(data_ref, scale_ref, pages, *, dtype, written):
    """One block of pages gathered from a GPU pool ref [num_pages, page_size, D].

    pages int32[P]; written bool[1, P * page_size]: slots holding a token. Returns x [L, D]
    (in dtype when quantized, else as stored) and its per-token scales f32[1, L], None for
    plain pages (scale_ref None)."""
    _, page_size, head_dim = data_ref.shape
    block_tokens = pages.shape[0] * page_size
    x = data_ref[pages].reshape(block_tokens, head_dim)
    if scale_ref is None:
        return x, None
    scales = scale_ref[pages].reshape(1, block_tokens)
    return x.astype(dtype), token_scales(scales, written)


def finish(acc, l):
    """acc / l, with rows that saw no key (l == 0) set to exactly zero. l broadcasts to acc."""
    return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)


def finish_with_sinks(acc, m, l, sinks):
    """acc / l with a sink logit per row joining the denominator (gpt-oss; reference._finish):
    acc e^(m - m') / (l e^(m - m') + e^(sink - m')), m' = max(m, sink). m, l and sinks
    broadcast to acc; a row that saw no key (acc and l 0, m MASK_VALUE) gives zeros."""
    m_new = jnp.maximum(m, sinks)
    scale = jnp.exp(m - m_new)
    return acc * scale / (l * scale + jnp.exp(sinks - m_new))


def sink_rows(sinks, num_kv_heads: int, group_rows: int, repeat: int = 1):
    """float32 [Hkv, group_rows * repeat]: each KV head's query heads' sinks in the kernels'
    row order (its group zero-padded to group_rows rows, repeated for each token of a
    prefill block, ragged_layout's rows)."""
    sg = sinks.astype(jnp.float32).reshape(num_kv_heads, -1)
    sg = jnp.pad(sg, ((0, 0), (0, group_rows - sg.shape[1])))
    return jnp.tile(sg, (1, repeat))


def merge_splits(acc, m, l, sinks=None):
    """Log-sum-exp merge over axis 0 of split partials: acc [S, ..., D]; m, l [S, ...];
    sinks (optional) broadcast to m[0]: finish_with_sinks."""
    m_max = jnp.max(m, axis=0)
    w = jnp.exp(m - m_max[None])
    l_tot = jnp.sum(w * l, axis=0)
    o = jnp.sum(w[..., None] * acc, axis=0)
    if sinks is not None:
        return finish_with_sinks(o, m_max[..., None], l_tot[..., None], sinks[..., None])
    return finish(o, l_tot[..., None])


# --- decode wrappers (plain jnp, outside the kernels) ---------------------------------------


def pad_page_table(page_table, *, pages_per_block: int, sliding_window, multiple: int = 1):
    """int32 table whose rows a block's page slice never leaves: whole blocks, plus one when a
    window start may be unaligned, rounded up to `multiple` columns. Padding points at the
    null page 0, whose tokens are masked anyway."""
    pages_per_seq = page_table.shape[1]
    width = -(-pages_per_seq // pages_per_block) * pages_per_block
    width += pages_per_block if sliding_window else 0
    width = -(-width // multiple) * multiple
    return jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, width - pages_per_seq)))


def group_queries(q, num_kv_heads: int, rows: int):
    """q [B, Hq, D] -> [B, Hkv, rows, D]: each KV head's query group, zero-padded to rows."""
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))


def ungroup(out, num_q_heads: int):
    """Inverse of group_queries: [B, Hkv, rows, D] -> [B, Hq, D] (padding rows dropped)."""
    batch, num_kv_heads, _, head_dim = out.shape
    group = num_q_heads // num_kv_heads
    return out[:, :, :group].reshape(batch, num_q_heads, head_dim)


def merge_decode_splits(acc, m, l, num_q_heads: int, dtype, sinks=None):
    """Split partials acc [B, Hkv, S, rows, D], m, l [B, Hkv, S, rows] -> [B, Hq, D] in dtype;
    sinks: float32[Hq] or None, joining each head's denominator here (the kernel's partials
    are the same with or without them)."""
    if sinks is not None:
        sinks = sink_rows(sinks, acc.shape[1], acc.shape[3])  # [Hkv, rows]
    out = merge_splits(jnp.moveaxis(acc, 2, 0), jnp.moveaxis(m, 2, 0), jnp.moveaxis(l, 2, 0),
                       sinks)  # fmt: skip
    return ungroup(out, num_q_heads).astype(dtype)


# --- names that moved between jax versions -------------------------------------------------


def any_memory_space():
    """HBM-resident operand (no automatic copy): pl.ANY on new jax, pltpu.ANY before."""
    if hasattr(pl, "ANY"):
        return pl.ANY
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.ANY


def tpu_compiler_params(num_grid_dims: int):
    """All grid dimensions parallel (independent programs; megacore may split them)."""
    from jax.experimental.pallas import tpu as pltpu

    params_cls = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
    parallel = getattr(pltpu, "PARALLEL", "parallel")
    return params_cls(dimension_semantics=(parallel,) * num_grid_dims)


def triton_call_kwargs(*, num_warps: int, num_stages: int) -> dict:
    """pallas_call keywords pinning the Triton lowering on GPU.

    From jax 0.9 Mosaic GPU is the default GPU lowering; passing Triton compiler params
    (and `backend="triton"` where pallas_call has that argument) keeps these kernels on
    Triton, which they are written for (gathers by a vector of page ids).
    """
    from jax.experimental.pallas import triton as pl_triton

    kwargs = {
        "compiler_params": pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    }
    if "backend" in inspect.signature(pl.pallas_call).parameters:
        kwargs["backend"] = "triton"
    return kwargs


# --- ragged prefill bookkeeping (plain jnp, outside the kernels) ----------------------------


def ragged_layout(q, context_lens, query_start, *, num_kv_heads: int, group_rows: int,
                  block_q: int):
    """Lays out a ragged query batch for the prefill kernels.

    Query rows are token-major within a KV head: row r of block i is token
    i * block_q + r // group_rows, query head (r % group_rows) of the group.

        q [T, Hq, D] -> q_rows [Hkv, T_pad * group_rows, D]   (pad heads, pad tokens)

    Returns (q_rows, row_seq, row_pos, block_lo, block_hi):
      row_seq, row_pos: int32[T_pad * group_rows]: the row's sequence and absolute position
        (-1 for padding rows, which then match no key and give zeros).
      block_lo, block_hi: int32[T_pad // block_q]: the sequences [lo, hi) whose query rows
        meet token block i.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    group = num_q_heads // num_kv_heads
    padded_tokens = -(-num_tokens // block_q) * block_q
    qs = query_start.astype(jnp.int32)

    t = jnp.arange(padded_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(qs[1:], t, side="right").astype(jnp.int32)
    valid = t < qs[num_seqs]
    seq_c = jnp.clip(seq, 0, num_seqs - 1)
    pos = context_lens.astype(jnp.int32)[seq_c] - (qs[seq_c + 1] - t)
    row_seq = jnp.repeat(jnp.where(valid, seq_c, -1), group_rows)
    row_pos = jnp.repeat(jnp.where(valid, pos, -1), group_rows)

    starts = jnp.arange(padded_tokens // block_q, dtype=jnp.int32) * block_q
    block_lo = jnp.searchsorted(qs[1:], starts, side="right").astype(jnp.int32)
    block_hi = jnp.searchsorted(qs[:-1], starts + block_q, side="left").astype(jnp.int32)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, padded_tokens - num_tokens), (0, 0), (0, group_rows - group), (0, 0)))
    q_rows = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * group_rows, head_dim)
    return q_rows, row_seq, row_pos, block_lo, block_hi


def unlayout(out_rows, *, num_tokens: int, group: int, group_rows: int):
    """Inverse of ragged_layout's query layout: [Hkv, T_pad * Gp, D] -> [T, Hkv * group, D]."""
    num_kv_heads, _, head_dim = out_rows.shape
    out = out_rows.reshape(num_kv_heads, -1, group_rows, head_dim)[:, :num_tokens, :group]
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_kv_heads * group, head_dim)

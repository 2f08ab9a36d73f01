"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) on the paged pool, as pure functions.

A token's keys and values are all up-projections of one normed latent c [kv_lora_rank]
plus one rotated key k_rope [qk_rope_head_dim] shared by every head, so the pool stores only
those: one row [c | k_rope] per token and layer, its first half in the K pool and its second
in the V pool (each [1, num_layers * N, page_size, (r + dr) / 2]: one "KV head" of half the
row, so copies, swaps, sharding and int8/fp8 pages treat it as any pool):

    row of a token:   [ c_0 ... c_{r-1} | k_rope_0 ... k_rope_{dr-1} ]   r + dr values
    K pool:           [ first (r + dr) / 2 ]
    V pool:                               [ last (r + dr) / 2 ]

Attention runs in the absorbed form for prefill and decode alike (exact, one code path): the
key up-projection W_UK is folded into each query head (q_nope @ W_UK^T [kv_lora_rank]), so
score(t, s) = [q_nope W_UK^T | q_rope] . row_s, the same row serves as the value, and W_UV is
applied to the attention's latent output: out_h = (sum_s p_s c_s) @ W_UV_h. The paged
attention reads the two halves as one row (pallas_kernels, latent=True).

Params of a latent-attention layer (models/config.py layout, beside the MLP's):
  wq [hidden, H, dn + dr]                     (q_lora_rank 0)
  wq_a [hidden, q_lora_rank], q_a_norm [q_lora_rank], wq_b [q_lora_rank, H, dn + dr]
  wkv_a [hidden, r + dr], kv_a_norm [r]
  wkv_b [r, H, dn + dv]                       (W_UK: [..., :dn], W_UV: [..., dn:])
  wo [H, dv, hidden]
with dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, r = kv_lora_rank; rotary
dims stored in rotate-half order (a checkpoint's interleaved pairs are reordered as loaded).
Under tensor parallelism the heads are split (wq, wq_b, wkv_b, wo) and the latent's
projection replicated, as the one-head pool is.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from models import quantization
from models.config import ModelConfig
from pallas_kernels import kv_quant

# The attention params of a latent-attention layer (module docstring).
ATTENTION_PARAMS = ("wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wkv_b", "wo")


def attention(
    h: jax.Array,  # [T, D], normed
    layer: dict,
    cfg: ModelConfig,
    cos: jax.Array,  # [T, 1, dr]
    sin: jax.Array,
    k_pages,
    v_pages,
    slots: jax.Array,  # int32[T]: flat slots in the pool, layer offset included
    table: jax.Array,  # int32[S, P]: page table, layer offset included
    context_lens: jax.Array,  # int32[S]
    query_start: jax.Array,  # int32[S + 1]
    *,
    norm: Callable,
    rotate: Callable,
    decode_only: bool,
    max_query_len: int | None,
    attn_kwargs: dict,
):
    """One layer's latent attention: (o_proj's input times wo [T, D] before any tensor-
    parallel reduction, k_pages, v_pages) with this step's rows written."""
    dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    eps = cfg.rms_norm_eps
    if cfg.q_lora_rank:
        qa = norm(quantization.matmul(h, layer["wq_a"]), layer["q_a_norm"], eps)
        q = quantization.einsum("tc,chk->thk", qa, layer["wq_b"])
    else:
        q = quantization.einsum("td,dhk->thk", h, layer["wq"])  # [T, H, dn + dr]
    kv = quantization.matmul(h, layer["wkv_a"])  # [T, r + dr]
    latent = norm(kv[:, :r], layer["kv_a_norm"], eps)
    k_rope = rotate(kv[:, None, r:], cos, sin)  # [T, 1, dr]
    q_rope = rotate(q[..., dn:], cos, sin)  # [T, H, dr]
    row = jnp.concatenate([latent[:, None, :], k_rope.astype(latent.dtype)], axis=-1)
    half = cfg.head_dim
    k_pages = kv_quant.write(k_pages, row[..., :half], slots)
    v_pages = kv_quant.write(v_pages, row[..., half:], slots)
    wkv_b = quantization.dequantize(layer["wkv_b"], h.dtype)  # [r, H, dn + dv]
    q_latent = jnp.einsum("thn,rhn->thr", q[..., :dn], wkv_b[..., :dn])  # W_UK absorbed
    q_full = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    if decode_only:
        out = pallas_kernels.paged_decode_attention(
            q_full, k_pages, v_pages, context_lens, table, latent=True, **attn_kwargs
        )
    else:
        out = pallas_kernels.paged_prefill_attention(
            q_full, k_pages, v_pages, context_lens, table, query_start,
            max_query_len=max_query_len, latent=True, **attn_kwargs,
        )  # fmt: skip
    o = jnp.einsum("thr,rhv->thv", out[..., :r], wkv_b[..., dn:])  # W_UV after attention
    return quantization.einsum("thv,hvd->td", o, layer["wo"]), k_pages, v_pages


def init_attention(cfg: ModelConfig, w: Callable, ones: Callable) -> dict:
    """Random attention params of one layer (w(*shape): random, ones(*shape): norms)."""
    d, hq, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    params = {
        "wkv_a": w(d, r + cfg.qk_rope_head_dim),
        "kv_a_norm": ones(r),
        "wkv_b": w(r, hq, cfg.qk_nope_head_dim + cfg.v_head_dim),
        "wo": w(hq, cfg.v_head_dim, d),
    }
    if cfg.q_lora_rank:
        c = cfg.q_lora_rank
        params.update(wq_a=w(d, c), q_a_norm=ones(c), wq_b=w(c, hq, qk))
    else:
        params["wq"] = w(d, hq, qk)
    return params


def _deinterleave(n: int) -> np.ndarray:
    """Indices putting n rotary dims stored as interleaved pairs (x0, x1), (x2, x3), ... in
    rotate-half order (x0, x2, ..., x1, x3, ...): q . k is unchanged, as both are reordered,
    and the rotation is then transformers' interleaved one exactly."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def hf_tensors(cfg: ModelConfig, prefix: str) -> dict[str, tuple]:
    """The attention params' HF tensors: name -> (hf_name, hf_shape, to_layout, to_hf), torch
    Linear weights [out, in] transposed and split into heads, the rotary dims reordered
    (_deinterleave) when cfg.rope_interleave."""
    d, hq, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    perm = _deinterleave(dr) if cfg.rope_interleave else np.arange(dr)
    inv = np.argsort(perm)
    a = prefix + "self_attn."

    def linear(name, out_dim, in_dim, shape, order=None):
        """[out, in] -> [in, out] split to shape; order: the last axis reordered."""

        def to_layout(x):
            y = x.T.reshape(shape)
            return y if order is None else y[..., order[0]]

        def to_hf(y):
            y = y if order is None else y[..., order[1]]
            return y.reshape(in_dim, out_dim).T

        return (a + name, (out_dim, in_dim), to_layout, to_hf)

    def rope_last(width):  # the last axis's rotary part reordered
        keep = np.arange(width - dr)
        return (np.concatenate([keep, width - dr + perm]), np.concatenate([keep, width - dr + inv]))

    plain = (lambda x: x), (lambda x: x)
    qk = dn + dr
    out = {
        "wkv_a": linear("kv_a_proj_with_mqa.weight", r + dr, d, (d, r + dr), rope_last(r + dr)),
        "kv_a_norm": (a + "kv_a_layernorm.weight", (r,), *plain),
        "wkv_b": linear("kv_b_proj.weight", hq * (dn + dv), r, (r, hq, dn + dv)),
        "wo": linear("o_proj.weight", d, hq * dv, (hq, dv, d)),
    }
    if cfg.q_lora_rank:
        c = cfg.q_lora_rank
        out["wq_a"] = linear("q_a_proj.weight", c, d, (d, c))
        out["q_a_norm"] = (a + "q_a_layernorm.weight", (c,), *plain)
        out["wq_b"] = linear("q_b_proj.weight", hq * qk, c, (c, hq, qk), rope_last(qk))
    else:
        out["wq"] = linear("q_proj.weight", hq * qk, d, (d, hq, qk), rope_last(qk))
    return out

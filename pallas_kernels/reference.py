"""Pure-jnp reference paged attention: the CPU path and the ground truth for the kernels.

Layouts (shared by every kernel in this package):
  k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]
  page_table:       int32[num_seqs, pages_per_seq]   (entries past a sequence's length may be
                    anything that indexes the pool; page 0 is the null page padding points at)

Masking is exact even when unused slots hold garbage or NaN: scores are masked with `where`
(not by adding a bias), probabilities of masked slots are zeroed, and masked V rows are zeroed
before the weighted sum, so 0 * NaN never happens. A query with no visible key gives zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A large finite negative, so that max-subtraction never computes -inf - (-inf).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Full float32 products: the reference is the ground truth the float32 kernels are held to
# within 2e-5, and XLA on a GPU would otherwise run float32 einsums in TF32.
_FULL = jax.lax.Precision.HIGHEST

# Query tokens processed at once by the reference; bounds the gathered-KV temporary.
_TOKEN_BLOCK = 128


def _probs(s, visible, *, sm_scale, soft_cap):
    """Scores [T, Hkv, G, L] -> unnormalised probabilities (exactly 0 where not visible) and
    their row sums."""
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = visible[:, None, None, :]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    return p, jnp.sum(p, axis=-1, keepdims=True)


def _attend(q, k, v, visible, *, sm_scale, soft_cap):
    """q [T, Hkv, G, D]; k, v [Hkv, T, L, D]; visible bool[T, L] -> [T, Hkv, G, D] (f32)."""
    s = jnp.einsum("tkgd,ktld->tkgl", q.astype(jnp.float32), k.astype(jnp.float32),
                   precision=_FULL)
    p, denom = _probs(s, visible, sm_scale=sm_scale, soft_cap=soft_cap)
    v = jnp.where(visible[None, :, :, None], v.astype(jnp.float32), 0.0)
    o = jnp.einsum("tkgl,ktld->tkgd", p, v, precision=_FULL)
    return o / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)


def _attend_pair(q, k, v, which, visible, *, sm_scale, soft_cap):
    """Tokens of at most two sequences, whose keys are gathered once per sequence, not once
    per token: q [T, Hkv, G, D]; k, v [Hkv, 2, L, D] with rows past each sequence's length
    already zeroed in v; which int32[T] in {0, 1}; visible bool[T, L] -> [T, Hkv, G, D]."""
    s2 = jnp.einsum("tkgd,ksld->tkgsl", q.astype(jnp.float32), k.astype(jnp.float32),
                    precision=_FULL)
    pick = which[:, None, None, None]
    s = jnp.where(pick == 0, s2[:, :, :, 0], s2[:, :, :, 1])
    p, denom = _probs(s, visible, sm_scale=sm_scale, soft_cap=soft_cap)
    o2 = jnp.einsum("tkgl,ksld->tkgsd", p, v.astype(jnp.float32), precision=_FULL)
    o = jnp.where(pick == 0, o2[:, :, :, 0], o2[:, :, :, 1])
    return o / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)


def paged_prefill_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    context_lens: jax.Array,  # int32[num_seqs]: tokens in the cache after this step's writes
    page_table: jax.Array,  # int32[num_seqs, pages_per_seq]
    query_start: jax.Array,  # int32[num_seqs + 1]: cumulative query offsets
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim], q's dtype
    """Ragged paged attention: one call serves prefill chunks and decode tokens together.

    Sequence s owns query rows [query_start[s], query_start[s+1]); they are the last
    `qlen` tokens of its context_lens[s] tokens, already written to the pages, and each
    attends to every earlier position and to itself (causal). Rows at or past
    query_start[num_seqs] are padding and give zeros.

        cache of seq s:  |<------- context_lens[s] ------->|
                         [ cached tokens ][ this step's q ]
                                          ^ position context_lens[s] - qlen
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    group = num_q_heads // num_kv_heads
    max_len = pages_per_seq * page_size

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start[1:], t, side="right").astype(jnp.int32)
    valid = t < query_start[num_seqs]
    seq = jnp.clip(seq, 0, num_seqs - 1)
    qlen = query_start[seq + 1] - query_start[seq]
    pos = context_lens[seq] - qlen + (t - query_start[seq])  # [T]
    kv_len = jnp.where(valid, context_lens[seq], 0)

    def block(args):
        qb, seqb, posb, lenb = args
        kv_pos = jnp.arange(max_len, dtype=jnp.int32)[None, :]
        visible = (kv_pos <= posb[:, None]) & (kv_pos < lenb[:, None])
        if sliding_window is not None:
            visible = visible & (kv_pos > posb[:, None] - sliding_window)
        qg = qb.reshape(-1, num_kv_heads, group, head_dim)

        def per_token(_):  # decode-like blocks: every token its own sequence's pages
            pages = page_table[seqb]  # [B, P]
            k = k_pages[:, pages].reshape(num_kv_heads, -1, max_len, head_dim)
            v = v_pages[:, pages].reshape(num_kv_heads, -1, max_len, head_dim)
            return _attend(qg, k, v, visible, sm_scale=sm_scale, soft_cap=soft_cap)

        def per_pair(_):  # prefill-like blocks: one or two sequences' pages, gathered once
            pair = jnp.stack([seqb[0], seqb[-1]])
            pages = page_table[pair]  # [2, P]
            k = k_pages[:, pages].reshape(num_kv_heads, 2, max_len, head_dim)
            v = v_pages[:, pages].reshape(num_kv_heads, 2, max_len, head_dim)
            # Rows at or past a sequence's length may hold garbage (even NaN): zero them, so
            # a zero probability never multiplies a NaN. Earlier rows were written this step
            # or before and are finite.
            written = kv_pos < context_lens[pair][:, None]  # [2, L]
            v = jnp.where(written[None, :, :, None], v, 0.0)
            which = (seqb != seqb[0]).astype(jnp.int32)
            return _attend_pair(qg, k, v, which, visible, sm_scale=sm_scale, soft_cap=soft_cap)

        at_most_two = jnp.all((seqb == seqb[0]) | (seqb == seqb[-1]))
        return jax.lax.cond(at_most_two, per_pair, per_token, None)

    if num_tokens > _TOKEN_BLOCK and num_tokens % _TOKEN_BLOCK == 0:
        nb = num_tokens // _TOKEN_BLOCK

        def split(x):
            return x.reshape(nb, _TOKEN_BLOCK, *x.shape[1:])

        out = jax.lax.map(block, (split(q), split(seq), split(pos), split(kv_len)))
        out = out.reshape(num_tokens, num_kv_heads, group, head_dim)
    else:
        out = block((q, seq, pos, kv_len))
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    lengths: jax.Array,  # int32[batch]; 0 gives zeros
    page_table: jax.Array,  # int32[batch, pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:  # [batch, num_q_heads, head_dim], q's dtype
    """Decode attention: one query per sequence, at position lengths[b] - 1."""
    batch = q.shape[0]
    query_start = jnp.arange(batch + 1, dtype=jnp.int32)
    return paged_prefill_attention(
        q,
        k_pages,
        v_pages,
        lengths.astype(jnp.int32),
        page_table,
        query_start,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
    )

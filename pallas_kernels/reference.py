"""Pure-jnp reference paged attention: the CPU path and the ground truth for the kernels.

Layouts (shared by every kernel in this package):
  k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]
  page_table:       int32[num_seqs, pages_per_seq]   (entries past a sequence's length may be
                    anything that indexes the pool; page 0 is the null page padding points at)

Masking is exact even when unused slots hold garbage or NaN: scores are masked with `where`
(not by adding a bias), probabilities of masked slots are zeroed, and masked V rows are zeroed
before the weighted sum, so 0 * NaN never happens. A query with no visible key gives zeros.

How it runs (what makes it usable as the CPU path): query tokens go in blocks of
_TOKEN_BLOCK; a block attends over its context _KEY_BLOCK keys at a time with an online
softmax, and only over the key blocks its tokens can see (so a prompt's first tokens do not
pay for the page table's full width). Keys are gathered once per sequence when the block's
tokens belong to one or two sequences (prefill), once per token otherwise (decode), and pages
a row does not need are read as the null page. A caller that knows a bound on the query
tokens per sequence (max_query_len: a verification step's k + 1) gets each sequence's queries
attended as one group, its keys gathered once, when the step fits the bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_kernel, kv_quant

# A large finite negative, so that max-subtraction never computes -inf - (-inf).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Full float32 products: the reference is the ground truth the float32 kernels are held to
# within 2e-5, and XLA on a GPU would otherwise run float32 einsums in TF32.
_FULL = jax.lax.Precision.HIGHEST

# Query tokens processed at once by the reference; bounds the gathered-KV temporary.
_TOKEN_BLOCK = 128
# Decode-like token blocks larger than this are sorted by context length and attended in
# sub-blocks of this many tokens, each over only the keys its longest token sees.
_DECODE_SUB_BLOCK = 8
# Keys per step of a block's loop over its context (rounded down to whole pages, and at most
# the page table's width).
_KEY_BLOCK = 256


def _online_step(carry, s, mask, pv, *, sm_scale, soft_cap):
    """One key block of an online softmax.

    carry: (m, l, acc), the running max and sum [..., 1] and output [..., D]; s: raw scores
    [..., C]; mask: bool, broadcastable to s, whether a key is visible; pv(p): p [..., C]
    times the block's V (whose rows that hold no value are zeroed). Masked probabilities are
    exactly 0, and a block with nothing visible leaves the carry as it was.
    """
    m, l, acc = carry
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)  # 0 at the first visible block (m was MASK_VALUE)
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    return m_new, l * alpha + jnp.sum(p, axis=-1, keepdims=True), acc * alpha + pv(p)


def _finish(m, l, acc, sinks):
    """The online softmax's output acc / l, with sinks (float32 broadcastable to m: one
    logit per query head, gpt-oss) joining the denominator as one more key of no value:

        out = sum_j e^(s_j - m') v_j / (sum_j e^(s_j - m') + e^(sink - m')),  m' = max(m, sink)

    A query that sees no key gives zeros either way."""
    if sinks is None:
        return acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)
    m_new = jnp.maximum(m, sinks)
    scale = jnp.exp(m - m_new)
    return acc * scale / (l * scale + jnp.exp(sinks - m_new))


def _read_key_block(k_pages, v_pages, rows, row_lens, i, key_block_pages, latent=False):
    """Key block i of each row: positions int32[block] and K, V [Hkv, R, block, D] float32
    (latent: K and V both the row of K's and V's halves side by side, D twice theirs).

    rows int32[R, P]: page-table rows; row_lens int32[R]: tokens written in each row's pages
    (slots past it are zeroed in V). A page no slot of which is written (past the row's
    length, or a column past the table's width) is read as the null page: masked anyway,
    and cheap to read again."""
    hkv, _, page_size, d = k_pages.shape
    r, width = rows.shape
    block = key_block_pages * page_size
    cols = i * key_block_pages + jnp.arange(key_block_pages, dtype=jnp.int32)
    kv_pos = i * block + jnp.arange(block, dtype=jnp.int32)
    written = kv_pos[None, :] < row_lens[:, None]  # [R, block]
    needed = (cols[None, :] < width) & (cols[None, :] * page_size < row_lens[:, None])
    pages = jnp.where(needed, rows[:, jnp.minimum(cols, width - 1)], 0)

    def gather(pool):  # a quantized pool (kv_quant.QuantizedPages) is dequantized here
        return kv_quant.take(pool, pages).reshape(hkv, r, block, d)

    if latent:  # one row split over the two pools (models/mla.py): keys and values alike
        row = jnp.concatenate([gather(k_pages), gather(v_pages)], axis=-1)
        return kv_pos, row, jnp.where(written[None, :, :, None], row, 0.0)
    return kv_pos, gather(k_pages), jnp.where(written[None, :, :, None], gather(v_pages), 0.0)


def _attend_block(q, k_pages, v_pages, rows, row_lens, which, pos, kv_len, *, page_size,
                  key_block_pages, key_range, sm_scale, soft_cap, sliding_window, latent=False,
                  sinks=None):
    """One block of query tokens over the keys [lo, hi) of their context.

    q [T, Hkv, G, D]; rows int32[R, P]: the page-table rows read, either one per token
    (which None, R = T) or the block's sequences (R in (1, 2); which int32[T] in [0, R) says
    whose token t is); row_lens int32[R]: tokens written in each row's pages (slots past it
    are zeroed in V); pos, kv_len int32[T]: each token's position and its sequence's length
    (0: padding, sees nothing); key_range: int32 (lo, hi) holding every key a token of the
    block sees; sinks: float32[Hq] or None (_finish). Returns [T, Hkv, G, D] float32.
    """
    t, hkv, g, d = q.shape
    r = rows.shape[0]
    block = key_block_pages * page_size
    qf = q.astype(jnp.float32)

    # The per-token path's queries as [Hkv, T, G, D]: the gathered blocks' leading dims.
    qk = qf.transpose(1, 0, 2, 3) if which is None else None

    def step(i, carry):
        kv_pos, k, v = _read_key_block(k_pages, v_pages, rows, row_lens, i, key_block_pages,
                                       latent)
        visible = (kv_pos[None, :] <= pos[:, None]) & (kv_pos[None, :] < kv_len[:, None])
        if sliding_window is not None:
            visible = visible & (kv_pos[None, :] > pos[:, None] - sliding_window)
        if which is None:  # row t is token t's
            # Batch dims in the blocks' own order (Hkv, T) and the keys as the left operand:
            # XLA:CPU then multiplies the gathered [block, D] tiles as they lie. Written
            # as q @ K^T over (T, Hkv) it copied every K block into [T, Hkv, D, block] first,
            # which cost more than the products (docs/benchmarks.md, issue 11).
            s = jnp.einsum("ktld,ktgd->ktlg", k, qk, precision=_FULL).transpose(1, 0, 3, 2)

            def pv(p):  # p [T, Hkv, G, block]
                o = jnp.einsum("ktgl,ktld->ktgd", p.transpose(1, 0, 2, 3), v, precision=_FULL)
                return o.transpose(1, 0, 2, 3)
        elif r == 1:
            s = jnp.einsum("tkgd,kld->tkgl", qf, k[:, 0], precision=_FULL)

            def pv(p):
                return jnp.einsum("tkgl,kld->tkgd", p, v[:, 0], precision=_FULL)
        else:  # scores against both sequences' keys, each token's own picked
            pick = which[:, None, None, None] == 0
            s2 = jnp.einsum("tkgd,ksld->tkgsl", qf, k, precision=_FULL)
            s = jnp.where(pick, s2[:, :, :, 0], s2[:, :, :, 1])

            def pv(p):
                o2 = jnp.einsum("tkgl,ksld->tkgsd", p, v, precision=_FULL)
                return jnp.where(pick, o2[:, :, :, 0], o2[:, :, :, 1])

        return _online_step(carry, s, visible[:, None, None, :], pv, sm_scale=sm_scale,
                            soft_cap=soft_cap)

    init = (
        jnp.full((t, hkv, g, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((t, hkv, g, 1), jnp.float32),
        jnp.zeros((t, hkv, g, d), jnp.float32),
    )
    lo, hi = key_range
    m, l, acc = jax.lax.fori_loop(lo // block, (hi + block - 1) // block, step, init)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32).reshape(hkv, g, 1)
    return _finish(m, l, acc, sinks)


def _attend_grouped(q, k_pages, v_pages, context_lens, page_table, query_start, *, max_query_len,
                    sm_scale, soft_cap, sliding_window, latent=False,
                    sinks=None):
    """paged_prefill_attention's result when no sequence has more than max_query_len query
    tokens: each sequence's queries as one group [max_query_len, Hq], its keys gathered once
    per key block for all of them (the per-token path gathers them once per query token).
    The shape of a verification step, k + 1 tokens per row. Same arguments and result."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_seqs, width = page_table.shape
    group = num_q_heads // num_kv_heads
    qm = max_query_len
    key_block_pages = max(1, min(width, _KEY_BLOCK // page_size))
    block = key_block_pages * page_size

    qlen = query_start[1:] - query_start[:-1]  # [S]
    j = jnp.arange(qm, dtype=jnp.int32)
    valid = j[None, :] < qlen[:, None]  # [S, Qm]
    token = query_start[:-1, None] + j[None, :]  # [S, Qm]: each query's row in q
    pos = context_lens[:, None] - qlen[:, None] + j[None, :]  # [S, Qm]
    seen = valid & (context_lens[:, None] > 0)  # queries that see anything
    qg = q[jnp.where(valid, token, 0)].astype(jnp.float32)  # [S, Qm, Hq, D]
    qg = qg.reshape(num_seqs, qm, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(num_seqs, num_kv_heads, qm * group, head_dim)  # [S, Hkv, Qm*G, D]
    hi = jnp.max(jnp.where(seen, pos + 1, 0))
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.min(jnp.where(seen, jnp.maximum(pos - sliding_window + 1, 0), hi))

    def step(i, carry):
        kv_pos, k, v = _read_key_block(k_pages, v_pages, page_table, context_lens, i,
                                       key_block_pages, latent)
        visible = (kv_pos <= pos[:, :, None]) & (kv_pos < context_lens[:, None, None])
        visible &= seen[:, :, None]  # [S, Qm, C]
        if sliding_window is not None:
            visible &= kv_pos > pos[:, :, None] - sliding_window
        s = jnp.einsum("skqd,ksld->skql", qg, k, precision=_FULL)
        s = s.reshape(num_seqs, num_kv_heads, qm, group, block)

        def pv(p):
            p = p.reshape(num_seqs, num_kv_heads, qm * group, block)
            o = jnp.einsum("skql,ksld->skqd", p, v, precision=_FULL)
            return o.reshape(num_seqs, num_kv_heads, qm, group, head_dim)

        return _online_step(carry, s, visible[:, None, :, None, :], pv, sm_scale=sm_scale,
                            soft_cap=soft_cap)

    shape = (num_seqs, num_kv_heads, qm, group)
    init = (
        jnp.full((*shape, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((*shape, 1), jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(lo // block, (hi + block - 1) // block, step, init)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group, 1)
    out = _finish(m, l, acc, sinks)  # [S, Hkv, Qm, G, D]
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_seqs * qm, num_q_heads, head_dim)
    rows = jnp.where(valid, token, num_tokens).reshape(-1)  # absent queries: dropped
    result = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    return result.at[rows].set(out, mode="drop").astype(q.dtype)


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
    max_query_len: int | None = None,
    latent: bool = False,
    sinks: jax.Array | None = None,  # float32[num_q_heads]: gpt-oss's sink logits
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim], q's dtype
    """Ragged paged attention: one call serves prefill chunks and decode tokens together.

    Sequence s owns query rows [query_start[s], query_start[s+1]); they are the last
    `qlen` tokens of its context_lens[s] tokens, already written to the pages, and each
    attends to every earlier position and to itself (causal). Rows at or past
    query_start[num_seqs] are padding and give zeros.

        cache of seq s:  |<------- context_lens[s] ------->|
                         [ cached tokens ][ this step's q ]
                                          ^ position context_lens[s] - qlen

    max_query_len (static, optional): the query tokens a sequence usually has at most (a
    verification step: k + 1). When every sequence has at most that many, they are attended
    in groups per sequence (_attend_grouped), else as below; the result is the same.

    latent (static): multi-head latent attention (models/mla.py): each token's key and value
    are one row, its first half in k_pages and its second in v_pages (head_dim each), and q
    and the result are rows [num_tokens, num_q_heads, 2 * head_dim].

    sinks (optional): one logit per query head that joins every query's softmax
    denominator (gpt-oss's attention sinks, _finish); None: a plain softmax.
    """
    kw = {"sm_scale": sm_scale, "soft_cap": soft_cap, "sliding_window": sliding_window,
          "latent": latent, "sinks": sinks}
    args = (q, k_pages, v_pages, context_lens, page_table, query_start)
    # On the CPU every token runs its kernel (cpu_kernel: pages read where they lie, a
    # sequence's tokens sharing each page's reads, on every core) where it serves: float32
    # queries, float32 or one-byte quantized pools, no latent rows. Lowered for another
    # platform: the gathers below.
    if (not latent and q.dtype == jnp.float32 and cpu_kernel.serves(k_pages)
            and jax.default_backend() == "cpu" and cpu_kernel.available()):
        return jax.lax.platform_dependent(
            *args,
            cpu=lambda *a: _kernel_step(*a, sm_scale=sm_scale, soft_cap=soft_cap,
                                        sliding_window=sliding_window, sinks=sinks),
            default=lambda *a: _gathered(*a, max_query_len=max_query_len, **kw),
        )
    return _gathered(*args, max_query_len=max_query_len, **kw)


def _token_positions(context_lens, query_start, num_tokens):
    """Each query token's sequence, position and its sequence's length (0: padding, a token
    at or past query_start[-1]), int32[T] each."""
    num_seqs = context_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start[1:], t, side="right").astype(jnp.int32)
    valid = t < query_start[num_seqs]
    seq = jnp.clip(seq, 0, num_seqs - 1)
    qlen = query_start[seq + 1] - query_start[seq]
    pos = context_lens[seq] - qlen + (t - query_start[seq])
    return seq, pos, jnp.where(valid, context_lens[seq], 0)


def _kernel_step(q, k_pages, v_pages, context_lens, page_table, query_start, *, sm_scale,
                 soft_cap, sliding_window, sinks):
    """paged_prefill_attention by the CPU kernel: token t over keys [lo, pos + 1) of its own
    sequence (lo past the sliding window; padding: zeros)."""
    seq, pos, kv_len = _token_positions(context_lens, query_start, q.shape[0])
    ends = jnp.where(kv_len > 0, jnp.minimum(pos + 1, kv_len), 0).astype(jnp.int32)
    starts = jnp.zeros_like(ends)
    if sliding_window is not None:
        starts = jnp.maximum(pos - sliding_window + 1, 0).astype(jnp.int32)
    return cpu_kernel.attention(q, k_pages, v_pages, page_table.astype(jnp.int32), seq,
                                starts, ends, sm_scale=sm_scale, soft_cap=soft_cap,
                                sinks=sinks)


def _gathered(q, k_pages, v_pages, context_lens, page_table, query_start, *, sm_scale,
              soft_cap, sliding_window, max_query_len, latent, sinks):
    """paged_prefill_attention by gathers of key blocks (the module's docstring)."""
    if max_query_len is not None:
        kw = {"sm_scale": sm_scale, "soft_cap": soft_cap, "sliding_window": sliding_window,
              "latent": latent, "sinks": sinks}
        args = (q, k_pages, v_pages, context_lens, page_table, query_start)
        fits = jnp.max(query_start[1:] - query_start[:-1]) <= max_query_len
        return jax.lax.cond(
            fits,
            lambda a: _attend_grouped(*a, max_query_len=max_query_len, **kw),
            lambda a: _gathered(*a, max_query_len=None, **kw),
            args,
        )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    group = num_q_heads // num_kv_heads
    key_block_pages = max(1, min(pages_per_seq, _KEY_BLOCK // page_size))
    seq, pos, kv_len = _token_positions(context_lens, query_start, num_tokens)

    def block(args):
        qb, seqb, posb, lenb = args
        qg = qb.reshape(-1, num_kv_heads, group, head_dim)
        def key_range(pos_b, len_b):  # int32 (lo, hi) holding every key the tokens see
            seen = len_b > 0  # tokens that see anything (padding does not)
            hi = jnp.max(jnp.where(seen, pos_b + 1, 0))
            lo = jnp.int32(0)
            if sliding_window is not None:
                lo = jnp.min(jnp.where(seen, jnp.maximum(pos_b - sliding_window + 1, 0), hi))
            return lo, hi

        kw = {"page_size": page_size, "key_block_pages": key_block_pages,
              "key_range": key_range(posb, lenb), "sm_scale": sm_scale, "soft_cap": soft_cap,
              "sliding_window": sliding_window, "latent": latent,
              "sinks": sinks}
        first, last = seqb[0], seqb[-1]  # tokens are in sequence order
        zeros = jnp.zeros(seqb.shape, jnp.int32)

        def one(_):  # every token of one sequence: its keys gathered once
            rows = page_table[first][None]
            return _attend_block(qg, k_pages, v_pages, rows, context_lens[first][None], zeros,
                                 posb, lenb, **kw)

        def two(_):  # tokens of two sequences: each one's keys gathered once
            pair = jnp.stack([first, last])
            which = (seqb != first).astype(jnp.int32)
            return _attend_block(qg, k_pages, v_pages, page_table[pair], context_lens[pair],
                                 which, posb, lenb, **kw)

        def per_token(_):  # decode-like blocks: every token its own sequence's keys
            n = qg.shape[0]
            if n <= _DECODE_SUB_BLOCK or n % _DECODE_SUB_BLOCK:
                return _attend_block(qg, k_pages, v_pages, page_table[seqb], lenb, None, posb,
                                     lenb, **kw)
            # Tokens sorted by context length in sub-blocks, each looping only over the key
            # blocks its own longest token sees: a batch of mixed lengths does not pay the
            # longest context for every token (a key block a token does not see leaves its
            # carry exactly as it was, so only the products' shapes change).
            order = jnp.argsort(lenb)
            sub = n // _DECODE_SUB_BLOCK

            def split(x):
                return x[order].reshape(sub, _DECODE_SUB_BLOCK, *x.shape[1:])

            def attend(args):
                q_s, seq_s, pos_s, len_s = args
                return _attend_block(q_s, k_pages, v_pages, page_table[seq_s], len_s, None,
                                     pos_s, len_s, **{**kw, "key_range": key_range(pos_s, len_s)})

            out = jax.lax.map(attend, (split(qg), split(seqb), split(posb), split(lenb)))
            out = out.reshape(n, *out.shape[2:])
            return out[jnp.argsort(order)]

        if qg.shape[0] == 1:  # one token: its own sequence
            return one(None)
        at_most_two = jnp.all((seqb == first) | (seqb == last))
        branch = jnp.where(first == last, 0, jnp.where(at_most_two, 1, 2))
        return jax.lax.switch(branch, (one, two, per_token), None)

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
    latent: bool = False,
    sinks: jax.Array | None = None,  # float32[num_q_heads]
) -> jax.Array:  # [batch, num_q_heads, head_dim], q's dtype
    """Decode attention: one query per sequence, at position lengths[b] - 1 (latent:
    paged_prefill_attention's)."""
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
        latent=latent,
        sinks=sinks,
    )

"""Builders for paged-attention test inputs: tiny NaN-filled pools with shuffled page tables.

Every slot of the pool that no sequence has written holds NaN (page 0, the null page, too),
and page-table entries past a sequence's pages point at random pages, so a kernel that reads
or multiplies an unwritten slot without masking it produces NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCES = {  # per element, after the output is cast to its dtype
    "float32": {"atol": 2e-5, "rtol": 2e-5},
    "bfloat16": {"atol": 2e-2, "rtol": 2e-2},
}


@dataclasses.dataclass
class Case:
    q: jnp.ndarray
    k_pages: jnp.ndarray
    v_pages: jnp.ndarray
    context_lens: jnp.ndarray  # int32[S]
    page_table: jnp.ndarray  # int32[S, P]
    query_start: jnp.ndarray | None  # int32[S + 1] (prefill cases)
    sm_scale: float


def make_pool(rng, *, context_lens, num_kv_heads, page_size, head_dim, pages_per_seq, dtype,
              spare_pages=3):
    """NaN pool with each sequence's tokens written into shuffled pages."""
    context_lens = np.asarray(context_lens, np.int32)
    needed = [-(-int(n) // page_size) for n in context_lens]
    assert max(needed) <= pages_per_seq
    num_pages = 1 + sum(needed) + spare_pages  # page 0 is the null page
    ids = rng.permutation(np.arange(1, num_pages))
    k = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    table = rng.integers(0, num_pages, size=(len(context_lens), pages_per_seq)).astype(np.int32)
    taken = 0
    for s, n in enumerate(context_lens):
        pages = ids[taken: taken + needed[s]]
        taken += needed[s]
        table[s, : needed[s]] = pages
        for t in range(int(n)):
            p, o = pages[t // page_size], t % page_size
            k[:, p, o] = rng.standard_normal((num_kv_heads, head_dim))
            v[:, p, o] = rng.standard_normal((num_kv_heads, head_dim))
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table)


def decode_case(seed=0, *, lengths, num_kv_heads, group, page_size, head_dim, dtype,
                pages_per_seq=None):
    rng = np.random.default_rng(seed)
    if pages_per_seq is None:
        pages_per_seq = max(1, -(-max(lengths) // page_size))
    k, v, table = make_pool(rng, context_lens=lengths, num_kv_heads=num_kv_heads,
                            page_size=page_size, head_dim=head_dim,
                            pages_per_seq=pages_per_seq, dtype=dtype)
    q = rng.standard_normal((len(lengths), num_kv_heads * group, head_dim))
    return Case(jnp.asarray(q, dtype), k, v, jnp.asarray(lengths, jnp.int32), table, None,
                head_dim**-0.5)


def prefill_case(seed=0, *, seqs, num_kv_heads, group, page_size, head_dim, dtype,
                 pad_tokens=3):
    """seqs: [(context_len, query_len)]; rows after the last sequence are padding."""
    rng = np.random.default_rng(seed)
    ctx = [c for c, _ in seqs]
    pages_per_seq = max(1, -(-max(ctx) // page_size))
    k, v, table = make_pool(rng, context_lens=ctx, num_kv_heads=num_kv_heads,
                            page_size=page_size, head_dim=head_dim,
                            pages_per_seq=pages_per_seq, dtype=dtype)
    qs = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = rng.standard_normal((int(qs[-1]) + pad_tokens, num_kv_heads * group, head_dim))
    return Case(jnp.asarray(q, dtype), k, v, jnp.asarray(ctx, jnp.int32), table,
                jnp.asarray(qs), head_dim**-0.5)


def check(out, expected):
    """Same dtype and shape, all finite, and close per element within the dtype's tolerance."""
    assert out.dtype == expected.dtype, (out.dtype, expected.dtype)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    tol = TOLERANCES[jnp.dtype(out.dtype).name]
    o = np.asarray(out.astype(jnp.float32))
    e = np.asarray(expected.astype(jnp.float32))
    assert np.all(np.isfinite(o)), "kernel output has non-finite values"
    assert np.all(np.isfinite(e)), "reference output has non-finite values"
    np.testing.assert_allclose(o, e, **tol)


def spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def decode_specs(batch, pages_per_seq, hq, hkv, head_dim, page_size, num_pages, dtype):
    """Abstract arguments of a decode call (for lowering without data)."""
    pool = spec((hkv, num_pages, page_size, head_dim), dtype)
    return (spec((batch, hq, head_dim), dtype), pool, pool, spec((batch,), "int32"),
            spec((batch, pages_per_seq), "int32"))


def prefill_specs(tokens, seqs, pages_per_seq, hq, hkv, head_dim, page_size, num_pages, dtype):
    """Abstract arguments of a ragged prefill call."""
    pool = spec((hkv, num_pages, page_size, head_dim), dtype)
    return (spec((tokens, hq, head_dim), dtype), pool, pool, spec((seqs,), "int32"),
            spec((seqs, pages_per_seq), "int32"), spec((seqs + 1,), "int32"))

"""Multi-head latent attention's decode on the paged pool (models/mla.py's layout).

Each token's key and value are one row [latent | rotary key] of 2 * head_dim values, its
first half in k_pages and its second in v_pages ([1, num_pages, page_size, head_dim] each,
plain or kv_quant.QuantizedPages); every query head attends over the same rows:

    score(h, s) = q[h, :D] . K[s] + q[h, D:] . V[s]          (D = head_dim, one row split)
    out[h]      = sum_s p(h, s) [K[s] | V[s]]                 [Hq, 2D]

The reference (reference.py, latent=True) serves the CPU and any shape a kernel refuses.
"""

from __future__ import annotations

import jax

from pallas_kernels import reference


def paged_decode_attention(
    q: jax.Array,  # [batch, num_q_heads, 2 * head_dim]
    k_pages,  # [1, num_pages, page_size, head_dim]: each row's first half
    v_pages,  # [1, num_pages, page_size, head_dim]: its second half
    lengths: jax.Array,  # int32[batch]; 0 gives zeros
    page_table: jax.Array,  # int32[batch, pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    backend: str | None = None,
) -> jax.Array:  # [batch, num_q_heads, 2 * head_dim], q's dtype
    """Latent decode attention, dispatched (module docstring)."""
    del interpret, backend
    return reference.paged_decode_attention(
        q, k_pages, v_pages, lengths, page_table, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, latent=True,
    )  # fmt: skip

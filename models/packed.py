"""Weights packed for the CPU's matmul kernel (pallas_kernels/cpu_matmul.cc).

A float32 weight w [K, N] (N a multiple of 64) is kept as panels [N / 64, K, 64]: each panel's
K x 64 block contiguous, so the kernel reads it in order, six rows of x at a time. On
the CPU SmolLM2's 32-row decode step went from 89.5 to 66.8 ms (its LM head 15.9 -> 11.6) and
a 2,048-token prefill step stayed as fast (docs/benchmarks.md, "Prefill, sampling and products
through CPU kernels"). switch_layers
(models/llama.py) packs the switched layers' plain weights and the kept-transposed tied head
where the kernel is built; models/quantization.py's weights and every other layout stay as
they are.

    PackedWeight(panels)      a pytree (panels its one leaf); .shape is w's [K, N]
    pack(w) -> PackedWeight   where it applies (pack_applies), else w itself
    dense(x, w)               x [..., K] @ w for a packed, quantized or plain w
    columns(w, ids)           w[:, ids].T [len(ids), K] (the tied table's lookup)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import quantization
from pallas_kernels import cpu_kernel


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    panels: Any  # float32[N / 64, K, 64]

    @property
    def shape(self) -> tuple[int, int]:
        p, k, panel = self.panels.shape
        return (k, p * panel)

    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return int(self.panels.nbytes)


jax.tree_util.register_dataclass(PackedWeight, data_fields=["panels"], meta_fields=[])


def pack_applies(w: Any) -> bool:
    """A plain float32 matrix whose columns fill whole panels, with the kernel built here."""
    return (
        isinstance(w, jax.Array | np.ndarray)
        and w.ndim == 2
        and w.dtype == np.float32
        and w.shape[1] % cpu_kernel.PANEL == 0
        and cpu_kernel.available()
    )


def pack(w: Any) -> Any:
    return PackedWeight(jnp.asarray(cpu_kernel.pack(w))) if pack_applies(w) else w


def dense(x: jax.Array, w: Any, valid: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ w: the CPU kernel for a packed w (lowered for another platform: the
    panels unpacked into one dot), quantization.matmul otherwise. valid: int32[], the rows of
    x (flattened) that matter, a prefix (a step's real tokens before its bucket's padding):
    the kernel computes those and gives zeros for the rest;
    other paths compute every row. None: all."""
    if not isinstance(w, PackedWeight):
        return quantization.matmul(x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).astype(jnp.float32)
    out = jax.lax.platform_dependent(
        cpu=lambda: cpu_kernel.matmul(rows, w.panels, valid),
        default=lambda: rows @ cpu_kernel.unpack(w.panels),
    )
    return out.reshape(*lead, w.shape[1]).astype(x.dtype)


def columns(w: Any, ids: jax.Array) -> jax.Array:
    """w[:, ids].T: [len(ids), K], for a packed or plain w [K, N]."""
    if not isinstance(w, PackedWeight):
        return jnp.take(w, ids, axis=1).T
    panel = cpu_kernel.PANEL
    return w.panels[ids // panel, :, ids % panel]

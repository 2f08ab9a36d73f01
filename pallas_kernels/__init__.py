"""Paged attention: Pallas kernels for GPU and TPU, with pure-jnp references.

`paged_decode_attention` and `paged_prefill_attention` dispatch on the backend:

  backend  kernel                                   when
  "gpu"    gpu_decode / gpu_prefill (Pallas Triton)  head_dim and page_size powers of two,
                                                     head_dim >= 16
  "tpu"    tpu_decode / tpu_prefill (Mosaic TPU)     page_size a multiple of 8
  "cpu"    reference                                 always; also any shape a kernel refuses

The backend is `jax.default_backend()` unless forced with `backend=`. With `interpret=True`
and no forced backend on a CPU host, the GPU kernel runs in the Pallas interpreter (so the
engine can exercise the kernel path without an accelerator). Soft capping, sliding
windows and attention sinks (gpt-oss: a logit per query head in each softmax's denominator;
an optional input, None for the other families) are implemented in every kernel. All functions are traceable inside jit; backend
selection happens at trace time.

Quantized pages (kv_quant.QuantizedPages: int8, fp8 e4m3 or e5m2 codes and a bfloat16 scale
per token and KV head) go to the same kernels under the same shape rules: the Triton and
Mosaic TPU kernels read the codes and scales and dequantize after the load, so attention
reads 1 byte per element (plus 2 per row) instead of the activations' 2 or 4. The reference
dequantizes after its gather. All three dtypes lower for 'cuda' (an H200, where Triton
converts fp8 natively from sm_89) and for 'tpu' (tests/pallas_kernels/test_kv_quant_kernels.py),
so no dtype falls back on its own.

GPU decode has two kernels: "triton" (gpu_decode, the default) and "mosaic"
(mosaic_gpu_decode: Mosaic GPU, Hopper wgmma, bfloat16/float16 only; the path off jax's
deprecated Triton lowering). `gpu_kernel=` chooses; when it is None the environment variable
JPAGED_GPU_KERNEL does (read when the call is traced, so set it before the engine starts),
and "triton" when that is unset. A shape or dtype the Mosaic kernel refuses runs on Triton,
quantized pages among them (it reads 16-bit pages only). Prefill always uses Triton on GPU.

latent=True (multi-head latent attention) has its own kernels under the same dispatch:
mla.py for decode and mla_prefill.py for ragged prefill (mla.supports_gpu / supports_tpu).
"""

from __future__ import annotations

import functools
import logging
import os

import jax

from pallas_kernels import reference
from pallas_kernels.kv_quant import QuantizedPages
from pallas_kernels.reference import MASK_VALUE

logger = logging.getLogger(__name__)

__all__ = [
    "GPU_KERNELS",
    "MASK_VALUE",
    "gpu_decode_kernel",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference",
    "select_backend",
]

_BACKENDS = ("gpu", "tpu", "cpu")
GPU_KERNELS = ("triton", "mosaic")
GPU_KERNEL_ENV = "JPAGED_GPU_KERNEL"


def select_backend(q_shape, k_shape, dtype, *, interpret: bool, backend: str | None,
                   latent: bool = False) -> str:  # fmt: skip
    """Which implementation runs: "gpu", "tpu" or "cpu" (the reference). Plain and quantized
    pages (kv_quant.QuantizedPages, whose shape and dtype are its codes') follow the same
    rules: every kernel reads both, so only a shape a kernel refuses falls back (on GPU the
    dtype decides whether a pool's offsets fit, gpu_decode.offsets_fit). latent: the latent
    attention's kernels decide (mla.supports_gpu / supports_tpu; decode and prefill alike)."""
    if backend is None:
        backend = jax.default_backend()
        if backend == "cpu" and interpret:
            backend = "gpu"
    if backend in ("cuda", "rocm"):
        backend = "gpu"
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {_BACKENDS}")
    if backend == "cpu":
        return "cpu"
    if latent:
        from pallas_kernels import mla

        ok = (mla.supports_gpu(q_shape, k_shape, dtype) if backend == "gpu"
              else mla.supports_tpu(k_shape))  # fmt: skip
    elif backend == "gpu":
        from pallas_kernels import gpu_decode

        ok = gpu_decode.supports(q_shape, k_shape, dtype)
    else:
        from pallas_kernels import tpu_decode

        ok = tpu_decode.supports(q_shape, k_shape)
    if ok:
        return backend
    _warn_reference(backend, tuple(q_shape), tuple(k_shape), str(dtype))
    return "cpu"


@functools.cache
def _warn_reference(backend: str, q_shape, k_shape, dtype: str) -> None:
    """Once per shape: an accelerator runs the XLA reference attention (correct, much slower)."""
    logger.warning(
        "paged attention on %s runs the XLA reference, not a Pallas kernel: the kernels refuse "
        "q %s over %s pages %s (docs/attention.md, Dispatch)", backend, q_shape, dtype, k_shape,
    )


def _latent_kernel(which: str, *, prefill: bool):
    """The latent attention kernel select_backend picked ("gpu" or "tpu"): mla.py's decode
    kernels, mla_prefill.py's ragged prefill kernels."""
    if prefill:
        from pallas_kernels import mla_prefill

        return {"gpu": mla_prefill.gpu_paged_prefill_attention,
                "tpu": mla_prefill.tpu_paged_prefill_attention}[which]  # fmt: skip
    from pallas_kernels import mla

    return {"gpu": mla.gpu_paged_decode_attention, "tpu": mla.tpu_paged_decode_attention}[which]


def gpu_decode_kernel(q_shape, k_shape, dtype, gpu_kernel: str | None) -> str:
    """Which GPU decode kernel runs: "mosaic" when asked for (argument, else
    $JPAGED_GPU_KERNEL) and the shape and dtype suit it, else "triton". dtype: the pages'
    (a QuantizedPages' codes). Quantized pages always run on Triton: the Mosaic kernel feeds
    16-bit pages straight to wgmma and has no dequantizing load (mosaic_gpu_decode.supports
    refuses int8 and fp8)."""
    if gpu_kernel is None:
        gpu_kernel = os.environ.get(GPU_KERNEL_ENV) or "triton"
    if gpu_kernel not in GPU_KERNELS:
        raise ValueError(f"unknown GPU kernel {gpu_kernel!r} (from the argument or "
                         f"${GPU_KERNEL_ENV}); expected one of {GPU_KERNELS}")
    if gpu_kernel == "mosaic":
        from pallas_kernels import mosaic_gpu_decode

        if mosaic_gpu_decode.supports(q_shape, k_shape, dtype):
            return "mosaic"
    return "triton"


def paged_decode_attention(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array | QuantizedPages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array | QuantizedPages,  # [num_kv_heads, num_pages, page_size, head_dim]
    lengths: jax.Array,  # int32[batch]; 0 gives zeros
    page_table: jax.Array,  # int32[batch, pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    backend: str | None = None,
    gpu_kernel: str | None = None,
    latent: bool = False,
    sinks: jax.Array | None = None,  # [num_q_heads]: gpt-oss's sink logits
) -> jax.Array:  # [batch, num_q_heads, head_dim], q's dtype
    """Decode attention (one query per sequence at position lengths[b] - 1), dispatched.

    See reference.paged_decode_attention for the contract. `backend` forces "gpu", "tpu"
    or "cpu"; `interpret` runs a Pallas kernel in the interpreter; `gpu_kernel` picks the
    GPU kernel ("triton" or "mosaic"; None: $JPAGED_GPU_KERNEL, else "triton"). sinks:
    one logit per query head joining each softmax's denominator (gpt-oss; None: none). Every
    kernel takes them, and without them traces the program it traced before they existed.
    latent: multi-head latent attention (reference.paged_prefill_attention), its own
    kernels (pallas_kernels/mla.py; no sinks).
    """
    kwargs = {"sm_scale": sm_scale, "soft_cap": soft_cap, "sliding_window": sliding_window}
    if latent:
        which = select_backend(q.shape, k_pages.shape, k_pages.dtype, interpret=interpret,
                               backend=backend, latent=True)  # fmt: skip
        if which == "cpu":
            return reference.paged_decode_attention(q, k_pages, v_pages, lengths, page_table,
                                                    latent=True, **kwargs)  # fmt: skip
        return _latent_kernel(which, prefill=False)(q, k_pages, v_pages, lengths, page_table,
                                                    interpret=interpret, **kwargs)  # fmt: skip
    if sinks is not None:  # only then: the other families' kernels are traced as before
        kwargs["sinks"] = sinks
    which = select_backend(
        q.shape, k_pages.shape, k_pages.dtype, interpret=interpret, backend=backend
    )
    if which == "gpu" and gpu_decode_kernel(q.shape, k_pages.shape, k_pages.dtype,
                                            gpu_kernel) == "mosaic":
        from pallas_kernels import mosaic_gpu_decode

        return mosaic_gpu_decode.paged_decode_attention(
            q, k_pages, v_pages, lengths, page_table, interpret=interpret, **kwargs
        )
    if which == "gpu":
        from pallas_kernels import gpu_decode

        return gpu_decode.paged_decode_attention(
            q, k_pages, v_pages, lengths, page_table, interpret=interpret, **kwargs
        )
    if which == "tpu":
        from pallas_kernels import tpu_decode

        return tpu_decode.paged_decode_attention(
            q, k_pages, v_pages, lengths, page_table, interpret=interpret, **kwargs
        )
    return reference.paged_decode_attention(q, k_pages, v_pages, lengths, page_table, **kwargs)


def paged_prefill_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k_pages: jax.Array | QuantizedPages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array | QuantizedPages,  # [num_kv_heads, num_pages, page_size, head_dim]
    context_lens: jax.Array,  # int32[num_seqs]
    page_table: jax.Array,  # int32[num_seqs, pages_per_seq]
    query_start: jax.Array,  # int32[num_seqs + 1]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    backend: str | None = None,
    max_query_len: int | None = None,
    latent: bool = False,
    sinks: jax.Array | None = None,  # [num_q_heads]: gpt-oss's sink logits
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim], q's dtype
    """Ragged paged attention (prefill chunks and decode tokens in one call), dispatched.

    See reference.paged_prefill_attention for the contract. max_query_len (static): the
    query tokens per sequence a step usually has at most (a verification step's k + 1); the
    reference then attends each sequence's queries as one group when they fit (the kernels
    take no hint). sinks as paged_decode_attention's. latent: multi-head latent attention,
    its own kernels in the absorbed form (pallas_kernels/mla_prefill.py; no sinks).
    """
    kwargs = {"sm_scale": sm_scale, "soft_cap": soft_cap, "sliding_window": sliding_window}
    args = (q, k_pages, v_pages, context_lens, page_table, query_start)
    if latent:
        which = select_backend(q.shape, k_pages.shape, k_pages.dtype, interpret=interpret,
                               backend=backend, latent=True)  # fmt: skip
        if which == "cpu":
            return reference.paged_prefill_attention(*args, max_query_len=max_query_len,
                                                     latent=True, **kwargs)  # fmt: skip
        return _latent_kernel(which, prefill=True)(*args, interpret=interpret, **kwargs)
    if sinks is not None:
        kwargs["sinks"] = sinks
    which = select_backend(
        q.shape, k_pages.shape, k_pages.dtype, interpret=interpret, backend=backend
    )
    if which == "gpu":
        from pallas_kernels import gpu_prefill

        return gpu_prefill.paged_prefill_attention(*args, interpret=interpret, **kwargs)
    if which == "tpu":
        from pallas_kernels import tpu_prefill

        return tpu_prefill.paged_prefill_attention(*args, interpret=interpret, **kwargs)
    return reference.paged_prefill_attention(*args, max_query_len=max_query_len, **kwargs)

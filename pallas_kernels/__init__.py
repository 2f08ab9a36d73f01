"""Paged attention: Pallas kernels for GPU and TPU, with pure-jnp references.

`paged_decode_attention` and `paged_prefill_attention` dispatch on the backend: the reference
on CPU (and wherever no kernel applies), Pallas kernels on GPU and TPU.
"""

from pallas_kernels.reference import paged_decode_attention, paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention"]

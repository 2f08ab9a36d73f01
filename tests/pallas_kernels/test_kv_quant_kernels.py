"""The Pallas kernels on quantized KV pages (kv_quant.QuantizedPages: int8, fp8 e4m3, fp8
e5m2 codes and a bfloat16 scale per token and KV head) against the reference on the same
quantized pages, and their lowering and dispatch.

The kernels run in interpret mode: GPU decode and prefill (Triton), TPU decode and prefill
(Mosaic TPU). Pools are NaN outside the written tokens, so an unwritten slot quantizes to a
NaN scale (and NaN fp8 codes): a kernel that lets one reach a product gives NaN. Lengths
end mid-page (7, 9, 21 with pages of 8), at a page end (8, 32) and at 0. Float32 queries
are held to the reference at atol = rtol = 1e-5; the reference computes q @ (s * k) where
the kernels compute (q @ k) * s, which differs by rounding only. Interpret mode compiles
each kernel variant for seconds, so the fp8 dtypes' plain variant and bf16 prefill run with
`-m slow`; every kernel meets every dtype by default (with a soft cap and a window).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gpu_target import lower_for_cuda
from paged_cases import check, decode_case, prefill_case, spec

import pallas_kernels
from pallas_kernels import (
    gpu_decode,
    gpu_prefill,
    kv_quant,
    reference,
    tpu_decode,
    tpu_prefill,
)
from pallas_kernels.kv_quant import QuantizedPages

DTYPES = {
    "int8": np.dtype(np.int8),
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
DECODE = {
    "gpu": functools.partial(gpu_decode.paged_decode_attention, interpret=True),
    "tpu": functools.partial(tpu_decode.paged_decode_attention, interpret=True),
}
PREFILL = {
    "gpu": functools.partial(gpu_prefill.paged_prefill_attention, interpret=True),
    "tpu": functools.partial(tpu_prefill.paged_prefill_attention, interpret=True),
}
CAP_WINDOW = {"soft_cap": 5.0, "sliding_window": 9}  # the window starts mid-page


def _variants():
    """(dtype, kernel keywords): every dtype with a soft cap and a window, and plain
    attention (int8 by default, fp8 with -m slow: interpret mode compiles each for seconds)."""
    for dtype in DTYPES:
        yield pytest.param(dtype, CAP_WINDOW, id=f"{dtype}-cap-window")
        yield pytest.param(dtype, {}, id=f"{dtype}-plain",
                           marks=() if dtype == "int8" else pytest.mark.slow)


def quantize_case(case, dtype):
    """The case with its pools quantized (NaN rows: NaN scales)."""
    case.k_pages = QuantizedPages(*kv_quant.quantize(case.k_pages, dtype))
    case.v_pages = QuantizedPages(*kv_quant.quantize(case.v_pages, dtype))
    return case


def assert_close(out, expected):
    out, expected = np.asarray(out), np.asarray(expected)
    assert out.shape == expected.shape and out.dtype == expected.dtype == np.float32
    assert np.isfinite(out).all() and np.isfinite(expected).all()
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


def decode_args(case):
    return (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)


def prefill_args(case):
    return decode_args(case) + (case.query_start,)


@pytest.mark.parametrize("dtype,kwargs", list(_variants()))
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_decode_kernel_on_quantized_pages_equals_the_reference(impl, dtype, kwargs):
    case = quantize_case(decode_case(5, lengths=[0, 1, 7, 8, 9, 21, 32], num_kv_heads=2,
                                     group=2, page_size=8, head_dim=64, dtype="float32"),
                         DTYPES[dtype])
    out = DECODE[impl](*decode_args(case), sm_scale=case.sm_scale, **kwargs)
    expected = reference.paged_decode_attention(*decode_args(case), sm_scale=case.sm_scale,
                                                **kwargs)
    assert_close(out, expected)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)  # length 0


@pytest.mark.parametrize("dtype,kwargs", list(_variants()))
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_prefill_kernel_on_quantized_pages_equals_the_reference(impl, dtype, kwargs):
    # An unscheduled sequence, a decode token, a whole prompt ending mid-page, a prefix
    # continued to a page end, a decode token on a full table, a chunk straddling pages.
    seqs = [(5, 0), (1, 1), (7, 7), (8, 2), (32, 1), (21, 13)]
    case = quantize_case(prefill_case(6, seqs=seqs, num_kv_heads=2, group=2, page_size=8,
                                      head_dim=64, dtype="float32"), DTYPES[dtype])
    out = PREFILL[impl](*prefill_args(case), sm_scale=case.sm_scale, **kwargs)
    expected = reference.paged_prefill_attention(*prefill_args(case), sm_scale=case.sm_scale,
                                                 **kwargs)
    assert_close(out, expected)
    pad = int(case.query_start[-1])
    np.testing.assert_array_equal(np.asarray(out[pad:]), 0.0)  # padding rows


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_decode_on_int8_pages_with_bfloat16_queries(impl):
    """The engine's GPU/TPU case: bfloat16 activations, int8 pages; the codes convert to
    bfloat16 exactly, so the bf16 tolerance (2e-2) holds against the float32 reference."""
    case = quantize_case(decode_case(7, lengths=[0, 7, 9, 32], num_kv_heads=2, group=2,
                                     page_size=8, head_dim=64, dtype="bfloat16"), np.int8)
    out = DECODE[impl](*decode_args(case), sm_scale=case.sm_scale)
    check(out, reference.paged_decode_attention(*decode_args(case), sm_scale=case.sm_scale))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_prefill_on_int8_pages_with_bfloat16_queries(impl):
    case = quantize_case(prefill_case(8, seqs=[(7, 7), (21, 5)], num_kv_heads=2, group=2,
                                      page_size=8, head_dim=64, dtype="bfloat16"), np.int8)
    out = PREFILL[impl](*prefill_args(case), sm_scale=case.sm_scale)
    check(out, reference.paged_prefill_attention(*prefill_args(case), sm_scale=case.sm_scale))


def test_k_and_v_must_both_be_quantized_or_both_plain():
    case = decode_case(0, lengths=[3], num_kv_heads=1, group=2, page_size=8, head_dim=64,
                       dtype="float32")
    k = QuantizedPages(*kv_quant.quantize(case.k_pages, np.int8))
    with pytest.raises(ValueError, match="k_pages and v_pages must both be QuantizedPages or "
                                         "both plain arrays, got QuantizedPages and "):
        gpu_decode.paged_decode_attention(case.q, k, case.v_pages, case.context_lens,
                                          case.page_table, sm_scale=1.0, interpret=True)


# --- lowering ---------------------------------------------------------------------------

HKV, NUM_PAGES, PAGE, HEAD_DIM = 8, 257, 16, 128


def quantized_pool(dtype):
    return QuantizedPages(spec((HKV, NUM_PAGES, PAGE, HEAD_DIM), dtype),
                          spec((HKV, NUM_PAGES, PAGE), "bfloat16"))


def kernel_args(dtype):
    """Abstract decode and prefill arguments: bf16 queries (32 heads), a quantized pool."""
    pool = quantized_pool(dtype)
    decode = (spec((8, 32, HEAD_DIM), "bfloat16"), pool, pool, spec((8,), "int32"),
              spec((8, 32), "int32"))
    prefill = (spec((512, 32, HEAD_DIM), "bfloat16"), pool, pool, spec((8,), "int32"),
               spec((8, 32), "int32"), spec((9,), "int32"))
    return decode, prefill


def lowered_text(fn, args, platform):
    kwargs = {"sm_scale": 0.125, "soft_cap": 30.0, "sliding_window": 100}
    if platform == "cuda":
        return lower_for_cuda(fn, args, **kwargs).as_text()
    return jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(
        lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernels_on_quantized_pages_lower_for_cuda_and_tpu(dtype):
    """Every kernel lowers with each quantized dtype, and the pool reaches the kernel call as
    stored: the module holds the codes [8, 257, 16, 128] in their dtype and never a
    dequantized copy of the pool."""
    mlir = {"int8": "i8", "e4m3": "f8E4M3FN", "e5m2": "f8E5M2"}[dtype]
    codes = f"tensor<{HKV}x{NUM_PAGES}x{PAGE}x{HEAD_DIM}x{mlir}>"
    decode, prefill = kernel_args(DTYPES[dtype])
    for platform, kernels, marker in (
        ("cuda", (gpu_decode, gpu_prefill), "__gpu$xla.gpu.triton"),
        ("tpu", (tpu_decode, tpu_prefill), "tpu_custom_call"),
    ):
        for module, args, name in ((kernels[0], decode, "paged_decode_attention"),
                                   (kernels[1], prefill, "paged_prefill_attention")):
            text = lowered_text(getattr(module, name), args, platform)
            assert marker in text, (platform, name)
            assert codes in text, (platform, name)
            for wide in ("bf16", "f32"):
                assert f"tensor<{HKV}x{NUM_PAGES}x{PAGE}x{HEAD_DIM}x{wide}>" not in text


# --- dispatch ---------------------------------------------------------------------------


def test_dispatch_sends_quantized_pages_to_the_kernels():
    pool = quantized_pool(np.int8)
    q, k = (4, 8, 128), pool.shape

    def sel(q, k, **kw):
        return pallas_kernels.select_backend(q, k, pool.dtype, **kw)

    assert [sel(q, k, interpret=False, backend=b) for b in ("gpu", "tpu", "cpu")] == [
        "gpu", "tpu", "cpu"]
    assert sel(q, k, interpret=True, backend=None) == "gpu"
    # Shapes a kernel refuses still fall back, quantized or not.
    assert sel((4, 8, 80), (2, 10, 16, 80), interpret=False, backend="gpu") == "cpu"
    assert sel(q, (2, 10, 12, 128), interpret=False, backend="tpu") == "cpu"
    # The Mosaic GPU kernel reads 16-bit pages only: quantized pages run on Triton.
    for dtype in DTYPES.values():
        assert pallas_kernels.gpu_decode_kernel(q, k, dtype, "mosaic") == "triton"
    assert pallas_kernels.gpu_decode_kernel(q, k, jnp.bfloat16, "mosaic") == "mosaic"


@pytest.mark.parametrize("backend,kernel", [(None, "jpaged_gpu"), ("tpu", "jpaged_tpu"),
                                            ("cpu", None)])
def test_dispatcher_traces_the_kernel_for_quantized_pages(backend, kernel):
    """Which implementation the dispatcher traces for a quantized pool (interpret=True on
    this CPU host): the kernel's pallas_call on "gpu" and "tpu", none on "cpu"."""
    case = quantize_case(decode_case(1, lengths=[9], num_kv_heads=1, group=2, page_size=8,
                                     head_dim=64, dtype="float32"), DTYPES["e4m3"])
    pcase = quantize_case(prefill_case(2, seqs=[(9, 3)], num_kv_heads=1, group=2, page_size=8,
                                       head_dim=64, dtype="float32"), DTYPES["e4m3"])
    kw = {"sm_scale": 0.125, "interpret": True, "backend": backend}
    jaxprs = [
        str(jax.make_jaxpr(functools.partial(pallas_kernels.paged_decode_attention, **kw))(
            *decode_args(case))),
        str(jax.make_jaxpr(functools.partial(pallas_kernels.paged_prefill_attention, **kw))(
            *prefill_args(pcase))),
    ]
    for text, name in zip(jaxprs, ("decode", "prefill"), strict=True):
        if kernel is None:
            assert "pallas_call" not in text
        else:
            assert f"{kernel}_{name}" in text

"""The kernels lower for their platforms on this CPU-only machine, and the dispatcher picks
the right implementation.

Lowering runs jax's own lowering for platform 'cuda' (Pallas -> Triton IR, serialized into
the custom call; for an abstract H200, gpu_target.h200) and 'tpu' (Pallas -> Mosaic MLIR,
serialized into tpu_custom_call). It catches kernels that no longer lower after an edit or a
jax upgrade. The Triton IR is compiled for sm_90 in test_sm90_compile.py; the Mosaic TPU
compiler needs the device's toolchain, so TPU layout problems are only caught on hardware.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_target import lower_for_cuda
from paged_cases import check, decode_case, prefill_case

import pallas_kernels
from pallas_kernels import gpu_decode, gpu_prefill, reference, tpu_decode, tpu_prefill


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def decode_specs(batch, ctx, hq, hkv, head_dim, page_size, dtype):
    pages_per_seq = ctx // page_size
    num_pages = batch * pages_per_seq + 1
    return (
        spec((batch, hq, head_dim), dtype),
        spec((hkv, num_pages, page_size, head_dim), dtype),
        spec((hkv, num_pages, page_size, head_dim), dtype),
        spec((batch,), "int32"),
        spec((batch, pages_per_seq), "int32"),
    )


def prefill_specs(tokens, seqs, ctx, hq, hkv, head_dim, page_size, dtype):
    pages_per_seq = ctx // page_size
    num_pages = seqs * pages_per_seq + 1
    return (
        spec((tokens, hq, head_dim), dtype),
        spec((hkv, num_pages, page_size, head_dim), dtype),
        spec((hkv, num_pages, page_size, head_dim), dtype),
        spec((seqs,), "int32"),
        spec((seqs, pages_per_seq), "int32"),
        spec((seqs + 1,), "int32"),
    )


def lower_text(fn, args, platform, **kwargs):
    if platform == "cuda":  # for an abstract H200: jax 0.11 asks which GPU it lowers for
        return lower_for_cuda(fn, args, sm_scale=0.125, **kwargs).as_text()

    def f(*a):
        return fn(*a, sm_scale=0.125, **kwargs)

    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


DECODE_SHAPES = [
    (64, 2048, 32, 8, 128, 16, "bfloat16"),  # the benchmark's main shape
    (8, 512, 32, 8, 128, 8, "bfloat16"),
    (4, 256, 8, 1, 64, 32, "float32"),  # MQA, f32
]


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_decode_lowers_for_cuda(shape):
    text = lower_text(gpu_decode.paged_decode_attention, decode_specs(*shape), "cuda")
    assert "jpaged_gpu_decode" in text
    assert "triton" in text.lower()


def test_gpu_decode_lowers_for_cuda_with_window_and_cap():
    text = lower_text(gpu_decode.paged_decode_attention, decode_specs(*DECODE_SHAPES[1]),
                      "cuda", soft_cap=30.0, sliding_window=100)
    assert "jpaged_gpu_decode" in text


def test_gpu_prefill_lowers_for_cuda():
    args = prefill_specs(512, 8, 1024, 32, 8, 128, 16, "bfloat16")
    text = lower_text(gpu_prefill.paged_prefill_attention, args, "cuda", sliding_window=256)
    assert "jpaged_gpu_prefill" in text
    assert "triton" in text.lower()


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tpu_decode_lowers_for_tpu(shape):
    text = lower_text(tpu_decode.paged_decode_attention, decode_specs(*shape), "tpu")
    assert "tpu_custom_call" in text


def test_tpu_prefill_lowers_for_tpu():
    args = prefill_specs(512, 8, 1024, 32, 8, 128, 16, "bfloat16")
    text = lower_text(tpu_prefill.paged_prefill_attention, args, "tpu", soft_cap=50.0)
    assert "tpu_custom_call" in text


def test_dispatch_backends(caplog):
    q, k = (4, 8, 128), (2, 10, 16, 128)
    f32 = jnp.dtype(jnp.float32)

    def sel(q, k, dtype=f32, **kw):
        return pallas_kernels.select_backend(q, k, dtype, **kw)

    assert sel(q, k, interpret=False, backend="gpu") == "gpu"
    assert sel(q, k, interpret=False, backend="cuda") == "gpu"
    assert sel(q, k, interpret=False, backend="tpu") == "tpu"
    assert sel(q, k, interpret=False, backend="cpu") == "cpu"
    # On this CPU host: reference by default, the GPU kernel interpreted on request.
    assert sel(q, k, interpret=False, backend=None) == "cpu"
    assert sel(q, k, interpret=True, backend=None) == "gpu"
    # Shapes a kernel cannot take fall back to the reference.
    assert sel((4, 8, 80), (2, 10, 16, 80), interpret=False, backend="gpu") == "cpu"
    assert sel((4, 8, 128), (2, 10, 12, 128), interpret=False, backend="gpu") == "cpu"
    assert sel((4, 8, 128), (2, 10, 12, 128), interpret=False, backend="tpu") == "cpu"
    # Triton offsets are int32 up to 4 GiB, int64 past it (test_sm90_compile.py reads them):
    # only 1-byte pools of 2**31 to 2**32 elements are refused.
    big = (8, 2**18, 16, 128)  # 2**32 elements: 16 GiB, 8 GiB, 4 GiB in 4, 2, 1 bytes
    assert sel((4, 8, 128), big, interpret=False, backend="gpu") == "gpu"
    assert sel((4, 8, 128), big, jnp.dtype(jnp.bfloat16), interpret=False, backend="gpu") == "gpu"
    assert sel((4, 8, 128), big, jnp.dtype(jnp.int8), interpret=False, backend="gpu") == "cpu"
    # A fallback on an accelerator is logged, once per shape.
    assert sel((4, 8, 128), big, jnp.dtype(jnp.int8), interpret=False, backend="gpu") == "cpu"
    assert [r.getMessage() for r in caplog.records if "int8" in r.getMessage()] == [
        "paged attention on gpu runs the XLA reference, not a Pallas kernel: the kernels refuse "
        "q (4, 8, 128) over int8 pages (8, 262144, 16, 128) (docs/attention.md, Dispatch)"
    ]
    assert sel((4, 8, 128), (8, 2**17, 16, 128), jnp.dtype(jnp.int8), interpret=False,
               backend="gpu") == "gpu"  # 2**31 elements
    with pytest.raises(ValueError, match="unknown backend"):
        sel(q, k, interpret=False, backend="metal")


def test_dispatch_cpu_is_the_reference_and_kernel_path_matches_inside_jit():
    case = decode_case(1, lengths=[0, 1, 17, 33], num_kv_heads=2, group=2, page_size=16,
                       head_dim=64, dtype="float32")
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    ref = reference.paged_decode_attention(*args, sm_scale=case.sm_scale)
    out_cpu = jax.jit(
        lambda *a: pallas_kernels.paged_decode_attention(*a, sm_scale=case.sm_scale)
    )(*args)
    np.testing.assert_array_equal(np.asarray(out_cpu), np.asarray(ref))
    for backend in (None, "tpu"):
        out = jax.jit(
            lambda *a, b=backend: pallas_kernels.paged_decode_attention(
                *a, sm_scale=case.sm_scale, interpret=True, backend=b)
        )(*args)
        check(out, ref)


@pytest.mark.slow
def test_dispatch_prefill_kernel_path_inside_jit():
    case = prefill_case(2, seqs=[(9, 9), (20, 1), (17, 4)], num_kv_heads=2, group=2,
                        page_size=8, head_dim=64, dtype="float32")
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table,
            case.query_start)
    ref = reference.paged_prefill_attention(*args, sm_scale=case.sm_scale)
    for backend in (None, "tpu"):
        out = jax.jit(
            lambda *a, b=backend: pallas_kernels.paged_prefill_attention(
                *a, sm_scale=case.sm_scale, interpret=True, backend=b)
        )(*args)
        check(out, ref)

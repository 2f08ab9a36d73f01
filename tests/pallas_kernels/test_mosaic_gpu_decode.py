"""The Mosaic GPU decode kernel (pallas_kernels/mosaic_gpu_decode.py): lowered for an H200 on
this CPU host under both supported jax versions, run in jax's GPU interpreter against the
reference where jax allows it, and chosen by the dispatcher only when asked for.

What each jax version allows (measured on this CPU host):
- lowering for 'cuda' inside an abstract H200: jax 0.10.2 and 0.11.2 (a `mosaic_gpu_v2`
  custom call). The Mosaic GPU compiler itself (MLIR -> PTX) runs on the device, so this
  kernel has not been compiled to a cubin here, unlike the Triton ones (test_sm90_compile).
- GPU interpret mode (SMEM, TMA, mbarriers and wgmma simulated on the CPU,
  `plgpu.InterpretGPUParams`): jax 0.11.2. jax 0.10.2's interpreter has no rule for
  `layout_cast` ("MLIR translation rule for primitive 'layout_cast' not found for platform
  cpu"), which every wgmma-layout array needs; the test asserts exactly that there.
Inputs as in the Triton tests: NaN pools except written tokens, shuffled page tables, lengths
0, 1, ps - 1, ps, ps + 1 and full in one batch; bf16 tolerance atol = rtol = 2e-2 per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_target import lower_for_cuda
from paged_cases import check, decode_case, decode_specs

import pallas_kernels
from pallas_kernels import mosaic_gpu_decode, reference, tuning

JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
INTERPRETS = JAX_VERSION >= (0, 11)


@pytest.mark.parametrize(
    "shape,kwargs",
    [
        ((64, 128, 32, 8, 128, 16, 8193, "bfloat16"), {}),  # bench_attention's 64 x 2048
        ((32, 128, 32, 8, 64, 16, 200_000, "bfloat16"), {}),  # 1B, the largest decode bucket
        ((8, 4, 32, 8, 128, 128, 40, "float16"), {"soft_cap": 30.0, "sliding_window": 100}),
    ],
    ids=["bench-64x2048", "llama1b-s32-p128", "page128-f16-window-cap"],
)
def test_mosaic_decode_lowers_for_cuda(shape, kwargs):
    lowered = lower_for_cuda(mosaic_gpu_decode.paged_decode_attention, decode_specs(*shape),
                             sm_scale=shape[4] ** -0.5, **kwargs)
    text = lowered.as_text()
    assert "stablehlo.custom_call @mosaic_gpu" in text
    assert "triton" not in text


def run_interpreted(case, blocks=None, **kwargs):
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    out = mosaic_gpu_decode.paged_decode_attention(*args, sm_scale=case.sm_scale,
                                                   interpret=True, blocks=blocks, **kwargs)
    return out, reference.paged_decode_attention(*args, sm_scale=case.sm_scale, **kwargs)


def edge_lengths(page_size, pages_per_seq=4):
    full = page_size * pages_per_seq
    return [0, 1, page_size - 1, page_size, page_size + 1, full]


def _matrix():
    """(page_size, head_dim, kv heads, group): every page size, both head dims, GQA 1-8 and
    MQA with a group of 12 (a few seconds each in the interpreter)."""
    for ps, d, hkv, group in [(16, 64, 2, 4), (8, 128, 1, 8), (32, 64, 4, 1), (64, 128, 1, 12),
                              (128, 64, 2, 2)]:
        yield pytest.param(ps, d, hkv, group, id=f"ps{ps}-d{d}-kv{hkv}g{group}")


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group", list(_matrix()))
def test_mosaic_decode_interpreted_equals_reference(page_size, head_dim, num_kv_heads, group):
    case = decode_case(page_size, lengths=edge_lengths(page_size), num_kv_heads=num_kv_heads,
                       group=group, page_size=page_size, head_dim=head_dim, dtype="bfloat16")
    if not INTERPRETS:
        with pytest.raises(NotImplementedError, match="layout_cast"):
            run_interpreted(case)
        return
    out, expected = run_interpreted(case)
    check(out, expected)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # length 0


@pytest.mark.slow
def test_mosaic_decode_interpreted_splits_window_and_cap():
    """Uneven splits over 13 pages, and soft cap / sliding window."""
    case = decode_case(5, lengths=[0, 1, 15, 16, 17, 40, 64, 100], num_kv_heads=2, group=4,
                       page_size=8, head_dim=64, dtype="bfloat16", pages_per_seq=13)
    for kwargs in ({"blocks": tuning.DecodeBlocks(group_rows=64, pages_per_block=8,
                                                  num_splits=3)},
                   {"soft_cap": 5.0}, {"sliding_window": 9},
                   {"soft_cap": 2.0, "sliding_window": 30}):
        if not INTERPRETS:
            with pytest.raises(NotImplementedError, match="layout_cast"):
                run_interpreted(case, **kwargs)
            continue
        out, expected = run_interpreted(case, **kwargs)
        check(out, expected)


def test_dispatch_chooses_the_gpu_decode_kernel(monkeypatch):
    choose = pallas_kernels.gpu_decode_kernel
    q, k = (4, 32, 128), (8, 10, 16, 128)
    monkeypatch.delenv("JPAGED_GPU_KERNEL", raising=False)
    assert choose(q, k, jnp.bfloat16, None) == "triton"  # the default
    assert choose(q, k, jnp.bfloat16, "mosaic") == "mosaic"
    assert choose(q, k, jnp.float32, "mosaic") == "triton"  # wgmma: 16-bit operands only
    assert choose((4, 32, 80), (8, 10, 16, 80), jnp.bfloat16, "mosaic") == "triton"
    monkeypatch.setenv("JPAGED_GPU_KERNEL", "mosaic")
    assert choose(q, k, jnp.bfloat16, None) == "mosaic"
    assert choose(q, k, jnp.bfloat16, "triton") == "triton"  # the argument wins
    monkeypatch.setenv("JPAGED_GPU_KERNEL", "cuda")
    with pytest.raises(ValueError, match="unknown GPU kernel 'cuda'"):
        choose(q, k, jnp.bfloat16, None)


def test_dispatcher_lowers_the_chosen_kernel(monkeypatch):
    monkeypatch.delenv("JPAGED_GPU_KERNEL", raising=False)
    args = decode_specs(8, 32, 32, 8, 128, 16, 257, "bfloat16")

    def lowered(**kwargs):
        return lower_for_cuda(pallas_kernels.paged_decode_attention, args, sm_scale=0.088,
                              backend="gpu", **kwargs).as_text()

    assert "__gpu$xla.gpu.triton" in lowered()
    assert "@mosaic_gpu" in lowered(gpu_kernel="mosaic")
    assert "__gpu$xla.gpu.triton" in lowered(gpu_kernel="triton")

"""Decode kernels (GPU Triton, TPU Mosaic) in Pallas interpret mode against the reference.

Pools are NaN except for written tokens and page tables are shuffled (see paged_cases).
One batch holds the lengths 0, 1, ps - 1, ps, ps + 1 and full, so every call checks all of
them. Tolerances are per element: f32 atol = rtol = 2e-5, bf16 atol = rtol = 2e-2.

Interpret mode compiles each kernel shape for a minute or more on a 2-core CPU, so only a
representative subset runs by default; `pytest -m slow tests/pallas_kernels` runs the rest
(the full matrix), and both sets are meant to pass.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import check, decode_case

from pallas_kernels import gpu_decode, reference, tpu_decode, tuning

IMPLS = {
    "gpu": functools.partial(gpu_decode.paged_decode_attention, interpret=True),
    "tpu": functools.partial(tpu_decode.paged_decode_attention, interpret=True),
}


def edge_lengths(page_size, pages_per_seq=4):
    full = page_size * pages_per_seq
    return [0, 1, page_size - 1, page_size, page_size + 1, full]


def run(impl, case, **kwargs):
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    out = IMPLS[impl](*args, sm_scale=case.sm_scale, **kwargs)
    expected = reference.paged_decode_attention(*args, sm_scale=case.sm_scale, **kwargs)
    return out, expected


def _matrix():
    """page size x head_dim x dtype; one combination runs by default, the rest with -m slow."""
    for ps in (8, 16, 32):
        for d in (64, 128):
            for dt in ("float32", "bfloat16"):
                fast = (ps, d, dt) == (8, 64, "float32")
                yield pytest.param(ps, d, dt, marks=() if fast else pytest.mark.slow,
                                   id=f"ps{ps}-d{d}-{dt}")


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize("page_size,head_dim,dtype", list(_matrix()))
def test_decode_page_sizes_dims_dtypes(impl, page_size, head_dim, dtype):
    case = decode_case(page_size, lengths=edge_lengths(page_size), num_kv_heads=2, group=4,
                       page_size=page_size, head_dim=head_dim, dtype=dtype)
    out, expected = run(impl, case)
    check(out, expected)
    # Length 0 gives exact zeros, not NaN or garbage.
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "num_kv_heads,group",
    [pytest.param(4, 1, id="gqa1", marks=pytest.mark.slow),
     pytest.param(2, 2, id="gqa2", marks=pytest.mark.slow),
     pytest.param(2, 4, id="gqa4", marks=pytest.mark.slow),
     pytest.param(1, 8, id="gqa8", marks=pytest.mark.slow),
     pytest.param(1, 12, id="mqa12")],
)
def test_decode_gqa_and_mqa(impl, num_kv_heads, group):
    case = decode_case(group, lengths=edge_lengths(16, 3), num_kv_heads=num_kv_heads,
                       group=group, page_size=16, head_dim=64, dtype="float32")
    out, expected = run(impl, case)
    check(out, expected)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_decode_soft_cap_and_sliding_window(impl):
    case = decode_case(7, lengths=[0, 1, 7, 8, 9, 21, 32], num_kv_heads=2, group=2,
                       page_size=8, head_dim=64, dtype="float32")
    for kwargs in ({"soft_cap": 5.0}, {"sliding_window": 5}, {"sliding_window": 9},
                   {"soft_cap": 2.0, "sliding_window": 16}):
        out, expected = run(impl, case, **kwargs)
        check(out, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "blocks",
    [
        tuning.DecodeBlocks(group_rows=16, pages_per_block=1, num_splits=1),
        tuning.DecodeBlocks(group_rows=16, pages_per_block=2, num_splits=3),
        tuning.DecodeBlocks(group_rows=32, pages_per_block=4, num_splits=4),
    ],
    ids=["ppb1", "ppb2-split3", "ppb4-split4"],
)
def test_gpu_decode_splits_and_blocks(blocks):
    """Uneven split counts, several pages per block, blocks wider than the table."""
    case = decode_case(3, lengths=[0, 1, 15, 16, 17, 40, 64, 100], num_kv_heads=2, group=4,
                       page_size=8, head_dim=64, dtype="float32", pages_per_seq=13)
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    out = gpu_decode.paged_decode_attention(*args, sm_scale=case.sm_scale, interpret=True,
                                            blocks=blocks)
    check(out, reference.paged_decode_attention(*args, sm_scale=case.sm_scale))


@pytest.mark.slow
@pytest.mark.parametrize("ppb", [1, 2, 4])
def test_tpu_decode_pages_per_block(ppb):
    """Odd block counts exercise both buffer slots and the last, partly copied block."""
    case = decode_case(4, lengths=[0, 1, 15, 16, 17, 40, 64, 100], num_kv_heads=2, group=4,
                       page_size=8, head_dim=64, dtype="float32", pages_per_seq=13)
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    blocks = tuning.DecodeBlocks(group_rows=8, pages_per_block=ppb, num_splits=1)
    out = tpu_decode.paged_decode_attention(*args, sm_scale=case.sm_scale, interpret=True,
                                            blocks=blocks)
    check(out, reference.paged_decode_attention(*args, sm_scale=case.sm_scale))


def test_merge_splits_is_exact_for_empty_splits():
    acc = jnp.array([[[1.0, 2.0]], [[0.0, 0.0]]])  # split 1 saw no key
    m = jnp.array([[0.5], [-1e30]])
    l = jnp.array([[2.0], [0.0]])
    from pallas_kernels.common import merge_splits

    np.testing.assert_allclose(np.asarray(merge_splits(acc, m, l)), [[0.5, 1.0]])
    np.testing.assert_array_equal(np.asarray(merge_splits(acc * 0, m * 0 - 1e30, l * 0)), 0.0)

"""Ragged prefill kernels (GPU Triton, TPU Mosaic) in interpret mode against the reference.

One mixed batch per call: an unscheduled sequence (no query rows), a decode token at length
1, a whole prompt of ps - 1 tokens, a chunk continuing a prefix at ps + 1, a decode token
on a full table, a long chunk straddling several query blocks, and padding rows at the end.
Tolerances per element: f32 atol = rtol = 2e-5, bf16 atol = rtol = 2e-2.
A representative subset runs by default; `-m slow` runs the rest of the matrix.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from paged_cases import check, prefill_case

from pallas_kernels import gpu_prefill, reference, tpu_prefill, tuning

IMPLS = {
    "gpu": functools.partial(gpu_prefill.paged_prefill_attention, interpret=True),
    "tpu": functools.partial(tpu_prefill.paged_prefill_attention, interpret=True),
}


def mixed_seqs(ps, full_pages=4):
    full = ps * full_pages
    return [(5, 0), (1, 1), (ps - 1, ps - 1), (ps, 2), (ps + 1, 3), (full, 1),
            (2 * ps + 3, ps + 5)]


def run(impl, case, **kwargs):
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table,
            case.query_start)
    out = IMPLS[impl](*args, sm_scale=case.sm_scale, **kwargs)
    expected = reference.paged_prefill_attention(*args, sm_scale=case.sm_scale, **kwargs)
    return out, expected


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "page_size,head_dim,dtype",
    [pytest.param(8, 64, "float32")]
    + [pytest.param(*c, marks=pytest.mark.slow)
       for c in [(16, 128, "bfloat16"), (32, 64, "bfloat16"), (16, 64, "float32"),
                 (8, 128, "bfloat16"), (32, 128, "float32")]],
)
def test_prefill_mixed_batch(impl, page_size, head_dim, dtype):
    case = prefill_case(page_size, seqs=mixed_seqs(page_size), num_kv_heads=2, group=2,
                        page_size=page_size, head_dim=head_dim, dtype=dtype)
    out, expected = run(impl, case)
    check(out, expected)
    # Padding rows (past query_start[-1]) are exact zeros.
    pad = int(case.query_start[-1])
    np.testing.assert_array_equal(np.asarray(out[pad:], np.float32), 0.0)


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "num_kv_heads,group",
    [pytest.param(2, 1, id="gqa1", marks=pytest.mark.slow),
     pytest.param(2, 2, id="gqa2", marks=pytest.mark.slow),
     pytest.param(1, 4, id="gqa4", marks=pytest.mark.slow),
     pytest.param(1, 8, id="gqa8", marks=pytest.mark.slow),
     pytest.param(1, 6, id="mqa6")],
)
def test_prefill_gqa_and_mqa(impl, num_kv_heads, group):
    case = prefill_case(group, seqs=mixed_seqs(8, 3), num_kv_heads=num_kv_heads, group=group,
                        page_size=8, head_dim=64, dtype="float32")
    out, expected = run(impl, case)
    check(out, expected)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_prefill_soft_cap_and_sliding_window(impl):
    case = prefill_case(11, seqs=mixed_seqs(8), num_kv_heads=1, group=2, page_size=8,
                        head_dim=64, dtype="float32")
    for kwargs in ({"soft_cap": 3.0}, {"sliding_window": 4}, {"sliding_window": 11}):
        out, expected = run(impl, case, **kwargs)
        check(out, expected)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_prefill_small_query_blocks(impl):
    """Query blocks smaller than sequences and sequences smaller than blocks, 1 page/block."""
    case = prefill_case(5, seqs=mixed_seqs(8), num_kv_heads=2, group=2, page_size=8,
                        head_dim=64, dtype="float32", pad_tokens=9)
    blocks = tuning.PrefillBlocks(group_rows=2, block_q=8, pages_per_block=1)
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table,
            case.query_start)
    out = IMPLS[impl](*args, sm_scale=case.sm_scale, blocks=blocks)
    check(out, reference.paged_prefill_attention(*args, sm_scale=case.sm_scale))

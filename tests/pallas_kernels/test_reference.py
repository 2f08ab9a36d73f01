"""The reference paged attention against a dense float64 oracle written with numpy loops.

The reference is the ground truth the kernels are held to and the CPU engine's attention, and
it is not a plain formula: query blocks, key blocks over only the keys a block can see, an
online softmax, keys gathered per sequence or per token, unneeded pages read as the null
page. Every one of those paths is driven here on NaN-filled pools with shuffled page tables
(tests/pallas_kernels/paged_cases.py): blocks of one, two and many sequences, decode rows,
chunks continuing a prefix, rows with no query tokens, padding rows, several query and key
blocks (the block sizes shrunk so that small cases cross them), sliding windows and soft
capping. Tolerances per element: f32 atol = rtol = 2e-5, bf16 atol = rtol = 2e-2.

On the CPU a float32 step runs the C++ kernel instead (pallas_kernels/cpu_kernel.py), so every
test runs twice: as the CPU serves it ("kernel") and with the kernel reported unavailable
("gather": the jnp path above, the one other platforms lower).
"""

from __future__ import annotations

import numpy as np
import pytest
from paged_cases import check, decode_case, prefill_case

from pallas_kernels import cpu_kernel, reference


def dense(case, *, soft_cap=None, sliding_window=None):
    """Causal attention of each query row over its sequence's tokens, read slot by slot."""
    q = np.asarray(case.q, np.float64)
    k_pages = np.asarray(case.k_pages.astype("float32"), np.float64)
    v_pages = np.asarray(case.v_pages.astype("float32"), np.float64)
    lens = np.asarray(case.context_lens)
    table = np.asarray(case.page_table)
    qs = np.arange(len(lens) + 1) if case.query_start is None else np.asarray(case.query_start)
    hkv, _, ps, _ = k_pages.shape
    group = q.shape[1] // hkv
    out = np.zeros(q.shape)
    for s, n in enumerate(lens):
        if n == 0:  # no keys (a decode row of length 0): zeros
            continue
        rows = range(qs[s], qs[s + 1])
        slots = [(table[s, j // ps], j % ps) for j in range(n)]
        k = np.stack([k_pages[:, p, o] for p, o in slots], 1)  # [Hkv, n, D]
        v = np.stack([v_pages[:, p, o] for p, o in slots], 1)
        for i, t in enumerate(rows):
            pos = n - len(rows) + i
            keys = np.arange(pos + 1)
            if sliding_window is not None:
                keys = keys[keys > pos - sliding_window]
            for h in range(q.shape[1]):
                kh = h // group
                sc = k[kh, keys] @ q[t, h] * case.sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                p = np.exp(sc - sc.max())
                out[t, h] = p @ v[kh, keys] / p.sum()
    return out


def run(case, **kwargs):
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    if case.query_start is None:
        return reference.paged_decode_attention(*args, sm_scale=case.sm_scale, **kwargs)
    return reference.paged_prefill_attention(*args, case.query_start, sm_scale=case.sm_scale,
                                             **kwargs)


def assert_matches(case, max_query_len=None, **kwargs):
    extra = {} if max_query_len is None else {"max_query_len": max_query_len}
    out = run(case, **extra, **kwargs)
    expected = dense(case, **kwargs)
    check(out, expected.astype(np.float32).astype(out.dtype))
    pad = len(case.context_lens) if case.query_start is None else int(case.query_start[-1])
    np.testing.assert_array_equal(np.asarray(out[pad:], np.float32), 0.0)  # padding rows


@pytest.fixture(autouse=True, params=["kernel", "gather"])
def path(request, monkeypatch):
    """Which CPU path float32 steps take: the C++ kernel or the reference's gathers."""
    if request.param == "gather":
        monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    return request.param


@pytest.fixture
def small_blocks(monkeypatch):
    """Query blocks of 8 tokens and key blocks of 2 pages, so small cases cross both."""
    monkeypatch.setattr(reference, "_TOKEN_BLOCK", 8)
    monkeypatch.setattr(reference, "_KEY_BLOCK", 8)


# (context_len, query_len): a row with no query tokens, decode rows, whole prompts, chunks
# continuing a prefix, a long prompt (71 query tokens). In blocks of 8 the order puts two
# sequences in the first block, four in the second, one in the third, and so on.
MIXED = [(5, 0), (1, 1), (7, 7), (12, 2), (9, 3), (30, 1), (23, 13), (40, 40), (3, 3), (33, 1)]


@pytest.mark.parametrize("blocks", ["default", "small"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_matches_dense(request, blocks, dtype):
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    for pad in (1, 9):  # 72 and 80 tokens: whole blocks of 8 (the lax.map path)
        case = prefill_case(1, seqs=MIXED, num_kv_heads=2, group=3, page_size=4, head_dim=16,
                            dtype=dtype, pad_tokens=pad)
        assert_matches(case)


@pytest.mark.parametrize("kwargs", [{"sliding_window": 5}, {"soft_cap": 2.0},
                                    {"sliding_window": 9, "soft_cap": 5.0}])
def test_prefill_window_and_cap(small_blocks, kwargs):
    case = prefill_case(2, seqs=MIXED, num_kv_heads=1, group=4, page_size=4, head_dim=8,
                        dtype="float32", pad_tokens=1)
    assert_matches(case, **kwargs)


@pytest.mark.parametrize("blocks", ["default", "small"])
def test_decode_matches_dense(request, blocks):
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    case = decode_case(3, lengths=[1, 0, 17, 64, 5, 33, 48, 2], num_kv_heads=2, group=2,
                       page_size=4, head_dim=16, dtype="float32")
    assert_matches(case)
    assert_matches(case, sliding_window=6)


def test_wide_table_reads_only_what_rows_see(small_blocks):
    """A page table much wider than any sequence (a large page bucket) gives the same
    result: key blocks past every row's context are never run, and their NaN is unseen."""
    case = decode_case(4, lengths=[3, 9, 1], num_kv_heads=1, group=2, page_size=4,
                       head_dim=8, dtype="float32", pages_per_seq=16)
    assert_matches(case)


@pytest.mark.parametrize("blocks", ["default", "small"])
def test_decode_sub_blocks_sorted_by_length_match_dense_and_the_unsorted_path(
    request, blocks, monkeypatch
):
    """32 decode rows of mixed lengths (padding rows of length 0 among them) go in sub-blocks
    of 8 sorted by length, each over only its own longest context's key blocks: the same
    values as the dense oracle, and the same as one block over the longest up to float32
    rounding (the products run in other shapes; skipped key blocks change nothing)."""
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    lengths = [1, 0, 17, 64, 5, 33, 48, 2, 90, 3, 0, 7, 61, 12, 1, 29,
               44, 8, 100, 0, 15, 6, 77, 21, 2, 38, 9, 55, 4, 0, 70, 11]  # fmt: skip
    case = decode_case(5, lengths=lengths, num_kv_heads=2, group=2, page_size=4,
                       head_dim=16, dtype="float32")
    for kwargs in ({}, {"sliding_window": 6}):
        assert_matches(case, **kwargs)
        sorted_out = np.asarray(run(case, **kwargs))
        monkeypatch.setattr(reference, "_DECODE_SUB_BLOCK", 1 << 20)  # one block, unsorted
        np.testing.assert_allclose(sorted_out, np.asarray(run(case, **kwargs)), rtol=1e-6,
                                   atol=1e-6)
        monkeypatch.setattr(reference, "_DECODE_SUB_BLOCK", 8)


# A verification step's shape: decode rows with 0-4 proposals (1-5 query tokens each), a row
# with no query tokens, contexts crossing several pages and key blocks.
VERIFY = [(9, 5), (1, 1), (30, 3), (5, 0), (17, 5), (44, 2), (4, 4), (63, 1)]


@pytest.mark.parametrize("blocks", ["default", "small"])
@pytest.mark.parametrize("kwargs", [{}, {"sliding_window": 6}, {"soft_cap": 2.0}])
def test_grouped_queries_match_dense(request, blocks, kwargs):
    """max_query_len: sequences of at most that many query tokens are attended in groups
    per sequence, each sequence's keys gathered once; the same values as the dense oracle,
    padding rows zero, and the same as the per-token path up to float32 rounding."""
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    case = prefill_case(6, seqs=VERIFY, num_kv_heads=2, group=3, page_size=4, head_dim=16,
                        dtype="float32", pad_tokens=5)
    assert_matches(case, max_query_len=5, **kwargs)
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table,
            case.query_start)
    kw = {"soft_cap": None, "sliding_window": None, **kwargs}
    grouped = reference._attend_grouped(*args, max_query_len=5, sm_scale=case.sm_scale, **kw)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(run(case, **kwargs)),
                               rtol=1e-6, atol=1e-6)


def test_grouped_queries_fall_back_when_a_sequence_has_more():
    """A step where some sequence has more query tokens than max_query_len (a prompt in a
    verification step) takes the general path: still the dense oracle's values."""
    case = prefill_case(7, seqs=MIXED, num_kv_heads=2, group=2, page_size=4, head_dim=16,
                        dtype="float32", pad_tokens=3)
    assert_matches(case, max_query_len=5)
    grouped = reference._attend_grouped(
        case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table,
        case.query_start, max_query_len=5, sm_scale=case.sm_scale, soft_cap=None,
        sliding_window=None)
    assert not np.allclose(np.asarray(grouped), dense(case), atol=1e-3)  # would be wrong

"""Prompt-lookup proposals: exact tokens on hand-built sequences (vLLM's examples and rules:
longest n first, earliest occurrence, cut at k, the sequence end and max_model_len), a
brute-force reference over random batches, and the per-slot token mirror of NgramProposer."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.config import SpeculativeConfig
from jpaged.spec_decode.ngram_proposer import NgramProposer, matched_prefix, ngram_propose


def propose_one(tokens, *, lo, hi, k, max_model_len=None) -> list[int]:
    buf = np.asarray([tokens], np.int32)
    proposals, num = ngram_propose(
        buf,
        np.array([len(tokens)]),
        np.array([k]),
        prompt_lookup_min=lo,
        prompt_lookup_max=hi,
        max_model_len=max_model_len,
        width=k,
    )
    assert (proposals[0, num[0] :] == -1).all()
    return proposals[0, : num[0]].tolist()


def reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The definition: the longest n in [lo, hi] whose suffix occurs earlier, its earliest
    occurrence, up to k tokens after it."""
    size = len(tokens)
    for n in range(hi, lo - 1, -1):
        for start in range(size - n):
            if tokens[start : start + n] == tokens[size - n :]:
                return tokens[start + n : start + n + k]
    return []


def test_vllm_docstring_example():
    # vLLM: [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] has no match, [2,3] does -> [4,2,3].
    assert propose_one([1, 2, 3, 4, 2, 3], lo=2, hi=3, k=4) == [4, 2, 3]


def test_longest_n_wins_over_earlier_shorter_match():
    # "8 9" occurs at 0 (followed by 1); "7 8 9" occurs at 4 (followed by 2).
    seq = [8, 9, 1, 0, 7, 8, 9, 2, 5, 7, 8, 9]
    assert propose_one(seq, lo=2, hi=3, k=2) == [2, 5]
    # Capped at n = 2 both occurrences match; the earliest wins.
    assert propose_one(seq, lo=2, hi=2, k=2) == [1, 0]
    # n = 1 alone: the earliest 9.
    assert propose_one(seq, lo=1, hi=1, k=3) == [1, 0, 7]


def test_earliest_occurrence_of_the_longest():
    seq = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose_one(seq, lo=1, hi=4, k=1) == [1]


def test_min_n_and_no_match():
    seq = [1, 2, 3, 4, 5, 3]  # only a 1-gram match
    assert propose_one(seq, lo=1, hi=3, k=2) == [4, 5]
    assert propose_one(seq, lo=2, hi=3, k=2) == []
    assert propose_one([1, 2, 3, 4], lo=1, hi=2, k=2) == []
    assert propose_one([4], lo=1, hi=2, k=2) == []


def test_cut_at_k_sequence_end_and_max_model_len():
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose_one(seq, lo=2, hi=2, k=3) == [3, 4, 5]
    assert propose_one(seq, lo=2, hi=2, k=10) == [3, 4, 5, 6, 1, 2]
    assert propose_one(seq, lo=2, hi=2, k=10, max_model_len=10) == [3, 4]
    assert propose_one(seq, lo=2, hi=2, k=10, max_model_len=8) == []
    # A run overlapping its own suffix: [1,1,1,1] matches "1 1" at 0, followed by two tokens.
    assert propose_one([1, 1, 1, 1], lo=2, hi=2, k=5) == [1, 1]


def test_batch_equals_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        batch = int(rng.integers(1, 9))
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        width = int(rng.integers(1, 6))
        seqs = [
            rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(1, 40))).tolist()
            for _ in range(batch)
        ]
        caps = rng.integers(0, width + 1, batch)
        buf = np.full((batch, 48), 9, np.int32)  # stale values past each row's end
        for row, seq in enumerate(seqs):
            buf[row, : len(seq)] = seq
        lens = np.array([len(s) for s in seqs])
        proposals, num = ngram_propose(
            buf, lens, caps, prompt_lookup_min=lo, prompt_lookup_max=hi, width=width
        )
        assert proposals.shape == (batch, width) and proposals.dtype == np.int32
        for row, seq in enumerate(seqs):
            assert proposals[row, : num[row]].tolist() == reference(seq, lo, hi, int(caps[row]))
            assert (proposals[row, num[row] :] == -1).all()


def make_proposer(k=3, lo=2, hi=3, max_num_seqs=4, max_model_len=4096) -> NgramProposer:
    config = SpeculativeConfig(
        method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi
    )
    return NgramProposer(config, max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def test_proposer_mirror_follows_sequences():
    p = make_proposer()
    a = [1, 2, 3, 4, 1, 2]
    b = [7, 8, 9, 7, 8]
    proposals, num = p.propose([2, 0], [10, 11], [a, b])
    assert proposals.tolist() == [[3, 4, 1], [9, 7, 8]] and num.tolist() == [3, 3]
    a += [3, 4, 1, 2, 5]  # appended since: only the tail is copied
    proposals, num = p.propose([2, 0], [10, 11], [a, b])
    assert proposals[0, : num[0]].tolist() == reference(a, 2, 3, 3)
    # Slot 2 now holds another sequence (same length): the mirror is rebuilt.
    c = [5, 5, 6, 6, 5, 5, 6, 0, 0, 5, 5]
    proposals, num = p.propose([2], [12], [c])
    assert proposals[0, : num[0]].tolist() == reference(c, 2, 3, 3) == [6, 6, 5]
    # Per-sequence caps; 0 proposes nothing.
    proposals, num = p.propose([2, 0], [12, 11], [c, b], np.array([1, 0]))
    assert proposals.tolist() == [[6, -1, -1], [-1, -1, -1]] and num.tolist() == [1, 0]


def test_proposer_grows_past_initial_width():
    p = make_proposer(max_model_len=5000)
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 1000, 3000).tolist()
    seq += seq[100:103]
    proposals, num = p.propose([1], [5], [seq])
    assert proposals[0, : num[0]].tolist() == reference(seq, 2, 3, 3) == seq[103:106]


def test_proposer_needs_ngram_config():
    config = SpeculativeConfig(num_speculative_tokens=2, model="/ckpt/draft")
    with pytest.raises(ValueError, match="ngram"):
        NgramProposer(config, max_num_seqs=2, max_model_len=16)


def test_matched_prefix_stops_at_the_first_mismatch_or_either_end():
    assert matched_prefix([5, 6, 7], [5, 6, 9, 7]) == 2
    assert matched_prefix([5, 6, 7], [5, 6]) == 2  # only two tokens came so far
    assert matched_prefix([5, 6], [5, 6, 7]) == 2
    assert matched_prefix([5], [4]) == 0 and matched_prefix([], [1]) == 0

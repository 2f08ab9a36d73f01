"""N-gram (prompt lookup) proposals on the host, vLLM's semantics, vectorised over a batch.

For a sequence t[0:L]: the longest n in [prompt_lookup_min, prompt_lookup_max] whose suffix
t[L-n:L] occurred earlier in t, at its earliest occurrence (as vLLM's NgramProposer); the
proposal is up to k tokens that followed that occurrence, cut at the sequence's end and at
max_model_len. No match: no proposal.

NgramProposer keeps a numpy mirror of each slot's token ids so a step copies only the tokens
appended since the last one (converting thousands of Python ints per sequence and step would
cost more than the search). The mirror is a cache of Sequence.token_ids, keyed by slot and
checked against the slot's sequence id and length; it never decides correctness (every
proposal is verified by the target model).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jpaged.config import SpeculativeConfig

_INITIAL_WIDTH = 1024  # mirror columns; doubled on demand up to max_model_len


def ngram_propose(
    token_ids: np.ndarray,
    num_tokens: np.ndarray,
    num_proposals: np.ndarray,
    *,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    max_model_len: int | None = None,
    width: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt-lookup proposals for a batch.

    Args:
      token_ids: int32[B, W], row b's tokens in [0, num_tokens[b]) (ids >= 0; the rest ignored).
      num_tokens: int32[B].
      num_proposals: int32[B], the most tokens to propose per row (0: none).
      width: columns of the result (default max(num_proposals)).

    Returns:
      proposals: int32[B, width], -1 after each row's count.
      num_proposed: int32[B].

    Candidate end positions p (the occurrence is t[p-n:p], the proposal starts at p) are the
    places where the last token recurs, found for all rows in one comparison; each longer n
    then keeps the candidates whose next token back matches too:

        t:      a b c d b c e ... b c       (L tokens, suffix "b c" at L-2, L-1)
        j = 0:  t[p-1] == t[L-1]   ("c")    candidates p = 3, 6, ...
        j = 1:  t[p-2] == t[L-2]   ("b")    survivors are matches of length 2
    """
    token_ids = np.asarray(token_ids)
    num_tokens = np.asarray(num_tokens, np.int64)
    num_proposals = np.asarray(num_proposals, np.int64)
    batch = num_tokens.shape[0]
    if width is None:
        width = int(num_proposals.max(initial=0))
    proposals = np.full((batch, width), -1, np.int32)
    num_proposed = np.zeros(batch, np.int32)
    # An earlier occurrence of an n-token suffix needs at least n + 1 tokens.
    rows = np.flatnonzero((num_proposals > 0) & (num_tokens > prompt_lookup_min))
    if rows.size == 0 or width == 0:
        return proposals, num_proposed
    lens = num_tokens[rows]  # [R]
    span = int(lens.max())
    # A C-ordered [R, stride] array whose row r holds the tokens of rows[r]: the buffer itself
    # when every row is searched, else the searched rows gathered once.
    if rows.size == batch and token_ids.flags.c_contiguous:
        tokens = token_ids
    else:
        tokens = np.ascontiguousarray(token_ids[rows, :span])
    stride = tokens.shape[1]
    flat_tokens = tokens.reshape(-1)
    back = lens[:, None] - 1 - np.arange(prompt_lookup_max)  # [R, N]: index of the j-th last
    suffix = np.where(back >= 0, np.take_along_axis(tokens, np.maximum(back, 0), axis=1), -1)
    suffix = np.ascontiguousarray(suffix.T)  # [N, R]

    # Ends p in [1, L-1] (p = L would be the suffix itself) where t[p-1] == t[L-1].
    hit = tokens[:, : span - 1] == suffix[0][:, None]  # [R, T-1], column p-1
    hit &= np.arange(1, span) < lens[:, None]
    # Sorted by row, then by end (flatnonzero is much faster than a 2-d nonzero).
    cand_row, cand_col = np.divmod(np.flatnonzero(hit), span - 1)
    cand_pos = cand_row * stride + cand_col  # flat index of t[p-1]
    best = np.zeros(rows.size, np.int64)  # [R]: longest match length found
    first = np.zeros(rows.size, np.int64)  # [R]: its earliest end p
    for j in range(prompt_lookup_max):
        if j > 0:
            keep = cand_pos - j >= cand_row * stride  # t[p-1-j] exists
            keep[keep] = flat_tokens[cand_pos[keep] - j] == suffix[j][cand_row[keep]]
            cand_row, cand_pos = cand_row[keep], cand_pos[keep]
        if cand_row.size == 0:
            break
        leaders = np.flatnonzero(np.r_[True, cand_row[1:] != cand_row[:-1]])  # first per row
        best[cand_row[leaders]] = j + 1
        first[cand_row[leaders]] = cand_pos[leaders] - cand_row[leaders] * stride + 1
    k = np.minimum(num_proposals[rows], np.minimum(lens - first, width))
    if max_model_len is not None:
        k = np.minimum(k, max_model_len - lens)
    k = np.where(best >= prompt_lookup_min, np.maximum(k, 0), 0)
    cols = np.arange(width)
    take = np.minimum(first[:, None] + cols, span - 1)  # [R, width]
    gathered = np.take_along_axis(tokens, take, axis=1)
    proposals[rows] = np.where(cols < k[:, None], gathered, -1)
    num_proposed[rows] = k
    return proposals, num_proposed


def matched_prefix(proposal: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading proposal tokens equal the tokens that came (greedy acceptance: a
    proposal is accepted up to its first mismatch)."""
    n = 0
    while n < len(proposal) and n < len(tokens) and proposal[n] == tokens[n]:
        n += 1
    return n


class NgramProposer:
    """Prompt-lookup proposer for a running batch (one row per scheduler slot)."""

    def __init__(self, config: SpeculativeConfig, *, max_num_seqs: int, max_model_len: int):
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs method 'ngram', got {config.method!r}")
        self.config = config
        self.max_model_len = max_model_len
        self._tokens = np.zeros((max_num_seqs, min(_INITIAL_WIDTH, max_model_len)), np.int32)
        self._num_tokens = np.zeros(max_num_seqs, np.int64)  # tokens mirrored per slot
        self._owner = np.full(max_num_seqs, -1, np.int64)  # seq_id mirrored per slot

    def _sync(self, slot: int, seq_id: int, token_ids: Sequence[int]) -> None:
        known = int(self._num_tokens[slot])
        if self._owner[slot] != seq_id or known > len(token_ids):
            self._owner[slot], known = seq_id, 0
        if len(token_ids) > self._tokens.shape[1]:
            width = self._tokens.shape[1]
            while width < len(token_ids):
                width *= 2
            grown = np.zeros((self._tokens.shape[0], min(width, self.max_model_len)), np.int32)
            grown[:, : self._tokens.shape[1]] = self._tokens
            self._tokens = grown
        self._tokens[slot, known : len(token_ids)] = token_ids[known:]
        self._num_tokens[slot] = len(token_ids)

    def propose(
        self,
        slots: Sequence[int],
        seq_ids: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        num_proposals: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Proposals for B running sequences.

        Args:
          slots, seq_ids: each sequence's scheduler slot and id.
          token_ids: each sequence's committed tokens (prompt + output, no proposals).
          num_proposals: int32[B] per-sequence caps (AcceptanceTracker.num_proposals);
            default num_speculative_tokens for all.

        Returns:
          proposals int32[B, num_speculative_tokens] (-1 padded) and num_proposed int32[B].
        """
        k = self.config.num_speculative_tokens
        if num_proposals is None:
            num_proposals = np.full(len(slots), k, np.int32)
        num_proposals = np.minimum(np.asarray(num_proposals), k)
        for slot, seq_id, ids, n in zip(slots, seq_ids, token_ids, num_proposals, strict=True):
            if n > 0:
                self._sync(slot, seq_id, ids)
        # Searched by slot over the whole mirror (no copy of it; slots not proposing are skipped).
        slots = np.asarray(slots, np.int64)
        caps = np.zeros(self._owner.shape[0], np.int64)
        caps[slots] = num_proposals
        proposals, num_proposed = ngram_propose(
            self._tokens,
            self._num_tokens,
            caps,
            prompt_lookup_min=self.config.prompt_lookup_min,
            prompt_lookup_max=self.config.prompt_lookup_max,
            max_model_len=self.max_model_len,
            width=k,
        )
        return proposals[slots], num_proposed[slots]

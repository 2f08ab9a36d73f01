"""How much to speculate: the per-sequence proposal count and the batch's cost governor.

(SpeculativeConfig, what a user passes, is in jpaged/config.py.) AcceptanceTracker owns the
only changing state of speculation on the host: each running sequence's recent acceptance,
from which it decides how many tokens to propose next step (fewer when proposals are being
rejected, none when speculation does not pay, with a periodic probe so a sequence that starts
copying text again gets proposals again), and the totals that `stats()` reports.

CostGovernor measures, per sequence bucket, whether verifying steps give more tokens per
second than plain ones. The proposers (ngram_proposer.py, draft_model.py) say what to
propose; the verification math is jpaged/sample/rejection_sampler.py. Nothing here touches
the device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jpaged.config import check_int


@dataclasses.dataclass
class _Acceptance:
    accepted: float  # decayed count of accepted proposals
    rejected: float  # decayed count of rejections (at most one per verification)
    idle: int = 0  # steps recorded without a proposal since the last verified one


class AcceptanceTracker:
    """Per-sequence proposal counts from recent acceptance, and the speculation totals.

    Acceptance is modelled per proposed token: alpha = P(a proposal is accepted | the ones
    before it were). A verification that accepts a of n proposals is a accepts and, if a < n,
    one rejection; alpha = accepted / (accepted + rejected) over counts that decay by `decay`
    per verification (a moving estimate over the last few steps). Proposal i (1-based) is
    accepted with probability alpha**i, so the count proposed is the largest k <= k_max with
    alpha**k >= min_gain: each proposal costs a verified query token and is worth alpha**i
    tokens. A new sequence starts at alpha = 1 (full proposals). At 0 proposals the sequence is
    probed with k_max proposals after `probe_interval` steps without any, so a sequence that
    turns to copying is found again.

    State is keyed by sequence id (so preemption and swap keep it, and the counts, hence a
    seeded request's tokens, do not depend on which slot it ran in); `free` drops it.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        *,
        min_gain: float = 0.3,
        decay: float = 0.8,
        probe_interval: int = 8,
    ) -> None:
        check_int("num_speculative_tokens", num_speculative_tokens, minimum=1)
        if not 0.0 < min_gain < 1.0:
            raise ValueError(f"min_gain must be in (0, 1), got {min_gain!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        check_int("probe_interval", probe_interval, minimum=1)
        self.num_speculative_tokens = num_speculative_tokens
        self.min_gain = min_gain
        self.decay = decay
        self.probe_interval = probe_interval
        self._seqs: dict[int, _Acceptance] = {}
        self.num_drafts = 0  # verifications with at least one proposal
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # accepted_per_pos[i]: verifications that accepted proposal i (vLLM's per-position count)
        self.accepted_per_pos = np.zeros(num_speculative_tokens, np.int64)

    def _state(self, seq_id: int) -> _Acceptance:
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _Acceptance(accepted=1.0, rejected=0.0)
        return state

    def acceptance_rate(self, seq_id: int) -> float:
        """The sequence's current per-token acceptance estimate alpha."""
        s = self._state(seq_id)
        return s.accepted / (s.accepted + s.rejected) if s.accepted + s.rejected > 0 else 1.0

    def num_proposals(self, seq_ids: Sequence[int]) -> np.ndarray:
        """int32[B]: how many tokens each sequence should propose this step (0..k_max)."""
        k_max = self.num_speculative_tokens
        out = np.zeros(len(seq_ids), np.int32)
        for row, seq_id in enumerate(seq_ids):
            alpha = self.acceptance_rate(seq_id)
            if alpha >= 1.0:
                k = k_max
            elif alpha <= 0.0:
                k = 0
            else:
                # Largest k with alpha**k >= min_gain (the epsilon keeps exact powers inside).
                k = min(k_max, math.floor(math.log(self.min_gain) / math.log(alpha) + 1e-9))
            if k == 0 and self._seqs[seq_id].idle >= self.probe_interval:
                k = k_max
            out[row] = k
        return out

    def record(
        self, seq_ids: Sequence[int], num_proposed: np.ndarray, num_accepted: np.ndarray
    ) -> None:
        """After a step: int32[B] proposals verified and accepted per sequence. Call it for every
        decoding sequence each step, also those with 0 proposals (that advances the probe)."""
        num_proposed = np.asarray(num_proposed)
        num_accepted = np.asarray(num_accepted)
        for seq_id, n, a in zip(seq_ids, num_proposed.tolist(), num_accepted.tolist(), strict=True):
            if not 0 <= a <= n <= self.num_speculative_tokens:
                raise ValueError(
                    f"need 0 <= num_accepted <= num_proposed <= {self.num_speculative_tokens}, "
                    f"got {a} of {n} for sequence {seq_id}"
                )
            state = self._state(seq_id)
            if n == 0:
                state.idle += 1
                continue
            state.idle = 0
            state.accepted = self.decay * state.accepted + a
            state.rejected = self.decay * state.rejected + (a < n)
            self.num_drafts += 1
            self.num_draft_tokens += n
            self.num_accepted_tokens += a
            self.accepted_per_pos[:a] += 1

    def free(self, seq_id: int) -> None:
        """Forgets a finished (or aborted) sequence."""
        self._seqs.pop(seq_id, None)

    def reset_totals(self) -> None:
        """Restarts the counts that stats() reports (the engine's reset_stats); the running
        sequences' acceptance estimates stay."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos[:] = 0

    def stats(self) -> dict[str, float | int | list[int]]:
        """vLLM's speculative-decoding metrics: drafts, draft tokens, accepted tokens, the
        acceptance rate and the mean acceptance length (tokens per verification, the target's
        own token included)."""
        drafts = self.num_drafts
        return {
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_pos": self.accepted_per_pos.tolist(),
            "spec_acceptance_rate": (
                self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
            ),
            "spec_mean_acceptance_length": (
                1.0 + self.num_accepted_tokens / drafts if drafts else 0.0
            ),
        }


@dataclasses.dataclass
class _BucketCost:
    plain_s: float | None = None  # seconds per decode step without proposals
    verify_s: float | None = None  # seconds per decode step verifying proposals
    verify_tokens: float = 1.0  # tokens a verifying step gives each row
    since_plain: int = 0  # verifying steps since the last plain one
    since_verify: int = 0  # plain steps since the last verifying one
    interval: int = 16  # steps of the faster mode between probes of the slower one
    verify_faster: bool | None = None  # the decision after the last step (None: unmeasured)


class CostGovernor:
    """Whether a batch's greedy and unseeded rows propose, from what steps measurably cost.

    Per sequence bucket it keeps moving averages of the seconds per decode step without
    proposals (plain) and per decode step that verifies proposals, and of the tokens a
    verifying step gives each row. Speculating pays when verify_tokens / verify_s >=
    1 / plain_s. A bucket first speculates, then runs one plain step to measure it, then the
    better mode, with one step of the other mode every probe_interval steps so a change in
    acceptance or load is seen. Each probe that confirms the decision doubles the bucket's
    interval (up to max_probe_interval: a probe of a mode that loses by 2x costs a whole step),
    and a changed decision restores probe_interval. With n-gram proposals the engine also
    sets the tokens estimate from the running rows (set_tokens), so a batch that starts
    copying is seen within a few steps, not at the next probe, and a new batch is judged on
    its own rows. A bucket that runs plain steps switches to verifying only when verifying
    is faster by switch_margin (a fraction), and back as soon as plain steps are faster:
    estimates near the break-even point would otherwise flip it back and forth, and a
    verifying step that loses costs more than a plain step that misses a gain. On an
    accelerator a small batch verifies almost for free and the governor keeps speculating; on
    a compute-bound CPU it stops where verification loses.

    Decisions depend on timing, so they apply only to rows whose tokens do not depend on
    them: greedy rows (speculation is exact) and unseeded sampled rows. Seeded sampled rows
    keep their proposals (the engine sees to it).
    """

    def __init__(
        self,
        *,
        decay: float = 0.7,
        probe_interval: int = 16,
        max_probe_interval: int = 128,
        switch_margin: float = 0.1,
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        if not 0.0 <= switch_margin < 1.0:
            raise ValueError(f"switch_margin must be in [0, 1), got {switch_margin!r}")
        check_int("probe_interval", probe_interval, minimum=1)
        check_int("max_probe_interval", max_probe_interval, minimum=probe_interval)
        self.decay = decay
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.switch_margin = switch_margin
        self._buckets: dict[int, _BucketCost] = {}

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1.0 - self.decay) * new

    def speculates(self, bucket: int) -> bool:
        """Whether a decode step of this sequence bucket should propose."""
        c = self._buckets.get(bucket)
        if c is None or c.verify_s is None:
            return True
        if c.plain_s is None:
            return False
        if c.verify_faster:
            return c.since_plain < c.interval
        return c.since_verify >= c.interval

    def record(
        self, bucket: int, seconds: float, tokens_per_row: float | None, *,
        rows_estimate: bool = False,
    ) -> None:
        """A decode step of this bucket took seconds; tokens_per_row: what a verifying step
        gave each row on average (None: a plain step). rows_estimate: tokens_per_row is the
        running rows' estimate (as set_tokens takes it), which replaces the average."""
        c = self._buckets.get(bucket)
        if c is None:
            c = self._buckets[bucket] = _BucketCost(interval=self.probe_interval)
        was = c.verify_faster
        probe = was is not None and was == (tokens_per_row is None)  # the slower mode's step
        if tokens_per_row is None:
            c.plain_s = self._average(c.plain_s, seconds)
            c.since_plain = 0
            c.since_verify += 1
        else:
            first = c.verify_s is None
            c.verify_s = self._average(c.verify_s, seconds)
            c.verify_tokens = (
                tokens_per_row
                if first or rows_estimate
                else self._average(c.verify_tokens, tokens_per_row)
            )
            c.since_verify = 0
            c.since_plain += 1
        self._decide(c, was, probe)

    def set_tokens(self, bucket: int, tokens_per_row: float) -> None:
        """What verifying would give each row of this bucket's running batch now, replacing
        the average (with n-gram proposals the engine knows it per row, from proposals made
        on the host during plain steps and checked against the tokens that followed, and from
        verifications), so the decision follows the rows without verifying steps; only
        verifying steps measure what verifying costs. Ignored before the bucket verified once."""
        c = self._buckets.get(bucket)
        if c is None or c.verify_s is None:
            return
        c.verify_tokens = tokens_per_row
        self._decide(c, c.verify_faster, probe=False)

    def _decide(self, c: _BucketCost, was: bool | None, probe: bool) -> None:
        """The bucket's faster mode from its averages (from plain to verifying only with
        verifying faster by switch_margin); a probe that confirms the decision doubles the
        probe interval, a changed decision restores probe_interval."""
        if c.plain_s is None or c.verify_s is None:
            return
        verify_rate, plain_rate = c.verify_tokens / c.verify_s, 1.0 / c.plain_s
        margin = 0.0 if was is None or was else self.switch_margin
        c.verify_faster = verify_rate >= plain_rate * (1.0 + margin)
        if c.verify_faster != was:
            c.interval = self.probe_interval
        elif probe:
            c.interval = min(2 * c.interval, self.max_probe_interval)

    def costs(self) -> dict[int, tuple[float | None, float | None, float]]:
        """bucket -> (plain seconds, verify seconds, verify tokens per row)."""
        return {b: (c.plain_s, c.verify_s, c.verify_tokens) for b, c in self._buckets.items()}

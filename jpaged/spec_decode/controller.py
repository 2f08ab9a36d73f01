"""SpecController: all speculative-decoding policy and state, behind four calls of the step.

The engine calls it at fixed points of its step and holds no speculation state itself:

    propose(running)              before scheduling: proposals by seq_id (or None)
    before_dispatch(plan, seq_of) after scheduling: the draft model's page edits replayed and
                                  its proposals filled in -> (plan, draft_probs)
    after_commit(plan, out, ...)  after the scheduler committed the step's tokens: the
                                  acceptance tracker, the cost governor's observations, the
                                  shadow proposals of plain steps, the draft model's commit
    release(seq_ids)              a request finished or was aborted: its sequences' state goes

plus step_collected / idle (the governor's step clock), may_overlap (whether the next plan may
be made before this one's tokens are known) and stats. With speculation off (config.speculative
None) every call is a no-op and `enabled` is False.

Invariants: every piece of per-sequence state here (the tracker's, the shadows, the rows'
estimates, the draft's) is keyed by seq_id and dropped by release; a controller is made anew
when the engine rebuilds its host state after a failed step (the draft model is reset).
Sequences are read (params, token_ids, table_row, num_computed_tokens, group), never written.
"""

from __future__ import annotations

import time

import numpy as np

from jpaged.sample.sampler import SamplerOutput
from jpaged.spec_decode.governor import AcceptanceTracker, CostGovernor
from jpaged.spec_decode.ngram_proposer import NgramProposer, matched_prefix
from jpaged.worker.step_inputs import bucket
from jpaged.worker.step_plan import StepPlan

# Weight of a row's previous estimate of what verifying gives it, per observation.
_ROW_DECAY = 0.5


def may_speculate(seq) -> bool:
    """Whether a decoding sequence may propose: not with a grammar, a logit bias, or
    prompt log-probabilities still to come."""
    p = seq.params
    return not (
        p.structured_outputs is not None
        or p.logit_bias
        or seq.group.prompt_logprobs is not None
        and seq.num_output_tokens == 0
    )


def keeps_proposals(seq) -> bool:
    """A seeded sampled row speculates whatever the batch or the step costs: its tokens must
    not depend on them (a greedy row's tokens are the same either way)."""
    return seq.params.seed is not None and not seq.params.greedy


class SpecController:
    def __init__(self, config, *, vocab_size: int, drafter=None) -> None:
        """config: the EngineConfig (its speculative config, or None: speculation off).
        drafter: the DraftModel of a draft_model config (reset here), else None."""
        self.config = config
        self.speculative = spec = config.speculative
        self._drafter = drafter
        self._vocab_size = vocab_size
        self._proposer = self._tracker = self._governor = None
        self._proposed: dict[int, int] = {}  # seq_id -> proposals of the step in flight
        # n-gram with the governor, plain steps: seq_id -> (its length when proposed, the
        # proposal), checked against the tokens that follow (_shadow_proposals)
        self._shadows: dict[int, tuple[int, list[int]]] = {}
        # n-gram with the governor: seq_id -> moving average of the tokens a verifying step
        # gives the row (from its shadows and its verifications); see _rows_tokens.
        self._row_tokens: dict[int, float] = {}
        # The governor's measurements: when the last step was collected (None after an idle
        # engine) and (sequence bucket, tokens per row or None) of the decode step collected.
        self._step_end: float | None = None
        self._decode_step: tuple[int, float | None] | None = None
        self._compiles_at_end = 0  # the runner's compile count when _step_end was taken
        self._clock = time.perf_counter  # tests script it
        if spec is None:
            return
        if spec.cost_aware:
            self._governor = CostGovernor()
        if spec.method == "draft_model":
            spec.check_draft_vocab(vocab_size, drafter.vocab_size)
            drafter.reset()
        else:
            sched = config.scheduler
            self._proposer = NgramProposer(
                spec, max_num_seqs=sched.max_num_seqs, max_model_len=sched.max_model_len
            )
        self._tracker = AcceptanceTracker(spec.num_speculative_tokens)

    def renewed(self) -> SpecController:
        """A fresh controller with the same draft model (reset): after a failed step."""
        return SpecController(self.config, vocab_size=self._vocab_size, drafter=self._drafter)

    @property
    def enabled(self) -> bool:
        return self._tracker is not None

    # -- the step's fixed points -----------------------------------------------------------
    def propose(self, running: list) -> dict[int, list[int]] | None:
        """Speculative tokens for the running sequences that decode next, capped so a step
        never passes max_tokens or max_model_len. Rows with a grammar, a logit bias or
        prompt log-probabilities do not speculate."""
        if self._tracker is None:
            return None
        seqs, caps = [], []
        max_len = self.config.scheduler.max_model_len
        for seq in running:
            p = seq.params
            if seq.num_computed_tokens != seq.num_tokens - 1 or not may_speculate(seq):
                continue
            room = max_len - seq.num_tokens - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)
            seqs.append(seq)
            caps.append(max(room, 0))
        if not seqs:
            return None
        ids = [s.seq_id for s in seqs]
        want = np.minimum(self._tracker.num_proposals(ids), caps)
        if self._speculation_off(len(seqs)):
            # A big batch, or verification loses: only seeded sampled rows speculate (their
            # tokens must not depend on the batch; a greedy row's tokens are the same either way).
            keep = [keeps_proposals(s) for s in seqs]
            want = np.where(keep, want, 0)
        if self._drafter is not None:  # slots now, the draft's tokens once pages are known
            self._proposed = dict(zip(ids, want.tolist(), strict=True))
            return {i: [0] * int(n) for i, n in zip(ids, want) if n}
        proposals, num = self._proposer.propose(
            [s.table_row for s in seqs], ids, [s.token_ids for s in seqs], want
        )
        self._proposed = dict(zip(ids, num.tolist(), strict=True))  # for the tracker
        return {i: proposals[j, :n].tolist() for j, (i, n) in enumerate(zip(ids, num)) if n}

    def before_dispatch(self, plan: StepPlan, seq_of) -> tuple[StepPlan, object]:
        """With a draft model: the plan's page edits replayed on the draft and its proposal
        slots filled with the draft's tokens. Returns (plan, the draft's probabilities or
        None). seq_of: seq_id -> its unfinished Sequence or None."""
        if self._drafter is None:
            return plan, None
        self._drafter.sync(plan)
        if plan.num_proposed is None:
            return plan, None
        return self._drafter.propose(plan, seq_of)

    def after_commit(self, plan: StepPlan, out: SamplerOutput, running_seq, seq_of) -> None:
        """A step's tokens are committed: the tracker learns what each row proposed and had
        accepted, the governor what the step gave, plain steps check their shadow proposals
        and the draft model keeps its verified K/V. running_seq: seq_id -> the running
        Sequence or None; seq_of: seq_id -> the unfinished Sequence or None."""
        if self._tracker is None:
            return
        self._record_acceptance(plan, out)
        self._note_decode_step(plan, out)
        if self._governor is not None and self._proposer is not None:
            self._shadow_proposals(plan, running_seq)
        if self._drafter is not None:
            self._drafter.committed(plan, out, seq_of)

    def release(self, seq_ids) -> None:
        """Drops the state of finished or aborted sequences."""
        if self._tracker is None:
            return
        for seq_id in seq_ids:
            self._tracker.free(seq_id)
            self._shadows.pop(seq_id, None)
            self._row_tokens.pop(seq_id, None)
            if self._drafter is not None:
                self._drafter.forget(seq_id)

    # -- overlap and the governor's clock --------------------------------------------------
    def may_overlap(self, plan: StepPlan, running: list) -> bool:
        """Whether the step after plan may skip proposals, so it can be made before plan's
        tokens are known (proposals and verified lengths need them); True with speculation
        off. So when plan verified nothing and the batch is over disable_by_batch_size with no
        seeded sampled row (those always keep their proposals, see propose): skipping changes
        no greedy token, and only a batch that shrinks to the limit in this step loses a
        step's proposals. n-gram only (a draft model replays each committed step first)."""
        if self._tracker is None:
            return True
        if self._drafter is not None or plan.proposals is not None:
            return False
        return self._speculation_off(len(running)) and not any(map(keeps_proposals, running))

    def step_collected(self, busy: bool, num_compiles: int) -> None:
        """Gives the governor the seconds since the previous step was collected, for a decode
        step collected just now right after another, unless a program was compiled (or loaded
        from the compilation cache) meanwhile: one such outlier would hold a moving average
        off for many probes. busy: requests remain; num_compiles: the runner's compile count."""
        if self._governor is None:
            return
        now = self._clock()
        if (
            self._step_end is not None
            and self._decode_step is not None
            and num_compiles == self._compiles_at_end
        ):
            seq_bucket, tokens = self._decode_step
            self._governor.record(seq_bucket, now - self._step_end, tokens,
                                  rows_estimate=self._proposer is not None)  # fmt: skip
        self._step_end = now if busy else None
        self._compiles_at_end = num_compiles

    def idle(self) -> None:
        """Nothing ran: the next step's time is not a decode step's."""
        self._step_end = None

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Proposed and accepted tokens and the mean acceptance length (speculation on)."""
        if self._tracker is None:
            return {}
        t = self._tracker.stats()
        return {
            "spec_num_drafts": t["spec_num_drafts"],
            "spec_num_draft_tokens": t["spec_num_draft_tokens"],
            "spec_num_accepted_tokens": t["spec_num_accepted_tokens"],
            "spec_mean_acceptance_length": t["spec_mean_acceptance_length"],
        }

    def reset_stats(self) -> None:
        if self._tracker is not None:
            self._tracker.reset_totals()

    # -- policy ----------------------------------------------------------------------------
    def _speculation_off(self, num_decoding: int) -> bool:
        """Whether greedy and unseeded rows of a batch of num_decoding decoding sequences
        propose nothing: over disable_by_batch_size, or where the cost governor measured
        that verifying steps lose to plain ones."""
        limit = self.speculative.disable_by_batch_size
        if limit is not None and num_decoding > limit:
            return True
        governor = self._governor
        if governor is None or num_decoding == 0:
            return False
        return not governor.speculates(bucket(self.config.seq_buckets, num_decoding))

    def _note_decode_step(self, plan: StepPlan, out: SamplerOutput) -> None:
        """For the cost governor: the step's sequence bucket and tokens per row when every
        row decoded (one token, or one plus its proposals), else None."""
        self._decode_step = None
        if self._governor is None or not len(plan):
            return
        proposed = plan.num_proposed
        if proposed is None:
            if plan.decode_only:
                self._decode_step = (bucket(self.config.seq_buckets, len(plan)), None)
            return
        if not np.array_equal(plan.num_new_tokens, proposed + 1):
            return
        given = np.minimum(out.num_accepted[: len(plan)], proposed) + 1  # tokens per row
        if self._proposer is None:
            tokens = float(np.mean(given))
        else:  # n-gram: the rows' estimates, this step's included
            for seq_id, n in zip(plan.seq_ids.tolist(), given.tolist(), strict=True):
                self._note_row_tokens(seq_id, n)
            tokens = self._rows_tokens(plan)
        self._decode_step = (bucket(self.config.seq_buckets, len(plan)), tokens)

    def _note_row_tokens(self, seq_id: int, tokens: float) -> None:
        """One more observation of what verifying gives a row (its accepted count plus one)."""
        old = self._row_tokens.get(seq_id, 1.0)
        self._row_tokens[seq_id] = _ROW_DECAY * old + (1.0 - _ROW_DECAY) * tokens

    def _rows_tokens(self, plan: StepPlan) -> float:
        """What a verifying step would give the rows of plan, each on average: the mean of
        the rows' own estimates (a row not yet observed counts 1 token). Per row, so a new
        batch is judged on its own rows, not on what the batch before it copied."""
        rows = self._row_tokens
        return float(np.mean([rows.get(i, 1.0) for i in plan.seq_ids.tolist()]))

    def _shadow_proposals(self, plan: StepPlan, running_seq) -> None:
        """After a plain decode step (n-gram, cost governor on): what verifying would have
        given its rows. Each row holds one proposal made on the host from its tokens so far,
        as a verifying step would have proposed it (the tracker's count of tokens), and checks
        it against the tokens the plain steps then make: once it mismatches or is matched
        whole, a verification would have given its accepted count plus one, an observation
        of the row (_note_row_tokens). The governor then gets the rows' estimate
        (_rows_tokens); no device work, no stats."""
        if plan.num_proposed is not None or not plan.decode_only:
            return
        shadows, fresh = self._shadows, []
        for seq_id in plan.seq_ids.tolist():
            seq = running_seq(seq_id)
            if seq is None:
                shadows.pop(seq_id, None)
                self._row_tokens.pop(seq_id, None)
                continue
            pending = shadows.get(seq_id)
            if pending is None:
                if may_speculate(seq):
                    fresh.append(seq)
                else:
                    self._note_row_tokens(seq_id, 1)  # it would not propose: 1 token a step
                continue
            start, proposal = pending
            made = seq.token_ids[start : start + len(proposal)]
            accepted = matched_prefix(proposal, made)
            if accepted < len(made) or accepted == len(proposal):
                self._note_row_tokens(seq_id, accepted + 1)
                del shadows[seq_id]
                fresh.append(seq)
        if fresh:
            ids = [s.seq_id for s in fresh]
            proposals, num = self._proposer.propose(  # as many as a verifying step would
                [s.table_row for s in fresh],
                ids,
                [s.token_ids for s in fresh],
                self._tracker.num_proposals(ids),
            )
            for j, (seq, n) in enumerate(zip(fresh, num.tolist(), strict=True)):
                if n:
                    shadows[seq.seq_id] = (seq.num_tokens, proposals[j, :n].tolist())
                else:  # no match: a verifying step gives this row 1 token
                    self._note_row_tokens(seq.seq_id, 1)
        seq_bucket = bucket(self.config.seq_buckets, len(plan))
        self._governor.set_tokens(seq_bucket, self._rows_tokens(plan))

    def _record_acceptance(self, plan: StepPlan, out: SamplerOutput) -> None:
        """Tells the tracker what every decoding sequence proposed and had accepted."""
        proposed = self._proposed
        if not proposed:
            return
        self._proposed = {}
        ids, num, accepted = [], [], []
        verified = out.num_accepted.tolist() if out.num_accepted is not None else None
        row_proposed = plan.num_proposed.tolist() if plan.num_proposed is not None else None
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            if seq_id in proposed:
                ids.append(seq_id)
                n = row_proposed[i] if row_proposed is not None else 0
                num.append(n)
                accepted.append(min(verified[i], n) if verified is not None else 0)
        if ids:
            self._tracker.record(ids, np.asarray(num), np.asarray(accepted))

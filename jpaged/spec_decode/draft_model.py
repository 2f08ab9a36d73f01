"""A draft model for speculative decoding: its own runner and K/V pool over the target's pages.

The draft (a smaller model with the same tokenizer) keeps its K/V in a pool of its own with
the target's page ids: a token at (page, offset) for the target is at (page, offset) in the
draft pool too. So the draft needs no allocator: the scheduler's page decisions serve both,
and `sync` replays each target plan's page-table edits and copy-on-write copies on the draft's
device state. The draft's own programs are compiled per bucket like the target's.

It owns how far each sequence's draft K/V is valid (`_computed`: positions, and the pages they
were written to). Per speculative step, for every row the scheduler granted k proposal slots
(placeholders in the plan):

    catch-up   one or more ragged draft steps over the positions the draft has not computed,
               ending with the row's last token: sample x0 ~ q0          (draft offset 0)
    decode     k - 1 draft steps: feed x_{j-1} at position L - 1 + j, sample x_j ~ q_j
    verify     the target's step gets the proposals and q_0..q_{k-1} (on the device)

After the target verifies, a accepted proposals leave the draft valid up to L + min(a, k - 1)
positions (it never computed the last proposal's K/V). A sequence whose pages changed under
the draft (swapped back in, recomputed) is caught up from zero, and one whose pages were
loaded from the KV host tier from its first loaded page (sync); stale draft K/V can only make
proposals worse, never outputs wrong: verification keeps the target's distribution.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.config import EngineConfig
from jpaged.worker.programs import PRELUDE_COPIES, PRELUDE_UPDATES
from jpaged.worker.runner import ModelRunner
from jpaged.worker.step_inputs import bucket, pad_rows
from jpaged.worker.step_plan import ScheduledRow, StepPlan, build
from models import quantization
from models.loader import LoadedModel


@functools.partial(jax.jit, donate_argnums=(0,))
def _place(acc, probs, rows, j):
    """acc float32[S, K, V]: row rows[i] position j <- probs[i] (rows out of range dropped)."""
    return acc.at[rows, j].set(probs, mode="drop")


class DraftModel:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel, num_pages: int, eos_token_ids
    ) -> None:
        self.config = config
        self.page_size = config.cache.page_size
        self.budget = config.scheduler.max_num_batched_tokens
        self.k = config.num_speculative_tokens
        self.eos_token_ids = list(eos_token_ids)
        dtype = quantization.activation_dtype(loaded.params)
        self.runner = ModelRunner(config, loaded.config, loaded.params, num_pages, dtype)
        self.vocab_size = loaded.config.vocab_size
        self._computed: dict[int, tuple[int, tuple[int, ...]]] = {}  # seq_id -> (n, pages)

    def reset(self) -> None:
        """After a failed step: a fresh pool and no sequence computed."""
        self.runner.reset_state()
        self._computed.clear()

    def forget(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)

    # -- pages -------------------------------------------------------------------------------
    def sync(self, plan: StepPlan) -> None:
        """Applies a target plan's page-table edits and page copies to the draft's state. A
        page the plan writes from host (a host-tier load, a swap-in) holds no draft K/V:
        each sequence's draft is valid up to its first such page (then caught up)."""
        if len(plan.swap_in):
            loaded = set(plan.swap_in[:, 1].tolist())
            for seq_id, (n, pages) in list(self._computed.items()):
                j = next((j for j, p in enumerate(pages) if p in loaded), None)
                if j is not None:
                    self._computed[seq_id] = (min(n, j * self.page_size), pages[:j])
        updates, copies = plan.page_updates, plan.page_copies
        scratch = self.runner.scratch_row
        while len(updates) or len(copies):
            upd, cps = updates[:PRELUDE_UPDATES], copies[:PRELUDE_COPIES]
            updates, copies = updates[len(upd) :], copies[len(cps) :]
            self.runner.run_prelude(
                pad_rows(upd, PRELUDE_UPDATES, (scratch, 0, 0)),
                pad_rows(cps, PRELUDE_COPIES, (0, 0)),
            )

    def _valid(self, seq) -> int:
        """Positions of seq whose draft K/V is in its current pages."""
        n, pages = self._computed.get(seq.seq_id, (0, ()))
        if tuple(seq.pages[: len(pages)]) != pages:
            return 0  # swapped back in or recomputed into other pages
        return min(n, seq.num_computed_tokens)

    # -- proposals ---------------------------------------------------------------------------
    def propose(self, plan: StepPlan, sequence) -> tuple[StepPlan, jax.Array]:
        """Fills the plan's proposal placeholders with the draft's proposals.

        Args:
          plan: a target plan whose rows with num_proposed > 0 hold placeholders.
          sequence: seq_id -> the live Sequence (Scheduler.sequence).

        Returns:
          The plan with proposals in token_ids and proposals, and the proposals'
          distributions float32[seq bucket, K, V] on the device.
        """
        rows = [
            (i, sequence(int(plan.seq_ids[i])), int(plan.num_proposed[i]))
            for i in np.flatnonzero(plan.num_proposed)
        ]
        num_rows = bucket(self.config.seq_buckets, len(plan))
        probs = jnp.zeros((num_rows, self.k, self.vocab_size), jnp.float32)
        proposals = {i: [] for i, _, _ in rows}
        # Catch-up: positions [valid, L) through ragged steps; the last one samples x0.
        pending = [(i, seq, self._valid(seq)) for i, seq, _ in rows]
        while pending:
            batch, budget, rest = [], self.budget, []
            for i, seq, start in pending:
                n = min(seq.num_tokens - start, budget)
                if n <= 0 or len(batch) == self.config.scheduler.max_num_seqs:
                    rest.append((i, seq, start))
                    continue
                batch.append((i, seq, start, n))
                budget -= n
            draft_rows = [
                ScheduledRow(seq, n, start, r, start + n == seq.num_tokens)
                for r, (_, seq, start, n) in enumerate(batch)
            ]
            tokens, step_probs = self._step(draft_rows, offset=0)
            done = []
            for r, (i, seq, start, n) in enumerate(batch):
                if start + n == seq.num_tokens:
                    proposals[i].append(int(tokens[r]))
                    done.append((r, i))
                else:
                    rest.append((i, seq, start + n))
            probs = self._gather(probs, step_probs, done, 0, num_rows)
            pending = rest
        # Decode: x_j at position L - 1 + j for j < k.
        for j in range(1, self.k):
            live = [(i, seq) for i, seq, k in rows if k > j]
            if not live:
                break
            draft_rows = [
                ScheduledRow(seq, 1, seq.num_tokens - 1 + j, r, True)
                for r, (_, seq) in enumerate(live)
            ]
            feed = [proposals[i][j - 1] for i, _ in live]
            tokens, step_probs = self._step(draft_rows, offset=j, feed=feed)
            for r, (i, _) in enumerate(live):
                proposals[i].append(int(tokens[r]))
            probs = self._gather(
                probs, step_probs, list(enumerate(i for i, _ in live)), j, num_rows
            )
        token_ids = plan.token_ids.copy()
        filled = plan.proposals.copy()
        for i, seq, k in rows:
            first = int(plan.query_start[i]) + 1
            token_ids[first : first + k] = proposals[i][:k]
            filled[i, :k] = proposals[i][:k]
        return dataclasses.replace(plan, token_ids=token_ids, proposals=filled), probs

    def _step(self, rows, *, offset: int, feed=None):
        """One draft step over rows; returns the sampled tokens (host) and the rows'
        distributions (device, [seq bucket, V])."""
        plan = build(
            rows,
            page_size=self.page_size,
            eos_token_ids=self.eos_token_ids,
            page_updates=[],
            page_copies=[],
            swap_out=[],
            swap_in=[],
        )
        if feed is not None:  # decode: the previous proposal, known on the host
            plan = dataclasses.replace(plan, token_ids=np.asarray(feed, np.int32))
        step = self.runner.dispatch(plan, draft_offset=offset)
        return np.asarray(jax.device_get(step.out.tokens)), step.out.draft_probs

    @staticmethod
    def _gather(acc, step_probs, placed, j: int, num_rows: int):
        """Puts step rows' distributions at their target rows' position j."""
        if not placed:
            return acc
        rows = np.full(step_probs.shape[0], num_rows, np.int32)  # unplaced rows are dropped
        for r, i in placed:
            rows[r] = i
        return _place(acc, step_probs, rows, np.int32(j))

    def committed(self, plan: StepPlan, out, sequence) -> None:
        """After the target verified: the draft is valid up to L + min(a, k - 1) positions of
        each speculative row's sequence."""
        if plan.num_proposed is None:
            return
        for i in np.flatnonzero(plan.num_proposed):
            seq = sequence(int(plan.seq_ids[i]))
            if seq is None:
                continue
            k, a = int(plan.num_proposed[i]), int(out.num_accepted[i])
            valid = min(int(plan.starts[i]) + 1 + min(a, k - 1), seq.num_computed_tokens)
            pages = tuple(seq.pages[: -(-valid // self.page_size)])
            self._computed[seq.seq_id] = (valid, pages)


def load_draft(config: EngineConfig, dtype):
    """The draft model of a draft_model speculative config (same vocabulary), or None."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    from models.demo import resolve_builtin
    from models.loader import load_model

    draft = load_model(resolve_builtin(spec.model), dtype=dtype)
    return draft

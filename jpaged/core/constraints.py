"""Constraints: the engine's structured outputs, one grammar matcher per constrained sequence.

Owns the StructuredOutputManager (made when the first constrained request arrives: it needs
the tokenizer's vocabulary) keyed (request_id, completion index). The engine calls it at
fixed points: add (a request arrives, before anything about it is stored), bitmask (a plan
is dispatched: the rows' token masks), advance (a sequence got a token: its grammar moves on
and may end the sequence) and release (a request finished or was aborted).

Invariants: a fork's child gets its matcher copied from its parent's before the parent
advances (bitmask runs before the step's tokens are committed); release drops every matcher
of a request.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jpaged.core.sequence import RequestGroup, Sequence
from jpaged.structured_output.manager import StructuredOutputManager
from jpaged.worker.step_plan import StepPlan


class Constraints:
    def __init__(self, tokenizer, vocab_size: int, *, disable_any_whitespace: bool) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._disable_any_whitespace = disable_any_whitespace
        self.manager: StructuredOutputManager | None = None

    def add(self, request_id: str, structured_outputs) -> None:
        """A constrained request's first matcher (ValueError for a bad constraint)."""
        if self.manager is None:
            if self._tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; the model has none")
            self.manager = StructuredOutputManager(
                self._tokenizer,
                self._vocab_size,
                disable_any_whitespace=self._disable_any_whitespace,
            )
        self.manager.add((request_id, 0), structured_outputs)

    def bitmask(self, plan: StepPlan, seq_of: Callable[[int], Sequence | None]) -> np.ndarray:
        """The rows' structured-output masks (int32[len(plan), ceil(vocab / 32)]). A fork's
        child gets its matcher here, copied from its parent's before the parent advances."""
        manager = self.manager
        keys = []
        for seq_id, constrained in zip(plan.seq_ids.tolist(), plan.constrained):
            seq = seq_of(seq_id) if constrained else None
            if seq is None:
                keys.append(None)
                continue
            key = (seq.group.request_id, seq.index)
            if key not in manager:
                manager.fork((seq.group.request_id, 0), key)
            keys.append(key)
        mask = manager.allocate_bitmask(len(plan))
        manager.fill_bitmask(keys, mask)
        return mask

    def advance(self, seq: Sequence, finish: Callable[..., None]) -> None:
        """Commits seq's new token to its grammar; a grammar that is complete (only EOS left)
        stops the sequence, one that failed ends it with finish_reason "error". A grammar
        completed by the token that reached max_tokens or max_model_len is a "stop" too:
        "length" says the output is cut short. finish: the scheduler's finish."""
        if self.manager is None or seq.params.structured_outputs is None:
            return
        key = (seq.group.request_id, seq.index)
        manager = self.manager
        manager.advance(key, seq.token_ids[-1:])
        error = manager.error(key)
        if seq.is_finished:
            if seq.finish_reason == "length" and manager.is_finished(key):
                finish(seq, "stop")
            return
        if error is not None:
            seq.group.error = f"structured output: {error}"
            finish(seq, "error")
        elif manager.is_finished(key):
            finish(seq, "stop")

    def release(self, group: RequestGroup) -> None:
        """Drops a finished or aborted request's matchers."""
        if self.manager is not None and group.params.structured_outputs is not None:
            for index in range(max(len(group.seqs), 1)):
                self.manager.remove((group.request_id, index))

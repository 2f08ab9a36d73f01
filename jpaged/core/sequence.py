"""Requests and their sequences, as the scheduler sees them.

A request (RequestGroup) has one prompt and n completions; each completion is a Sequence.
A request with n > 1 starts as one sequence (the parent); when its prompt is computed the
scheduler forks n - 1 children that share the parent's pages. From then on each sequence is
independent: it is scheduled, preempted and finished on its own.

A sequence moves toward its num_tokens by num_computed_tokens; there are no separate
prefill and decode phases: a prefill is a sequence with many tokens still to compute.
"""

from __future__ import annotations

import dataclasses
import enum

from jpaged.pooling import Pooler
from jpaged.sample.sampling_params import SamplingParams
from jpaged.worker.step_plan import SamplingConstants


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    cache_salt: str | None = None
    session: str | None = None  # its session's key (jpaged/core/session_pages.py), or None
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    aborted: bool = False  # an n > 1 request aborted before its fork never gets n sequences
    # prompt_logprobs: [None, {id: logprob} for prompt tokens 1..] as prefill computes them
    prompt_logprobs: list | None = None
    error: str | None = None  # a constraint's error that ended a sequence ("error")
    pooler: Pooler | None = None  # an embedding request's running sums (jpaged/pooling.py)
    lora: object | None = None  # its LoRA adapter (jpaged/lora: a HostAdapter), None: base
    lora_slot: int = -1  # the device slot its adapter holds while admitted (LoRAManager)

    @property
    def finished(self) -> bool:
        return (self.aborted or len(self.seqs) == self.params.n) and all(
            s.status is SeqStatus.FINISHED for s in self.seqs
        )


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    group: RequestGroup
    index: int  # completion index within the group
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    seed: int  # sampling stream of this sequence: key = fold_in(seed, num_output_tokens)
    num_computed_tokens: int = 0
    # Tokens sampled by steps still in flight (async scheduling), not yet in token_ids; the
    # scheduler plans as if they were there.
    num_placeholders: int = 0
    # The sequence's rows of the page table while running, one per paging group
    # (models/kv_groups.py): the host copy of those rows, owned by the KVCacheManager (the device
    # table is edited by each plan's updates). `pages` is the first group's.
    tables: list[list[int]] = dataclasses.field(default_factory=lambda: [[]])
    page_hashes: list[int] = dataclasses.field(default_factory=list)  # of the full pages
    # Window group -> (page, generation) of the generated page its last slide left in the
    # prefix cache, forgotten at its next slide (KVCacheManager.slide).
    slid_pages: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    table_row: int = -1  # row of the device page table while running, else -1
    # Host swap pages holding the K/V of the computed tokens while swapped out (waiting with
    # num_computed_tokens kept); empty otherwise.
    swap_pages: list[int] = dataclasses.field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    needs_fork: bool = False  # an unforked parent of an n > 1 request
    yielded: bool = False  # preempted once for a waiting prompt (jpaged/core/prompt_first.py)
    # Preempted by recompute at least once: re-admitted only when its whole context fits
    # beside the running ones' prompts (KVCacheManager.can_allocate's reserved).
    recomputed: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    # Its sampling values that never change: set at creation (step_plan.sampling_constants).
    sampling_constants: SamplingConstants | None = None

    def drop_last_tokens(self, n: int) -> None:
        """Drops the last n generated tokens and their logprobs (tokens a speculative step
        accepted after a stop string; the engine finishes the sequence next)."""
        if not 0 <= n <= self.num_output_tokens:
            raise ValueError(f"cannot drop {n} of {self.num_output_tokens} generated tokens")
        if n == 0:
            return
        dropped = self.token_ids[-n:]
        del self.token_ids[-n:]
        if len(self.logprobs) > self.num_output_tokens:
            for token, entry in zip(dropped, self.logprobs[self.num_output_tokens :]):
                self.cumulative_logprob -= entry.get(token, 0.0)
            del self.logprobs[self.num_output_tokens :]

    @property
    def pages(self) -> list[int]:
        """The first paging group's pages (the only group's, unless the model mixes
        attention kinds)."""
        return self.tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """num_tokens counting the placeholders of steps in flight."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

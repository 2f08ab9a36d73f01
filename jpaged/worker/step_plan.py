"""StepPlan: one step's work as plain arrays, made by the scheduler, read by the runner.

A plan is a frozen snapshot: it holds no live Sequence, so nothing the scheduler changes after
`schedule()` (commits, stops, preemptions) can change a plan already handed to the device.
The scheduler is the only host owner of page tables (each Sequence's `tables`, one per paging
group: models/kv_groups.py); a plan carries the page-table edits the device must make
(`page_updates`, rows of the whole device table: group g's row r is g * (max_num_seqs + 1) + r)
and, for every new token, its flat pool slot in each group (`slot_mapping`), so the runner
never reads a page list.

Layout of one plan with S rows (scheduled sequences) and T new tokens:

    rows    seq_ids, table_rows, starts, num_new_tokens, sample_rows, keep_sample   [S]
    tokens  token_ids, positions                                                   [T]
            slot_mapping                                                        [G, T]
            row i's tokens are [query_start[i], query_start[i + 1])

    token_ids[t] == PLACEHOLDER: the token is the sample of the previous step (async
    scheduling), still on the device; the runner reads it from that step's sampled ids.

A fork's child (n > 1) is a row with no new tokens that samples from its parent's row
(sample_rows[i] != i).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceABC

import numpy as np

from jpaged.sample.sampler import Penalties, SamplingInputs
from jpaged.sample.sampling_params import SamplingParams

PLACEHOLDER = -1
MAX_BANNED = 8  # stop tokens masked per row before min_tokens


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    seq_ids: np.ndarray  # int64[S]
    table_rows: np.ndarray  # int32[S]: page-table row of each sequence
    starts: np.ndarray  # int32[S]: tokens computed before the step
    num_new_tokens: np.ndarray  # int32[S]
    sample_rows: np.ndarray  # int32[S]
    keep_sample: np.ndarray  # bool[S]: the sample is appended (all tokens computed)
    query_start: np.ndarray  # int32[S + 1]
    token_ids: np.ndarray  # int32[T]; PLACEHOLDER: the previous step's sample
    positions: np.ndarray  # int32[T]
    slot_mapping: np.ndarray  # int32[G, T]: page * page_size + offset in each group's pages
    page_updates: np.ndarray  # int32[U, 3]: (row of the whole table, column, page)
    page_copies: np.ndarray  # int32[C, 2]: (src, dst) copies before the step (copy-on-write)
    swap_out: np.ndarray  # int32[O, 2]: (device page, host page), before swap_in
    swap_in: np.ndarray  # int32[I, 2]: (host page, device page), before the step
    # The rows' sampling values, unpadded (the runner pads them into the step's bucket);
    # token_bitmask and use_bitmask are None here (Constraints makes the masks).
    sampling: SamplingInputs
    uses_penalties: np.ndarray  # bool[S]: the row's next token waits for this step's sample
    wants_logprobs: bool  # some row asked for log-probabilities
    max_pages: int  # pages the longest row spans after the step
    decode_only: bool  # one token per row, each row sampling itself
    # int32[T]: for a prompt token of a row that asked for prompt_logprobs, the next prompt
    # token (whose log-probability it predicts), else -1; None when no row asked.
    prompt_targets: np.ndarray | None = None
    # Speculative decoding: int32[S, K'] proposed tokens (-1 padded) of the rows that verify
    # proposals (their new tokens are the last token then the proposals), int32[S] how many;
    # None when no row proposes.
    proposals: np.ndarray | None = None
    num_proposed: np.ndarray | None = None
    pools: bool = False  # some row computes prompt tokens of an embedding request
    constrained: np.ndarray | None = None  # bool[S]: the row has a structured-output grammar

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_lens(self) -> np.ndarray:  # int32[S]: tokens cached after the step
        return self.starts + self.num_new_tokens


def pairs(items: SequenceABC[tuple[int, ...]], width: int) -> np.ndarray:
    """A list of int tuples -> int32[len, width] (also when empty)."""
    return np.asarray(items, np.int32).reshape(len(items), width)


def pow2_width(n: int, lo: int = 16) -> int:
    """The width of a padded per-row list of n entries (penalty tokens, logit_bias): the
    next power of two, at least lo."""
    return max(lo, 1 << max(0, (max(n, 1) - 1).bit_length()))


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingConstants:
    """A sequence's sampling values that never change (computed once, at its creation)."""

    temperature: float  # 0.0: greedy (SamplingParams.greedy)
    top_k: int  # 0: no limit
    top_p: float
    min_p: float
    key_high: int  # the sequence's threefry key, uint32 words
    key_low: int


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRow:
    """One row of a plan while the scheduler makes it. num_new_tokens is 0 for a fresh fork,
    which samples from its parent's row (sample_row); proposals: speculative tokens verified
    after the last one (num_new_tokens counts them), or None."""

    seq: object  # the Sequence; read by build, and only there
    num_new_tokens: int
    start: int  # its first new token's position
    sample_row: int  # the row whose sample is its next token (its own, or its parent's)
    keep_sample: bool  # the sample is its next token (False: a chunk of a longer prompt)
    proposals: list[int] | None = None


def sampling_constants(params: SamplingParams, key_data: np.ndarray) -> SamplingConstants:
    """The per-row sampling values that never change for a sequence (computed once)."""
    return SamplingConstants(
        temperature=0.0 if params.greedy else params.temperature,
        top_k=max(params.top_k, 0),
        top_p=params.top_p,
        min_p=params.min_p,
        key_high=int(key_data[0]),
        key_low=int(key_data[1]),
    )


def build(
    rows: list[ScheduledRow],
    *,
    page_size: int,
    eos_token_ids: SequenceABC[int],
    page_updates: list[tuple[int, int, int]],
    page_copies: list[tuple[int, int]],
    swap_out: list[tuple[int, int]],
    swap_in: list[tuple[int, int]],
    num_groups: int = 1,
) -> StepPlan:
    """The plan of the scheduled rows.

    Args:
      rows: one ScheduledRow per scheduled sequence, in row order; its seq is read here and
        only here (Sequence.tables, token_ids, params).
      page_size: tokens per page.
      num_groups: paging groups: each sequence's len(tables).
      eos_token_ids: banned with the stop tokens while a row has fewer than min_tokens.
    """
    tok: list[int] = []
    pos: list[int] = []
    slot: list[list[int]] = [[] for _ in range(num_groups)]
    table_rows: list[int] = []
    query_end: list[int] = []
    consts: list[SamplingConstants] = []
    num_generated: list[int] = []
    num_banned: list[int] = []
    num_pages = 0
    ban: list[tuple[int, list[int]]] = []
    penalty_rows: list[int] = []
    bias_rows: list[int] = []
    constrained: list[int] = []
    prompt_spans: list[tuple[int, int, int, int]] = []  # (row, first token, start, n)
    spec_rows: list[tuple[int, list[int]]] = []  # (row, its proposals)
    wants_logprobs = pools = False
    for i, row in enumerate(rows):
        seq, n, start, proposals = row.seq, row.num_new_tokens, row.start, row.proposals
        if proposals:  # the last token, then the proposals after it (speculative decoding)
            spec_rows.append((i, proposals))
            tok.append(seq.token_ids[start])
            tok.extend(proposals)
        elif n == 1:  # a decode token (or the last of a prompt)
            tok.append(seq.token_ids[start] if start < len(seq.token_ids) else PLACEHOLDER)
        elif n:
            tok.extend(seq.token_ids[start : start + n])
        if n == 1:
            pos.append(start)
            for g, pages in enumerate(seq.tables):
                slot[g].append(pages[start // page_size] * page_size + start % page_size)
        elif n:
            span = np.arange(start, start + n)
            pos.extend(range(start, start + n))
            for g, pages in enumerate(seq.tables):
                page_of = np.asarray(pages, np.int64)[span // page_size]
                slot[g].extend((page_of * page_size + span % page_size).tolist())
        end = start + n
        num_pages = max(num_pages, -(-end // page_size))
        table_rows.append(seq.table_row)
        query_end.append(len(tok))
        consts.append(seq.sampling_constants)
        p = seq.params
        generated = seq.num_output_tokens + seq.num_placeholders
        num_generated.append(generated)
        num_banned.append(max(p.min_tokens - generated, 0))
        if generated < p.min_tokens:
            ban.append((i, ([] if p.ignore_eos else list(eos_token_ids)) + p.stop_token_ids))
        if p.uses_penalties:
            penalty_rows.append(i)
        if p.logit_bias:
            bias_rows.append(i)
        if p.structured_outputs is not None:
            constrained.append(i)
        if p.prompt_logprobs is not None and n and start < seq.num_prompt_tokens - 1:
            prompt_spans.append((i, len(tok) - n, start, n))
        wants_logprobs |= p.logprobs is not None
        pools |= bool(n) and seq.group.pooler is not None and start < seq.num_prompt_tokens
    s = len(rows)
    banned = np.full((s, MAX_BANNED), -1, np.int32)
    for i, stops in ban:
        banned[i, : len(stops[:MAX_BANNED])] = stops[:MAX_BANNED]
    uses_penalties = np.zeros(s, bool)
    uses_penalties[penalty_rows] = True
    bias_ids = bias_values = is_constrained = None
    if bias_rows:
        width = pow2_width(max(len(rows[i].seq.params.logit_bias) for i in bias_rows))
        bias_ids = np.full((s, width), -1, np.int32)
        bias_values = np.zeros((s, width), np.float32)
        for i in bias_rows:
            bias = rows[i].seq.params.logit_bias
            bias_ids[i, : len(bias)] = list(bias)
            bias_values[i, : len(bias)] = list(bias.values())
    if constrained:
        is_constrained = np.zeros(s, bool)
        is_constrained[constrained] = True
    key_data = np.empty((s, 2), np.uint32)
    key_data[:, 0] = [c.key_high for c in consts]
    key_data[:, 1] = [c.key_low for c in consts]
    sampling = SamplingInputs(
        temperature=np.asarray([c.temperature for c in consts], np.float32),
        top_k=np.asarray([c.top_k for c in consts], np.int32),
        top_p=np.asarray([c.top_p for c in consts], np.float32),
        min_p=np.asarray([c.min_p for c in consts], np.float32),
        key_data=key_data,
        num_generated=np.asarray(num_generated, np.int32),
        banned=banned,
        penalties=_penalties(rows, penalty_rows) if penalty_rows else None,
        bias_ids=bias_ids,
        bias_values=bias_values,
        num_banned_positions=np.asarray(num_banned, np.int32),
    )
    prompt_targets = None
    if prompt_spans:
        prompt_targets = np.full(len(tok), -1, np.int32)
        for i, first, start, n in prompt_spans:
            seq = rows[i].seq
            end = min(start + n, seq.num_prompt_tokens - 1)  # the last prompt token predicts
            prompt_targets[first : first + end - start] = seq.token_ids[start + 1 : end + 1]
    proposals = num_proposed = None
    if spec_rows:
        width = max(len(x) for _, x in spec_rows)
        proposals = np.full((s, width), -1, np.int32)
        num_proposed = np.zeros(s, np.int32)
        for i, x in spec_rows:
            proposals[i, : len(x)] = x
            num_proposed[i] = len(x)
    num_new = np.fromiter((r.num_new_tokens for r in rows), np.int32, count=s)
    sample_rows = np.fromiter((r.sample_row for r in rows), np.int32, count=s)
    query_start = np.zeros(s + 1, np.int32)
    query_start[1:] = query_end
    return StepPlan(
        seq_ids=np.fromiter((r.seq.seq_id for r in rows), np.int64, count=s),
        table_rows=np.asarray(table_rows, np.int32),
        starts=np.fromiter((r.start for r in rows), np.int32, count=s),
        num_new_tokens=num_new,
        sample_rows=sample_rows,
        keep_sample=np.fromiter((r.keep_sample for r in rows), bool, count=s),
        query_start=query_start,
        token_ids=np.asarray(tok, np.int32),
        positions=np.asarray(pos, np.int32),
        slot_mapping=np.asarray(slot, np.int32).reshape(num_groups, len(tok)),
        page_updates=pairs(page_updates, 3),
        page_copies=pairs(page_copies, 2),
        swap_out=pairs(swap_out, 2),
        swap_in=pairs(swap_in, 2),
        sampling=sampling,
        uses_penalties=uses_penalties,
        wants_logprobs=wants_logprobs,
        max_pages=num_pages,
        decode_only=bool(s)
        and not spec_rows
        and bool(np.all(num_new == 1))
        and bool(np.array_equal(sample_rows, np.arange(s))),
        prompt_targets=prompt_targets,
        proposals=proposals,
        num_proposed=num_proposed,
        pools=pools,
        constrained=is_constrained,
    )


def empty_plan() -> StepPlan:
    """A plan with no rows (padding only: what a warm-up or a follower's dummy step runs)."""
    return build([], page_size=1, eos_token_ids=(), page_updates=[], page_copies=[],
                 swap_out=[], swap_in=[])  # fmt: skip


def _penalties(rows: list[ScheduledRow], penalty_rows: list[int]) -> Penalties:
    s = len(rows)
    seqs = [rows[i].seq for i in penalty_rows]
    hp = pow2_width(max(q.num_prompt_tokens for q in seqs))
    ho = pow2_width(max(q.num_output_tokens for q in seqs))
    prompt = np.full((s, hp), -1, np.int32)
    output = np.full((s, ho), -1, np.int32)
    presence = np.zeros(s, np.float32)
    frequency = np.zeros(s, np.float32)
    repetition = np.ones(s, np.float32)
    for i, seq in zip(penalty_rows, seqs, strict=True):
        p = seq.params
        prompt[i, : seq.num_prompt_tokens] = seq.token_ids[: seq.num_prompt_tokens]
        out = seq.output_token_ids
        output[i, : len(out)] = out
        presence[i], frequency[i] = p.presence_penalty, p.frequency_penalty
        repetition[i] = p.repetition_penalty
    return Penalties(prompt, output, presence, frequency, repetition)

"""Beam search on the paged cache, driven from the host, with transformers' semantics.

Every live beam is a Sequence in the scheduler. A device step yields, for each beam whose
tokens are all computed, its top K raw log-probabilities, K = max(2, 1 + num_eos) x
beam_width as in transformers (a candidate in the top K over all beams is in its own beam's
top K, so K per beam is enough). Once every live beam of a request has reported:

    candidates = top K of (beam score + token log-probability) over live beams x top K
    finished  <- those of the best beam_width candidates that end (EOS, or max_tokens
                 reached), scored cum_logprob / num_generated ** length_penalty (the EOS
                 counted); the best beam_width finished ones are kept
    running   <- the best beam_width candidates that do not end

The choice becomes page-table edits, never cache copies: a parent chosen once keeps its
pages and appends its token; one chosen c > 1 times is forked c - 1 times (the children
share its pages; a partly filled last page is copied on its first write); an unchosen beam
is dropped (its page references are freed). The search talks to the engine only through its
step_unsampled and its BeamSequences (`engine.beams`: append_token, fork_sequence,
drop_sequence, running_sequence_ids, preempt_sequence), the only code that edits beams in the
scheduler. The search stops as transformers' does: all
candidates end, or beam_width beams are finished and (early_stopping=True) or no running
beam can beat the worst of them any more.

A request keeps at most beam_width sequences, so requests are admitted while their slots
fit max_num_seqs; the engine runs nothing else meanwhile.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence as SequenceABC

import numpy as np

from jpaged.core.sequence import SeqStatus
from jpaged.sample.sampler import MAX_LOGPROBS
from jpaged.sample.sampling_params import BeamSearchParams, SamplingParams


class BeamSequences:
    """The beam search's edits of the scheduler's sequences (an LLMEngine's `beams`)."""

    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler

    def append_token(self, seq_id: int, token: int) -> None:
        """Appends a token the caller chose to a sequence (computed by its next step)."""
        self._scheduler.append_token(seq_id, int(token))

    def fork_sequence(self, seq_id: int) -> int:
        """A new sequence of the same request with seq_id's tokens, sharing its pages;
        returns its seq_id."""
        return self._scheduler.fork(self._scheduler.sequence(seq_id)).seq_id

    def drop_sequence(self, seq_id: int) -> None:
        """Finishes one sequence of a request (a dropped beam): its pages are freed and its
        request keeps only its other sequences."""
        seq = self._scheduler.sequence(seq_id)
        self._scheduler.finish(seq, "abort")
        seq.group.seqs.remove(seq)

    def running_sequence_ids(self) -> list[int]:
        """Running sequences, oldest admission first."""
        return [s.seq_id for s in self._scheduler.running]

    def preempt_sequence(self, seq_id: int) -> None:
        """Frees a running sequence's pages; it is recomputed after the waiting ones."""
        seq = self._scheduler.sequence(seq_id)
        if seq is not None and seq.status is SeqStatus.RUNNING:
            self._scheduler.preempt(seq)


@dataclasses.dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens, the EOS that ended the beam included
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (an EOS) or "length" (max_tokens)


@dataclasses.dataclass
class BeamSearchOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # beam_width of them, best score first


@dataclasses.dataclass(frozen=True)
class _Candidate:
    score: float  # parent beam's cumulative log-probability + the token's
    beam: int  # index of the parent among the running beams
    token: int


@dataclasses.dataclass
class _Beam:
    seq_id: int
    token_ids: list[int]  # generated so far
    score: float  # cumulative log-probability of the generated tokens


class _BeamRequest:
    """The search state of one prompt; `select` is pure host logic, `advance` edits pages."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_candidates = max(2, 1 + len(eos_token_ids)) * params.beam_width
        self.beams: list[_Beam] = []  # running, best first; the prompt's sequence at first
        self.finished: list[BeamSearchSequence] = []  # best first, at most beam_width
        self.reports: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # seq_id -> top K
        self.num_generated = 0

    def report(self, seq_id: int, top_ids: np.ndarray, top_logprobs: np.ndarray) -> None:
        """Stores a computed beam's top-K next tokens (int32[K]) and log-probabilities."""
        if not self.beams:
            self.beams = [_Beam(seq_id, [], 0.0)]
        k = self.num_candidates
        self.reports[seq_id] = (top_ids[:k], top_logprobs[:k])

    def ready(self) -> bool:
        return bool(self.beams) and all(b.seq_id in self.reports for b in self.beams)

    def select(self) -> list[_Candidate] | None:
        """One search step from the reports: updates `finished`; returns the next running
        beams (best first), or None when the search is over."""
        p = self.params
        width = p.beam_width
        cands = []
        for b, beam in enumerate(self.beams):
            ids, lps = self.reports.pop(beam.seq_id)
            cands += [_Candidate(beam.score + float(lp), b, int(t)) for t, lp in zip(ids, lps)]
        # torch.topk over the flat (beam, token) scores; ties broken by that flat index
        cands.sort(key=lambda c: (-c.score, c.beam, c.token))
        cands = cands[: self.num_candidates]
        self.num_generated += 1
        n = self.num_generated
        is_eos = [c.token in self.eos_token_ids for c in cands]
        ends = [e or n >= p.max_tokens for e in is_eos]
        for c, eos, end in zip(cands[:width], is_eos[:width], ends[:width]):
            if end:  # only the best beam_width candidates may finish, as in transformers
                tokens = self.beams[c.beam].token_ids
                self.finished.append(
                    BeamSearchSequence(
                        token_ids=tokens + [c.token],
                        text="",
                        cum_logprob=c.score,
                        score=c.score / n**p.length_penalty,
                        finish_reason="stop" if eos else "length",
                    )
                )
        self.finished.sort(key=lambda s: -s.score)
        del self.finished[width:]
        running = [c for c, end in zip(cands, ends) if not end][:width]
        if not running:
            return None
        if len(self.finished) == width:
            if p.early_stopping is True:
                return None
            # The best a running beam could still score: at max_tokens when early_stopping
            # is "never" and longer is better, else at its current length.
            length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else n
            if running[0].score / length**p.length_penalty <= self.finished[-1].score:
                return None
        return running

    def advance(self, engine, running: list[_Candidate]) -> None:
        """Makes `running` the live beams: drop unchosen parents, fork parents chosen more
        than once (pages shared, not copied), then append each beam's token."""
        chosen = {c.beam for c in running}
        for b, beam in enumerate(self.beams):
            if b not in chosen:
                engine.beams.drop_sequence(beam.seq_id)
        seq_ids: list[int] = []
        taken: set[int] = set()
        for c in running:
            parent = self.beams[c.beam].seq_id
            seq_ids.append(engine.beams.fork_sequence(parent) if c.beam in taken else parent)
            taken.add(c.beam)
        beams = []
        for seq_id, c in zip(seq_ids, running, strict=True):
            engine.beams.append_token(seq_id, c.token)
            beams.append(_Beam(seq_id, [*self.beams[c.beam].token_ids, c.token], c.score))
        self.beams = beams

    def output(self, tokenizer) -> BeamSearchOutput:
        for s in self.finished:
            s.text = tokenizer.decode(s.token_ids, True) if tokenizer is not None else ""
        return BeamSearchOutput(
            self.request_id, self.prompt, list(self.prompt_token_ids), list(self.finished)
        )


def beam_search(
    engine,
    prompts: SequenceABC,
    params: BeamSearchParams,
    request_ids: list[str],
) -> list[BeamSearchOutput]:
    """Runs beam search for every prompt on an idle engine; outputs in prompt order.

    Args:
      engine: an LLMEngine with no unfinished requests.
      prompts: texts or token-id lists; all are validated before any is queued.
      params: the search's BeamSearchParams.
      request_ids: one unused request id per prompt.

    Returns:
      One BeamSearchOutput per prompt, holding beam_width sequences, best first.
    """
    if not hasattr(engine, "step_unsampled"):
        raise ValueError(
            f"beam search runs on one LLMEngine (data_parallel_size 1), got {type(engine).__name__}"
        )
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")  # noqa: TRY004 - ValueError for every bad field (the API)
    if engine.has_unfinished_requests():
        raise RuntimeError("beam search needs an idle engine: finish or abort its requests first")
    width = params.beam_width
    eos = () if params.ignore_eos else engine.eos_token_ids
    per_beam = max(2, 1 + len(eos))
    max_num_seqs = engine.config.scheduler.max_num_seqs
    _check_width(width, per_beam, max_num_seqs)
    requests = []
    for i, (rid, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
        try:
            text, ids = engine.tokenize_prompt(prompt)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        if len(ids) + params.max_tokens > engine.max_model_len:
            raise ValueError(
                f"prompt {i}: {len(ids)} tokens + max_tokens ({params.max_tokens}) exceed "
                f"max_model_len ({engine.max_model_len})"
            )
        requests.append(_BeamRequest(rid, text, ids, params, eos))
    # Greedy rows with the top-20 log-probabilities; stops are the search's, not the engine's.
    sampling = SamplingParams(
        temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=per_beam * width
    )
    pending = collections.deque(requests)
    active: dict[str, _BeamRequest] = {}
    done: dict[str, BeamSearchOutput] = {}
    try:
        while pending or active:
            while pending and (len(active) + 1) * width <= max_num_seqs:
                req = pending.popleft()
                engine.add_request(req.request_id, list(req.prompt_token_ids), sampling)
                active[req.request_id] = req
            reports = engine.step_unsampled()
            if reports is None:
                _make_room(engine, active.values())
                continue
            for rid, seq_id, out, row in reports:
                active[rid].report(seq_id, out.top_ids[row], out.top_logprobs[row])
            for rid, req in list(active.items()):
                if not req.ready():
                    continue
                running = req.select()
                if running is None:
                    engine.abort_request(rid)  # drops the live beams, frees their pages
                    done[rid] = req.output(engine.tokenizer)
                    del active[rid]
                else:
                    req.advance(engine, running)
    except BaseException:
        engine.abort_request(list(active))
        raise
    return [done[r.request_id] for r in requests]


def _check_width(width: int, per_beam: int, max_num_seqs: int) -> None:
    """Raises ValueError for a beam_width the sampler's top tokens or the slots cannot hold."""
    if per_beam * width > MAX_LOGPROBS:
        raise ValueError(
            f"beam_width must be <= {MAX_LOGPROBS // per_beam} (each beam's top "
            f"{per_beam} x beam_width tokens come from the sampler's top {MAX_LOGPROBS}), "
            f"got {width}"
        )
    if width > max_num_seqs:
        raise ValueError(f"beam_width must be <= max_num_seqs ({max_num_seqs}), got {width}")


def _make_room(engine, active) -> None:
    """Nothing could run: beams that must still be computed wait for pages that beams
    already computed (waiting for their siblings) hold. Preempts the newest of those."""
    reported = {seq_id for req in active for seq_id in req.reports}
    for seq_id in reversed(engine.beams.running_sequence_ids()):
        if seq_id in reported:
            engine.beams.preempt_sequence(seq_id)
            return
    raise RuntimeError("beam search cannot proceed: the page pool is too small for one beam")

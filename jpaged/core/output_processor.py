"""Turns committed tokens into text and RequestOutputs; finds stop strings.

It owns each sequence's text: an incremental detokenizer (tokenizers' DecodeStream, seeded
with the prompt's last tokens so word-boundary spaces come out right; it releases text only
once a UTF-8 character is complete) and, for DELTA outputs, how much was already emitted.
The engine owns everything else: `process` only reports a stop string it found, and the engine
finishes the sequence.

Stop strings are searched only in the window the newest text can complete; a match truncates
the text (before the stop string, or after it with include_stop_str_in_output). While a
sequence runs, its last (longest stop string - 1) characters are held back from every output,
so a stop string is never partly emitted; this is the only hold-back on the way to a client.

Output kinds (SamplingParams.output_kind): CUMULATIVE, everything so far at every step;
DELTA, only the new text, token ids and logprobs of each choice that changed (a choice's
finish is emitted exactly once); FINAL_ONLY, everything, once, when the request finishes.
"""

from __future__ import annotations

import dataclasses

from tokenizers.decoders import DecodeStream

from jpaged.core.sequence import RequestGroup, Sequence
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sample.sampler import SamplerOutput
from jpaged.sample.sampling_params import RequestOutputKind
from jpaged.tokenizer import Tokenizer
from jpaged.worker.step_plan import StepPlan

# Prompt tokens kept as detokenizer context (word-boundary spaces need a few).
_PREFIX_CONTEXT = 5


@dataclasses.dataclass(eq=False)
class _SeqText:
    stream: DecodeStream | None
    num_seen: int  # tokens of the sequence the detokenizer has consumed
    text: str = ""
    num_sent_tokens: int = 0  # DELTA: token ids (and logprobs) already emitted
    num_sent_chars: int = 0  # DELTA: characters already emitted
    finish_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, _SeqText] = {}  # by seq_id
        self._prompt_logprobs_sent: set[str] = set()  # DELTA requests (by request_id)

    def _state(self, seq: Sequence) -> _SeqText:
        state = self._texts.get(seq.seq_id)
        if state is None:
            stream = None
            if self.tokenizer is not None:
                stream = DecodeStream(
                    ids=self.context(seq), skip_special_tokens=seq.params.skip_special_tokens
                )
            state = self._texts[seq.seq_id] = _SeqText(stream, seq.num_prompt_tokens)
        return state

    def context(self, seq: Sequence) -> list[int]:
        """The prompt's last tokens the detokenizer starts from (for word-boundary spaces),
        ending on a complete character: a prompt that ends inside a UTF-8 character leaves
        that character's bytes to the output's first text."""
        end = seq.num_prompt_tokens
        context = seq.token_ids[max(end - _PREFIX_CONTEXT, 0) : end]
        skip = seq.params.skip_special_tokens
        while context and self.tokenizer.decode(context, skip).endswith("\ufffd"):
            context = context[:-1]
        return context

    def process(self, seq: Sequence) -> tuple[str | None, int]:
        """Detokenizes seq's tokens since the last call (one, or several after a speculative
        step); returns the stop string the new text completed (the text is already cut
        there), or None, and how many of the new tokens came after the one that completed
        it (several tokens with stop strings are read one at a time, as vLLM does). The
        caller drops those tokens and finishes the sequence."""
        state = self._state(seq)
        if state.stream is None:
            return None, 0
        p = seq.params
        new = seq.token_ids[state.num_seen :]
        state.num_seen = len(seq.token_ids)
        if not new:
            return None, 0
        looks = bool(p.stop) and seq.finish_reason != "stop"
        pieces = [[t] for t in new] if looks and len(new) > 1 else [new]
        stop, surplus = None, 0
        for i, piece in enumerate(pieces):
            delta = state.stream.step(self.tokenizer.backend, piece if len(piece) > 1 else piece[0])
            if delta:
                state.text += delta
                if looks:
                    stop = self._find_stop(state, p, len(delta))
                    if stop is not None:
                        surplus = len(pieces) - 1 - i
                        state.num_seen -= surplus
                        break
        if stop is None and seq.is_finished and not isinstance(seq.stop_reason, str):
            self._flush(seq, state)
        return stop, surplus

    @staticmethod
    def _find_stop(state: _SeqText, params, new_chars: int) -> str | None:
        text = state.text
        for stop in params.stop:
            start = max(len(text) - new_chars - len(stop) + 1, 0)
            idx = text.find(stop, start)
            if idx != -1:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                state.text = text[:end]
                return stop
        return None

    def _flush(self, seq: Sequence, state: _SeqText) -> None:
        """At a token-level finish, releases text held back by an incomplete character."""
        full = self.tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)
        if full.startswith(state.text):
            state.text = full

    def text(self, seq: Sequence) -> str:
        state = self._texts.get(seq.seq_id)
        return state.text if state is not None else ""

    def make_output(self, group: RequestGroup) -> RequestOutput | None:
        """The request's output of this step by its output kind (None: nothing to emit).
        A finished request's text states are dropped."""
        finished = group.finished
        kind = group.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        holdback = max((len(s) for s in group.params.stop), default=1) - 1
        want_logprobs = group.params.logprobs is not None
        outputs = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            state = self._state(seq)
            text = state.text
            if not seq.is_finished and holdback:
                text = text[: max(len(text) - holdback, 0)]
            token_ids = seq.token_ids[seq.num_prompt_tokens :]
            logprobs = seq.logprobs if want_logprobs else None
            if delta:
                if state.finish_sent:
                    continue
                new_tokens = token_ids[state.num_sent_tokens :]
                new_text = text[state.num_sent_chars :]
                if not new_tokens and not new_text and not seq.is_finished:
                    continue
                if logprobs is not None:
                    logprobs = logprobs[state.num_sent_tokens :]
                state.num_sent_tokens = len(token_ids)
                state.num_sent_chars = len(text)
                state.finish_sent = seq.is_finished
                token_ids, text = new_tokens, new_text
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(logprobs) if logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        prompt_logprobs = self._prompt_logprobs(group, delta)
        if finished:
            self.release(group)
        if delta and not outputs and not finished and prompt_logprobs is None:
            return None
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=group.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            error=group.error,
            embedding=None
            if group.pooler is None or group.pooler.embedding is None or not finished
            else group.pooler.embedding.tolist(),
        )

    def _prompt_logprobs(self, group: RequestGroup, delta: bool) -> list | None:
        """The prompt's log-probabilities once all are computed (DELTA: in one output)."""
        lp = group.prompt_logprobs
        if lp is None or len(lp) < len(group.prompt_token_ids):
            return None
        if delta:
            if group.request_id in self._prompt_logprobs_sent:
                return None
            self._prompt_logprobs_sent.add(group.request_id)
        return lp

    def release(self, group: RequestGroup) -> None:
        """Drops the text states of a request's sequences (finished or aborted)."""
        for seq in group.seqs:
            self._texts.pop(seq.seq_id, None)
        self._prompt_logprobs_sent.discard(group.request_id)


# -- a step's prompt-side results, added to their requests before its tokens are committed --
def record_prompt_logprobs(plan: StepPlan, out: SamplerOutput, seq_of) -> None:
    """Appends each prompt position's log-probabilities to its request (positions already
    recorded, recomputed after a preemption, are skipped). seq_of: seq_id -> its
    unfinished Sequence or None."""
    targets = plan.prompt_targets
    for i, seq_id in enumerate(plan.seq_ids.tolist()):
        seq = seq_of(seq_id)
        if seq is None or seq.group.prompt_logprobs is None:
            continue
        recorded, n = seq.group.prompt_logprobs, seq.params.prompt_logprobs
        first, last = int(plan.query_start[i]), int(plan.query_start[i + 1])
        position = int(plan.starts[i]) + 1  # the prompt position the first token predicts
        for t in range(first, last):
            if targets[t] >= 0 and position == len(recorded):
                top = zip(
                    out.prompt_top_ids[t, :n].tolist(), out.prompt_top_logprobs[t, :n].tolist()
                )
                recorded.append({int(targets[t]): float(out.prompt_logprobs[t]), **dict(top)})
            position += 1


def record_pooled(plan: StepPlan, out: SamplerOutput, seq_of) -> None:
    """Adds each embedding row's chunk of its prompt to its request's Pooler."""
    for i, seq_id in enumerate(plan.seq_ids.tolist()):
        seq = seq_of(seq_id)
        if seq is not None and seq.group.pooler is not None:
            start = int(plan.starts[i])
            n = min(int(plan.num_new_tokens[i]), seq.num_prompt_tokens - start)
            if n > 0:
                seq.group.pooler.add(start, n, out.pooled[i])

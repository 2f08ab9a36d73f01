"""Turns sampled tokens into text and RequestOutputs; finds stop strings.

It owns each sequence's text and detokenizer offsets. Stop strings are searched only in the
window the newest text can complete; a match truncates the text (before the stop string, or
after it with include_stop_str_in_output) and finishes the sequence through the scheduler.
While a sequence runs, the last (longest stop string - 1) characters are held back, so a
stop string is never partly emitted.
"""

from __future__ import annotations

from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.scheduler import Scheduler
from jpaged.sequence import RequestGroup, Sequence
from jpaged.tokenizer import Tokenizer

# Prompt tokens kept as detokenizer context (word-boundary spaces need a few).
_PREFIX_CONTEXT = 5


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler

    def start(self, seq: Sequence) -> None:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(seq.num_prompt_tokens - _PREFIX_CONTEXT, 0)

    def process(self, seq: Sequence) -> None:
        """Detokenizes a sequence's newest token and applies stop strings."""
        if self.tokenizer is None:
            return
        p = seq.params
        if seq.read_offset == 0:  # first token: start from the prompt's end
            self.start(seq)
        delta, seq.prefix_offset, seq.read_offset = self.tokenizer.decode_incremental(
            seq.token_ids, seq.prefix_offset, seq.read_offset, p.skip_special_tokens
        )
        if delta:
            seq.text += delta
            if p.stop and seq.finish_reason != "stop":
                self._check_stop_strings(seq, len(delta))
        if seq.is_finished and not isinstance(seq.stop_reason, str):
            self._flush(seq)

    def _check_stop_strings(self, seq: Sequence, new_chars: int) -> None:
        text = seq.text
        for stop in seq.params.stop:
            start = max(len(text) - new_chars - len(stop) + 1, 0)
            idx = text.find(stop, start)
            if idx == -1:
                continue
            end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
            seq.text = text[:end]
            self.scheduler.finish(seq, "stop", stop)
            return

    def _flush(self, seq: Sequence) -> None:
        """At a token-level finish, releases text held back by an incomplete character."""
        full = self.tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)
        if full.startswith(seq.text):
            seq.text = full

    def make_output(self, group: RequestGroup) -> RequestOutput:
        holdback = max((len(s) for s in group.params.stop), default=1) - 1
        outputs = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            text = seq.text
            if not seq.is_finished and holdback:
                text = text[: max(len(text) - holdback, 0)]
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if group.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=list(group.prompt_token_ids),
            outputs=outputs,
            finished=group.finished,
            num_cached_tokens=group.num_cached_tokens,
        )

"""Reasoning models' text read into reasoning and content (--reasoning-parser): vLLM's
qwen3 and deepseek_r1, both `<think>...</think>`.

Where the reasoning is, for a parser and a rendered prompt (Reasoning, one per request):
- opened (deepseek_r1 always; qwen3 when the prompt ends with `<think>`, as Qwen3-Thinking's
  and R1's templates make it): the output is reasoning up to the first `</think>`; a
  `<think>` the model writes first anyway (after whitespace, if any) is dropped;
- not opened (qwen3 otherwise): the output is reasoning only when it begins (after
  whitespace, if any) with `<think>`, up to the first `</think>`; else all of it is content;
- reasoning that never closes (cut off by max_tokens) is all reasoning, streamed or not;
- content is what follows `</think>` without its leading whitespace (the models write
  "\\n\\n" there, and their own templates drop it when they render the turn again), None in
  a message when empty after reasoning; reasoning is None when the output had none.

ReasoningStream reads one choice delta by delta and holds back only what a later delta could
change (a tail that may begin a tag, whitespace before a possible `<think>` or after
`</think>`), so a tag split across deltas at any point never leaks into either part, and the
streamed parts concatenate to what split() gives for the whole text.

Constraints apply after the reasoning: ReasoningPromptPlan gives a request's structured
output (response_format, tool_choice required or named) the ReasoningPrefix that matches
this reading (jpaged/structured_output/params.py), once the prompt is rendered.

The tags are read as text: Qwen3's and R1's are ordinary (non-special) tokens, so they stay
in the decoded output.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jpaged.sample.sampling_params import SamplingParams
from jpaged.structured_output.params import ReasoningPrefix
from server.prompt_plans import PromptPlan

if TYPE_CHECKING:
    from server.engine_loop import ChoiceState

_WS = " \t\r\n"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """A reasoning format: its tags, and whether the output is reasoning from its start
    whatever the prompt says (always_opened)."""

    name: str
    always_opened: bool
    start: str = "<think>"
    end: str = "</think>"

    def for_prompt(self, prompt_text: str | None) -> Reasoning:
        """The reading of one request whose rendered prompt is prompt_text."""
        opened = self.always_opened or (
            prompt_text is not None and prompt_text.rstrip(_WS).endswith(self.start)
        )
        return Reasoning(self, opened)


PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", always_opened=True),
    "qwen3": ReasoningParser("qwen3", always_opened=False),
}


def get_parser(name: str) -> ReasoningParser:
    """The parser named name (--reasoning-parser). Raises ValueError naming the choices."""
    parser = PARSERS.get(name)
    if parser is None:
        raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return parser


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """One request's reading: its parser, and whether its prompt opened the reasoning."""

    parser: ReasoningParser
    opened: bool

    def stream(self) -> ReasoningStream:
        """A reader for one choice's text, delta by delta."""
        return ReasoningStream(self.parser, opened=self.opened)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output -> (reasoning or None when it had none, content)."""
        stream = self.stream()
        stream.feed(text, final=True)
        return stream.reasoning, stream.content

    def prefix(self) -> ReasoningPrefix:
        """The constraint-side view of this reading."""
        return ReasoningPrefix(start=self.parser.start, end=self.parser.end, opened=self.opened)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """params with its constraint (if any) applied after the reasoning."""
        if params.structured_outputs is None:
            return params
        return params.clone(
            structured_outputs=params.structured_outputs.with_reasoning(self.prefix())
        )


def split_reasoning(
    text: str, parser: str | ReasoningParser, *, prompt_text: str | None = None
) -> tuple[str | None, str]:
    """A whole output -> (reasoning or None, content), read as parser does after a prompt
    whose rendered text is prompt_text (None: a prompt that opened nothing)."""
    if isinstance(parser, str):
        parser = get_parser(parser)
    return parser.for_prompt(prompt_text).split(text)


# The states of a ReasoningStream, in the order the text moves through them.
_OPENING = "opening"  # the output may begin with start (whitespace first allowed)
_REASONING = "reasoning"
_GAP = "gap"  # after end: whitespace, dropped
_CONTENT = "content"


class ReasoningStream:
    """One choice's text -> its reasoning and content (see the module docstring).

    feed(delta, final) returns the (reasoning, content) text this delta adds; final=True
    flushes whatever was held back. `reasoning` (None until a reasoning part begins) and
    `content` are the whole parts so far.
    """

    def __init__(self, parser: ReasoningParser, *, opened: bool) -> None:
        self._start, self._end = parser.start, parser.end
        self._opened = opened
        self._state = _OPENING
        self._held = ""
        self.reasoning: str | None = None
        self.content = ""
        self._fed = 0  # characters fed so far
        # characters of the output through the end tag, once it was read (None before)
        self.end_offset: int | None = None

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        self._fed += len(delta)
        reasoning = content = ""
        while True:
            if self._state == _OPENING:
                head = text.lstrip(_WS)
                if head.startswith(self._start):
                    text = head[len(self._start) :]
                    self._state = _REASONING
                elif self._start.startswith(head) and not final:
                    self._held = text  # may still become start: wait
                    break
                else:
                    self._state = _REASONING if self._opened else _CONTENT
                if self._state == _REASONING:
                    self.reasoning = ""
            elif self._state == _REASONING:
                k = text.find(self._end)
                if k >= 0:
                    reasoning += text[:k]
                    text = text[k + len(self._end) :]
                    self.end_offset = self._fed - len(text)  # text: the fed text's tail
                    self._state = _GAP
                    continue
                keep = 0 if final else _tag_prefix_len(text, self._end)
                reasoning += text[: len(text) - keep]
                self._held = text[len(text) - keep :]
                break
            elif self._state == _GAP:
                text = text.lstrip(_WS)
                if not text:
                    break
                self._state = _CONTENT
            else:
                content += text
                break
        if reasoning:
            self.reasoning += reasoning
        self.content += content
        return reasoning, content


def reasoning_tokens(stream: ReasoningStream | None, choice: ChoiceState) -> int:
    """How many of choice's tokens are its reasoning, as stream read its text: none without
    reasoning, every token through the one that completed the end tag, all of them while the
    reasoning is unclosed (exact to the arrival: tokens of one step arrive together)."""
    if stream is None or stream.reasoning is None:
        return 0
    if stream.end_offset is None:
        return choice.num_tokens
    return choice.tokens_through(stream.end_offset)


def _tag_prefix_len(text: str, tag: str) -> int:
    """How many of text's last characters may be the beginning of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningPromptPlan(PromptPlan):
    """A chat's PromptPlan that, once its prompt is rendered (render_now, which prepare
    calls when nothing rendered it before), knows the request's Reasoning and has its
    constraint, if any, start after the reasoning."""

    def __init__(self, *args, parser: ReasoningParser, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._parser = parser
        self.reasoning: Reasoning | None = None  # set by render_now

    def render_now(self, engine) -> None:
        super().render_now(engine)
        self.reasoning = self._parser.for_prompt(self.prompt_text)
        self.params = self.reasoning.constrain(self.params)

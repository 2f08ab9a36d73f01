"""--reasoning-parser's readers (server/reasoning_parsers.py) on whole texts and on every way
a text can arrive in deltas: exact reasoning and content, tags split anywhere, no tags,
reasoning that never closes; and the prompt that decides whether qwen3's output starts
inside the reasoning. (The server's answers: test_reasoning_serving.py.)"""

from __future__ import annotations

import itertools

import pytest

from jpaged.structured_output.params import ReasoningPrefix
from server.reasoning_parsers import PARSERS, get_parser, split_reasoning

R1 = get_parser("deepseek_r1")
QWEN3 = get_parser("qwen3")
# Qwen3-Thinking's generation prompt opens the reasoning; Qwen3's with enable_thinking=false
# closes an empty one; the original Qwen3's opens nothing (the model writes <think>).
OPENED = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
CLOSED = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
PLAIN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

# (parser, prompt, output) -> (reasoning, content)
CASES = [
    (R1, PLAIN, "abc</think>\n\nanswer", ("abc", "answer")),
    (R1, PLAIN, "<think>\nabc\n</think>\n\nanswer", ("\nabc\n", "answer")),
    (R1, None, "still thinking <th", ("still thinking <th", "")),  # never closed
    (R1, None, "", ("", "")),
    (R1, None, "</think>", ("", "")),
    (R1, None, "a</think>b</think>c", ("a", "b</think>c")),  # the first end tag ends it
    (R1, None, "r</think> \t a  b \n", ("r", "a  b \n")),
    (R1, None, "x<think>y</think>z", ("x<think>y", "z")),  # <think> only counts first
    (QWEN3, PLAIN, "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "answer")),
    (QWEN3, PLAIN, "plain answer", (None, "plain answer")),
    (QWEN3, PLAIN, " so <think>a</think> b", (None, " so <think>a</think> b")),
    (QWEN3, PLAIN, " \n<think>x</think>y", ("x", "y")),
    (QWEN3, PLAIN, "<think>unclosed", ("unclosed", "")),
    (QWEN3, PLAIN, "<thin", (None, "<thin")),
    (QWEN3, PLAIN, "", (None, "")),
    (QWEN3, OPENED, "plan</think>\n\nanswer", ("plan", "answer")),
    (QWEN3, OPENED, "plan, unclosed", ("plan, unclosed", "")),
    (QWEN3, OPENED, "<think>plan</think>answer", ("plan", "answer")),
    (QWEN3, CLOSED, "answer</think>x", (None, "answer</think>x")),
    (QWEN3, None, "a</think>b", (None, "a</think>b")),
]


def deltas(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def streamed(parser, prompt, pieces: list[str]) -> tuple[str | None, str, list]:
    """Feeds pieces; returns the whole reasoning (None when none began), the content, and
    each delta's (reasoning, content)."""
    stream = parser.for_prompt(prompt).stream()
    out = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    reasoning = "".join(r for r, _ in out)
    assert stream.reasoning == (None if stream.reasoning is None else reasoning)
    assert stream.content == "".join(c for _, c in out)
    return stream.reasoning, stream.content, out


@pytest.mark.parametrize(("parser", "prompt", "text", "expected"), CASES)
def test_whole_text(parser, prompt, text, expected):
    assert parser.for_prompt(prompt).split(text) == expected
    assert split_reasoning(text, parser.name, prompt_text=prompt) == expected


@pytest.mark.parametrize(("parser", "prompt", "text", "expected"), CASES)
def test_every_split_into_up_to_four_deltas_gives_the_whole_texts_parts(
    parser, prompt, text, expected
):
    for k in range(4):
        for cuts in itertools.combinations(range(len(text) + 1), k):
            reasoning, content, _ = streamed(parser, prompt, deltas(text, cuts))
            assert (reasoning, content) == expected, deltas(text, cuts)
    # one character per delta, then an empty final delta (the finish alone)
    reasoning, content, _ = streamed(parser, prompt, [*text, ""])
    assert (reasoning, content) == expected


@pytest.mark.parametrize(
    ("parser", "prompt", "text", "expected"),
    [
        (R1, None, "<think>r</think>c", ("r", "c")),
        (QWEN3, PLAIN, "<think>r</think>c", ("r", "c")),
        (QWEN3, PLAIN, "<think</think>c", (None, "<think</think>c")),
    ],
)
def test_every_composition_of_a_short_text(parser, prompt, text, expected):
    """All 2^(n-1) ways to cut the text: no cut point, however many, moves a character."""
    n = len(text)
    for mask in range(1 << (n - 1)):
        cuts = tuple(i + 1 for i in range(n - 1) if mask >> i & 1)
        assert streamed(parser, prompt, deltas(text, cuts))[:2] == expected


def test_tags_split_across_deltas_are_held_back_and_never_leak():
    pieces = ["<th", "ink>plan</th", "ink>\n", "\nans", "wer", ""]
    _, _, out = streamed(QWEN3, PLAIN, pieces)
    assert out == [("", ""), ("plan", ""), ("", ""), ("", "ans"), ("", "wer"), ("", "")]
    # a held tail that turns out not to be a tag goes out with the next delta
    _, _, out = streamed(R1, None, ["a </thi", "s is</", "think>", "  x"])
    assert out == [("a ", ""), ("</this is", ""), ("", ""), ("", "x")]
    # qwen3 without <think> first: content at once, a later <think> is content too
    _, _, out = streamed(QWEN3, PLAIN, ["Hi", " <think>", "x</think>"])
    assert out == [("", "Hi"), ("", " <think>"), ("", "x</think>")]
    # whitespace before a possible <think> waits; it is content when no tag follows
    _, _, out = streamed(QWEN3, PLAIN, ["\n", " <", "b>"])
    assert out == [("", ""), ("", ""), ("", "\n <b>")]


def test_unclosed_reasoning_is_all_reasoning_at_the_finish():
    # the held tail of a cut-off reasoning is flushed as reasoning by the final delta
    _, _, out = streamed(R1, None, ["I think </thi", ""])
    assert out == [("I think ", ""), ("</thi", "")]
    _, _, out = streamed(QWEN3, OPENED, ["step 1", " </", ""])
    assert out == [("step 1", ""), (" ", ""), ("</", "")]


def test_which_prompts_open_the_reasoning():
    assert QWEN3.for_prompt(OPENED).opened and QWEN3.for_prompt("x <think>  \n").opened
    assert not QWEN3.for_prompt(CLOSED).opened and not QWEN3.for_prompt(PLAIN).opened
    assert not QWEN3.for_prompt(None).opened
    assert R1.for_prompt(PLAIN).opened and R1.for_prompt(None).opened  # always
    assert QWEN3.for_prompt(OPENED).prefix() == ReasoningPrefix(opened=True)
    assert QWEN3.for_prompt(PLAIN).prefix() == ReasoningPrefix(opened=False)


def test_unknown_parser_names_the_choices():
    assert sorted(PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError) as e:
        get_parser("qwen")
    assert str(e.value) == "reasoning_parser must be one of deepseek_r1, qwen3, got 'qwen'"
    with pytest.raises(ValueError, match="got 'r1'"):
        split_reasoning("x", "r1")

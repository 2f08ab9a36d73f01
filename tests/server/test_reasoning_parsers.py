"""--reasoning-parser: its readers (server/reasoning_parsers.py) on whole texts and on every
way a text can arrive in deltas (exact reasoning and content, tags split anywhere, no tags,
reasoning that never closes, the prompt that decides whether qwen3's output starts inside
the reasoning); then the HTTP API on a scripted fake engine, streamed and not: reasoning
apart from content, tool calls read from the content only, constraints handed to the engine
behind the reasoning prefix the prompt calls for. (A real Qwen3 model under the grammar:
test_reasoning_qwen3.py.)"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from fake_engine import EOS_TOKEN_ID, FakeEngine
from serving_helpers import sse_events

from jpaged.structured_output.params import ReasoningPrefix
from server.options import REASONING_PARSERS, ServerOptions
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
    assert sorted(PARSERS) == ["deepseek_r1", "qwen3"] == sorted(REASONING_PARSERS)
    with pytest.raises(ValueError) as e:
        get_parser("qwen")
    assert str(e.value) == "reasoning_parser must be one of deepseek_r1, qwen3, got 'qwen'"
    with pytest.raises(ValueError, match="got 'r1'"):
        split_reasoning("x", "r1")
    with pytest.raises(ValueError) as e:
        ServerOptions(reasoning_parser="qwen")
    assert str(e.value) == "reasoning_parser must be one of deepseek_r1, qwen3, got 'qwen'"


# ---- the HTTP API on a scripted fake engine -------------------------------------------------


class ScriptedEngine(FakeEngine):
    """The fake engine; a request added while `scripts` holds one says it, one piece per
    token, then EOS (or stops at max_tokens)."""

    def __init__(self) -> None:
        super().__init__(max_model_len=512)
        self.scripts: list[list[str]] = []
        self._said: dict[str, list[str]] = {}

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        super().add_request(request_id, prompt, params, **kwargs)
        self._said[request_id] = self.scripts.pop(0)

    def _append_token(self, r, c) -> None:
        script = self._said[r.request_id]
        i = len(c.token_ids)
        c.token_ids.append(10 + i if i < len(script) else EOS_TOKEN_ID)
        if self._pages_for(len(r.prompt_ids) + len(c.token_ids)) > len(c.page_ids):
            self._take_pages(c, 1)
        if i == len(script):
            c.finish_reason = "stop"
            return
        c.text += script[i]
        if r.params.max_tokens is not None and len(c.token_ids) >= r.params.max_tokens:
            c.finish_reason = "length"


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# A template whose generation prompt opens the reasoning, as Qwen3-Thinking's does
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: <think>\n{% endif %}"
)
# qwen3 writing <think> itself, its tags split across tokens, then a hermes tool call
CALLING = [
    "<th",
    "ink>Let me",
    " check.</th",
    "ink>\n\n",
    "<tool_call>\n",
    '{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}',
    "\n</tool_call>",
]


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=30)


def answer(server, script: list[str], **body) -> dict:
    server.engine.scripts.append(script)
    r = post(server, {"messages": ASK, "max_tokens": 50, **body})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return choice


def stream(server, script: list[str], **body) -> list[tuple[dict, str | None]]:
    """The streamed chunks' choices after the role chunk, each as (delta, finish_reason).
    (How many tokens a chunk holds depends on timing: the engine may step several times
    between two reads.)"""
    server.engine.scripts.append(script)
    body = {"messages": ASK, "max_tokens": 50, **body, "stream": True}
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    (role, *rest) = [e["choices"][0] for e in events[:-1]]
    assert role["delta"] == {"role": "assistant", "content": ""}
    return [(c["delta"], c["finish_reason"]) for c in rest]


def merged(chunks) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """A stream's reasoning, content, calls (name, arguments) and last finish_reason; checks
    that every reasoning delta comes before any content or call, that the two reasoning
    fields agree, and that the finish comes last."""
    reasoning, content, calls, kinds = "", "", [], []
    for delta, _ in chunks:
        assert delta.get("reasoning") == delta.get("reasoning_content")
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                assert call["type"] == "function" and call["function"]["arguments"] == ""
                calls.append([call["function"]["name"], ""])
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
        kinds += ["reasoning"] if "reasoning" in delta else []
        kinds += ["answer"] if "content" in delta or "tool_calls" in delta else []
    assert kinds == sorted(kinds, reverse=True)  # "reasoning"s, then "answer"s
    assert all(f is None for _, f in chunks[:-1])
    return reasoning, content, [tuple(c) for c in calls], chunks[-1][1]


@pytest.fixture(scope="module")
def servers():
    from serving_helpers import RunningServer

    made = {
        name: RunningServer(ScriptedEngine(), reasoning_parser=name, tool_call_parser="hermes")
        for name in ("qwen3", "deepseek_r1")
    }
    made["none"] = RunningServer(ScriptedEngine(), tool_call_parser="hermes")
    yield made
    for s in made.values():
        s.close()


def test_reasoning_apart_from_the_content_and_tool_calls_from_the_content(servers):
    qwen3 = servers["qwen3"]
    choice = answer(qwen3, CALLING, tools=TOOLS, tool_choice="auto")
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == "Let me check."
    assert message["content"] is None
    ((call),) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls"
    # streamed: reasoning deltas, the tags' pieces never sent, then the call
    chunks = stream(qwen3, CALLING, tools=TOOLS, tool_choice="auto")
    assert merged(chunks) == (
        "Let me check.", "", [("get_weather", '{"city": "Paris"}')], "tool_calls"
    )  # fmt: skip
    # a tool call written inside the reasoning is reasoning, not a call
    inside = ["<think><tool_call>", '{"name": "get_weather", "arguments": {}}', "</tool_call>"]
    message = answer(qwen3, inside, tools=TOOLS, tool_choice="auto")["message"]
    assert message["reasoning"] == "".join(inside)[len("<think>") :]
    assert message["content"] is None and "tool_calls" not in message


def test_plain_answers_and_cut_off_reasoning(servers):
    r1 = servers["deepseek_r1"]
    script = ["Two and", " two.</think>", "\n\nThe answer", " is 4."]
    message = answer(r1, script)["message"]
    assert message == {"role": "assistant", "content": "The answer is 4.",
                       "reasoning": "Two and two.", "reasoning_content": "Two and two."}  # fmt: skip
    assert merged(stream(r1, script)) == ("Two and two.", "The answer is 4.", [], "stop")
    # cut off by max_tokens inside the reasoning: all of it is reasoning, content null
    choice = answer(r1, ["Two and", " two </th", "ink>x"], max_tokens=2)
    assert choice["message"]["reasoning"] == "Two and two </th"
    assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
    assert merged(stream(r1, ["Two and", " two </th", "ink>x"], max_tokens=2)) == (
        "Two and two </th", "", [], "length"
    )  # fmt: skip
    # qwen3, no <think> in the output or the prompt: all content, reasoning null
    message = answer(servers["qwen3"], ["Paris is", " sunny."])["message"]
    assert message["content"] == "Paris is sunny." and message["reasoning"] is None
    # qwen3 after a template that opens <think>: the output starts inside the reasoning
    choice = answer(servers["qwen3"], ["Sun", "ny?</think>", "Sunny."],
                    chat_template=THINKING_TEMPLATE)  # fmt: skip
    assert (choice["message"]["reasoning"], choice["message"]["content"]) == ("Sunny?", "Sunny.")
    # a server without --reasoning-parser: the text as it came, no reasoning fields
    message = answer(servers["none"], script)["message"]
    assert message == {"role": "assistant", "content": "".join(script)}


def usage_of(server, script: list[str], streamed: bool = False, **body) -> dict:
    """The usage of one chat: the response's, or the streamed usage chunk's."""
    server.engine.scripts.append(script)
    body = {"messages": ASK, "max_tokens": 50, **body}
    if not streamed:
        r = post(server, body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    return events[-2]["usage"]


@pytest.mark.parametrize("streamed", [False, True])
def test_usage_counts_the_reasoning_tokens(servers, streamed):
    """completion_tokens_details.reasoning_tokens: every token through the one that completes
    the end tag (each scripted piece is one token; the fake engine adds EOS)."""
    qwen3, r1 = servers["qwen3"], servers["deepseek_r1"]
    cases = [
        (r1, ["Two and", " two.</think>", "\n\nThe answer", " is 4."], {}, 2, 5),
        (r1, ["Two", " </th", "ink>", "\n\nOk."], {}, 3, 5),  # the tag over two tokens
        (r1, ["Two and", " two </th", "ink>x"], {"max_tokens": 2}, 2, 2),  # never closed
        (qwen3, ["Paris is", " sunny."], {}, 0, 3),  # no reasoning at all
        (qwen3, ["<think>", "hm", "</think>", "Ok"], {}, 3, 5),
        (qwen3, ["Sun", "ny?</think>", "Sunny."], {"chat_template": THINKING_TEMPLATE}, 2, 4),
    ]
    for server, script, extra, thought, completion in cases:
        usage = usage_of(server, script, streamed, **extra)
        assert usage["completion_tokens"] == completion, script
        assert usage["completion_tokens_details"] == {"reasoning_tokens": thought}, script
    # a server without --reasoning-parser counts nothing apart
    assert "completion_tokens_details" not in usage_of(servers["none"], ["a", "b"], streamed)


def test_constraints_reach_the_engine_behind_the_reasoning(servers):
    """The engine gets the request's constraint with the reasoning prefix its prompt calls
    for (the fake engine does not decode under it; test_reasoning_qwen3.py's model does), and
    the forced call is read from the content after the reasoning."""
    qwen3, r1 = servers["qwen3"], servers["deepseek_r1"]
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    cases = [
        (qwen3, {}, ReasoningPrefix(opened=False)),
        (qwen3, {"chat_template": THINKING_TEMPLATE}, ReasoningPrefix(opened=True)),
        (r1, {}, ReasoningPrefix(opened=True)),
    ]
    for server, extra, prefix in cases:
        before = set(server.engine.received)
        choice = answer(server, ["<think>hm</think>", '{"city": "Rome"}'], response_format=fmt,
                        **extra)  # fmt: skip
        (rid,) = set(server.engine.received) - before
        constraint = server.engine.received[rid][0].structured_outputs
        assert constraint.reasoning == prefix and constraint.json == WEATHER
        assert json.loads(constraint.ll_grammar)["grammars"][1]["name"] == "json_schema"
        assert choice["message"]["content"] == '{"city": "Rome"}'
        assert choice["message"]["reasoning"] == "hm"
    # tool_choice required: the tools' grammar after the reasoning, the call from the content
    required = [
        "Call it.</think>\n",
        '[{"name": "get_weather", ',
        '"parameters": {"city": "Oslo"}}]',
    ]
    choice = answer(r1, required, tools=TOOLS, tool_choice="required")
    assert choice["message"]["reasoning"] == "Call it." and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    rid = list(r1.engine.received)[-1]  # the latest request
    assert r1.engine.received[rid][0].structured_outputs.reasoning == ReasoningPrefix()
    # without --reasoning-parser the constraint holds from the first token
    answer(servers["none"], ['{"city": "Rome"}'], response_format=fmt)
    rid = list(servers["none"].engine.received)[-1]
    assert servers["none"].engine.received[rid][0].structured_outputs.reasoning is None

"""The tool-call parsers on hand-written model outputs: exact content and tool calls, whole
and streamed (one character at a time and in uneven chunks), and the streamed deltas in
OpenAI's shape (id, type and name first with empty arguments, then fragments)."""

from __future__ import annotations

import itertools

import pytest

from server.options import TOOL_CALL_PARSERS
from server.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolCallStream,
    mistral_call_id,
)

WEATHER = '{"city": "Paris", "unit": "celsius"}'


def whole(parser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    s = ToolCallStream(parser)
    s.feed(text, final=True)
    return s.content, [(c["function"]["name"], c["function"]["arguments"]) for c in s.calls]


def streamed(parser, chunks: list[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    """What a client assembles from the deltas: content, calls, and the deltas themselves."""
    s = ToolCallStream(parser)
    content, calls, deltas = "", {}, []
    for i, chunk in enumerate(chunks):
        text, new = s.feed(chunk, final=i == len(chunks) - 1)
        content += text
        deltas += new
        for d in new:
            if "id" in d:
                assert d["index"] == len(calls)
                calls[d["index"]] = [d["function"]["name"], ""]
                assert d["function"]["arguments"] == "" and d["type"] == "function"
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    return content or None, [tuple(c) for c in calls.values()], deltas


def check(parser, text: str, want_content, want_calls) -> None:
    assert whole(parser, text) == (want_content, want_calls)
    by_char = [*text, ""]
    sizes = itertools.cycle([3, 1, 7, 2, 11])
    uneven, i = [], 0
    while i < len(text):
        n = next(sizes)
        uneven.append(text[i : i + n])
        i += n
    for chunks in (by_char, uneven, [text]):
        content, calls, _ = streamed(parser, chunks)
        assert (content, calls) == (want_content, want_calls), chunks


def test_the_flag_names_every_parser():
    assert tuple(PARSERS) == TOOL_CALL_PARSERS


# ---- hermes -------------------------------------------------------------------------------


def test_hermes_one_call():
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
    check(HermesParser(), text, None, [("get_weather", WEATHER)])


def test_hermes_several_calls_and_text_before():
    text = (
        "Let me look both up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    check(
        HermesParser(),
        text,
        "Let me look both up.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')],
    )


def test_hermes_malformed_json_is_content():
    text = 'Sure.\n<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>'
    check(HermesParser(), text, text, [])


def test_hermes_plain_answer_and_a_lookalike_tag_are_content():
    check(HermesParser(), "The weather is fine.\n", "The weather is fine.\n", [])
    check(HermesParser(), "Use <tool> tags.", "Use <tool> tags.", [])


def test_hermes_call_without_its_end_tag_and_arguments_as_text():
    # the output stopped (EOS) before </tool_call>; arguments given as JSON text
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
    check(HermesParser(), text, None, [("f", '{"x": 1}')])


def test_hermes_streamed_deltas_split_over_many_chunks():
    text = f'Ok.<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
    content, calls, deltas = streamed(HermesParser(), [*text, ""])
    assert (content, calls) == ("Ok.", [("get_weather", WEATHER)])
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[0]["id"].startswith("call_") and len(deltas[0]["id"]) == 29
    fragments = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) == len(WEATHER)  # one per character fed, none held back
    assert "".join(fragments) == WEATHER


# ---- llama3_json --------------------------------------------------------------------------


def test_llama3_one_call():
    text = f'{{"name": "get_weather", "parameters": {WEATHER}}}'
    check(Llama3JsonParser(), text, None, [("get_weather", WEATHER)])


def test_llama3_python_tag_and_several_calls():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {"zone": "CET"}}'
    )
    check(
        Llama3JsonParser(),
        text,
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')],
    )


def test_llama3_text_before_the_call():
    text = 'I will check.\n{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    check(Llama3JsonParser(), text, "I will check.", [("get_weather", '{"city": "Oslo"}')])


def test_llama3_malformed_json_and_other_objects_are_content():
    text = '{"name": "get_weather", "parameters": {"city": Oslo}}'
    assert whole(Llama3JsonParser(), text) == (text, [])
    check(Llama3JsonParser(), 'Use {braces} or {"a": 1}.', 'Use {braces} or {"a": 1}.', [])


# ---- mistral ------------------------------------------------------------------------------


def test_mistral_one_and_several_calls():
    one = f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}]'
    check(MistralParser(), one, None, [("get_weather", WEATHER)])
    several = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]'
    )
    check(
        MistralParser(),
        several,
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')],
    )


def test_mistral_text_before_and_the_marker_skipped():
    text = 'Checking.[TOOL_CALLS][{"name": "f", "arguments": {"x": [1, 2]}}]'
    check(MistralParser(), text, "Checking.", [("f", '{"x": [1, 2]}')])
    # [TOOL_CALLS] is a special token: with skip_special_tokens only the array is left
    check(MistralParser(), '[{"name": "f", "arguments": {}}]', None, [("f", "{}")])


def test_mistral_malformed_json_is_content():
    text = '[TOOL_CALLS][{"name": "f", "arguments": {"x": }}]'
    assert whole(MistralParser(), text) == (text, [])
    check(MistralParser(), "[1, 2] is a list.", "[1, 2] is a list.", [])


def test_mistral_ids_are_nine_letters_and_digits():
    ids = {mistral_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)


# ---- the grammar-decoded shapes -----------------------------------------------------------


def test_required_and_named_choice():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "noop", "parameters": {}}]'
    check(RequiredParser(), text, None, [("get_weather", '{"city": "Paris"}'), ("noop", "{}")])
    check(NamedParser("get_weather"), WEATHER, None, [("get_weather", WEATHER)])


def test_named_choice_sends_its_name_before_any_text():
    s = ToolCallStream(NamedParser("f"))
    assert s.feed("", final=False)[1][0]["function"] == {"name": "f", "arguments": ""}


@pytest.mark.parametrize("max_calls", [1, None])
def test_parallel_tool_calls_false_keeps_the_first_call(max_calls):
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    s = ToolCallStream(HermesParser(), max_calls=max_calls)
    s.feed(text, final=True)
    assert [c["function"]["name"] for c in s.calls] == (["a"] if max_calls else ["a", "b"])

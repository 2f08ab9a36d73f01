"""A constraint after a reasoning prefix (ReasoningPrefix, StructuredOutputsParams.with_reasoning)
on the demo tokenizer, whose tags are several tokens each ('<', '/', 'th', 'in', 'k', '>'): the
model reasons freely, the constraint holds only after the first `</think>` and a little
whitespace, and the output cannot end before the constrained part does."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jpaged.structured_output import StructuredOutputsParams
from jpaged.structured_output.manager import StructuredOutputManager
from jpaged.structured_output.params import ReasoningPrefix
from jpaged.tokenizer import Tokenizer
from models.demo import build_tokenizer

DEMO_EOS = 1  # </s>
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer(), (DEMO_EOS,))


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, 2048)


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def walk(manager, tokenizer, params, text: str, key="k") -> tuple[int | None, bool]:
    """Feeds text's tokens; returns (index of the first refused token or None, finished)."""
    manager.add(key, params)
    try:
        mask = manager.allocate_bitmask(1)
        for i, t in enumerate(ids(tokenizer, text)):
            manager.fill_bitmask([key], mask)
            allowed = bool(mask[0, t // 32] >> (t % 32) & 1)
            manager.advance(key, [t])
            assert allowed == (manager.error(key) is None)  # the mask and the matcher agree
            if not allowed:
                return i, False
        return None, manager.is_finished(key)
    finally:
        manager.remove(key)


def allowed_texts(manager, tokenizer, params, prefix_text: str, key="m") -> set[str]:
    """The decoded tokens the grammar allows after prefix_text."""
    manager.add(key, params)
    try:
        manager.advance(key, ids(tokenizer, prefix_text))
        mask = manager.allocate_bitmask(1)
        manager.fill_bitmask([key], mask)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:2048]
        return {tokenizer.backend.id_to_token(int(t)) for t in np.flatnonzero(bits)}
    finally:
        manager.remove(key)


OPENED = StructuredOutputsParams(json=SCHEMA).with_reasoning(ReasoningPrefix(opened=True))
OPTIONAL = StructuredOutputsParams(json=SCHEMA).with_reasoning(ReasoningPrefix(opened=False))


@pytest.mark.parametrize(
    ("params", "text", "expected"),
    [
        # the prompt opened <think>: anything up to </think>, then the schema
        (OPENED, 'I need a "number" {not json}</think>\n\n{"a": 12}', (None, True)),
        (OPENED, '<think>\nhm</think>{"a": 1}', (None, True)),
        (OPENED, 'x</think> \n{"a": 1}', (None, True)),
        (OPENED, '{"a": 1}', (None, False)),  # still reasoning: no end tag yet
        (OPENED, "x</think>\n\n\n\n\n{", (11, False)),  # at most 4 whitespace characters
        (OPENED, 'x</think>{"a": "no"}', (12, False)),  # '"' where the integer goes
        (OPENED, 'x</think>{"a": 1}</think>', (14, False)),  # nothing after the body
        # the prompt opened nothing: the output opens <think> itself or is the body at once
        (OPTIONAL, '<think>hm {</think>\n\n{"a": 3}', (None, True)),
        (OPTIONAL, '{"a": 3}', (None, True)),
        (OPTIONAL, 'hm</think>{"a": 3}', (0, False)),
        (OPTIONAL, ' <think>x</think>{"a": 3}', (0, False)),
    ],
)
def test_the_constraint_holds_after_the_reasoning(manager, tokenizer, params, text, expected):
    assert walk(manager, tokenizer, params, text) == expected


def byte_token(b: int) -> str:
    """The byte-level BPE (GPT-2) name of the token of byte b."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def test_masks_allow_free_reasoning_then_only_the_body(manager, tokenizer):
    free = allowed_texts(manager, tokenizer, OPENED, "Let me see")
    # refused while reasoning: EOS (the output cannot end there), BOS, and the 77 bytes that
    # cannot begin a UTF-8 character (continuation bytes, 0xC0, 0xC1, 0xF5-0xFF)
    cannot_begin = [*range(0x80, 0xC0), 0xC0, 0xC1, *range(0xF5, 0x100)]
    vocab = {tokenizer.backend.id_to_token(i) for i in range(2048)}
    assert vocab - free == {"</s>", "<s>", *map(byte_token, cannot_begin)}
    assert len(vocab - free) == 79
    # the end tag's tokens themselves: after "</th" comes "in" (or anything else)
    assert "in" in allowed_texts(manager, tokenizer, OPENED, "ok </th")
    # after the end tag: whitespace (the gap) and the JSON's first token, nothing else
    after = allowed_texts(manager, tokenizer, OPENED, "ok </think>")
    assert "{" in after and "Ċ" in after and "h" not in after and "</s>" not in after
    assert allowed_texts(manager, tokenizer, OPENED, "ok </think>\n\n\n\n") == {"{"}
    # without a prefix the same schema allows only "{" first
    assert allowed_texts(manager, tokenizer, StructuredOutputsParams(json=SCHEMA), "") == {"{"}


@pytest.mark.parametrize(
    ("params", "body"),
    [
        (StructuredOutputsParams(regex="ye+s"), "yeees"),
        (StructuredOutputsParams(choice=["yes", "no"]), "no"),
        (StructuredOutputsParams(grammar='root ::= "a" "b"{2}'), "abb"),
        (StructuredOutputsParams(json_object=True), '{"z": [1]}'),
    ],
)
def test_every_kind_of_constraint_takes_a_prefix(manager, tokenizer, params, body):
    for opened in (True, False):
        wrapped = params.with_reasoning(ReasoningPrefix(opened=opened))
        assert walk(manager, tokenizer, wrapped, "<think>why</think>\n" + body) == (None, True)
        assert walk(manager, tokenizer, wrapped, "<think>why</think>\nzz")[0] is not None
    assert walk(manager, tokenizer, params.with_reasoning(ReasoningPrefix(opened=False)), body) == (
        None,
        True,
    )


def test_with_reasoning_keeps_the_constraint_and_the_engine_default(manager, tokenizer):
    plain = StructuredOutputsParams(json=SCHEMA)
    assert plain.with_reasoning(None) is plain
    assert OPENED.with_reasoning(None).ll_grammar == plain.ll_grammar
    assert OPENED.with_reasoning(ReasoningPrefix(opened=False)).ll_grammar == OPTIONAL.ll_grammar
    assert OPENED.reasoning == ReasoningPrefix() and OPENED.json == SCHEMA
    assert json.loads(OPENED.ll_grammar)["grammars"][1]["name"] == "json_schema"
    # an engine whose default is vLLM's any-whitespace JSON: the default applies after the
    # reasoning too
    loose = StructuredOutputManager(tokenizer, 2048, disable_any_whitespace=False)
    text = 'r</think>{ "a" :  5 }'
    assert walk(loose, tokenizer, OPENED, text) == (None, True)
    assert walk(manager, tokenizer, OPENED, text)[0] is not None
    with pytest.raises(ValueError, match="reasoning must be a ReasoningPrefix, got dict"):
        plain.with_reasoning({"opened": True})
    with pytest.raises(ValueError, match="reasoning end must be a non-empty string"):
        ReasoningPrefix(end="")
    # a request cannot set it: it is no constructor argument
    with pytest.raises(TypeError):
        StructuredOutputsParams(json=SCHEMA, reasoning=ReasoningPrefix())

"""Structured outputs on the host (jpaged/structured_output/) and the logits processors of
the step (jpaged/sample/logits_processors.py).

Constraints are exercised by greedy walks: random logits, masked by the filled bitmask under
jit, argmax, advance, until the grammar accepts only EOS; the decoded text must then satisfy
the constraint, checked by an independent parser (json, re, ast).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import jsonschema
import llguidance.numpy
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from jpaged.config import StructuredOutputsConfig
from jpaged.entrypoints.engine_args import add_engine_flags, engine_config_from_args, engine_kwargs
from jpaged.sample.logits_processors import apply_logit_bias, apply_token_bitmask
from jpaged.structured_output import StructuredOutputsParams
from jpaged.structured_output.manager import StructuredOutputManager, build_ll_tokenizer
from jpaged.structured_output.params import whitespace_pattern_problem
from jpaged.tokenizer import Tokenizer
from models.demo import build_tokenizer

DEMO_EOS = 1  # </s>
DEMO_TOKENS = 2048
VOCAB = 2100  # the model's vocabulary: larger than the tokenizer's

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -5, "maximum": 5},
                "ok": {"type": "boolean"},
            },
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
    },
    "required": ["name", "age", "tags", "point"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo_tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer(), eos_token_ids=(DEMO_EOS,))


@pytest.fixture(scope="module")
def manager(demo_tokenizer: Tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(demo_tokenizer, VOCAB)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row int32[W] allows, ascending."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


@jax.jit
def masked_argmax(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    return jnp.argmax(apply_token_bitmask(logits, bitmask), axis=-1)


def walk(
    manager: StructuredOutputManager,
    tokenizer: Tokenizer,
    params: list[StructuredOutputsParams],
    *,
    seed: int,
    max_steps: int = 400,
    boost: list[int] | None = None,
) -> list[str]:
    """One batch of greedy walks, an unconstrained row after each constrained one; returns the
    decoded texts of the constrained rows. Unconstrained rows must take the plain argmax.
    boost: token ids whose logits get +100, so a walk takes one of them wherever its
    grammar allows it."""
    eos = tokenizer.eos_token_id
    keys: list[Hashable | None] = []
    for i, p in enumerate(params):
        manager.add(("walk", seed, i), p)
        keys += [("walk", seed, i), None]
    tokens: dict[Hashable, list[int]] = {k: [] for k in keys if k is not None}
    rng = np.random.default_rng(seed)
    bitmask = manager.allocate_bitmask(len(keys) + 1)  # one padding row
    for _ in range(max_steps):
        live = [k if k is not None and not manager.is_finished(k) else None for k in keys]
        if all(k is None for k in live):
            break
        manager.fill_bitmask(live, bitmask)
        logits = rng.standard_normal((len(keys) + 1, manager.vocab_size), dtype=np.float32)
        if boost:
            logits[:, boost] += 100.0
        next_ids = np.asarray(masked_argmax(logits, bitmask))
        assert next_ids[-1] == np.argmax(logits[-1])
        for row, (key, token) in enumerate(zip(live, next_ids.tolist())):
            if key is None:
                assert token == np.argmax(logits[row])
                continue
            manager.advance(key, [token])
            assert manager.error(key) is None
            if token != eos:
                tokens[key].append(token)
    assert all(manager.is_finished(k) for k in tokens), "a walk did not finish"
    for k in tokens:
        manager.remove(k)
    assert all(t < DEMO_TOKENS for ts in tokens.values() for t in ts)
    return [tokenizer.decode(ts) for ts in tokens.values()]


# -- walks under each kind of constraint -----------------------------------------------------


def check_schema_by_hand(obj: object) -> None:
    assert isinstance(obj, dict)
    assert set(obj) - {"code"} == {"name", "age", "tags", "point"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert 1 <= len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"red", "green", "blue"}
    assert set(obj["point"]) == {"x", "ok"}
    assert type(obj["point"]["x"]) is int and -5 <= obj["point"]["x"] <= 5
    assert type(obj["point"]["ok"]) is bool
    assert "code" not in obj or re.fullmatch("[A-Z]{2}[0-9]{2}", obj["code"])


def outside_strings(text: str) -> str:
    """The JSON text with every string's content removed: the syntax and its whitespace."""
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


@pytest.mark.parametrize("disable_any_whitespace", [None, False, True])
def test_json_schema_walks_parse_and_validate(manager, demo_tokenizer, disable_any_whitespace):
    params = StructuredOutputsParams(
        json=json.dumps(SCHEMA), disable_any_whitespace=disable_any_whitespace
    )
    texts = walk(manager, demo_tokenizer, [params] * 6, seed=1)
    for text in texts:
        obj = json.loads(text)
        check_schema_by_hand(obj)
        jsonschema.validate(obj, SCHEMA)
        if disable_any_whitespace is None:  # the canonical layout, json.dumps' own
            assert layout(text) == layout(json.dumps(obj)), text
        elif disable_any_whitespace:
            assert not re.search(r"\s", outside_strings(text)), text


def layout(text: str) -> str:
    """The JSON text's syntax and whitespace, every string empty and every number 0 (the
    grammar may spell 0 as -0)."""
    return re.sub(r"-?[0-9]+", "0", outside_strings(text))


@pytest.fixture(scope="module")
def whitespace_ids(demo_tokenizer) -> list[int]:
    """The demo tokenizer's whitespace-only tokens (tab, LF, CR, one to three spaces)."""
    ids = [
        i
        for i in range(DEMO_TOKENS)
        if (s := demo_tokenizer.decode([i])) and set(s) <= set(" \t\n\r")
    ]
    assert len(ids) == 6
    return ids


# Strings are enums only, so whitespace the walks choose can only fall between JSON tokens.
NO_FREE_STRINGS = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "at": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["kind", "n", "flags", "at"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("kwargs", "check"),
    [
        # the default: json.dumps' layout exactly, however much the model wants whitespace
        ({}, lambda text, obj: layout(text) == layout(json.dumps(obj))),
        ({"disable_any_whitespace": True}, lambda text, obj: layout(text) == layout(json.dumps(obj, separators=(",", ":")))),
        ({"whitespace_pattern": ""}, lambda text, obj: not re.search(r"\s", text)),
        # at most one space per gap, and the walks that prefer whitespace take one in each
        ({"whitespace_pattern": "[ ]?"}, lambda text, obj: set(re.findall(r"\s+", text)) == {" "}),
        ({"whitespace_pattern": "[ ]?", "disable_any_whitespace": False}, lambda text, obj: set(re.findall(r"\s+", text)) == {" "}),
        ({"whitespace_pattern": "\n?"}, lambda text, obj: set(re.findall(r"\s+", text)) == {"\n"}),
        ({"whitespace_pattern": "(\n  )?"}, lambda text, obj: set(re.findall(r"\s+", text)) == {"\n  "}),
    ],
)  # fmt: skip
def test_whitespace_is_what_the_request_allows_when_the_model_wants_more(
    manager, demo_tokenizer, whitespace_ids, kwargs, check
):
    params = StructuredOutputsParams(json=NO_FREE_STRINGS, **kwargs)
    texts = walk(manager, demo_tokenizer, [params] * 4, seed=7, boost=whitespace_ids)
    for text in texts:
        obj = json.loads(text)
        jsonschema.validate(obj, NO_FREE_STRINGS)
        assert check(text, obj), text


def accepts(manager: StructuredOutputManager, tokenizer, params, text: str) -> bool:
    """Whether params' grammar, run by manager, takes text whole and is then complete."""
    manager.add("probe", params)
    try:
        manager.advance("probe", tokenizer.encode(text, False))
        return manager.error("probe") is None and manager.is_finished("probe")
    finally:
        manager.remove("probe")


LAYOUTS = {
    "compact": '{"kind":"cat","n":1,"flags":[true,false],"at":{"x":-2}}',
    "canonical": '{"kind": "cat", "n": 1, "flags": [true, false], "at": {"x": -2}}',
    "spaced": '{ "kind" : "cat" , "n" : 1 , "flags" : [ true , false ] , "at" : { "x" : -2 } }',
    "pretty": '{\n  "kind": "cat",\n  "n": 1,\n  "flags": [\n    true,\n    false\n  ],\n'
    '  "at": {\n    "x": -2\n  }\n}',
    "runaway": '{"kind": "cat",\r\n\t  \t\r\t  \n \r\n"n":1,"flags":[true],"at":{"x":0}}',
}


@pytest.mark.parametrize(
    ("engine_default", "kwargs", "taken"),
    [
        (None, {}, {"canonical"}),
        (True, {}, {"compact"}),
        (False, {}, set(LAYOUTS)),  # vLLM's default: any whitespace
        # a request's own setting wins over the engine's default
        (False, {"disable_any_whitespace": True}, {"compact"}),
        (True, {"disable_any_whitespace": False}, set(LAYOUTS)),
        (False, {"whitespace_pattern": "[ ]?"}, {"compact", "canonical", "spaced"}),
        (None, {"whitespace_pattern": "[ \n]*"}, {"compact", "canonical", "spaced", "pretty"}),
    ],
)
def test_the_engines_default_applies_to_requests_that_set_no_whitespace(
    demo_tokenizer, engine_default, kwargs, taken
):
    manager = StructuredOutputManager(demo_tokenizer, VOCAB, disable_any_whitespace=engine_default)
    for kind in ({"json": NO_FREE_STRINGS}, {"json_object": True}):
        params = StructuredOutputsParams(**kind, **kwargs)
        got = {
            name for name, text in LAYOUTS.items() if accepts(manager, demo_tokenizer, params, text)
        }
        assert got == taken, (kind, got)
    # other kinds never change with the default
    regex = StructuredOutputsParams(regex=r"\{ [a-z]+ \}")
    assert accepts(manager, demo_tokenizer, regex, "{ abc }")


def test_json_object_allows_only_an_object(manager, demo_tokenizer):
    manager.add("obj", StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    bitmask = manager.allocate_bitmask(1)
    manager.fill_bitmask(["obj"], bitmask)
    firsts = {demo_tokenizer.decode([int(t)]) for t in allowed_ids(bitmask[0])}
    assert firsts and all(s.startswith("{") for s in firsts)
    manager.advance("obj", demo_tokenizer.encode('{"a":[1,{"b":null}]}', False))
    assert manager.error("obj") is None
    assert manager.is_finished("obj")
    manager.remove("obj")


@pytest.mark.parametrize(
    "regex", [r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)", r"\d{3}-[A-Z]{2}( ok)?", r"(世界|🙂){1,2}!"]
)
def test_regex_walks_fullmatch(manager, demo_tokenizer, regex):
    texts = walk(manager, demo_tokenizer, [StructuredOutputsParams(regex=regex)] * 6, seed=2)
    for text in texts:
        assert re.fullmatch(regex, text), text


def test_choice_walks_give_a_choice(manager, demo_tokenizer):
    choice = ["red", "green", "blue", "dark blue", "世界", 'say "hi"\n']
    texts = walk(manager, demo_tokenizer, [StructuredOutputsParams(choice=choice)] * 8, seed=3)
    assert all(text in choice for text in texts) and len(set(texts)) > 1, texts


LARK_SUMS = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""


def check_sum(node: ast.AST) -> None:
    """Only integer literals, + and - (the grammar's language, parsed by Python)."""
    if isinstance(node, ast.BinOp):
        assert isinstance(node.op, ast.Add | ast.Sub)
        check_sum(node.left)
        check_sum(node.right)
    else:
        assert isinstance(node, ast.Constant) and type(node.value) is int


def test_lark_grammar_walks_parse(manager, demo_tokenizer):
    params = StructuredOutputsParams(grammar=LARK_SUMS)
    texts = walk(manager, demo_tokenizer, [params] * 6, seed=4)
    for text in texts:
        assert re.fullmatch(r"[0-9+\-()]+", text), text
        check_sum(ast.parse(text, mode="eval").body)


def test_gbnf_grammar_walks(manager, demo_tokenizer):
    params = StructuredOutputsParams(grammar='root ::= ("yes" | "no") "!" [0-9]')
    texts = walk(manager, demo_tokenizer, [params] * 6, seed=5)
    assert all(re.fullmatch(r"(yes|no)![0-9]", t) for t in texts), texts


def byte_fallback_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE (Llama 2's tokenizer.json layout): "▁" for spaces, <0xNN>
    byte tokens for characters outside the vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz0123456789", "▁t", "he", "▁the"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return Tokenizer(tok, eos_token_ids=(2,))


def test_byte_fallback_tokenizer_walks():
    tokenizer = byte_fallback_tokenizer()
    assert tokenizer.decode(tokenizer.encode("the é")) == "the é"
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size)
    regex = r"[a-z]{2,4} (é|世)[0-9]"
    texts = walk(manager, tokenizer, [StructuredOutputsParams(regex=regex)] * 6, seed=6)
    for text in texts:
        assert re.fullmatch(regex, text), text


# -- bitmask rows, failures, forks, rollback ----------------------------------------------------


def test_none_failed_and_padding_rows_are_all_ones(manager, demo_tokenizer):
    for key in ("a", "b", "c"):
        manager.add(key, StructuredOutputsParams(regex="[0-9]{4}"))
    fresh = manager.allocate_bitmask(1)
    manager.fill_bitmask(["a"], fresh)
    assert 0 < len(allowed_ids(fresh[0])) < DEMO_TOKENS

    manager.advance("b", demo_tokenizer.encode("x", False))  # forbidden: fails "b" alone
    error = manager.error("b")
    assert error and "\n" not in error and "doesn't satisfy the grammar" in error
    assert manager.error("a") is None and not manager.is_finished("b")
    manager.advance("b", demo_tokenizer.encode("1", False))  # a failed key stays failed
    assert manager.error("b") == error

    bitmask = np.zeros((6, manager.num_words), np.int32)
    manager.fill_bitmask(["a", None, "b", "c"], bitmask)
    np.testing.assert_array_equal(bitmask[0], fresh[0])
    np.testing.assert_array_equal(bitmask[3], fresh[0])
    assert (bitmask[[1, 2, 4, 5]] == -1).all()

    manager.advance("a", demo_tokenizer.encode("1234", False))
    manager.advance("c", demo_tokenizer.encode("12", False))
    assert manager.is_finished("a") and not manager.is_finished("c")
    manager.fill_bitmask(["a"], bitmask)
    assert allowed_ids(bitmask[0]).tolist() == [DEMO_EOS]
    for key in ("a", "b", "c"):
        manager.remove(key)
    assert len(manager) == 0 and manager.error("b") is None


def test_parallel_fill_equals_one_by_one(manager, demo_tokenizer):
    """Many rows go through llguidance's thread pool: the same rows as one at a time."""
    texts = ["1", "12", "123", "", "9", "99", "999", "4", "45", "456"]
    keys = [f"p{i}" for i in range(len(texts))]
    for key, text in zip(keys, texts):
        manager.add(key, StructuredOutputsParams(regex="[0-9]{3}[a-c]"))
        manager.advance(key, demo_tokenizer.encode(text, False))
    rows = [None, *keys, None]
    together = manager.allocate_bitmask(len(rows))
    manager.fill_bitmask(rows, together)
    for i, key in enumerate(keys):
        alone = manager.allocate_bitmask(1)
        manager.fill_bitmask([key], alone)
        np.testing.assert_array_equal(together[i + 1], alone[0])
        manager.remove(key)
    assert (together[[0, -1]] == -1).all()


def test_fork_and_rollback(manager, demo_tokenizer):
    manager.add("x", StructuredOutputsParams(regex="(ab|cd)[0-9]{3}"))
    before = manager.allocate_bitmask(1)
    manager.fill_bitmask(["x"], before)
    manager.advance("x", demo_tokenizer.encode("ab1", False))
    manager.fork("x", "y")
    manager.advance("y", demo_tokenizer.encode("23", False))
    assert manager.is_finished("y") and not manager.is_finished("x")

    after = manager.allocate_bitmask(2)
    manager.fill_bitmask(["x", "y"], after)
    manager.rollback("y", 2)
    again = manager.allocate_bitmask(1)
    manager.fill_bitmask(["y"], again)
    np.testing.assert_array_equal(again[0], after[0])
    manager.rollback("y", len(demo_tokenizer.encode("ab1", False)))
    manager.fill_bitmask(["y"], again)
    np.testing.assert_array_equal(again[0], before[0])
    with pytest.raises(ValueError, match="cannot roll back 1 tokens of 'y'"):
        manager.rollback("y", 1)
    for key in ("x", "y"):
        manager.remove(key)


def test_model_vocab_beyond_the_tokenizer_is_masked(manager):
    manager.add("any", StructuredOutputsParams(regex=r"(.|\n)*"))
    bitmask = manager.allocate_bitmask(1)
    manager.fill_bitmask(["any"], bitmask)
    manager.remove("any")
    allowed = allowed_ids(bitmask[0])
    assert bitmask.shape == (1, (VOCAB + 31) // 32)
    assert allowed.max() < DEMO_TOKENS and DEMO_EOS in allowed and 0 not in allowed  # <s>
    assert len(allowed) > DEMO_TOKENS // 2


def test_vocab_below_the_tokenizer_is_rejected(demo_tokenizer):
    with pytest.raises(ValueError, match="vocab_size 2000 is below the tokenizer's 2048 tokens"):
        build_ll_tokenizer(demo_tokenizer, 2000)


def test_manager_rejects_a_duplicate_key_and_a_bad_buffer(manager):
    manager.add("dup", StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="'dup' is already added"):
        manager.add("dup", StructuredOutputsParams(choice=["b"]))
    with pytest.raises(ValueError, match=r"bitmask must be int32\[rows, 66\], got int64\[2, 66\]"):
        manager.fill_bitmask(["dup"], np.zeros((2, 66), np.int64))
    with pytest.raises(ValueError, match="with >= 2 rows, got 1"):
        manager.fill_bitmask(["dup", None], manager.allocate_bitmask(1))
    manager.remove("dup")
    manager.remove("never added")


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": {"type": "objekt"}}, "structured_outputs.json: invalid JSON schema: "),
        ({"json": '{"type": '}, "structured_outputs.json: invalid JSON: "),
        ({"json": "[1]"}, "structured_outputs.json must be a JSON schema object"),
        ({"json": {"type": "string", "pattern": "[a-"}}, "structured_outputs.json: invalid JSON"),
        ({"regex": "[a-z"}, "structured_outputs.regex: invalid regex: "),
        ({"regex": 3}, "structured_outputs.regex must be a string, got 3"),
        ({"grammar": "start: foo"}, "structured_outputs.grammar: invalid grammar: "),
        ({"grammar": ""}, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be a bool, got 'yes'"),
        (
            {"json": {"type": "object"}, "regex": "a"},
            (
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                "must be set, got json and regex"
            ),
        ),
        ({}, "must be set, got none"),
        ({"json_object": False}, "must be set, got none"),
        (
            {"json_object": True, "disable_any_whitespace": "no"},
            "structured_outputs.disable_any_whitespace must be a bool, got 'no'",
        ),
        (
            {"json_object": True, "whitespace_pattern": 3},
            "structured_outputs.whitespace_pattern must be a string, got 3",
        ),
        (
            {"json_object": True, "whitespace_pattern": "[ "},
            "structured_outputs.whitespace_pattern: invalid regex '[ ': unclosed character class",
        ),
        (
            {"json": {"type": "object"}, "whitespace_pattern": "\\s*"},
            (
                "structured_outputs.whitespace_pattern: '\\\\s*' can match '\\x0b'; only space, "
                "\\t, \\n and \\r may appear between JSON tokens"
            ),
        ),
        (
            {"json_object": True, "whitespace_pattern": " ?,"},
            "structured_outputs.whitespace_pattern: ' ?,' can match ','",
        ),
        (
            {"json_object": True, "whitespace_pattern": "", "disable_any_whitespace": True},
            (
                "structured_outputs.whitespace_pattern and "
                "structured_outputs.disable_any_whitespace=true contradict each other: set one"
            ),
        ),
        (
            {"regex": "a+", "whitespace_pattern": "[ ]?"},
            (
                "structured_outputs.whitespace_pattern applies to JSON constraints only (a "
                "schema or json_object), not to regex"
            ),
        ),
        (
            {"choice": ["a"], "disable_any_whitespace": True},
            "structured_outputs.disable_any_whitespace applies to JSON constraints only",
        ),
    ],
)
def test_bad_params_raise_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        StructuredOutputsParams(**kwargs)
    assert "\n" not in str(info.value)


def test_error_messages_say_what_is_wrong():
    with pytest.raises(ValueError, match="unclosed character class"):
        StructuredOutputsParams(regex="[a-z")
    with pytest.raises(ValueError, match='unknown name: "foo"'):
        StructuredOutputsParams(grammar="start: foo")
    with pytest.raises(ValueError, match="Invalid type: objekt"):
        StructuredOutputsParams(json={"type": "objekt"})


@pytest.mark.parametrize(
    "pattern", ["", " ", "[ ]?", "[ \t\n\r]*", "\\x20{0,2}", "( |\n  )?", "\n?", "[\\n\\t]", " *"]
)
def test_whitespace_patterns_that_match_only_json_whitespace_pass(pattern):
    assert whitespace_pattern_problem(pattern) is None
    assert StructuredOutputsParams(json_object=True, whitespace_pattern=pattern).sets_whitespace


@pytest.mark.parametrize(
    ("pattern", "example"),
    [
        ("a", "'a'"),
        (".", "'\\x00'"),
        ("[^x]", "'\\x00'"),
        ("[ ]|x", "'x'"),
        ("/", "'/'"),
        ("\\/", "'/'"),
        ("(  )*\tx", "'x'"),  # found after whitespace
        ("\\s", "'\\x0b'"),  # \s is wider than JSON's whitespace
        (" é", "the byte 0xc3 (non-ASCII)"),
        ("\u00a0", "the byte 0xc2 (non-ASCII)"),  # no-break space: not JSON whitespace
    ],
)
def test_whitespace_patterns_that_can_match_anything_else_fail(pattern, example):
    problem = whitespace_pattern_problem(pattern)
    assert problem == (
        f"{pattern!r} can match {example}; only space, \\t, \\n and \\r may appear between "
        "JSON tokens"
    )


def test_the_structured_outputs_config_setting():
    config = engine_config_from_args(structured_outputs_config={"disable_any_whitespace": True})
    assert config.structured_outputs_config == '{"backend": "auto", "disable_any_whitespace": true}'
    assert config.structured_outputs == StructuredOutputsConfig(disable_any_whitespace=True)
    assert engine_config_from_args().structured_outputs.disable_any_whitespace is None
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--structured-outputs-config", '{"disable_any_whitespace": false}'])
    kwargs = engine_kwargs(args)
    assert kwargs == {"structured_outputs_config": '{"disable_any_whitespace": false}'}
    assert not engine_config_from_args(**kwargs).structured_outputs.disable_any_whitespace
    for bad, message in [
        ('{"whitespace": 1}', "unknown structured_outputs_config keys ['whitespace']; known: "),
        ('{"backend": "xgrammar"}', "structured_outputs_config.backend must be one of"),
        ('{"disable_any_whitespace": "yes"}', "disable_any_whitespace must be true or false"),
        ("{", "structured_outputs_config is not valid JSON"),
        ("[]", "structured_outputs_config must be a JSON object, got []"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            engine_config_from_args(structured_outputs_config=bad)


def test_params_kind_and_copies():
    choice = ["a", "b"]
    params = StructuredOutputsParams(choice=choice)
    choice.append("c")
    assert params.kind == "choice" and params.choice == ["a", "b"]
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert params == StructuredOutputsParams(choice=("a", "b"))


# -- logits processors against numpy references -----------------------------------------------


def bitmask_reference(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    out = logits.copy()
    for s in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(bitmask[s, t // 32]) >> (t % 32)) & 1:
                out[s, t] = -np.inf
    return out


@pytest.mark.parametrize("vocab", [64, 77, 2100])
def test_apply_token_bitmask_equals_numpy(vocab):
    rng = np.random.default_rng(vocab)
    num_words = (vocab + 31) // 32
    logits = rng.standard_normal((5, vocab), dtype=np.float32)
    bitmask = rng.integers(-(2**31), 2**31, (5, num_words), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # unconstrained
    bitmask[2] = 0
    bitmask[2, num_words - 1] = np.int32(-(2**31))  # only token 32 * (W - 1) + 31
    traces = []

    @jax.jit
    def masked(x, m):
        traces.append(1)
        return apply_token_bitmask(x, m)

    got = np.asarray(masked(logits, bitmask))
    expected = bitmask_reference(logits, bitmask)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[1], logits[1])
    assert np.isfinite(got[2]).sum() == (1 if 32 * num_words - 1 < vocab else 0)
    llg = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(llg, bitmask)
    np.testing.assert_array_equal(got, llg)
    np.testing.assert_array_equal(
        np.asarray(masked(logits, ~bitmask)), bitmask_reference(logits, ~bitmask)
    )
    assert len(traces) == 1


def test_apply_token_bitmask_rejects_a_wrong_width():
    with pytest.raises(ValueError, match=r"bitmask must be int32\[2, 3\] for logits \[2, 77\]"):
        apply_token_bitmask(jnp.zeros((2, 77)), jnp.zeros((2, 2), jnp.int32))


def test_apply_logit_bias_equals_numpy():
    rng = np.random.default_rng(0)
    vocab, num_rows, width = 300, 4, 5
    logits = rng.standard_normal((num_rows, vocab), dtype=np.float32)
    ids = np.full((num_rows, width), -1, np.int32)
    values = rng.uniform(-100, 100, (num_rows, width)).astype(np.float32)
    ids[0] = rng.choice(vocab, width, replace=False)
    ids[2, :2] = [0, vocab - 1]
    ids[3, :3] = rng.choice(vocab, 3, replace=False)
    expected = logits.copy()
    for s in range(num_rows):
        for b in range(width):
            if ids[s, b] >= 0:
                expected[s, ids[s, b]] += values[s, b]
    got = np.asarray(jax.jit(apply_logit_bias)(logits, ids, values))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[1], logits[1])

"""The constraint a request puts on its output (JSON schema, regex, choice, grammar).

StructuredOutputsParams is validated when constructed: a bad schema, regex, grammar or
whitespace pattern is a one-line ValueError naming the field, so no invalid constraint
reaches the engine. It holds the llguidance grammar text the constraint compiles to; the
matchers that run it are manager.py's.

JSON grammars (json, json_object) bound the whitespace outside strings unless asked not to:
by default one layout, json.dumps' `{"a": 1, "b": [1, 2]}` (one space after each "," and
":", nowhere else), so a model cannot spend its budget on whitespace between tokens and a
bounded schema closes within its longest form. A request asks for other whitespace with
whitespace_pattern (each gap between JSON tokens matches it) or disable_any_whitespace
(True: compact JSON, none at all; False: any run of JSON whitespace, vLLM's default); an
engine-wide default comes from EngineConfig.structured_outputs_config and reaches
grammar_for() through the manager.

A constraint with a ReasoningPrefix (a reasoning model's `<think>...</think>`) lets the model
write any text up to and including the first end tag, then a little whitespace, and
constrains only what follows. The grammar itself carries the prefix (reasoning_grammar), so
the manager and the engine run it like any other: the tags may span any tokens, a token may
hold the end of the reasoning and the start of the body, and the output cannot end before
the constrained part is complete.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json as jsonlib
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import llguidance
import llguidance.numpy
import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")
KIND_NAMES = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "JSON object grammar",
}
JSON_KINDS = ("json", "json_object")
# The layout JSON grammars allow when neither the request nor the engine says otherwise:
# json.dumps' separators and no other whitespace (docs/decoding.md says why).
CANONICAL_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# JSON's whitespace (RFC 8259): the only characters a whitespace_pattern may match.
JSON_WHITESPACE = " \t\n\r"
# A caret line or a numbered source excerpt in llguidance's messages.
_NOISE_LINE = re.compile(r"^\s*(\^+|\d+ \|.*)?\s*$")


def one_line(message: str) -> str:
    """llguidance's messages span lines (a source excerpt, a caret, a parser-state dump):
    keep the lines that say what went wrong, joined into one."""
    message = message.split("<non-verbose/>")[0].split("<state>")[0]
    lines = [ln.strip() for ln in message.splitlines() if not _NOISE_LINE.match(ln)]
    return " ".join(ln for ln in lines if ln)


def json_options(disable_any_whitespace: bool | None, whitespace_pattern: str | None) -> dict:
    """llguidance's JSON compile options for the whitespace between JSON tokens.

    whitespace_pattern, when given, is the regex each gap matches (llguidance's
    whitespace_pattern, separators "," and ":"); else disable_any_whitespace True allows
    none (compact JSON), False any run of JSON whitespace (llguidance's
    whitespace_flexible), and None the canonical layout.
    """
    if whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    if disable_any_whitespace is None:
        return dict(CANONICAL_LAYOUT)
    return {"whitespace_flexible": not disable_any_whitespace}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReasoningPrefix:
    """Free text a reasoning model writes before its constrained output.

    opened: True when the prompt already opened the reasoning (DeepSeek-R1's and
    Qwen3-Thinking's templates end the generation prompt with `<think>`): the output is any
    text up to and including the first `end`. False: the output either opens it itself, its
    first characters being `start`, and then runs to the first `end` as well, or it is the
    constrained part from its first character.

    Between `end` and the constrained part come at most MAX_GAP whitespace characters (the
    models write "\n\n" there); a reader takes the text after `end` without its leading
    whitespace as the content (server/reasoning_parsers.py).
    """

    start: str = "<think>"
    end: str = "</think>"
    opened: bool = True

    MAX_GAP: ClassVar[int] = 4

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"reasoning {name} must be a non-empty string, got {value!r}")
        if type(self.opened) is not bool:
            raise ValueError(f"reasoning opened must be a bool, got {self.opened!r}")


def reasoning_grammar(body: str, prefix: ReasoningPrefix) -> str:
    """The llguidance grammar of prefix, then what body allows.

    Args:
      body: an llguidance grammar as params make them (Lark text, or a TopLevelGrammar's
        JSON text with the start grammar first).
      prefix: the reasoning before it.
    Returns:
      A TopLevelGrammar's JSON text: a Lark start rule, then body's grammars, its first one
      named (and referenced by that name) when it was not.

    The reasoning is one lazy lexeme that ends at the first `end` (so never contains it):
    while it lasts, a mask allows nearly every token and llguidance computes it in a few
    microseconds.
    """
    if body.lstrip().startswith("{"):
        top = jsonlib.loads(body)
    else:
        top = {"grammars": [{"lark_grammar": body}]}
    first, *rest = top["grammars"]
    first = {**first, "name": first.get("name") or "body"}
    ref = "@" + first["name"]
    end = jsonlib.dumps(prefix.end, ensure_ascii=False)  # Lark strings take JSON's escapes
    if prefix.opened:
        start = f"start: reasoning GAP {ref}"
    else:
        opening = jsonlib.dumps(prefix.start, ensure_ascii=False)
        start = f"start: {opening} reasoning GAP {ref} | {ref}"
    lark = f"{start}\nreasoning[lazy]: /(?s:.*)/ {end}\nGAP: /[ \\t\\r\\n]{{0,{prefix.MAX_GAP}}}/\n"
    grammars = [{"lark_grammar": lark}, first, *rest]
    return jsonlib.dumps({"grammars": grammars, "max_tokens": top.get("max_tokens")})


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """One constraint on a request's output; field names and meanings follow vLLM.

    Exactly one of json (a JSON schema: a dict or its JSON text), regex, choice (the output is
    one of these strings), grammar (Lark, as llguidance accepts it, or GBNF) and json_object
    (any JSON object) is set.

    Whitespace outside strings, for json and json_object only (an error with the others):
      disable_any_whitespace: True: none (compact JSON, `{"a":1}`); False: any run of
        space, tab, CR and LF between tokens (vLLM's default, which lets a model emit
        whitespace until max_tokens); None: the engine's default (the canonical layout
        `{"a": 1, "b": [1, 2]}` unless structured_outputs_config says otherwise).
      whitespace_pattern: a regex (llguidance's syntax) each gap between JSON tokens
        matches, e.g. "" (none) or "[ ]?" (at most one space); it may match only JSON
        whitespace. Overrides disable_any_whitespace=False; with True it is an error.

    reasoning (not a constructor argument: with_reasoning sets it, so no request field
    reaches it): text the model writes freely before the constrained output (a
    ReasoningPrefix, a reasoning model's `<think>...</think>`), or None: the constraint
    holds from the output's first token.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None
    reasoning: ReasoningPrefix | None = dataclasses.field(init=False, default=None)
    # The llguidance grammar the constraint compiles to, with this request's whitespace (the
    # canonical layout when it sets none); set by __post_init__.
    ll_grammar: str = dataclasses.field(init=False, repr=False, compare=False, default="")
    # The parsed JSON schema (json and json_object), for grammar_for.
    _schema: dict | None = dataclasses.field(init=False, repr=False, compare=False, default=None)
    # The grammar without the reasoning prefix (with_reasoning's), for a later with_reasoning.
    _body: str = dataclasses.field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        if type(self.json_object) is not bool:  # bool has no subclasses; 0 and 1 are not bools
            raise ValueError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
            )
        if (
            self.disable_any_whitespace is not None
            and type(self.disable_any_whitespace) is not bool
        ):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be a bool, got "
                f"{self.disable_any_whitespace!r}"
            )
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                f"must be set, got {' and '.join(given) if given else 'none'}"
            )
        self._check_whitespace(given[0])
        object.__setattr__(self, "ll_grammar", self._compile(given[0]))

    def with_reasoning(self, prefix: ReasoningPrefix | None) -> StructuredOutputsParams:
        """This constraint after prefix: a copy whose grammar lets the model reason first
        (None: the constraint itself, from the first token). The body is not compiled again.

        Raises:
          ValueError: prefix is not a ReasoningPrefix (or None).
        """
        if prefix is not None and not isinstance(prefix, ReasoningPrefix):
            raise ValueError(f"reasoning must be a ReasoningPrefix, got {type(prefix).__name__}")
        if prefix == self.reasoning:
            return self
        out = copy.copy(self)
        body = self.ll_grammar if self.reasoning is None else self._body
        grammar = body if prefix is None else reasoning_grammar(body, prefix)
        error = llguidance.LLMatcher.validate_grammar(grammar) if prefix is not None else None
        if error:
            raise ValueError(f"structured_outputs: invalid reasoning prefix: {one_line(error)}")
        object.__setattr__(out, "reasoning", prefix)
        object.__setattr__(out, "ll_grammar", grammar)
        object.__setattr__(out, "_body", body)
        return out

    @property
    def kind(self) -> str:
        """Which field holds the constraint: one of KINDS."""
        return self._given()[0]

    @property
    def sets_whitespace(self) -> bool:
        """Whether the request chose its own whitespace (else the engine's default applies)."""
        return self.disable_any_whitespace is not None or self.whitespace_pattern is not None

    def grammar_for(self, default_disable_any_whitespace: bool | None) -> str:
        """The grammar to run on an engine whose default is default_disable_any_whitespace
        (None: the canonical layout): ll_grammar, except for a JSON constraint that sets no
        whitespace of its own, which takes the engine's default."""
        if self._schema is None or self.sets_whitespace or default_disable_any_whitespace is None:
            return self.ll_grammar
        grammar = _json_grammar(self._schema, json_options(default_disable_any_whitespace, None))
        return grammar if self.reasoning is None else reasoning_grammar(grammar, self.reasoning)

    def _given(self) -> list[str]:
        return [
            k
            for k in KINDS
            if (self.json_object if k == "json_object" else getattr(self, k) is not None)
        ]

    def _check_whitespace(self, kind: str) -> None:
        names = [
            n
            for n in ("disable_any_whitespace", "whitespace_pattern")
            if getattr(self, n) is not None
        ]
        if names and kind not in JSON_KINDS:
            raise ValueError(
                f"structured_outputs.{names[0]} applies to JSON constraints only (a schema or "
                f"json_object), not to {kind}"
            )
        pattern = self.whitespace_pattern
        if pattern is None:
            return
        field = "structured_outputs.whitespace_pattern"
        if type(pattern) is not str:
            raise ValueError(f"{field} must be a string, got {pattern!r}")
        if self.disable_any_whitespace:
            raise ValueError(
                f"{field} and structured_outputs.disable_any_whitespace=true contradict each "
                "other: set one"
            )
        problem = whitespace_pattern_problem(pattern)
        if problem:
            raise ValueError(f"{field}: {problem}")

    def _compile(self, kind: str) -> str:
        """The llguidance grammar text for the constraint, checked by llguidance."""
        field = f"structured_outputs.{kind}"
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except jsonlib.JSONDecodeError as e:
                    raise ValueError(f"{field}: invalid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(
                    f"{field} must be a JSON schema object (a dict or its JSON text), "
                    f"got {type(schema).__name__}"
                )
        elif kind == "json_object":
            schema = {"type": "object"}
        if kind in JSON_KINDS:
            object.__setattr__(self, "_schema", schema)
            options = json_options(self.disable_any_whitespace, self.whitespace_pattern)
            grammar = _json_grammar(schema, options)
        elif kind == "regex":
            if not isinstance(self.regex, str):
                raise ValueError(f"{field} must be a string, got {self.regex!r}")
            grammar = llguidance.LLMatcher.grammar_from_regex(self.regex)
        elif kind == "choice":
            choice = self.choice
            if (
                isinstance(choice, str)
                or not isinstance(choice, Sequence)
                or not choice
                or not all(isinstance(c, str) for c in choice)
            ):
                raise ValueError(f"{field} must be a non-empty list of strings, got {choice!r}")
            object.__setattr__(self, "choice", list(choice))
            # Lark string literals take JSON's escapes; the alternatives are tried as one lexeme.
            lark = "start: " + " | ".join(jsonlib.dumps(c, ensure_ascii=False) for c in choice)
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError(f"{field} must be a non-empty string, got {self.grammar!r}")
            try:  # Lark as is; GBNF (rules written `a ::= ...`) converted to Lark
                grammar = llguidance.grammar_from("grammar", self.grammar)
            except ValueError as e:
                raise ValueError(f"{field}: invalid grammar: {one_line(str(e))}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"{field}: invalid {KIND_NAMES[kind]}: {one_line(error)}")
        return grammar


def _json_grammar(schema: dict, options: dict) -> str:
    # The request's whitespace comes in as defaults: a schema's own "x-guidance" options
    # (llguidance's per-schema settings) take precedence over them.
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


# ---- whitespace patterns ----------------------------------------------------------------


class _ByteTokens:
    """A tokenizer of the 256 single bytes and an EOS (id 256): a grammar's first mask over
    it shows every first byte its language allows."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))


def _lark_regex(pattern: str) -> str:
    """pattern as a Lark /regex/ literal: "/" and line breaks escaped, escapes kept."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i : i + 2])
            i += 2
            continue
        out.append({"/": "\\/", "\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, c))
        i += 1
    return "/" + "".join(out) + "/"


@functools.lru_cache(maxsize=256)
def whitespace_pattern_problem(pattern: str) -> str | None:
    """Why pattern cannot be a whitespace_pattern (one line), or None when it is a regex
    that matches only strings of JSON whitespace (space, \\t, \\n, \\r).

    Exact, by llguidance's own regex engine: the strings pattern matches that are not all
    JSON whitespace form a regular language, empty iff its grammar allows no first byte.
    """
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(pattern))
    if error:
        reason = re.search(r".*error: (.*)$", one_line(error))
        return f"invalid regex {pattern!r}: {reason.group(1) if reason else one_line(error)}"
    lark = f"start: X\nX: {_lark_regex(pattern)} & ~/[ \\t\\n\\r]*/\n"
    tokenizer = _byte_tokenizer()
    matcher = llguidance.LLMatcher(
        tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0
    )
    if matcher.is_error():  # llguidance read the regex alone but not inside the check
        return f"invalid regex {pattern!r}: {one_line(matcher.get_error())}"
    mask = np.zeros((1, (tokenizer.vocab_size + 31) // 32), np.int32)
    example = None
    for _ in range(16):  # a few whitespace bytes in, for an example of what else it matches
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
        allowed = [int(b) for b in allowed if b < 256]
        if not allowed:
            break
        other = [b for b in allowed if chr(b) not in JSON_WHITESPACE]
        if other:
            b = other[0]
            example = repr(chr(b)) if b < 0x80 else f"the byte 0x{b:02x} (non-ASCII)"
            break
        example = "a character that is not JSON whitespace"
        matcher.consume_token(allowed[0])
    if example is None:
        return None
    return (
        f"{pattern!r} can match {example}; only space, \\t, \\n and \\r may appear "
        "between JSON tokens"
    )

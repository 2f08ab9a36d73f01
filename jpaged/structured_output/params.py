"""The constraint a request puts on its output (JSON schema, regex, choice, grammar).

StructuredOutputsParams is validated when constructed: a bad schema, regex or grammar is a
one-line ValueError naming the field, so no invalid constraint reaches the engine. It holds
the llguidance grammar text the constraint compiles to; the matchers that run it are
manager.py's.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
import re
from collections.abc import Sequence
from typing import Any

import llguidance

KINDS = ("json", "regex", "choice", "grammar", "json_object")
KIND_NAMES = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "JSON object grammar",
}
# A caret line or a numbered source excerpt in llguidance's messages.
_NOISE_LINE = re.compile(r"^\s*(\^+|\d+ \|.*)?\s*$")


def one_line(message: str) -> str:
    """llguidance's messages span lines (a source excerpt, a caret, a parser-state dump):
    keep the lines that say what went wrong, joined into one."""
    message = message.split("<non-verbose/>")[0].split("<state>")[0]
    lines = [ln.strip() for ln in message.splitlines() if not _NOISE_LINE.match(ln)]
    return " ".join(ln for ln in lines if ln)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """One constraint on a request's output; field names and meanings follow vLLM.

    Exactly one of json (a JSON schema: a dict or its JSON text), regex, choice (the output is
    one of these strings), grammar (Lark, as llguidance accepts it, or GBNF) and json_object
    (any JSON object) is set. disable_any_whitespace makes JSON outputs compact (no
    whitespace between tokens of the JSON syntax), as in vLLM.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    # The llguidance grammar the constraint compiles to; set by __post_init__.
    ll_grammar: str = dataclasses.field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if type(value) is not bool:  # bool has no subclasses; 0 and 1 are not bools here
                raise ValueError(f"structured_outputs.{name} must be a bool, got {value!r}")
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                f"must be set, got {' and '.join(given) if given else 'none'}"
            )
        object.__setattr__(self, "ll_grammar", self._compile(given[0]))

    @property
    def kind(self) -> str:
        """Which field holds the constraint: one of KINDS."""
        return self._given()[0]

    def _given(self) -> list[str]:
        return [
            k
            for k in KINDS
            if (self.json_object if k == "json_object" else getattr(self, k) is not None)
        ]

    def _compile(self, kind: str) -> str:
        """The llguidance grammar text for the constraint, checked by llguidance."""
        field = f"structured_outputs.{kind}"
        json_options = {"whitespace_flexible": not self.disable_any_whitespace}
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
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=json_options
            )
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

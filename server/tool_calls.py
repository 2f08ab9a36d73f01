"""Tool calling on /v1/chat/completions: a request's tools and tool_choice become what the
engine decodes and how each choice's text is read back (ToolPlan).

  tool_choice  the prompt            decoding                      the text is read by
  "none"       tools in the template  free                         nobody: it is content
  "auto"       tools in the template  free                         --tool-call-parser
  "required"   tools in the template  [{"name", "parameters"}, ...]  RequiredParser
  named        tools in the template  that function's parameters   NamedParser

"required" and named choice decode under a JSON schema built from the tools' own (the
structured-output machinery), so their arguments always validate. Unset, tool_choice is
"auto" when the request gives tools and the server parses tool calls
(--enable-auto-tool-choice), else "none". finish_reason becomes "tool_calls" when a choice
that stopped on its own made calls under "auto" or "required"; a named choice keeps "stop"
(as vLLM). Every refusal is an APIError(400) naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable

from jpaged.structured_output import StructuredOutputsParams
from server.openai_protocol import APIError, ChatCompletionRequest
from server.tool_parsers import (
    PARSERS,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolCallStream,
    ToolParser,
    mistral_call_id,
    openai_call_id,
)

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    choice: str  # "none", "auto", "required" or "named"
    tools: list[dict] | None  # the chat template's `tools` variable
    constraint: StructuredOutputsParams | None  # required and named choice
    parser: Callable[[], ToolParser] | None  # None: the text is content
    max_calls: int | None = None  # parallel_tool_calls=false: 1
    new_id: Callable[[], str] = openai_call_id

    def stream(self) -> ToolCallStream | None:
        """A reader for one choice's text, or None when its text is plain content."""
        if self.parser is None:
            return None
        return ToolCallStream(self.parser(), max_calls=self.max_calls, new_id=self.new_id)

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        if reason == "stop" and made_calls and self.choice in ("auto", "required"):
            return "tool_calls"
        return reason


NO_TOOLS = ToolPlan("none", None, None, None)


def plan_tools(
    req: ChatCompletionRequest, *, parser_name: str | None, auto_enabled: bool
) -> ToolPlan:
    """The request's ToolPlan. parser_name: --tool-call-parser; auto_enabled:
    --enable-auto-tool-choice."""
    check_tool_messages(req)
    tools = req.tools or []
    schemas = _schemas(tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools and auto_enabled and parser_name else "none"
    if choice != "none" and not tools:
        shown = f'"{choice}"' if isinstance(choice, str) else "a named function"
        raise APIError(400, f"tool_choice {shown} needs tools: the request has none",
                       param="tool_choice")  # fmt: skip
    rendered = [t.model_dump(exclude_none=True) for t in tools] if req.tools else None
    max_calls = None if req.parallel_tool_calls else 1
    if choice == "none":
        return ToolPlan("none", rendered, None, None)
    if choice == "auto":
        if not (auto_enabled and parser_name):
            raise APIError(
                400,
                'tool_choice "auto" needs a server started with --enable-auto-tool-choice '
                'and --tool-call-parser; use "required" or a named function, which this '
                "server decodes under the tools' schemas",
                param="tool_choice",
            )
        parser = PARSERS[parser_name]
        new_id = mistral_call_id if parser is MistralParser else openai_call_id
        return ToolPlan("auto", rendered, None, parser, max_calls, new_id)
    if choice == "required":
        items = [_call_schema(t.function.name, schemas[i]) for i, t in enumerate(tools)]
        schema = {
            "type": "array",
            "items": items[0] if len(items) == 1 else {"anyOf": items},
            "minItems": 1,
        }
        if max_calls is not None:
            schema["maxItems"] = max_calls
        constraint = _constraint(schema, "tools")
        return ToolPlan("required", rendered, constraint, RequiredParser, max_calls)
    name = choice.function.name
    names = [t.function.name for t in tools]
    if name not in names:
        raise APIError(
            400,
            f"tool_choice.function.name: {name!r} is not one of the tools "
            f"({', '.join(map(repr, names))})",
            param="tool_choice.function.name",
        )
    constraint = _constraint(schemas[names.index(name)], "tools")
    return ToolPlan("named", rendered, constraint, functools.partial(NamedParser, name), 1)


def check_tool_messages(req: ChatCompletionRequest) -> None:
    """A tool message names the call it answers (templates key results by it)."""
    for i, m in enumerate(req.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(
                400,
                f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers",
                param=f"messages[{i}].tool_call_id",
            )


def _schemas(tools) -> list[dict]:
    """Each tool's parameters schema, checked (a schema llguidance cannot compile is a 400
    naming the tool); names must be unique and not empty."""
    seen: dict[str, int] = {}
    schemas = []
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not name:
            raise APIError(400, f"tools[{i}].function.name: must not be empty",
                           param=f"tools[{i}].function.name")  # fmt: skip
        if name in seen:
            raise APIError(
                400,
                f"tools[{i}].function.name: {name!r} is also tools[{seen[name]}]'s name",
                param=f"tools[{i}].function.name",
            )
        seen[name] = i
        schema = tool.function.parameters
        schema = NO_PARAMETERS if schema is None else schema
        _constraint(schema, f"tools[{i}].function.parameters")
        schemas.append(schema)
    return schemas


def _call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _constraint(schema: dict, field: str) -> StructuredOutputsParams:
    try:
        return _compiled(json.dumps(schema))
    except ValueError as e:
        detail = str(e).removeprefix("structured_outputs.json: ")
        raise APIError(400, f"{field}: {detail}", param=field) from None


@functools.lru_cache(maxsize=256)
def _compiled(schema_text: str) -> StructuredOutputsParams:
    """Agents send the same tools with every turn: each schema is compiled once."""
    return StructuredOutputsParams(json=json.loads(schema_text))

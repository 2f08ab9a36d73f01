"""Tool calling on /v1/chat/completions: a request's tools and tool_choice become what the
engine decodes and how each choice's text is read back (ToolPlan).

  tool_choice  the prompt            decoding                      the text is read by
  "none"       tools in the template  free                         nobody: it is content
  "auto"       tools in the template  free                         the template's parser
  "required"   tools in the template  [{"name", "parameters"}, ...]  RequiredParser
  named        tools in the template  that function's parameters   NamedParser

"Tools in the template": the template's `tools` variable, and, for a template that renders
no tools (or no past calls or results), what server/tool_prompts.py adds to the
conversation in the syntax of the parser that reads the answer. That parser is the one the
template's own tool syntax names (hermes, llama3_json, mistral), or --tool-call-parser.
"auto" needs no flag: the model answers in text or calls tools. "required" and named choice
decode under a JSON schema built from the tools' own (the structured-output machinery), so
their arguments always validate; they take the turn over from a response_format (as
OpenAI's API does: the format applies to the turn that answers in text). Unset, tool_choice
is "auto" when the request gives tools, else "none" (OpenAI's defaults).
--enable-auto-tool-choice is accepted and changes nothing. finish_reason becomes
"tool_calls" when a choice that stopped on its own made calls under "auto" or "required"; a
named choice keeps "stop" (as vLLM). Every refusal is an APIError(400) naming the field.
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
from server.tool_prompts import ToolPrompt, tool_prompt

NO_PARAMETERS = {"type": "object", "properties": {}}
_NOTHING_ADDED = ToolPrompt("hermes")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    choice: str  # "none", "auto", "required" or "named"
    tools: list[dict] | None  # the chat template's `tools` variable
    constraint: StructuredOutputsParams | None  # required and named choice
    parser: Callable[[], ToolParser] | None  # None: the text is content
    max_calls: int | None = None  # parallel_tool_calls=false: 1
    new_id: Callable[[], str] = openai_call_id
    # what the conversation gets for its template (tools, past calls and results)
    prompt: ToolPrompt = _NOTHING_ADDED

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
    req: ChatCompletionRequest,
    *,
    parser_name: str | None = None,
    template: str | None = None,
    auto_enabled: bool | None = None,
) -> ToolPlan:
    """The request's ToolPlan.

    Args:
      parser_name: --tool-call-parser (None: the template's own syntax).
      template: the chat template the conversation renders with (the request's, the
        server's or the model's); None: unknown, so nothing is added to the conversation
        and "auto" reads hermes calls (or parser_name's).
      auto_enabled: --enable-auto-tool-choice, accepted and not needed ("auto" always works).
    """
    del auto_enabled
    check_tool_messages(req)
    tools = req.tools or []
    schemas = _schemas(tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        shown = f'"{choice}"' if isinstance(choice, str) else "a named function"
        raise APIError(400, f"tool_choice {shown} needs tools: the request has none",
                       param="tool_choice")  # fmt: skip
    rendered = [t.model_dump(exclude_none=True) for t in tools] if req.tools else None
    prompt = tool_prompt(template, rendered, parser_name)
    max_calls = None if req.parallel_tool_calls else 1
    plan = functools.partial(ToolPlan, tools=rendered, prompt=prompt)
    if choice == "none":
        return plan(choice="none", constraint=None, parser=None)
    if choice == "auto":
        parser = PARSERS[prompt.syntax]
        new_id = mistral_call_id if parser is MistralParser else openai_call_id
        return plan(choice="auto", constraint=None, parser=parser, max_calls=max_calls,
                    new_id=new_id)  # fmt: skip
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
        return plan(choice="required", constraint=constraint, parser=RequiredParser,
                    max_calls=max_calls)  # fmt: skip
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
    return plan(choice="named", constraint=constraint,
                parser=functools.partial(NamedParser, name), max_calls=1)  # fmt: skip


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

"""How a request's tools and tool history reach the model's prompt, for any chat template.

A template is read once (template_tools, cached by its text) for what it does with tools:

  - its tool-call syntax, from its own text: `[TOOL_CALLS]` is Mistral's, `<tool_call>`
    Hermes' (Qwen 2.5 / 3, Hermes, SmolLM3), `<|python_tag|>` or `"parameters": ` Llama
    3.x's JSON; it picks the parser that reads tool_choice "auto" output (--tool-call-parser
    overrides it). A template that names tools in no known syntax is read as hermes.
  - whether it renders `tools`, an assistant's `tool_calls` and a tool message's content:
    probe conversations carrying sentinel names are rendered and the sentinels looked for.
    A template that never mentions "tool" renders none of them (SmolLM2's writes any role
    as a turn, but was never trained on tools), so it is not probed.

ToolPrompt then fills in what the template leaves out, in the syntax of the parser that
reads the answer, so that the model sees its tools and its own past calls and results:

  - tools: a system message (appended to the conversation's first system message, else one
    put first), TOOLS_HEADER, the tools one JSON object a line inside <tools></tools>, and
    the call format (CALL_FORMATS[syntax]). The same text whatever tool_choice is, so a
    tool loop's turns share their prompt prefix (and the prefix cache).
  - an assistant's tool_calls: appended to its content as the syntax writes calls
    (format_calls), e.g. `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`.
  - tool results: a user turn holding each result as `<tool_response>\n...\n</tool_response>`
    (consecutive results in one turn, so user/assistant alternation holds).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import Any

from models.chat_template import render_chat, validate_messages

logger = logging.getLogger("jpaged.server")

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
# How each syntax asks for calls (Hermes' is the text Qwen 2.5 and Hermes were trained on).
CALL_FORMATS = {
    "hermes": (
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    ),
    "llama3_json": (
        "To call a function, respond with only a JSON object in the format "
        '{"name": <function-name>, "parameters": <args-json-object>}; separate several '
        "calls with ; and do not use variables."
    ),
    "mistral": (
        "To call functions, respond with [TOOL_CALLS] followed by a JSON array of calls: "
        '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
    ),
}
SYNTAXES = tuple(CALL_FORMATS)

_PROBE_TOOL = "jpaged_probe_tool"
_PROBE_ARG = "jpaged_probe_argument"
_PROBE_RESULT = "jpaged_probe_result"
_PROBE_ID = "a0b1c2d3e"  # 9 letters and digits: Mistral's templates refuse other ids


@dataclasses.dataclass(frozen=True)
class TemplateTools:
    """What one chat template does with tools (see the module docstring)."""

    syntax: str  # the parser its tool calls are read with: hermes, llama3_json, mistral
    renders_tools: bool
    renders_calls: bool
    renders_results: bool


@functools.lru_cache(maxsize=32)
def template_tools(template: str) -> TemplateTools:
    """The template's tool syntax and which tool parts it renders (module docstring)."""
    if "tool" not in template:
        return TemplateTools("hermes", False, False, False)
    if "[TOOL_CALLS]" in template:
        syntax = "mistral"
    elif "<tool_call>" in template:
        syntax = "hermes"
    elif "<|python_tag|>" in template or '"parameters": ' in template:
        syntax = "llama3_json"
    else:
        syntax = "hermes"
        logger.warning(
            "the chat template's tool-call syntax is none of %s: tool_choice auto reads "
            "calls as hermes (set --tool-call-parser to choose)",
            ", ".join(SYNTAXES),
        )
    tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}  # fmt: skip
    ask = [{"role": "user", "content": "hi"}]
    with_tools = _probe(template, ask, tools=[tool])
    renders_tools = with_tools is not None and _PROBE_TOOL in with_tools
    call = {"id": _PROBE_ID, "type": "function",
            "function": {"name": _PROBE_TOOL, "arguments": {"x": _PROBE_ARG}}}  # fmt: skip
    history = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": _PROBE_ID, "name": _PROBE_TOOL, "content": _PROBE_RESULT},
    ]
    text = _probe(template, history, tools=[tool]) or ""
    return TemplateTools(syntax, renders_tools, _PROBE_ARG in text, _PROBE_RESULT in text)


def _probe(template: str, messages: list[dict], **extra) -> str | None:
    try:
        # Stand-in BOS and EOS texts: templates concatenate them (Mistral's writes EOS
        # after each answer), and the probe looks only for its sentinels.
        return render_chat(template, messages, add_generation_prompt=True, bos_token="<s>",
                           eos_token="</s>", **extra)  # fmt: skip
    except ValueError:  # the template refuses this conversation: it renders none of it
        return None


@dataclasses.dataclass(frozen=True)
class ToolPrompt:
    """What a conversation gets added for its template (module docstring): tools_text is the
    system text carrying the tools (None: the template renders them, or there are none)."""

    syntax: str
    tools_text: str | None = None
    calls_in_content: bool = False
    results_as_user: bool = False

    def messages(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[int | None]]:
        """The conversation as the template is given it, and for each of its messages the
        index of the request's message it came from (None: the added tools message), so a
        template error names the client's message.

        messages are OpenAI's dicts (as ChatMessage.to_dict gives them; not changed); they
        are validated first (models/chat_template.validate_messages: a ValueError naming the
        message), so contents are strings and call arguments objects here.
        """
        checked = validate_messages(messages)
        origins: list[int | None] = list(range(len(checked)))
        if not (self.tools_text or self.calls_in_content or self.results_as_user):
            return checked, origins
        out: list[dict[str, Any]] = []
        origins = []
        in_results = False  # the last message out is a user turn of tool results
        for i, m in enumerate(checked):
            if self.calls_in_content and m["role"] == "assistant" and m.get("tool_calls"):
                calls = format_calls(self.syntax, [c["function"] for c in m["tool_calls"]])
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
            elif self.results_as_user and m["role"] == "tool":
                result = f"<tool_response>\n{m['content']}\n</tool_response>"
                if in_results:
                    out[-1]["content"] += "\n" + result
                else:
                    out.append({"role": "user", "content": result})
                    origins.append(i)
                    in_results = True
                continue
            out.append(m)
            origins.append(i)
            in_results = False
        if self.tools_text is None:
            return out, origins
        if out[0]["role"] == "system":
            first = out[0]["content"]
            text = f"{first}\n\n{self.tools_text}" if first else self.tools_text
            return [{**out[0], "content": text}, *out[1:]], origins
        return [{"role": "system", "content": self.tools_text}, *out], [None, *origins]


def tool_prompt(
    template: str | None, tools: list[dict] | None, parser_name: str | None
) -> ToolPrompt:
    """The ToolPrompt of a conversation with tools (OpenAI's tool definitions, or None) for
    a template (None: unknown, nothing is added). parser_name: --tool-call-parser."""
    if template is None:
        return ToolPrompt(parser_name or "hermes")
    found = template_tools(template)
    syntax = parser_name or found.syntax
    text = None
    if tools and not found.renders_tools:
        lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        text = f"{TOOLS_HEADER}{lines}\n</tools>\n\n{CALL_FORMATS[syntax]}"
    return ToolPrompt(syntax, text, not found.renders_calls, not found.renders_results)


def format_calls(syntax: str, calls: list[dict]) -> str:
    """Tool calls ({"name", "arguments": object}) written as a model writes them in syntax."""
    if syntax == "mistral":
        body = ", ".join(_call_json(c, "arguments") for c in calls)
        return f"[TOOL_CALLS][{body}]"
    if syntax == "llama3_json":
        return "; ".join(_call_json(c, "parameters") for c in calls)
    return "\n".join(f"<tool_call>\n{_call_json(c, 'arguments')}\n</tool_call>" for c in calls)


def _call_json(call: dict, key: str) -> str:
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return f'{{"name": {json.dumps(call["name"], ensure_ascii=False)}, "{key}": {arguments}}}'

"""OpenAI-compatible requests: pydantic models, their checks, and the SamplingParams they make.

This module owns the request side of the HTTP API (openai_api.py owns the routes and the
flow of a call, openai_responses.py the response and chunk shapes). A request is checked in
three places, and every refusal is an APIError in OpenAI's shape, `param` naming the field:

  1. pydantic: the JSON's shape and types. Unknown fields are refused (a client asking for an
     option this server lacks hears so rather than getting different output), and so are
     NaN and infinities.
  2. to_sampling_params: the values, by SamplingParams itself (the checks and messages of
     gRPC and the offline API), plus what only HTTP has: logit_bias ids against the
     vocabulary, the constraint's several spellings (response_format, vLLM's
     structured_outputs and guided_*: at most one; a bad schema, regex or grammar is refused
     here, before anything streams), the server's n limit, stream_options without stream.
     echo with logprobs asks the engine for prompt_logprobs.
  3. The prompt (server/prompt_plans.py): a chat is rendered and tokenized in a worker
     thread before the request is submitted (PromptPlan.render_now), so a conversation its template cannot render (a
     template's error, whatever it raised) is a 400 naming the message and never reaches
     the engine thread; a text prompt is tokenized on the engine thread. There
     (PromptPlan.prepare) max_tokens is fitted to max_model_len; prompt + max_tokens past
     it is a 400 context_length_exceeded stating both numbers. Unset max_tokens means "up
     to max_model_len - prompt" (as vLLM), capped by the server's or the model's default
     max_tokens where one is set. A completion with echo and max_tokens 0 scores its
     prompt: it runs with max_tokens 1 and its one token is left out of the answer
     (scores_prompt_only).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jpaged.sample.sampling_params import SamplingParams
from jpaged.structured_output import KINDS as CONSTRAINT_KINDS
from jpaged.structured_output import StructuredOutputsParams
from server import openai_fields

MAX_LOGIT_BIAS = 100.0


class APIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return "requests" if self.status == 429 else "invalid_request_error"

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# ---- request models ---------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk
    include_obfuscation: bool | None = None  # OpenAI's; accepted, nothing is obfuscated here


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema. name and description are accepted and not
    shown to the model (OpenAI shows it the description; here the schema alone governs the
    output, so a client that relies on the description should say it in the prompt);
    strict is accepted either way (the output always follows the schema here)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Strict):
    """The fields completions and chat completions share (OpenAI's, then vLLM's extras).
    Fields OpenAI defines for the endpoint that are not declared here are dropped before
    validation, with one log line per field name (server/openai_fields.py)."""

    openai_endpoint: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _drop_unused_openai_fields(cls, data: Any) -> Any:
        return openai_fields.drop_unused(data, cls.openai_endpoint, cls.model_fields)

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's constraints: structured_outputs (StructuredOutputsParams' fields) and the older
    # guided_* spellings; at most one constraint per request, response_format included.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # structured_outputs.whitespace_pattern
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM's: the token ids of each choice (and the prompt's) in the response
    return_token_ids: bool = False
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation between tenants
    # The request's session (jpaged/core/session_pages.py: its cached KV pages are evicted
    # last while the session is active): OpenAI's prompt_cache_key, else its user field.
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=256)
    user: str | None = Field(default=None, min_length=1, max_length=256)

    def session_key(self) -> str | None:
        """The engine's session key: prompt_cache_key, else user, else None."""
        return self.prompt_cache_key or self.user

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(max_tokens asked for or None, the field it came from)."""
        return self.max_tokens, "max_tokens"

    def param_names(self) -> dict[str, str]:
        """SamplingParams field -> this request's field, where they differ."""
        return {}


class CompletionRequest(_SamplingRequest):
    openai_endpoint: ClassVar[str] = "completions"
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    """One message; fields beyond these go to the chat template as they are. An assistant's
    tool_calls are OpenAI's ({"id", "type", "function": {"name", "arguments"}}; arguments
    may be the JSON text or the object, the template gets the object), a tool message's
    tool_call_id names the call it answers (server/tool_calls.py checks it is there)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True)
        if out["role"] == "developer":  # OpenAI's newer name for the system role
            out["role"] = "system"
        out.setdefault("content", None)
        return out


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # accepted: required and named choice always follow the schema


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingRequest):
    openai_endpoint: ClassVar[str] = "chat.completions"
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    # None: "auto" when tools are given and the server parses tool calls, else "none"
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's chat extras
    prompt_logprobs: int | None = None  # non-streamed only, as vLLM
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def param_names(self) -> dict[str, str]:
        return {"logprobs": "top_logprobs", "max_tokens": self.requested_max_tokens()[1]}


class TokenizeRequest(_Strict):
    """vLLM's /tokenize of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's /tokenize of a conversation, rendered as /v1/chat/completions renders it."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- values -----------------------------------------------------------------------------

_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
# Template variables render_chat sets itself; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token"}
)


def to_sampling_params(
    req: _SamplingRequest,
    *,
    defaults: dict,
    max_n: int,
    vocab_size: int,
    tool_constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's SamplingParams, max_tokens as asked (None when unset: fitted later).

    defaults: SamplingParams fields for those the request leaves unset (the serve command's
    flags over the model's own defaults). tool_constraint: the grammar of a "required" or
    named tool_choice (server/tool_calls.py), which no other constraint may join. Raises
    APIError(400) naming the field.
    """
    _check_http_only_fields(req, vocab_size)
    given = {f: getattr(req, f) for f in _SAMPLING_FIELDS if getattr(req, f) is not None}
    num_logprobs = req.num_logprobs()
    if num_logprobs is not None:
        given["logprobs"] = num_logprobs
        if isinstance(req, CompletionRequest) and req.echo:
            given["prompt_logprobs"] = num_logprobs  # the echoed prompt carries logprobs
    if isinstance(req, ChatCompletionRequest) and req.prompt_logprobs is not None:
        given["prompt_logprobs"] = req.prompt_logprobs
    if req.logit_bias:
        given["logit_bias"] = {int(k): v for k, v in req.logit_bias.items() if v}
    constraint = structured_outputs_of(req)  # checked even when the tools' grammar wins
    if tool_constraint is not None:
        # OpenAI's behaviour: a forced tool call governs its turn, and response_format the
        # turn that answers in text (an agent with an output type sends both). vLLM's
        # explicit constraints have no such turn: they and a forced call conflict.
        fmt = req.response_format
        if constraint is not None and (fmt is None or fmt.type == "text"):
            raise APIError(
                400,
                "tool_choice required or a named function decodes under the tools' schemas: "
                "it cannot be combined with structured_outputs or guided_*",
                param="tool_choice",
            )
        constraint = tool_constraint
    if constraint is not None:
        given["structured_outputs"] = constraint
    max_tokens, _ = req.requested_max_tokens()
    if scores_prompt_only(req):
        max_tokens = 1  # the engine samples at least one token; the answer leaves it out
    kwargs = {**defaults, **given, "max_tokens": max_tokens}
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        raise invalid(str(e), req.param_names()) from None
    if params.n > max_n:
        raise APIError(400, f"n must be <= {max_n} on this server, got {params.n}", param="n")
    for i, t in enumerate(params.stop_token_ids):
        if t >= vocab_size:
            raise APIError(
                400,
                f"stop_token_ids[{i}] = {t} is out of range [0, {vocab_size})",
                param="stop_token_ids",
            )
    return params


def _check_http_only_fields(req: _SamplingRequest, vocab_size: int) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options is only allowed with stream=true", param="stream_options"
        )
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise APIError(
                400,
                f"logit_bias token id {token} is out of range [0, {vocab_size})",
                param="logit_bias",
            )
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise APIError(
                400,
                f"logit_bias values must be in [-100, 100], got {bias} for token {token}",
                param="logit_bias",
            )
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(
                400, "prompt_logprobs are not sent in a stream: ask without stream=true",
                param="prompt_logprobs",
            )  # fmt: skip
        check_template_kwargs(req)


def check_template_kwargs(req: ChatCompletionRequest | TokenizeChatRequest) -> None:
    for key in req.chat_template_kwargs or {}:
        if key in _RESERVED_TEMPLATE_VARS or not key.isidentifier():
            raise APIError(
                400, f"chat_template_kwargs may not set {key!r}", param="chat_template_kwargs"
            )


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_outputs_of(req: _SamplingRequest) -> StructuredOutputsParams | None:
    """The request's one constraint, from whichever field spells it; APIError(400) for two
    spellings, an unknown key in structured_outputs, a field that would change nothing, or a
    constraint llguidance refuses (param names the request's field: guided_regex,
    structured_outputs.json, response_format.json_schema.schema,
    guided_whitespace_pattern ...). structured_outputs' options (disable_any_whitespace,
    whitespace_pattern; guided_whitespace_pattern is the second) apply whichever field holds
    the constraint, as in vLLM."""
    given: list[tuple[str, dict[str, Any]]] = []  # (request field, StructuredOutputsParams kwargs)
    fmt = req.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.type != "json_schema":
        raise APIError(
            400,
            f"response_format.json_schema is only read with type json_schema, not {fmt.type}",
            param="response_format.json_schema",
        )
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(
                400,
                "response_format.json_schema: field required for type json_schema",
                param="response_format.json_schema",
            )
        given.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
    options: dict[str, Any] = {}
    option_fields: dict[str, str] = {}  # option -> the request field that set it
    if req.structured_outputs is not None:
        kinds = dict(req.structured_outputs)
        for key in kinds:
            if key not in _CONSTRAINT_FIELDS:
                raise APIError(
                    400,
                    f"unknown field 'structured_outputs.{key}': this server does not support it",
                    param=f"structured_outputs.{key}",
                )
        for k in [k for k in kinds if k not in CONSTRAINT_KINDS]:  # options
            options[k] = kinds.pop(k)
            option_fields[k] = f"structured_outputs.{k}"
        if kinds:
            given.append(("structured_outputs", kinds))
    if req.guided_whitespace_pattern is not None:
        if "whitespace_pattern" in options:
            raise APIError(
                400,
                "set whitespace_pattern once: structured_outputs.whitespace_pattern or "
                "guided_whitespace_pattern",
                param="guided_whitespace_pattern",
            )
        options["whitespace_pattern"] = req.guided_whitespace_pattern
        option_fields["whitespace_pattern"] = "guided_whitespace_pattern"
    for name in _GUIDED:
        value = getattr(req, name)
        if value is not None:
            given.append((name, {name.removeprefix("guided_"): value}))
    if not given:
        if options:
            where = next(iter(option_fields.values())).split(".")[0]
            raise APIError(
                400,
                f"{where}: set a constraint (json, regex, choice, grammar, json_object) in "
                "structured_outputs or in response_format or guided_*",
                param=where,
            )
        return None
    if len(given) > 1:
        names = [field.split(".")[0] for field, _ in given]
        raise APIError(
            400,
            "set at most one constraint (response_format json_object or json_schema, "
            f"structured_outputs, guided_*), got {' and '.join(names)}",
            param=names[1],
        )
    field, kwargs = given[0]
    try:
        return StructuredOutputsParams(**kwargs, **options)
    except ValueError as e:
        message = str(e)
        # "structured_outputs.regex: invalid regex: ..." -> this request's field
        m = re.match(r"structured_outputs(\.\w+)?", message)
        option = m.group(1)[1:] if m and m.group(1) else None
        if option in option_fields:  # an option's problem: the field that set it
            where = option_fields[option]
            raise APIError(400, where + message[m.end() :], param=where) from None
        if field == "structured_outputs":
            param = m.group(0) if m else field
            raise APIError(400, message, param=param) from None
        rest = message[m.end() :] if m else ": " + message
        raise APIError(400, field + rest, param=field) from None


_CONSTRAINT_FIELDS = frozenset(
    f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init
)


def scores_prompt_only(req: _SamplingRequest) -> bool:
    """A completion with echo and max_tokens 0: the prompt, scored, and no new token (what
    legacy clients such as HELM send for log-likelihoods)."""
    return isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The completion request's prompts (one engine request each)."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    for i, one in enumerate(prompts):
        if not one:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise APIError(400, f"{where} must not be empty", param="prompt")
    return prompts


# ---- errors -----------------------------------------------------------------------------

# A ValueError's message starts with the field it is about: "temperature must be >= 0",
# "messages[0].role: must be one of ...", "prompt has 130 tokens ...".
_LEADING_FIELD = re.compile(r"([A-Za-z_]\w*)((?:\[\d+\]|\.[A-Za-z_]\w*)*)(?=[: ])")
_REQUEST_FIELDS = (
    set(CompletionRequest.model_fields)
    | set(ChatCompletionRequest.model_fields)
    | {"logprobs", "max_tokens"}
)


def invalid(message: str, names: dict[str, str] | None = None) -> APIError:
    """A 400 for a ValueError's message, param from the field it starts with."""
    m = _LEADING_FIELD.match(message)
    if not (m and m.group(1) in _REQUEST_FIELDS):
        return APIError(400, message)
    name = (names or {}).get(m.group(1), m.group(1))  # SamplingParams' name -> the request's
    return APIError(400, name + message[len(m.group(1)) :], param=name + m.group(2))


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def from_validation_errors(errors: list[dict]) -> APIError:
    """The first of pydantic's (or FastAPI's) errors as a 400 naming the field."""
    if not errors:
        return APIError(400, "invalid request body")
    e = errors[0]
    kind = e.get("type", "")
    if kind == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", e.get("msg", ""))
        return APIError(400, f"malformed JSON body: {detail}")
    param = _loc_param(e.get("loc", ()))
    if kind == "extra_forbidden":
        return APIError(
            400, f"unknown field {param!r}: this server does not support it", param=param
        )
    if not param:
        return APIError(400, f"request body: {_our_words(e) or e.get('msg', 'invalid')}")
    if kind == "missing":
        return APIError(400, f"{param}: field required", param=param)
    return APIError(400, f"{param}: {_our_words(e) or e.get('msg', 'invalid value')}", param=param)


# pydantic's error types in jpaged's words (what was expected, and what came).
_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _our_words(e: dict) -> str | None:
    """The error's sentence in jpaged's words, or None to keep pydantic's."""
    kind, ctx, got = e.get("type", ""), e.get("ctx") or {}, e.get("input")
    if kind in _EXPECTED:
        return f"must be {_EXPECTED[kind]}, got {_shown(got)}"
    if kind == "too_short" and "min_length" in ctx:
        n = ctx["min_length"]
        what = "message" if _loc_param(e.get("loc", ())) == "messages" else "item"
        return f"give at least {n} {what}{'s' if n != 1 else ''}, got {ctx.get('actual_length', 0)}"
    if kind == "too_long" and "max_length" in ctx:
        return f"at most {ctx['max_length']} items, got {ctx.get('actual_length')}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
              "less_than": "<"}  # fmt: skip
    if kind in bounds:
        limit = next(iter(ctx.values()), None)
        return f"must be {bounds[kind]} {limit}, got {_shown(got)}"
    return None


def _shown(value) -> str:
    text = (
        json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool)) else repr(value)
    )
    return text if len(text) <= 40 else text[:37] + "..."


def _loc_param(loc) -> str:
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out

"""The request fields OpenAI's API defines, per endpoint: the one list the HTTP API checks
request bodies against.

A request model declares the fields jpaged reads; a field in this list that the model does
not declare is one OpenAI defines and jpaged does not use (store, metadata, service_tier,
...): it is dropped before validation and logged once per process per field name
(drop_unused), so clients that send them work. A field in neither is still refused with a
400 naming it (the models forbid extra fields), so a typo or an option this server lacks is
heard rather than silently changing nothing. The lists follow the openai Python client's
request types (openai/types/.../*_create_params.py); tests/server/test_openai_fields.py
holds them to the installed client's.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from typing import Any

logger = logging.getLogger("jpaged.server")

CHAT_COMPLETIONS = frozenset(
    {
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
        "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
        "modalities", "moderation", "n", "parallel_tool_calls", "prediction",
        "presence_penalty", "prompt_cache_key", "prompt_cache_options",
        "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier",
        "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
        "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
        "web_search_options",
    }
)  # fmt: skip
COMPLETIONS = frozenset(
    {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
        "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
        "suffix", "temperature", "top_p", "user",
    }
)  # fmt: skip
EMBEDDINGS = frozenset({"input", "model", "dimensions", "encoding_format", "user"})
RESPONSES = frozenset(
    {
        "access_programs", "background", "background_options", "context_management",
        "conversation", "image", "include", "input", "instructions", "max_output_tokens",
        "max_tool_calls", "metadata", "model", "moderation", "parallel_tool_calls",
        "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_options",
        "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store",
        "stream", "stream_options", "temperature", "text", "tool_choice", "tools",
        "top_logprobs", "top_p", "truncation", "user",
    }
)  # fmt: skip
# endpoint -> the fields OpenAI defines for its request body
FIELDS: dict[str, frozenset[str]] = {
    "chat.completions": CHAT_COMPLETIONS,
    "completions": COMPLETIONS,
    "embeddings": EMBEDDINGS,
    "responses": RESPONSES,
}

_warned: set[str] = set()  # field names already logged (once per process per name)


def drop_unused(data: Any, endpoint: str, declared: Container[str]) -> Any:
    """data (a request body) without the fields OpenAI defines for endpoint that the model
    does not declare, each logged once per process; anything else is returned as it is.

    Meant for a pydantic model's `model_validator(mode="before")`.
    """
    if not isinstance(data, dict):
        return data
    defined = FIELDS[endpoint]
    unused = [k for k in data if k in defined and k not in declared]
    if not unused:
        return data
    for name in unused:
        if name not in _warned:
            _warned.add(name)
            logger.warning(
                "ignoring request field %r (an OpenAI %s field this server does not use); "
                "logged once",
                name,
                endpoint,
            )
    return {k: v for k, v in data.items() if k not in unused}

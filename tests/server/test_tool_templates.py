"""A multi-turn tool exchange (user -> tool calls -> tool results -> answer) sent to
/v1/chat/completions renders exactly as transformers' apply_chat_template(..., tools=...)
renders it, for the hermes (Qwen 2.5), Llama 3.1 and Mistral templates.

The request goes the server's way (the pydantic request, its tools plan, the messages'
to_dict, render_chat) with arguments as OpenAI sends them, JSON text; transformers gets the
objects, which is what these templates write with tojson.
"""

from __future__ import annotations

import json

import pytest
import tokenizers
import transformers
from tool_templates import LLAMA31_TEMPLATE, MISTRAL_TEMPLATE, QWEN25_TEMPLATE

from models.chat_template import render_chat
from server.openai_protocol import ChatCompletionRequest
from server.tool_calls import plan_tools

BOS, EOS = "<s>", "</s>"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
     "description": "The weather in a city, \"now\" & <later>", "parameters": {
         "type": "object", "properties": {"city": {"type": "string"},
                                          "unit": {"type": "string", "enum": ["c", "f"]}},
         "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time",
     "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]  # fmt: skip


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip


def exchange(ids: list[str], parallel: bool) -> list[dict]:
    calls = [call(ids[0], "get_weather", {"city": "Paris", "unit": "c"})]
    results = [{"role": "tool", "tool_call_id": ids[0], "content": '{"temp": 21}'}]
    if parallel:
        calls.append(call(ids[1], "get_time", {"zone": "CET"}))
        results.append({"role": "tool", "tool_call_id": ids[1], "content": "14:05"})
    return [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *results,
        {"role": "assistant", "content": "21 degrees."},
        {"role": "user", "content": "Thanks. And Oslo?"},
    ]


def with_objects(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [
                {**c, "function": {**c["function"],
                                   "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]  # fmt: skip
        out.append(m)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer():
    vocab = {"<unk>": 0, BOS: 1, EOS: 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS
    )


def served(template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    """The prompt /v1/chat/completions renders for this body."""
    body = {"messages": messages, "tools": TOOLS, "chat_template": template,
            "add_generation_prompt": add_generation_prompt}  # fmt: skip
    req = ChatCompletionRequest.model_validate(body)
    plan = plan_tools(req, parser_name="hermes", auto_enabled=True)
    return render_chat(
        template,
        [m.to_dict() for m in req.messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=BOS,
        eos_token=EOS,
        tools=plan.tools,
    )


CASES = [
    ("hermes", QWEN25_TEMPLATE, ["call_a1", "call_b2"], True),
    ("llama3", LLAMA31_TEMPLATE, ["call_a1"], False),  # one call per turn in Llama 3.1
    ("mistral", MISTRAL_TEMPLATE, ["a1b2c3d4e", "f5g6h7i8j"], True),  # 9-character ids
]


@pytest.mark.parametrize(("name", "template", "ids", "parallel"), CASES, ids=[c[0] for c in CASES])
def test_a_tool_exchange_renders_as_transformers(hf_tokenizer, name, template, ids, parallel):
    messages = exchange(ids, parallel)
    if name == "llama3":  # its template takes the system turn apart from the tools
        messages = messages[1:]
    for upto, generation in [(len(messages) - 3, True), (len(messages) - 1, False),
                             (len(messages), True)]:  # fmt: skip
        history = messages[:upto]
        want = hf_tokenizer.apply_chat_template(
            with_objects(history), tools=TOOLS, chat_template=template, tokenize=False,
            add_generation_prompt=generation,
        )  # fmt: skip
        assert served(template, history, generation) == want, (name, upto)


def test_what_the_templates_wrote():
    """The parts a model reads, spelled out (independent of transformers)."""
    qwen = served(QWEN25_TEMPLATE, exchange(["call_a1", "call_b2"], True)[:5], True)
    assert qwen.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
        '"arguments": {"zone": "CET"}}\n</tool_call><|im_end|>\n<|im_start|>user\n'
        '<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n14:05\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert "\n" + json.dumps(TOOLS[0]) + "\n" in qwen  # tojson, not HTML-escaped
    llama = served(LLAMA31_TEMPLATE, exchange(["call_a1"], False)[1:4], True)
    assert llama.endswith(
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": {"city": "Paris", "unit": "c"}}<|eot_id|><|start_header_id|>ipython'
        '<|end_header_id|>\n\n"{\\"temp\\": 21}"<|eot_id|><|start_header_id|>assistant'
        "<|end_header_id|>\n\n"
    )
    mistral = served(MISTRAL_TEMPLATE, exchange(["a1b2c3d4e"], False)[:4], False)
    assert mistral.endswith(
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, '
        '"id": "a1b2c3d4e"}]</s>[TOOL_RESULTS] {"content": {"temp": 21}, "call_id": '
        '"a1b2c3d4e"}[/TOOL_RESULTS]'
    )

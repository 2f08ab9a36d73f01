"""--reasoning-parser qwen3 on a real engine: a tiny Qwen3 checkpoint (transformers' layout,
tests/checkpoints.py) whose template's generation prompt opens `<think>`, as Qwen3-Thinking's
does, decoding under a JSON schema or a forced tool call: the model reasons freely, the
constraint holds only after `</think>`.

The checkpoint is random except where the test forces its tokens: its attention and MLP
outputs are zeroed, so the logits depend on the last token alone, and its embeddings and LM
head make greedy decoding walk the cycle

    "\\n" -> "S" -> "ure" -> "." -> "<" -> "/" -> "th" -> "in" -> "k" -> ">" -> "\\n" -> ...

i.e. write "Sure.</think>\\n" after the prompt's last "\\n", then "Sure." again. Every other
token's logit is exactly 0, so where a grammar masks the cycle's next token, the allowed
token of lowest id wins: the JSON below is what the grammar alone chose. The demo tokenizer
spells each tag with several tokens ("<", "/", "th", "in", "k", ">"), so the grammar sees
tags that span tokens.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from checkpoints import make_tiny_checkpoint
from serving_helpers import RunningServer, sse_events

from jpaged import LLM

# The demo tokenizer's ids of "\n", "S", "ure", ".", "<", "/", "th", "in", "k", ">"
CYCLE = [200, 52, 390, 15, 29, 16, 366, 261, 76, 31]
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: <think>\n{% endif %}"
)
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["answer"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "hi"}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


def force_the_cycle(path) -> None:
    """Rewrites the checkpoint so that greedy decoding walks CYCLE (module docstring)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = np.zeros_like(w)  # the residual stream is the embedding alone
    weights["model.norm.weight"] = np.ones_like(weights["model.norm.weight"])
    embed = weights["model.embed_tokens.weight"]
    head = np.zeros_like(weights["lm_head.weight"])
    for i, token in enumerate(CYCLE):
        embed[token] = np.eye(embed.shape[1], dtype=embed.dtype)[i]  # direction i
        head[CYCLE[(i + 1) % len(CYCLE)], i] = 10.0  # direction i -> the next token
    weights["lm_head.weight"] = head
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    force_the_cycle(path)
    llm = LLM(
        str(path),
        max_num_seqs=2,
        max_model_len=512,  # the tools ride in a system message (the template renders none)
        max_num_batched_tokens=64,
        min_token_bucket=64,
        page_size=16,
        num_pages=64,
    )
    s = RunningServer(llm.llm_engine, reasoning_parser="qwen3", chat_template=TEMPLATE)
    yield s
    s.close()


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.http_url + path, json={"temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat(server, **body) -> dict:
    (choice,) = post(server, "/v1/chat/completions", {"messages": ASK, **body})["choices"]
    return choice


def test_without_a_constraint_the_model_says_sure_after_the_tag(server):
    # 13 tokens: "Sure.</think>" (9), "\n", "Sure." (3)
    choice = chat(server, max_tokens=13)
    assert choice["message"]["reasoning"] == "Sure."
    assert choice["message"]["content"] == "Sure."
    assert choice["finish_reason"] == "length"


def test_the_json_schema_holds_after_the_reasoning(server):
    choice = chat(server, max_tokens=40, response_format=FORMAT)
    assert choice["message"]["reasoning"] == choice["message"]["reasoning_content"] == "Sure."
    # "Sure." again is masked after the tag: the grammar's JSON, closed, stopped
    assert choice["message"]["content"] == '{"answer": 1}'
    assert choice["finish_reason"] == "stop"
    # the same prompt and schema on /v1/completions (no reasoning parser there): the schema
    # holds from the first token and the model never writes its reasoning
    (completion,) = post(
        server,
        "/v1/completions",
        {"prompt": "user: hi\nassistant: <think>\n", "max_tokens": 40, "response_format": FORMAT},
    )["choices"]
    assert completion["text"] == '{"answer": 1}'
    # streamed: the reasoning as reasoning deltas, then the JSON as content
    body = {"temperature": 0, "messages": ASK, "max_tokens": 40, "response_format": FORMAT,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "Sure."
    assert "".join(d.get("content") or "" for d in deltas) == '{"answer": 1}'
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_a_forced_tool_call_after_the_reasoning(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(server, max_tokens=40, tools=TOOLS, tool_choice=named)
    message = choice["message"]
    assert message["reasoning"] == "Sure." and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # "required" with one call at most: after it the array must close
    choice = chat(
        server, max_tokens=60, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["reasoning"] == "Sure." and choice["finish_reason"] == "tool_calls"

"""The real SmolLM2-135M-Instruct at temperature 1 (the engine's default with
generation_config="vllm", which drops the built-in model's greedy default) fills bounded JSON schemas that all close and validate, 16 of 16, through
LLM.chat and over HTTP (response_format json_schema), with the default whitespace.

One engine for the module: the offline requests run first, then its engine is served
in-process and the HTTP requests are sent together, so they are batched as well.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from serving_helpers import RunningServer

from jpaged import LLM
from jpaged.structured_output import StructuredOutputsParams
from models.demo import SMOLLM2_DIR, cache_root, ensure_smollm2

# The real model's accuracy and end-to-end behaviour: CI proves it under Python 3.11; its
# programs and code paths run under 3.12 in the tiny-model tests (pyproject's `once`).
pytestmark = pytest.mark.once

# The user's jpaged cache, read at collection: the demo_model_dir fixture later points
# JPAGED_CACHE_DIR at a temporary directory for the session.
_SMOLLM2_DIR = cache_root() / SMOLLM2_DIR

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
# Twice PERSON's longest compact form (140 characters).
MAX_TOKENS = 280
PEOPLE = [
    "Maria is 34, lives in Lisbon and likes hiking and chess.",
    "Tom is 27, lives in Boston and likes the guitar.",
    "Aiko is 45, lives in Osaka and likes painting and tea.",
    "Pierre is 61, lives in Lyon and likes cooking and cycling.",
    "Fatima is 19, lives in Cairo and likes football.",
    "Lars is 52, lives in Oslo and likes skiing and fishing.",
    "Priya is 38, lives in Mumbai and likes dance and yoga.",
    "Carlos is 23, lives in Madrid and likes tennis.",
    "Anna is 70, lives in Vienna and likes opera and gardening.",
    "Kwame is 31, lives in Accra and likes running and poetry.",
    "Mei is 29, lives in Shanghai and likes photography.",
    "John is 44, lives in Denver and likes climbing and baking.",
    "Olga is 56, lives in Kyiv and likes knitting and reading.",
    "Diego is 12, lives in Lima and likes drawing.",
    "Sara is 40, lives in Rome and likes swimming and films.",
    "Ahmed is 65, lives in Dubai and likes golf and history.",
]


def conversation(sentence: str) -> list[dict]:
    return [
        {"role": "user", "content": f"{sentence}\nGive this person's name, age, city and "
         "hobbies as a JSON object."},
    ]  # fmt: skip


def test_longest_compact_form():
    longest = {
        "name": "n" * 20,
        "age": 120,
        "city": "c" * 20,
        "hobbies": ["h" * 16] * 3,
    }
    jsonschema.validate(longest, PERSON)
    assert 2 * len(json.dumps(longest, separators=(",", ":"))) == MAX_TOKENS


@pytest.fixture(scope="module")
def llm():
    return LLM(
        str(ensure_smollm2(_SMOLLM2_DIR)), max_num_seqs=16, max_model_len=512,
        generation_config="vllm",
    )


def check(text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


def test_16_of_16_offline(llm):
    base = llm.get_default_sampling_params()
    assert base.temperature == 1.0  # no model defaults (generation_config="vllm")
    constraint = StructuredOutputsParams(json=PERSON)
    params = [
        base.clone(seed=i, max_tokens=MAX_TOKENS, structured_outputs=constraint) for i in range(16)
    ]
    outs = llm.chat([conversation(p) for p in PEOPLE], params)
    for out in outs:
        check(out.outputs[0].text, out.outputs[0].finish_reason)
    assert len({o.outputs[0].text for o in outs}) == 16


def test_16_of_16_over_http(llm):
    server = RunningServer(llm.llm_engine, model_name="smollm2")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}  # fmt: skip

    def ask(i: int) -> dict:
        body = {"model": "smollm2", "messages": conversation(PEOPLE[i]), "seed": i,
                "max_tokens": MAX_TOKENS, "response_format": fmt}  # fmt: skip
        r = httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    try:
        with ThreadPoolExecutor(16) as pool:
            choices = list(pool.map(ask, range(16)))
    finally:
        server.close()
    for choice in choices:
        check(choice["message"]["content"], choice["finish_reason"])

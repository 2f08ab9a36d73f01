"""The built-in SmolLM2's shipped sampling defaults (models/demo.py
SMOLLM2_GENERATION_DEFAULTS, greedy): a chat that leaves temperature unset answers the
capital question with Paris, offline and over HTTP, whatever the seed; request values win;
other models' files get none of them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving_helpers import RunningServer

from jpaged import LLM
from models.demo import (
    SMOLLM2_DIR,
    SMOLLM2_GENERATION_DEFAULTS,
    builtin_generation_defaults,
    cache_root,
    ensure_smollm2,
)

# The user's jpaged cache, read at collection (the demo_model_dir fixture later points
# JPAGED_CACHE_DIR at a temporary directory for the session).
_SMOLLM2_DIR = cache_root() / SMOLLM2_DIR
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(ensure_smollm2(_SMOLLM2_DIR)), max_num_seqs=5, max_model_len=256)


def test_the_builtin_files_defaults_and_no_others(tmp_path):
    builtin = ensure_smollm2(_SMOLLM2_DIR)
    assert builtin_generation_defaults(builtin) == SMOLLM2_GENERATION_DEFAULTS
    assert builtin_generation_defaults(tmp_path / builtin.name) == {}  # another directory
    assert builtin_generation_defaults(builtin.parent / "other.gguf") == {}


def test_an_unset_temperature_answers_paris_for_every_seed_offline(llm):
    assert llm.llm_engine.sampling_defaults == SMOLLM2_GENERATION_DEFAULTS
    base = llm.get_default_sampling_params()
    assert base.temperature == 0.0
    params = [base.clone(seed=seed, max_tokens=16) for seed in range(5)]
    outs = llm.chat([QUESTION] * 5, params)
    assert ["Paris" in o.outputs[0].text for o in outs] == [True] * 5
    # A request's own temperature wins: sampled rows differ from the greedy ones somewhere.
    sampled = llm.chat([QUESTION] * 5, [base.clone(seed=s, max_tokens=16, temperature=1.0)
                                       for s in range(5)])  # fmt: skip
    assert {o.outputs[0].text for o in sampled} != {outs[0].outputs[0].text}


def test_an_unset_temperature_answers_paris_for_every_seed_over_http(llm):
    server = RunningServer(llm.llm_engine, model_name="smollm2")

    def ask(seed: int) -> str:
        body = {"model": "smollm2", "messages": QUESTION, "seed": seed, "max_tokens": 16}
        r = httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    try:
        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(ask, range(5)))
    finally:
        server.close()
    assert ["Paris" in a for a in answers] == [True] * 5, answers


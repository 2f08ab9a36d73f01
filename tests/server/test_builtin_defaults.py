"""The built-in SmolLM2's shipped sampling defaults (models/demo.py
SMOLLM2_GENERATION_DEFAULTS, greedy): a chat that leaves temperature unset answers the
capital question with Paris, offline, through `jpaged chat` and over HTTP, whatever the
seed; request values win; generation_config="vllm" drops them (temperature 1.0); other
models' files get none of them. One loaded model and one engine serve every test."""

from __future__ import annotations

import dataclasses
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving_helpers import RunningServer

from jpaged.config import EngineConfig
from jpaged.core.engine import LLMEngine
from jpaged.entrypoints import cli
from jpaged.entrypoints.engine_args import engine_config_from_args
from jpaged.sample.sampling_params import SamplingParams
from jpaged.worker.model_loading import load_for_config
from models.demo import (
    SMOLLM2_DIR,
    SMOLLM2_GENERATION_DEFAULTS,
    builtin_generation_defaults,
    cache_root,
    ensure_smollm2,
)

# The real model's accuracy and end-to-end behaviour: CI proves it under Python 3.11; its
# programs and code paths run under 3.12 in the tiny-model tests (pyproject's `once`).
pytestmark = pytest.mark.once

# The user's jpaged cache, read at collection (the demo_model_dir fixture later points
# JPAGED_CACHE_DIR at a temporary directory for the session).
_SMOLLM2_DIR = cache_root() / SMOLLM2_DIR
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SEEDS = range(5)


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    # test_tool_calling's slots and context (tests/server/conftest.py smollm2_server): every
    # step program this engine runs is then the same program, which the suite's compilation
    # cache holds (five seeds run as four and one).
    return engine_config_from_args(
        str(ensure_smollm2(_SMOLLM2_DIR)), max_num_seqs=4, max_model_len=512
    )


@pytest.fixture(scope="module")
def loaded(config):
    return load_for_config(config)


@pytest.fixture(scope="module")
def engine(config, loaded):
    return LLMEngine(config, loaded=loaded)


def _answers(engine: LLMEngine, params: list[SamplingParams]) -> list[str]:
    _, ids = engine.chat_prompt(QUESTION)
    for i, p in enumerate(params):
        engine.add_request(f"q-{i}", ids, p)
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    return [texts[f"q-{i}"] for i in range(len(params))]


def test_the_builtin_files_defaults_and_no_others(tmp_path):
    builtin = ensure_smollm2(_SMOLLM2_DIR)
    assert builtin_generation_defaults(builtin) == SMOLLM2_GENERATION_DEFAULTS
    assert builtin_generation_defaults(tmp_path / builtin.name) == {}  # another directory
    assert builtin_generation_defaults(builtin.parent / "other.gguf") == {}


def test_request_values_win_and_vllm_drops_the_defaults(config, loaded, engine):
    assert engine.sampling_defaults == SMOLLM2_GENERATION_DEFAULTS == {"temperature": 0.0}
    assert SamplingParams(**engine.sampling_defaults).temperature == 0.0
    # What a request sets wins over the shipped default (the CLI's merge; HTTP's is the same
    # dict order in server/app.py).
    args = cli.build_parser().parse_args(["generate", "x", "--temperature", "0.7"])
    assert cli.sampling_params_from_args(args, engine.sampling_defaults).temperature == 0.7
    args = cli.build_parser().parse_args(["generate", "x"])
    assert cli.sampling_params_from_args(args, engine.sampling_defaults).temperature == 0.0
    vllm = LLMEngine(dataclasses.replace(config, generation_config="vllm"), loaded=loaded)
    assert vllm.sampling_defaults == {}
    assert SamplingParams(**vllm.sampling_defaults).temperature == 1.0


def test_an_unset_temperature_answers_paris_for_every_seed_offline(engine):
    base = SamplingParams(**engine.sampling_defaults)
    answers = _answers(engine, [base.clone(seed=s, max_tokens=16) for s in SEEDS])
    assert ["Paris" in a for a in answers] == [True] * 5, answers
    # A request's own temperature wins: sampled rows differ from the greedy ones somewhere.
    sampled = _answers(engine, [base.clone(seed=s, max_tokens=16, temperature=1.0) for s in SEEDS])
    assert set(sampled) != {answers[0]}, sampled


def test_jpaged_chat_answers_paris_for_every_seed(engine, monkeypatch, capsys):
    """`jpaged chat` as the README shows it (no --temperature), one seed per run, on the
    shared engine (make_engine_from_args returns it)."""
    monkeypatch.setattr(cli, "make_engine_from_args", lambda args, num_seqs=None: engine)
    answers = []
    for seed in SEEDS:
        monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n/exit\n"))
        assert cli.main(["chat", "--seed", str(seed), "--max-tokens", "16"]) == 0
        answers.append(capsys.readouterr().out)
    assert ["Paris" in a for a in answers] == [True] * 5, answers


def test_an_unset_temperature_answers_paris_for_every_seed_over_http(engine):
    server = RunningServer(engine, model_name="smollm2")

    def ask(seed: int) -> str:
        body = {"model": "smollm2", "messages": QUESTION, "seed": seed, "max_tokens": 16}
        r = httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    try:
        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(ask, SEEDS))
    finally:
        server.close()
    assert ["Paris" in a for a in answers] == [True] * 5, answers

"""Fixtures for the server tests (see serving_helpers for the server they run)."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fake_engine import FakeEngine
from serving_helpers import RunningServer

from models.demo import SMOLLM2_DIR, cache_root, ensure_smollm2

# The user's jpaged cache, read at collection (demo_model_dir later moves JPAGED_CACHE_DIR).
_SMOLLM2_DIR = cache_root() / SMOLLM2_DIR


@pytest.fixture
def make_server():
    servers = []

    def make(engine=None, **options) -> RunningServer:
        s = RunningServer(engine if engine is not None else FakeEngine(), **options)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def server(make_server) -> RunningServer:
    return make_server()


@pytest.fixture(scope="session")
def smollm2_server():
    """(LLM, RunningServer) of the real SmolLM2-135M-Instruct, built once per worker process
    for the modules tests/conftest.py's SAME_WORKER_MODULES sends to one worker (tool calling
    and the agent clients): four sequence slots, 512 tokens of context, the model's own
    sampling defaults, no tool flags (tool_choice "auto" needs none). Tests send their own
    seeds and leave no request running, so each sees the server as a fresh one would."""
    from jpaged import LLM

    llm = LLM(str(ensure_smollm2(_SMOLLM2_DIR)), max_num_seqs=4, max_model_len=512)
    # Compiled here, outside RunningServer's 60 s start-up limit; the server's own warm-up
    # then finds every program compiled.
    llm.llm_engine.warm_up(64, up_to=512)
    server = RunningServer(llm.llm_engine, model_name="smollm2")
    yield llm, server
    server.close()

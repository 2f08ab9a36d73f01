"""Every engine front implements EngineClient with the same method signatures."""

import inspect

import pytest
from fake_engine import FakeEngine

from jpaged.core.engine import LLMEngine
from jpaged.core.parallel import DataParallelEngine
from jpaged.interface import EngineClient

METHODS = [
    name
    for name, value in vars(EngineClient).items()
    if callable(value) and not name.startswith("_")
]


def test_the_interface_lists_the_engine_calls():
    assert sorted(METHODS) == [
        "abort_request",
        "add_request",
        "chat_prompt",
        "has_unfinished_requests",
        "num_running",
        "num_unfinished_requests",
        "num_waiting",
        "stats",
        "step",
        "tokenize_prompt",
    ]


@pytest.mark.parametrize("cls", [LLMEngine, DataParallelEngine, FakeEngine])
@pytest.mark.parametrize("name", METHODS)
def test_engines_implement_each_call_with_its_signature(cls, name):
    want = list(inspect.signature(getattr(EngineClient, name)).parameters)
    got = list(inspect.signature(getattr(cls, name)).parameters)
    assert got[: len(want)] == want, (cls.__name__, name)


def test_a_fake_engine_is_an_engine_client():
    assert isinstance(FakeEngine(), EngineClient)

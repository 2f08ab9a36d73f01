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

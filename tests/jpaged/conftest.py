"""One engine on the demo model, shared by the engine-level tests (compiles are the cost).

The tests mirror jpaged/'s subpackages (core/, worker/, ...); helpers shared between them
(engine_probes.py, test_memory.make_engine) are imported by module name from these folders.
"""

import sys
from pathlib import Path

import pytest

from jpaged import LLM

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE / "core"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


@pytest.fixture(scope="session")
def demo_llm(demo_model_dir):
    return LLM(
        str(demo_model_dir),
        max_num_seqs=8,
        max_model_len=128,
        max_num_batched_tokens=32,
        page_size=16,
        num_pages=64,
    )

"""One engine on the demo model, shared by the engine-level tests (compiles are the cost)."""

import pytest

from jpaged import LLM


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

"""The compiled step program updates the page pool in place: the pool's buffers are donated
and aliased to the outputs, and no copy of the pool is made, with the layers scanned (the
pool is the scan's carry) or unrolled."""

from __future__ import annotations

import re

import pytest

from jpaged import LLM, SamplingParams

KW = {
    "max_num_seqs": 2,
    "max_model_len": 32,
    "max_num_batched_tokens": 32,
    "page_size": 8,
    "num_pages": 9,
    "compilation_cache_dir": None,
}


@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_step_copies_no_page_pool(demo_model_dir, scan_layers):
    llm = LLM(str(demo_model_dir), scan_layers=scan_layers, **KW)
    llm.generate([[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    runner = llm.llm_engine.runner
    pool = "f32[" + ",".join(map(str, runner.state.k_pages.shape)) + "]"
    keys = runner.programs.step_keys()
    assert keys
    for key in keys:
        text = runner.programs.executable(key).as_text()
        assert pool in text
        copies = re.findall(re.escape(pool) + r"(?:\{[^}]*\})? copy\(", text)
        assert copies == [], key
        aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", text).group(1)
        # k_pages, v_pages and the page table: the state's three leaves, donated
        assert aliases.count("may-alias") == 3, aliases

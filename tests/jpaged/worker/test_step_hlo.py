"""The compiled step program updates the page pool in place: the pool's buffers are donated
and aliased to the outputs, and no copy of the pool is made, with the layers scanned (the
pool is the scan's carry) or unrolled."""

from __future__ import annotations

import math
import re

import jax
import pytest

from jpaged import LLM, SamplingParams
from jpaged.worker import programs

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


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2", "bfloat16", "int8"])
def test_cpu_steps_never_convert_the_whole_pool(demo_model_dir, kv_cache_dtype):
    """XLA:CPU gathers and scatters float8 and bfloat16 through float16 copies of the whole
    operand; the CPU step moves such pages as integers of the same width (kv_quant.PoolBits),
    so no instruction converts the pool (or its scales) to a float dtype, and the step's
    tokens are the unconverted pool's."""
    llm = LLM(str(demo_model_dir), kv_cache_dtype=kv_cache_dtype, **KW)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([[3, 4, 5, 6], [7, 8, 9]], params)
    runner = llm.llm_engine.runner
    sizes = {leaf.size for leaf in jax.tree.leaves(runner.state.k_pages)}  # data (and scales)
    assert len(sizes) == (1 if kv_cache_dtype == "bfloat16" else 2)
    for key in runner.programs.step_keys():
        text = runner.programs.executable(key).as_text()
        # Every element-type conversion (bitcast-convert is not one) and its element count.
        converts = re.findall(r"= \w+\[([\d,]*)\]\S* convert\(", text)
        assert converts, key  # the pattern finds the step's other conversions
        whole_pool = [d for d in converts if d and math.prod(map(int, d.split(","))) in sizes]
        assert whole_pool == [], key
        aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", text).group(1)
        assert aliases.count("may-alias") == len(jax.tree.leaves(runner.state)), aliases
    # The same tokens as steps that gather the float pages as they are.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(programs, "_gathers_on_cpu", lambda backend: False)
        plain = LLM(str(demo_model_dir), kv_cache_dtype=kv_cache_dtype, **KW)
        want = plain.generate([[3, 4, 5, 6], [7, 8, 9]], params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in want]

"""engine.warm_up(context_len) compiles the step programs a short request meets first.

After it, one request of up to context_len tokens (prompt and output) compiles no new step
program, with and without n-gram speculation; the warm-up keys are bucket keys, each once.
Each program runs WARM_UP_RUNS times on rows that write only the null page's first slot.
"""

import numpy as np
import pytest

from jpaged import LLM, SamplingParams
from jpaged.worker.step_inputs import WARM_UP_RUNS, bucket_keys

SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
        "prompt_lookup_min": 1}


@pytest.mark.parametrize("speculative", [None, SPEC], ids=["plain", "ngram"])
def test_a_short_request_after_warm_up_compiles_no_step_program(demo_model_dir, speculative):
    llm = LLM(str(demo_model_dir), max_num_seqs=8, max_model_len=256,
              max_num_batched_tokens=256, page_size=16, num_pages=64,
              speculative_config=speculative)
    engine = llm.llm_engine
    keys = engine.runner.warm_up_keys(64)
    assert len(set(keys)) == len(keys)
    assert set(keys) <= set(bucket_keys(engine.config))
    assert len(keys) < len(bucket_keys(engine.config))
    programs = engine.runner.programs
    assert programs.num_step_programs == 0
    engine.warm_up(64)
    assert set(programs.step_keys()) == set(keys)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4] * 5  # 40 tokens, repetitive (speculation proposes)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = llm.generate([prompt], params)
    assert len(out[0].outputs[0].token_ids) == 24
    assert set(programs.step_keys()) == set(keys)
    if speculative is not None:
        assert llm.stats()["spec_num_draft_tokens"] > 0


def test_precompile_up_to_max_len_compiles_those_buckets_and_nothing_later(demo_model_dir):
    # An accelerator's step shapes (page-column buckets from 4, decode programs), on CPU.
    llm = LLM(str(demo_model_dir), max_num_seqs=8, max_model_len=256,
              max_num_batched_tokens=64, page_size=16, num_pages=64,
              precompile=True, precompile_max_len=64, min_page_bucket=4, decode_programs=True)
    engine = llm.llm_engine
    programs = engine.runner.programs
    keys = bucket_keys(engine.config, 64)
    assert {k.num_page_cols for k in keys} == {4}  # 64 tokens: 4 pages
    assert set(programs.step_keys()) == set(keys)
    prompts = [[3 + i] * (5 + 7 * i) for i in range(8)]  # 5..54 tokens, up to 64 in all
    params = [SamplingParams(temperature=0.0, max_tokens=64 - len(p), ignore_eos=True)
              for p in prompts]
    out = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in out] == [64 - len(p) for p in prompts]
    assert set(programs.step_keys()) == set(keys)
    assert llm.stats()["num_recompiles"] == 0


def test_warm_up_runs_each_program_on_rows_that_change_nothing_a_request_reads(
    demo_model_dir, monkeypatch
):
    kw = {"max_num_seqs": 4, "max_model_len": 64, "max_num_batched_tokens": 64,
          "page_size": 16, "num_pages": 32}
    prompts = [[3, 4, 5, 6, 7], [8] * 20, [9, 10] * 6]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cold = LLM(str(demo_model_dir), **kw)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params)]
    llm = LLM(str(demo_model_dir), **kw)
    runner = llm.llm_engine.runner
    ran = []
    run_step = runner.run_step
    monkeypatch.setattr(runner, "run_step", lambda key, x: ran.append(key) or run_step(key, x))
    llm.llm_engine.warm_up(64)
    keys = runner.warm_up_keys(64)
    assert ran == [key for key in keys for _ in range(WARM_UP_RUNS)]
    # The runs wrote each layer's null page's first slot and nothing else; their samples
    # are gone.
    num_layers = llm.llm_engine.model_config.num_layers
    for pages in runner.state.kv_pages:  # [H, layers * pages, page_size, D], layer-major
        by_layer = np.asarray(pages).reshape(pages.shape[0], num_layers, -1, *pages.shape[2:])
        assert np.abs(by_layer[:, :, 1:]).max() == 0 == np.abs(by_layer[:, :, 0, 1:]).max()
        assert (np.abs(by_layer[:, :, 0, 0]).max(axis=(0, 2)) > 0).all()  # every layer
    assert np.asarray(runner.state.page_table).max() == 0
    assert np.asarray(runner.last_tokens).max() == 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    ran.clear()
    llm.llm_engine.warm_up(64)  # compiled and run already: nothing runs again
    assert ran == []

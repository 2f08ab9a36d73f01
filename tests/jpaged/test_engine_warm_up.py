"""engine.warm_up(context_len) compiles the step programs a short request meets first.

After it, one request of up to context_len tokens (prompt and output) compiles no new step
program, with and without n-gram speculation; the warm-up keys are bucket keys, each once.
"""

import pytest

from jpaged import LLM, SamplingParams
from jpaged.step_inputs import bucket_keys

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

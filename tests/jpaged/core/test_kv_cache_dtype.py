"""--kv-cache-dtype through the engine (the demo model: 4 layers, 2 KV heads, head_dim 64).

The budget: a fixed KV memory holds exactly the pages kv_quant.bytes_per_page says, and an
int8/fp8 engine admits at least 1.9x the concurrent sequences of a bfloat16/float32 one.
Then the features that move pages, on an int8 (and fp8) cache: prefix caching, forks
(copy-on-write of a partial page), beam search, swap preemption and n-gram speculation
each give the tokens of the same quantized engine without them.
"""

import dataclasses

import numpy as np
import pytest
from test_memory import greedy, make_engine, random_ids, run, tokens
from test_swap import batch  # 16 random greedy requests

from jpaged import LLM, BeamSearchParams, SamplingParams
from jpaged.config import CacheConfig
from jpaged.core.engine import LLMEngine
from jpaged.core.memory_plan import resolve_num_pages
from jpaged.entrypoints.engine_args import engine_config_from_args
from models.config import ModelConfig
from pallas_kernels import kv_quant

PAGE = 4
MEMORY = 64 * 16384  # 64 float32 pages of the demo model (2 x 4 x 2 x 4 x 64 x 4 bytes)
# dtype -> (pages in MEMORY, null page included; 16-token sequences running at once)
ADMITTED = {
    "float32": (65, 16),
    "bfloat16": (129, 32),
    "int8": (249, 62),  # 1048576 // (2 x 4 x 2 x 4 x (64 + 2)) = 248, + the null page
    "fp8": (249, 62),
}


def test_the_config_refuses_an_unknown_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .* got 'int4'"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(TypeError, match="kv_cache_dtyp"):
        LLM(None, kv_cache_dtyp="int8")


def test_pages_from_memory_count_the_smaller_pages():
    smol = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                       head_dim=64)  # SmolLM2-135M's attention
    f32_page = 2 * 30 * 3 * 16 * 64 * 4  # 737,280 bytes
    config = engine_config_from_args(None)
    pages = {}
    for name in ("float32", "bfloat16", "int8", "fp8", "fp8_e5m2"):
        cache = CacheConfig(kv_cache_memory_bytes=100 * f32_page, kv_cache_dtype=name)
        dtype = kv_quant.storage_dtype(name, np.float32)
        pages[name] = resolve_num_pages(cache, config, smol, 4, kv_dtype=dtype)
    # int8/fp8 rows: 64 bytes + a 2-byte scale -> 190,080 bytes a page.
    assert pages == {"float32": 101, "bfloat16": 201, "int8": 388, "fp8": 388, "fp8_e5m2": 388}


def admission_engine(path, kv_cache_dtype) -> LLMEngine:
    config = engine_config_from_args(
        str(path), page_size=PAGE, max_num_seqs=64, max_model_len=64, max_num_batched_tokens=1024,
        kv_cache_memory_bytes=MEMORY, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
    )  # fmt: skip
    s = config.scheduler
    one = dataclasses.replace(s, min_token_bucket=1024, min_seq_bucket=64, min_page_bucket=16)
    return LLMEngine(dataclasses.replace(config, scheduler=one))


def test_equal_memory_admits_twice_the_sequences_in_fp8_and_four_times_in_int8(demo_model_dir):
    running = {}
    for name, (num_pages, _) in ADMITTED.items():
        engine = admission_engine(demo_model_dir, name)
        assert engine.num_pages == num_pages
        prompts = [random_ids(engine, 16, seed=i) for i in range(64)]  # 4 pages each
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy(1))
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.stats()["peak_pages_used"] // 4)
        running[name] = peak
        assert engine.stats()["kv_cache_dtype"] == {"fp8": "float8_e4m3fn"}.get(name, name)
        row = {"float32": 256, "bfloat16": 128}.get(name, 66)
        assert engine.stats()["kv_bytes_per_token"] == 2 * 4 * 2 * row
    assert running == {name: seqs for name, (_, seqs) in ADMITTED.items()}
    assert running["int8"] >= 1.9 * running["float32"] and running["fp8"] >= 1.9 * running["bfloat16"]


def test_a_draft_models_pool_is_quantized_and_counted_so(demo_model_dir):
    """The model as its own draft on an int8 cache: the draft's pool holds int8 pages too,
    and the memory budget counts both pools' int8 pages (not the draft's as float32)."""
    config = engine_config_from_args(
        str(demo_model_dir), page_size=PAGE, max_num_seqs=4, max_model_len=64,
        kv_cache_memory_bytes=MEMORY, kv_cache_dtype="int8",
        speculative_config={"method": "draft_model", "model": str(demo_model_dir),
                            "num_speculative_tokens": 2},
    )  # fmt: skip
    engine = LLMEngine(config)
    int8_page = 2 * 4 * 2 * PAGE * (64 + 2)  # K and V rows of 64 int8 + a 2-byte scale
    assert engine.num_pages == MEMORY // (2 * int8_page) + 1 == 125
    assert engine.spec._drafter.runner.kv_dtype == engine.runner.kv_dtype == np.int8


# -- the features that move pages, on a quantized cache ---------------------------------------
@pytest.fixture(scope="module")
def engines(demo_model_dir):
    return {
        "on": make_engine(demo_model_dir, num_pages=8 * 16 + 1, kv_cache_dtype="int8"),
        "off": make_engine(demo_model_dir, num_pages=8 * 16 + 1, kv_cache_dtype="int8",
                           enable_prefix_caching=False),
        # 16 usable pages: one max_model_len sequence; the batches below need far more.
        "swap": make_engine(demo_model_dir, num_pages=17, kv_cache_dtype="int8",
                            enable_prefix_caching=False, preemption_mode="swap",
                            num_swap_pages=256),
    }


def test_prefix_caching_on_an_int8_cache_changes_no_token(engines):
    on, off = engines["on"], engines["off"]
    shared = random_ids(on, 22, seed=1)  # 5 full pages and 2 tokens
    requests = [("first", shared, greedy(12), 0)] + [
        (f"s{i}", shared[: 8 + 3 * i] + random_ids(on, 3, seed=20 + i), greedy(10), 2)
        for i in range(5)
    ]
    on.reset_stats()
    got = run(on, requests)
    assert on.stats()["prefix_cache_hit_tokens"] >= 8 * 5
    assert tokens(got) == tokens(run(off, requests))


def test_forks_copy_the_partial_pages_rows_and_scales(engines):
    on, off = engines["on"], engines["off"]
    prompt = random_ids(on, 10, seed=3)  # 2 full pages and a partial one every fork copies
    forks = run(on, [("n4", prompt, SamplingParams(n=4, temperature=0.0, max_tokens=12,
                                                    ignore_eos=True), 0)])
    alone = run(off, [("n1", prompt, greedy(12), 0)])["n1"].outputs[0].token_ids
    assert [c.token_ids for c in forks["n4"].outputs] == [alone] * 4


def test_swap_preemption_moves_the_scales_with_the_pages(engines):
    swap, off = engines["swap"], engines["off"]
    requests = [(rid, prompt, params, 0) for rid, prompt, params in batch(swap)]
    swap.reset_stats()
    got = run(swap, requests)
    stats = swap.stats()
    assert stats["num_swaps_out"] > len(requests) // 2
    assert stats["num_swaps_in"] == stats["num_swaps_out"] == stats["num_preemptions"]
    assert tokens(got) == tokens(run(off, requests))
    space = swap.runner.swap_space  # rows and scales on the host, both written
    assert space.data.dtype == np.int8 and space.scales.any()


def test_beam_search_on_an_int8_cache_is_the_same_with_prefix_caching(demo_model_dir):
    def beams(**kwargs):
        llm = LLM(str(demo_model_dir), page_size=PAGE, max_num_seqs=8, max_model_len=64,
                  num_pages=129, kv_cache_dtype="int8", **kwargs)
        prompts = [random_ids(llm.llm_engine, n, seed=40 + n) for n in (5, 9)]
        out = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8))
        return [[(s.token_ids, round(s.cum_logprob, 4)) for s in o.sequences] for o in out]

    assert beams() == beams(enable_prefix_caching=False)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_ngram_speculation_on_a_quantized_cache_is_exact_for_greedy(demo_model_dir,
                                                                    kv_cache_dtype):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [3, 4, 3, 4, 3, 4, 3, 4, 3], [9, 9, 9, 9]]

    def engine(**kwargs):
        return make_engine(demo_model_dir, num_pages=64, kv_cache_dtype=kv_cache_dtype,
                           **kwargs)

    requests = [(f"p{i}", p, greedy(24), 0) for i, p in enumerate(prompts)]
    spec = engine(speculative_config=NGRAM)
    got = run(spec, requests)
    assert spec.stats()["spec_num_accepted_tokens"] > 0
    assert tokens(got) == tokens(run(engine(), requests))

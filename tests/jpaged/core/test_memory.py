"""Memory management on a real model: prefix caching, copy-on-write forks, preemption.

Three small engines on the tiny llama checkpoint (page_size 4, max_model_len 64), shared by
the module: prefix caching on and off with a large pool, and caching on with a pool far too
small for the batch. Each pads every step to one shape (one token, sequence and page bucket),
so an engine compiles only a few programs. Requests are fed step by step through LLMEngine, so
some arrive while the request they share a prefix with is still running.
"""

import dataclasses
import math

import numpy as np
import pytest

from jpaged import SamplingParams
from jpaged.core.engine import LLMEngine
from jpaged.entrypoints.engine_args import engine_config_from_args

PAGE_SIZE = 4
MAX_MODEL_LEN = 64


def make_engine(path, **kwargs) -> LLMEngine:
    config = engine_config_from_args(
        str(path),
        page_size=PAGE_SIZE,
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=32,
        **kwargs,
    )
    s = config.scheduler
    one_bucket = dataclasses.replace(
        s,
        min_token_bucket=s.max_num_batched_tokens,
        min_seq_bucket=s.max_num_seqs,
        min_page_bucket=config.max_pages_per_seq,
    )
    return LLMEngine(dataclasses.replace(config, scheduler=one_bucket))


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return {
        "on": make_engine(path, num_pages=8 * 16 + 1),
        "off": make_engine(path, num_pages=8 * 16 + 1, enable_prefix_caching=False),
        # 16 usable pages: what one sequence of max_model_len needs; the batch needs ~90.
        "small": make_engine(path, num_pages=17),
    }


def run(engine: LLMEngine, requests) -> dict:
    """requests: (request_id, prompt ids, params, arrival step[, cache_salt]). Steps the
    engine, adding each request at its arrival step; returns request_id -> finished output."""
    pending = sorted(requests, key=lambda r: r[3])
    done = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _, *salt = pending.pop(0)
            engine.add_request(rid, prompt, params, cache_salt=salt[0] if salt else None)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    assert engine.stats()["pages_used"] == 0
    return done


def tokens(outputs) -> dict:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in outputs.items()}


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_ids(engine, n, seed):
    vocab = engine.model_config.vocab_size
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


# -- prefix caching ----------------------------------------------------------------------------
def test_prefix_caching_changes_no_output_and_hits_what_is_shared(engines):
    on, off = engines["on"], engines["off"]
    p = random_ids(on, 40, seed=1)  # the shared prompt: 10 full pages
    suffix = [random_ids(on, 6, seed=10 + i) for i in range(8)]
    # "a" runs 16 tokens; the others share prefixes with it, most arriving while it runs
    # (its 40-token prompt is prefilled in steps 0-1 with the 32-token budget).
    a_out = run(off, [("a", p, greedy(16), 0)])["a"].outputs[0].token_ids
    requests = [
        ("a", p, greedy(16), 0, None, 0),
        ("inside_one_page", p[:2] + suffix[0], greedy(8), 0, None, 0),
        ("salted", p[:13] + suffix[1][:3], greedy(8), 0, "tenant", 0),
        ("on_boundary", p[:8] + suffix[2][:5], greedy(8), 3, None, 8),
        # The whole prompt is two full pages: one is left to compute, to sample from.
        ("is_two_pages", p[:8], greedy(8), 3, None, 4),
        ("many_pages", p[:37] + suffix[3][:4], greedy(8), 4, None, 36),
        ("same_salt", p[:13] + suffix[4][:3], greedy(8), 4, "tenant", 12),
        ("identical", p, greedy(8), 5, None, 36),
        # a's prompt and its first 6 generated tokens (a's page 10, full since step 5).
        ("into_generated", p + a_out[:6] + suffix[5][:3], greedy(8), 8, None, 44),
    ]
    expected_hits = {r[0]: r[5] for r in requests}
    requests = [r[:5] for r in requests]

    off.reset_stats()
    ref = run(off, requests)
    assert off.stats()["prefix_cache_hit_tokens"] == 0 and off.stats()["pages_cached"] == 0
    on.reset_stats()
    got = run(on, requests)

    assert tokens(got) == tokens(ref)
    assert got["identical"].outputs[0].token_ids == got["a"].outputs[0].token_ids[:8]
    assert {rid: out.num_cached_tokens for rid, out in got.items()} == expected_hits
    stats = on.stats()
    assert stats["prefix_cache_query_tokens"] == sum(len(r[1]) for r in requests)
    assert stats["prefix_cache_hit_tokens"] == sum(expected_hits.values()) == 140
    assert stats["num_preemptions"] == 0
    assert stats["pages_cached"] > 0  # freed pages stay reusable


def test_a_request_after_the_sharer_finished_revives_its_free_cached_pages(engines):
    on, off = engines["on"], engines["off"]
    p = random_ids(on, 30, seed=2)
    run(on, [("first", p, greedy(4), 0)])  # computes 33 tokens: 8 full pages get cached
    assert on.stats()["pages_used"] == 0 and on.stats()["pages_cached"] >= 8
    second = [("second", p[:28] + [5, 6], greedy(8), 0)]
    got = run(on, second)
    assert got["second"].num_cached_tokens == 28
    assert tokens(got) == tokens(run(off, second))


# -- copy-on-write forks -----------------------------------------------------------------------
def test_n8_sampling_shares_the_prompt_and_copies_only_the_partial_page(engines):
    on = engines["on"]
    prompt = random_ids(on, 10, seed=3)  # pages of 4: two full, one with 2 tokens
    max_tokens = 8

    def sample(seed):
        on.reset_stats()
        params = SamplingParams(
            n=8, temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True
        )
        out = run(on, [(f"n8-{seed}", prompt, params, 0)])[f"n8-{seed}"]
        return [tuple(c.token_ids) for c in out.outputs], on.stats()["peak_pages_used"]

    samples, peak = sample(seed=11)
    prompt_pages = math.ceil(len(prompt) / PAGE_SIZE)
    own_pages = math.ceil(max_tokens / PAGE_SIZE)
    assert peak <= prompt_pages + 8 * (own_pages + 1)  # 27, the bound
    # Exactly: the 2 full prompt pages shared by all 8; each sequence owns its copy of the
    # partial page (positions 8-11) and pages 12-15 and 16 (its last token is not computed).
    assert peak == 2 + 8 * 3
    assert peak < 8 * math.ceil((len(prompt) + max_tokens - 1) / PAGE_SIZE)  # 40 unshared
    assert all(len(s) == max_tokens for s in samples)
    assert len(set(samples)) == 8  # each fork samples with its own seed
    assert sample(seed=11)[0] == samples  # the same seeds give the same samples
    other, _ = sample(seed=12)
    assert not set(other) & set(samples)


# -- preemption --------------------------------------------------------------------------------
def test_a_pool_far_too_small_preempts_often_and_changes_no_greedy_token(engines):
    small, off = engines["small"], engines["off"]
    rng = np.random.default_rng(4)
    requests = [
        (f"r{i}", random_ids(small, int(rng.integers(4, 16)), seed=100 + i), greedy(32), 0)
        for i in range(16)
    ]
    ref = run(off, requests)
    small.reset_stats()
    got = run(small, requests)
    stats = small.stats()
    assert tokens(got) == tokens(ref)
    assert all(len(o.outputs[0].token_ids) == 32 for o in got.values())
    # More preemptions than requests (35 when written): most are preempted, some repeatedly.
    assert stats["num_preemptions"] > len(requests)
    assert stats["prefix_cache_hit_tokens"] > 0  # recomputation is partly served by the cache
    assert stats["peak_pages_used"] == stats["pages_total"] == 16

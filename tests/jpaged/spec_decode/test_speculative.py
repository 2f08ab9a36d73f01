"""Speculative decoding (n-gram proposals) through the engine: exact for greedy requests,
batch-independent for seeded ones, pages accounted, under preemption and swap too."""

import dataclasses

import numpy as np
import pytest
from engine_probes import count_overlapped

from jpaged import LLM, SamplingParams
from jpaged.core.engine import LLMEngine
from jpaged.entrypoints.engine_args import engine_config_from_args
from jpaged.sample.sampling_params import RequestOutputKind
from jpaged.spec_decode.governor import CostGovernor

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, page_size=8)
# Repetitive prompts, so that proposals are found and often accepted by the random model.
PROMPTS = [
    [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6],
    [9, 9, 9, 9, 9, 9],
    [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3],
    [11, 12, 13, 14, 15],
    [1, 2, 1, 2, 1, 2, 1],
    [7, 8, 9, 10, 7, 8, 9, 10, 7, 8],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def one_bucket(path, **kwargs) -> LLM:
    """An LLM whose steps all fit one token, sequence and page bucket (few compiles)."""
    config = engine_config_from_args(str(path), **{**ENGINE, **kwargs})
    s = config.scheduler
    scheduler = dataclasses.replace(
        s,
        min_token_bucket=s.max_num_batched_tokens,
        min_seq_bucket=s.max_num_seqs,
        min_page_bucket=config.max_pages_per_seq,
    )
    llm = LLM.__new__(LLM)
    llm.llm_engine = LLMEngine(dataclasses.replace(config, scheduler=scheduler))
    llm._ids = iter(range(10**9))
    return llm


@pytest.fixture(scope="module")
def reference(demo_model_dir):
    return one_bucket(demo_model_dir, num_pages=128)


@pytest.fixture(scope="module")
def speculative(demo_model_dir):
    return one_bucket(demo_model_dir, num_pages=128, speculative_config=NGRAM)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_are_exactly_the_non_speculative_ones(reference, speculative):
    ref = reference.generate(PROMPTS, GREEDY)
    want = tokens(ref)
    speculative.generate(PROMPTS[:1], GREEDY)
    speculative.llm_engine.reset_stats()  # the speculation counts restart too
    assert speculative.stats()["spec_num_draft_tokens"] == 0
    got = speculative.generate(PROMPTS, GREEDY)
    assert tokens(got) == want
    # several tokens per step reach the text too
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
    stats = speculative.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["spec_mean_acceptance_length"] > 1.0
    assert stats["pages_used"] == 0 and stats["num_compiled"] <= stats["num_buckets"]
    # Logprobs of the emitted tokens are the target's own.
    lp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    want_lp = reference.generate(PROMPTS[:2], lp)
    got_lp = speculative.generate(PROMPTS[:2], lp)
    for w, g in zip(want_lp, got_lp, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for pw, pg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert set(pw) == set(pg)
            assert all(abs(pw[t] - pg[t]) < 1e-4 for t in pw)


def test_stops_inside_accepted_proposals_end_the_output_there(reference, speculative):
    want = reference.generate(PROMPTS[:3], GREEDY)
    for w, prompt in zip(want, PROMPTS[:3], strict=True):
        ids = w.outputs[0].token_ids
        stop = ids[15]  # a token in the middle of the output, maybe inside a verified run
        first = ids.index(stop)
        params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])
        (got,) = speculative.generate([prompt], params)
        assert got.outputs[0].token_ids == ids[: first + 1]
        assert got.outputs[0].finish_reason == "stop" and got.outputs[0].stop_reason == stop
    short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    got = speculative.generate(PROMPTS, short)
    assert [len(t) for t in tokens(got)] == [7] * len(PROMPTS)  # never past max_tokens
    assert tokens(got) == [t[:7] for t in tokens(reference.generate(PROMPTS, GREEDY))]


def _deltas(llm, prompt, params):
    """(text, token count) of each step's output for one request, DELTA outputs."""
    engine = llm.llm_engine
    engine.add_request("deltas", prompt, params.clone(output_kind=RequestOutputKind.DELTA))
    steps = []
    while engine.has_unfinished_requests():
        steps += [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in engine.step()]
    return steps


def test_stop_strings_inside_accepted_proposals_end_the_output_there(demo_model_dir, reference):
    """A stop string completed by a token inside a verified run (several tokens in one
    step): the output's tokens and text end where the non-speculative engine's do, the
    tokens accepted after it dropped. The model is its own draft (every proposal accepted:
    4 new tokens a step; n-gram runs repeat text already out); each stop is two characters
    first seen one character into a multi-token step's text. The cost governor is off: on a
    CPU it may measure that verifying loses and run plain one-token steps, which have no
    stop inside a step to test."""
    spec = {**draft_config(demo_model_dir), "cost_aware": False}
    speculative = one_bucket(demo_model_dir, num_pages=128, speculative_config=spec)
    inside = 0
    for prompt in PROMPTS:
        steps = _deltas(speculative, prompt, GREEDY)
        text = "".join(t for t, _ in steps)
        offset = tokens_before = 0
        for delta, n in steps:
            stop = delta[1:3]
            if n > 2 and len(stop) == 2 and "\ufffd" not in stop and text.find(stop) == offset + 1:
                params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
                (ref,) = reference.generate([prompt], params)  # one token a step
                (got,) = speculative.generate([prompt], params)
                assert got.outputs[0].text == ref.outputs[0].text == text[: offset + 1]
                assert got.outputs[0].token_ids == ref.outputs[0].token_ids, (prompt, stop)
                assert (got.outputs[0].finish_reason, got.outputs[0].stop_reason) == (
                    "stop", stop
                )  # fmt: skip
                inside += len(ref.outputs[0].token_ids) < tokens_before + n
            offset += len(delta)
            tokens_before += n
    assert inside >= 1  # at least one stop fell before the end of its step's tokens
    assert speculative.stats()["pages_used"] == 0


def test_seeded_sampling_is_batch_independent(speculative):
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True)
    alone = tokens(speculative.generate([PROMPTS[2]], params))[0]
    together = tokens(speculative.generate(PROMPTS, params))[2]
    assert together == alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_pool_too_small_preempts_and_changes_no_greedy_token(demo_model_dir, reference, mode):
    small = one_bucket(
        demo_model_dir,
        num_pages=17,  # 16 usable pages of 8 tokens (one 128-token sequence) for 4 of up to 59
        speculative_config=NGRAM,
        preemption_mode=mode,
        **({"num_swap_pages": 64} if mode == "swap" else {}),
    )
    got = small.generate(PROMPTS, GREEDY)
    assert tokens(got) == tokens(reference.generate(PROMPTS, GREEDY))
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["pages_used"] == 0 and stats["swap_pages_used"] == 0
    if mode == "swap":
        assert stats["num_swaps_out"] > 0


def test_speculative_config_errors_name_the_field():
    with pytest.raises(ValueError, match="speculative_config: num_speculative_tokens"):
        engine_config_from_args(
            "x", speculative_config={"method": "ngram", "num_speculative_tokens": 0}
        )
    with pytest.raises(
        ValueError, match="speculative_config: --speculative-config is not valid JSON"
    ):
        engine_config_from_args("x", speculative_config="{not json")
    config = engine_config_from_args(
        "x", speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'
    )
    assert config.num_speculative_tokens == 2 and hash(config) == hash(config)
    np.testing.assert_equal(config.speculative.prompt_lookup_max, 5)


# -- a draft model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_draft(tmp_path_factory, demo_model_dir):
    """A random 2-layer Llama with the demo model's tokenizer (so the same vocabulary)."""
    import shutil

    from models.demo import DEMO_DIMS, build_tokenizer, write_llama_checkpoint

    path = tmp_path_factory.mktemp("draft") / "draft"
    tok = build_tokenizer()
    dims = {**DEMO_DIMS, "layers": 2, "hidden": 128, "intermediate": 256}
    write_llama_checkpoint(path, seed=99, vocab=tok.get_vocab_size(), **dims)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(demo_model_dir / name, path / name)
    return path


def draft_config(model, k=3):
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def test_the_model_as_its_own_draft_accepts_every_proposal(demo_model_dir, reference):
    """In a 16-page pool with the KV host tier: sequences preempted and re-admitted with
    pages loaded from host, whose draft K/V is caught up (every proposal still accepted)."""
    llm = one_bucket(demo_model_dir, num_pages=17, kv_offload_bytes=32 << 20,
                     speculative_config=draft_config(demo_model_dir))  # fmt: skip
    assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(reference.generate(PROMPTS, GREEDY))
    s = llm.stats()
    assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"] > 0
    assert s["host_hit_pages"] > 0 and s["num_preemptions"] > 0
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    llm.llm_engine.reset_stats()
    llm.generate(PROMPTS, sampled)  # p == q: rejection sampling accepts everything
    s = llm.stats()
    assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"] > 0
    assert s["pages_used"] == 0 and s["host_pages_used"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_another_draft_changes_no_greedy_token_under_preemption(
    demo_model_dir, reference, small_draft, mode
):
    """Recompute runs with the KV host tier on: a re-admitted sequence's evicted pages come
    back from host into pages the draft has no K/V in (DraftModel.sync catches it up)."""
    llm = one_bucket(
        demo_model_dir,
        num_pages=17,
        speculative_config=draft_config(small_draft, k=2),
        preemption_mode=mode,
        **({"num_swap_pages": 64} if mode == "swap" else {"kv_offload_bytes": 32 << 20}),
    )
    assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(reference.generate(PROMPTS, GREEDY))
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["spec_num_draft_tokens"] > 0
    assert s["pages_used"] == 0 and s["swap_pages_used"] == 0
    if mode == "recompute":
        assert s["host_hit_pages"] > 0 and s["host_pages_used"] == 0


def test_a_draft_with_another_vocabulary_is_rejected(demo_model_dir, tmp_path):
    from models.demo import write_llama_checkpoint

    other = write_llama_checkpoint(
        tmp_path / "other", seed=1, hidden=64, layers=1, heads=2, kv_heads=1, intermediate=64,
        vocab=1000,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"vocabulary \(1000 tokens\) must equal the target's"):
        one_bucket(demo_model_dir, speculative_config=draft_config(other))


def test_disable_by_batch_size_stops_greedy_proposals_in_big_batches(demo_model_dir, reference):
    """Over the limit only seeded sampled rows propose: greedy tokens are unchanged and no
    greedy row proposes, and those steps overlap the host's work with the device's (async
    scheduling, as without speculation); a seeded row's tokens equal its tokens alone (under
    the limit), and while it runs no step overlaps."""
    limited = one_bucket(demo_model_dir, num_pages=128,
                         speculative_config={**NGRAM, "disable_by_batch_size": 2})  # fmt: skip
    overlapped = count_overlapped(limited.llm_engine)
    got = limited.generate(PROMPTS[:4], GREEDY)  # 4 decoding rows > 2: nothing proposed
    assert tokens(got) == tokens(reference.generate(PROMPTS[:4], GREEDY))
    assert limited.stats()["spec_num_draft_tokens"] == 0
    assert overlapped[0] >= 30  # 40 tokens each: every decode step after the first two
    alone = limited.generate(PROMPTS[:1], GREEDY)  # 1 row <= 2: it speculates
    assert tokens(alone) == tokens(got)[:1] and limited.stats()["spec_num_draft_tokens"] > 0
    # low temperature: the random model repeats itself, so prompt lookup finds proposals
    seeded = SamplingParams(temperature=0.2, seed=11, max_tokens=40, ignore_eos=True)
    limited.reset_stats()
    one = tokens(limited.generate([PROMPTS[2]], seeded))[0]
    drafts_alone = limited.stats()["spec_num_draft_tokens"]
    limited.reset_stats()
    overlapped[0] = 0
    mixed = limited.generate(PROMPTS[:4], [GREEDY, GREEDY, seeded, GREEDY])
    assert tokens(mixed)[2] == one and drafts_alone > 0
    assert 0 < limited.stats()["spec_num_draft_tokens"]
    assert overlapped[0] == 0  # the seeded row runs to the end with the others
    with pytest.raises(ValueError, match="disable_by_batch_size must be an integer >= 1"):
        one_bucket(demo_model_dir, speculative_config={**NGRAM, "disable_by_batch_size": 0})


def scripted_costs(engine: LLMEngine, *, plain: float, verify: float) -> None:
    """The engine's step clock advances by `plain` seconds as each step without proposals is
    fetched and by `verify` as each that verifies some is: the governor's measurements
    become exact and reproducible."""
    now = [0.0]
    fetch = engine.runner.fetch

    def timed(step):
        now[0] += plain if step.plan.proposals is None else verify
        return fetch(step)

    engine.runner.fetch = timed
    engine.spec._clock = lambda: now[0]


@pytest.mark.parametrize("verify_cost", [1.0, 8.0], ids=["verifying-pays", "verifying-loses"])
def test_the_cost_governor_keeps_speculating_only_where_verifying_pays(
    demo_model_dir, reference, verify_cost
):
    """Where a verifying step costs as much as a plain one, the batch keeps speculating (one
    plain probe every 16 steps); where it costs 8 plain steps (more than any acceptance here
    wins) greedy rows stop proposing after one plain probe and their steps overlap, with a
    verifying probe every 16 steps. Greedy tokens are the same either way."""
    llm = one_bucket(demo_model_dir, num_pages=128, speculative_config=NGRAM)
    engine = llm.llm_engine
    scripted_costs(engine, plain=1.0, verify=verify_cost)
    overlapped = count_overlapped(engine)
    got = llm.generate(PROMPTS[:4], GREEDY)
    assert tokens(got) == tokens(reference.generate(PROMPTS[:4], GREEDY))
    stats = llm.stats()
    plain_s, verify_s, per_row = engine.spec._governor.costs()[4]
    assert (plain_s, verify_s) == (1.0, verify_cost) and per_row >= 1.0
    if verify_cost == 1.0:
        assert per_row / verify_s >= 1 / plain_s
        assert stats["spec_num_drafts"] >= 4 * 5 and overlapped[0] <= 4
    else:
        assert per_row / verify_s < 1 / plain_s
        # the first step, then one probe each 16 steps: 4 rows each
        assert stats["spec_num_drafts"] <= 4 * 3 and overlapped[0] >= 20


def test_seeded_rows_keep_proposing_when_the_governor_stops_the_batch(demo_model_dir):
    llm = one_bucket(demo_model_dir, num_pages=128, speculative_config=NGRAM)
    # low temperature: the random model repeats itself, so prompt lookup finds proposals
    seeded = SamplingParams(temperature=0.2, seed=11, max_tokens=40, ignore_eos=True)
    one = tokens(llm.generate([PROMPTS[2]], seeded))[0]
    scripted_costs(llm.llm_engine, plain=1.0, verify=8.0)
    mixed = llm.generate(PROMPTS[:4], [GREEDY, GREEDY, seeded, GREEDY])
    assert tokens(mixed)[2] == one


def test_a_step_that_compiled_is_not_timed(demo_model_dir):
    """A compile inside a step's interval (here: a plain step that takes 100 s and counts a
    compile) leaves the governor's averages alone: plain steps still cost 1 s to it, and
    verifying, at 8 s, still loses."""
    llm = one_bucket(demo_model_dir, num_pages=128, speculative_config=NGRAM)
    engine = llm.llm_engine
    llm.generate(PROMPTS[:4], GREEDY)  # every program this test meets is compiled
    engine.spec._governor = type(engine.spec._governor)()  # without the real-clock samples of that run
    scripted_costs(engine, plain=1.0, verify=8.0)
    fetch, programs, plain_steps = engine.runner.fetch, engine.runner.programs, [0]
    scripted_clock, offset = engine.spec._clock, [0.0]
    engine.spec._clock = lambda: scripted_clock() + offset[0]

    def one_slow_compiling_step(step):
        out = fetch(step)
        if step.plan.proposals is None and step.plan.decode_only:
            plain_steps[0] += 1
            if plain_steps[0] == 3:
                programs.num_compiles += 1
                offset[0] += 100.0  # this step's interval: 101 s
        return out

    engine.runner.fetch = one_slow_compiling_step
    llm.generate(PROMPTS[:4], GREEDY)
    assert plain_steps[0] > 3
    plain_s, verify_s, _ = engine.spec._governor.costs()[4]
    assert (plain_s, verify_s) == (1.0, 8.0)


def test_plain_steps_check_shadow_proposals_so_a_copying_batch_speculates_again(
    demo_model_dir, reference
):
    """A bucket that measured verifying as losing (plain 1 s a step, verifying 2 s for 1 token
    a row) and probes it only every 128 steps still switches back within a 40-token request
    when its rows copy: each plain step checks n-gram proposals made on the host against the
    tokens that follow, and the rows' estimate of what verifying would give (over 2 tokens a
    row: this model repeats itself) reaches the governor. Greedy tokens are unchanged."""
    llm = one_bucket(demo_model_dir, num_pages=128, speculative_config=NGRAM)
    engine = llm.llm_engine
    scripted_costs(engine, plain=1.0, verify=2.0)
    engine.spec._governor = CostGovernor(probe_interval=128)
    engine.spec._governor.record(4, 2.0, 1.0)  # verifying: 1 token a row in 2 s
    engine.spec._governor.record(4, 1.0, None)  # plain: 1 in 1 s, faster
    assert not engine.spec._governor.speculates(4)
    samples = []
    set_tokens = engine.spec._governor.set_tokens
    engine.spec._governor.set_tokens = lambda b, t: (samples.append((b, t)), set_tokens(b, t))
    records = []
    record = engine.spec._governor.record
    engine.spec._governor.record = lambda *a, **kw: (records.append((a, kw)), record(*a, **kw))
    got = llm.generate(PROMPTS[:4], GREEDY)
    assert tokens(got) == tokens(reference.generate(PROMPTS[:4], GREEDY))
    assert samples and {b for b, _ in samples} == {4}
    # The rows' estimate passed verifying's break-even with the margin (2 tokens in 2 s
    # against 1 in 1 s, times 1.1), and the batch speculated again.
    assert max(t for _, t in samples) > 2.2 and all(1.0 <= t <= 5.0 for _, t in samples)
    assert llm.stats()["spec_num_drafts"] > 0
    assert engine.spec._row_tokens == {}  # the rows' estimates went with their requests
    # A verification gives the governor the rows' estimate too, replacing its average.
    verifying = [kw for (_, _, t), kw in records if t is not None]
    assert verifying and all(kw == {"rows_estimate": True} for kw in verifying)

"""Host packing: the scheduler's plan as plain arrays, padded into a bucket (exact arrays)."""

import dataclasses
import os

import numpy as np
import pytest
from xla_flags import OLD_EMITTERS, TEST_OPT_LEVEL

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import RequestGroup
from jpaged.sample.sampler import SamplerOutput
from jpaged.sample.sampling_params import SamplingParams
from jpaged.worker.step_inputs import (
    WARM_UP_RUNS,
    Demand,
    StepKey,
    bucket_keys,
    holds,
    needs_key,
    pack,
    step_key,
    update_capacity,
    warm_up_inputs,
    warm_up_keys,
)
from jpaged.worker.step_plan import PLACEHOLDER, empty_plan

SCRATCH = 4  # max_num_seqs: the scratch page-table row


def make(admits=None):
    config = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=16),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32),
    )
    return Scheduler(config, PageAllocator(16), eos_token_ids=(0,), admits=admits), config


def add(sched, rid, prompt, **params):
    group = RequestGroup(rid, None, list(prompt), SamplingParams(**params), arrival=0)
    sched.add(group, seed=7)
    return group


def feed(sched, plan, tokens):
    out = SamplerOutput(np.asarray(tokens, np.int32), np.zeros(len(plan), np.float32), None, None)
    sched.commit(plan, out)


def test_a_prefill_plan_is_plain_arrays_and_packs_into_its_bucket():
    sched, config = make()
    add(sched, "a", [11, 12, 13, 14, 15], temperature=0.0, max_tokens=4)  # pages 1, 2
    add(sched, "b", [21, 22], temperature=0.5, top_k=3, min_tokens=2, max_tokens=4)  # page 3
    plan = sched.schedule()
    assert plan.seq_ids.tolist() == [0, 1]
    assert plan.table_rows.tolist() == [0, 1]
    assert plan.starts.tolist() == [0, 0] and plan.num_new_tokens.tolist() == [5, 2]
    assert plan.query_start.tolist() == [0, 5, 7]
    assert plan.token_ids.tolist() == [11, 12, 13, 14, 15, 21, 22]
    assert plan.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    # page * 4 + offset: a's positions 0-3 in page 1, 4 in page 2; b's in page 3
    assert plan.slot_mapping.tolist() == [[4, 5, 6, 7, 8, 12, 13]]  # one paging group
    assert plan.page_updates.tolist() == [[0, 0, 1], [0, 1, 2], [1, 0, 3]]
    assert plan.max_pages == 2 and not plan.decode_only
    assert plan.sampling.banned.tolist()[1][:1] == [0]  # b: EOS banned before min_tokens

    key = step_key(plan, config)
    assert key == StepKey(num_tokens=16, num_seqs=4, num_page_cols=4, decode_only=False)
    assert key in bucket_keys(config)
    inputs = pack(plan, key, scratch_row=SCRATCH, page_size=4, mask_words=2)
    assert inputs.token_ids.tolist() == [11, 12, 13, 14, 15, 21, 22] + [0] * 9
    assert inputs.src_rows.tolist() == [-1] * 16
    assert inputs.slot_mapping.tolist() == [[4, 5, 6, 7, 8, 12, 13] + [0] * 9]  # pad: null page
    assert inputs.table_rows.tolist() == [0, 1, SCRATCH, SCRATCH]
    assert inputs.context_lens.tolist() == [5, 2, 0, 0]
    assert inputs.query_start.tolist() == [0, 5, 7, 7, 7]
    assert inputs.logits_indices.tolist() == [4, 6, 0, 0]
    cap = update_capacity(key, 4)
    assert inputs.page_updates.shape == (cap, 3)
    assert inputs.page_updates.tolist() == [[0, 0, 1], [0, 1, 2], [1, 0, 3]] + [
        [SCRATCH, 0, 0]
    ] * (cap - 3)
    assert inputs.page_copies.tolist() == [[0, 0]] * 4
    s = inputs.sampling
    assert s.temperature.tolist() == [0.0, 0.5, 0.0, 0.0]
    assert s.top_k.tolist() == [0, 3, 0, 0] and s.top_p.tolist() == [1.0] * 4
    assert s.num_generated.tolist() == [0, 0, 0, 0]
    assert s.key_data.tolist()[:2] == [[0, 7], [0, 7]] and s.penalties is None
    assert s.token_bitmask.tolist() == [[-1, -1]] * 4 and not s.use_bitmask  # no grammar
    assert s.bias_ids is None and inputs.prompt_targets is None


def test_masks_biases_and_prompt_targets_are_packed_per_row():
    sched, config = make()
    add(sched, "a", [11, 12, 13], temperature=0.0, max_tokens=4, logit_bias={7: 2.5, 9: -1.0})
    add(sched, "b", [21, 22, 23, 24], temperature=0.0, max_tokens=4, prompt_logprobs=2)
    plan = sched.schedule()
    assert plan.sampling.bias_ids.tolist()[0][:3] == [7, 9, -1]
    assert plan.sampling.bias_ids.shape == (2, 16) and plan.sampling.bias_ids[1].max() == -1
    # b's tokens 21..23 predict 22..24; its last prompt token predicts the first output.
    assert plan.prompt_targets.tolist() == [-1, -1, -1, 22, 23, 24, -1]
    key = step_key(plan, config)
    assert (key.bias_width, key.prompt_logprobs) == (16, True)
    mask = np.array([[-1, 5], [3, 0]], np.int32)  # rows' masks (2 words: vocab <= 64)
    inputs = pack(plan, key, scratch_row=SCRATCH, page_size=4, mask_words=2, token_bitmask=mask)
    assert inputs.sampling.use_bitmask
    assert inputs.sampling.token_bitmask.tolist() == [[-1, 5], [3, 0], [-1, -1], [-1, -1]]
    assert inputs.sampling.bias_values.tolist()[0][:2] == [2.5, -1.0]
    assert inputs.prompt_targets.tolist() == [-1, -1, -1, 22, 23, 24, -1] + [-1] * 9


def test_decode_tokens_still_on_the_device_read_the_previous_steps_rows():
    sched, config = make()
    add(sched, "a", [11, 12, 13], temperature=0.0, max_tokens=8)
    add(sched, "b", [21, 22, 23, 24], temperature=0.0, max_tokens=8)
    first = sched.schedule()
    sched.dispatched(first)  # async: the next plan is made before first's tokens are known
    second = sched.schedule()
    assert second.decode_only
    assert second.token_ids.tolist() == [PLACEHOLDER, PLACEHOLDER]
    assert second.positions.tolist() == [3, 4]
    assert second.slot_mapping.tolist() == [[4 + 3, 3 * 4]]  # a: page 1 slot 3; b: new page 3
    key = step_key(second, config)
    assert key == StepKey(num_tokens=4, num_seqs=4, num_page_cols=4, decode_only=True)
    inputs = pack(second, key, scratch_row=SCRATCH, page_size=4, mask_words=2, prev_plan=first)
    assert inputs.src_rows.tolist() == [0, 1, -1, -1]  # rows of first that sampled them
    assert inputs.token_ids.tolist() == [0, 0, 0, 0]
    assert inputs.sampling.num_generated.tolist() == [1, 1, 0, 0]  # placeholders count
    sched.dispatched(second)
    feed(sched, first, [31, 41])
    feed(sched, second, [32, 42])
    seqs = [sched.sequence(i) for i in (0, 1)]
    assert [s.token_ids[-2:] for s in seqs] == [[31, 32], [41, 42]]


def test_penalty_rows_carry_their_token_histories():
    sched, config = make()
    add(sched, "p", [5, 6, 5], temperature=0.0, presence_penalty=0.5, max_tokens=4)
    add(sched, "q", [9], temperature=0.0, max_tokens=4)
    plan = sched.schedule()
    feed(sched, plan, [7, 8])
    plan = sched.schedule()
    p = plan.sampling.penalties
    assert plan.uses_penalties.tolist() == [True, False]
    assert p.prompt_tokens.shape == (2, 16) and p.output_tokens.shape == (2, 16)
    assert p.prompt_tokens[0, :4].tolist() == [5, 6, 5, -1]
    assert p.output_tokens[0, :2].tolist() == [7, -1]
    assert p.prompt_tokens[1].tolist() == [-1] * 16  # rows without penalties stay empty
    assert p.presence.tolist() == [0.5, 0.0] and p.repetition.tolist() == [1.0, 1.0]
    key = step_key(plan, config)
    assert key.penalty_shape == (16, 16)
    inputs = pack(plan, key, scratch_row=SCRATCH, page_size=4, mask_words=2)
    assert inputs.sampling.penalties.prompt_tokens.shape == (4, 16)
    assert inputs.sampling.penalties.presence.tolist() == [0.5, 0.0, 0.0, 0.0]


def test_forks_pad_the_tokens_to_the_rows_so_every_key_is_a_bucket_key():
    config = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=64, max_model_len=32),
    )
    sched = Scheduler(config, PageAllocator(64), eos_token_ids=(0,))
    add(sched, "a", [11, 12, 13], temperature=1.0, n=20, max_tokens=2)
    plan = sched.schedule()
    assert plan.num_tokens == 3 and len(plan) == 20  # the parent's 3 tokens; 19 forks
    key = step_key(plan, config)
    assert key == StepKey(num_tokens=32, num_seqs=32, num_page_cols=4, decode_only=False)
    assert key in bucket_keys(config)


def test_bucket_keys_are_the_reachable_shapes_up_to_max_len():
    config = EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256),
    )
    assert config.seq_buckets == (4, 8, 16) and config.token_buckets == (16, 32, 64)
    assert config.page_buckets == (4, 8, 16)
    ragged = {(k.num_tokens, k.num_seqs) for k in bucket_keys(config) if not k.decode_only}
    # 9..16 rows carry at least 9 tokens, which the smallest token bucket (16) holds
    assert ragged == {(16, 4), (32, 4), (64, 4), (16, 8), (32, 8), (64, 8), (16, 16),
                      (32, 16), (64, 16)}
    assert len(bucket_keys(config)) == 3 * 3 + 9 * 3
    short = bucket_keys(config, max_len=100)  # 7 pages: page buckets 4 and 8
    assert {k.num_page_cols for k in short} == {4, 8}
    assert len(short) == 3 * 2 + 9 * 2
    assert set(short) < set(bucket_keys(config))
    big = EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64, max_model_len=64),
    )
    # 33..64 rows: at least 33 tokens, so the 64-token bucket only
    assert {k.num_tokens for k in bucket_keys(big) if k.num_seqs == 64} == {64}
    assert {k.num_tokens for k in bucket_keys(big) if k.num_seqs == 32} == {32, 64}


def test_a_verification_of_every_row_runs_exactly_its_tokens():
    """8 rows each verifying k = 4 proposals run 40 tokens (not the 64-token bucket); 7 rows
    verifying and one decoding (36 tokens) too; 6 and 2 (32 tokens) fit the 32 bucket. Every
    such key is one bucket_keys lists."""
    config = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=128),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        speculative_config='{"method": "ngram", "num_speculative_tokens": 4}',
    )
    assert config.seq_buckets == (4, 8) and config.token_buckets == (16, 32, 64)
    for proposing, tokens in ((8, 40), (7, 40), (6, 32)):
        sched = Scheduler(config, PageAllocator(128), eos_token_ids=(0,))
        for i in range(8):
            add(sched, f"r{i}", [5 + i, 6, 7], max_tokens=20)
        plan = sched.schedule()
        feed(sched, plan, [9] * len(plan))
        ids = [seq.seq_id for seq in sched.running]
        plan = sched.schedule({i: [1, 2, 3, 4] for i in ids[:proposing]})
        assert plan.num_tokens == 5 * proposing + (8 - proposing)
        key = step_key(plan, config)
        assert (key.num_tokens, key.num_seqs, key.spec_k) == (tokens, 8, 4)
        assert key in bucket_keys(config)


def _padded_inputs(key: StepKey, page_size: int = 4):
    return pack(empty_plan(), key, scratch_row=8, page_size=page_size, mask_words=2)


def test_warm_up_runs_lay_a_ragged_keys_tokens_over_one_two_and_every_row():
    key = StepKey(8, 4, 2, False)  # 2 page columns of 4 tokens: every row's context is 8
    runs = [warm_up_inputs(_padded_inputs(key), key, 4, run) for run in range(WARM_UP_RUNS)]
    assert WARM_UP_RUNS == 3
    assert [x.query_start.tolist() for x in runs] == [
        [0, 8, 8, 8, 8], [0, 4, 8, 8, 8], [0, 2, 4, 6, 8]]
    assert [x.context_lens.tolist() for x in runs] == [
        [8, 0, 0, 0], [8, 8, 0, 0], [8, 8, 8, 8]]
    assert [x.positions.tolist() for x in runs] == [
        list(range(8)), [4, 5, 6, 7] * 2, [6, 7] * 4]
    assert [x.logits_indices.tolist() for x in runs] == [
        [7, 0, 0, 0], [3, 7, 0, 0], [1, 3, 5, 7]]
    assert [x.sampling.temperature.tolist() for x in runs] == [
        [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert [x.sampling.top_p.tolist() for x in runs] == [
        [1, 1, 1, 1], [1, 1, 1, 1], pytest.approx([0.9] * 4)]
    assert [bool(x.sampling.use_bitmask) for x in runs] == [False, False, True]
    assert (runs[2].sampling.token_bitmask == -1).all()  # the mask allows every token
    padded = _padded_inputs(key)
    for x in runs:  # nothing a request reads: the scratch row, the null page's slot 0
        assert x.table_rows.tolist() == [8] * 4
        assert x.slot_mapping.tolist() == [[0] * 8]
        np.testing.assert_array_equal(x.page_updates, padded.page_updates)
        np.testing.assert_array_equal(x.page_copies, padded.page_copies)
        assert (x.src_rows == -1).all()


def test_warm_up_rows_never_hold_more_tokens_than_their_context():
    key = StepKey(16, 2, 1, False)  # one page column: a row's context is 4 tokens
    x = warm_up_inputs(_padded_inputs(key), key, 4, 0)
    assert x.query_start.tolist() == [0, 4, 4]  # the other 12 tokens are padding
    assert x.positions.tolist() == [0, 1, 2, 3] + [0] * 12
    assert x.context_lens.tolist() == [4, 0]


def test_warm_up_runs_of_a_decode_key_give_every_row_a_full_context():
    key = StepKey(4, 4, 3, True)
    for run in range(WARM_UP_RUNS):
        x = warm_up_inputs(_padded_inputs(key), key, 4, run)
        assert x.query_start.tolist() == [0, 1, 2, 3, 4]
        assert x.context_lens.tolist() == [12] * 4
        assert x.positions.tolist() == [11] * 4
        assert x.logits_indices.tolist() == [0, 1, 2, 3]
        assert x.sampling.temperature.tolist() == [min(run, 1)] * 4


def test_max_context_caps_a_warm_up_rows_context_at_whole_pages():
    key = StepKey(4, 4, 3, True)  # three page columns of 4 tokens: 12 without a cap
    for cap, context in ((5, 8), (8, 8), (1, 4), (100, 12)):
        x = warm_up_inputs(_padded_inputs(key), key, 4, 0, max_context=cap)
        assert x.context_lens.tolist() == [context] * 4, cap
        assert x.positions.tolist() == [context - 1] * 4, cap


def test_the_last_warm_up_run_of_a_verification_key_verifies_every_proposal_it_can():
    key = StepKey(8, 2, 2, False, spec_k=3)
    x = warm_up_inputs(_padded_inputs(key), key, 4, 2)
    assert x.num_proposed.tolist() == [3, 3]
    assert x.proposals.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert x.logits_indices.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    first = warm_up_inputs(_padded_inputs(key), key, 4, 0)
    assert first.num_proposed.tolist() == [0, 0]
    assert first.proposals.tolist() == [[-1, -1, -1]] * 2
    assert first.logits_indices.tolist() == [[7] * 4, [0] * 4]


def test_a_warm_up_run_outside_the_runs_is_refused():
    key = StepKey(8, 4, 2, False)
    with pytest.raises(ValueError, match=r"warm-up run must be in \[0, 3\), got 3"):
        warm_up_inputs(_padded_inputs(key), key, 4, 3)


@pytest.fixture
def fusion_emitters(monkeypatch):
    """XLA_FLAGS without the suite's jax 0.10 flag turning the fusion emitters off, as a
    user's process runs: the CPU resolves SchedulerConfig.one_row_bucket on."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = [f for f in flags if f != OLD_EMITTERS]
    monkeypatch.setenv("XLA_FLAGS", " ".join(kept))


def test_on_cpu_one_page_bucket_and_decode_steps_on_the_ragged_programs(fusion_emitters):
    base = EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
    )
    gpu, cpu = base.resolve(256, "gpu"), base.resolve(256, "cpu")
    assert gpu.page_buckets == (4, 8, 16) and gpu.decode_programs
    assert cpu.page_buckets == (16,) and not cpu.decode_programs
    # The smallest token bucket: 4 on CPU, 16 on accelerators (and unresolved).
    assert cpu.token_buckets == (4, 8, 16, 32, 64)
    assert gpu.token_buckets == base.token_buckets == (16, 32, 64)
    keys = bucket_keys(cpu)
    assert all(not k.decode_only and k.num_page_cols == 16 for k in keys)
    assert {(k.num_tokens, k.num_seqs) for k in keys} == {
        (1, 1), (4, 4), (8, 4), (16, 4), (32, 4), (64, 4), (8, 8), (16, 8), (32, 8), (64, 8),
        (16, 16), (32, 16), (64, 16)
    }  # fmt: skip
    assert len(keys) == 13 and len(bucket_keys(gpu)) == 3 * 3 + 9 * 3
    # A decode step of r rows pads to (bucket(r) tokens, bucket(r) rows), keys precompiled;
    # one row's has a program of its own on CPU (SchedulerConfig.one_row_bucket).
    assert [(k.num_tokens, k.num_seqs) for k in warm_up_keys(cpu, 64)] == [
        (4, 4), (8, 8), (16, 16), (1, 1), (8, 4), (16, 4), (32, 4), (64, 4)
    ]
    assert cpu.scheduler.one_row_bucket and not gpu.scheduler.one_row_bucket
    # A smallest token bucket given (not the platform's) keeps every step in the buckets.
    pinned = dataclasses.replace(base, scheduler=dataclasses.replace(
        base.scheduler, min_token_bucket=8)).resolve(256, "cpu")  # fmt: skip
    assert not pinned.scheduler.one_row_bucket
    assert all(k.num_seqs >= 4 for k in bucket_keys(pinned))
    assert set(warm_up_keys(cpu, 64)) <= set(keys)


def test_a_decode_plan_on_cpu_runs_the_ragged_key_of_its_rows(fusion_emitters):
    base = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=16),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32),
    )
    config = base.resolve(32, "cpu")
    sched = Scheduler(config, PageAllocator(16), eos_token_ids=(0,))
    add(sched, "a", [5, 6, 7], max_tokens=4, ignore_eos=True)
    add(sched, "b", [8, 9], max_tokens=4, ignore_eos=True)
    prefill = sched.schedule()
    feed(sched, prefill, [11, 12])
    decode = sched.schedule()
    assert decode.decode_only and len(decode) == 2
    assert step_key(decode, config) == StepKey(4, 4, 8, False)  # CPU: a 4-token bucket
    assert step_key(decode, base) == StepKey(4, 4, 4, True)  # with decode programs
    assert step_key(decode, config) in bucket_keys(config)
    feed(sched, decode, [13, 0])
    sched.finish(sched.running[1], "stop")  # "b" ends: "a" decodes alone
    lone = sched.schedule()
    assert lone.decode_only and len(lone) == 1
    assert step_key(lone, config) == StepKey(1, 1, 8, False)  # CPU: one row, one token
    assert step_key(lone, base) == StepKey(4, 4, 4, True)
    assert step_key(lone, config) in bucket_keys(config)


def test_without_the_fusion_emitters_the_cpu_pads_a_lone_decode(monkeypatch):
    """With XLA_FLAGS turning XLA:CPU's fusion emitters off, a (1, 1) program runs its
    matrix-vector products as emitted loops (several times slower than (4, 4)): no one-row
    program, the keys are the buckets'."""
    monkeypatch.setenv("XLA_FLAGS", f"{TEST_OPT_LEVEL} {OLD_EMITTERS}")
    cpu = EngineConfig().resolve(2048, "cpu")
    assert cpu.scheduler.one_row_bucket is False
    assert min(k.num_seqs for k in bucket_keys(cpu)) == 4
    assert len(bucket_keys(cpu)) == 26 and len(warm_up_keys(cpu, 64)) == 8


def test_the_default_configs_program_counts_on_cpu_and_on_accelerators(fusion_emitters):
    """What a default engine (max_num_seqs 32, 512 batched tokens, max_model_len 2048) can
    compile, and what the server's warm-up (64 tokens) compiles: a change that adds programs
    fails here (issue 38: 162 reachable programs before the CPU defaults)."""
    base = EngineConfig()
    cpu, gpu = base.resolve(2048, "cpu"), base.resolve(2048, "gpu")
    assert len(bucket_keys(cpu)) == 27  # 26 and a one-row decode's (1, 1)
    assert len(warm_up_keys(cpu, 64)) == 9
    assert len(bucket_keys(gpu)) == 162


def test_a_program_holds_a_step_of_no_more_and_no_other_features_than_it_has():
    step = StepKey(20, 3, 2, False, num_logprobs=20, penalty_shape=(16, 32))
    assert holds(step, step)
    assert holds(StepKey(32, 4, 8, False, num_logprobs=20, penalty_shape=(32, 32),
                         bias_width=16, prompt_logprobs=True), step)  # fmt: skip
    for smaller in (
        StepKey(16, 4, 8, False, num_logprobs=20, penalty_shape=(16, 32)),  # tokens
        StepKey(32, 2, 8, False, num_logprobs=20, penalty_shape=(16, 32)),  # rows
        StepKey(32, 4, 1, False, num_logprobs=20, penalty_shape=(16, 32)),  # columns
        StepKey(32, 4, 8, False, penalty_shape=(16, 32)),  # no logprobs
        StepKey(32, 4, 8, False, num_logprobs=20),  # no penalties
        StepKey(32, 4, 8, False, num_logprobs=20, penalty_shape=(16, 16)),  # narrower
        StepKey(32, 4, 8, True, num_logprobs=20, penalty_shape=(16, 32)),  # decode-only
        StepKey(32, 4, 8, False, num_logprobs=20, penalty_shape=(16, 32), spec_k=2),
    ):
        assert not holds(smaller, step), smaller
    decode = StepKey(4, 4, 2, True)
    assert holds(StepKey(4, 4, 2, False), decode) and holds(decode, decode)
    assert not holds(StepKey(4, 4, 2, False, bias_width=16), StepKey(4, 4, 2, False, bias_width=32))
    assert not holds(StepKey(4, 4, 2, False), StepKey(4, 4, 2, False, prompt_logprobs=True))


def test_pack_fills_a_bigger_programs_features_with_neutral_values():
    sched, _ = make()
    add(sched, "a", [5, 6, 7])
    plan = sched.schedule()
    key = StepKey(16, 2, 8, False, num_logprobs=20, penalty_shape=(16, 16), bias_width=16,
                  prompt_logprobs=True)  # fmt: skip
    inputs = pack(plan, key, scratch_row=SCRATCH, page_size=4, mask_words=2)
    np.testing.assert_array_equal(inputs.prompt_targets, np.full(16, -1))
    p = inputs.sampling.penalties
    np.testing.assert_array_equal(p.prompt_tokens, np.full((2, 16), -1))
    assert (p.presence.tolist(), p.frequency.tolist(), p.repetition.tolist()) == (
        [0.0, 0.0], [0.0, 0.0], [1.0, 1.0])  # fmt: skip
    np.testing.assert_array_equal(inputs.sampling.bias_ids, np.full((2, 16), -1))


def test_needs_key_is_the_biggest_step_the_demands_run_together():
    _, config = make()  # page_size 4, budget 16 tokens, max_model_len 32
    plain = SamplingParams(max_tokens=4)
    demands = [
        Demand(params=plain, num_prompt_tokens=9, num_new_tokens=1, context_len=13,
               in_prompt=False),
        Demand(params=SamplingParams(logprobs=1, presence_penalty=0.5, max_tokens=20),
               num_prompt_tokens=5, num_new_tokens=5, context_len=25),
        Demand(params=SamplingParams(logit_bias={3: 1.0}, prompt_logprobs=0, n=2, max_tokens=4),
               num_prompt_tokens=3, num_new_tokens=3, context_len=7, num_rows=2),
    ]  # fmt: skip
    assert needs_key(demands, config) == StepKey(
        9, 4, 7, False, num_logprobs=20, penalty_shape=(16, 32), bias_width=16,
        prompt_logprobs=True)  # fmt: skip
    many = [Demand(params=plain, num_prompt_tokens=12, num_new_tokens=12, context_len=16)] * 2
    assert needs_key(many, config) == StepKey(16, 2, 4, False)  # the step budget caps tokens
    done = Demand(params=SamplingParams(prompt_logprobs=0), num_prompt_tokens=3,
                  num_new_tokens=1, context_len=8, in_prompt=False)  # fmt: skip
    assert not needs_key([done], config).prompt_logprobs


def test_the_admission_check_sees_the_running_sequences_and_the_next_one():
    seen = []
    sched, _ = make(admits=lambda demands: seen.append(demands) or len(demands) < 2)
    add(sched, "a", [5, 6, 7], max_tokens=2)
    add(sched, "b", [8, 9], logprobs=1, max_tokens=3)
    plan = sched.schedule()
    assert plan.seq_ids.tolist() == [0]  # alone: admitted unchecked; with "a" running: refused
    assert [[(d.num_new_tokens, d.context_len, d.params.logprobs) for d in ds] for ds in seen] == [
        [(3, 5, None), (2, 5, 1)]]  # fmt: skip
    feed(sched, plan, [11])
    feed(sched, sched.schedule(), [0])  # "a" ends on its second token (EOS is 0)
    assert sched.schedule().seq_ids.tolist() == [1]

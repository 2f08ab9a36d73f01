"""SpeculativeConfig (vLLM's names, defaults and errors), AcceptanceTracker (the adaptive
proposal count: full at first, fewer as proposals are rejected, none when they do not pay,
probed again later, back to full when they are accepted) and CostGovernor (speculate in a
batch size only where measured verifying steps give more tokens per second)."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.config import SpeculativeConfig
from jpaged.spec_decode.governor import AcceptanceTracker, CostGovernor


def test_config_defaults_follow_vllm():
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = SpeculativeConfig(num_speculative_tokens=2, model="/ckpt/draft")
    assert c.method == "draft_model" and c.prompt_lookup_min is None
    assert hash(c) == hash(
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="/ckpt/draft")
    )


def test_config_from_dict_and_json():
    value = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    c = SpeculativeConfig.from_dict(value)
    assert c == SpeculativeConfig(**value)
    assert (
        SpeculativeConfig.from_json(
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
        )
        == c
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"num_speculative_tokens": 3}, "method"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1.5},
            "prompt_lookup_max",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "/ckpt"}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "cost_aware": "yes"}, "cost_aware"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 3, "model": ""}, "model"),
        (
            {
                "method": "draft_model",
                "num_speculative_tokens": 3,
                "model": "/c",
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_max",
        ),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "draft_tensor_parallel_size",
        ),
        ([("method", "ngram")], "mapping"),
    ],
)
def test_config_from_dict_errors(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(value)


def test_config_from_json_errors():
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_json("{method: ngram}")
    with pytest.raises(ValueError, match="mapping"):
        SpeculativeConfig.from_json("[1, 2]")


def test_check_draft_vocab():
    c = SpeculativeConfig(num_speculative_tokens=2, model="/ckpt/draft")
    c.check_draft_vocab(32000, 32000)
    with pytest.raises(ValueError, match="vocabulary"):
        c.check_draft_vocab(32000, 32001)


def test_tracker_goes_down_probes_and_recovers():
    t = AcceptanceTracker(4, min_gain=0.3, decay=0.8, probe_interval=8)
    seq = [7]
    counts = []

    def step(num_accepted_of):
        k = int(t.num_proposals(seq)[0])
        counts.append(k)
        t.record(seq, [k], [num_accepted_of(k)])

    step(lambda k: 0)  # fresh: full proposals, all rejected -> alpha 0.44 -> 1
    step(lambda k: 0)  # 1 rejected -> alpha 0.26 -> 0
    for _ in range(8):
        step(lambda k: 0)  # no speculation for 8 steps, then a probe with k_max
    step(lambda k: k)  # the probe is accepted in full -> alpha 0.76 -> back to 4
    step(lambda k: k)
    assert counts == [4, 1] + [0] * 8 + [4, 4]
    assert t.acceptance_rate(7) == pytest.approx(
        (0.8**4 + 0.8 * 4 + 4) / (0.8**4 + 0.8 * 4 + 4 + 1.8 * 0.8**2)
    )


def test_tracker_partial_acceptance_gives_fewer_proposals():
    t = AcceptanceTracker(5, min_gain=0.3, decay=0.8)
    for _ in range(40):
        t.record([1], [5], [2])  # two of five proposals accepted, every step
    # alpha -> 2/3 per proposal: 0.67**2 >= 0.3 > 0.67**3, so two proposals.
    assert t.acceptance_rate(1) == pytest.approx(2 / 3, abs=1e-3)
    assert t.num_proposals([1]).tolist() == [2]


def test_tracker_bounds_wasted_proposals():
    """Proposals that are always rejected cost at most k_max per probe interval."""
    t = AcceptanceTracker(4, probe_interval=8)
    proposed = 0
    for _ in range(90):
        k = int(t.num_proposals([3])[0])
        proposed += k
        t.record([3], [k], [0])
    assert proposed <= 4 + 1 + 4 * (90 // 9)
    assert proposed / 90 < 0.6  # against 4 per step without adaptation


def test_tracker_state_per_sequence_and_free():
    t = AcceptanceTracker(3)
    t.num_proposals([1, 2])
    t.record([1, 2], np.array([3, 3]), np.array([3, 0]))
    t.record([1, 2], np.array([3, 1]), np.array([3, 0]))
    assert t.num_proposals([2, 1]).tolist() == [0, 3]
    t.free(2)
    assert t.num_proposals([2]).tolist() == [3]  # a new sequence starts at full proposals


def test_tracker_stats_and_errors():
    t = AcceptanceTracker(3)
    t.record([1, 2, 3], np.array([3, 2, 0]), np.array([1, 2, 0]))
    s = t.stats()
    assert s["spec_num_drafts"] == 2
    assert s["spec_num_draft_tokens"] == 5
    assert s["spec_num_accepted_tokens"] == 3
    assert s["spec_accepted_per_pos"] == [2, 1, 0]
    assert s["spec_acceptance_rate"] == pytest.approx(3 / 5)
    assert s["spec_mean_acceptance_length"] == pytest.approx(1 + 3 / 2)
    t.reset_totals()  # the counts restart; each sequence's acceptance estimate stays
    assert t.stats()["spec_num_drafts"] == t.stats()["spec_num_draft_tokens"] == 0
    assert t.stats()["spec_accepted_per_pos"] == [0, 0, 0]
    assert t.stats()["spec_mean_acceptance_length"] == 0.0
    assert t.acceptance_rate(2) == 1.0 and t.acceptance_rate(1) == pytest.approx(1.8 / 2.8)
    t.record([1], np.array([2]), np.array([2]))
    assert t.stats()["spec_num_accepted_tokens"] == 2 and t.stats()["spec_num_drafts"] == 1
    with pytest.raises(ValueError, match="num_accepted"):
        t.record([1], [2], [3])
    with pytest.raises(ValueError, match="num_proposed"):
        t.record([1], [4], [0])
    with pytest.raises(ValueError, match="min_gain"):
        AcceptanceTracker(3, min_gain=1.0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AcceptanceTracker(0)


def test_governor_measures_both_modes_then_keeps_the_faster_and_probes_the_other():
    g = CostGovernor(decay=0.5, probe_interval=3)
    assert g.speculates(8)  # nothing measured: speculate first
    g.record(8, 0.30, 2.0)  # a verifying step: 2 tokens a row in 0.3 s
    assert not g.speculates(8)  # plain not measured yet: one plain step
    g.record(8, 0.10, None)  # plain: 1 token a row in 0.1 s beats 2 in 0.3 s
    assert g.costs() == {8: (0.10, 0.30, 2.0)}
    assert [g.speculates(8) for _ in range(2)] == [False, False]  # peeking changes nothing
    g.record(8, 0.10, None)
    g.record(8, 0.10, None)
    assert g.speculates(8)  # 3 plain steps since the last verification: probe it
    g.record(8, 0.12, 3.0)  # acceptance rose: (2+3)/2 = 2.5 tokens in (0.3+0.12)/2 = 0.21 s
    plain_s, verify_s, per_row = g.costs()[8]
    assert (plain_s, round(verify_s, 6), per_row) == (0.10, 0.21, 2.5)
    assert g.speculates(8)  # 2.5 / 0.21 > 1 / 0.1
    g.record(8, 0.21, 2.5)
    g.record(8, 0.21, 2.5)
    assert not g.speculates(8)  # 3 verifications since the last plain step: probe plain
    assert g.speculates(16)  # buckets are measured apart
    with pytest.raises(ValueError, match="probe_interval must be an integer >= 1"):
        CostGovernor(probe_interval=0)
    with pytest.raises(ValueError, match="decay must be in"):
        CostGovernor(decay=1.0)


def test_governor_probes_a_mode_that_keeps_losing_less_and_less_often():
    g = CostGovernor(decay=0.5, probe_interval=2, max_probe_interval=8)
    g.record(4, 0.30, 1.5)  # verifying: 1.5 tokens a row in 0.3 s
    g.record(4, 0.10, None)  # plain: 1 in 0.1 s, faster

    def plain_steps_until_probe() -> int:
        n = 0
        while not g.speculates(4):
            g.record(4, 0.10, None)
            n += 1
        g.record(4, 0.30, 1.5)  # the probe confirms: verifying still loses
        return n

    # the first gap counts the measuring plain step; each confirming probe doubles it, to 8
    assert [plain_steps_until_probe() for _ in range(5)] == [1, 4, 8, 8, 8]
    # Acceptance rose: a probe wins ((1.5+3)/2 tokens in (0.3+0.01)/2 s against 1 in 0.1 s),
    # the bucket switches over and the interval restarts at 2, now between plain probes (two
    # verifying steps since the last plain one: probe plain now).
    g.record(4, 0.01, 3.0)
    assert not g.speculates(4)
    g.record(4, 0.10, None)  # the plain probe confirms: the interval doubles to 4
    verifying = 0
    while g.speculates(4):
        g.record(4, 0.01, 3.0)
        verifying += 1
    assert verifying == 4
    with pytest.raises(ValueError, match="max_probe_interval must be an integer >= 4"):
        CostGovernor(probe_interval=4, max_probe_interval=2)


def test_governor_takes_the_running_rows_tokens_estimate():
    g = CostGovernor(decay=0.5, probe_interval=2, max_probe_interval=8)
    g.set_tokens(4, 3.0)  # nothing measured yet: ignored (the bucket speculates first)
    assert g.costs() == {}
    g.record(4, 0.20, 1.0)  # verifying: 1 token a row in 0.2 s
    g.record(4, 0.10, None)  # plain: 1 in 0.1 s, faster
    assert not g.speculates(4)
    g.set_tokens(4, 2.0)  # the rows copy: 2 tokens in 0.2 s, as fast as plain (not 10% faster)
    assert not g.speculates(4) and g.costs()[4] == (0.10, 0.20, 2.0)
    g.set_tokens(4, 2.5)  # replaced, not averaged: 2.5 tokens in 0.2 s beat 1 in 0.1 s
    assert g.speculates(4) and g.costs()[4][2] == 2.5


def test_governor_starts_verifying_only_when_it_wins_by_the_margin_and_stops_at_once():
    g = CostGovernor(decay=0.5, probe_interval=2, max_probe_interval=8, switch_margin=0.1)
    g.record(4, 0.20, 1.75)  # verifying: 1.75 tokens a row in 0.2 s = 8.75 a second
    g.record(4, 0.10, None)  # plain: 10 a second, faster
    assert not g.speculates(4)
    g.set_tokens(4, 2.0)  # 2 in 0.2 s = 10 a second: not faster
    assert not g.speculates(4)
    g.set_tokens(4, 2.125)  # 10.6 a second: faster, but by less than 10%
    assert not g.speculates(4)
    g.set_tokens(4, 2.25)  # 11.25 a second: faster by more than 10%
    assert g.speculates(4)
    g.set_tokens(4, 2.0625)  # 10.3 a second: still faster, keep verifying
    assert g.speculates(4)
    g.set_tokens(4, 1.875)  # 9.4 a second: plain wins, switch at once
    assert not g.speculates(4)
    with pytest.raises(ValueError, match="switch_margin must be in"):
        CostGovernor(switch_margin=1.0)


def test_governor_replaces_its_tokens_average_with_the_rows_estimate():
    g = CostGovernor(decay=0.5, probe_interval=2)
    g.record(4, 0.20, 3.0)  # the batch before copied: 3 tokens a row in 0.2 s
    g.record(4, 0.10, None)  # plain: 10 a second against 15: verifying stays
    assert g.speculates(4)
    g.record(4, 0.20, 1.5, rows_estimate=True)  # the new rows: 1.5 each, 7.5 a second
    assert g.costs()[4][2] == 1.5  # replaced (the average would be 2.25: still verifying)
    assert not g.speculates(4)

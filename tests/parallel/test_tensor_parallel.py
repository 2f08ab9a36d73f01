"""Tensor and data parallelism on 8 simulated CPU devices: same greedy tokens as one device,
pools split over KV heads, weights laid out Megatron-style, one program per step with one
all-reduce per row-parallel matmul, and Orbax restored into shards equal to HF loaded."""

from __future__ import annotations

import pytest
from sharded_worker import CONFIGS, assert_same_tokens_and_logprobs

TP = "('kv', 'rep')"
NUM_LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 2, 64, 8, 4, 8, 128, 2048


@pytest.mark.parametrize(("t", "d"), [c for c in CONFIGS if c != (1, 1)])
def test_tokens_equal_single_device(tp_results, t, d):
    res = tp_results[f"{t}x{d}"]
    assert_same_tokens_and_logprobs(res, tp_results["1x1"])
    assert all(len(toks) == 8 for toks in res["tokens"])


@pytest.mark.parametrize("t", [2, 8])
def test_swap_preemption_under_tp_gives_the_single_device_tokens(tp_results, t):
    res = tp_results[f"swap_{t}x1"]
    assert res["tokens"] == tp_results["1x1"]["tokens"]
    stats = res["stats"]
    assert stats["num_swaps_out"] > 0
    assert stats["num_preemptions"] == stats["num_swaps_out"] == stats["num_swaps_in"]
    assert (stats["pages_used"], stats["swap_pages_used"]) == (0, 0)
    assert res["pool_spec"] == "P('kv', None, None, None)"  # still split over heads
    if t == 2:  # the host tier on: pages evicted from the pool come back, same tokens
        assert res["again"] == tp_results["1x1"]["tokens"]
        assert stats["host_hit_pages"] > 0 and stats["host_pages_used"] == 0


@pytest.mark.parametrize(("t", "d"), CONFIGS)
def test_pool_bytes_per_device(tp_results, t, d):
    layout = tp_results[f"{t}x{d}"]["layout"]
    total = NUM_LAYERS * 4 * 32 * 16 * 8 * 4  # layers x kv heads x pages x page size x dim x f32
    assert layout["pool_total_bytes"] == total
    assert layout["pool_devices"] == t
    assert layout["pool_device_bytes"] == [total // min(t, KV_HEADS)] * t


def _expected_layout(t: int, *, stacked: bool = True) -> dict:
    """Specs and per-device shapes; stacked (scanned layers): "layers.<name>" with a leading
    unsplit layer dimension, else layer 0's "layers.0.<name>"."""
    kv = min(t, KV_HEADS)
    layers = {
        "input_norm": ["P()", [HIDDEN]],
        "post_attn_norm": ["P()", [HIDDEN]],
        "wq": [f"P(None, {TP}, None)", [HIDDEN, HEADS // t, HEAD_DIM]],
        "wk": ["P(None, 'kv', None)", [HIDDEN, KV_HEADS // kv, HEAD_DIM]],
        "wv": ["P(None, 'kv', None)", [HIDDEN, KV_HEADS // kv, HEAD_DIM]],
        "wo": [f"P({TP}, None, None)", [HEADS // t, HEAD_DIM, HIDDEN]],
        "w_gate": [f"P(None, {TP})", [HIDDEN, INTER // t]],
        "w_up": [f"P(None, {TP})", [HIDDEN, INTER // t]],
        "w_down": [f"P({TP}, None)", [INTER // t, HIDDEN]],
    }
    out = {
        "embed": [f"P({TP}, None)", [VOCAB // t, HIDDEN]],
        "lm_head": [f"P(None, {TP})", [HIDDEN, VOCAB // t]],
        "final_norm": ["P()", [HIDDEN]],
    }
    for name, (spec, shape) in layers.items():
        if stacked:
            spec = "P(None,)" if spec == "P()" else spec.replace("P(", "P(None, ", 1)
            out[f"layers.{name}"] = [spec, [NUM_LAYERS, *shape]]
        else:
            out[f"layers.0.{name}"] = [spec, shape]
    return out


@pytest.mark.parametrize("t", [2, 4, 8])
def test_weight_shardings(tp_results, t):
    assert tp_results[f"{t}x1"]["layout"]["weights"] == _expected_layout(t)


def test_single_device_path_has_no_mesh(tp_results):
    """One CPU device, unsharded: per-layer weights (models/llama.py switch_layers), q/k/v
    and gate/up merged (fuse_projections) and packed in panels of 64 columns for the CPU's
    matmul kernel (models/packed.py: [N / 64, K, 64]), no mesh."""
    weights = tp_results["1x1"]["layout"]["weights"]
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    assert weights["layers.0.wqkv"] == ["None", [qkv // 64, HIDDEN, 64]]
    assert weights["layers.0.w_gate_up"] == ["None", [2 * INTER // 64, HIDDEN, 64]]
    assert weights["layers.0.wo"] == ["None", [HIDDEN // 64, HEADS * HEAD_DIM, 64]]
    assert "layers.wq" not in weights and "layers.0.wq" not in weights


def test_unrolled_layers_under_tp_give_the_scanned_tokens(tp_results):
    res = tp_results["unrolled_2x1"]
    assert res["tokens"] == tp_results["2x1"]["tokens"] == tp_results["1x1"]["tokens"]
    assert res["layout"]["weights"] == _expected_layout(2, stacked=False)
    for prog in res["collectives"]:  # every layer's two all-reduces in the program
        assert (prog["all_reduce"], prog["all_gather"]) == (2 * NUM_LAYERS + 1, 1), prog["key"]


@pytest.mark.parametrize("t", [2, 4, 8])
def test_step_is_one_program_with_expected_collectives(tp_results, t):
    """Per step: one all-reduce after each row-parallel matmul (wo, w_down) of the scanned
    layer (the loop body, run once per layer), one for the vocab-parallel embedding, one
    all-gather of the logits; nothing else."""
    programs = tp_results[f"{t}x1"]["collectives"]
    # Two token buckets were used; on CPU a decode step runs the ragged program of its
    # buckets (no decode-only programs, SchedulerConfig.decode_programs).
    assert len(programs) == 2
    for prog in programs:
        assert (prog["modules"], prog["all_reduce"], prog["all_gather"]) == (1, 2 + 1, 1), prog[
            "key"
        ]


def test_data_parallel_replicas_own_their_devices(tp_results):
    res = tp_results["2x2"]
    assert res["replica_devices"] == [[0, 1], [2, 3]]
    # Both replicas ran (and compiled) steps: replica 0 holds the chunked long prompt (two
    # token buckets), replica 1 only short ones (one bucket).
    assert res["replica_steps"] == [2, 1]


def test_orbax_restore_under_tp4_equals_hf(tp_results):
    """HF -> Orbax -> restored into T = 4 shards: same layout, tokens and logprobs (bitwise)
    as the HF checkpoint loaded under T = 4, and the tokens of one device."""
    ours, hf = tp_results["orbax_4x1"], tp_results["4x1"]
    assert ours["params_equal_hf"] is True  # every restored shard, bitwise and placed alike
    assert ours["layout"] == hf["layout"]
    assert ours["tokens"] == hf["tokens"] == tp_results["1x1"]["tokens"]
    assert ours["logprobs"] == hf["logprobs"]

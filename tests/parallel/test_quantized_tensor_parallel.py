"""Quantized weights under tensor parallelism on simulated CPU devices: int8 and fp8 (quantized
at load) and GGUF Q4_1 (int8 blocks of 32 with scale and offset) give the single-device
quantized tokens at T = 2, split as the float weights are (models/sharding.py quantized_spec),
and a file whose blocks cannot split is refused with one line naming the tensor."""

from __future__ import annotations

import pytest
from sharded_worker import assert_same_tokens_and_logprobs

TP = "('kv', 'rep')"


@pytest.mark.parametrize("label", ["int8", "fp8", "q4_1"])
def test_quantized_tokens_under_tp2_equal_one_device(quant_results, label):
    one, two = quant_results[f"{label}_1"], quant_results[f"{label}_2"]
    assert_same_tokens_and_logprobs(two, one)
    assert all(len(toks) == 8 for toks in one["tokens"])
    # The same arrays, split: weight_bytes counts each global array once.
    assert two["weight_bytes"] == one["weight_bytes"]
    assert one["layout"]["wq.q"][0] == "None"  # one device: no mesh


@pytest.mark.parametrize("label", ["int8", "fp8"])
def test_per_channel_scales_split_with_the_output_channels(quant_results, label):
    """tp_checkpoint (D 64, 8 query and 4 KV heads of 8, F 128, 2 layers) at T = 2: q exactly
    as the float weight; scales split on column-parallel weights, replicated on wo/w_down."""
    col, heads_q = f"P(None, None, {TP})", f"P(None, None, {TP}, None)"
    heads_kv = "P(None, None, 'kv', None)"
    want = {
        "input_norm": ["P(None,)", [2, 64]],
        "post_attn_norm": ["P(None,)", [2, 64]],
        "wq.q": [heads_q, [2, 64, 4, 8]],
        "wq.scale": [heads_q, [2, 1, 4, 8]],
        "wk.q": [heads_kv, [2, 64, 2, 8]],
        "wk.scale": [heads_kv, [2, 1, 2, 8]],
        "wv.q": [heads_kv, [2, 64, 2, 8]],
        "wv.scale": [heads_kv, [2, 1, 2, 8]],
        "wo.q": [f"P(None, {TP}, None, None)", [2, 4, 8, 64]],
        "wo.scale": ["P(None, None, None, None)", [2, 1, 1, 64]],
        "w_gate.q": [col, [2, 64, 64]],
        "w_gate.scale": [col, [2, 1, 64]],
        "w_up.q": [col, [2, 64, 64]],
        "w_up.scale": [col, [2, 1, 64]],
        "w_down.q": [f"P(None, {TP}, None)", [2, 64, 64]],
        "w_down.scale": ["P(None, None, None)", [2, 1, 64]],
    }
    assert quant_results[f"{label}_2"]["layout"] == want


def test_gguf_blocks_split_with_their_scales_and_offsets(quant_results):
    """Q4_1 (D 128, 4 query and 2 KV heads of 32, F 512): each device holds the scales and
    offsets of its own blocks of 32 (along D for the column-parallel weights, unsplit; along
    Dh for wo, whose heads split; along F for w_down, split: 16 blocks, 8 each)."""
    layout = quant_results["q4_1_2"]["layout"]
    heads_q, col, row = f"P(None, None, {TP}, None)", f"P(None, None, {TP})", f"P(None, {TP}, None)"
    for part in ("scale", "offset"):
        assert layout[f"wq.{part}"] == [heads_q, [2, 4, 2, 32]]
        assert layout[f"wk.{part}"] == ["P(None, None, 'kv', None)", [2, 4, 1, 32]]
        assert layout[f"wo.{part}"] == [f"P(None, {TP}, None, None)", [2, 2, 1, 128]]
        assert layout[f"w_gate.{part}"] == [col, [2, 4, 256]]
        assert layout[f"w_down.{part}"] == [row, [2, 8, 128]]
    assert layout["w_down.q"] == [row, [2, 256, 128]]


def test_quantized_data_parallel_replicas(quant_results):
    """D = 2 x T = 2 with int8 weights: the tokens of one device, and stats() gives the
    replicas' shared KV dtype and bytes per token (not summed)."""
    res = quant_results["int8_2x2"]
    assert res["tokens"] == quant_results["int8_1"]["tokens"]
    assert res["stats"] == {
        "kv_cache_dtype": "float32",
        "kv_bytes_per_token": 2 * 2 * 4 * 8 * 4,  # layers x K, V x KV heads x head dim x f32
        "quantization": "int8",
    }


def test_blocks_that_cannot_split_are_refused(quant_results):
    """Q8_0 with F 96: w_down's 3 blocks of 32 along F cannot go 1.5 to each of 2 devices."""
    assert quant_results["odd_error"] == (
        "model.layers.0.mlp.down_proj.weight: tensor parallelism over 2 devices gives each 48 "
        "of its 96 blocked elements, not whole quantization blocks of 32; use a "
        "tensor_parallel_size dividing 3, or no --quantization"
    )

"""LoRA adapters under tensor parallelism on simulated CPU devices (issue 55): a batch of two
adapters and the base gives the single-device tokens at T = 8 (KV heads split over 4, each on
two devices), and each adapter's slots are split as its module (models/sharding.py lora_specs):
A replicated and B split over the output for q/k/v/gate/up, A split over the input and B
replicated for o/down, also after slot writes at run time."""

from __future__ import annotations

TP = "('kv', 'rep')"


def test_adapters_under_tp_give_the_single_device_tokens(lora_results):
    one, base = lora_results["tokens_1"], lora_results["base"]
    assert lora_results["tokens_8"] == one
    # rows 0, 3 on adapter a1, row 2 on a2, rows 1 and 4 on the base
    assert [one[i] != base[i] for i in range(5)] == [True, False, True, True, False]


def test_slots_are_split_as_their_modules(lora_results):
    """tp_checkpoint (D 64, 8 query heads and 4 KV heads of 8, F 128, 2 layers) at T = 8,
    2 slots of rank 8: per-device shapes."""
    col, kv, row = f"P(None, None, None, {TP})", "P(None, None, None, 'kv')", f"P(None, {TP}, None, None)"
    rep = "P(None,)"
    want = {
        "a_q_proj": [rep, [2, 64, 2, 8]], "b_q_proj": [col, [2, 2, 8, 8]],
        "a_k_proj": [rep, [2, 64, 2, 8]], "b_k_proj": [kv, [2, 2, 8, 8]],
        "a_v_proj": [rep, [2, 64, 2, 8]], "b_v_proj": [kv, [2, 2, 8, 8]],
        "a_o_proj": [row, [2, 8, 2, 8]], "b_o_proj": [rep, [2, 2, 8, 64]],
        "a_gate_proj": [rep, [2, 64, 2, 8]], "b_gate_proj": [col, [2, 2, 8, 16]],
        "a_up_proj": [rep, [2, 64, 2, 8]], "b_up_proj": [col, [2, 2, 8, 16]],
        "a_down_proj": [row, [2, 16, 2, 8]], "b_down_proj": [rep, [2, 2, 8, 64]],
    }  # fmt: skip
    assert lora_results["layout"] == want

"""models/lora.py against a per-token numpy reference: each token gets x @ A[slot] @ B[slot]
(nothing for -1; padding tokens nothing), for steps on 0 to 8 of 8 slots at every formulation
(one adapter sliced, the step's slots gathered and dense, all slots dense, gathered per token
when a step has no more tokens than its width, a program wider than the step, tokens grouped
by slot in blocks from 4 tokens per width on); writing a slot changes that slot alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import lora

N, R, D_IN, D_OUT = 8, 4, 16, 12
ROWS = 10


@functools.partial(jax.jit, static_argnums=(4,))
def _update(y, x, layer, row_slots, num_tokens, query_start, ids):
    slots = lora.token_slots(row_slots, query_start, num_tokens)
    return lora.add(y, x, layer, "q_proj", lora.make_step(slots, ids, N))


def _layer(rng):
    return {
        "lora_a_q_proj": jnp.asarray(rng.normal(size=(D_IN, N, R)), jnp.float32),
        "lora_b_q_proj": jnp.asarray(rng.normal(size=(N, R, D_OUT)), jnp.float32),
    }


def test_widths():
    assert lora.widths(16) == (0, 1, 4, 16) and lora.widths(2) == (0, 1, 2)
    assert lora.widths(4) == (0, 1, 4) and lora.widths(1) == (0, 1)
    assert [lora.width_for(n, 16) for n in (0, 1, 2, 4, 5, 16)] == [0, 1, 4, 4, 16, 16]
    with pytest.raises(ValueError, match="3 adapters in a step of LoRA width 2"):
        lora.step_ids(np.array([0, 1, 2, -1]), 2, 8)


# (adapters, width, tokens): width 1 sliced; 4 < N gathered and dense (15 and 24 tokens); N dense;
# tokens <= width gathered per token (8 tokens, width 8); a width-4 program on a one-adapter
# step; 32 tokens at width 4 and 8: grouped in blocks of 4 and 2 rows
CASES = [(0, 1, 32), (1, 1, 32), (3, 4, 15), (1, 4, 32), (5, 8, 24), (8, 8, 32), (3, 8, 8),
         (2, 4, 4), (3, 4, 32), (5, 8, 32), (8, 8, 64)]  # fmt: skip


@pytest.mark.parametrize("num_adapters,width,tokens", CASES)
def test_update_equals_per_token_reference(num_adapters, width, tokens):
    rng = np.random.default_rng(num_adapters)
    layer = _layer(rng)
    adapters = rng.choice(N, num_adapters, replace=False)
    row_slots = np.full(ROWS, -1, np.int32)  # rows past the adapters' rows: base or padding
    row_slots[:num_adapters] = adapters
    rng.shuffle(row_slots[: num_adapters + 2])
    lens = np.zeros(ROWS, np.int32)
    lens[: num_adapters + 2] = rng.integers(1, 4 if tokens > ROWS else 2, num_adapters + 2)
    query_start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = rng.normal(size=(tokens, D_IN)).astype(np.float32)  # tokens past the rows: padding
    y = rng.normal(size=(tokens, D_OUT)).astype(np.float32)
    ids = lora.step_ids(row_slots, width, N)
    got = _update(y, x, layer, row_slots, tokens, query_start, ids)
    got = np.asarray(got)
    want = y.copy()
    a, b = np.asarray(layer["lora_a_q_proj"]), np.asarray(layer["lora_b_q_proj"])
    for row, slot in enumerate(row_slots):
        for t in range(query_start[row], query_start[row + 1]):
            if slot >= 0:
                want[t] += x[t] @ a[:, slot] @ b[slot]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_write_slots_changes_one_slot():
    rng = np.random.default_rng(0)
    slots = [_layer(rng), _layer(rng)]  # two layers, unstacked
    new = {"lora_a_q_proj": np.ones((2, D_IN, R), np.float32),
           "lora_b_q_proj": np.full((2, R, D_OUT), 2.0, np.float32)}  # fmt: skip
    out = lora.write_slots(slots, jnp.int32(3), new)
    for before, after in zip(slots, out, strict=True):
        a0, a1 = np.asarray(before["lora_a_q_proj"]), np.asarray(after["lora_a_q_proj"])
        assert (a1[:, 3] == 1).all() and np.array_equal(np.delete(a1, 3, 1), np.delete(a0, 3, 1))
        b0, b1 = np.asarray(before["lora_b_q_proj"]), np.asarray(after["lora_b_q_proj"])
        assert (b1[3] == 2).all() and np.array_equal(np.delete(b1, 3, 0), np.delete(b0, 3, 0))


@pytest.mark.parametrize("counts", [(29, 1, 1, 1), (9, 9, 9, 5), (0, 0, 0, 0)])
def test_grouped_blocks_at_their_bound(counts):
    """32 tokens at width 4 (blocks of 4 rows, 11 blocks): each slot's last block partly
    filled uses all 11 (29 + 1 + 1 + 1: 8 + 1 + 1 + 1 blocks), base tokens between them."""
    rng = np.random.default_rng(1)
    layer = _layer(rng)
    slots = np.full(32, -1, np.int32)
    slots[: sum(counts)] = np.repeat([6, 0, 3, 5], counts)
    rng.shuffle(slots)
    step = lora.make_step(jnp.asarray(slots), jnp.asarray([0, 3, 5, 6], jnp.int32), N)
    assert step.blocks.slot.shape == (11,) and step.blocks.src.shape == (44,)
    x = rng.normal(size=(32, D_IN)).astype(np.float32)
    y = rng.normal(size=(32, D_OUT)).astype(np.float32)
    got = np.asarray(jax.jit(lora.add, static_argnums=3)(y, x, layer, "q_proj", step))
    a, b = np.asarray(layer["lora_a_q_proj"]), np.asarray(layer["lora_b_q_proj"])
    want = y + np.stack([x[t] @ a[:, s] @ b[s] if s >= 0 else np.zeros(D_OUT) for t, s in
                         enumerate(slots)])  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width,tokens", [(1, 8), (8, 8), (8, 12), (4, 32)])
def test_bfloat16_slots_equal_a_rounded_reference(width, tokens):
    """--lora-dtype bfloat16 on a float32 model: the slots hold bfloat16 bits (uint16), the
    update is float32 over the rounded weights, at each formulation (sliced, per token,
    dense, blocks)."""
    assert lora.storage_dtype("bfloat16", jnp.float32) == jnp.uint16
    assert lora.storage_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert lora.storage_dtype("bfloat16", jnp.bfloat16) == jnp.bfloat16
    rng = np.random.default_rng(width)
    a = rng.normal(size=(D_IN, R)).astype(np.float32)
    b = rng.normal(size=(R, D_OUT)).astype(np.float32)
    empty = {k: jnp.zeros(s, jnp.uint16) for k, s in
             lora.slot_shapes_of({"q_proj": (D_IN, D_OUT)}, N, R).items()}  # fmt: skip
    layer = lora.write_slots(empty, jnp.int32(5), {"lora_a_q_proj": a, "lora_b_q_proj": b})
    assert layer["lora_a_q_proj"].dtype == jnp.uint16
    slots = np.where(np.arange(tokens) % 3 == 0, -1, 5).astype(np.int32)
    ids = np.full(width, -1, np.int32)
    ids[0] = 5
    step = lora.make_step(jnp.asarray(slots), jnp.asarray(ids), N)
    x = rng.normal(size=(tokens, D_IN)).astype(np.float32)
    got = np.asarray(jax.jit(lora.add, static_argnums=3)(np.zeros((tokens, D_OUT), np.float32),
                                                         x, layer, "q_proj", step))  # fmt: skip
    rounded = [np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32)) for w in (a, b)]
    want = np.where((slots >= 0)[:, None], x @ rounded[0] @ rounded[1], 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - np.where((slots >= 0)[:, None], x @ a @ b, 0)).max() > 1e-3  # rounded

"""Quantized KV pages (pallas_kernels/kv_quant.py): exact round trips of hand-made rows, the
functional write, and the reference attention over quantized pages equal to the same
attention over their dequantized float32 pages.

Hand-made values are chosen so that every expected number is exact: a scale is bf16(amax /
qmax), and each case says why its scale and codes are what they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from paged_cases import decode_case, prefill_case

from pallas_kernels import kv_quant, reference
from pallas_kernels.kv_quant import QuantizedPages

INT8 = np.dtype(np.int8)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(ml_dtypes.bfloat16)


def round_trip(row, dtype):
    q, scale = kv_quant.quantize_checked(np.asarray([row], np.float32), dtype)
    back = kv_quant.dequantize(q, scale)
    return np.asarray(q[0], np.float32).tolist(), float(scale[0]), np.asarray(back[0]).tolist()


def test_storage_dtypes_follow_vllms_names():
    f32 = np.dtype(np.float32)
    assert kv_quant.storage_dtype("auto", f32) == f32
    assert kv_quant.storage_dtype("auto", ml_dtypes.bfloat16) == np.dtype(ml_dtypes.bfloat16)
    assert kv_quant.storage_dtype("fp8", f32) == kv_quant.storage_dtype("fp8_e4m3", f32) == E4M3
    assert kv_quant.storage_dtype("fp8_e5m2", f32) == E5M2
    assert kv_quant.storage_dtype("int8", f32) == INT8
    assert [kv_quant.is_quantized(d) for d in (f32, INT8, E4M3, E5M2)] == [False, True, True, True]
    assert [kv_quant.qmax(d) for d in (INT8, E4M3, E5M2)] == [127.0, 448.0, 57344.0]
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        kv_quant.storage_dtype("int4", f32)


def test_bytes_per_row_count_the_scale():
    assert kv_quant.bytes_per_token_row(np.float32, 64) == 256
    assert kv_quant.bytes_per_token_row(ml_dtypes.bfloat16, 64) == 128
    assert kv_quant.bytes_per_token_row(INT8, 64) == kv_quant.bytes_per_token_row(E4M3, 64) == 66


def test_int8_scale_rounding_and_half_to_even():
    # amax 254 -> scale 254 / 127 = 2 (exact); -127 / 2 = -63.5 rounds to even -64; 0.5 / 2
    # = 0.25 rounds to 0.
    assert round_trip([254.0, -127.0, 0.5, 0.0], INT8) == (
        [127.0, -64.0, 0.0, 0.0], 2.0, [254.0, -128.0, 0.0, 0.0]
    )


def test_int8_saturates_at_127_when_the_bf16_scale_rounds_down():
    # 129 / 127 = 1.015748... rounds to bf16 1.015625 (steps of 2^-7 there): 129 / 1.015625 =
    # 127.015 is clipped to 127, and 3.046875 / 1.015625 = 3 exactly.
    assert round_trip([129.0, -129.0, 3.046875, 0.0], INT8) == (
        [127.0, -127.0, 3.0, 0.0], 1.015625, [128.984375, -128.984375, 3.046875, 0.0]
    )


def test_fp8_e4m3_exact_codes_and_saturation_at_448():
    # amax 896 -> scale 2: 448, -0.5 and 1.5 are e4m3 values.
    assert round_trip([896.0, -1.0, 3.0, 0.0], E4M3) == (
        [448.0, -0.5, 1.5, 0.0], 2.0, [896.0, -1.0, 3.0, 0.0]
    )
    # 455.5 / 448 rounds to bf16 1.015625; 455.5 / 1.015625 = 448.49 is clipped to 448.
    assert round_trip([455.5, 0.0, 0.0, 0.0], E4M3) == (
        [448.0, 0.0, 0.0, 0.0], 1.015625, [455.0, 0.0, 0.0, 0.0]
    )


def test_fp8_e5m2_exact_codes():
    # amax 57344 * 4 -> scale 4; 57344 and -1.5 * ... are e5m2 values.
    assert round_trip([229376.0, -6.0, 0.25, 0.0], E5M2) == (
        [57344.0, -1.5, 0.0625, 0.0], 4.0, [229376.0, -6.0, 0.25, 0.0]
    )


@pytest.mark.parametrize("dtype", [INT8, E4M3, E5M2], ids=["int8", "e4m3", "e5m2"])
def test_a_zero_row_has_scale_zero_and_dequantizes_to_zeros(dtype):
    assert round_trip([0.0, 0.0, 0.0, 0.0], dtype) == ([0.0] * 4, 0.0, [0.0] * 4)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_non_finite_values_are_refused_before_they_reach_a_page(dtype, bad):
    name = dtype.name
    with pytest.raises(ValueError, match=rf"refusing to write a non-finite K/V value \({bad} at "
                                         rf"index \(1, 2\)\) to a {name} KV page"):
        kv_quant.quantize_checked(np.asarray([[1.0, 2.0, 3.0], [4.0, 5.0, bad]]), dtype)


def test_write_quantizes_each_row_into_its_slot_with_its_scale():
    pages = kv_quant.zeros((2, 3, 2, 4), INT8)  # 2 heads, 3 pages of 2 slots, head_dim 4
    new = np.zeros((2, 2, 4), np.float32)  # 2 tokens
    new[0, 0] = [254.0, -127.0, 0.5, 0.0]  # token 0, head 0: scale 2
    new[0, 1] = [1.0, 2.0, 3.0, 127.0]  # token 0, head 1: scale 1
    new[1, :] = [[12.7, 0, 0, 0], [-1.27, 0, 0, 0]]  # token 1: scales bf16(0.1), bf16(0.01)
    out = kv_quant.write(pages, jnp.asarray(new), jnp.asarray([5, 2], jnp.int32))  # p2 o1, p1 o0
    assert isinstance(out, QuantizedPages) and out.shape == (2, 3, 2, 4) and out.dtype == INT8
    data, scales = np.asarray(out.data), np.asarray(out.scales, np.float32)
    assert data[0, 2, 1].tolist() == [127, -64, 0, 0] and data[1, 2, 1].tolist() == [1, 2, 3, 127]
    assert data[0, 1, 0].tolist() == [127, 0, 0, 0] and data[1, 1, 0].tolist() == [-127, 0, 0, 0]
    assert scales[:, 2, 1].tolist() == [2.0, 1.0]
    want = [float(ml_dtypes.bfloat16(12.7 / 127)), float(ml_dtypes.bfloat16(1.27 / 127))]
    assert scales[:, 1, 0].tolist() == want
    written = {(2, 1), (1, 0)}
    for p in range(3):
        for o in range(2):
            if (p, o) not in written:  # every other slot is untouched
                assert not data[:, p, o].any() and not scales[:, p, o].any()


@pytest.mark.parametrize("dtype", [INT8, E4M3, E5M2, BF16], ids=["int8", "e4m3", "e5m2", "bf16"])
def test_pool_bits_write_and_read_the_same_bytes_as_the_pool(dtype):
    """kv_quant.PoolBits (a CPU step's view of a float8 or bfloat16 pool as integers):
    write, take and an index copy through the bits equal the same on the pool, byte for byte,
    and from_bits gives the pool back."""
    rng = np.random.default_rng(0)
    pages = kv_quant.zeros((2, 5, 4, 8), dtype)  # 2 heads, 5 pages of 4 slots, head_dim 8
    pages = kv_quant.write(
        pages,
        jnp.asarray(rng.normal(size=(9, 2, 8)), jnp.float32),
        jnp.arange(9, dtype=jnp.int32) + 3,
    )
    bits = kv_quant.to_bits(pages)
    assert isinstance(bits, kv_quant.PoolBits) and bits.dtype == dtype and bits.shape == pages.shape
    assert all(
        np.dtype(leaf.dtype).kind == "u" or leaf.dtype == INT8 for leaf in jax.tree.leaves(bits)
    )
    new, slots = jnp.asarray(rng.normal(size=(3, 2, 8)), jnp.float32), jnp.asarray([0, 17, 9])
    index = jnp.asarray([[4, 0], [2, 2]], jnp.int32)
    want, got = (
        kv_quant.write(pages, new, slots),
        kv_quant.from_bits(kv_quant.write(bits, new, slots)),
    )
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert g.dtype == w.dtype and np.asarray(g).tobytes() == np.asarray(w).tobytes()
    np.testing.assert_array_equal(
        kv_quant.take(kv_quant.to_bits(want), index), kv_quant.take(want, index)
    )
    copied = kv_quant.from_bits(jax.tree.map(lambda a: a.at[:, 1].set(a[:, 3]), bits))
    np.testing.assert_array_equal(kv_quant.take(copied, 1), kv_quant.take(pages, 3))
    assert kv_quant.to_bits(jnp.zeros((1, 2, 2, 2), jnp.float32)).dtype == np.float32  # as it is


def quantized(case, dtype):
    """The case's pools quantized (rows past the written ones hold NaN: scale NaN), and the
    same pools dequantized to float32."""
    kq = QuantizedPages(*kv_quant.quantize(case.k_pages, dtype))
    vq = QuantizedPages(*kv_quant.quantize(case.v_pages, dtype))
    return (kq, vq), tuple(kv_quant.dequantize(p.data, p.scales) for p in (kq, vq))


@pytest.mark.parametrize("dtype", [INT8, E4M3, E5M2], ids=["int8", "e4m3", "e5m2"])
def test_reference_over_quantized_pages_equals_it_over_their_dequantized_values(dtype):
    case = decode_case(0, lengths=[0, 1, 7, 8, 9, 32], num_kv_heads=2, group=4, page_size=8,
                       head_dim=64, dtype="float32")
    (kq, vq), (kd, vd) = quantized(case, dtype)
    args = (case.context_lens, case.page_table)
    got = reference.paged_decode_attention(case.q, kq, vq, *args, sm_scale=case.sm_scale)
    want = reference.paged_decode_attention(case.q, kd, vd, *args, sm_scale=case.sm_scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    assert np.all(np.asarray(got[0]) == 0.0) and np.isfinite(np.asarray(got)).all()
    # And close to the unquantized pages (how close is what the SmolLM2 tests measure).
    exact = reference.paged_decode_attention(case.q, case.k_pages, case.v_pages, *args,
                                             sm_scale=case.sm_scale)
    atol = {INT8: 0.05, E4M3: 0.15, E5M2: 0.3}[dtype]
    np.testing.assert_allclose(np.asarray(got), np.asarray(exact), atol=atol)

    pcase = prefill_case(1, seqs=[(9, 9), (20, 4), (5, 1)], num_kv_heads=2, group=4,
                         page_size=8, head_dim=64, dtype="float32")
    (kq, vq), (kd, vd) = quantized(pcase, dtype)
    args = (pcase.context_lens, pcase.page_table, pcase.query_start)
    got = reference.paged_prefill_attention(pcase.q, kq, vq, *args, sm_scale=pcase.sm_scale)
    want = reference.paged_prefill_attention(pcase.q, kd, vd, *args, sm_scale=pcase.sm_scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


def test_key_rotation_is_the_orthonormal_hadamard_matrix():
    h4 = 0.5 * np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]])
    np.testing.assert_array_equal(kv_quant.key_rotation(4), h4.astype(np.float32))
    for d in (64, 96, 80, 7):
        r = kv_quant.key_rotation(d).astype(np.float64)
        np.testing.assert_allclose(r @ r, np.eye(d), atol=1e-6)  # symmetric, its own inverse
        np.testing.assert_array_equal(r, r.T)
    # 96 = 3 x 32: three 32 x 32 blocks of +-1/sqrt(32) on the diagonal, zeros elsewhere.
    r96 = kv_quant.key_rotation(96)
    blocks = np.kron(np.eye(3), np.ones((32, 32))) > 0
    assert set(np.abs(r96[blocks]).tolist()) == {np.float32(1 / np.sqrt(32))}
    assert not r96[~blocks].any()
    np.testing.assert_array_equal(kv_quant.key_rotation(7), np.eye(7, dtype=np.float32))


@pytest.mark.parametrize("dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_rotated_keys_keep_every_logit_and_shrink_the_error_of_a_shared_offset(dtype):
    """Keys and queries sharing a large offset on 4 of 64 channels (q . k concentrated on a
    few channels): rotating both keeps every q . k, and the rms logit error of quantized
    keys is at least 1.5x smaller (here: int8 0.488 -> 0.170, e4m3 2.41 -> 1.22)."""
    rng = np.random.default_rng(0)
    k = rng.normal(size=(4096, 64)).astype(np.float32)
    q = rng.normal(size=(4096, 64)).astype(np.float32)
    offset = np.zeros(64, np.float32)
    offset[:4] = rng.uniform(10, 20, 4) * rng.choice([-1, 1], 4)
    k, q = k + offset, q + offset / 4
    exact = (q * k).sum(-1)
    qr, kr = kv_quant.rotate_keys(jnp.asarray(q)), kv_quant.rotate_keys(jnp.asarray(k))
    np.testing.assert_allclose(np.asarray((qr * kr).sum(-1)), exact, rtol=1e-4, atol=1e-3)

    def logit_error(q, k):
        back = kv_quant.dequantize(*kv_quant.quantize(k, dtype))
        return float(np.sqrt(np.mean((np.asarray((q * back).sum(-1)) - exact) ** 2)))

    plain, rotated = logit_error(jnp.asarray(q), jnp.asarray(k)), logit_error(qr, kr)
    assert rotated < plain / 1.5, (plain, rotated)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_forward_stores_rotated_keys_and_plain_values_in_quantized_pages(dtype):
    """models.llama.forward over a quantized pool: each of the first layer's K rows (whose
    inputs do not depend on the pool) dequantized and rotated back is the float32 pool's row
    to the dtype's rounding; its V rows are stored as they are."""
    from models.config import ModelConfig
    from models.llama import forward, init_params

    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    params = init_params(cfg, scale=0.3)
    shape = (cfg.num_kv_heads, cfg.num_layers * 4, 4, cfg.head_dim)  # 4 pages of 4 per layer
    n = 8
    args = (
        jnp.arange(3, 3 + n, dtype=jnp.int32),  # token ids
        jnp.arange(n, dtype=jnp.int32),  # positions
        jnp.arange(4, 4 + n, dtype=jnp.int32),  # slots: pages 1 and 2
        jnp.asarray([n], jnp.int32),
        jnp.asarray([[1, 2]], jnp.int32),
        jnp.asarray([0, n], jnp.int32),
    )
    run = jax.jit(forward, static_argnums=(1,))
    _, (k_f32, v_f32) = run(params, cfg, (jnp.zeros(shape), jnp.zeros(shape)), *args)
    storage = kv_quant.storage_dtype(dtype, np.float32)
    _, (k_q, v_q) = run(params, cfg, (kv_quant.zeros(shape, storage),) * 2, *args)
    first = slice(1, 3)  # layer 0's pages 1 and 2 (layer 1's are 5 and 6)
    k_stored = np.asarray(kv_quant.dequantize(k_q.data, k_q.scales))[:, first]
    v_stored = np.asarray(kv_quant.dequantize(v_q.data, v_q.scales))[:, first]
    k_ref, v_ref = np.asarray(k_f32)[:, first], np.asarray(v_f32)[:, first]
    rotation = kv_quant.key_rotation(cfg.head_dim)
    # Rounding bounds: half a step of the row's largest value (int8: 0.5 / 127), or a
    # relative 2**-4 (e4m3); the rotated row's error vector keeps its norm rotated back.
    step = {"int8": 0.5 / 127, "fp8": 2.0**-4}[dtype]
    for stored, ref, rot in ((k_stored, k_ref, rotation), (v_stored, v_ref, None)):
        amax = np.abs(ref @ rotation if rot is not None else ref).max(-1)
        back = stored @ rot if rot is not None else stored
        error = np.linalg.norm(back - ref, axis=-1)
        assert np.all(error <= step * amax * np.sqrt(cfg.head_dim) + 1e-6)
        assert np.abs(ref).min(-1).max() > 0  # rows were written
    # As stored, the keys are not the float32 pool's (they are rotated).
    assert np.abs(k_stored - k_ref).max() > np.abs(k_ref).max() / 2

"""Multi-head latent attention's paged attention (pallas_kernels/mla.py, reference.py latent):
the reference against a dense per-head softmax over the latent rows; the GPU (Triton) latent
decode kernel and the TPU (Mosaic) one in the Pallas interpreter against the reference, on
plain, int8 and fp8 (e4m3) pages, the dispatcher's choice, with head blocks and half rows of several power-of-two chunks; their
lowering for 'cuda' and 'tpu' at DeepSeek-V3's shape (128 heads, half row 288 = 256 + 32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_target import lower_for_cuda

import pallas_kernels
from pallas_kernels import kv_quant, mla, reference
from pallas_kernels.kv_quant import QuantizedPages

# DeepSeek-V3's decode operands: 8 sequences of up to 32 pages of 16, 128 heads, half row 288.
V3_DECODE = (
    jax.ShapeDtypeStruct((8, 128, 576), jnp.bfloat16),
    jax.ShapeDtypeStruct((1, 257, 16, 288), jnp.bfloat16),
    jax.ShapeDtypeStruct((1, 257, 16, 288), jnp.bfloat16),
    jax.ShapeDtypeStruct((8,), jnp.int32),
    jax.ShapeDtypeStruct((8, 32), jnp.int32),
)


def _case(seed, *, d=48, heads=20, page=4, lengths=(0, 7, 19), pages_per_seq=5):
    """Pools [1, N, page, d] NaN outside the written slots, queries [B, heads, 2d]."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    n = batch * pages_per_seq + 1
    table = rng.permutation(np.arange(1, n))[: batch * pages_per_seq].reshape(batch, -1)
    k = np.full((1, n, page, d), np.nan, np.float32)
    v = np.full((1, n, page, d), np.nan, np.float32)
    for b, length in enumerate(lengths):
        for t in range(length):
            k[0, table[b, t // page], t % page] = rng.normal(size=d)
            v[0, table[b, t // page], t % page] = rng.normal(size=d)
    q = rng.normal(size=(batch, heads, 2 * d)).astype(np.float32)
    args = (q, k, v, np.asarray(lengths, np.int32), table.astype(np.int32))
    return tuple(jnp.asarray(a) for a in args)


def test_the_reference_is_softmax_over_the_latent_rows():
    q, k, v, lengths, table = _case(0)
    out = np.asarray(reference.paged_decode_attention(q, k, v, lengths, table, sm_scale=0.1,
                                                      latent=True))  # fmt: skip
    page = k.shape[2]
    for b, length in enumerate(np.asarray(lengths)):
        if length == 0:
            np.testing.assert_array_equal(out[b], 0)
            continue
        t = np.arange(length)
        rows = np.concatenate([np.asarray(k)[0, np.asarray(table)[b, t // page], t % page],
                               np.asarray(v)[0, np.asarray(table)[b, t // page], t % page]], -1)
        s = np.asarray(q)[b] @ rows.T * 0.1  # [heads, length]
        p = np.exp(s - s.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ rows
        np.testing.assert_allclose(out[b], want, atol=2e-5, rtol=0)


def test_chunks_are_the_powers_of_two_of_the_half_row():
    assert mla._chunks(288) == ((0, 256), (256, 32))
    assert mla._chunks(48) == ((0, 32), (32, 16)) and mla._chunks(16) == ((0, 16),)
    assert mla.supports_gpu((4, 128, 576), (1, 9, 16, 288), jnp.bfloat16)
    assert not mla.supports_gpu((4, 128, 40), (1, 9, 16, 20), jnp.float32)  # 20 = 16 + 4


@pytest.mark.parametrize(("d", "heads", "page"), [(48, 20, 4), (16, 4, 8)])
def test_gpu_kernel_interpreted_equals_the_reference(d, heads, page):
    q, k, v, lengths, table = _case(1, d=d, heads=heads, page=page)
    want = reference.paged_decode_attention(q, k, v, lengths, table, sm_scale=0.1, latent=True)
    got = pallas_kernels.paged_decode_attention(q, k, v, lengths, table, sm_scale=0.1,
                                                interpret=True, latent=True)  # fmt: skip
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_gpu_kernel_on_int8_pages_equals_the_reference():
    q, k, v, lengths, table = _case(2)
    kq = QuantizedPages(*kv_quant.quantize(k, jnp.int8))
    vq = QuantizedPages(*kv_quant.quantize(v, jnp.int8))
    want = reference.paged_decode_attention(q, kq, vq, lengths, table, sm_scale=0.1, latent=True)
    got = mla.gpu_paged_decode_attention(q, kq, vq, lengths, table, sm_scale=0.1, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert np.abs(np.asarray(want)).max() > 0.1


def test_the_dispatcher_picks_the_latent_decode_kernels():
    """latent=True decode: the Triton kernel under interpret on a CPU host, the Mosaic one for
    'tpu', the reference for 'cpu' and for shapes the kernels refuse (a half row of 20, not
    a multiple of 16; pages of 4 on the TPU)."""

    def names(args, **kw):
        fn = lambda *a: pallas_kernels.paged_decode_attention(*a, sm_scale=0.1, latent=True, **kw)
        return str(jax.make_jaxpr(fn)(*args))

    args = _case(4, d=16, heads=4, page=8)
    assert "jpaged_gpu_mla_decode" in names(args, interpret=True)
    assert "jpaged_tpu_mla_decode" in names(args, interpret=True, backend="tpu")
    assert "mla_decode" not in names(args, backend="cpu")
    assert "mla_decode" not in names(_case(4, d=20, heads=4, page=8), interpret=True)
    assert "mla_decode" not in names(_case(4, d=16, heads=4, page=4), interpret=True, backend="tpu")


def test_both_kernels_on_fp8_pages_equal_the_reference():
    """fp8 (e4m3) pages, a small case (the kernels' fp8 and int8 paths differ only in the
    codes' dtype): the GPU and TPU kernels interpreted equal the reference."""
    q, k, v, lengths, table = _case(5, d=16, heads=4, page=8, lengths=(0, 11), pages_per_seq=2)
    k = QuantizedPages(*kv_quant.quantize(k, jnp.float8_e4m3fn))
    v = QuantizedPages(*kv_quant.quantize(v, jnp.float8_e4m3fn))
    want = reference.paged_decode_attention(q, k, v, lengths, table, sm_scale=0.1, latent=True)
    assert np.abs(np.asarray(want)).max() > 0.1
    for kernel in (mla.gpu_paged_decode_attention, mla.tpu_paged_decode_attention):
        got = kernel(q, k, v, lengths, table, sm_scale=0.1, interpret=True)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0, err_msg=kernel.__name__)


def test_gpu_kernel_lowers_for_cuda_at_deepseek_v3_shape():
    text = lower_for_cuda(mla.gpu_paged_decode_attention, V3_DECODE, sm_scale=0.1).as_text()
    assert "jpaged_gpu_mla_decode" in text and "triton" in text.lower()


@pytest.mark.parametrize("quantized", [False, True])
def test_tpu_kernel_interpreted_equals_the_reference(quantized):
    q, k, v, lengths, table = _case(3, d=48, heads=20, page=8)
    if quantized:
        k = QuantizedPages(*kv_quant.quantize(k, jnp.int8))
        v = QuantizedPages(*kv_quant.quantize(v, jnp.int8))
    want = reference.paged_decode_attention(q, k, v, lengths, table, sm_scale=0.1, latent=True)
    got = pallas_kernels.paged_decode_attention(q, k, v, lengths, table, sm_scale=0.1,
                                                backend="tpu", interpret=True, latent=True)  # fmt: skip
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_tpu_kernel_lowers_for_tpu_at_deepseek_v3_shape():
    lowered = jax.jit(lambda *a: mla.tpu_paged_decode_attention(*a, sm_scale=0.1)).trace(*V3_DECODE)
    text = lowered.lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "jpaged_tpu_mla_decode" in text

"""Multi-head latent attention's ragged prefill kernels (pallas_kernels/mla_prefill.py): the
GPU (Triton) and TPU (Mosaic) kernels in the Pallas interpreter against the reference
(reference.paged_prefill_attention, latent=True) on NaN-filled pools, over several page
sizes, chunks starting mid-page after a prefix hit, whole prompts, decode tokens and padding
rows, on plain, int8 and fp8 (e4m3) pages; the dispatcher's choice; their lowering for 'cuda' (an
abstract H200) and 'tpu' at DeepSeek-V3's shape (128 heads, half row 288 = 256 + 32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_target import lower_for_cuda
from paged_cases import prefill_case, prefill_specs

import pallas_kernels
from pallas_kernels import kv_quant, mla_prefill, reference
from pallas_kernels.kv_quant import QuantizedPages

# (context length, query tokens) per sequence: a chunk starting mid-page after a prefix hit,
# a whole prompt, a decode token, a chunk of a page's width starting mid-page, an empty one.
SEQS = [(13, 6), (7, 7), (20, 1), (19, 8), (0, 0)]

# DeepSeek-V3's prefill operands: 256 tokens of 8 sequences, up to 32 pages of 16 each.
V3_PREFILL = prefill_specs(256, 8, 32, 128, 1, 288, 16, 257, "bfloat16")
V3_PREFILL = (jax.ShapeDtypeStruct((256, 128, 576), jnp.bfloat16), *V3_PREFILL[1:])


def _case(seed, *, d, heads, page, seqs=SEQS, quantized=None):
    """(q [T, heads, 2d], k, v, context_lens, page_table, query_start): pools [1, N, page, d]
    NaN outside the written slots (paged_cases.make_pool), 3 padding query rows."""
    c = prefill_case(seed, seqs=seqs, num_kv_heads=1, group=heads, page_size=page,
                     head_dim=d, dtype=jnp.float32)  # fmt: skip
    rng = np.random.default_rng(seed + 100)
    q = jnp.asarray(rng.standard_normal((c.q.shape[0], heads, 2 * d)), jnp.float32)
    k, v = c.k_pages, c.v_pages
    if quantized is not None:  # the pages' dtype
        k = QuantizedPages(*kv_quant.quantize(k, quantized))
        v = QuantizedPages(*kv_quant.quantize(v, quantized))
    return q, k, v, c.context_lens, c.page_table, c.query_start


def _check(got, want, num_real_tokens):
    got, want = np.asarray(got), np.asarray(want)
    assert np.all(np.isfinite(got)) and np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(got[num_real_tokens:], 0)  # padding rows


# Page 8 (d 16, 4 heads) runs in test_the_dispatcher_picks_the_latent_prefill_kernels.
@pytest.mark.parametrize(("d", "heads", "page"), [(48, 20, 4), (32, 3, 16)])
def test_gpu_kernel_interpreted_equals_the_reference(d, heads, page):
    args = _case(1, d=d, heads=heads, page=page)
    want = reference.paged_prefill_attention(*args, sm_scale=0.1, latent=True)
    got = mla_prefill.gpu_paged_prefill_attention(*args, sm_scale=0.1, interpret=True)
    _check(got, want, int(args[-1][-1]))


def test_gpu_kernel_on_int8_pages_equals_the_reference():
    args = _case(2, d=16, heads=4, page=4, quantized=jnp.int8)
    want = reference.paged_prefill_attention(*args, sm_scale=0.1, latent=True)
    got = mla_prefill.gpu_paged_prefill_attention(*args, sm_scale=0.1, interpret=True)
    _check(got, want, int(args[-1][-1]))


def test_tpu_kernel_on_int8_pages_interpreted_equals_the_reference():
    """(Plain pages of 8: the dispatcher's test and the race test.)"""
    args = _case(3, d=16, heads=4, page=16, quantized=jnp.int8)
    want = reference.paged_prefill_attention(*args, sm_scale=0.1, latent=True)
    got = mla_prefill.tpu_paged_prefill_attention(*args, sm_scale=0.1, interpret=True)
    _check(got, want, int(args[-1][-1]))


def test_both_kernels_on_fp8_pages_equal_the_reference():
    """fp8 (e4m3) pages (the kernels' fp8 and int8 paths differ only in the codes' dtype):
    the GPU and TPU kernels interpreted equal the reference."""
    seqs = [(13, 6), (7, 7)]  # a chunk starting mid-page after a prefix hit, a whole prompt
    args = _case(6, d=16, heads=4, page=8, seqs=seqs, quantized=jnp.float8_e4m3fn)
    want = reference.paged_prefill_attention(*args, sm_scale=0.1, latent=True)
    for kernel in (mla_prefill.gpu_paged_prefill_attention, mla_prefill.tpu_paged_prefill_attention):
        _check(kernel(*args, sm_scale=0.1, interpret=True), want, int(args[-1][-1]))


def _kernel_names(fn, *args):
    return {str(e.params.get("name")) for e in jax.make_jaxpr(fn)(*args).eqns}


def test_the_dispatcher_picks_the_latent_prefill_kernels():
    """latent=True prefill: the Triton kernel under interpret on a CPU host and for 'gpu',
    the Mosaic one for 'tpu' (pages of a multiple of 8), the reference for 'cpu' and for
    a page size the TPU kernel refuses; the results equal the reference's."""
    args = _case(4, d=16, heads=4, page=8)
    want = reference.paged_prefill_attention(*args, sm_scale=0.1, latent=True)

    def run(**kw):
        return lambda *a: pallas_kernels.paged_prefill_attention(*a, sm_scale=0.1, latent=True,
                                                                 max_query_len=8, **kw)

    for kw, name in [({"interpret": True}, "jpaged_gpu_mla_prefill"),
                     ({"interpret": True, "backend": "tpu"}, "jpaged_tpu_mla_prefill")]:
        assert name in str(jax.make_jaxpr(run(**kw))(*args))
        _check(run(**kw)(*args), want, int(args[-1][-1]))
    assert "mla_prefill" not in str(jax.make_jaxpr(run(backend="cpu"))(*args))
    odd = _case(4, d=16, heads=4, page=4)
    assert "mla_prefill" not in str(jax.make_jaxpr(run(backend="tpu", interpret=True))(*odd))


def test_gpu_kernel_lowers_for_cuda_at_deepseek_v3_shape():
    text = lower_for_cuda(mla_prefill.gpu_paged_prefill_attention, V3_PREFILL,
                          sm_scale=0.1).as_text()  # fmt: skip
    assert "jpaged_gpu_mla_prefill" in text and "triton" in text.lower()


@pytest.mark.parametrize("quantized", [False, True])
def test_tpu_kernel_lowers_for_tpu_at_deepseek_v3_shape(quantized):
    args = V3_PREFILL
    if quantized:  # int8 codes and a bfloat16 scale per token and half row
        def pool(a):
            return QuantizedPages(jax.ShapeDtypeStruct(a.shape, jnp.int8),
                                  jax.ShapeDtypeStruct(a.shape[:-1], kv_quant.SCALE_DTYPE))

        args = (args[0], pool(args[1]), pool(args[2]), *args[3:])
    fn = jax.jit(lambda *a: mla_prefill.tpu_paged_prefill_attention(*a, sm_scale=0.1))
    text = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "jpaged_tpu_mla_prefill" in text


def test_block_choices():
    gpu = mla_prefill.gpu_blocks(num_tokens=256, num_q_heads=128, page_size=16, pages_per_seq=32)
    assert (gpu.head_rows, gpu.block_q, gpu.pages_per_block) == (16, 1, 2)
    gpu = mla_prefill.gpu_blocks(num_tokens=9, num_q_heads=3, page_size=64, pages_per_seq=4)
    assert (gpu.head_rows, gpu.block_q, gpu.pages_per_block) == (4, 4, 1)
    tpu = mla_prefill.tpu_blocks(num_tokens=9, num_q_heads=3, page_size=8, pages_per_seq=2)
    assert (tpu.head_rows, tpu.block_q, tpu.pages_per_block) == (4, 16, 2)
    with pytest.raises(ValueError, match="block_q must be >= 1, got 0"):
        mla_prefill.LatentPrefillBlocks(head_rows=4, block_q=0, pages_per_block=1)


def test_tpu_kernel_has_no_races_under_the_interpreters_dma_model():
    """The Mosaic kernel in the TPU interpreter that models DMAs, semaphores and two cores
    (copies land when waited for; the race detector on): the reference's result, no race."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from jax.experimental.pallas import tpu as pltpu

    args = _case(5, d=16, heads=4, page=8)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait",
                                   num_cores_or_threads=2)  # fmt: skip
    got = mla_prefill.tpu_paged_prefill_attention(*args, sm_scale=0.1, interpret=params)
    _check(got, reference.paged_prefill_attention(*args, sm_scale=0.1, latent=True),
           int(args[-1][-1]))  # fmt: skip
    assert interpret_pallas_call.races.races_found is False

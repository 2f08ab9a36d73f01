"""Attention sinks (gpt-oss: a learned logit per query head that joins every softmax's
denominator and contributes no value) in the reference and in every kernel.

The reference is held to a dense numpy softmax over [scores, sink] (decode, ragged prefill
with a sliding window, and the grouped path of max_query_len); the GPU and TPU kernels in
interpret mode to the reference with sinks of both signs, GQA so that a wrong head order
shows, and NaN-filled pools (paged_cases); and they lower for 'cuda' and 'tpu' with the
sink input. Without sinks the kernels trace the programs they traced before (the sinks are an
optional input, None for every other family).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_target import lower_for_cuda
from paged_cases import check, decode_case, decode_specs, prefill_case, prefill_specs, spec

import pallas_kernels
from pallas_kernels import gpu_decode, gpu_prefill, reference, tpu_decode, tpu_prefill, tuning

SINKS = np.array([2.0, -1.0, 0.5, 4.0], np.float32)  # 4 query heads: 2 KV heads x group 2


def _dense(q, k_pages, v_pages, context_lens, page_table, query_start, sm_scale, sinks,
           window=None):
    """softmax([scores, sink]) @ [V, 0] per token and head, in float64 numpy."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    table, ctx, qs = (np.asarray(a) for a in (page_table, context_lens, query_start))
    page_size = k.shape[2]
    group = q.shape[1] // k.shape[0]
    out = np.zeros_like(q)
    for s in range(len(ctx)):
        n = int(ctx[s])
        if n == 0:
            continue  # sees nothing: zeros
        slots = [(table[s, t // page_size], t % page_size) for t in range(n)]
        keys = np.stack([k[:, p, o] for p, o in slots], 1) if n else None  # [Hkv, n, D]
        vals = np.stack([v[:, p, o] for p, o in slots], 1) if n else None
        for row in range(int(qs[s]), int(qs[s + 1])):
            pos = n - (int(qs[s + 1]) - row)
            for h in range(q.shape[1]):
                scores = keys[h // group] @ q[row, h] * sm_scale
                seen = np.arange(n) <= pos
                if window is not None:
                    seen &= np.arange(n) > pos - window
                logits = np.append(scores[seen], sinks[h])
                p = np.exp(logits - logits.max())
                out[row, h] = (p[:-1] / p.sum()) @ vals[h // group][seen]
    return out


def _prefill(dtype="float32"):
    seqs = [(5, 0), (1, 1), (7, 7), (9, 2), (20, 1), (19, 13)]
    return prefill_case(3, seqs=seqs, num_kv_heads=2, group=2, page_size=8, head_dim=16,
                        dtype=dtype)  # fmt: skip


def _args(case):
    return (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table,
            case.query_start)  # fmt: skip


def test_reference_prefill_and_grouped_path_equal_a_dense_softmax_with_sinks():
    case, window = _prefill(), 5
    want = _dense(*_args(case), case.sm_scale, SINKS, window)
    kw = {"sm_scale": case.sm_scale, "sliding_window": window, "sinks": jnp.asarray(SINKS)}
    out = reference.paged_prefill_attention(*_args(case), **kw)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=0)
    grouped = reference.paged_prefill_attention(*_args(case), max_query_len=13, **kw)
    np.testing.assert_allclose(np.asarray(grouped), want, atol=2e-6, rtol=0)
    plain = reference.paged_prefill_attention(*_args(case), sm_scale=case.sm_scale,
                                              sliding_window=window)  # fmt: skip
    assert np.abs(np.asarray(plain) - want).max() > 1e-2  # the sinks matter here


def test_reference_decode_equals_a_dense_softmax_with_sinks():
    case = decode_case(1, lengths=[0, 1, 7, 8, 9, 32], num_kv_heads=2, group=2, page_size=8,
                       head_dim=16, dtype="float32")  # fmt: skip
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    out = reference.paged_decode_attention(*args, sm_scale=case.sm_scale,
                                           sinks=jnp.asarray(SINKS))  # fmt: skip
    qs = np.arange(len(case.context_lens) + 1)
    want = _dense(*args, qs, case.sm_scale, SINKS)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)  # length 0: zeros


DECODE = {
    "gpu": functools.partial(gpu_decode.paged_decode_attention, interpret=True,
                             blocks=tuning.DecodeBlocks(group_rows=16, pages_per_block=1,
                                                        num_splits=2)),
    "tpu": functools.partial(tpu_decode.paged_decode_attention, interpret=True),
}  # fmt: skip
PREFILL = {
    "gpu": functools.partial(gpu_prefill.paged_prefill_attention, interpret=True),
    "tpu": functools.partial(tpu_prefill.paged_prefill_attention, interpret=True),
}


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_decode_kernels_with_sinks_equal_the_reference(impl):
    """The GPU kernel over 2 splits (the sinks join in the merge), the TPU one in-kernel."""
    case = decode_case(2, lengths=[0, 1, 9, 24], num_kv_heads=2, group=2, page_size=8,
                       head_dim=16, dtype="float32")  # fmt: skip
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    kw = {"sm_scale": case.sm_scale, "sliding_window": 10, "sinks": jnp.asarray(SINKS)}
    check(DECODE[impl](*args, **kw), reference.paged_decode_attention(*args, **kw))


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_prefill_kernels_with_sinks_equal_the_reference(impl):
    case = _prefill()
    kw = {"sm_scale": case.sm_scale, "sliding_window": 5, "sinks": jnp.asarray(SINKS)}
    out = PREFILL[impl](*_args(case), **kw)
    check(out, reference.paged_prefill_attention(*_args(case), **kw))
    pad = int(case.query_start[-1])
    np.testing.assert_array_equal(np.asarray(out[pad:]), 0.0)  # padding rows


def _lowered(fn, args, platform, **kwargs):
    if platform == "cuda":
        return lower_for_cuda(fn, args, sm_scale=0.125, **kwargs).as_text()
    f = lambda *a: fn(*a, sm_scale=0.125, **kwargs)
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize(
    ("fn", "platform", "name"),
    [(gpu_decode.paged_decode_attention, "cuda", "jpaged_gpu_decode"),
     (gpu_prefill.paged_prefill_attention, "cuda", "jpaged_gpu_prefill"),
     (tpu_decode.paged_decode_attention, "tpu", "jpaged_tpu_decode"),
     (tpu_prefill.paged_prefill_attention, "tpu", "jpaged_tpu_prefill")],
)  # fmt: skip
def test_kernels_with_sinks_lower_and_without_them_take_no_sink_input(fn, platform, name):
    """bfloat16, 64 query heads over 8 KV heads (gpt-oss's), a 128-token window."""
    decode = "decode" in name
    args = (decode_specs(8, 16, 64, 8, 64, 16, 129, "bfloat16") if decode
            else prefill_specs(64, 4, 16, 64, 8, 64, 16, 65, "bfloat16"))  # fmt: skip
    with_sinks = _lowered(
        lambda *a, **kw: fn(*a[:-1], sinks=a[-1], **kw), (*args, spec((64,), "float32")),
        platform, sliding_window=128,
    )  # fmt: skip
    without = _lowered(fn, args, platform, sliding_window=128)
    assert name in with_sinks and name in without
    assert with_sinks != without
    assert "tensor<64xf32>" in with_sinks and "tensor<64xf32>" not in without


def test_dispatcher_passes_sinks_to_the_kernel_it_picks():
    """pallas_interpret (the GPU kernel in the interpreter) with sinks gives the reference's
    result, prefill and decode."""
    case = _prefill()
    kw = {"sm_scale": case.sm_scale, "sliding_window": 5, "sinks": jnp.asarray(SINKS)}
    check(pallas_kernels.paged_prefill_attention(*_args(case), interpret=True, **kw),
          reference.paged_prefill_attention(*_args(case), **kw))  # fmt: skip


def test_gpu_prefill_with_sinks_compiles_for_sm90_within_the_limits():
    """The one Triton kernel the sinks change (decode's join in the merge, outside it):
    gpt-oss's shape in bfloat16 at the engine's largest prefill bucket, compiled for sm_90
    with the triton package: shared memory and registers within an H100's, no spills."""
    from gpu_target import compile_sm90, triton_calls

    args = (*prefill_specs(512, 32, 128, 64, 8, 64, 16, 4097, "bfloat16"),
            spec((64,), "float32"))  # fmt: skip
    lowered = lower_for_cuda(
        lambda *a, **kw: gpu_prefill.paged_prefill_attention(*a[:-1], sinks=a[-1], **kw),
        args, sm_scale=0.125, sliding_window=128,
    )  # fmt: skip
    (call,) = triton_calls(lowered)
    kernel = compile_sm90(call)
    kernel.check_limits()
    assert kernel.spill_stores == kernel.spill_loads == 0

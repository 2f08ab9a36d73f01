"""The CPU's paged attention kernel (pallas_kernels/cpu_kernel.py, cpu_paged_attention.cc):
every token of a float32 step on the CPU (prefill chunks in tiles of a sequence's consecutive
tokens, decode rows one by one) reads its pages in place through it. Held to the dense
float64 oracle of test_reference on NaN-filled pools (a slot read outside a row's keys would
show) through each of its code paths (page size 16 with the K page transposed for a tile, any
other page size; head_dim 64 and 128 with the values' sums in registers, any other), beside
the reference's gather path it replaces, and kept off the GPU's lowering
(lax.platform_dependent)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_target import lower_for_cuda
from paged_cases import decode_case, prefill_case
from test_reference import MIXED, assert_matches, run
from test_sinks import SINKS, _dense

from pallas_kernels import cpu_kernel, kv_quant, reference

LENGTHS = [1, 0, 17, 64, 5, 33, 48, 2, 90, 3, 0, 7, 61, 12, 1, 29,
           44, 8, 100, 0, 15, 6, 77, 21, 2, 38, 9, 55, 4, 0, 70, 11]  # fmt: skip


@pytest.fixture
def gather_path(monkeypatch):
    """The reference's own gather path (the kernel reported unavailable)."""
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)


def _kernel_calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count(cpu_kernel.TARGET)


def test_the_kernel_builds_here_and_serves_float32_steps():
    assert cpu_kernel.available()
    case = decode_case(1, lengths=LENGTHS, num_kv_heads=2, group=2, page_size=4, head_dim=16,
                       dtype="float32")
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)

    def decode(*a):
        return reference.paged_decode_attention(*a, sm_scale=case.sm_scale)

    assert _kernel_calls(decode, *args) == 1
    bf16 = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args]
    assert _kernel_calls(decode, *bf16) == 0  # bfloat16 pools: the gather path
    case = prefill_case(1, seqs=MIXED, num_kv_heads=2, group=2, page_size=16, head_dim=16,
                        dtype="float32")

    def prefill(*a):
        return reference.paged_prefill_attention(*a, sm_scale=case.sm_scale)

    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table,
            case.query_start)
    assert _kernel_calls(prefill, *args) == 1  # one call for every token of the step
    def verify(*a):  # max_query_len (a verification step): the kernel serves it too
        return reference.paged_prefill_attention(*a, sm_scale=case.sm_scale, max_query_len=5)

    assert _kernel_calls(verify, *args) == 1


# Prompts and chunks of several tiles (40 query tokens: tiles of 16, 16 and 8), decode rows,
# a row with no query tokens, chunks continuing a prefix, contexts over several pages.
TILES = [(40, 40), (5, 0), (1, 1), (7, 7), (12, 2), (70, 33), (9, 3), (30, 1), (23, 13),
         (18, 17), (3, 3), (33, 1)]


@pytest.mark.parametrize(
    "kwargs", [{}, {"sliding_window": 6}, {"soft_cap": 2.0}, {"sliding_window": 1}]
)
@pytest.mark.parametrize(
    "shape",
    [(3, 3, 16, 64),  # SmolLM2's heads: K transposed for a tile, values in 4 vectors
     (2, 4, 16, 128),  # values in 8 vectors
     (1, 2, 16, 32),  # page 16, other head_dim
     (2, 3, 8, 64),  # other page size
     (1, 1, 16, 64)],  # a group of one: tiles of 16 rows
)
def test_prefill_tiles_match_dense(shape, kwargs):
    hkv, group, page_size, head_dim = shape
    for pad in (0, 5):
        case = prefill_case(9, seqs=TILES, num_kv_heads=hkv, group=group, page_size=page_size,
                            head_dim=head_dim, dtype="float32", pad_tokens=pad)
        assert_matches(case, **kwargs)


def test_prefill_kernel_equals_the_gather_path_it_replaces(monkeypatch):
    case = prefill_case(10, seqs=TILES, num_kv_heads=3, group=3, page_size=16, head_dim=64,
                        dtype="float32")
    kernel = np.asarray(run(case, sliding_window=20))
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    np.testing.assert_allclose(kernel, np.asarray(run(case, sliding_window=20)), rtol=2e-6,
                               atol=2e-6)


@pytest.mark.parametrize("window", [None, 7])
def test_sinks_match_a_dense_softmax_with_sinks(window):
    """gpt-oss's sinks join each row's denominator in the kernel as in the reference."""
    case = prefill_case(11, seqs=TILES, num_kv_heads=2, group=2, page_size=16, head_dim=64,
                        dtype="float32")
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table,
            case.query_start)
    fn = jax.jit(lambda *a: reference.paged_prefill_attention(
        *a, sm_scale=case.sm_scale, sliding_window=window, sinks=jnp.asarray(SINKS)))
    assert fn.lower(*args).as_text().count(cpu_kernel.TARGET) == 1
    want = _dense(*[np.asarray(a) for a in args], case.sm_scale, np.asarray(SINKS),
                  window=window)
    np.testing.assert_allclose(np.asarray(fn(*args)), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "kwargs", [{}, {"sliding_window": 6}, {"soft_cap": 2.0}, {"sliding_window": 1}]
)
@pytest.mark.parametrize("shape", [(2, 2, 4, 16), (1, 4, 16, 8), (3, 1, 8, 64)])
def test_decode_rows_match_dense(shape, kwargs):
    """32 rows of mixed lengths (padding rows of length 0 among them): kv heads, group,
    page size and head_dim varied; windows and soft capping."""
    hkv, group, page_size, head_dim = shape
    case = decode_case(2, lengths=LENGTHS, num_kv_heads=hkv, group=group, page_size=page_size,
                       head_dim=head_dim, dtype="float32")
    assert_matches(case, **kwargs)


def test_one_token_and_mixed_blocks_match_dense():
    """A lone decode row (the CPU's (1, 1) program) and a ragged step whose blocks mix
    prefill chunks (the gather path) with decode rows (the kernel)."""
    assert_matches(decode_case(3, lengths=[37], num_kv_heads=3, group=3, page_size=16,
                               head_dim=64, dtype="float32"))
    seqs = [(5, 0), (1, 1), (7, 7), (12, 2), (9, 3), (30, 1), (23, 13), (40, 40), (33, 1)]
    case = prefill_case(4, seqs=seqs, num_kv_heads=2, group=2, page_size=4, head_dim=16,
                        dtype="float32")
    assert_matches(case)
    assert_matches(case, sliding_window=5)


def test_the_kernel_equals_the_gather_path_it_replaces(monkeypatch):
    case = decode_case(5, lengths=LENGTHS, num_kv_heads=3, group=3, page_size=16, head_dim=64,
                       dtype="float32", pages_per_seq=16)
    kernel = np.asarray(run(case))
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    np.testing.assert_allclose(kernel, np.asarray(run(case)), rtol=2e-6, atol=2e-6)


def test_the_gather_path_still_matches_dense(gather_path):
    case = decode_case(6, lengths=LENGTHS, num_kv_heads=2, group=2, page_size=4, head_dim=16,
                       dtype="float32")
    assert_matches(case)
    assert_matches(case, sliding_window=6)


def test_jpaged_cpu_attention_reference_turns_it_off(monkeypatch):
    assert cpu_kernel.available()
    monkeypatch.setenv(cpu_kernel.ENV, "reference")
    assert not cpu_kernel.available()
    case = decode_case(8, lengths=[9, 30], num_kv_heads=2, group=2, page_size=4, head_dim=16,
                       dtype="float32")
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    assert _kernel_calls(
        lambda *a: reference.paged_decode_attention(*a, sm_scale=case.sm_scale), *args
    ) == 0


def test_a_failed_build_is_a_warning_and_the_gather_path(monkeypatch, tmp_path, caplog):
    """_registered's body (the process's own registration untouched) with no compiler:
    False, one warning, nothing half written in the cache directory."""
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_kernel._registered.__wrapped__() is False
    assert "CPU attention kernel unavailable" in caplog.text
    assert not list(tmp_path.rglob("*.so*"))


def test_lowered_for_cuda_the_step_holds_no_cpu_kernel_call():
    case = decode_case(7, lengths=[9, 30, 4, 17], num_kv_heads=2, group=2, page_size=4,
                       head_dim=16, dtype="float32")
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)

    def decode(*a):
        return reference.paged_decode_attention(*a, sm_scale=case.sm_scale)

    assert _kernel_calls(decode, *args) == 1  # on the CPU
    assert cpu_kernel.TARGET not in lower_for_cuda(decode, args).as_text()


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("form", ["pages", "bits"])
def test_quantized_pools_equal_the_gather_path(monkeypatch, dtype, form):
    """One-byte pools with bfloat16 row scales (kv_quant.QuantizedPages, or PoolBits as a
    CPU step holds them): each page's rows dequantized by the kernel, the gather path's
    values; a prefill step of several tiles and decode rows, rows past the written ones NaN
    (their scales NaN)."""
    store = kv_quant.storage_dtype(dtype, np.float32)
    case = prefill_case(14, seqs=TILES, num_kv_heads=3, group=3, page_size=16, head_dim=64,
                        dtype="float32")
    k, v = (kv_quant.QuantizedPages(*kv_quant.quantize(p, store))
            for p in (case.k_pages, case.v_pages))
    if form == "bits":
        k, v = kv_quant.to_bits(k), kv_quant.to_bits(v)
    args = (case.q, k, v, case.context_lens, case.page_table, case.query_start)

    def attend(*a):
        return reference.paged_prefill_attention(*a, sm_scale=case.sm_scale, sliding_window=40)

    text = jax.jit(attend).lower(*args).as_text()
    assert cpu_kernel.QUANTIZED_TARGET in text
    kernel = np.asarray(jax.jit(attend)(*args))
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    gather = np.asarray(jax.jit(lambda *a: attend(*a))(*args))
    assert np.isfinite(kernel).all()
    np.testing.assert_allclose(kernel, gather, rtol=2e-6, atol=2e-6)


# The suite holds XLA:CPU to one thread (tests/conftest.py), so the kernels' items run on the
# calling thread alone there. In a process of XLA's default threading they are shared with
# tasks on XLA's intra-op pool: the same cases, the dense oracle's values (attention), jnp's
# argmax (sampling), float64 products (matmul, over two blocks of 240 rows).
POOL_SCRIPT = """
import sys
sys.path[:0] = sys.argv[1:]
import jax.numpy as jnp, numpy as np
from paged_cases import decode_case, prefill_case
from test_cpu_kernel import LENGTHS, TILES
from test_reference import assert_matches
from test_sampler_ops import rows_with_ties_and_specials
from jpaged.sample.sampler import _vocab_passes
from pallas_kernels import cpu_kernel
assert cpu_kernel.threads() >= 2, cpu_kernel.threads()
assert_matches(prefill_case(12, seqs=TILES * 3, num_kv_heads=3, group=3, page_size=16,
                            head_dim=64, dtype="float32"), sliding_window=30)
assert_matches(decode_case(13, lengths=LENGTHS, num_kv_heads=3, group=3, page_size=16,
                           head_dim=64, dtype="float32"))
x = rows_with_ties_and_specials(0, 5000)
argmax, _, _ = _vocab_passes(jnp.asarray(x), jnp.asarray(x))
np.testing.assert_array_equal(np.asarray(argmax), np.asarray(jnp.argmax(jnp.asarray(x), -1)))
rng = np.random.default_rng(5)
xm, wm = rng.standard_normal((300, 96), np.float32), rng.standard_normal((96, 320), np.float32)
got = np.asarray(cpu_kernel.matmul(jnp.asarray(xm), jnp.asarray(cpu_kernel.pack(wm))))
np.testing.assert_allclose(got, xm.astype(np.float64) @ wm, rtol=1e-4, atol=1e-4)
print("pool ok")
"""


def test_the_kernels_share_their_items_with_xlas_pool():
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    done = subprocess.run(
        [sys.executable, "-c", POOL_SCRIPT, str(here), str(here.parent / "jpaged" / "sample"),
         str(here.parents[1])],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert done.returncode == 0 and "pool ok" in done.stdout, done.stderr[-2000:]

"""The GPU kernels compiled for a real GPU (not interpreted) against the reference, and the
engine's greedy tokens through them. Selected with `pytest -m gpu` on a machine with a GPU
(scripts/gpu_session.sh runs them first); deselected everywhere else.

Same inputs as the interpret-mode tests (NaN pools, shuffled page tables, edge lengths),
plus shapes of real models (head_dim 128, GQA 4, bf16), compared per element.

In order of value, because device time is short and pytest runs a file top to bottom: the
engine's greedy tokens through the kernels, then bfloat16 (what the engine runs on a GPU)
decode and prefill, the Mosaic GPU decode kernel, then float32 (full-precision dots).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import check, decode_case, prefill_case

import pallas_kernels
from pallas_kernels import reference

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a GPU; jax's default backend here is {jax.default_backend()!r}")


def test_engine_greedy_tokens_same_with_kernels_and_reference(tmp_path):
    from numpy_checkpoints import make_llama_checkpoint

    from jpaged import LLM, SamplingParams

    path = make_llama_checkpoint(tmp_path / "ckpt", hidden=256, heads=4, kv_heads=2)
    prompts = [[7], [3, 9, 27, 81, 243], list(range(100, 119)), list(range(500, 600))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "pallas"):
        llm = LLM(
            str(path),
            dtype="float32",
            attention_backend=backend,
            max_num_seqs=4,
            max_model_len=160,
            max_num_batched_tokens=32,
            page_size=16,
            num_pages=64,
        )
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["pallas"] == tokens["reference"]


def run_decode_at_the_pool_end(num_pages: int, dtype: str, **kwargs):
    """Two sequences of 3 and 4 pages at the last 8 pages of a zero pool [2, num_pages, 16,
    128] (int8: kv_quant.QuantizedPages), decoded by the dispatcher and by the reference;
    returns the pool's bytes per half."""
    from pallas_kernels import kv_quant

    hkv, page_size, head_dim, group = 2, 16, 128, 4
    rng = np.random.default_rng(0)
    shape = (hkv, num_pages, page_size, head_dim)
    last = np.arange(num_pages - 8, num_pages)
    vals = [rng.normal(size=(hkv, 8, page_size, head_dim)).astype(np.float32) for _ in "kv"]
    if dtype == "int8":
        pools = [
            jax.tree.map(lambda a, b: a.at[:, last].set(b), kv_quant.zeros(shape, np.int8),
                         kv_quant.QuantizedPages(*kv_quant.quantize(jnp.asarray(x), np.int8)))
            for x in vals
        ]  # fmt: skip
        q_dtype, nbytes = jnp.bfloat16, math.prod(shape)
    else:
        pools = [jnp.zeros(shape, dtype).at[:, last].set(x.astype(dtype)) for x in vals]
        q_dtype, nbytes = jnp.dtype(dtype), math.prod(shape) * jnp.dtype(dtype).itemsize
    q = jnp.asarray(rng.normal(size=(2, hkv * group, head_dim)), q_dtype)
    table = jnp.asarray([[*last[:3], 0], last[3:7]], jnp.int32)
    lengths = jnp.asarray([3 * page_size - 5, 4 * page_size], jnp.int32)
    args = (q, *pools, lengths, table)
    out = jax.jit(lambda *a: pallas_kernels.paged_decode_attention(*a, sm_scale=0.1, **kwargs))(
        *args
    )
    check(out, reference.paged_decode_attention(*args, sm_scale=0.1))
    return nbytes


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_decode_kernel_reads_pages_past_4_gib(dtype):
    """A pool half over 4 GiB, as an accelerator's default pool is (one array of every
    layer's pages): the Triton kernel, which Pallas addresses with int64 offsets there
    (gpu_decode.offsets_fit; test_sm90_compile.py reads them), reads the pool's last pages as
    the reference does. About 9 GiB of device memory for bfloat16, 4.5 GiB for int8."""
    from pallas_kernels import gpu_decode

    itemsize = 1 if dtype == "int8" else 2
    num_pages = 2**32 // itemsize // (2 * 16 * 128) + 64
    shape = (2, num_pages, 16, 128)
    assert gpu_decode.offsets_fit(shape, jnp.dtype(dtype))
    assert pallas_kernels.select_backend(
        (2, 8, 128), shape, jnp.dtype(dtype), interpret=False, backend=None
    ) == "gpu"
    assert run_decode_at_the_pool_end(num_pages, dtype) > 2**32


def edge_lengths(page_size, pages_per_seq):
    full = page_size * pages_per_seq
    return [0, 1, page_size - 1, page_size, page_size + 1, full - 1, full]


def run_decode(page_size, head_dim, dtype, num_kv_heads, group, **kwargs):
    case = decode_case(
        page_size,
        lengths=edge_lengths(page_size, 6),
        num_kv_heads=num_kv_heads,
        group=group,
        page_size=page_size,
        head_dim=head_dim,
        dtype=dtype,
    )
    args = (case.q, case.k_pages, case.v_pages, case.context_lens, case.page_table)
    out = jax.jit(
        lambda *a: pallas_kernels.paged_decode_attention(*a, sm_scale=case.sm_scale, **kwargs)
    )(*args)
    expected = reference.paged_decode_attention(*args, sm_scale=case.sm_scale)
    check(out, expected)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)


def run_prefill(page_size, head_dim, dtype):
    # Decode rows, a chunk after a cached prefix, a fresh prompt, a chunk ending exactly on a
    # page boundary, then padding rows.
    seqs = [
        (1, 1),
        (page_size + 3, 1),
        (3 * page_size + 5, 7),
        (40, 40),
        (4 * page_size, page_size),
    ]
    case = prefill_case(
        page_size,
        seqs=seqs,
        num_kv_heads=2,
        group=4,
        page_size=page_size,
        head_dim=head_dim,
        dtype=dtype,
    )
    args = (
        case.q,
        case.k_pages,
        case.v_pages,
        case.context_lens,
        case.page_table,
        case.query_start,
    )
    out = jax.jit(lambda *a: pallas_kernels.paged_prefill_attention(*a, sm_scale=case.sm_scale))(
        *args
    )
    expected = reference.paged_prefill_attention(*args, sm_scale=case.sm_scale)
    check(out, expected)


PAGE_SIZES = [8, 16, 32, 64]
HEAD_DIMS = [64, 128]
GROUPS = [(8, 1), (2, 4), (1, 8)]


def _decode_grid(dtype):
    return [
        pytest.param(ps, d, dtype, hkv, g, id=f"ps{ps}-d{d}-{dtype}-kv{hkv}g{g}")
        for ps in PAGE_SIZES
        for d in HEAD_DIMS
        for hkv, g in GROUPS
    ]


def _prefill_grid(dtype):
    return [
        pytest.param(ps, d, dtype, id=f"ps{ps}-d{d}-{dtype}") for ps in (16, 32) for d in HEAD_DIMS
    ]


@pytest.mark.parametrize("page_size,head_dim,dtype,num_kv_heads,group", _decode_grid("bfloat16"))
def test_decode_kernel_on_gpu_bf16(page_size, head_dim, dtype, num_kv_heads, group):
    run_decode(page_size, head_dim, dtype, num_kv_heads, group, gpu_kernel="triton")


@pytest.mark.parametrize("page_size,head_dim,dtype", _prefill_grid("bfloat16"))
def test_prefill_kernel_on_gpu_bf16(page_size, head_dim, dtype):
    run_prefill(page_size, head_dim, dtype)


@pytest.mark.parametrize("page_size,head_dim,dtype,num_kv_heads,group", _decode_grid("bfloat16"))
def test_mosaic_decode_kernel_on_gpu(page_size, head_dim, dtype, num_kv_heads, group):
    """The Mosaic GPU kernel (Hopper wgmma, TMA); needs sm_90."""
    q_shape, k_shape = (1, num_kv_heads * group, head_dim), (num_kv_heads, 1, page_size, head_dim)
    assert pallas_kernels.gpu_decode_kernel(q_shape, k_shape, dtype, "mosaic") == "mosaic"
    run_decode(page_size, head_dim, dtype, num_kv_heads, group, gpu_kernel="mosaic")


@pytest.mark.parametrize("page_size,head_dim,dtype,num_kv_heads,group", _decode_grid("float32"))
def test_decode_kernel_on_gpu_f32(page_size, head_dim, dtype, num_kv_heads, group):
    run_decode(page_size, head_dim, dtype, num_kv_heads, group, gpu_kernel="triton")


@pytest.mark.parametrize("page_size,head_dim,dtype", _prefill_grid("float32"))
def test_prefill_kernel_on_gpu_f32(page_size, head_dim, dtype):
    run_prefill(page_size, head_dim, dtype)

"""Every GPU kernel configuration the engine can choose compiles for the H200 (sm_90), on CPU.

Each kernel is lowered for 'cuda' inside an abstract H200 (gpu_target.h200) and its Triton IR
is compiled to a cubin with the `triton` package (its passes and bundled ptxas), checking the
H200's limits: at most 232,448 bytes of shared memory per block, at most 255 registers per
thread and 65,536 per block. The configurations:

- every bucket of the default engine (max_num_seqs 32, max_num_batched_tokens 512,
  max_model_len 2048, page size 16, bfloat16, tensor_parallel_size 1) for the
  Llama-3.2-1B and Llama-3.1-8B shapes: a decode kernel per (sequences, page columns)
  bucket and a prefill kernel per (tokens, sequences, page columns) bucket, over the pool
  the default memory fraction gives on an H200 (every layer's pages in one array, as the
  kernels read it: tens of GiB, addressed with int64 offsets);
- the grid of tests/pallas_kernels/test_on_gpu.py and bench_attention's shapes;
- a few kernels on quantized pages (int8, fp8 e4m3, fp8 e5m2; kv_quant.QuantizedPages): the
  8B model's largest decode and prefill buckets over the pool its quantized pages give at
  the same memory, and two float32-query kernels (full-precision dots).

- the latent (MLA) decode and prefill kernels (pallas_kernels/mla.py, mla_prefill.py) in every
  bucket of the default engine at DeepSeek-V3's attention shape (128 query heads, one latent "KV head" of
  half row 288 = 512 + 64 split over K and V) over the pool DeepSeek-V2-Lite's pages get on
  an H200 (V3 itself does not fit one), and its largest bucket at V2-Lite's 16 heads, on
  int8 and fp8 pages and with float32 queries.

Float32 kernels must multiply at full precision (no `inputPrecision = tf32` in their dots).
The whole sweep (about 400 kernels, several CPU-minutes, in chunks of 24 that pytest-xdist
spreads over its workers with --dist load) is marked slow and CI runs it under the GPU
machine's versions (.ci/run, Python 3.12 stage); a representative subset runs in the default
suite. Where the triton package is not installed these tests fail, they do not skip:
it is a test dependency (.ci/run installs it).
"""

from __future__ import annotations

import functools
import hashlib
import re

import jax
import jax.numpy as jnp
import pytest
from gpu_target import compile_sm90, lower_for_cuda, triton_calls, ttir_text
from paged_cases import decode_specs, prefill_specs

import pallas_kernels
from jpaged.config import CacheConfig, EngineConfig
from pallas_kernels import gpu_decode, gpu_prefill, kv_quant, mla, mla_prefill
from pallas_kernels.kv_quant import QuantizedPages

# name: (layers, q heads, kv heads, head_dim, parameter count) of the Hugging Face configs.
MODELS = {
    "llama-3.2-1b": (16, 32, 8, 64, 1_235_814_400),
    "llama-3.1-8b": (32, 32, 8, 128, 8_030_261_248),
}
LLAMA3_CONTEXT = 131_072  # max_position_embeddings of both
# XLA's default allocator limit on a GPU (75% of its memory; nvidia-smi: 143,771 MiB on an
# H200), less bf16 weights; the engine's default kv_memory_fraction (0.8) of what is left.
H200_BYTES_LIMIT = int(0.75 * 143_771 * 2**20)


def default_engine() -> EngineConfig:
    return EngineConfig().resolve(LLAMA3_CONTEXT)


def h200_num_pages(model: str, config: EngineConfig, kv_dtype=jnp.bfloat16) -> int:
    """The pages the engine's default budget gives on an H200 (each one page of every layer)."""
    layers, _, hkv, head_dim, num_params = MODELS[model]
    page_bytes = kv_quant.bytes_per_page(  # K and V, scales included when quantized
        kv_dtype, num_layers=layers, num_kv_heads=hkv, page_size=config.cache.page_size,
        head_dim=head_dim)
    free = H200_BYTES_LIMIT - 2 * num_params
    return int(free * CacheConfig().kv_memory_fraction) // page_bytes + 1


def h200_pool_pages(model: str, config: EngineConfig, kv_dtype=jnp.bfloat16) -> int:
    """The pages axis of the pool the kernels read: every layer's pages in one array
    (jpaged/worker/programs.py init_state: layers x num_pages)."""
    return MODELS[model][0] * h200_num_pages(model, config, kv_dtype)


def engine_configs(model: str) -> list[tuple[str, object, tuple]]:
    """(id, kernel, args) for every bucket of the default engine serving `model`."""
    config = default_engine()
    _, hq, hkv, head_dim, _ = MODELS[model]
    pool = (hq, hkv, head_dim, config.cache.page_size, h200_pool_pages(model, config), "bfloat16")
    out = []
    for s in config.seq_buckets:
        for p in config.page_buckets:
            out.append((f"decode-s{s}-p{p}", gpu_decode.paged_decode_attention,
                        decode_specs(s, p, *pool)))
            for t in config.token_buckets:
                out.append((f"prefill-t{t}-s{s}-p{p}", gpu_prefill.paged_prefill_attention,
                            prefill_specs(t, s, p, *pool)))
    return out


def grid_configs() -> list[tuple[str, object, tuple]]:
    """test_on_gpu.py's grid (batch 7 x 6 pages; prefill 5 sequences) and bench_attention's
    shapes (32 query / 8 KV heads, head_dim 128, bf16)."""
    out = []
    for ps in (8, 16, 32, 64):
        for d in (64, 128):
            for dt in ("float32", "bfloat16"):
                for hkv, group in ((8, 1), (2, 4), (1, 8)):
                    out.append((f"gpu-test-decode-ps{ps}-d{d}-{dt}-kv{hkv}g{group}",
                                gpu_decode.paged_decode_attention,
                                decode_specs(7, 6, hkv * group, hkv, d, ps, 7 * 6 + 4, dt)))
    for ps in (16, 32):
        for d in (64, 128):
            for dt in ("float32", "bfloat16"):
                ctx = 4 * ps
                out.append((f"gpu-test-prefill-ps{ps}-d{d}-{dt}",
                            gpu_prefill.paged_prefill_attention,
                            prefill_specs(ps + 65 + 3, 5, -(-ctx // ps), 8, 2, d, ps, 40, dt)))
    bench = [(64, 2048, 16), (256, 1024, 16), (16, 8192, 16), (8, 512, 16)]
    bench += [(64, 2048, ps) for ps in (8, 32, 64, 128)]
    for batch, ctx, ps in bench:
        pages = ctx // ps
        out.append((f"bench-{batch}x{ctx}-ps{ps}", gpu_decode.paged_decode_attention,
                    decode_specs(batch, pages, 32, 8, 128, ps, 4 * batch * pages + 1, "bfloat16")))
    return out


QUANTIZED_DTYPES = {"int8": "int8", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def quantize_specs(args, dtype):
    """The abstract arguments with each pool [Hkv, N, page_size, D] replaced by quantized
    pages of dtype: codes of the same shape and bfloat16 scales [Hkv, N, page_size]."""
    def pool(a):
        return QuantizedPages(jax.ShapeDtypeStruct(a.shape, jnp.dtype(dtype)),
                              jax.ShapeDtypeStruct(a.shape[:-1], kv_quant.SCALE_DTYPE))

    return tuple(pool(a) if len(a.shape) == 4 else a for a in args)


def quantized_configs() -> list[tuple[str, object, tuple]]:
    """The 8B model's largest decode and prefill buckets per quantized dtype, over the pool
    that dtype's pages give on an H200; and float32-query decode and prefill on int8 pages
    (whose dots must stay at full precision)."""
    config = default_engine()
    _, hq, hkv, head_dim, _ = MODELS["llama-3.1-8b"]
    out = []
    for name, dtype in QUANTIZED_DTYPES.items():
        pages = h200_pool_pages("llama-3.1-8b", config, jnp.dtype(dtype))
        pool = (hq, hkv, head_dim, config.cache.page_size, pages, "bfloat16")
        out.append((f"llama-3.1-8b-decode-s32-p128-{name}", gpu_decode.paged_decode_attention,
                    quantize_specs(decode_specs(32, 128, *pool), dtype)))
        out.append((f"llama-3.1-8b-prefill-t512-s32-p128-{name}",
                    gpu_prefill.paged_prefill_attention,
                    quantize_specs(prefill_specs(512, 32, 128, *pool), dtype)))
    grid = {name: (kernel, args) for name, kernel, args in grid_configs()}
    for name in ("gpu-test-decode-ps64-d128-float32-kv1g8", "gpu-test-prefill-ps32-d128-float32"):
        kernel, args = grid[name]
        out.append((f"{name}-int8", kernel, quantize_specs(args, "int8")))
    return out


@functools.cache
def _compiled(ir_hash: str, call):
    return compile_sm90(call)


# DeepSeek-V2-Lite: (layers, q heads, latent half row, parameter count); its pages on an H200.
MLA_POOL_MODEL = (27, 16, 288, 15_706_484_224)


def mla_pool_pages(kv_dtype=jnp.bfloat16) -> int:
    """The pages axis of V2-Lite's latent pool on an H200 (h200_pool_pages' budget): each
    token one row of 2 x 288 values per layer, split over K and V as one KV head each."""
    layers, _, half, num_params = MLA_POOL_MODEL
    page_size = default_engine().cache.page_size
    page_bytes = kv_quant.bytes_per_page(kv_dtype, num_layers=layers, num_kv_heads=1,
                                         page_size=page_size, head_dim=half)  # fmt: skip
    free = H200_BYTES_LIMIT - 2 * num_params
    return layers * (int(free * CacheConfig().kv_memory_fraction) // page_bytes + 1)


def mla_prefill_specs(tokens, seqs, pages, heads, num_pages, dtype="bfloat16"):
    """Abstract latent prefill arguments: q [T, heads, 576], pools [1, N, 16, 288]."""
    half = MLA_POOL_MODEL[2]
    args = prefill_specs(tokens, seqs, pages, heads, 1, half, 16, num_pages, dtype)
    return (jax.ShapeDtypeStruct((tokens, heads, 2 * half), jnp.dtype(dtype)), *args[1:])


def mla_decode_specs(seqs, pages, heads, num_pages):
    """Abstract latent decode arguments: q [S, heads, 576], pools [1, N, 16, 288]."""
    half = MLA_POOL_MODEL[2]
    args = decode_specs(seqs, pages, heads, 1, half, 16, num_pages, "bfloat16")
    return (jax.ShapeDtypeStruct((seqs, heads, 2 * half), jnp.bfloat16), *args[1:])


def mla_configs() -> list[tuple[str, object, tuple]]:
    """The latent decode and prefill kernels in every bucket of the default engine at 128
    heads."""
    config = default_engine()
    num_pages = mla_pool_pages()
    out = []
    for s in config.seq_buckets:
        for p in config.page_buckets:
            out.append((f"mla-decode-s{s}-p{p}", mla.gpu_paged_decode_attention,
                        mla_decode_specs(s, p, 128, num_pages)))
            out += [(f"mla-prefill-t{t}-s{s}-p{p}", mla_prefill.gpu_paged_prefill_attention,
                     mla_prefill_specs(t, s, p, 128, num_pages)) for t in config.token_buckets]
    return out


def mla_extra_configs() -> list[tuple[str, object, tuple]]:
    """The largest bucket at V2-Lite's 16 heads, on int8 / fp8 pages, with float32 queries."""
    kernel = mla_prefill.gpu_paged_prefill_attention
    out = [("mla-prefill-t512-s32-p128-h16", kernel,
            mla_prefill_specs(512, 32, 128, 16, mla_pool_pages()))]
    for name in ("int8", "e4m3"):
        dtype = QUANTIZED_DTYPES[name]
        args = mla_prefill_specs(512, 32, 128, 128, mla_pool_pages(jnp.dtype(dtype)))
        out.append((f"mla-prefill-t512-s32-p128-{name}", kernel, quantize_specs(args, dtype)))
    out.append(("mla-prefill-t64-s4-p8-float32", kernel,
                mla_prefill_specs(64, 4, 8, 128, 1000, "float32")))
    return out


def check_config(name, kernel, args) -> dict:
    """Lowers and compiles one configuration; asserts the limits and the dot precision."""
    head_dim = args[0].shape[-1]
    lowered = lower_for_cuda(kernel, args, sm_scale=head_dim**-0.5)
    calls = triton_calls(lowered)
    assert len(calls) == 1, (name, [c.name for c in calls])
    call = calls[0]
    if args[0].dtype == jnp.float32:
        dots = re.findall(r"tt\.dot [^:]*", ttir_text(call))
        assert dots and not any("tf32" in d for d in dots), (name, dots)
    kernel_info = _compiled(hashlib.sha256(call.ir).hexdigest() + str(call.num_warps), call)
    kernel_info.check_limits()
    if isinstance(args[1], QuantizedPages):  # the codes reach the kernel as stored
        assert f"!tt.ptr<{_TRITON_TYPES[args[1].dtype.name]}>" in ttir_text(call), name
    if args[0].dtype != jnp.float32:  # bf16, what the engine runs on a GPU: no spills either
        assert kernel_info.spill_stores == kernel_info.spill_loads == 0, (name, kernel_info)
    return {"shared": kernel_info.shared_bytes, "registers": kernel_info.registers,
            "spills": kernel_info.spill_stores}


_TRITON_TYPES = {"int8": "i8", "float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2"}


def _chunks(configs, size):
    return [configs[i: i + size] for i in range(0, len(configs), size)]


ENGINE_CHUNKS = {m: _chunks(engine_configs(m), 24) for m in MODELS}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,chunk",
    [(m, i) for m in MODELS for i in range(len(ENGINE_CHUNKS[m]))],
    ids=lambda x: str(x),
)
def test_engine_buckets_compile_for_sm90(model, chunk):
    for name, kernel, args in ENGINE_CHUNKS[model][chunk]:
        check_config(f"{model}-{name}", kernel, args)


GRID_CHUNKS = _chunks(grid_configs(), 24)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(len(GRID_CHUNKS)))
def test_gpu_test_grid_and_bench_shapes_compile_for_sm90(chunk):
    for name, kernel, args in GRID_CHUNKS[chunk]:
        check_config(name, kernel, args)


@pytest.mark.slow
def test_quantized_page_kernels_compile_for_sm90():
    infos = {name: check_config(name, kernel, args) for name, kernel, args in quantized_configs()}
    assert len(infos) == 8
    # 1-byte codes: the decode kernel stages less shared memory than on bfloat16 pages.
    bf16 = check_config("llama-3.1-8b-decode-s32-p128", *_engine_config("llama-3.1-8b",
                                                                        "decode-s32-p128"))
    for name in QUANTIZED_DTYPES:
        assert infos[f"llama-3.1-8b-decode-s32-p128-{name}"]["shared"] < bf16["shared"]


MLA_CHUNKS = _chunks(mla_configs() + mla_extra_configs(), 25)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(len(MLA_CHUNKS)))
def test_latent_kernels_compile_for_sm90(chunk):
    for name, kernel, args in MLA_CHUNKS[chunk]:
        check_config(name, kernel, args)


def test_the_latent_kernels_compile_for_sm90_at_their_largest_buckets():
    """Default suite: decode's and prefill's largest buckets at 128 heads over V2-Lite's H200
    pool (tens of GiB: int64 offsets), which the dispatcher gives the kernels, without spills
    (the decode kernel spilled 36 registers with 4 warps), and the float32 prefill."""
    picked = {c[0]: c for c in mla_configs() if c[0] in ("mla-decode-s32-p128",
                                                          "mla-prefill-t512-s32-p128")}
    assert len(picked) == 2
    for name, kernel, args in picked.values():
        assert mla.supports_gpu(args[0].shape, args[1].shape, args[1].dtype)
        assert args[1].shape[1] * 16 * 288 > 2**31
        info = check_config(name, kernel, args)
        assert info["spills"] == 0 and info["shared"] < 100_000, (name, info)
    check_config(*mla_extra_configs()[-1])


def test_default_h200_pools_pick_the_triton_kernel_and_address_it_with_int64_offsets():
    """The engine's default pool on an H200 holds every layer's pages in one array, tens of
    GiB: bfloat16 and quantized pools of both models run the Triton kernels (they fell back to
    the reference while any pool of 2**31 elements was refused), whose lowering addresses
    them with int64 offsets."""
    config = default_engine()
    for model, (_, hq, hkv, head_dim, _) in MODELS.items():
        for dtype in ("bfloat16", *QUANTIZED_DTYPES.values()):
            pages = h200_pool_pages(model, config, jnp.dtype(dtype))
            k_shape = (hkv, pages, config.cache.page_size, head_dim)
            assert pages * config.cache.page_size * hkv * head_dim > 2**34, (model, dtype)
            got = pallas_kernels.select_backend((32, hq, head_dim), k_shape, jnp.dtype(dtype),
                                                interpret=False, backend="gpu")
            assert got == "gpu", (model, dtype, pages)
    args = quantize_specs(decode_specs(32, 128, *_h200_pool("llama-3.1-8b")), "float8_e4m3fn")
    assert _pool_offset_types(gpu_decode.paged_decode_attention, args) == {"i64"}


def _h200_pool(model):
    config = default_engine()
    _, hq, hkv, head_dim, _ = MODELS[model]
    return (hq, hkv, head_dim, config.cache.page_size, h200_pool_pages(model, config),
            "bfloat16")


def _pool_offset_types(kernel, args) -> set[str]:
    """The integer types of the offsets the lowered decode kernel adds to the K/V pool
    pointers (its only 3-D pointer tensors: [pages, page_size, head_dim] per block)."""
    (call,) = triton_calls(lower_for_cuda(kernel, args, sm_scale=0.125))
    dtype = args[1].dtype.name
    pool_type = _TRITON_TYPES.get(dtype, {"bfloat16": "bf16", "float32": "f32"}.get(dtype))
    pattern = r"tt\.addptr .*: tensor<(\d+x\d+x\d+)x!tt\.ptr<(\w+)>>, tensor<[0-9x]*(i\d+)>"
    adds = re.findall(pattern, ttir_text(call))
    assert len(adds) == 2, adds  # K and V
    return {offset for _, ptr, offset in adds if ptr == pool_type}


@pytest.mark.parametrize(("dtype", "pages", "lowered", "fits"), [
    ("float8_e4m3fn", 2**17, "i32", True),  # 2**31 elements in 2 GiB: the largest int32 pool
    ("float8_e4m3fn", 2**17 + 1, "i32", False),  # past 2**31 elements, under 4 GiB: refused
    ("float8_e4m3fn", 2**18 + 1, "i64", True),  # past 4 GiB
    ("bfloat16", 2**17, "i32", True),  # 2**31 elements in exactly 4 GiB
    ("bfloat16", 2**17 + 1, "i64", True),
])
def test_the_offset_rule_follows_the_lowering(dtype, pages, lowered, fits):
    """gpu_decode.offsets_fit against what Pallas's Triton lowering emits for a pool of
    [8, pages, 16, 128] (int32 offsets up to 4 GiB, int64 past it): a pool is refused exactly
    when its int32 offsets would wrap."""
    k_shape = (8, pages, 16, 128)
    assert gpu_decode.offsets_fit(k_shape, jnp.dtype(dtype)) == fits
    assert pallas_kernels.select_backend((32, 32, 128), k_shape, jnp.dtype(dtype),
                                         interpret=False, backend="gpu") == (
        "gpu" if fits else "cpu")
    specs = decode_specs(32, 128, 32, 8, 128, 16, pages, "bfloat16")
    if dtype != "bfloat16":
        specs = quantize_specs(specs, dtype)
    assert _pool_offset_types(gpu_decode.paged_decode_attention, specs) == {lowered}


def _engine_config(model, name):
    (kernel, args), = [(k, a) for n, k, a in engine_configs(model) if n == name]
    return kernel, args


def test_representative_kernels_compile_for_sm90():
    """Default suite: the largest engine buckets of each model (most shared memory), the
    benchmark's main shape, and float32 kernels at full precision."""
    picked = {}
    for model in MODELS:
        for name, kernel, args in engine_configs(model):
            if name in ("decode-s32-p128", "prefill-t512-s32-p128", "decode-s4-p4"):
                picked[f"{model}-{name}"] = (kernel, args)
    for name, kernel, args in grid_configs():
        if name in ("bench-64x2048-ps16", "gpu-test-decode-ps64-d128-float32-kv1g8",
                    "gpu-test-prefill-ps32-d128-float32"):
            picked[name] = (kernel, args)
    assert len(picked) == 9
    infos = {name: check_config(name, *ka) for name, ka in picked.items()}
    # The 8B model's decode kernel (head_dim 128, 128 tokens x 2 stages of K and V) holds the
    # most shared memory of the engine's kernels.
    assert infos["llama-3.1-8b-decode-s32-p128"]["shared"] == max(
        v["shared"] for k, v in infos.items() if k.startswith("llama"))

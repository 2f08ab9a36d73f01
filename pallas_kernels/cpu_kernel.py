"""The CPU's kernels: paged attention (cpu_paged_attention.cc), sampling's vocabulary passes
(cpu_sampling.cc) and products against packed weights (cpu_matmul.cc), built with the
system's C++ compiler on first use into one library, loaded, and registered as XLA FFI
targets for the CPU.

    available() -> bool                  whether they built here (else the jnp paths run)
    attention(q, k_pages, v_pages, page_table, seq, starts, ends, *, sm_scale, soft_cap,
              sinks=None) -> [T, Hq, D]
    greedy(logits, model_logits) -> (argmax int32[S], x_max f32[S], lse f32[S])
    pack(w [K, N]) -> panels [N / 64, K, 64];  unpack(panels) -> w
    matmul(x [M, K], panels) -> x @ w [M, N]

XLA:CPU runs the reference's page gather on one thread and copies every key block before its
product; the kernel reads each written slot where it lies, a sequence's consecutive tokens
(a prefill chunk) sharing each page's reads, on every core XLA would use (docs/benchmarks.md,
"A CPU attention kernel" and "Prefill, sampling and products through CPU kernels"). The
library is cached per sources, compiler flags, jaxlib and CPU under the jpaged cache
directory ($JPAGED_CACHE_DIR or ~/.cache/jpaged), written whole and renamed into place, so
concurrent processes never load half a file. No compiler, or a failed build: available() is
False, with one warning, and the jnp paths run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f"cpu_{name}.cc")
                for name in ("paged_attention", "sampling", "matmul"))
TARGET = "jpaged_cpu_paged_attention"
QUANTIZED_TARGET = "jpaged_cpu_paged_attention_quantized"
GREEDY_TARGET = "jpaged_cpu_greedy"
MATMUL_TARGET = "jpaged_cpu_matmul"
HEADERS = tuple(Path(__file__).with_name(f"cpu_{name}.h")  # included by the sources
                for name in ("math", "pool"))
_SYMBOLS = {TARGET: "JpagedCpuPagedAttention",
            QUANTIZED_TARGET: "JpagedCpuPagedAttentionQuantized",
            GREEDY_TARGET: "JpagedCpuGreedy",
            MATMUL_TARGET: "JpagedCpuMatmul"}
PANEL = 64  # columns per panel of a packed weight (cpu_matmul.cc)
# Vectorized float reductions (reassociation), no fast-math's finite-only assumption: the
# online softmax starts from -inf.
FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC", "-pthread")
# JPAGED_CPU_ATTENTION=reference keeps the jnp paths: the reference's gathers and the
# sampler's reductions (A/B runs, debugging).
ENV = "JPAGED_CPU_ATTENTION"


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    model = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
    return model + flags


def _library_path() -> Path:
    import jaxlib

    # jpaged's cache directory, as models.demo.cache_root names it (pallas_kernels imports
    # nothing from models: tests/test_layering.py).
    root = os.environ.get("JPAGED_CACHE_DIR") or Path.home() / ".cache" / "jpaged"
    key = hashlib.sha256()
    for part in (*(src.read_bytes() for src in SOURCES + HEADERS), " ".join(FLAGS).encode(),
                 jaxlib.__version__.encode(), _cpu_id().encode()):
        key.update(part)
    return Path(root) / "cpu_kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build_library(path: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    """Compiles sources (default: the kernels') into the shared library at path, written
    whole and renamed into place; RuntimeError on no compiler or a failed build.
    scripts/bench_cpu_attention.py builds other trees' attention source with it."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, sources), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def available() -> bool:
    """Whether the kernels serve this process: built, loaded and registered (once), and not
    turned off by JPAGED_CPU_ATTENTION=reference."""
    if os.environ.get(ENV, "kernel") == "reference":
        return False
    return _registered()


@functools.cache
def _registered() -> bool:
    """Builds (where the cache lacks it), loads and registers the kernels, once per process:
    XLA refuses a second handler under the same name."""
    try:
        path = _library_path()
        if not path.exists():
            build_library(path)
        lib = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
            )
    except (OSError, RuntimeError) as e:
        logger.warning("CPU attention kernel unavailable (%s); the gather path runs", e)
        return False
    return True


def threads() -> int:
    """Threads the kernel uses: one when XLA:CPU is held to one (the test suite), else every
    core this process may run on, as XLA's own pool."""
    if "--xla_cpu_multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", "").split():
        return 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def serves(pages) -> bool:
    """Whether attention takes this pool half: float32 pages, or a one-byte quantized pool
    (int8, fp8 e4m3 or e5m2 with bfloat16 row scales: kv_quant.QuantizedPages or PoolBits)."""
    if isinstance(pages, kv_quant.QuantizedPages | kv_quant.PoolBits):
        return kv_quant.is_quantized(pages.dtype) and pages.scales is not None
    return getattr(pages, "dtype", None) == jnp.float32


def _quantized(pages):
    """(bytes uint8[Hkv, P, S, D], scale bits uint16[Hkv, P, S]) of a quantized pool half."""
    def bits(a, dtype):
        return a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)

    return bits(pages.data, jnp.uint8), bits(pages.scales, jnp.uint16)


def _byte_values(dtype) -> np.ndarray:
    """f32[256]: the value of each byte in a one-byte dtype (int8, fp8 e4m3 or e5m2)."""
    return np.arange(256, dtype=np.uint8).view(np.dtype(dtype)).astype(np.float32)


def attention(q, k_pages, v_pages, page_table, seq, starts, ends, *, sm_scale: float,
              soft_cap: float | None, sinks=None):
    """q f32[T, Hq, D]; k_pages, v_pages f32[Hkv, P, S, D] or quantized pool halves
    (serves); page_table int32[N, W]; seq
    int32[T]: token t's sequence (its page-table row); starts, ends int32[T]: the keys
    [start, end) token t sees (end <= start: zeros); sinks: f32[Hq] sink logits (gpt-oss)
    or None. Returns f32[T, Hq, D]."""
    has_sinks = sinks is not None
    sinks = (jnp.zeros(q.shape[1], jnp.float32) if sinks is None
             else jnp.asarray(sinks, jnp.float32).reshape(q.shape[1]))
    kw = {"sm_scale": np.float32(sm_scale), "soft_cap": np.float32(soft_cap or 0.0),
          "has_sinks": has_sinks, "threads": np.int64(threads())}
    rest = (page_table, seq, starts, ends, sinks)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if isinstance(k_pages, kv_quant.QuantizedPages | kv_quant.PoolBits):
        lut = jnp.asarray(_byte_values(k_pages.dtype))
        call = jax.ffi.ffi_call(QUANTIZED_TARGET, out)
        return call(q, *_quantized(k_pages), *_quantized(v_pages), lut, *rest, **kw)
    return jax.ffi.ffi_call(TARGET, out)(q, k_pages, v_pages, *rest, **kw)


def greedy(logits, model_logits):
    """logits f32[S, V] (what tokens are picked from), model_logits f32[S, V] (what
    log-probabilities are taken of) -> (argmax int32[S]: each logits row's first maximum, or
    its first NaN; x_max f32[S]: each model row's maximum; lse f32[S]: log(sum(exp(model_logits
    - x_max))) per row), as jpaged/sample/sampler.py's jnp reductions give them."""
    s = logits.shape[0]
    call = jax.ffi.ffi_call(GREEDY_TARGET, (jax.ShapeDtypeStruct((s,), jnp.int32),
                                            jax.ShapeDtypeStruct((s,), jnp.float32),
                                            jax.ShapeDtypeStruct((s,), jnp.float32)))
    return call(logits, model_logits, threads=np.int64(threads()))


def pack(w):
    """w [K, N] (N a multiple of PANEL) -> panels [N / PANEL, K, PANEL], contiguous:
    panels[p, k, j] = w[k, PANEL p + j]. numpy in, numpy out; jax in, jax out."""
    k, n = w.shape
    if n % PANEL:
        raise ValueError(f"pack: {n} columns are not a multiple of {PANEL}")
    panels = w.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)
    return np.ascontiguousarray(panels) if isinstance(w, np.ndarray) else jnp.array(panels)


def unpack(panels):
    """pack's inverse: panels [P, K, PANEL] -> w [K, P * PANEL]."""
    p, k, _ = panels.shape
    return panels.transpose(1, 0, 2).reshape(k, p * PANEL)


def matmul(x, panels, valid=None):
    """x f32[M, K] @ w, w packed as panels f32[N / 64, K, 64] -> f32[M, N]. valid: int32[]
    (traced or not), the rows that matter: the first min(max(valid, 0), M) (a step's real
    tokens); the rest are zeros, not computed. None: all M."""
    m, n = x.shape[0], panels.shape[0] * PANEL
    valid = jnp.asarray(m if valid is None else valid, jnp.int32).reshape(())
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x, panels, valid, threads=np.int64(threads()))

"""Source trees' CPU kernels side by side in one process, for bench_cpu_attention.py and
bench_cpu_matmul.py: `--tree NAME=DIR` parsed, one kernel source of each tree built with
cpu_kernel's compiler and flags and registered under its own target, and the trees' calls
alternated (this VM's memory rate moves by half between minutes: only trees timed side by side
compare)."""
from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from pallas_kernels import cpu_kernel


def parse(specs: list[str], default: Path) -> list[tuple[str, Path]]:
    """--tree NAME=DIR values as (name, resolved dir); none: [("this", default)]."""
    trees = []
    for spec in specs or [f"this={default}"]:
        name, sep, path = spec.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"--tree {spec!r}: expected NAME=DIR")
        trees.append((name, Path(path).resolve()))
    return trees


def register(tree: Path, source: str, symbol: str, out: Path, target: str) -> None:
    """Builds the tree's pallas_kernels/<source> into the library at out and registers its
    handler symbol as the CPU FFI target `target`."""
    src = tree / "pallas_kernels" / source
    if not src.exists():
        raise SystemExit(f"--tree {tree}: no {src.relative_to(tree)}")
    try:
        cpu_kernel.build_library(out, (src,))
    except RuntimeError as e:
        raise SystemExit(f"building {src}: {e}") from None
    lib = ctypes.cdll.LoadLibrary(str(out))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def alternate(calls: dict[str, Callable], args: tuple, repeat: int,
              prefix: str = "") -> dict[str, np.ndarray]:
    """Prints each call's largest difference from the first's output, then times them in turn,
    repeat rounds; each call's milliseconds."""
    first_name, first = None, None
    for name, f in calls.items():
        out = np.asarray(f(*args))
        if first is None:
            first_name, first = name, out
        print(f"{prefix}{name}: largest difference from {first_name}: "
              f"{float(np.abs(out - first).max()):.3g}")
    times = {name: [] for name in calls}
    for _ in range(repeat):
        for name, f in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: np.array(ts) * 1e3 for name, ts in times.items()}

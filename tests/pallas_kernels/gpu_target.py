"""Lowering the GPU kernels for an H200 on a host without a GPU, and compiling their Triton IR
for sm_90 with the `triton` package: the checks that catch a kernel that cannot run on the
H200 before any GPU time is spent.

- `h200()`: a context in which Pallas lowers for an abstract NVIDIA H200. jax 0.11 asks the
  GPU model when it lowers a Triton call ("No supported GPU devices found, please specify an
  abstract GPU device using AbstractDevice"); jax 0.10 assumed sm_90 without a device. The
  same abstract mesh works on both.
- `lower_for_cuda(fn, args, **kwargs)`: `jax.jit(fn).trace(*args).lower(lowering_platforms=
  ("cuda",))` inside `h200()`.
- `triton_calls(lowered)`: every Pallas Triton custom call in a lowered module, with its
  serialized Triton IR (MLIR bytecode), warps and stages.
- `compile_sm90(call)`: Triton IR -> TTGIR -> LLVM IR -> PTX -> cubin with the triton
  package's own passes and its bundled ptxas, for sm_90a; returns the shared memory the
  kernel needs and ptxas's register and spill counts. XLA compiles the same IR with its own
  Triton build on the device, so this is close to, not the same as, the real compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import subprocess
import tempfile
from pathlib import Path

import jax

# H100 / H200 limits (CUDA occupancy tables, compute capability 9.0).
MAX_SHARED_BYTES = 232_448  # dynamic shared memory one block may opt in to (227 KiB)
REGISTERS_PER_SM = 65_536  # 32-bit registers shared by the threads of the resident blocks
MAX_REGISTERS_PER_THREAD = 255

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


@contextlib.contextmanager
def h200():
    """Pallas GPU lowerings inside this context target an abstract H200 (sm_90)."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_cuda(fn, args, **kwargs):
    """jax's lowering of fn(*args, **kwargs) for platform 'cuda' (a jax.stages.Lowered)."""

    def f(*a):
        return fn(*a, **kwargs)

    with h200():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


@dataclasses.dataclass(frozen=True)
class TritonCall:
    name: str
    ir: bytes  # Triton-dialect MLIR bytecode, as jax serialized it
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


def triton_calls(lowered) -> list[TritonCall]:
    """The Pallas Triton calls ("__gpu$xla.gpu.triton" custom calls) of a lowered module."""
    from jax._src.lib.mlir import ir

    calls = []

    def visit(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call":
                        target = ir.StringAttr(child.attributes["call_target_name"]).value
                        if target == "__gpu$xla.gpu.triton":
                            cfg = child.attributes["mhlo.backend_config"]

                            def i32(key, cfg=cfg):
                                return ir.IntegerAttr(cfg[key]).value

                            calls.append(TritonCall(
                                name=ir.StringAttr(cfg["name"]).value,
                                ir=ir.StringAttr(cfg["ir"]).value_bytes,
                                num_warps=i32("num_warps"),
                                num_stages=i32("num_stages"),
                                grid=(i32("grid_x"), i32("grid_y"), i32("grid_z")),
                            ))
                    visit(child)

    visit(lowered.compiler_ir("stablehlo").operation)
    return calls


def ttir_text(call: TritonCall) -> str:
    """The call's Triton IR as text (read back with jax's own MLIR and Triton dialect)."""
    from jax._src.lib import triton as jax_triton
    from jax._src.lib.mlir import ir

    ctx = ir.Context()
    jax_triton.dialect.register_dialect(ctx)
    return ir.Module.parse(call.ir, context=ctx).operation.get_asm(enable_debug_info=False)


@dataclasses.dataclass(frozen=True)
class Sm90Kernel:
    name: str
    shared_bytes: int
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int
    threads: int
    ptx: str

    def check_limits(self) -> None:
        """AssertionError naming the limit when the kernel cannot launch on an H100/H200."""
        assert self.shared_bytes <= MAX_SHARED_BYTES, (
            f"{self.name}: {self.shared_bytes} bytes of shared memory > {MAX_SHARED_BYTES}")
        assert self.registers <= MAX_REGISTERS_PER_THREAD, (self.name, self.registers)
        assert self.registers * self.threads <= REGISTERS_PER_SM, (
            f"{self.name}: {self.registers} registers x {self.threads} threads > "
            f"{REGISTERS_PER_SM}")


def triton_available() -> bool:
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _backend():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", 90, 32))


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_sm90(call: TritonCall) -> Sm90Kernel:
    """Compiles the call's Triton IR for sm_90a with the triton package (no GPU needed)."""
    from triton._C.libtriton import ir as tir
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler.compiler import Language

    backend = _backend()
    ctx = tir.context()
    tir.load_dialects(ctx)
    backend.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ttir"
        src.write_text(ttir_text(call))
        module = tir.parse_mlir_module(str(src), ctx)
        module.context = ctx
        options = backend.parse_options(
            {"num_warps": call.num_warps, "num_stages": call.num_stages})
        stages: dict = {}
        backend.add_stages(stages, options, Language.TRITON)
        metadata: dict = {}
        for ext in ("ttir", "ttgir", "llir", "ptx"):  # the cubin stage is ptxas, run below -v
            module = stages[ext](module, metadata)
        ptx = module
        ptx_path = Path(tmp) / "kernel.ptx"
        ptx_path.write_text(ptx)
        res = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx_path), "-o",
             str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True, check=False,
        )
    assert res.returncode == 0, f"ptxas failed for {call.name}:\n{res.stderr[-3000:]}"
    regs = _PTXAS_REGS.search(res.stderr)
    spills = _PTXAS_SPILLS.search(res.stderr)
    assert regs and spills, res.stderr
    return Sm90Kernel(
        name=call.name,
        shared_bytes=int(metadata["shared"]),
        registers=int(regs.group(1)),
        spill_stores=int(spills.group(1)),
        spill_loads=int(spills.group(2)),
        threads=32 * call.num_warps,
        ptx=ptx,
    )

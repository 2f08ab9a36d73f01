"""The XLA flags tests/conftest.py sets for the suite's processes (before jax starts), named
once for the tests that take one out again for a child process or a config check."""

# One compute thread per process, for XLA and for torch (and the subprocesses tests start):
# the suite runs in parallel worker processes instead, and thread pools sized for a large
# host on a 2-core CI quota oversubscribe it badly.
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
# Under jax 0.10 (Python 3.11 in CI) XLA:CPU also compiles fusions with its older emitters,
# not the MLIR fusion emitters it uses by default: the suite mostly compiles, and measured on
# the 2-core VM (2026-12-06) the 3.11 suite's XLA compile time fell from 1,477 s to 974 s
# (jax's backend-compile events summed over its workers), every test passing, while the
# programs run about 20% slower (SmolLM2 decode); a one-row (1, 1) step far slower, so the
# engine pads it to the buckets under this flag (jpaged/config.py _fusion_emitters). Users
# keep XLA's default. jax 0.11's XLA has no such flag (an unknown XLA flag aborts the
# process), so the 3.12 stage compiles with the default emitters.
OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# LLVM's optimization level for the code XLA emits, in both jax versions: at 0 the tiny test
# programs compile in about half the CPU time (tests/models/test_gemma.py on the 2-core VM,
# 2026-12-07, both runs side by side: 166 s of CPU at XLA's default, 76 s at 0; 10 passed
# in both). The dots still run in XLA's library kernels, and no float rewriting depends on it
# (XLA:CPU's fast math is off): only the emitted loops run slower. Not on an accelerator run:
# tests/conftest.py's pytest_configure takes it out again before jax starts a backend.
TEST_OPT_LEVEL = "--xla_backend_optimization_level=0"

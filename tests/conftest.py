"""Shared test setup: JAX on CPU in 32-bit mode, tiny checkpoints and the demo model.

Tests import helpers from tests/checkpoints.py (a plain module); this file only holds
fixtures and the environment defaults that must be set before JAX is imported.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
from pathlib import Path

# What the caller asked for, before the CPU default: `-m gpu` / `-m tpu` runs select their
# accelerator instead (pytest_configure below).
_PLATFORMS_ASKED = os.environ.get("JAX_PLATFORMS")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_ENABLE_X64"] = "0"
# Make `import checkpoints` work from any test folder, and the repo importable without install.
_TESTS = Path(__file__).resolve().parent
for _p in (_TESTS, _TESTS.parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from xla_flags import OLD_EMITTERS, ONE_THREAD, TEST_OPT_LEVEL

if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    from importlib.metadata import version

    # XLA stops reading flags at ONE_THREAD's bare word: the other flags go first.
    flags = (OLD_EMITTERS + " " if version("jaxlib").startswith("0.10.") else "") + ONE_THREAD
    flags = TEST_OPT_LEVEL + " " + flags
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Everything the tests load is on local disk: never wait on the Hugging Face Hub (a sandbox
# without network would otherwise spend timeouts on any lookup).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Compiled programs are shared through a persistent cache private to this test process (and
# the subprocesses it starts): engines built by different tests with the same shapes compile
# once, and nothing is written to the user's ~/.cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jpaged-test-xla-")

# Compiled programs are not loaded from jpaged's executable cache in tests: tests patch
# traced functions at run time, which its keys cannot see (tests/jpaged/worker/
# test_executable_cache.py turns it on for itself).
os.environ.setdefault("JPAGED_EXECUTABLE_CACHE", "off")

import pytest

try:  # hypothesis is a test extra; a device machine without it still runs `-m gpu`
    from hypothesis import settings
except ImportError:
    settings = None

# In CI the property tests replay the same examples every run (a change that breaks them
# still fails; a run cannot fail on examples no earlier run saw). Locally they explore.
if settings is not None:
    settings.register_profile("ci", derandomize=True, database=None)
    if os.environ.get("CI"):
        settings.load_profile("ci")


import jax

jax.config.update("jax_enable_x64", False)

from accelerators import ACCELERATORS, accelerator_of_run
from checkpoints import ARCHS, make_tiny_checkpoint
from smollm2_fixtures import hf_smollm2_model, hf_smollm2_tokenizer, smollm2_gguf  # noqa: F401

from jpaged.worker.map_count import map_usage

# Modules that one Python version proves, besides those marked `once` in their own file (the
# real-SmolLM2 accuracy and end-to-end tests). .ci/run's Python 3.12 stage leaves them out;
# stage 1 (Python 3.11) runs them. Each one's subject is host-side Python (the scheduler,
# the allocator, the tool and structured-output plumbing, the CLI and servers' request
# handling) or an engine path whose JAX programs other tests already run under 3.12. Those
# tests stay in the 3.12 stage: the kernels, sharding, caches of compiled programs, loaders,
# quantization and MoE.
ONE_VERSION_MODULES = {
    "tests/jpaged/core/test_paging_groups.py": "host plans (its engine tests need transformers)",
    "tests/jpaged/core/test_allocator_properties.py": "pure host: allocator and scheduler",
    "tests/jpaged/core/test_hybrid_paging.py": "host plans of windowed paging",
    "tests/jpaged/core/test_async_scheduling.py": "host overlap of steps",
    "tests/jpaged/spec_decode/test_speculative.py": "rejection sampler: tests/jpaged/sample",
    "tests/jpaged/structured_output/test_structured_engine.py": "llguidance masks, host side",
    "tests/jpaged/entrypoints/test_cli.py": "argument handling and output",
    "tests/jpaged/entrypoints/test_cli_errors.py": "argument errors",
    "tests/server/test_structured_outputs.py": "request plumbing; test_openai_api runs",
    "tests/server/test_admin.py": "admin endpoints",
    "tests/server/test_openai_demo.py": "demo model over HTTP; test_openai_api runs",
    "tests/server/test_spec_decode_metrics.py": "metric counters",
    "tests/models/test_gguf_families.py": "numpy GGUF parsing; test_gguf_loader runs",
    # The servers' request plumbing on the fake engine (no JAX program): test_openai_api
    # (HTTP) and test_generate (gRPC) stay in both stages for it.
    "tests/server/test_openai_errors.py": "HTTP error shapes on the fake engine",
    "tests/server/test_openai_streams.py": "SSE streams on the fake engine",
    "tests/server/test_bad_input.py": "gRPC validation on the fake engine",
    "tests/server/test_cancel.py": "gRPC cancellation on the fake engine",
    "tests/server/test_drain.py": "drain on the fake engine",
    "tests/server/test_engine_loop.py": "the engine thread on the fake engine",
    "tests/server/test_metrics.py": "Prometheus counters on the fake engine",
    "tests/server/test_grpc_chat.py": "gRPC chat plumbing on the fake engine",
    "tests/server/test_tool_requests.py": "tool request validation",
    "tests/server/test_tool_parsers.py": "string parsing",
    "tests/server/test_interface.py": "method signatures",
    "tests/server/test_wire.py": "protobuf field checks",
    "tests/server/test_proto.py": "generated stubs",
    "tests/test_layering.py": "reads the source",
    # Engine behaviour built on programs that other 3.12 tests compile and run (test_engine,
    # test_step_hlo, test_executable_cache, the kernels' and sharding's own tests): which
    # programs a warm-up compiles, admission at the mapping cap, the CPU server's slots,
    # every-request-ends, pages of a quantized pool moved by prefix caching, forks, beams and
    # swaps (the quantized pages themselves: test_kv_quant, test_kv_quant_kernels), the
    # quantized weights' sharding specs (host numpy; shard_map itself: test_tensor_parallel).
    "tests/jpaged/core/test_engine_warm_up.py": "the warm-up's program plan",
    "tests/jpaged/worker/test_map_count.py": "admission at Linux's mapping cap",
    "tests/server/test_startup.py": "the CPU server's slots and warm-up",
    "tests/jpaged/core/test_liveness.py": "every accepted request ends",
    "tests/jpaged/core/test_kv_cache_dtype.py": "quantized pages through the engine",
    "tests/parallel/test_quantized_tensor_parallel.py": "quantized weights' shard specs",
    # The CPU attention reference (jnp): under 3.12 every engine test on the CPU runs it, and
    # the kernels' interpret-mode tests compare against it.
    "tests/pallas_kernels/test_reference.py": "the CPU reference, run by 3.12's engine tests",
}  # fmt: skip


# The slowest modules, slowest first (each one's setup and calls, measured in a CI run on the
# idle 2-core machine, 2026-12-07 20:54-21:12 UTC: 36-200 s; a set of SAME_WORKER_MODULES
# by its modules' sum: tool calling 69 + agent clients 25 s, gguf_smollm2 70 + embeddings 24 s).
# xdist gives each worker whole modules in the order of the collection
# (--no-loadscope-reorder in pyproject.toml), so these start first and the many short modules
# fill in behind them: a slow module started last would leave the other worker idle until it
# ends. Regenerate from JPAGED_MODULE_TIMES below.
SLOW_MODULES_FIRST = (
    "tests/models/test_quantization_smollm2.py",
    "tests/parallel/test_expert_parallel.py",
    "tests/jpaged/core/test_allocator_properties.py",
    "tests/server/test_tool_calling.py",
    "tests/models/test_gguf_smollm2.py",
    "tests/jpaged/spec_decode/test_speculative.py",
    "tests/server/test_structured_smollm2.py",
    "tests/jpaged/core/test_paging_groups.py",
    "tests/jpaged/sample/test_sampler.py",
    "tests/models/test_gemma.py",
    "tests/models/test_deepseek.py",
    "tests/jpaged/core/test_engine_warm_up.py",
    "tests/models/test_moe.py",
)


# Modules that share a session-scoped fixture, each set run by one xdist worker: --dist loadfile
# hands out modules one at a time to whichever worker asks, so two modules sharing one SmolLM2
# server could each build it on a different worker. The scheduler below hands out a set as
# one unit, at the place of its first module in the order above.
SAME_WORKER_MODULES = {
    # tests/server/conftest.py smollm2_server: one real-SmolLM2 engine and server
    "tests/server/test_tool_calling.py": "smollm2_server",
    "tests/server/test_agent_clients.py": "smollm2_server",
    # tests/smollm2_fixtures.py hf_smollm2_model: transformers' SmolLM2 (about 20 s to load)
    "tests/models/test_gguf_smollm2.py": "hf_smollm2_model",
    "tests/server/test_embeddings.py": "hf_smollm2_model",
}


@pytest.hookimpl(optionalhook=True)  # xdist's hook; a run without xdist never calls it
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SameWorkerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return SAME_WORKER_MODULES.get(module, module)

    return SameWorkerScheduling(config, log)


def pytest_configure(config):
    """A `-m gpu` (or `-m tpu`) run runs on that accelerator, in one process, or stops at once
    with one line saying why: where the CPU default stayed, every such test would skip and
    the run would pass having tested nothing."""
    kind = accelerator_of_run(config.option.markexpr)
    if kind is None:
        return
    platform, accepted = ACCELERATORS[kind]
    asked = _PLATFORMS_ASKED
    if asked and not set(asked.split(",")) & set(accepted):
        pytest.exit(
            f"-m {kind} selects the {kind.upper()} tests, but JAX_PLATFORMS={asked} keeps jax "
            f"off the {kind.upper()}: unset it or name {'/'.join(accepted)}",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
    platforms = asked or platform
    os.environ["JAX_PLATFORMS"] = platforms  # subprocesses the tests start, too
    # The accelerator's kernels compile at XLA's own optimization level (jax reads XLA_FLAGS
    # when its first backend starts: jax.devices() below).
    os.environ["XLA_FLAGS"] = " ".join(
        os.environ.get("XLA_FLAGS", "").replace(TEST_OPT_LEVEL, "").split()
    )
    jax.config.update("jax_platforms", platforms)
    # One process holds the device: xdist's workers would each take most of its memory
    # (jax preallocates 75% at first use). xdist's own configure runs after this one.
    config.option.dist = "no"
    config.option.numprocesses = None
    config.option.tx = []
    try:
        found = jax.devices()[0].platform
    except (RuntimeError, AssertionError) as e:  # jax 0.10 asserts when no plugin has it
        text = str(e).strip()
        reason = text.splitlines()[0] if text else f"no jax backend for {platforms!r}"
        pytest.exit(
            f"-m {kind} needs a {kind.upper()}, and this machine has none that jax can use "
            f"(JAX_PLATFORMS={platforms}: {reason})",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
    if found != kind:
        pytest.exit(
            f"-m {kind} needs a {kind.upper()}; jax found only {found!r} devices here",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.relative_to(config.rootpath).as_posix() in ONE_VERSION_MODULES:
            item.add_marker(pytest.mark.once)
    # SLOW_MODULES_FIRST in its order, then the other modules by their number of tests, most
    # first (xdist's own reordering, which the option turns off); within a module, as written.
    modules = [item.path.relative_to(config.rootpath).as_posix() for item in items]
    counts = collections.Counter(modules)
    rank = {m: i for i, m in enumerate(SLOW_MODULES_FIRST)}
    keys = {m: (rank.get(m, len(rank)), -counts[m], m) for m in counts}
    order = sorted(range(len(items)), key=lambda i: (keys[modules[i]], i))
    items[:] = [items[i] for i in order]


# Memory mappings (jpaged/worker/map_count.py): XLA:CPU maps each compiled program's code in
# hundreds of pieces, Linux caps a process at vm.max_map_count (65,530 here), and one xdist
# worker runs half the suite: in the CI emulation of 2026-12-07 00:21 one worker refused 9
# compiles at 64,338-64,667 mappings. jax's caches keep every program of a jitted function for
# the process's life (tests/pallas_kernels/test_decode.py alone ends at 2,021 mappings, 738
# after jax.clear_caches()); engines free theirs when dropped. So after a module, a worker
# that has grown by an eighth of the cap since the last clearing clears jax's caches (a later
# compile of the same program reads the persistent compilation cache).
_maps_after_clearing = [0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's fixtures are finalized when nextitem is in another module
    if nextitem is not None and nextitem.path == item.path:
        return
    usage = map_usage()
    if usage is not None and usage[0] - _maps_after_clearing[0] > usage[1] // 8:
        gc.collect()
        jax.clear_caches()
        gc.collect()
        _maps_after_clearing[0] = map_usage()[0]


# JPAGED_MODULE_TIMES=FILE: the run appends one JSON line per module (its setup, call and
# teardown seconds summed), the measure behind SLOW_MODULES_FIRST. Written by the process that
# sees every report: xdist's controller (workers' reports reach it too), or the only one.
_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if os.environ.get("JPAGED_MODULE_TIMES"):
        module = report.nodeid.split("::", 1)[0]
        _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = os.environ.get("JPAGED_MODULE_TIMES")
    if path and _module_seconds and not hasattr(session.config, "workerinput"):
        import json

        slowest = sorted(_module_seconds.items(), key=lambda kv: -kv[1])
        with open(path, "a") as f:
            f.writelines(
                json.dumps({"module": m, "seconds": round(s, 1)}) + "\n" for m, s in slowest
            )


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """arch -> directory of a tiny random checkpoint (see tests/checkpoints.py), built once."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    """The demo model, built once per session under a temporary JPAGED_CACHE_DIR."""
    from models.demo import ensure_demo_model

    cache = tmp_path_factory.mktemp("jpaged_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JPAGED_CACHE_DIR", str(cache))
        path = ensure_demo_model()
        yield path

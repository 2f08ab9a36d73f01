"""Compiled programs loaded from the executable cache (jpaged/worker/executable_cache.py):
the same tokens as freshly compiled ones, no tracing; an entry of another config, dtype or
jax version is not used; a truncated or corrupt entry is rebuilt with a warning."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from jpaged import LLM, SamplingParams
from jpaged.worker import executable_cache
from jpaged.worker.executable_cache import ExecutableCache, cache_key

KW = {
    "max_num_seqs": 2,
    "max_model_len": 32,
    "max_num_batched_tokens": 32,
    "page_size": 8,
    "num_pages": 9,
}
PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(12, 26))]  # a 32-token step, then 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def cache_on(monkeypatch, tmp_path):
    """The executable cache on, in a directory of this test's own (the suite's JAX cache
    directory is put back after)."""
    monkeypatch.setenv(executable_cache.ENV, "on")
    from jax.experimental.compilation_cache import compilation_cache

    suite_dir = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    # JAX keeps the cache it opened for an earlier test of this worker until reset: a
    # program it served would not be stored here (executable_cache.py says why).
    compilation_cache.reset_cache()
    yield tmp_path / "cache"
    jax.config.update("jax_compilation_cache_dir", suite_dir)
    compilation_cache.reset_cache()


def _run(model_dir, cache_dir, **kw):
    llm = LLM(str(model_dir), compilation_cache_dir=str(cache_dir), **KW, **kw)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return tokens, llm.stats(), llm.llm_engine.runner.programs


def _entries(cache_dir):
    return sorted((cache_dir / "jpaged-executables").glob("*" + executable_cache.SUFFIX))


def test_a_second_engine_loads_every_program_and_gives_the_same_tokens(demo_model_dir, cache_on):
    fresh, stats, _ = _run(demo_model_dir, cache_on)
    assert stats["num_traced"] == stats["num_compiles"] > 0 and stats["num_loaded"] == 0
    assert len(_entries(cache_on)) == stats["num_compiles"]
    loaded, stats2, programs = _run(demo_model_dir, cache_on)
    assert loaded == fresh
    assert stats2["num_loaded"] == stats2["num_compiles"] == stats["num_compiles"]
    assert stats2["num_traced"] == 0 and stats2["trace_seconds"] == 0.0
    assert f"{stats['num_compiles']} loaded from the executable cache" in programs.summary()


def test_another_dtype_or_layer_layout_is_not_loaded(demo_model_dir, cache_on):
    _run(demo_model_dir, cache_on)
    for other in ({"dtype": "bfloat16"}, {"scan_layers": False}):
        _, stats, _ = _run(demo_model_dir, cache_on, **other)
        assert stats["num_loaded"] == 0 and stats["num_traced"] > 0, other


def test_a_truncated_entry_is_rebuilt_with_a_warning(demo_model_dir, cache_on, caplog):
    fresh, stats, _ = _run(demo_model_dir, cache_on)
    entries = _entries(cache_on)
    cut = entries[0]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    entries[1].write_bytes(b"not an entry at all")
    with caplog.at_level(logging.WARNING, logger="jpaged.worker.executable_cache"):
        again, stats2, programs = _run(demo_model_dir, cache_on)
    assert again == fresh
    assert programs.executables.num_rebuilt == 2
    assert stats2["num_traced"] == 2 and stats2["num_loaded"] == stats["num_compiles"] - 2
    assert (
        sum("unusable" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
        == 2
    )
    _, stats3, _ = _run(demo_model_dir, cache_on)  # the rebuilt entries are whole again
    assert stats3["num_loaded"] == stats3["num_compiles"]


def test_the_key_covers_config_shapes_dtypes_and_the_jax_version(monkeypatch):
    args = (np.zeros((4, 8), np.float32), {"a": np.zeros(3, np.int32)})
    base = cache_key("step", "config-1", args)
    assert cache_key("step", "config-1", args) == base
    assert cache_key("step", "config-2", args) != base
    assert cache_key("prelude", "config-1", args) != base
    assert cache_key("step", "config-1", (np.zeros((4, 9), np.float32), args[1])) != base
    assert cache_key("step", "config-1", (args[0].astype(np.float16), args[1])) != base
    assert cache_key("step", "config-1", (args[0], [args[1]["a"]])) != base  # another tree
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    assert cache_key("step", "config-1", args) != base


def test_the_key_asks_for_the_cpu_kernel_and_covers_it(monkeypatch):
    """A CPU program holds the attention kernel's FFI call (pallas_kernels/cpu_kernel.py):
    computing a key registers the kernel before any entry is loaded (a process loading every
    program traces none), and a program built without the kernel has another key."""
    from pallas_kernels import cpu_kernel

    args = (np.zeros((4, 8), np.float32),)
    base = cache_key("step", "config-1", args)
    asked = []

    def unavailable() -> bool:
        asked.append(True)
        return False

    monkeypatch.setattr(cpu_kernel, "available", unavailable)
    assert cache_key("step", "config-1", args) != base
    assert asked


def test_the_cache_is_off_when_the_environment_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv(executable_cache.ENV, "off")
    assert not ExecutableCache(tmp_path).enabled
    monkeypatch.setenv(executable_cache.ENV, "on")
    assert ExecutableCache(tmp_path).enabled
    assert not ExecutableCache(None).enabled


def test_jaxs_persistent_cache_stays_off_beside_it(demo_model_dir, cache_on):
    """A program JAX's cache served is stored without its code on XLA:CPU: the engine does
    not point JAX's cache at the directory when this cache is on."""
    _run(demo_model_dir, cache_on)
    assert jax.config.jax_compilation_cache_dir is None
    assert [p.name for p in cache_on.iterdir()] == ["jpaged-executables"]

"""The scanned layout straight from the loaders: stacked=True gives every layer's weights,
bitwise, in one [num_layers, ...] array per name, from a Hugging Face directory, a GGUF file
and an Orbax checkpoint; and the engine runs the layout it loaded (on the CPU a Llama's
layers switched per layer: per-layer weights, never stacked)."""

from __future__ import annotations

import numpy as np
import pytest
from numpy_checkpoints import make_llama_checkpoint

from models.loader import load_model

# A small engine over the 3-layer checkpoint below.
ENGINE = {"max_num_seqs": 2, "max_model_len": 32, "max_num_batched_tokens": 16,
          "page_size": 8, "num_pages": 9}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("stacked") / "llama", layers=3)


def _assert_stacked_equals(stacked: dict, per_layer: dict) -> None:
    layers = per_layer["layers"]
    assert sorted(stacked["layers"]) == sorted(layers[0])
    for name, array in stacked["layers"].items():
        assert array.shape == (len(layers), *layers[0][name].shape), name
        for i, layer in enumerate(layers):
            np.testing.assert_array_equal(np.asarray(array[i]), np.asarray(layer[name]))
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(np.asarray(stacked[name]), np.asarray(per_layer[name]))


def test_hf_directory_loads_stacked(checkpoint):
    _assert_stacked_equals(
        load_model(checkpoint, stacked=True).params, load_model(checkpoint).params
    )


def test_orbax_checkpoint_loads_stacked(checkpoint, tmp_path):
    from models.orbax_checkpoint import convert_hf_to_orbax

    out = convert_hf_to_orbax(checkpoint, tmp_path / "orbax")
    _assert_stacked_equals(load_model(out, stacked=True).params, load_model(checkpoint).params)


def test_the_engine_takes_the_loaded_stacked_layers_as_they_are(checkpoint):
    from jpaged import LLM, SamplingParams

    kw = ENGINE
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    scanned = LLM(str(checkpoint), **kw)
    runner = scanned.llm_engine.runner
    # On the CPU the scan switches over per-layer weights (models/llama.py switch_layers),
    # q/k/v and gate/up merged (fuse_projections): 4 + 2 + 2 heads of 16, 2 x 128 columns.
    assert isinstance(runner.params["layers"], tuple) and len(runner.params["layers"]) == 3
    first = runner.params["layers"][0]
    assert first["wqkv"].shape == (64, 128) and first["w_gate_up"].shape == (64, 256)
    assert not {"wq", "wk", "wv", "w_gate", "w_up"} & set(first)
    unrolled = LLM(str(checkpoint), scan_layers=False, **kw)
    assert isinstance(unrolled.llm_engine.runner.params["layers"], list)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    tokens = [o.outputs[0].token_ids for o in scanned.generate(prompts, greedy)]
    assert tokens == [o.outputs[0].token_ids for o in unrolled.generate(prompts, greedy)]


def test_a_lone_decode_runs_its_one_row_program_with_the_same_tokens(checkpoint):
    """SchedulerConfig.one_row_bucket (set here: the suite's jax 0.10 flags turn it off by
    default): once the shorter request ends, the other decodes alone in a (1, 1) program,
    and every token equals the engine that pads that step to (4, 4)."""
    from jpaged import LLM, SamplingParams

    kw = ENGINE
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 3)]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    runs = {}
    for one_row in (True, False):
        llm = LLM(str(checkpoint), one_row_bucket=one_row, **kw)
        outs = llm.generate(prompts, params)
        runs[one_row] = [o.outputs[0].token_ids for o in outs]
        lone = [k for k in llm.llm_engine.runner.programs.step_keys() if k.num_seqs == 1]
        assert [(k.num_tokens, k.num_seqs) for k in lone] == ([(1, 1)] if one_row else [])
    assert [len(t) for t in runs[True]] == [9, 3]
    assert runs[True] == runs[False]


def test_on_cpu_layers_over_the_line_run_unrolled_by_default(checkpoint, monkeypatch):
    """EngineConfig.scans_layers: scan_layers when set; on CPU, with the model's config,
    unrolled for layers over SCAN_LAYERS_CPU_MAX_BYTES (decided before the load, so the
    loader builds that layout straight away); accelerators scan."""
    import jpaged.config as config_module
    from jpaged import LLM, SamplingParams
    from jpaged.config import EngineConfig
    from models import hf_checkpoint
    from models.loader import read_config

    cfg = read_config(checkpoint)  # hidden 64, 4 heads (head_dim 16), 2 kv heads, 128 ffn
    assert cfg.layer_params == 3 * (64 * (2 * 64 + 2 * 32) + 3 * 64 * 128)
    line = config_module.SCAN_LAYERS_CPU_MAX_BYTES
    assert line == 2**30
    default, bf16 = EngineConfig(), EngineConfig(dtype="bfloat16")
    assert default.scans_layers("cpu", cfg) and default.scans_layers("cpu")
    monkeypatch.setattr(config_module, "SCAN_LAYERS_CPU_MAX_BYTES", cfg.layer_params * 4 - 1)
    assert not default.scans_layers("cpu", cfg)
    assert bf16.scans_layers("cpu", cfg)  # half the bytes: under the line
    assert default.scans_layers("gpu", cfg) and default.scans_layers("tpu", cfg)
    assert EngineConfig(scan_layers=True).scans_layers("cpu", cfg)

    stacked_loads = []
    build = hf_checkpoint.build_params

    def recorded(*args, stacked=False, **kw):
        stacked_loads.append(stacked(args[0]) if callable(stacked) else stacked)
        return build(*args, stacked=stacked, **kw)

    monkeypatch.setattr(hf_checkpoint, "build_params", recorded)
    kw = ENGINE
    unrolled = LLM(str(checkpoint), **kw)
    assert stacked_loads == [False]
    assert isinstance(unrolled.llm_engine.runner.params["layers"], list)
    scanned = LLM(str(checkpoint), scan_layers=True, **kw)
    # Scanned on the CPU: switched per layer, so loaded per layer too (never stacked).
    assert stacked_loads == [False, False]
    assert isinstance(scanned.llm_engine.runner.params["layers"], tuple)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    tokens = [o.outputs[0].token_ids for o in scanned.generate(prompts, greedy)]
    assert tokens == [o.outputs[0].token_ids for o in unrolled.generate(prompts, greedy)]


def test_gguf_file_loads_stacked(checkpoint, tmp_path):
    from checkpoints import write_gguf

    path = tmp_path / "llama.gguf"
    write_gguf(checkpoint, path, "Q8_0")
    _assert_stacked_equals(load_model(path, stacked=True).params, load_model(path).params)


def test_stacked_host_arrays_are_placed_without_a_copy_on_cpu(checkpoint, monkeypatch):
    """build_params fills each [num_layers, ...] array in an aligned_empty buffer, which jax
    on CPU places by aliasing it: the placed array's data is the host buffer itself, so the
    load never holds a stacked array twice."""
    import jax

    from models import hf_checkpoint

    for shape, dtype in (((3, 5, 7), np.float32), ((1000,), np.float16), ((2, 3), np.int8)):
        a = hf_checkpoint.aligned_empty(shape, dtype)
        assert (a.shape, a.dtype, a.flags.c_contiguous) == (shape, np.dtype(dtype), True)
        assert a.ctypes.data % hf_checkpoint.HOST_ALIGNMENT == 0
        a[...] = 3
        assert np.all(a == 3)
    assert hf_checkpoint.aligned_empty((0, 4), np.float32).shape == (0, 4)  # no empty map
    placed_from = {}
    place = hf_checkpoint._place

    def recorded(value, sharding, *name):
        out = place(value, sharding, *name)
        placed_from[value.ctypes.data] = out
        return out

    monkeypatch.setattr(hf_checkpoint, "_place", recorded)
    params = load_model(checkpoint, stacked=True).params
    assert jax.default_backend() == "cpu"
    for name, array in params["layers"].items():
        assert placed_from[array.unsafe_buffer_pointer()] is array, name

"""`jpaged convert`: an HF directory becomes an Orbax model directory that loads to the same
params (one device here; restores into shards are covered by test_tensor_parallel), with
quantized weights too (int8 / fp8 at load, one device and T = 2 in a worker process)."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from numpy_checkpoints import make_llama_checkpoint

from jpaged.entrypoints.cli import main
from models.loader import load_hf_model, load_model
from models.orbax_checkpoint import convert_hf_to_orbax

TP = "('kv', 'rep')"
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
STORAGE = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}


def test_convert_cli_round_trip(tiny_checkpoints, tmp_path):
    out = tmp_path / "orbax"
    src = tiny_checkpoints["qwen2"]  # biases: every optional tensor kind is written
    assert main(["convert", "--from-hf", str(src), "--out", str(out), "--dtype", "float32"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "params",
        "tokenizer.json",
    ]
    ours, ref = load_model(out), load_hf_model(src, dtype="float32")
    assert ours.config == ref.config and ours.eos_token_ids == ref.eos_token_ids
    assert ours.tokenizer.to_str() == ref.tokenizer.to_str()
    flat_ours = dict(zip(*_flat(ours.params), strict=True))
    flat_ref = dict(zip(*_flat(ref.params), strict=True))
    assert flat_ours.keys() == flat_ref.keys()
    for k, v in flat_ref.items():
        assert flat_ours[k].dtype == v.dtype, k
        np.testing.assert_array_equal(np.asarray(flat_ours[k]), np.asarray(v), err_msg=k)


def test_convert_refuses_existing_checkpoint(tiny_checkpoints, tmp_path, capsys):
    argv = ["convert", "--from-hf", str(tiny_checkpoints["llama"]), "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    assert main(argv) == 2
    assert "already holds an Orbax checkpoint (params/)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def numpy_orbax(tmp_path_factory):
    """(HF directory, its Orbax conversion in float32): a tiny numpy-written Llama (D 64, 4
    query and 2 KV heads of 16, F 128, 2 layers, untied LM head), no torch needed."""
    root = tmp_path_factory.mktemp("numpy_orbax")
    hf = make_llama_checkpoint(root / "hf")
    return hf, convert_hf_to_orbax(hf, root / "orbax", dtype="float32")


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_orbax_equals_quantized_hf(numpy_orbax, method, stacked):
    """quantization= on an Orbax checkpoint gives exactly the HF directory's params: the
    projections' q and per-channel scales, and the float32 embedding, norms and LM head."""
    hf, orbax = numpy_orbax
    names, leaves = _flat(load_model(orbax, quantization=method, stacked=stacked).params)
    ref_names, ref_leaves = _flat(load_model(hf, quantization=method, stacked=stacked).params)
    assert names == ref_names
    for name, ours, ref in zip(names, leaves, ref_leaves, strict=True):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, name
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref), err_msg=name)
    layers = ["['layers']"] if stacked else ["['layers'][0]", "['layers'][1]"]
    quantized = {f"{layer}['{w}'].q" for layer in layers for w in PROJECTIONS}
    dtypes = dict(zip(names, (a.dtype for a in leaves), strict=True))
    assert {n for n, dtype in dtypes.items() if dtype == STORAGE[method]} == quantized
    assert {dtype for n, dtype in dtypes.items() if n not in quantized} == {np.dtype(np.float32)}
    shapes = dict(zip(names, (a.shape for a in leaves), strict=True))
    wq = layers[0] + "['wq']"
    assert shapes[wq + ".q"] == (2,) * stacked + (64, 4, 16)
    assert shapes[wq + ".scale"] == (2,) * stacked + (1, 4, 16)
    assert shapes["['embed']"] == (2048, 64) and shapes["['lm_head']"] == (64, 2048)


def test_quantized_orbax_refusals(numpy_orbax, tmp_path):
    """An unknown method, expert parallelism, and a param whose shape config.json does not
    give (F 128 stored, 64 in the config): one line naming the param."""
    _, orbax = numpy_orbax
    with pytest.raises(ValueError, match=r"quantization must be one of int8, fp8 .*'int4'"):
        load_model(orbax, quantization="int4")
    with pytest.raises(ValueError, match="expert parallelism is not supported for Orbax"):
        load_model(orbax, quantization="int8", expert_parallel=True)
    edited = tmp_path / "orbax"
    shutil.copytree(orbax, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ValueError) as e:
        load_model(edited, quantization="int8")
    assert str(e.value) == (
        f"{edited / 'params'}/layers.0.w_gate: shape [64, 128], expected [64, 64] from config.json"
    )


def test_quantized_orbax_engine_tokens_equal_hf(numpy_orbax):
    """Greedy tokens of an int8-weight engine on the Orbax directory equal the HF one's."""
    from jpaged import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(40, 70))]
    tokens = {}
    for model in numpy_orbax:
        llm = LLM(model=str(model), quantization="int8", max_num_seqs=4, max_model_len=64)
        tokens[model.name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["orbax"] == tokens["hf"]
    assert [len(t) for t in tokens["hf"]] == [8, 8, 8]


@pytest.mark.parametrize("load", ["int8_stacked", "fp8_stacked", "int8_per_layer"])
def test_quantized_orbax_under_tp2_equals_hf(orbax_quant_results, load):
    """T = 2 (tp_checkpoint: D 64, 8 query and 4 KV heads of 8, F 128, 2 layers): every
    array of the Orbax load has the HF load's sharding and values; per-channel scales split
    with the column-parallel output channels, replicated on row-parallel wo."""
    res = orbax_quant_results[load]
    assert res["same_paths"] and res["different"] == []
    lists = 1 if load.endswith("stacked") else 2  # stacked: one [2, ...] array per name
    assert res["params"] == lists * (7 * 2 + 2) + 3  # (q, scale) x 7, 2 norms; embed, LM head, norm
    if "layout" in res:
        assert res["layout"] == res["hf_layout"]
        assert res["layout"]["wq.scale"] == [f"P(None, None, {TP}, None)", [2, 1, 4, 8]]
        assert res["layout"]["wo.scale"] == ["P(None, None, None, None)", [2, 1, 1, 64]]


def _flat(tree):
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(p) for p, _ in leaves], [x for _, x in leaves]

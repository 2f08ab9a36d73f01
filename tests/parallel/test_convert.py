"""`jpaged convert`: an HF directory becomes an Orbax model directory that loads to the same
params (one device here; restores into shards are covered by test_tensor_parallel)."""

from __future__ import annotations

import numpy as np

from jpaged.entrypoints.cli import main
from models.loader import load_hf_model, load_model


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


def _flat(tree):
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(p) for p, _ in leaves], [x for _, x in leaves]

"""load_hf_model against transformers' own state_dict, and its error messages."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import ARCHS, load_torch_model, make_tiny_checkpoint
from safetensors.numpy import load_file, save_file

from models.config import RopeScaling
from models.demo import random_llama_params
from models.loader import load_hf_model, save_hf_model


def _expected_params(state_dict, cfg) -> dict:
    """The params layout built straight from a torch state_dict, independent of the loader."""
    sd = {k: v.detach().numpy() for k, v in state_dict.items()}
    d, hq, hkv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_norm": sd[p + "input_layernorm.weight"],
            "post_attn_norm": sd[p + "post_attention_layernorm.weight"],
            "wq": sd[p + "self_attn.q_proj.weight"].T.reshape(d, hq, dh),
            "wk": sd[p + "self_attn.k_proj.weight"].T.reshape(d, hkv, dh),
            "wv": sd[p + "self_attn.v_proj.weight"].T.reshape(d, hkv, dh),
            "wo": sd[p + "self_attn.o_proj.weight"].T.reshape(hq, dh, d),
            "w_gate": sd[p + "mlp.gate_proj.weight"].T,
            "w_up": sd[p + "mlp.up_proj.weight"].T,
            "w_down": sd[p + "mlp.down_proj.weight"].T,
        }
        if cfg.attention_bias:
            layer["bq"] = sd[p + "self_attn.q_proj.bias"].reshape(hq, dh)
            layer["bk"] = sd[p + "self_attn.k_proj.bias"].reshape(hkv, dh)
            layer["bv"] = sd[p + "self_attn.v_proj.bias"].reshape(hkv, dh)
        if cfg.qk_norm:
            layer["q_norm"] = sd[p + "self_attn.q_norm.weight"]
            layer["k_norm"] = sd[p + "self_attn.k_norm.weight"]
        layers.append(layer)
    expected = {
        "embed": sd["model.embed_tokens.weight"],
        "layers": layers,
        "final_norm": sd["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        expected["lm_head"] = sd["lm_head.weight"].T
    return expected


def _assert_same_tree(actual, expected) -> None:
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for (path, a), e in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected)
    ):
        name = jax.tree_util.keystr(path)
        assert a.shape == e.shape, name
        assert a.dtype == e.dtype, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_params_equal_torch_state_dict(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    loaded = load_hf_model(path, dtype="float32")
    torch_model = load_torch_model(path)
    _assert_same_tree(loaded.params, _expected_params(torch_model.state_dict(), loaded.config))
    assert loaded.path == path
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.get_vocab_size() == loaded.config.vocab_size
    assert loaded.eos_token_ids == loaded.config.eos_token_ids == (1,)


def test_config_flags_per_arch(tiny_checkpoints):
    cfgs = {arch: load_hf_model(tiny_checkpoints[arch]).config for arch in ARCHS}
    assert cfgs["llama"].architecture == "LlamaForCausalLM"
    assert cfgs["llama"].rope_scaling is None
    assert cfgs["llama"].rope_theta == 10000.0
    assert not cfgs["llama"].tie_word_embeddings

    assert cfgs["llama3"].rope_theta == 500000.0
    assert cfgs["llama3"].rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    assert cfgs["llama3"].tie_word_embeddings
    assert "lm_head" not in load_hf_model(tiny_checkpoints["llama3"]).params

    assert cfgs["mistral"].architecture == "MistralForCausalLM"
    assert cfgs["qwen2"].attention_bias and not cfgs["qwen2"].qk_norm
    assert cfgs["qwen2"].sliding_window is None
    assert cfgs["qwen3"].qk_norm and not cfgs["qwen3"].attention_bias
    assert (cfgs["qwen3"].head_dim, cfgs["qwen3"].hidden_size) == (32, 64)
    for cfg in cfgs.values():
        assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)
        assert cfg.rms_norm_eps == 1e-5
        assert cfg.max_position_embeddings == 512


def test_default_dtype_is_float32_on_cpu(tiny_checkpoints):
    assert jax.default_backend() == "cpu"
    params = load_hf_model(tiny_checkpoints["llama"]).params
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype("float32")}


@pytest.mark.parametrize("dtype", ["bfloat16", jnp.bfloat16])
def test_bf16_override(tiny_checkpoints, dtype):
    f32 = load_hf_model(tiny_checkpoints["qwen2"], dtype="float32").params
    bf16 = load_hf_model(tiny_checkpoints["qwen2"], dtype=dtype).params
    expected = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(jnp.bfloat16), f32)
    _assert_same_tree(bf16, expected)


def test_bf16_checkpoint_loads(tmp_path):
    """A checkpoint stored in bfloat16 (as most published ones are) loads to the same values."""
    path = make_tiny_checkpoint(tmp_path / "m", "llama", dtype="bfloat16")
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].dtype == jnp.bfloat16
    loaded = load_hf_model(path, dtype="float32")
    expected = tensors["model.embed_tokens.weight"].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(loaded.params["embed"]), expected)


def test_sharded_checkpoint_loads_identically(tmp_path, tiny_checkpoints):
    path = make_tiny_checkpoint(tmp_path / "sharded", "qwen2", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    sharded = load_hf_model(path, dtype="float32").params
    single = load_hf_model(tiny_checkpoints["qwen2"], dtype="float32").params
    _assert_same_tree(sharded, single)


def test_save_hf_model_round_trip(tmp_path):
    params = random_llama_params(
        seed=3, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48, vocab=100
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "vocab_size": 100,
        "eos_token_id": 7,
    }
    save_hf_model(tmp_path, config, params)
    loaded = load_hf_model(tmp_path, dtype="float32")
    _assert_same_tree(loaded.params, params)
    assert loaded.tokenizer is None  # no tokenizer.json: documented, not an error
    assert loaded.eos_token_ids == (7,)  # no generation_config.json: config.json's


# --- errors: each names the file and the field or tensor -------------------------------------


@pytest.fixture
def llama_copy(tmp_path, tiny_checkpoints):
    path = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del cfg[key]
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, edit):
    file = str(path / "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope: model directory not found"):
        load_hf_model(tmp_path / "nope")


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json: file not found"):
        load_hf_model(llama_copy)


def test_corrupt_config(llama_copy):
    (llama_copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ValueError, match=r"config\.json: not readable JSON"):
        load_hf_model(llama_copy)


def test_config_not_an_object(llama_copy):
    (llama_copy / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object, got list"):
        load_hf_model(llama_copy)


def test_unsupported_architecture(llama_copy):
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"config\.json: architecture 'GPT2LMHeadModel'"):
        load_hf_model(llama_copy)


def test_missing_config_field(llama_copy):
    _edit_config(llama_copy, hidden_size=None)
    with pytest.raises(ValueError, match=r"config\.json: missing required field 'hidden_size'"):
        load_hf_model(llama_copy)


def test_unsupported_rope_type(llama_copy):
    # ("yarn" was the example until DeepSeek-V3 and gpt-oss brought it in: issue 56)
    _edit_config(llama_copy, rope_parameters={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match=r"config\.json: rope_parameters type 'dynamic'"):
        load_hf_model(llama_copy)


def test_llama3_rope_missing_field(llama_copy):
    _edit_config(llama_copy, rope_parameters={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match=r"missing field 'low_freq_factor'"):
        load_hf_model(llama_copy)


def test_old_style_rope_scaling(llama_copy):
    """transformers 4.x configs: top-level rope_theta and rope_scaling."""
    _edit_config(
        llama_copy,
        rope_parameters=None,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    cfg = load_hf_model(llama_copy).config
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling.factor == 8.0


def test_missing_tensor(llama_copy):
    _edit_tensors(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj"
    ):
        load_hf_model(llama_copy)


def test_wrongly_shaped_tensor(llama_copy):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)

    _edit_tensors(llama_copy, edit)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has "
        r"shape \[64, 64\], expected \[32, 64\]",
    ):
        load_hf_model(llama_copy)


def test_unexpected_tensor(llama_copy):
    """An o_proj bias the layout cannot hold must not be dropped silently."""

    def edit(t):
        t["model.layers.0.self_attn.o_proj.bias"] = np.ones(64, np.float32)

    _edit_tensors(llama_copy, edit)
    with pytest.raises(
        ValueError, match=r"unexpected tensor\(s\) 'model\.layers\.0\.self_attn\.o_proj\.bias'"
    ):
        load_hf_model(llama_copy)


@pytest.mark.parametrize("cut", ["truncated", "garbage"])
def test_corrupt_safetensors(llama_copy, cut):
    file = llama_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-100] if cut == "truncated" else b"not a safetensors file at all")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_hf_model(llama_copy)


def test_missing_weights(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors"):
        load_hf_model(llama_copy)


def test_missing_shard(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"index\.json: shard '{shard}' not found"):
        load_hf_model(path)


def test_tensor_missing_from_shard(tmp_path):
    """The index names a shard that does not hold the tensor."""
    path = make_tiny_checkpoint(tmp_path / "m", "llama", max_shard_size="20KB")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = shards[0]
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{shards[0]}: cannot read tensor 'model\.norm\.weight'"):
        load_hf_model(path)


def test_missing_tokenizer_gives_none(llama_copy):
    (llama_copy / "tokenizer.json").unlink()
    loaded = load_hf_model(llama_copy)
    assert loaded.tokenizer is None
    assert loaded.eos_token_ids == (1,)


def test_corrupt_tokenizer(llama_copy):
    (llama_copy / "tokenizer.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a readable tokenizer"):
        load_hf_model(llama_copy)


def test_eos_from_generation_config_wins(llama_copy):
    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    loaded = load_hf_model(llama_copy)
    assert loaded.eos_token_ids == loaded.config.eos_token_ids == (1, 5)


def test_eos_from_config_without_generation_config(llama_copy):
    (llama_copy / "generation_config.json").unlink()
    _edit_config(llama_copy, eos_token_id=[1, 9])
    assert load_hf_model(llama_copy).eos_token_ids == (1, 9)


def test_corrupt_generation_config(llama_copy):
    (llama_copy / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"generation_config\.json: not readable JSON"):
        load_hf_model(llama_copy)


def test_bad_eos_in_generation_config(llama_copy):
    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match=r"generation_config\.json: field 'eos_token_id'"):
        load_hf_model(llama_copy)


def test_bad_dtype(tiny_checkpoints):
    with pytest.raises(ValueError, match="floating point"):
        load_hf_model(tiny_checkpoints["llama"], dtype="int32")
    with pytest.raises(ValueError, match="not a dtype"):
        load_hf_model(tiny_checkpoints["llama"], dtype="float99")

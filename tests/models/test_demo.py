"""The built-in demo model: deterministic, loadable by us and by transformers, real tokenizer."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from checkpoints import load_torch_model

from models.demo import (
    BOS_TOKEN,
    DEMO_VERSION,
    EOS_TOKEN,
    build_tokenizer,
    default_cache_dir,
    ensure_demo_model,
)
from models.loader import load_hf_model

DEMO_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]


def test_demo_is_byte_identical_across_builds(tmp_path, demo_model_dir):
    other = ensure_demo_model(tmp_path / "other")
    assert sorted(os.listdir(other)) == DEMO_FILES
    for name in DEMO_FILES:
        assert (other / name).read_bytes() == (demo_model_dir / name).read_bytes(), name


def test_demo_uses_cache_dir_env_and_is_built_once(demo_model_dir):
    assert demo_model_dir == default_cache_dir()
    assert demo_model_dir.name == DEMO_VERSION
    assert demo_model_dir.parent == type(demo_model_dir)(os.environ["JPAGED_CACHE_DIR"])
    before = (demo_model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model() == demo_model_dir
    assert (demo_model_dir / "model.safetensors").stat().st_mtime_ns == before
    # cpu_kernels: the CPU attention kernel's build cache (pallas_kernels/cpu_kernel.py).
    kept = (DEMO_VERSION, "cpu_kernels")
    leftovers = [p.name for p in demo_model_dir.parent.iterdir() if p.name not in kept]
    assert leftovers == []  # the temp build dir was renamed, not left behind


def test_demo_config(demo_model_dir):
    loaded = load_hf_model(demo_model_dir)
    cfg = loaded.config
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (256, 4, 4, 2)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (64, 688, 2048)
    assert not cfg.tie_word_embeddings
    assert cfg.vocab_size == loaded.tokenizer.get_vocab_size() == 2048
    assert cfg.bos_token_id == loaded.tokenizer.token_to_id(BOS_TOKEN) == 0
    assert loaded.eos_token_ids == (loaded.tokenizer.token_to_id(EOS_TOKEN),) == (1,)
    gen = json.loads((demo_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1]


def test_demo_params_match_transformers(demo_model_dir):
    """transformers reads the same weights: save_hf_model's name mapping is HF's."""
    loaded = load_hf_model(demo_model_dir, dtype="float32")
    sd = {k: v.numpy() for k, v in load_torch_model(demo_model_dir).state_dict().items()}
    p = loaded.params
    np.testing.assert_array_equal(np.asarray(p["embed"]), sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(p["lm_head"]), sd["lm_head.weight"].T)
    wq = sd["model.layers.3.self_attn.q_proj.weight"].T.reshape(256, 4, 64)
    np.testing.assert_array_equal(np.asarray(p["layers"][3]["wq"]), wq)
    wo = sd["model.layers.2.self_attn.o_proj.weight"].T.reshape(4, 64, 256)
    np.testing.assert_array_equal(np.asarray(p["layers"][2]["wo"]), wo)
    np.testing.assert_array_equal(
        np.asarray(p["layers"][1]["w_down"]), sd["model.layers.1.mlp.down_proj.weight"].T
    )
    np.testing.assert_array_equal(np.asarray(p["final_norm"]), sd["model.norm.weight"])


def test_demo_logits_not_degenerate(demo_model_dir):
    """Random weights at std 0.02 still give distinct, finite next-token logits per input."""
    import torch

    model = load_torch_model(demo_model_dir)
    tok = load_hf_model(demo_model_dir).tokenizer
    ids = torch.tensor([tok.encode("The weather was cold that morning").ids])
    with torch.no_grad():
        logits = model(ids).logits[0].numpy()
    assert np.isfinite(logits).all()
    assert logits.std(axis=-1).min() > 1e-3
    assert len(set(logits.argmax(axis=-1).tolist())) > 1


@pytest.mark.parametrize(
    "text", ["héllo 世界 🙂", "The quick brown fox.", "  two  spaces\n\ttab", "", "ünïcödé ☃"]
)
def test_tokenizer_round_trips(text):
    tok = build_tokenizer()
    enc = tok.encode(text)
    assert enc.ids[0] == tok.token_to_id(BOS_TOKEN)
    assert tok.decode(enc.ids, skip_special_tokens=True) == text
    assert tok.decode(enc.ids[1:]) == text


def test_tokenizer_splits_multibyte_characters():
    """Characters unseen in training become one token per UTF-8 byte, so a decoder that
    streams tokens must hold back incomplete characters."""
    tok = build_tokenizer()
    ids = tok.encode("世", add_special_tokens=False).ids
    assert len(ids) == len("世".encode()) == 3
    assert "\ufffd" in tok.decode(ids[:1])
    assert tok.decode(ids) == "世"


def test_tokenizer_merges_english_and_is_stable():
    tok = build_tokenizer()
    assert tok.encode("the", add_special_tokens=False).ids == [tok.token_to_id("the")]
    assert tok.to_str() == build_tokenizer().to_str()


def test_demo_params_are_all_finite(demo_model_dir):
    params = load_hf_model(demo_model_dir).params
    for leaf in jax.tree_util.tree_leaves(params):
        assert np.isfinite(np.asarray(leaf)).all()

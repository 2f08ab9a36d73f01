"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE): the routing function on hand-made
logits, the grouped experts against a per-expert loop, and our logits and greedy tokens
(alone and through the engine) equal to transformers' for tiny random checkpoints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_families import (
    FAMILIES,
    MAX_TOKENS,
    engine_greedy,
    hf_greedy,
    hf_logits,
    paged_logits,
    prompts,
    save_tiny,
)

from models import moe
from models.config import ModelConfig
from models.loader import load_hf_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    return {f: save_tiny(root / f, f) for f in FAMILIES}


def test_route_softmax_then_top_k():
    logits = jnp.asarray(
        [[0.0, np.log(3.0), np.log(6.0), 0.0], [np.log(4.0), 0.0, 0.0, np.log(4.0) + 1e-3]],
        jnp.float32,
    )
    weights, ids = moe.route(logits, 2, norm_topk_prob=False)
    np.testing.assert_array_equal(ids, [[2, 1], [3, 0]])
    assert ids.dtype == jnp.int32
    np.testing.assert_allclose(weights[0], [6 / 11, 3 / 11], rtol=1e-6)  # of all 4 experts
    weights, _ = moe.route(logits, 2, norm_topk_prob=True)
    np.testing.assert_allclose(weights[0], [2 / 3, 1 / 3], rtol=1e-6)  # of the top 2
    np.testing.assert_allclose(weights.sum(-1), [1.0, 1.0], rtol=1e-6)
    _, ids = moe.route(logits, 4, norm_topk_prob=False)
    np.testing.assert_array_equal(ids[0], [2, 1, 0, 3])  # ties: the lower id first


def _moe_cfg(**kwargs) -> ModelConfig:
    fields = {
        "architecture": "MixtralForCausalLM",
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 6,
        "num_layers": 1,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 6,
        "norm_topk_prob": True,
    }
    return ModelConfig(**{**fields, **kwargs})


def test_grouped_experts_equal_a_loop_over_experts():
    cfg = _moe_cfg()
    rng = np.random.default_rng(0)
    layer = {
        "router": rng.normal(size=(8, 4)).astype(np.float32),
        "w_gate_exps": rng.normal(size=(4, 8, 6)).astype(np.float32),
        "w_up_exps": rng.normal(size=(4, 8, 6)).astype(np.float32),
        "w_down_exps": rng.normal(size=(4, 6, 8)).astype(np.float32),
    }
    x = rng.normal(size=(11, 8)).astype(np.float32)
    out = np.asarray(jax.jit(lambda x, p: moe.moe_mlp(x, p, cfg, jax.nn.silu))(x, layer))
    weights, ids = moe.route(jnp.asarray(x @ layer["router"]), 2, True)
    want = np.zeros_like(x)
    for t in range(11):
        for w, e in zip(np.asarray(weights[t]), np.asarray(ids[t]), strict=True):
            h = np.asarray(jax.nn.silu(x[t] @ layer["w_gate_exps"][e])) * (
                x[t] @ layer["w_up_exps"][e]
            )
            want[t] += w * (h @ layer["w_down_exps"][e])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_bad_expert_configs_are_clear_errors():
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be <= num_experts \(4\)"):
        _moe_cfg(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="expert parallelism needs experts"):
        _moe_cfg(num_experts=0, expert_parallel=True)
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 6,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 4,
        "decoder_sparse_step": 2,
    }
    with pytest.raises(ValueError, match="dense MLP layers among the expert layers"):
        ModelConfig.from_hf_config(hf)


@pytest.mark.needs_torch
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(checkpoints, family):
    loaded = load_hf_model(checkpoints[family])
    assert loaded.config.num_experts == 8 and loaded.config.num_experts_per_tok == 2
    ids = prompts(loaded.config.vocab_size)[1]
    ref = hf_logits(checkpoints[family], ids)
    np.testing.assert_allclose(paged_logits(loaded, [len(ids)], ids), ref, atol=1e-5, rtol=0)
    # chunked prefill then decode steps, layers scanned
    steps = paged_logits(loaded, [13, 12] + [1] * (len(ids) - 25), ids, stacked=True)
    np.testing.assert_allclose(steps, ref, atol=1e-5, rtol=0)


@pytest.mark.needs_torch
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_tokens_equal_transformers(checkpoints, family):
    path = checkpoints[family]
    token_prompts = prompts(160)
    want = hf_greedy(path, token_prompts)
    got = engine_greedy(
        path,
        token_prompts,
        MAX_TOKENS,
        max_num_seqs=2,
        max_model_len=64,
        max_num_batched_tokens=16,
        page_size=4,
        num_pages=40,
        enable_prefix_caching=True,
        compilation_cache_dir=None,
    )
    assert got == want

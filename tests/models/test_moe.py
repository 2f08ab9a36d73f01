"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE): the routing function on hand-made
logits, the grouped experts against a per-expert loop, and our logits and greedy tokens
(alone and through the engine) equal to transformers' for tiny random checkpoints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dense_families import hf_logits, paged_logits, preempted_greedy
from moe_families import FAMILIES, MAX_TOKENS, engine_greedy, hf_greedy, prompts, save_tiny

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


@pytest.mark.parametrize(
    "sizes", [[3, 0, 9, 1, 0], [0, 0, 17, 0, 0], [1, 1, 1, 1, 1], [8, 0, 0, 0, 8]]
)
def test_blocked_grouped_mlp_equals_ragged_dot(sizes):
    """The CPU's block loop equals jax.lax.ragged_dot's grouped matmuls on every row of a
    group (groups empty, of one row, of more than a block, and 3 rows of no group after
    them, which come out zero)."""
    rng = np.random.default_rng(1)
    num_rows, dim, inter = sum(sizes) + 3, 8, 6
    xs = rng.normal(size=(num_rows, dim)).astype(np.float32)
    w_gate, w_up = (rng.normal(size=(5, dim, inter)).astype(np.float32) for _ in range(2))
    w_down = rng.normal(size=(5, inter, dim)).astype(np.float32)
    sizes = np.asarray(sizes, np.int32)
    out = {
        blocked: np.asarray(jax.jit(lambda *a, b=blocked: moe.grouped_mlp(
            *a, jax.nn.silu, blocked=b))(xs, w_gate, w_up, w_down, sizes))
        for blocked in (True, False)
    }  # fmt: skip
    n = int(sizes.sum())
    np.testing.assert_allclose(out[True][:n], out[False][:n], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[True][n:], 0.0)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_blocked_grouped_mlp_dequantizes_each_block_expert(method):
    """Quantized experts in the block loop (each block's expert dequantized in the loop) give
    what their dequantized arrays give."""
    from models.quantization import QUANTIZED_PARAMS, dequantize, quantize

    rng = np.random.default_rng(2)
    sizes = np.asarray([3, 0, 9, 1, 5], np.int32)
    xs = rng.normal(size=(int(sizes.sum()), 8)).astype(np.float32)
    shapes = {"w_gate_exps": (5, 8, 6), "w_up_exps": (5, 8, 6), "w_down_exps": (5, 6, 8)}
    quantized = [
        jax.tree.map(jnp.asarray, quantize(rng.normal(size=s), QUANTIZED_PARAMS[n], method))
        for n, s in shapes.items()
    ]
    dequantized = [dequantize(w) for w in quantized]
    out = [
        np.asarray(jax.jit(lambda x, ws, sz: moe.grouped_mlp(
            x, *ws, sz, jax.nn.silu, blocked=True))(xs, ws, sizes))
        for ws in (quantized, dequantized)
    ]  # fmt: skip
    np.testing.assert_allclose(out[0], out[1], rtol=1e-6, atol=1e-6)


def test_block_rows_follow_the_mean_group_size():
    # decode (32 sequences x top-4 over 32 experts), a mid step, prefill of 2,048 tokens
    assert [moe.block_rows(m, 32) for m in (128, 1000, 8192, 1)] == [8, 32, 128, 8]


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


@pytest.mark.needs_torch
@pytest.mark.parametrize(
    ("family", "mode"), [("qwen3moe", "swap"), ("mixtral", "recompute"), ("olmoe", "swap")]
)
def test_a_forced_preemption_changes_no_token(checkpoints, family, mode):
    """A pool too small for both running sequences: one is preempted (recomputed or swapped
    to host and back) and the tokens are still transformers'."""
    ours, theirs = preempted_greedy(checkpoints[family], 160, mode, compilation_cache_dir=None)
    assert ours == theirs


def _write_gguf(hf_dir, out, family: str) -> None:
    """The checkpoint as llama.cpp's converter writes it: its experts stacked per layer
    ([E, out, in]), the llama architecture's (Mixtral's) Q/K rows permuted for GGML's rope."""
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"qwen3moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}[family]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    writer = gguf.GGUFWriter(str(out), arch)
    u32 = {
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "block_count": cfg["num_hidden_layers"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "expert_count": num_experts,
        "expert_used_count": cfg["num_experts_per_tok"],
    }
    if cfg.get("moe_intermediate_size"):
        u32["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    for key, value in u32.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    if cfg.get("clip_qkv"):
        writer.add_float32(f"{arch}.attention.clamp_kqv", cfg["clip_qkv"])
    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate": "ffn_gate_inp",
        "block_sparse_moe.gate": "ffn_gate_inp",
    }
    experts = {
        "gate_proj": "gate",
        "up_proj": "up",
        "down_proj": "down",
        "w1": "gate",
        "w3": "up",
        "w2": "down",
    }
    out_tensors = {}
    for name, w in tensors.items():
        if name in names:
            out_tensors[names[name]] = w
            continue
        parts = name.split(".")
        i, rest = parts[2], ".".join(parts[3:-1])
        if ".experts." in name:
            e, proj = int(parts[-3]), parts[-2]
            stack = out_tensors.setdefault(
                f"blk.{i}.ffn_{experts[proj]}_exps.weight",
                np.zeros((num_experts, *w.shape), w.dtype),
            )
            stack[e] = w
            continue
        short = layer_names[rest]
        if arch == "llama" and short in ("attn_q", "attn_k"):
            h = heads if short == "attn_q" else kv_heads
            w = w.reshape(h, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(w.shape)
        out_tensors[f"blk.{i}.{short}.weight"] = w
    for name, w in out_tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.needs_torch
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_equals_hf_directory(checkpoints, tmp_path, family):
    from models.loader import load_model

    path = tmp_path / f"{family}.gguf"
    _write_gguf(checkpoints[family], path, family)
    from_gguf, from_hf = load_model(path), load_hf_model(checkpoints[family])
    assert from_gguf.config.architecture == from_hf.config.architecture
    for name in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "qk_norm",
        "qk_norm_full",
        "clip_qkv",
    ):
        assert getattr(from_gguf.config, name) == getattr(from_hf.config, name), name
    flat_gguf = jax.tree_util.tree_leaves_with_path(from_gguf.params)
    flat_hf = jax.tree_util.tree_leaves_with_path(from_hf.params)
    assert [p for p, _ in flat_gguf] == [p for p, _ in flat_hf]
    for (p, a), (_, b) in zip(flat_gguf, flat_hf, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))


@pytest.mark.needs_torch
def test_int8_experts_give_the_logits_of_their_dequantized_weights(checkpoints):
    """--quantization int8 keeps the experts int8 (the block loop dequantizes each block's
    expert): the logits of every position equal those of the same weights dequantized
    up front."""
    import dataclasses

    from models.quantization import QuantizedWeight, dequantize

    loaded = load_hf_model(checkpoints["qwen3moe"], quantization="int8")
    experts = loaded.params["layers"][0]["w_gate_exps"]
    assert isinstance(experts, QuantizedWeight) and experts.dtype == jnp.int8
    plain = jax.tree.map(
        dequantize, loaded.params, is_leaf=lambda a: isinstance(a, QuantizedWeight)
    )
    ids = np.random.default_rng(3).integers(0, 160, 21).tolist()
    want = paged_logits(dataclasses.replace(loaded, params=plain), [21], ids)
    for chunks in ([21], [9, 1, 11]):
        np.testing.assert_allclose(paged_logits(loaded, chunks, ids), want, atol=1e-5, rtol=0)


@pytest.mark.needs_torch
def test_orbax_conversion_equals_hf_directory(checkpoints, tmp_path):
    from models.loader import load_model
    from models.orbax_checkpoint import convert_hf_to_orbax

    convert_hf_to_orbax(checkpoints["olmoe"], tmp_path / "olmoe")
    restored, from_hf = load_model(tmp_path / "olmoe"), load_hf_model(checkpoints["olmoe"])
    same = jax.tree_util.tree_map(
        lambda a, b: bool(np.array_equal(a, b)), restored.params, from_hf.params
    )
    assert all(jax.tree_util.tree_leaves(same))


def test_enable_expert_parallel_flag():
    """vLLM's flag reaches ParallelConfig, and the loaders' ModelConfig only for a model with
    experts (a dense model ignores it)."""
    import argparse

    from jpaged.entrypoints.engine_args import (
        add_engine_flags,
        engine_config_from_args,
        engine_kwargs,
    )

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--tensor-parallel-size", "4", "--enable-expert-parallel"])
    config = engine_config_from_args(**engine_kwargs(args))
    assert config.parallel.enable_expert_parallel and config.parallel.tensor_parallel_size == 4
    assert not engine_config_from_args().parallel.enable_expert_parallel
    assert _moe_cfg().with_expert_parallel(True).expert_parallel
    dense = _moe_cfg(num_experts=0, architecture="LlamaForCausalLM")
    assert dense.with_expert_parallel(True) is dense

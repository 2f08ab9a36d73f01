"""GLM-4.5 MoE (Glm4MoeForCausalLM): DeepSeek-V3-style routing against a numpy reference
(group selection, a bias that chooses but never weighs, scaling), the config fields, the
params with a dense first layer stacked and unstacked, and our logits and greedy tokens
equal to transformers' for tiny random checkpoints (a dense first layer, 4 groups of 2
experts of which 2 are eligible, a shared expert, partial rotary 0.5, q/k/v bias, with and
without the per-head q/k norm): whole and chunked prefill and decode steps (logits), and
through one engine prefix hits, a preemption by recompute, greedy forks and beam search."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import stack_expert
from dense_families import hf_logits, paged_logits
from moe_families import hf_greedy, prompts, save_tiny

from models import moe
from models.config import ModelConfig
from models.hf_checkpoint import WEIGHTS_FILE, save_hf_model
from models.llama import init_params, layer_at, stack_layers, unstack_layers
from models.loader import load_hf_model
from models.sharding import param_specs

FAMILIES = ("glm4moe", "glm4moe_qk_norm")
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("glm4moe")
    return {f: save_tiny(root / f, f) for f in FAMILIES}


def _reference_route(logits, bias, k, groups, topk_groups, norm, scaling):
    """transformers' Glm4MoeTopkRouter in numpy, one token at a time."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    weights, ids = [], []
    for s in scores:
        choice = s + bias
        per_group = choice.reshape(groups, -1)
        group_scores = np.sort(per_group, axis=1)[:, -2:].sum(axis=1)
        eligible = np.argsort(-group_scores, kind="stable")[:topk_groups]
        masked = np.full_like(per_group, -np.inf)
        masked[eligible] = per_group[eligible]
        chosen = np.argsort(-masked.reshape(-1), kind="stable")[:k]
        w = s[chosen]
        if norm:
            w = w / (w.sum() + 1e-20)
        weights.append(w * scaling)
        ids.append(chosen)
    return np.asarray(weights), np.asarray(ids)


@pytest.mark.parametrize(
    ("groups", "topk_groups", "k", "norm", "scaling"),
    [(4, 2, 3, True, 2.5), (8, 3, 4, False, 1.0), (1, 1, 2, True, 1.0), (4, 4, 2, True, 1.5)],
)
def test_route_grouped_equals_a_numpy_reference(groups, topk_groups, k, norm, scaling):
    rng = np.random.default_rng(groups * 10 + k)
    logits = rng.normal(0, 2, (37, 16)).astype(np.float32)
    bias = rng.normal(0, 0.5, 16).astype(np.float32)
    weights, ids = moe.route_grouped(
        jnp.asarray(logits), jnp.asarray(bias), k, num_groups=groups,
        topk_groups=topk_groups, norm_topk_prob=norm, scaling=scaling,
    )  # fmt: skip
    want_w, want_ids = _reference_route(logits, bias, k, groups, topk_groups, norm, scaling)
    assert ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(want_ids, -1))
    order, want_order = np.argsort(ids, -1), np.argsort(want_ids, -1)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, -1),
        np.take_along_axis(want_w, want_order, -1),
        rtol=1e-5,
    )


def test_the_bias_chooses_the_experts_but_does_not_weigh_them():
    """Expert 3's bias lifts it over expert 1 (sigmoid 0.5 + 0.4 > sigmoid(1) = 0.73); its
    weight is its unbiased score, renormalised with expert 0's and scaled."""
    logits = jnp.asarray([[2.0, 1.0, -3.0, 0.0]], jnp.float32)
    bias = jnp.asarray([0.0, 0.0, 0.0, 0.4], jnp.float32)
    sig = 1 / (1 + np.exp(-np.asarray([2.0, 1.0, -3.0, 0.0])))
    weights, ids = moe.route_grouped(logits, None, 2, norm_topk_prob=False)
    np.testing.assert_array_equal(ids, [[0, 1]])
    np.testing.assert_allclose(weights, [sig[[0, 1]]], rtol=1e-6)
    weights, ids = moe.route_grouped(logits, bias, 2, norm_topk_prob=True, scaling=3.0)
    np.testing.assert_array_equal(ids, [[3, 0]])  # in decreasing biased score: 0.9, 0.88
    np.testing.assert_allclose(weights, [3.0 * sig[[3, 0]] / sig[[3, 0]].sum()], rtol=1e-6)


def test_only_the_best_groups_are_eligible():
    """Groups {0,1} {2,3} {4,5}: group scores are the sums of their two experts (1.5, 1.05,
    1.3 in sigmoid space below), so with topk_group 2 the single best expert 2 (group 1)
    is passed over for experts of groups 0 and 2."""
    scores = np.asarray([0.75, 0.75, 0.95, 0.10, 0.65, 0.65])
    logits = jnp.asarray([np.log(scores / (1 - scores))], jnp.float32)
    _, ids = moe.route_grouped(logits, None, 2, num_groups=3, topk_groups=2)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 1]
    _, ids = moe.route_grouped(logits, None, 3, num_groups=3, topk_groups=2)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 1, 4]
    _, ids = moe.route_grouped(logits, None, 2, num_groups=3, topk_groups=3)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 2]


def _hf_config(**overrides) -> dict:
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 4,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "attention_bias": True,
        "use_qk_norm": True,
        "rope_theta": 10000.0,
    }
    return {**config, **overrides}


def test_config_fields_and_transformers_defaults():
    cfg = ModelConfig.from_hf_config(_hf_config())
    assert (cfg.num_experts, cfg.num_expert_groups, cfg.topk_groups) == (8, 4, 2)
    assert (cfg.num_dense_layers, cfg.num_shared_experts, cfg.shared_intermediate_size) == (1, 1, 4)
    assert cfg.moe_scoring == "sigmoid" and cfg.router_bias and cfg.routed_scaling_factor == 2.5
    assert cfg.qk_norm and cfg.attention_bias
    assert cfg.partial_rotary_factor == 0.5 and cfg.rotary_dim == 4  # transformers' default
    assert [cfg.has_experts(i) for i in range(3)] == [False, True, True]
    cfg = ModelConfig.from_hf_config(_hf_config(use_qk_norm=False, partial_rotary_factor=1.0))
    assert not cfg.qk_norm and cfg.rotary_dim == 8
    with pytest.raises(ValueError, match=r"topk_group \(5\) must be in \[1, n_group \(4\)\]"):
        ModelConfig.from_hf_config(_hf_config(topk_group=5))
    with pytest.raises(ValueError, match=r"n_group \(3\) must be a positive integer dividing"):
        ModelConfig.from_hf_config(_hf_config(n_group=3))
    with pytest.raises(ValueError, match="topk_method 'greedy' is not supported"):
        ModelConfig.from_hf_config(_hf_config(topk_method="greedy"))
    with pytest.raises(ValueError, match=r"first_k_dense_replace \(4\) exceeds the 3 layers"):
        ModelConfig.from_hf_config(_hf_config(first_k_dense_replace=4))


def test_a_dense_first_layer_stacks_over_the_layers_that_have_each_param():
    """Stacked, w_gate holds layer 0 only and the expert params layers 1 and 2; layer_at and
    unstack_layers give each layer back; the shard specs have the params' structure."""
    cfg = ModelConfig.from_hf_config(_hf_config())
    params = init_params(cfg)
    stacked = stack_layers(params)["layers"]
    assert stacked["w_gate"].shape == (1, 16, 24) and stacked["wq"].shape == (3, 16, 2, 8)
    assert stacked["router"].shape == (2, 16, 8) and stacked["router_bias"].shape == (2, 8)
    assert stacked["w_gate_shared"].shape == (2, 16, 4)
    for i, layer in enumerate(unstack_layers({"layers": stacked})["layers"]):
        assert layer.keys() == params["layers"][i].keys()
        for name, value in layer.items():
            np.testing.assert_array_equal(value, params["layers"][i][name])
    traced = jax.jit(lambda layers, i: layer_at(layers, i, experts=True))(stacked, 2)
    np.testing.assert_array_equal(traced["router"], params["layers"][2]["router"])
    for stacked_specs, tree in ((False, params), (True, stack_layers(params))):
        specs = param_specs(cfg, 2, stacked=stacked_specs)
        assert jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)) == jax.tree.structure(tree)  # fmt: skip


def test_stacked_layers_give_the_unrolled_logits_and_mtp_layers_are_left_unread(tmp_path):
    """A checkpoint saved from random params (with a multi-token-prediction layer 3 as GLM-4.5
    ships one) loads; its logits scanned (the dense layer unrolled first) equal unrolled."""
    from safetensors.numpy import load_file, save_file

    config = _hf_config(num_nextn_predict_layers=1)
    cfg = ModelConfig.from_hf_config(config)
    params = jax.tree.map(np.asarray, init_params(cfg, scale=0.3))
    save_hf_model(tmp_path, config, params)
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((16, 32), np.float32)
    save_file(tensors, str(tmp_path / WEIGHTS_FILE), metadata={"format": "pt"})
    loaded = load_hf_model(tmp_path)
    ids = np.random.default_rng(1).integers(0, 32, 9).tolist()
    unrolled = paged_logits(loaded, [9], ids)
    assert np.abs(unrolled).max() > 0.1
    np.testing.assert_allclose(paged_logits(loaded, [5, 1, 1, 1, 1], ids, stacked=True),
                               unrolled, atol=1e-5, rtol=0)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(_hf_config()))  # no MTP layer named
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) 'model.layers.3.eh_proj"):
        load_hf_model(tmp_path)


def test_int8_and_orbax_loads_of_a_dense_first_layer(tmp_path):
    """--quantization int8, stacked on the host over the layers that have each param (the
    shared experts quantized too), gives the logits of its weights dequantized; an Orbax
    conversion restores the same params, stacked or not."""
    from models.orbax_checkpoint import convert_hf_to_orbax
    from models.quantization import QuantizedWeight, dequantize

    config = _hf_config()
    cfg = ModelConfig.from_hf_config(config)
    save_hf_model(tmp_path / "hf", config, jax.tree.map(np.asarray, init_params(cfg, scale=0.3)))
    loaded = load_hf_model(tmp_path / "hf", quantization="int8", stacked=True)
    layers = loaded.params["layers"]
    assert isinstance(layers["w_gate_shared"], QuantizedWeight)
    assert layers["w_gate"].q.shape == (1, 16, 24) and layers["w_up_exps"].q.shape == (2, 8, 16, 4)
    plain = jax.tree.map(dequantize, loaded.params, is_leaf=lambda a: isinstance(a, QuantizedWeight))
    ids = np.random.default_rng(2).integers(0, 32, 9).tolist()
    want = paged_logits(dataclasses.replace(loaded, params=plain), [9], ids)
    np.testing.assert_allclose(paged_logits(loaded, [9], ids), want, atol=1e-5, rtol=0)

    from models.loader import load_model

    convert_hf_to_orbax(tmp_path / "hf", tmp_path / "orbax")
    from_hf = load_hf_model(tmp_path / "hf")
    for stacked in (False, True):
        restored = load_model(tmp_path / "orbax", stacked=stacked).params
        want = stack_layers(from_hf.params) if stacked else from_hf.params
        assert jax.tree.structure(restored) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.needs_torch
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(checkpoints, family):
    loaded = load_hf_model(checkpoints[family])
    assert loaded.config.num_dense_layers == 1 and loaded.config.qk_norm == family.endswith("norm")
    ids = prompts(loaded.config.vocab_size)[1]
    ref = hf_logits(checkpoints[family], ids)
    np.testing.assert_allclose(paged_logits(loaded, [len(ids)], ids), ref, atol=1e-5, rtol=0)
    # chunked prefill then decode steps, the expert layers scanned
    steps = paged_logits(loaded, [13, 12] + [1] * (len(ids) - 25), ids, stacked=True)
    np.testing.assert_allclose(steps, ref, atol=1e-5, rtol=0)


def _write_gguf(hf_dir, out) -> None:
    """The checkpoint as llama.cpp's converter (Glm4MoeModel) writes it: experts stacked per
    layer, Q/K not permuted (GGML's NeoX rope is rotate-half), block_count counting an MTP
    block after the decoder (one of its tensors here), the rotary dims of a head."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    num_layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    writer = gguf.GGUFWriter(str(out), "glm4moe")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(num_layers + 1)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(int(head_dim * cfg["rope_parameters"]["partial_rotary_factor"]))
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    writer.add_expert_weights_norm(cfg["norm_topk_prob"])
    writer.add_uint32("glm4moe.expert_group_count", cfg["n_group"])
    writer.add_uint32("glm4moe.expert_group_used_count", cfg["topk_group"])
    writer.add_nextn_predict_layers(1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, num_layers + 1)
    out_tensors = {}
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        if ".experts." in name:  # blk.N.ffn_{gate,up,down}_exps [E, out, in]
            stack_expert(out_tensors, names, name, w, cfg["n_routed_experts"])
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        out_tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    out_tensors[f"blk.{num_layers}.nextn.eh_proj.weight"] = np.zeros((64, 128), np.float32)
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
    _write_gguf(checkpoints[family], path)
    from_gguf, from_hf = load_model(path), load_hf_model(checkpoints[family])
    fields = dataclasses.asdict(from_hf.config)
    fields.update(eos_token_ids=(), bos_token_id=None)  # the tokenizer's, none written here
    assert from_gguf.config.rms_norm_eps == pytest.approx(fields.pop("rms_norm_eps"))  # float32
    assert {k: v for k, v in dataclasses.asdict(from_gguf.config).items() if k in fields} == fields
    flat_gguf = jax.tree_util.tree_leaves_with_path(from_gguf.params)
    flat_hf = jax.tree_util.tree_leaves_with_path(from_hf.params)
    assert [p for p, _ in flat_gguf] == [p for p, _ in flat_hf]
    for (p, a), (_, b) in zip(flat_gguf, flat_hf, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))


# One engine for the greedy, forks and beams runs below (one set of programs): 14 pages of 4
# tokens hold one 52-token sequence, not two of the long prompts (33 + 16 and 26 + 16 tokens
# need 13 + 11 pages), so one is preempted and recomputed.
ENGINE = {
    "max_num_seqs": 2, "max_model_len": 52, "max_num_batched_tokens": 16,
    "min_token_bucket": 16, "page_size": 4, "num_pages": 14, "compilation_cache_dir": None,
}  # fmt: skip


@pytest.mark.needs_torch
def test_engine_tokens_forks_and_beams_equal_transformers(checkpoints):
    """One engine: five prompts sharing a prefix (prefix hits), chunked prefill, 16 greedy
    tokens each, in a pool too small for two long sequences (a preemption by recompute); then
    n = 2 greedy forks (copy-on-write of the prompt's partial page) each give transformers'
    greedy tokens of the prompt alone, and a beam search of width 2 (beams that diverge, fork
    and drop) gives transformers' beams, sums of logprobs within 1e-4; the pool is whole
    after each."""
    from dense_families import check_forks_and_beams

    from jpaged import LLM, SamplingParams

    path = checkpoints["glm4moe_qk_norm"]
    token_prompts = prompts(160)
    llm = LLM(str(path), **ENGINE)
    outs = llm.generate(token_prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    stats = llm.stats()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, token_prompts, MAX_TOKENS)
    assert stats["num_preemptions"] >= 1 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["pages_used"] == 0
    prompt = np.random.default_rng(4).integers(0, 160, 11).tolist()  # a partial 3rd page
    check_forks_and_beams(llm, path, prompt, MAX_TOKENS)

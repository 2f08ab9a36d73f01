"""Gemma 2 and Gemma 3 (text) on the paged pool equal transformers (issue 28.1).

Tiny random models from transformers' own config classes, with sliding-window and full
attention layers (window 8, prompts up to 37 tokens), soft-capping (Gemma 2), a local rope
base and linear scaling on the global layers (Gemma 3). Logits within 1e-4 of transformers'
eager float32 model, scanned (grouped by the layer pattern) and unrolled, prefilled in one
shot, in chunks and by decode steps; greedy tokens through the engine equal transformers'
exactly with several prompts sharing a prefix, fewer slots than prompts and a small pool.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from dense_families import (
    engine_greedy,
    hf_greedy,
    hf_logits,
    paged_logits,
    preempted_greedy,
    prompts_with_shared_prefix,
    save_tiny,
)

from models.config import ModelConfig
from models.llama import layer_pattern
from models.loader import load_hf_model

VOCAB = 320
WINDOW = 8
_SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": WINDOW,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # activations large enough for the soft caps to bend them
}
CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **_SMALL,
        num_hidden_layers=4,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    # 8 layers of the 5 local : 1 global pattern: one scanned group of 6, two layers after.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_SMALL,
        num_hidden_layers=8,
        query_pre_attn_scalar=16,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {name: save_tiny(root / name, make()) for name, make in CONFIGS.items()}


def test_layer_kinds_follow_transformers(checkpoints):
    g2 = load_hf_model(checkpoints["gemma2"]).config
    assert g2.windows == (WINDOW, None, WINDOW, None)
    assert (g2.attn_soft_cap, g2.final_soft_cap, g2.sm_scale) == (2.0, 3.0, 24**-0.5)
    assert layer_pattern(g2) == 2
    g3 = load_hf_model(checkpoints["gemma3"]).config
    assert g3.windows == (WINDOW,) * 5 + (None,) + (WINDOW,) * 2
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling.factor) == (1e6, 1e4, 2.0)
    assert g3.qk_norm and g3.tie_word_embeddings and layer_pattern(g3) == 6


def _hf_dict(**fields):
    base = {
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "sliding_window": 4,
    }
    return {**base, **fields}


def test_config_json_forms():
    # Configs written before transformers listed layer_types: Gemma 3's sliding_window_pattern.
    old = _hf_dict(
        architectures=["Gemma3ForCausalLM"],
        sliding_window_pattern=2,
        rope_theta=5e5,
        rope_local_base_freq=2e4,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    cfg = ModelConfig.from_hf_config(old)
    assert cfg.windows == (4, None, 4, None)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.factor) == (5e5, 2e4, 4.0)
    g2 = ModelConfig.from_hf_config(_hf_dict(architectures=["Gemma2ForCausalLM"]))
    assert g2.windows == (4, None, 4, None) and g2.hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_config(
            _hf_dict(architectures=["Gemma2ForCausalLM"], layer_types=["chunked"] * 4)
        )
    with pytest.raises(ValueError, match="4 entries for 3 layers"):
        ModelConfig.from_hf_config(
            _hf_dict(
                architectures=["Gemma2ForCausalLM"],
                num_hidden_layers=3,
                layer_types=["full_attention"] * 4,
            )
        )
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        ModelConfig.from_hf_config(_hf_dict(architectures=["Gemma2ForCausalLM"], sliding_window=0))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config(
            _hf_dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True)
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints, name):
    path = checkpoints[name]
    loaded = load_hf_model(path)
    ids = np.random.default_rng(1).integers(0, VOCAB, 37).tolist()
    ref = hf_logits(path, ids)
    for stacked in (False, True):
        np.testing.assert_allclose(
            paged_logits(loaded, [37], ids, stacked=stacked), ref, atol=1e-4, rtol=0
        )
    stepwise = paged_logits(loaded, [5, 1, 31], ids, stacked=True)
    np.testing.assert_allclose(stepwise, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_greedy_equals_transformers(checkpoints, name):
    path = checkpoints[name]
    prompts = prompts_with_shared_prefix(VOCAB, [9, 20, 26, 33, 14], prefix=8)
    ours = engine_greedy(
        path,
        prompts,
        8,
        max_num_seqs=2,
        page_size=4,
        num_pages=24,
        max_model_len=64,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
    )
    assert ours == hf_greedy(path, prompts, 8)


@pytest.mark.parametrize(("name", "mode"), [("gemma2", "recompute"), ("gemma3", "swap")])
def test_a_forced_preemption_changes_no_token(checkpoints, name, mode):
    """A pool too small for both running sequences: one is preempted (its pages recomputed
    or swapped to host and back) and the tokens are still transformers'. The window layers'
    pages before the window are freed (docs/memory.md, "Hybrid paging"): Gemma 3's 8 paging
    groups still preempt with 13 pages of every layer and a 32-token budget."""
    pool = {"gemma3": {"num_pages": 13, "max_num_batched_tokens": 32}}.get(name, {})
    ours, theirs = preempted_greedy(checkpoints[name], VOCAB, mode, **pool)
    assert ours == theirs


TP_PROMPTS = prompts_with_shared_prefix(VOCAB, [12, 21, 30], prefix=4, seed=2)


@pytest.fixture(scope="module")
def tensor_parallel_tokens(checkpoints) -> dict:
    """Each model's greedy tokens at T = 1 and 2 on 2 CPU devices, from one worker process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    paths = [str(checkpoints[name]) for name in CONFIGS]
    res = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("dense_tp_worker.py")),
            json.dumps(TP_PROMPTS),
            "6",
            *paths,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
        check=False,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    by_path = json.loads(res.stdout.strip().splitlines()[-1])
    return {name: by_path[path] for name, path in zip(CONFIGS, paths, strict=True)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tensor_parallel_2_gives_the_single_device_tokens(
    checkpoints, tensor_parallel_tokens, name
):
    """Soft-capping, post-norms and the grouped layers under shard_map on 2 CPU devices."""
    tokens = tensor_parallel_tokens[name]
    assert tokens["2"] == tokens["1"]
    assert tokens["1"] == hf_greedy(checkpoints[name], TP_PROMPTS, 6)

"""Mixture-of-experts models under tensor parallelism (each expert's intermediate dim split)
and expert parallelism (whole experts split): on 8 simulated CPU devices, every family's
greedy tokens through the engine equal transformers' at T = 2, and with
--enable-expert-parallel at T = 2 and 4, where each device holds E / T experts (GLM-4.5 MoE
too: its dense first layer and shared expert split over their intermediate dim)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from moe_families import FAMILIES, hf_greedy, prompts, save_tiny

pytestmark = pytest.mark.needs_torch  # transformers writes the checkpoints and the reference


def _run(root: Path, *families: str) -> dict:
    """transformers' tokens per family and the worker's results for the families."""
    want = {f: hf_greedy(save_tiny(root / f, f), prompts(160)) for f in families}
    res = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("moe_worker.py")), str(root), *families],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ),
        check=False,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return {"want": want, "got": got}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every family's results from one worker process (each process's start and jax's import
    cost seconds)."""
    return _run(tmp_path_factory.mktemp("moe"), *FAMILIES, "glm4moe", "deepseek_v3", "gpt_oss")


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_transformers_and_experts_are_split(results, family):
    """Greedy tokens at TP 2, EP 2 and EP 4 equal transformers'; stacked expert weights
    [layers, E, D, F] per device: TP splits F, expert parallelism splits the 8 experts."""
    for t, ep in [(2, False), (2, True), (4, True)]:
        got = results["got"][f"{family}/{t}/{ep}"]
        assert got["tokens"] == results["want"][family], (t, ep)
        assert got["pages_used"] == 0
    f = 32 if family == "qwen3moe" else 48
    layouts = {k: v["layout"] for k, v in results["got"].items()}
    assert layouts[f"{family}/2/False"]["w_gate_exps"][1] == [3, 8, 64, f // 2]
    assert layouts[f"{family}/2/False"]["w_down_exps"][1] == [3, 8, f // 2, 64]
    assert layouts[f"{family}/2/True"]["w_gate_exps"][1] == [3, 4, 64, f]
    assert layouts[f"{family}/4/True"]["w_gate_exps"][1] == [3, 2, 64, f]
    assert layouts[f"{family}/4/True"]["w_down_exps"][1] == [3, 2, f, 64]
    assert layouts[f"{family}/4/True"]["router"][1] == [3, 64, 8]  # replicated


def test_glm4_moe_tokens_equal_transformers_and_experts_are_split(results):
    """GLM-4.5 MoE (a dense first layer, grouped routing, a shared expert): greedy tokens at
    TP 2, EP 2 and EP 4 equal transformers'; the expert params are stacked over the 2 expert
    layers, the dense MLP over the first layer only, and the dense and shared MLPs split
    their intermediate dim under either layout."""
    for t, ep in [(2, False), (2, True), (4, True)]:
        got = results["got"][f"glm4moe/{t}/{ep}"]
        assert got["tokens"] == results["want"]["glm4moe"], (t, ep)
        assert got["pages_used"] == 0
    layouts = {k: v["layout"] for k, v in results["got"].items()}
    assert layouts["glm4moe/2/False"]["w_gate_exps"][1] == [2, 8, 64, 16]
    assert layouts["glm4moe/2/True"]["w_gate_exps"][1] == [2, 4, 64, 32]
    assert layouts["glm4moe/4/True"]["w_down_exps"][1] == [2, 2, 32, 64]
    assert layouts["glm4moe/4/True"]["router"][1] == [2, 64, 8]  # replicated
    assert layouts["glm4moe/2/True"]["w_gate"][1] == [1, 64, 48]
    assert layouts["glm4moe/4/True"]["w_gate_shared"][1] == [2, 64, 8]


def test_deepseek_v3_tokens_equal_transformers_with_heads_split(results):
    """DeepSeek-V3 (latent attention, a dense first layer, grouped routing, a shared expert):
    greedy tokens at TP 2, EP 2 and EP 4 equal transformers'; the query and up-projections
    split over the 4 heads, the latent's projection replicated with the one-head pool."""
    for t, ep in [(2, False), (2, True), (4, True)]:
        got = results["got"][f"deepseek_v3/{t}/{ep}"]
        assert got["tokens"] == results["want"]["deepseek_v3"], (t, ep)
        assert got["pages_used"] == 0
    layouts = {k: v["layout"] for k, v in results["got"].items()}
    assert layouts["deepseek_v3/2/False"]["wkv_b"][1] == [3, 24, 2, 28]
    assert layouts["deepseek_v3/4/True"]["wq_b"][1] == [3, 48, 1, 24]
    assert layouts["deepseek_v3/4/True"]["wkv_a"][1] == [3, 64, 32]  # replicated
    assert layouts["deepseek_v3/4/True"]["w_gate_exps"][1] == [2, 2, 64, 32]


def test_gpt_oss_tokens_equal_transformers_and_experts_are_split(results):
    """gpt-oss (sinks, window and full layers, biased experts with the clamped SwiGLU):
    greedy tokens at TP 2, EP 2 and EP 4 equal transformers'; the sinks split with the query
    heads, the gate/up biases with the experts' F or the experts, the down bias replicated
    (added once after the all-reduce)."""
    for t, ep in [(2, False), (2, True), (4, True)]:
        got = results["got"][f"gpt_oss/{t}/{ep}"]
        assert got["tokens"] == results["want"]["gpt_oss"], (t, ep)
        assert got["pages_used"] == 0
    layouts = {k: v["layout"] for k, v in results["got"].items()}
    assert layouts["gpt_oss/2/False"]["w_gate_exps"][1] == [4, 4, 64, 16]
    assert layouts["gpt_oss/2/False"]["b_gate_exps"][1] == [4, 4, 16]
    assert layouts["gpt_oss/4/True"]["w_gate_exps"][1] == [4, 1, 64, 32]
    assert layouts["gpt_oss/4/True"]["b_gate_exps"][1] == [4, 1, 32]
    assert layouts["gpt_oss/4/True"]["b_down_exps"][1] == [4, 4, 64]  # replicated
    assert layouts["gpt_oss/4/True"]["sinks"][1] == [4, 1]  # 4 heads over 4 devices

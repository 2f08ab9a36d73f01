"""scripts/profile_step.py's table: each compiled op of a step summed into its part, the CPU
kernels' calls (ffi_calls) told apart by their result's shape."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "profile_step.py"
_spec = importlib.util.spec_from_file_location("profile_step", _PATH)
profile_step = importlib.util.module_from_spec(_spec)
sys.modules["profile_step"] = profile_step
_spec.loader.exec_module(profile_step)

# SmolLM2-135M's shapes: 9 query heads and 3 KV heads of 64, hidden 576, MLP 1,536.
CFG = types.SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                            intermediate_size=1536, vocab_size=49152)
SWITCH = "while/body/closed_call/cond/branch_16_fun/cond/branch_0_fun/"


def test_the_cpu_kernels_calls_go_to_their_parts_by_result_shape():
    rows = [  # (origin, ms per step, runs per step) as op_profile gives them (a 24-row step)
        ("while/body/closed_call/cond/branch_0_fun/ffi_call  f32[24,9,64]", 35.5, 30),
        ("cond/branch_0_fun/ffi_call  f32[24,49152]", 9.75, 1),
        ("cond/branch_0_fun/ffi_call  (s32[24]", 1.25, 1),
        (SWITCH + "ffi_call  f32[24,960]", 0.25, 1),
        (SWITCH + "ffi_call  f32[24,3072]", 0.5, 1),
        (SWITCH + "ffi_call  f32[24,576]", 0.375, 2),
        ("while/body/closed_call/cond/branch_3_fun/ffi_call  f32[24,3072]", 0.5, 1),
        ("while/body/closed_call/scatter  f32[3,1475040,64]", 0.625, 60),
        ("while/body/closed_call/cond/branch_7_fun/rsqrt  f32[24]", 0.125, 2),
    ]
    assert profile_step.step_parts(rows, CFG) == {
        "attention kernel": 35.5,
        "LM head": 9.75,
        "sampling": 1.25,
        "q/k/v projections": 0.25,
        "MLP gate and up": 1.0,
        "o projection and MLP down": 0.375,
        "K/V writes": 0.625,
        "norms, rope, residual, act": 0.125,
    }


def test_a_kernel_call_of_another_shape_is_not_taken_for_a_part():
    # head_dim 128 is not this model's: not its attention, and no product has that width
    rows = [("while/body/closed_call/cond/branch_0_fun/ffi_call  f32[24,9,128]", 2.0, 30),
            (SWITCH + "ffi_call  f32[24,1536]", 0.5, 1)]
    assert profile_step.step_parts(rows, CFG) == {"other kernel calls": 2.5}

"""scripts/step_program_digest.py: the digest sees instructions, not where they came from."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

_PATH = Path(__file__).parents[2] / "scripts" / "step_program_digest.py"
_spec = importlib.util.spec_from_file_location("step_program_digest", _PATH)
digest_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digest_mod)


def _compiled(f) -> str:
    x = jnp.ones((4, 8), jnp.float32)
    return jax.jit(f).lower(x).compile().as_text()


def test_the_same_computation_from_other_source_lines_has_one_digest():
    def first(x):
        return jnp.tanh(x) * 2.0

    def second(x):  # another function, other lines: other metadata, same instructions
        y = jnp.tanh(x)
        return y * 2.0

    a, b = _compiled(first), _compiled(second)
    assert a != b  # the texts differ (op names, source lines) ...
    assert digest_mod.instructions_digest(a) == digest_mod.instructions_digest(b)  # ... not what runs


def test_another_instruction_changes_the_digest():
    a = _compiled(lambda x: jnp.tanh(x) * 2.0)
    b = _compiled(lambda x: jnp.tanh(x) * 3.0)
    assert digest_mod.instructions_digest(a) != digest_mod.instructions_digest(b)
    assert len(digest_mod.instructions_digest(a)) == 16

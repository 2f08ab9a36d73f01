"""Which accelerator a pytest run asks for with -m (tests/conftest.py acts on it)."""

from __future__ import annotations

# `-m gpu` / `-m tpu`: the accelerator's platform (jax's name for it), and the platforms a
# caller's JAX_PLATFORMS may name for it.
ACCELERATORS = {"gpu": ("cuda", ("cuda", "rocm", "gpu")), "tpu": ("tpu", ("tpu",))}


def accelerator_of_run(markexpr: str) -> str | None:
    """The marker "gpu" or "tpu" when the -m expression selects that marker's tests and no unmarked test
    (`-m gpu`, `-m "gpu and not slow"`), else None (the default `not slow and not gpu ...`,
    no -m at all, `-m "gpu or not gpu"`)."""
    if not markexpr:
        return None
    from _pytest.mark.expression import Expression

    expression = Expression.compile(markexpr)
    if expression.evaluate(lambda name, **kwargs: False):
        return None  # it runs unmarked (CPU) tests too
    for marker in ACCELERATORS:
        if expression.evaluate(lambda name, marker=marker, **kwargs: name == marker):
            return marker
    return None

"""The sampler's fast CPU forms equal the jnp operations they replace, exactly.

_argmax (a max, then a float min over indices) must pick what jnp.argmax picks: the first
maximum, with ties and infinities, and the first NaN of a row that has one. _log_softmax_at
must equal jax.nn.log_softmax gathered at the chosen tokens. On the CPU the vocabulary passes
of an all-greedy step run a kernel (pallas_kernels/cpu_kernel.py greedy): the same argmax and
maxima, log-sum-exp to float32 rounding, NaN where jnp gives NaN. A seeded row's draw depends on
its key, its token count and its logits only, never on the batch's size or its row in it (the
CPU's token buckets pad one decoding row to 4 rows, eight to 8, more to 16...). Runs without
torch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.sample.sampler import (
    SamplingInputs,
    _argmax,
    _log_softmax_at,
    _vocab_passes,
    sample,
    seeds_to_key_data,
)
from pallas_kernels import cpu_kernel


def rows_with_ties_and_specials(seed: int, vocab: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, size=(16, vocab)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, 7] = np.inf
    x[3, [5, vocab - 1]] = np.inf  # tied infinities: the first wins
    x[4, 9] = np.nan
    x[5, [vocab - 2, 3]] = np.nan  # the first NaN wins, wherever the maximum is
    x[6, :] = np.nan
    x[7, vocab - 1] = 100.0  # the maximum at the last index
    return x


@pytest.mark.parametrize("vocab", [1, 2, 17, 49152])
def test_argmax_equals_jnp_argmax(vocab):
    if vocab < 10:
        x = np.random.default_rng(vocab).integers(-1, 2, size=(8, vocab)).astype(np.float32)
    else:
        x = rows_with_ties_and_specials(vocab, vocab)
    got = np.asarray(jax.jit(_argmax)(jnp.asarray(x)))
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32


def test_log_softmax_at_equals_the_full_log_softmax():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 1000)) * 20).astype(np.float32)
    x[0, :500] = -np.inf  # masked entries
    tokens = rng.integers(500, 1000, size=8).astype(np.int32)

    @jax.jit
    def at(x, tokens):
        _, x_max, lse = _vocab_passes(x, x)
        return _log_softmax_at(x, tokens, x_max, lse)

    got = np.asarray(at(jnp.asarray(x), jnp.asarray(tokens)))
    full = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
    np.testing.assert_allclose(got, full[np.arange(8), tokens], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab", [1, 17, 49152])
def test_the_cpu_kernels_vocabulary_passes_equal_the_jnp_ones(monkeypatch, vocab):
    """Rows with ties, infinities and NaN (in the picked-from logits and, shifted, in the
    model's), rows of 1 to 49,152 entries; the kernel's call is in the CPU program."""
    x = rows_with_ties_and_specials(vocab, max(vocab, 10))[:, :vocab]
    model = np.roll(x, 3, axis=0) * 1.5
    model[8] = np.random.default_rng(1).standard_normal(vocab) * 30  # a wide range
    args = (jnp.asarray(x), jnp.asarray(model))
    fn = jax.jit(_vocab_passes)
    assert cpu_kernel.available()
    assert cpu_kernel.GREEDY_TARGET in fn.lower(*args).as_text()
    kernel = [np.asarray(a) for a in fn(*args)]
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    plain = jax.jit(lambda a, b: _vocab_passes(a, b))  # traced afresh
    assert cpu_kernel.GREEDY_TARGET not in plain.lower(*args).as_text()
    want = [np.asarray(a) for a in plain(*args)]
    np.testing.assert_array_equal(kernel[0], want[0])  # argmax, exactly
    numbers = ~np.isnan(model).any(axis=1)  # a NaN row's maximum is XLA's choice; its
    np.testing.assert_array_equal(kernel[1][numbers], want[1][numbers])  # lse is NaN
    np.testing.assert_allclose(kernel[2], want[2], rtol=2e-6, atol=2e-6, equal_nan=True)
    assert np.isnan(want[2]).any() and np.isfinite(want[2]).any()
    chosen = [(model[np.arange(len(x)), r[0]] - r[1]) - r[2] for r in (kernel, want)]
    np.testing.assert_allclose(chosen[0], chosen[1], rtol=2e-6, atol=2e-6, equal_nan=True)


_SAMPLE = jax.jit(functools.partial(sample, num_logprobs=0))  # one compile per batch size


def _seeded_rows(num: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """num sampled rows (every third greedy), each with its own logits, seed, token count
    and filters."""
    rng = np.random.default_rng(seed)
    return {
        "logits": (rng.standard_normal((num, vocab)) * 3).astype(np.float32),
        "temperature": np.where(np.arange(num) % 3 == 0, 0.0, 0.9).astype(np.float32),
        "top_k": np.where(np.arange(num) % 4 == 1, 50, 0).astype(np.int32),
        "top_p": np.where(np.arange(num) % 5 == 2, 0.8, 1.0).astype(np.float32),
        "seed": rng.integers(0, 2**63, num, dtype=np.uint64),
        "num_generated": rng.integers(0, 100, num).astype(np.int32),
    }


def _sample_rows(rows: dict[str, np.ndarray]) -> np.ndarray:
    num = len(rows["logits"])
    inputs = SamplingInputs(
        temperature=jnp.asarray(rows["temperature"]),
        top_k=jnp.asarray(rows["top_k"]),
        top_p=jnp.asarray(rows["top_p"]),
        min_p=jnp.zeros(num, jnp.float32),
        key_data=jnp.asarray(seeds_to_key_data([int(s) for s in rows["seed"]])),
        num_generated=jnp.asarray(rows["num_generated"]),
        banned=jnp.full((num, 1), -1, jnp.int32),
    )
    return np.asarray(_SAMPLE(jnp.asarray(rows["logits"]), inputs).tokens)


def test_a_seeded_rows_draw_is_the_same_in_every_batch_size_and_row():
    """Eight rows sampled in one batch of 8, then in reverse order, then each at another row
    of a batch of 4 (the other rows drawn afresh): the same token every time. The draw is
    keyed by seed and position: another token count or seed draws another token for most
    rows."""
    vocab = 2000
    rows = _seeded_rows(8, vocab, seed=0)
    want = _sample_rows(rows)
    reverse = _sample_rows({k: v[::-1].copy() for k, v in rows.items()})
    assert np.array_equal(reverse[::-1], want)
    others = _seeded_rows(4, vocab, seed=1)
    for i in range(8):
        batch = {k: v.copy() for k, v in others.items()}
        for k, column in batch.items():
            column[(i + 3) % 4] = rows[k][i]
        assert _sample_rows(batch)[(i + 3) % 4] == want[i], i
    sampled = rows["temperature"] > 0
    later = _sample_rows({**rows, "num_generated": rows["num_generated"] + 1})
    reseeded = _sample_rows({**rows, "seed": rows["seed"] ^ np.uint64(1)})
    assert np.array_equal(later[~sampled], want[~sampled])  # greedy rows ignore the key
    assert (later != want)[sampled].sum() >= 4 and (reseeded != want)[sampled].sum() >= 4

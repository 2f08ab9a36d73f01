"""The sampler's fast CPU forms equal the jnp operations they replace, exactly.

_argmax (a max, then a float min over indices) must pick what jnp.argmax picks: the first
maximum, with ties and infinities, and the first NaN of a row that has one. _log_softmax_at
must equal jax.nn.log_softmax gathered at the chosen tokens. Runs without torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.sample.sampler import _argmax, _log_softmax_at


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
    got = np.asarray(jax.jit(_log_softmax_at)(jnp.asarray(x), jnp.asarray(tokens)))
    full = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
    np.testing.assert_allclose(got, full[np.arange(8), tokens], rtol=1e-6, atol=1e-6)

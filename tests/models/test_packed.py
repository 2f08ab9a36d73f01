"""Weights packed for the CPU's matmul kernel (models/packed.py, pallas_kernels/cpu_matmul.cc):
the kernel's products equal float64 numpy's over row counts that cross its tiles of 6 rows,
every last tile of 1-5 rows and its blocks of 240 rows, contraction lengths of any size and one
or several panels;
packing is a pure relayout (unpack gives w back exactly); dense and columns serve packed and
plain weights alike, and lowered for another platform a packed product holds no CPU call; a
product told how many rows are valid (a step's real tokens) computes those alone and gives
zeros past them, in the kernel and through dense;
switch_layers packs the plain float32 projections and the tied head, and leaves the rest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import packed
from models.llama import switch_layers
from pallas_kernels import cpu_kernel


def _operands(seed, m, k, n):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((k, n)).astype(np.float32))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 32, 245, 300])
@pytest.mark.parametrize("k, n", [(1, 64), (17, 192), (576, 128)])
def test_the_kernel_equals_float64_products(m, k, n):
    assert cpu_kernel.available()
    x, w = _operands(m * k + n, m, k, n)
    got = np.asarray(jax.jit(cpu_kernel.matmul)(jnp.asarray(x), jnp.asarray(cpu_kernel.pack(w))))
    want = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)  # the sum's magnitude
    assert got.shape == (m, n) and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-6)


@pytest.mark.parametrize("m, valid, computed", [
    (32, 17, 17), (32, 31, 31), (32, 8, 8), (32, 0, 0), (32, -3, 0), (32, 40, 32), (4, 3, 3),
    (1, 1, 1), (300, 260, 260), (300, 241, 241),
])
def test_valid_rows_are_computed_and_the_rest_are_zeros(m, valid, computed):
    assert cpu_kernel.available()
    x, w = _operands(m + valid, m, 48, 128)
    want = x.astype(np.float64) @ w.astype(np.float64)
    matmul = jax.jit(cpu_kernel.matmul)
    got = np.asarray(matmul(jnp.asarray(x), jnp.asarray(cpu_kernel.pack(w)), jnp.int32(valid)))
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert np.all(np.abs(got[:computed] - want[:computed]) <= 1e-6 * scale[:computed] + 1e-6)
    np.testing.assert_array_equal(got[computed:], 0.0)
    if computed < m:  # the rows past valid read nothing: NaN there stays out of the result
        x[computed:] = np.nan
        got_nan = np.asarray(matmul(jnp.asarray(x), jnp.asarray(cpu_kernel.pack(w)),
                                    jnp.int32(valid)))
        np.testing.assert_array_equal(got_nan, got)
    pw = packed.pack(jnp.asarray(w))
    through = np.asarray(jax.jit(packed.dense)(jnp.asarray(x), pw, jnp.int32(valid)))
    np.testing.assert_array_equal(through[computed:], 0.0)
    np.testing.assert_allclose(through[:computed], want[:computed], rtol=1e-5, atol=1e-5)


def test_packing_is_a_relayout():
    _, w = _operands(0, 1, 5, 192)
    panels = cpu_kernel.pack(w)
    assert panels.shape == (3, 5, 64) and panels.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(panels[1, 2], w[2, 64:128])
    np.testing.assert_array_equal(np.asarray(cpu_kernel.unpack(panels)), w)
    np.testing.assert_array_equal(np.asarray(cpu_kernel.pack(jnp.asarray(w))), panels)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        cpu_kernel.pack(w[:, :100])


def test_dense_and_columns_serve_packed_and_plain_weights():
    x, w = _operands(1, 6, 32, 128)
    pw = packed.pack(jnp.asarray(w))
    assert isinstance(pw, packed.PackedWeight) and pw.shape == (32, 128)
    assert pw.nbytes == w.nbytes
    x3 = jnp.asarray(x).reshape(2, 3, 32)  # leading dims kept
    got = np.asarray(jax.jit(packed.dense)(x3, pw))
    np.testing.assert_allclose(got.reshape(6, 128), x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(packed.dense(jnp.asarray(x), jnp.asarray(w))), x @ w,
                               rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([0, 63, 64, 127, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(packed.columns)(pw, ids)),
                                  w[:, np.asarray(ids)].T)
    np.testing.assert_array_equal(np.asarray(packed.columns(jnp.asarray(w), ids)),
                                  w[:, np.asarray(ids)].T)
    for odd in (w[:, :100], w.astype(np.float16), w[0]):  # not whole panels, not float32, 1-D
        assert packed.pack(odd) is odd


def test_lowered_for_cuda_a_packed_product_holds_no_cpu_call():
    from tests.pallas_kernels.gpu_target import lower_for_cuda

    x, w = _operands(2, 4, 32, 64)
    args = (jnp.asarray(x), packed.pack(jnp.asarray(w)))
    assert cpu_kernel.MATMUL_TARGET in jax.jit(packed.dense).lower(*args).as_text()
    assert cpu_kernel.MATMUL_TARGET not in lower_for_cuda(packed.dense, args).as_text()


def test_switch_layers_packs_plain_float32_projections_and_the_tied_head():
    rng = np.random.default_rng(3)
    d, hq, dh, f, vocab = 64, 4, 16, 96, 256

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    layer = {"wq": w(d, hq, dh), "wk": w(d, 2, dh), "wv": w(d, 2, dh), "wo": w(hq, dh, d),
             "w_gate": w(d, f), "w_up": w(d, f), "w_down": w(f, d), "input_norm": w(d)}
    params = {"embed": w(vocab, d), "final_norm": w(d),
              "layers": {k: jnp.stack([v, v]) for k, v in layer.items()}}
    switched = switch_layers(params)
    first = switched["layers"][0]
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert isinstance(first[name], packed.PackedWeight), name
    assert first["wo"].shape == (hq * dh, d)
    assert not isinstance(first["input_norm"], packed.PackedWeight)
    head = switched["tied_head"]
    assert isinstance(head, packed.PackedWeight) and head.shape == (d, vocab)
    np.testing.assert_array_equal(np.asarray(cpu_kernel.unpack(head.panels)),
                                  np.asarray(params["embed"]).T)
    plain = switch_layers(params, pack=False)
    assert not any(isinstance(v, packed.PackedWeight) for v in plain["layers"][0].values())
    np.testing.assert_array_equal(
        np.asarray(cpu_kernel.unpack(first["w_gate_up"].panels)),
        np.asarray(plain["layers"][0]["w_gate_up"]))


def test_jpaged_cpu_attention_reference_leaves_weights_unpacked(monkeypatch):
    """The switch that turns the CPU kernels off (pallas_kernels/cpu_kernel.py ENV) keeps the
    plain layout: XLA's dots, as before the kernels."""
    _, w = _operands(4, 1, 16, 64)
    assert isinstance(packed.pack(jnp.asarray(w)), packed.PackedWeight)
    monkeypatch.setenv(cpu_kernel.ENV, "reference")
    plain = jnp.asarray(w)
    assert packed.pack(plain) is plain

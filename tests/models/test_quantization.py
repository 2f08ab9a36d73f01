"""Weight quantization (models/quantization.py, issue 29): exact round trips on hand-made
weights, the quantized linear against the dequantized weight, a GGUF Q8_0 loaded as int8 with
its own blocks, GGUF's 4- to 6-bit block types loaded as int8 without loss (against
gguf.quants.dequantize), a compressed-tensors fp8 checkpoint loaded as stored, the
accelerator formulation lowered for cuda (abstract H200) and tpu, and clear errors for bad
inputs.

gguf 0.19's quants.quantize writes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 but not the K-quants
(NotImplementedError): Q4_K, Q5_K and Q6_K tensors are random bytes of the type
(tests/checkpoints.py write_gguf), every bit pattern being a valid block."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models import quantization as quant
from models.loader import load_model

F8 = ml_dtypes.float8_e4m3fn


def test_int8_per_channel_exact_values():
    # [K=2, N=4]: channel 0 max 1, channel 1 max 4 (negative values), channel 2 all zero,
    # channel 3 a value that rounds half away from the grid.
    w = np.array([[1.0, -2.0, 0.0, 0.5], [0.5, -4.0, 0.0, 0.25]], np.float32)
    qw = quant.quantize(w, (0,), "int8")
    assert qw.q.dtype == np.int8 and qw.scale.dtype == np.float32
    np.testing.assert_array_equal(qw.q, [[127, -64, 0, 127], [64, -127, 0, 64]])
    np.testing.assert_array_equal(
        qw.scale, np.array([[1 / 127, 4 / 127, 1.0, 0.5 / 127]], np.float32)
    )
    deq = quant.dequantize(qw, np.float32)
    np.testing.assert_array_equal(deq[:, 2], [0.0, 0.0])  # zeros stay zeros
    assert deq[0, 0] == np.float32(127) * np.float32(1 / 127)
    assert deq[1, 1] == np.float32(-127) * np.float32(4 / 127)
    assert deq[0, 1] == np.float32(-64) * np.float32(4 / 127)  # -2.015748: the grid's step


def test_saturation_at_the_dtype_max():
    # A float16 scale rounded below max/127 would map the max above 127: clipped to 127.
    w = np.array([[1.0], [0.0]], np.float32)
    scale16 = np.float16(1 / 127)
    assert np.float32(1.0) / np.float32(scale16) > 127  # the rounding this test relies on
    qw = quant.quantize(w, (0,), "int8", group=2, scale_dtype=np.float16)
    np.testing.assert_array_equal(qw.q, [[127], [0]])
    assert qw.scale.dtype == np.float16 and qw.scale[0, 0] == scale16
    # fp8: the channel's max lands exactly on e4m3's largest finite value, 448.
    f = quant.quantize(np.array([[3.0, -0.5], [-6.0, 0.25]], np.float32), (0,), "fp8")
    assert f.q.dtype == F8
    np.testing.assert_array_equal(f.q.astype(np.float32), [[224.0, -448.0], [-448.0, 224.0]])
    np.testing.assert_array_equal(f.scale, np.float32([[6 / 448, 0.5 / 448]]))


def test_groups_along_the_last_contraction_axis():
    # wo-like [H=1, Dh=4, D=2], groups of 2 along Dh: one scale per (head, group, channel).
    w = np.arange(8, dtype=np.float32).reshape(1, 4, 2) - 3.0  # [-3 .. 4]
    qw = quant.quantize(w, (0, 1), "int8", group=2)
    assert qw.scale.shape == (1, 2, 2) and (qw.group, qw.group_axis) == (2, -2)
    np.testing.assert_array_equal(qw.scale[0], np.float32([[3, 2], [3, 4]]) / 127)
    np.testing.assert_array_equal(qw.q[0], [[-127, -127], [-42, 0], [42, 64], [127, 127]])
    # Stacked (a leading layer axis) and indexed back: the same weight.
    stacked = quant.QuantizedWeight(qw.q[None], qw.scale[None], qw.group, qw.group_axis)
    np.testing.assert_array_equal(quant.dequantize(stacked[0]), quant.dequantize(qw))


def test_non_finite_weights_are_refused():
    w = np.ones((4, 3), np.float32)
    w[2, 1] = np.nan
    with pytest.raises(
        ValueError, match=r"wq: cannot quantize a non-finite weight \(nan at index \[2, 1\]\)"
    ):
        quant.quantize(w, (0,), "int8", name="wq")
    w[2, 1] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        quant.quantize(w, (0,), "fp8")
    with pytest.raises(ValueError, match="group size 3 does not divide axis 0"):
        quant.quantize(np.ones((4, 3), np.float32), (0,), group=3)
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8"):
        quant.quantize(np.ones((4, 3), np.float32), (0,), "int4")


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("native", [False, True])
def test_quantized_linear_equals_the_dequantized_weight(method, native):
    """The CPU formulation (dequantize, float dot) and the accelerator one (dot_general over
    the stored values, scaled after) both equal x times the dequantized weight."""
    rng = np.random.default_rng(0)
    cases = [
        ("td,dhk->thk", (5, 32), (32, 2, 8), (0,)),
        ("thk,hkd->td", (5, 2, 8), (2, 8, 32), (0, 1)),
    ]
    for subscripts, x_shape, w_shape, axes in cases:
        x = jnp.asarray(rng.normal(size=x_shape).astype(np.float32))
        w = quant.quantize(rng.normal(size=w_shape).astype(np.float32), axes, method)
        qw = jax.tree.map(jnp.asarray, w)
        want = jnp.einsum(subscripts, x, quant.dequantize(qw), precision="highest")
        got = jax.jit(lambda x, w, s=subscripts: quant.einsum(s, x, w, native=native))(x, qw)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    x = jnp.asarray(rng.normal(size=(3, 32)).astype(np.float32))
    qw = jax.tree.map(jnp.asarray, quant.quantize(rng.normal(size=(32, 16)), (0,), method))
    want = jnp.matmul(x, quant.dequantize(qw), precision="highest")
    np.testing.assert_allclose(quant.matmul(x, qw, native=native), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group,offset", [(32, False), (32, True), (0, False)])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_tied_logits_and_embedding_rows_equal_the_dequantized_table(monkeypatch, group, offset,
                                                                    num_tokens):
    """A quantized tied table (per block of a row, with GGUF's offsets, or per row): the LM
    head's blocks of VOCAB_BLOCK rows (8 here: 5 blocks and 3 rows left over) and the
    whole-table product for one token equal x @ dequantize(table).T; embed_rows dequantizes
    the looked-up rows only, to the table's values exactly."""
    monkeypatch.setattr(quant, "VOCAB_BLOCK", 8)
    rng = np.random.default_rng(3)
    w = quant.quantize(rng.normal(size=(43, 64)), (1,), "int8", group=group,
                       scale_dtype=np.float16)
    if offset:
        w = dataclasses.replace(w, offset=rng.normal(size=w.scale.shape).astype(np.float16))
    table = jax.tree.map(jnp.asarray, w)
    dense = np.asarray(quant.dequantize(w))
    x = rng.normal(size=(num_tokens, 64)).astype(np.float32)
    got = jax.jit(quant.tied_logits)(jnp.asarray(x), table)
    assert got.shape == (num_tokens, 43)
    np.testing.assert_allclose(got, x @ dense.T, rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([42, 0, 7, 7])
    np.testing.assert_array_equal(quant.embed_rows(table, ids, jnp.float32), dense[[42, 0, 7, 7]])
    plain = jnp.asarray(dense)
    np.testing.assert_array_equal(quant.embed_rows(plain, ids, jnp.float32), dense[[42, 0, 7, 7]])


def _lowered(f, args, platform: str) -> tuple[str, list[str]]:
    """jit(f)(*args) lowered for platform ("cuda": an abstract H200, or "tpu"): the line of
    main's signature and the dot_general lines."""
    from tests.pallas_kernels.gpu_target import h200

    traced = jax.jit(f).trace(*args)
    if platform == "cuda":
        with h200():
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
    else:
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    return main, [line for line in text.splitlines() if "dot_general" in line]


def test_quantized_matmul_lowers_for_cuda_and_tpu():
    """The accelerator formulation lowers for an abstract H200 and for tpu: the program takes
    the stored int8 / fp8 weight, widens it to the activations' bfloat16 and runs one
    dot_general accumulating in float32."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 64)).astype(np.float32), jnp.bfloat16)
    for method, type_name in (("int8", "i8"), ("fp8", "f8E4M3FN")):
        qw = jax.tree.map(jnp.asarray, quant.quantize(rng.normal(size=(64, 2, 32)), (0,), method))

        def f(x, w):
            return quant.einsum("td,dhk->thk", x, w, native=True)

        for platform in ("cuda", "tpu"):
            main, dots = _lowered(f, (x, qw), platform)
            assert f"tensor<64x2x32x{type_name}>" in main, main
            assert "tensor<1x2x32xf32>" in main, main  # the per-channel scale
            assert len(dots) == 1, dots
            want = "(tensor<4x64xbf16>, tensor<64x2x32xbf16>) -> tensor<4x2x32xf32>"
            assert want in dots[0], dots


def _q4_1_like(rng, shape, axis: int) -> quant.QuantizedWeight:
    """A grouped weight with an offset, as a Q4_1 tensor loads: q 0..15 per group of 32
    along axis, float16 scale and offset."""
    groups = list(shape)
    groups[axis] //= 32
    q = rng.integers(0, 16, size=shape).astype(np.int8)
    scale = rng.uniform(0.001, 0.01, size=groups).astype(np.float16)
    offset = rng.uniform(-0.08, 0.0, size=groups).astype(np.float16)
    return quant.QuantizedWeight(q, scale, 32, axis - len(shape), offset)


@pytest.mark.parametrize("native", [False, True])
def test_grouped_weight_with_offset_equals_the_dequantized_weight(native):
    """q * scale + offset per group (GGUF's Q4_1 / K-quants): the linear equals x times the
    dequantized weight, whose every element is q * scale + offset of its group."""
    rng = np.random.default_rng(1)
    w = _q4_1_like(rng, (2, 64, 32), axis=1)  # wo-like [H, Dh, D], groups along Dh
    deq = quant.dequantize(w)
    want = w.q[1, 37, 5] * np.float32(w.scale[1, 1, 5]) + np.float32(w.offset[1, 1, 5])
    assert deq[1, 37, 5] == want
    assert w.nbytes == 2 * 64 * 32 + 2 * (2 * 2 * 32 * 2)
    assert w[1].offset.shape == (2, 32)  # indexing a layer keeps the offset
    qw = jax.tree.map(jnp.asarray, w)
    x = jnp.asarray(rng.normal(size=(5, 2, 64)).astype(np.float32))
    got = jax.jit(lambda x, w: quant.einsum("thk,hkd->td", x, w, native=native))(x, qw)
    want = jnp.einsum("thk,hkd->td", x, deq, precision="highest")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    w = jax.tree.map(jnp.asarray, _q4_1_like(rng, (64, 48), axis=0))
    x = jnp.asarray(rng.normal(size=(3, 64)).astype(np.float32))
    want = jnp.matmul(x, quant.dequantize(w), precision="highest")
    np.testing.assert_allclose(quant.matmul(x, w, native=native), want, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_with_offset_lowers_for_cuda_and_tpu():
    """A Q4_1-like weight (int8 q, float16 scale and offset per 32) lowers for an abstract
    H200 and for tpu: the program takes the stored arrays, dequantizes them to the
    activations' bfloat16 and runs one dot_general."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 64)).astype(np.float32), jnp.bfloat16)
    qw = jax.tree.map(jnp.asarray, _q4_1_like(rng, (64, 2, 32), axis=0))

    def f(x, w):
        return quant.einsum("td,dhk->thk", x, w)

    for platform in ("cuda", "tpu"):
        main, dots = _lowered(f, (x, qw), platform)
        assert "tensor<64x2x32xi8>" in main, main
        assert main.count("tensor<2x2x32xf16>") == 2, main  # the scale and the offset
        assert len(dots) == 1, dots
        assert "(tensor<4x64xbf16>, tensor<64x2x32xbf16>) -> tensor<4x2x32xbf16>" in dots[0], dots


# A tiny llama whose projections dominate its bytes (8 layers), as GGUF (numpy-made: no torch).
_TINY = {"hidden": 128, "intermediate": 512, "layers": 8}


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    from tests.checkpoints import write_gguf
    from tests.numpy_checkpoints import make_llama_checkpoint

    root = tmp_path_factory.mktemp("q8")
    hf = make_llama_checkpoint(root / "hf", **_TINY)
    write_gguf(hf, root / "model-q8_0.gguf", "Q8_0")
    return root / "model-q8_0.gguf"


def _layer_bytes(params) -> int:
    return quant.weight_bytes(params["layers"])


@pytest.mark.parametrize("stacked", [False, True])
def test_gguf_q8_0_loads_as_int8_with_its_blocks(q8_gguf, stacked):
    from gguf import GGUFReader

    dense = load_model(q8_gguf, stacked=stacked)
    q8 = load_model(q8_gguf, stacked=stacked, quantization="int8")
    layers = q8.params["layers"]
    layer = layers if stacked else layers[3]
    wq = layer["wq"]
    assert isinstance(wq, quant.QuantizedWeight) and (wq.group, wq.group_axis) == (32, -3)
    assert wq.q.dtype == jnp.int8 and wq.scale.dtype == jnp.float16
    assert wq.shape == ((8,) if stacked else ()) + (128, 4, 32)
    # Exactly the file's blocks: the int8 values of blk.3.ffn_down equal the file's bytes.
    raw = {t.name: t for t in GGUFReader(q8_gguf).tensors}["blk.3.ffn_down.weight"].data
    blocks = np.asarray(raw).reshape(128, 512 // 32, 34)  # [out, blocks, fp16 d + 32 int8]
    file_q = blocks[:, :, 2:].copy().view(np.int8).reshape(128, 512)  # [out=D, in=F]
    file_d = blocks[:, :, :2].copy().view(np.float16).reshape(128, 16)
    down = layer["w_down"][3] if stacked else layer["w_down"]
    np.testing.assert_array_equal(np.asarray(down.q), file_q.T)
    np.testing.assert_array_equal(np.asarray(down.scale), file_d.T)
    # Dequantized, every projection equals the float load's (which gguf.quants dequantizes).
    dense_layer = dense.params["layers"] if stacked else dense.params["layers"][3]
    for name in quant.QUANTIZED_PARAMS:
        if name in layer:
            np.testing.assert_array_equal(quant.dequantize(layer[name]), dense_layer[name])
    # The embedding table keeps its blocks too (rows of 128: 4 blocks, float16 d each); the
    # untied LM head (output.weight) stays float32.
    embed = q8.params["embed"]
    assert isinstance(embed, quant.QuantizedWeight) and (embed.group, embed.group_axis) == (32, -1)
    assert (embed.q.dtype, embed.scale.dtype, embed.scale.shape) == (jnp.int8, jnp.float16, (2048, 4))
    np.testing.assert_array_equal(quant.dequantize(embed), dense.params["embed"])
    np.testing.assert_array_equal(q8.params["lm_head"], dense.params["lm_head"])
    # Resident bytes: the projections at 1 + 2/32 bytes per weight (+ float32 norms).
    projections = 8 * (128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 512)
    norms = 8 * 2 * 128 * 4
    assert _layer_bytes(q8.params) == projections * (1 + 2 / 32) + norms
    assert _layer_bytes(dense.params) == projections * 4 + norms
    assert _layer_bytes(q8.params) <= 0.3 * _layer_bytes(dense.params)
    rest = 2048 * 128 * (1 + 2 / 32) + 2048 * 128 * 4 + 128 * 4  # embedding, LM head, norm
    assert quant.weight_bytes(q8.params) == _layer_bytes(q8.params) + rest


def _int8_engine_matches_float32(path) -> tuple[dict, dict]:
    """Greedy tokens of three prompts and their top-3 logprobs from an int8-weight engine
    equal the float32 load's (tokens exactly, logprobs to 1e-5); both engines' stats()."""
    from jpaged import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(40, 70))]
    runs = {}
    for method in (None, "int8"):
        llm = LLM(model=str(path), quantization=method, max_num_seqs=4, max_model_len=64)
        runs[method] = (llm.generate(prompts, params), llm.stats())
    (dense, dense_stats), (q8, q8_stats) = runs[None], runs["int8"]
    for a, b in zip(dense, q8, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            np.testing.assert_allclose(list(lb.values()), list(la.values()), atol=1e-5)
    return dense_stats, q8_stats


def test_gguf_q8_0_logits_equal_the_dequantized_load(q8_gguf):
    """Greedy tokens and their logprobs through the engine: int8 weights (dequantized in the
    step on the CPU) against the float32 load, to 1e-5; llm.stats() reports the bytes."""
    dense_stats, q8_stats = _int8_engine_matches_float32(q8_gguf)
    assert (dense_stats["quantization"], q8_stats["quantization"]) == (None, "int8")
    assert q8_stats["weight_bytes"] == 2_097_152 + 1_327_616  # as the test above counts
    assert dense_stats["weight_bytes"] == 7_872_512 + 2_097_664


# The block types loaded without loss: q's range, the scale dtype, offset or not, the group.
_LOSSLESS = {
    "Q4_0": (-8, 7, np.float16, False, 32),
    "Q4_1": (0, 15, np.float16, True, 32),
    "Q5_0": (-16, 15, np.float16, False, 32),
    "Q5_1": (0, 31, np.float16, True, 32),
    "Q4_K": (0, 15, np.float32, True, 32),
    "Q5_K": (0, 31, np.float32, True, 32),
    "Q6_K": (-32, 31, np.float32, False, 16),
}
# Rows of 256 inputs at least (the K-quants' super-block): hidden 256, head_dim 64.
_BLOCKS = {"hidden": 256, "intermediate": 512, "layers": 2}
_GGUF_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def block_checkpoint(tmp_path_factory):
    from tests.numpy_checkpoints import make_llama_checkpoint

    return make_llama_checkpoint(tmp_path_factory.mktemp("blocks") / "hf", **_BLOCKS)


def _projection_weights() -> int:
    d, f, kv = 256, 512, 2 * 64
    return 2 * (d * d * 2 + d * kv * 2 + 3 * d * f)


@pytest.mark.parametrize("kind", list(_LOSSLESS))
def test_gguf_block_types_load_as_int8_without_loss(block_checkpoint, tmp_path, kind):
    """Every projection stored as `kind`: the int8 load keeps the format's integers, and
    q * scale + offset equals gguf.quants.dequantize's values (through the float32 load, and
    for blk.1.attn_q directly from the file's bytes, un-permuted) to 1e-6 relative."""
    import gguf

    from models.gguf import unpermute_rows
    from tests.checkpoints import write_gguf

    lo, hi, scale_dtype, has_offset, group = _LOSSLESS[kind]
    path = tmp_path / f"model-{kind.lower()}.gguf"
    write_gguf(
        block_checkpoint, path, lambda name, shape: kind if name.startswith("blk.") else "F32"
    )
    dense = load_model(path)
    q8 = load_model(path, quantization="int8")
    for i, layer in enumerate(q8.params["layers"]):
        for name in quant.QUANTIZED_PARAMS:
            if name not in layer:
                continue
            w = layer[name]
            assert isinstance(w, quant.QuantizedWeight) and w.group == group, name
            assert w.q.dtype == np.int8 and w.scale.dtype == scale_dtype, name
            assert (w.offset is not None) == has_offset, name
            if has_offset:
                assert w.offset.dtype == scale_dtype, name
            assert lo <= w.q.min() and w.q.max() <= hi, (name, w.q.min(), w.q.max())
            want = dense.params["layers"][i][name]
            np.testing.assert_allclose(quant.dequantize(w), want, rtol=1e-6, atol=0, err_msg=name)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.1.attn_q.weight"]
    ref = gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(256, 256)  # [out, in]
    ref = unpermute_rows(ref, 4).T.reshape(256, 4, 64)  # wq's layout [D, Hq, Dh]
    np.testing.assert_allclose(quant.dequantize(q8.params["layers"][1]["wq"]), ref, rtol=1e-6)
    # Resident bytes: 1 per weight, the scale (and offset) once per group; norms float32.
    extra = np.dtype(scale_dtype).itemsize * (2 if has_offset else 1) / group
    norms = 2 * 2 * 256 * 4
    assert quant.weight_bytes(q8.params["layers"]) == _projection_weights() * (1 + extra) + norms


# A file of every lossless type, a different one per layer for each projection: the layers of
# a name take one form (models/gguf.py block_forms), so that they stack for lax.scan.
_MIXED = list(_LOSSLESS)


def _mixed_type(name: str, shape) -> str:
    parts = name.split(".")  # "blk.1.attn_q.weight"; "token_embd.weight" stays float32
    if len(parts) != 4 or parts[2] not in _GGUF_PROJECTIONS:
        return "F32"
    layer, kind = parts[1], parts[2]
    return _MIXED[(_GGUF_PROJECTIONS.index(kind) + 3 * int(layer)) % len(_MIXED)]


def test_gguf_mixed_block_types_stack_in_one_form_and_match_the_float_logits(
    block_checkpoint, tmp_path
):
    """Greedy tokens and logprobs through the engine (layers stacked and scanned on the CPU):
    int8 weights of every lossless type against the float32 load of the same file, to 1e-5;
    stats() reports the exact resident bytes of the forms block_forms picks."""
    from tests.checkpoints import write_gguf

    path = tmp_path / "mixed.gguf"
    write_gguf(block_checkpoint, path, _mixed_type)
    loaded = load_model(path, stacked=True, quantization="int8")
    layers = loaded.params["layers"]
    # attn_q: Q4_0 then Q5_1 -> float16, an offset (zero for Q4_0); ffn_gate: Q4_K then Q4_0
    # -> float32; attn_output: Q5_1 then Q6_K -> groups of 16, float32, an offset.
    forms = {"wq": (32, np.float16, True), "w_gate": (32, np.float32, True),
             "wo": (16, np.float32, True), "w_down": (16, np.float32, False)}  # fmt: skip
    for name, (group, dtype, has_offset) in forms.items():
        w = layers[name]
        assert (w.group, w.scale.dtype, w.offset is not None) == (group, dtype, has_offset), name
        assert w.q.shape[0] == 2 and w.scale.shape[0] == 2
    np.testing.assert_array_equal(np.asarray(layers["wq"].offset[0]), 0)  # Q4_0: no minimum
    dense = load_model(path, stacked=True)
    for name in quant.QUANTIZED_PARAMS:
        if name in layers:
            want = dense.params["layers"][name]
            np.testing.assert_allclose(quant.dequantize(layers[name]), want, rtol=1e-6, atol=0)
    _, stats = _int8_engine_matches_float32(path)
    # Bytes per weight: wq 1 + 4/32, wk wv w_gate w_up 1 + 8/32, wo 1 + 8/16, w_down 1 + 4/16.
    layer_bytes = 131072 * 1.125 + 65536 * 2 * 1.25 + 131072 * 1.5 + 262144 * 3 * 1.25
    assert quant.weight_bytes(layers) == layer_bytes + 2 * 2 * 256 * 4 == 1_495_040
    assert stats["weight_bytes"] == 1_495_040 + 2 * 2048 * 256 * 4 + 256 * 4


def _write_fp8_checkpoint(root, *, drop_scale: str | None = None, config_groups=None):
    """The tiny llama as a compressed-tensors fp8 checkpoint (per-channel weight_scale)."""
    from safetensors.flax import save_file
    from safetensors.numpy import load_file

    from tests.numpy_checkpoints import make_llama_checkpoint

    hf = make_llama_checkpoint(root)
    tensors = load_file(str(hf / "model.safetensors"))
    out, expected = {}, {}
    for name, w in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            scale = (np.abs(w).max(axis=1, keepdims=True) / 448).astype(np.float32)  # [out, 1]
            q = (w / scale).astype(F8)
            out[name] = jnp.asarray(q)
            if name + "_scale" != drop_scale:
                out[name + "_scale"] = jnp.asarray(scale)
            expected[name] = q.astype(np.float32) * scale
        else:
            out[name] = jnp.asarray(w)
    save_file(out, str(hf / "model.safetensors"))
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": config_groups
        or {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }
    (hf / "config.json").write_text(json.dumps(config))
    return hf, expected


def test_compressed_tensors_fp8_loads_without_dequantization(tmp_path):
    hf, expected = _write_fp8_checkpoint(tmp_path / "fp8")
    loaded = load_model(hf)
    wq = loaded.params["layers"][1]["wq"]
    assert isinstance(wq, quant.QuantizedWeight) and wq.q.dtype == F8
    assert wq.scale.shape == (1, 4, 16) and wq.scale.dtype == jnp.float32
    want = expected["model.layers.1.self_attn.q_proj.weight"].T.reshape(64, 4, 16)
    np.testing.assert_array_equal(quant.dequantize(wq), want)
    wo = loaded.params["layers"][0]["wo"]
    assert wo.scale.shape == (1, 1, 64)
    want = expected["model.layers.0.self_attn.o_proj.weight"].T.reshape(4, 16, 64)
    np.testing.assert_array_equal(quant.dequantize(wo), want)
    assert loaded.params["embed"].dtype == jnp.float32  # not quantized in the checkpoint


def test_fp8_checkpoint_without_a_weight_scale_is_a_clear_error(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    hf, _ = _write_fp8_checkpoint(tmp_path / "fp8", drop_scale=name + "_scale")
    with pytest.raises(ValueError, match=f"fp8 tensor '{name}' has no '{name}_scale'"):
        load_model(hf)
    hf, _ = _write_fp8_checkpoint(
        tmp_path / "int4", config_groups={"g": {"weights": {"num_bits": 4, "type": "int"}}}
    )
    with pytest.raises(ValueError, match="jpaged reads float 8-bit"):
        load_model(hf)


def test_unknown_quantization_is_a_clear_error(q8_gguf):
    from jpaged.config import EngineConfig
    from jpaged.entrypoints.cli import build_parser

    with pytest.raises(ValueError, match="quantization must be one of int8, fp8 .*'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8 .*'awq'"):
        load_model(q8_gguf, quantization="awq")
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--quantization", "fp8"])
    assert args.quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--quantization", "int4"])


def test_float_checkpoint_quantized_at_load_names_the_tensor_it_refuses(tmp_path):
    """A float Hugging Face directory with quantization "int8": per-channel int8 projections
    (scale size 1 on the contraction axes); a NaN weight is refused naming its tensor."""
    from safetensors.numpy import load_file, save_file

    from tests.numpy_checkpoints import make_llama_checkpoint

    path = make_llama_checkpoint(tmp_path / "llama")
    wq = load_model(path, quantization="int8").params["layers"][1]["wq"]
    assert isinstance(wq, quant.QuantizedWeight) and wq.q.dtype == jnp.int8
    assert (wq.shape, wq.scale.shape, wq.group) == ((64, 4, 16), (1, 4, 16), 0)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.weight"][3, 5] = np.nan
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.self_attn\.q_proj\.weight: cannot"):
        load_model(path, quantization="int8")


def _specs(w: quant.QuantizedWeight, spec, kv: int = 2):
    """sharding.quantized_spec of w on an abstract ("data", "kv", "rep") mesh of (1, kv, 1)."""
    from jax.sharding import AbstractMesh

    from models.sharding import quantized_spec

    mesh = AbstractMesh((1, kv, 1), ("data", "kv", "rep"))
    out = quantized_spec(spec, w, mesh, "w")
    return out.q, out.scale, out.offset


def test_quantized_specs_follow_the_float_weight():
    from jax.sharding import PartitionSpec as P

    tp = ("kv", "rep")
    rng = np.random.default_rng(0)
    col = quant.quantize(rng.normal(size=(8, 6)).astype(np.float32), (0,))  # w_gate [D, F]
    assert _specs(col, P(None, tp)) == (P(None, tp), P(None, tp), None)
    row = quant.quantize(rng.normal(size=(6, 8)).astype(np.float32), (0,))  # w_down [F, D]
    assert _specs(row, P(tp, None)) == (P(tp, None), P(None, None), None)
    # Blocks of 2 along F (6 = 3 blocks): split with w_down's F over 3 devices, 1 each.
    blocks = quant.quantize(rng.normal(size=(6, 8)).astype(np.float32), (0,), group=2)
    blocks = quant.QuantizedWeight(blocks.q, blocks.scale, 2, -2, blocks.scale)
    assert _specs(blocks, P(tp, None), kv=3) == (P(tp, None), P(tp, None), P(tp, None))
    with pytest.raises(ValueError, match=r"^w: tensor parallelism over 2 devices gives each 3 "):
        _specs(blocks, P(tp, None), kv=2)

"""Weight-only quantization: int8 and fp8 (e4m3) weights with float scales, and the linear
layers that consume them.

A quantized param is a QuantizedWeight: `q` (int8 or float8_e4m3fn) in the param's own
layout (models/config.py) and `scale` of the same rank, whose product is the weight:

    per output channel   scale has size 1 on the contraction axes     wq [D, Hq, Dh]:
                                                                       scale [1, Hq, Dh]
    per group of g       the last contraction axis split in groups of g   wo [Hq, Dh, D],
                         consecutive input elements (GGUF's blocks)       g 32: [Hq, Dh/32, D]

A grouped weight may carry an `offset` shaped like its scale: the weight is then
q * scale + offset per group. GGUF's block formats load so without loss (models/gguf.py):
their integers as int8 (Q4_1 0..15, Q6_K -32..31, ...), the format's own block scale and,
for Q4_1 / Q5_1 / Q4_K / Q5_K, its block minimum as the offset.

Which params are quantized: the projections of QUANTIZED_PARAMS (attention and MLP, dense
and experts); and a GGUF file's block-quantized embedding table under --quantization int8
(models/gguf.py), which is also the LM head when tied: embed_rows dequantizes only the
looked-up rows, and tied_logits multiplies by the table a block of rows at a time on the CPU
(dequantized whole in the step it cost SmolLM2 12x its float32 time). An untied LM head,
a float checkpoint's embedding table, norms, biases and the MoE router stay in the
activation dtype.

The formulation (measured by scripts/bench_quant_matmul.py): on the CPU the weight is
dequantized to the activation dtype in the step and multiplied there (XLA:CPU has no fast
int8 x float kernel: every mixed formulation measured slower than float32, so the CPU keeps
float32 compute and gains the memory only). On GPU and TPU a per-channel weight enters the
program as stored and widens to the activation dtype in one dot_general with
preferred_element_type float32 (XLA fuses the widening into the matmul), and the scale
multiplies the output channels after it. Activations are never quantized (weight-only: the
fp8 tensor cores of an H200 would need fp8 activations too, which this does not do).

Host-side quantization refuses non-finite weights (a NaN would poison every output of its
channel): a ValueError naming the tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

QUANTIZATIONS = ("int8", "fp8")
# The storage dtype of each method and its largest finite value (the scale maps the
# channel's or group's max |w| onto it).
STORAGE_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
MAX_VALUES = {"int8": 127.0, "fp8": 448.0}
# Quantized params -> their contraction axes in the layout of models/config.py.
QUANTIZED_PARAMS = {
    "wq": (0,),
    "wk": (0,),
    "wv": (0,),
    "wo": (0, 1),
    "w_gate": (0,),
    "w_up": (0,),
    "w_down": (0,),
    "w_gate_exps": (1,),
    "w_up_exps": (1,),
    "w_down_exps": (1,),
    "w_gate_shared": (0,),
    "w_up_shared": (0,),
    "w_down_shared": (0,),
}


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight q * scale (+ offset) (see the module docstring). group: 0 per output channel,
    else the group size along axis group_axis (static, part of the pytree's structure)."""

    q: Any  # int8 | float8_e4m3fn[param shape]
    scale: Any  # float32 | float16[param shape, contraction axes 1 or / group]
    group: int = 0
    group_axis: int = 0  # negative: from the end
    offset: Any = None  # None | float32 | float16[scale's shape]; grouped weights only

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offset is None else int(self.offset.nbytes)
        return int(self.q.nbytes) + int(self.scale.nbytes) + extra

    def __len__(self) -> int:
        return self.q.shape[0]

    def __getitem__(self, index) -> QuantizedWeight:
        """Row(s) of the leading axis of every array: layer i of a stacked weight."""
        offset = None if self.offset is None else self.offset[index]
        return QuantizedWeight(
            self.q[index], self.scale[index], self.group, self.group_axis, offset
        )


jax.tree_util.register_dataclass(
    QuantizedWeight, data_fields=["q", "scale", "offset"], meta_fields=["group", "group_axis"]
)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def check_method(method: str | None) -> None:
    if method is not None and method not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), got {method!r}"
        )


def quantize(
    w: np.ndarray,
    contract_axes: tuple[int, ...],
    method: str = "int8",
    *,
    group: int = 0,
    scale_dtype: Any = np.float32,
    name: str = "weight",
) -> QuantizedWeight:
    """Quantizes a float weight (numpy, host) per output channel or per group.

    Args:
      w: float[param shape].
      contract_axes: the axes the matmul sums over (QUANTIZED_PARAMS); the scales have size
        1 there (per channel), or with group > 0 the last of them holds size / group.
      method: "int8" (round to nearest, saturated at +-127) or "fp8" (float8_e4m3fn, +-448).
      group: 0 per output channel, else consecutive elements per scale on the last
        contraction axis (must divide it).
      scale_dtype: the scales' dtype; q is computed against the stored (rounded) scale.
      name: named in errors.

    Returns:
      QuantizedWeight of numpy arrays. An all-zero channel or group has scale 1 and q 0.

    Raises:
      ValueError: an unknown method, a non-finite value, a group that does not divide the axis.
    """
    check_method(method)
    w = np.asarray(w, dtype=np.float32)
    if not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0].tolist()
        raise ValueError(
            f"{name}: cannot quantize a non-finite weight ({w[tuple(bad)]} at index {bad})"
        )
    axis = contract_axes[-1]
    if group:
        if w.shape[axis] % group:
            raise ValueError(
                f"{name}: group size {group} does not divide axis {axis} of shape {list(w.shape)}"
            )
        blocks = w.reshape(*w.shape[:axis], w.shape[axis] // group, group, *w.shape[axis + 1 :])
        amax = np.abs(blocks).max(axis=axis + 1)  # [.., size / group, ..]
        expand = axis + 1
    else:
        blocks = w
        amax = np.abs(w).max(axis=contract_axes, keepdims=True)
        expand = None
    top = MAX_VALUES[method]
    scale = (amax / top).astype(scale_dtype)
    scale = np.where(scale > 0, scale, np.ones((), scale_dtype)).astype(scale_dtype)
    s = scale.astype(np.float32)
    scaled = blocks / (s if expand is None else np.expand_dims(s, expand))
    scaled = np.clip(scaled, -top, top)
    if method == "int8":
        q = np.rint(scaled).astype(np.int8)
    else:
        q = scaled.astype(ml_dtypes.float8_e4m3fn)
    return QuantizedWeight(q.reshape(w.shape), scale, group, axis - w.ndim if group else 0)


def dequantize(w: Any, dtype: Any = jnp.float32) -> Any:
    """The float weight of a QuantizedWeight (a plain array passes through), in dtype."""
    if not isinstance(w, QuantizedWeight):
        return w
    xp = jnp if isinstance(w.q, jax.Array) else np
    q = w.q.astype(np.float32)
    scale = w.scale.astype(np.float32)
    if w.group:
        a = q.ndim + w.group_axis
        shape = q.shape
        q = q.reshape(*shape[:a], shape[a] // w.group, w.group, *shape[a + 1 :])
        out = q * xp.expand_dims(scale, a + 1)
        if w.offset is not None:
            out = out + xp.expand_dims(w.offset.astype(np.float32), a + 1)
        out = out.reshape(shape)
    else:
        out = q * scale
    return out.astype(dtype)


def _native_dot(subscripts: str, x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x times a per-channel quantized w as one dot_general over w's stored values (int8 or
    fp8 operand, float32 accumulation), the output channels then scaled: "td,dhk->thk"-like
    subscripts whose output is x's free axes then w's (no batch axes)."""
    inputs, out_sub = subscripts.split("->")
    x_sub, w_sub = inputs.split(",")
    if x_sub.startswith("..."):  # matmul: the leading axes of x are free
        x_sub = "".join(chr(ord("A") + i) for i in range(x.ndim - 1)) + x_sub[3:]
        out_sub = x_sub[:-1] + out_sub[3:]
    contract = [c for c in w_sub if c in x_sub and c not in out_sub]
    free = "".join(c for c in x_sub if c not in contract) + "".join(
        c for c in w_sub if c not in contract
    )
    if free != out_sub:
        raise ValueError(f"einsum {subscripts!r}: not a plain contraction of x and w")
    dims = (
        (tuple(x_sub.index(c) for c in contract), tuple(w_sub.index(c) for c in contract)),
        ((), ()),
    )
    # The stored values widen to x's dtype inside the program (jax's dot_general takes one
    # operand dtype), which XLA fuses into the GPU/TPU matmul: the weight's bytes are read
    # once, in int8 / fp8.
    out = jax.lax.dot_general(x, w.q.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    kept = tuple(i for i, c in enumerate(w_sub) if c not in contract)
    dropped = tuple(i for i in range(len(w_sub)) if i not in kept)
    scale = jnp.squeeze(w.scale, axis=dropped).astype(jnp.float32)
    return (out * scale).astype(x.dtype)


def einsum(subscripts: str, x: jax.Array, w: Any, *, native: bool | None = None) -> jax.Array:
    """jnp.einsum(subscripts, x, w) for a plain or quantized weight w (the output in x's
    dtype; a plain w is jnp.einsum itself).

    native: the accelerator formulation (_native_dot) for a per-channel w; None: on every
    platform but the CPU (the CPU dequantizes w to x's dtype and multiplies in it). Grouped
    scales (and offsets) are dequantized everywhere: q * scale + offset in one elementwise
    pass feeding the dot (scripts/bench_quant_matmul.py measured the offset's cost on the
    CPU against a separate per-group correction term, docs/benchmarks.md)."""
    if not isinstance(w, QuantizedWeight):
        return jnp.einsum(subscripts, x, w)
    if native is None:
        native = jax.default_backend() != "cpu"
    if w.group or not native:
        return jnp.einsum(subscripts, x, dequantize(w, x.dtype))
    return _native_dot(subscripts, x, w)


def matmul(x: jax.Array, w: Any, *, native: bool | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] for a plain or quantized w."""
    if not isinstance(w, QuantizedWeight):
        return x @ w
    return einsum("...k,kn->...n", x, w, native=native)


def activation_dtype(params: Any) -> np.dtype:
    """The dtype the model computes in: its first param that is not quantized (a GGUF load
    under --quantization int8 has an int8 embedding table first)."""
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_quantized):
        if not is_quantized(leaf):
            return np.dtype(leaf.dtype)
    raise ValueError("every param is quantized: no activation dtype to compute in")


def embed_rows(table: Any, ids: jax.Array, dtype: Any) -> jax.Array:
    """Rows ids of an embedding table [V, D] (plain, or a QuantizedWeight whose scales
    follow its rows: per row or per block of a row), in dtype: only the gathered rows are
    dequantized."""
    if not isinstance(table, QuantizedWeight):
        return table[ids]
    return dequantize(table[ids], dtype)


# Vocabulary rows dequantized at a time by tied_logits on the CPU: a block's float32 copy
# (1,024 x 576 x 4 bytes for SmolLM2) stays in the cache for its matmul.
VOCAB_BLOCK = 1024


def tied_logits(x: jax.Array, table: Any) -> jax.Array:
    """x [T, D] @ table [V, D]^T, the LM head of a tied embedding, in x's dtype.

    A quantized table on the CPU: for one row, the whole table dequantized into the product
    (XLA:CPU fuses the widening into its matrix-vector loop: the int8 bytes are read once);
    for more rows, blocks of VOCAB_BLOCK rows (lax.map), each dequantized and multiplied
    while in the cache. Dequantizing the whole table for T rows wrote and read a float32
    copy of it (SmolLM2: 113 MB) every step, 2.5x float32's time at T = 32.
    docs/benchmarks.md ("The embedding table kept int8 too") has the measurements.
    Elsewhere: the table dequantized into one einsum (as grouped projections are)."""
    if not isinstance(table, QuantizedWeight):
        return x @ table.T
    rows = table.q.shape[0]
    if jax.default_backend() != "cpu" or x.shape[0] == 1 or rows < 2 * VOCAB_BLOCK:
        return x @ dequantize(table, x.dtype).T
    num, rest = divmod(rows, VOCAB_BLOCK)

    def split(a):  # the first num * VOCAB_BLOCK rows as [num, VOCAB_BLOCK, ...]
        return None if a is None else a[: num * VOCAB_BLOCK].reshape(num, VOCAB_BLOCK, *a.shape[1:])

    def one(parts):
        q, scale, offset = parts
        w = QuantizedWeight(q, scale, table.group, table.group_axis, offset)
        return x @ dequantize(w, x.dtype).T  # [T, VOCAB_BLOCK]

    out = jax.lax.map(one, (split(table.q), split(table.scale), split(table.offset)))
    out = out.transpose(1, 0, 2).reshape(x.shape[0], num * VOCAB_BLOCK)
    if rest:  # the last rows, fewer than a block
        out = jnp.concatenate([out, x @ dequantize(table[num * VOCAB_BLOCK :], x.dtype).T], axis=1)
    return out


def quantize_param(param: str, value: np.ndarray, method: str | None, **kwargs) -> Any:
    """value quantized when method is set and param is one of QUANTIZED_PARAMS, else value
    (kwargs: quantize's, name among them)."""
    if method is None or param not in QUANTIZED_PARAMS:
        return value
    return quantize(value, QUANTIZED_PARAMS[param], method, **kwargs)


def weight_bytes(params: Any) -> int:
    """Resident bytes of every array of a params pytree (a quantized weight: q + scale)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(params))


def hf_to_layout(w: QuantizedWeight, spec: Any, name: str) -> QuantizedWeight:
    """A per-channel (or per-tensor) quantized Hugging Face weight [out, in] (experts:
    [E, out, in]) in the param layout: q through spec.to_layout as it is, the scale
    broadcast over the weight, laid out the same way and kept once per output channel.
    A grouped one (groups along in, group_axis -1: GGUF's blocks) keeps one scale (and
    offset) per group along the param's last contraction axis.

    Raises:
      ValueError: name is not a quantized param, or its groups do not fit the layout (the
        last contraction axis is not a multiple of the group).
    """
    if name not in QUANTIZED_PARAMS:
        raise ValueError(f"{spec.hf_name}: a quantized tensor where jpaged expects a float one")
    q = spec.to_layout(w.q)
    if w.group:
        return _groups_to_layout(w, np.ascontiguousarray(q), spec, name)
    scale = np.asarray(w.scale, dtype=np.float32)
    if scale.ndim == w.q.ndim - 1 or scale.size == 1:  # [out] or one per tensor
        scale = scale.reshape(scale.shape + (1,) * (w.q.ndim - scale.ndim))
    full = spec.to_layout(np.broadcast_to(scale, w.q.shape))
    index = tuple(
        slice(0, 1) if a in QUANTIZED_PARAMS[name] else slice(None) for a in range(q.ndim)
    )
    return QuantizedWeight(np.ascontiguousarray(q), np.ascontiguousarray(full[index]))


def _groups_to_layout(w: QuantizedWeight, q: np.ndarray, spec: Any, name: str) -> QuantizedWeight:
    """hf_to_layout of a grouped weight: each group's scale repeated over its elements, laid
    out as q is, and taken once per group along the last contraction axis. The groups run
    along in, whose innermost part that axis is (wo [Hq, Dh, D]: Dh), so a group stays one
    group when the axis is a multiple of it."""
    axis, g = QUANTIZED_PARAMS[name][-1], w.group
    if w.group_axis != -1 or q.shape[axis] % g:
        raise ValueError(
            f"{spec.hf_name}: groups of {g} along axis {w.group_axis} do not fit axis {axis} "
            f"of the layout {list(q.shape)}"
        )
    index = tuple(slice(None, None, g) if a == axis else slice(None) for a in range(q.ndim))

    def per_group(x: Any) -> Any:
        if x is None:
            return None
        return np.ascontiguousarray(spec.to_layout(np.repeat(x, g, axis=-1))[index])

    return QuantizedWeight(q, per_group(w.scale), g, axis - q.ndim, per_group(w.offset))

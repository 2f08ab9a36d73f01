"""MXFP4 weights (OCP microscaling FP4, as gpt-oss checkpoints store their experts), on the host.

A tensor W [..., rows, cols] is stored as two uint8 arrays, cols in blocks of 32:

    W_blocks  [..., rows, cols / 32, 16]  two FP4 (e2m1) codes per byte, the element of even
                                          index in the low nibble, the odd one in the high
    W_scales  [..., rows, cols / 32]      an E8M0 exponent per block: the block's values are
                                          its codes' values times 2 ** (scale - 127)

    e2m1 code  0..7:  +0 +0.5 +1 +1.5 +2 +3 +4 +6      8..15: the same, negative

gpt-oss stores each expert projection [out, in] this way (blocks along the input dim), where
the float checkpoint stores it [in, out]: dequantize then swap the last two axes
(hf_checkpoint reads it so). Every MXFP4 value is exact in bfloat16 and float32.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # values per scale
# The values of the 16 e2m1 codes.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray, *, name: str = "") -> np.ndarray:
    """float32 [..., rows, cols] of blocks uint8[..., rows, cols / 32, 16] and scales
    uint8[..., rows, cols / 32] (the module docstring's layout).

    Raises:
      ValueError: dtypes or shapes that do not pair up, naming `name`.
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.ndim < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"{name}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not "
            f"pair up (blocks [..., cols / {BLOCK}, {BLOCK // 2}], scales [..., cols / {BLOCK}])"
        )
    codes = np.empty((*blocks.shape[:-1], BLOCK), np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    exponents = scales.astype(np.int32) - SCALE_BIAS
    values = np.ldexp(FP4_VALUES[codes], exponents[..., None])
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of w [..., rows, cols] (cols a multiple of 32): each block's scale is
    the power of two that brings its largest magnitude to at most 6, each value the nearest
    e2m1 code (ties to the lower magnitude) of value / scale. dequantize(*quantize(w)) is w
    exactly when w's blocks hold only e2m1 values times their scale."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last dim a multiple of {BLOCK}, got {w.shape[-1]}")
    grouped = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    peak = np.max(np.abs(grouped), axis=-1)
    exponent = np.where(peak > 0, np.ceil(np.log2(np.maximum(peak, 1e-38) / 6.0)), 0)
    exponent = np.clip(exponent, -SCALE_BIAS, 255 - SCALE_BIAS).astype(np.int32)
    scaled = grouped / np.ldexp(np.float32(1), exponent)[..., None]
    magnitudes = FP4_VALUES[:8]
    nearest = np.argmin(np.abs(np.abs(scaled)[..., None] - magnitudes), axis=-1)
    codes = (nearest + 8 * (scaled < 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order whatever w's strides (safetensors' numpy writer copies the memory as it lies)
    scales = (exponent + SCALE_BIAS).astype(np.uint8)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(scales)

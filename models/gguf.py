"""Loads a GGUF file (llama.cpp's format) into the same LoadedModel as a Hugging Face directory.

The `gguf` package reads the file (GGUFReader, memory-mapped) and dequantizes its tensors
(gguf.quants.dequantize); this module maps llama.cpp's names and metadata onto
models/config.py:

  general.architecture   llama -> LlamaForCausalLM (Llama 2/3, Mistral, SmolLM2),
                         qwen2 -> Qwen2ForCausalLM (q/k/v biases), qwen3 -> Qwen3ForCausalLM
                         (q/k RMSNorm), qwen3moe -> Qwen3MoeForCausalLM, olmoe ->
                         OlmoeForCausalLM, llama with {arch}.expert_count -> Mixtral
                         (experts stored stacked: ffn_gate_inp, ffn_{gate,up,down}_exps),
                         glm4moe -> Glm4MoeForCausalLM (_glm4moe_fields: leading dense
                         blocks, shared experts ffn_*_shexp, the choice bias exp_probs_b,
                         partial rotary rope.dimension_count; block_count counts the
                         nextn_predict_layers MTP blocks after the decoder, left unread),
                         gemma2, gemma3, phi3, gpt-oss and deepseek2 (DeepSeek-V2/V3's
                         latent attention; their names and fields: models/gguf_families.py)
  {arch}.*               layers, sizes, heads, head dim, context length, rope base, norm eps
  rope_freqs.weight      Llama 3.1+ rope scaling, stored as per-frequency divisors; read back
                         as the llama3 RopeScaling that produces exactly those divisors
  rope.scaling.type      "linear" with rope.scaling.factor (Gemma 3's global layers)
  output.weight absent   tied embeddings
  tokenizer.*            the tokenizer and chat template (models/gguf_tokenizer.py)

llama.cpp's converter permutes the rows of the llama architecture's Q and K projections (and
their biases) from Hugging Face's rotate-half rope layout to GGML's interleaved one; loading
undoes it (`unpermute_rows`) so the params equal the Hugging Face checkpoint's. qwen2 and
qwen3 files are not permuted.

Invariants: as for Hugging Face directories, every tensor the config implies is present with
its expected shape and no tensor of the file is left unused. Every failure (not a GGUF file,
a truncated one, an unsupported architecture or tensor type, a missing or misshaped tensor) is
a ValueError whose message names the file and what is wrong.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from models import gguf_families, hf_checkpoint
from models import quantization as quant
from models.config import LinearRopeScaling, ModelConfig, RopeScaling

GGUF_MAGIC = b"GGUF"
# Rows GGUFFile.read dequantizes at a time (its float32 temporaries scale with them).
DEQUANTIZE_ROWS = 4096
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **gguf_families.ARCHITECTURES,
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
}
# llama.cpp's "llama" architecture with experts ({arch}.expert_count > 0) is Mixtral.
EXPERT_ARCHITECTURES = {"llama": "MixtralForCausalLM"}
# GGML tensor types jpaged dequantizes (through gguf.quants) when loading.
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "MXFP4",
)
ROPE_FREQS = "rope_freqs.weight"

_TOP_LEVEL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Experts: llama.cpp stores a layer's experts stacked, one tensor [E, ...] each.
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.{expert}.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.{expert}.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.{expert}.down_proj.weight": "ffn_down_exps.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.experts.{expert}.w1.weight": "ffn_gate_exps.weight",
    "block_sparse_moe.experts.{expert}.w3.weight": "ffn_up_exps.weight",
    "block_sparse_moe.experts.{expert}.w2.weight": "ffn_down_exps.weight",
}
# Where llama.cpp's names for an architecture differ from the ones above.
_ARCH_LAYER_NAMES = {
    "glm4moe": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    },
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_BLOCK = re.compile(r"blk\.(\d+)\.")


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """llama.cpp's name for a Hugging Face tensor of an architecture
    ("model.layers.3.mlp.up_proj.weight" -> "blk.3.ffn_up.weight")."""
    if hf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[hf_name]
    m = _LAYER_NAME.fullmatch(hf_name)
    names = {
        **_LAYER_NAMES, **gguf_families.LAYER_NAMES.get(arch, {}), **_ARCH_LAYER_NAMES.get(arch, {})
    }  # fmt: skip
    if m is None or m.group(2) not in names:
        raise KeyError(f"no GGUF name for tensor {hf_name!r}")
    return f"blk.{m.group(1)}.{names[m.group(2)]}"


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file path names: itself if it is a .gguf file, the only .gguf file of a
    directory without config.json, else None (not a GGUF model).

    Raises:
      ValueError: a directory without config.json holds several .gguf files.
    """
    p = Path(path)
    if p.suffix == ".gguf" and not p.is_dir():
        return p
    if p.is_dir() and not (p / hf_checkpoint.CONFIG_FILE).exists():
        files = sorted(f for f in p.glob("*.gguf") if f.is_file())
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise ValueError(f"{p}: holds {len(files)} .gguf files ({names}); pass one file's path")
        if files:
            return files[0]
    return None


@functools.cache
def _reader_class():
    """GGUFReader over a plain ndarray view of its memory map (numpy.memmap's Python-level
    __array_finalize__ ran for every one of the 1.2 million views the reader takes parsing
    SmolLM2's 49,152-token vocabulary: 2.2-2.7 s to open the file against 0.8 s so, measured on
    the 2-core VM). The views still read the file's pages; nothing is copied."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:  # GGUFReader.__init__ assigns its memmap
            self._data = value.view(np.ndarray)

    return Reader


class GGUFFile:
    """An opened GGUF file: its metadata (key -> Python value) and tensors by name."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: GGUF file not found")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(
                f"{self.path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})"
            )
        try:
            reader = _reader_class()(self.path)
        except (ValueError, IndexError, OSError) as e:
            # GGUFReader reshapes every tensor over the memory map: a short file fails there.
            raise ValueError(f"{self.path}: truncated or corrupt GGUF file ({e})") from None
        try:
            self.metadata: dict[str, Any] = {
                key: field.contents() for key, field in reader.fields.items()
            }
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: unreadable GGUF metadata ({e})") from None
        self.tensors = {t.name: t for t in reader.tensors}
        self.arch = self.metadata.get("general.architecture")

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in numpy order (GGML lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def check_type(self, name: str) -> None:
        """Raises a ValueError when a tensor's GGML type is not one jpaged dequantizes."""
        kind = self.tensors[name].tensor_type.name
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"{self.path}: tensor {name!r} has type {kind}, which jpaged cannot load; "
                f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )

    def read(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32 in numpy order ([out, in] for a projection)."""
        from gguf import quants

        self.check_type(name)
        tensor = self.tensors[name]
        data, kind = tensor.data, tensor.tensor_type
        if data.ndim < 2 or data.shape[0] <= DEQUANTIZE_ROWS:
            out = quants.dequantize(data, kind).reshape(self.shape(name))
            # An F32 tensor comes back as a view of the memory map; copied, so that no array
            # the model keeps (jax may alias a host buffer on CPU) holds the file's pages.
            return out.copy() if np.may_share_memory(out, data) else out
        # Row blocks into one output: dequantize's float32 temporaries (several times its
        # output) then take a block's size, not the tensor's (SmolLM2's Q8_0 embedding:
        # 113 MB of output, a peak of about 150 MB more dequantized whole); aligned, so that
        # jax on CPU places it without a copy (hf_checkpoint.HOST_ALIGNMENT).
        out = hf_checkpoint.aligned_empty((data.shape[0], *self.shape(name)[1:]), np.float32)
        for i in range(0, data.shape[0], DEQUANTIZE_ROWS):
            rows = quants.dequantize(data[i : i + DEQUANTIZE_ROWS], kind)
            out[i : i + DEQUANTIZE_ROWS] = rows.reshape(-1, *out.shape[1:])
        return out.reshape(self.shape(name))


# Block size of GGML's quantized types (Q4_0 .. Q8_0; the K-quants' 256-element super-blocks
# hold 32-element sub-blocks too): re-quantization to int8 keeps one scale per such block.
GGML_BLOCK = 32
_FLOAT_TYPES = ("F32", "F16", "BF16")
# Types whose blocks load as int8 without loss (decode_blocks): the group each scale (and
# offset) covers. Q2_K and Q3_K are re-quantized per 32-element block instead.
LOSSLESS_GROUPS = {
    "Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16,
}  # fmt: skip
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
_WITH_OFFSET = {"Q4_1", "Q5_1", "Q4_K", "Q5_K"}
_SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row [n, 2] -> float16 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles(b: np.ndarray, width: int) -> np.ndarray:
    """[n, bytes] -> [n, 2 * bytes]: per run of `width` bytes, its low nibbles then its high
    ones (GGML's 4-bit packing: byte j of a run holds elements j and j + width)."""
    runs = b.reshape(b.shape[0], -1, 1, width)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(b.shape[0], -1)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit minima per super-block: bytes
    0-3 and 4-7 hold scales / minima 0-3 in their low 6 bits and the top 2 bits of 4-7 in
    their high 2; bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and minima 4-7."""
    lo_s, lo_m, mixed = b[:, 0:4], b[:, 4:8], b[:, 8:12]
    scales = np.concatenate([lo_s & 63, (mixed & 15) | ((lo_s >> 6) << 4)], axis=1)
    minima = np.concatenate([lo_m & 63, (mixed >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return scales.astype(np.float32), minima.astype(np.float32)


def decode_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A block-quantized tensor's integers, scales and offsets, exactly as the file stores
    them: the weight is q * scale + offset per group of LOSSLESS_GROUPS[kind] elements.

    Q8_0 / Q4_0 / Q5_0 keep their float16 d as the scale (q: -128..127 / -8..7 / -16..15, no
    offset); Q4_1 / Q5_1 their float16 d and minimum m (q 0..15 / 0..31); the K-quants fold
    the super-block's d (and dmin) with each sub-block's scale (and minimum) into float32:
    Q4_K / Q5_K scale d * sc and offset -dmin * m (q 0..15 / 0..31), Q6_K scale d * sc per 16
    (q -32..31). Each product is the float32 one gguf.quants.dequantize forms.

    Args:
      data: uint8[..., row bytes] (GGUFReader's tensor.data of a quantized tensor).
      kind: a LOSSLESS_GROUPS type name.

    Returns:
      q int8[..., n], scale[..., n / group], offset[..., n / group] or None.
    """
    rows = data.shape[:-1]
    if kind in _BLOCK_BYTES:
        b = data.reshape(-1, _BLOCK_BYTES[kind])
        d = _f16(b[:, 0:2])
        m = _f16(b[:, 2:4]) if kind in ("Q4_1", "Q5_1") else None
        if kind == "Q8_0":
            q = b[:, 2:].view(np.int8)
        else:
            q = _nibbles(b[:, -16:], 16)
            if kind in ("Q5_0", "Q5_1"):  # 32 high bits, element j's in bit j (little end)
                high = np.unpackbits(b[:, -20:-16], axis=1, bitorder="little")
                q = q | (high << 4)
            if m is None:  # Q4_0 / Q5_0: centred on 8 / 16
                q = q.astype(np.int16) - (8 if kind == "Q4_0" else 16)
            q = q.astype(np.int8)
        scale, offset = d, m
    else:
        b = data.reshape(-1, _SUPER_BLOCK_BYTES[kind])
        if kind == "Q6_K":
            # ql[128] qh[64] scales int8[16] d; per half of 128: ql's 64 bytes low nibbles
            # then high ones, qh's 32 bytes bit pairs 0-1 .. 6-7 for four runs of 32.
            low = _nibbles(b[:, 0:128], 64)
            pairs = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
            q = (low | ((pairs & 3).reshape(-1, 256) << 4)).astype(np.int16) - 32
            sub = b[:, 192:208].view(np.int8).astype(np.float32)
            scale, offset = _f16(b[:, 208:210]).astype(np.float32) * sub, None
        else:
            # d dmin scales[12] (Q5_K: qh[32]) qs[128]: four runs of 32 bytes, two
            # sub-blocks each; Q5_K's bit i of qh byte e is sub-block i's element e.
            d = _f16(b[:, 0:2]).astype(np.float32)
            dmin = _f16(b[:, 2:4]).astype(np.float32)
            sc, mn = _k_scales(b[:, 4:16])
            q = _nibbles(b[:, -128:], 32)
            if kind == "Q5_K":
                high = np.unpackbits(b[:, 16:48, None], axis=2, bitorder="little")
                q = q | (high.transpose(0, 2, 1).reshape(-1, 256) << 4)
            scale, offset = d * sc, -(dmin * mn)
        q = q.astype(np.int8)
    n = q.size // max(1, int(np.prod(rows)))
    shape = (*rows, n // LOSSLESS_GROUPS[kind])
    q = q.reshape(*rows, n)
    return q, scale.reshape(shape), None if offset is None else offset.reshape(shape)


def block_forms(file: GGUFFile, specs: dict) -> dict[str, tuple[int, Any, bool]]:
    """Param name -> (group, scale dtype, has offset): the one int8 form every layer's tensor
    of that name takes, so that the layers stack (a Q4_K_M file mixes Q4_K and Q6_K layers of
    attn_v and ffn_down). The smallest group of the kinds found, float16 scales when every
    kind stores float16 ones, an offset when any kind has one (zero where its kind has none);
    names with a kind outside LOSSLESS_GROUPS are absent (re-quantized)."""
    kinds: dict[str, set[str]] = {}
    for key, spec in specs.items():
        tensor = file.tensors.get(gguf_tensor_name(spec.hf_name, file.arch))
        if key[0] == "layers" and key[-1] in quant.QUANTIZED_PARAMS and tensor is not None:
            kinds.setdefault(key[-1], set()).add(tensor.tensor_type.name)
    return {
        name: (
            min(LOSSLESS_GROUPS[k] for k in found),
            np.dtype(np.float16 if found <= set(_BLOCK_BYTES) else np.float32),
            bool(found & _WITH_OFFSET),
        )
        for name, found in kinds.items()
        if found <= set(LOSSLESS_GROUPS)
    }


def _quantize(
    file: GGUFFile,
    method: str,
    layout_rows: Callable[[str, np.ndarray], np.ndarray],
    forms: dict[str, tuple[int, Any, bool]],
    name: str,
    spec,
    value: np.ndarray,
):
    """A projection's (or the embedding table's) stored form under --quantization
    (load_gguf_model's docstring)."""
    if name == "embed":
        return _quantized_embedding(file, method, spec, value)
    if name not in quant.QUANTIZED_PARAMS:
        return value
    tensor_name = gguf_tensor_name(spec.hf_name, file.arch)
    kind = file.tensors[tensor_name].tensor_type.name
    axes = quant.QUANTIZED_PARAMS[name]
    form = forms.get(name)
    if method == "int8" and form and value.shape[axes[-1]] % form[0] == 0:
        group, dtype, has_offset = form
        q, scale, offset = decode_blocks(np.asarray(file.tensors[tensor_name].data), kind)
        repeat = LOSSLESS_GROUPS[kind] // group  # exact: a block's scale on each of its groups
        scale = np.repeat(scale, repeat, axis=-1).astype(dtype)
        if has_offset:
            offset = np.zeros_like(scale) if offset is None else offset
            offset = layout_rows(tensor_name, np.repeat(offset, repeat, axis=-1).astype(dtype))
        stored = quant.QuantizedWeight(
            layout_rows(tensor_name, q), layout_rows(tensor_name, scale), group, -1, offset
        )
        return quant.hf_to_layout(stored, spec, name)
    if method == "fp8" or kind in _FLOAT_TYPES or value.shape[axes[-1]] % GGML_BLOCK:
        return quant.quantize(value, axes, method, name=spec.hf_name)
    return quant.quantize(value, axes, "int8", group=GGML_BLOCK, name=spec.hf_name)


def _quantized_embedding(file: GGUFFile, method: str, spec, value: np.ndarray):
    """token_embd under --quantization int8: its blocks as stored (decode_blocks; scales per
    block of each row, so a lookup and the tied LM head dequantize by rows, models/
    quantization.py embed_rows and tied_logits), when its type keeps them without loss; a
    float table (F32/F16/BF16, or a type outside LOSSLESS_GROUPS) and "fp8" keep value."""
    tensor = file.tensors[gguf_tensor_name(spec.hf_name, file.arch)]
    kind = tensor.tensor_type.name
    if method != "int8" or kind not in LOSSLESS_GROUPS:
        return value
    q, scale, offset = decode_blocks(np.asarray(tensor.data), kind)
    q = q.reshape(value.shape)
    scale = scale.reshape(value.shape[0], -1)
    offset = None if offset is None else offset.reshape(scale.shape)
    return quant.QuantizedWeight(q, scale, LOSSLESS_GROUPS[kind], -1, offset)


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K permutation for rope: rows [h, j, 2] -> [h, 2, j].

    convert_hf_to_gguf.py stores row (head h, half s, index j) of a Hugging Face projection
    (rotate-half layout: the two halves of a head are rotated together) at row (h, j, s), so
    pairs rotated together sit next to each other as GGML's rope expects. w is [rows, ...]
    with rows = num_heads * head_dim (a weight [out, in] or a bias [out]).
    """
    head_dim = w.shape[0] // num_heads
    grouped = w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
    return grouped.swapaxes(1, 2).reshape(w.shape)


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a GGUF file (reads metadata and tensor shapes only)."""
    return _config(GGUFFile(path))


def _config(file: GGUFFile) -> ModelConfig:
    meta, source = file.metadata, file.path
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{source}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )

    def field(key: str, default: Any = None, *, required: bool = False) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            if required:
                raise ValueError(f"{source}: missing metadata field {full!r}")
            return default
        value = meta[full]
        if isinstance(value, list):
            # A ValueError like every other malformed-file error, so callers catch one type.
            raise ValueError(f"{source}: metadata field {full!r} varies per layer; not supported")  # noqa: TRY004
        return value

    hidden = int(field("embedding_length", required=True))
    num_heads = int(field("attention.head_count", required=True))
    head_dim = field("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = field("rope.dimension_count")  # full rotary: the head dim
    head_dim = int(head_dim) if head_dim is not None else hidden // num_heads
    value_dim = field("attention.value_length")
    mla = arch in gguf_families.MLA_ARCHITECTURES  # its head dims: deepseek2_fields
    if value_dim is not None and int(value_dim) != head_dim and not mla:
        raise ValueError(
            f"{source}: value head dim {value_dim} differs from key head dim {head_dim}; "
            "not supported"
        )
    rope_scaling = None
    scaling_type = field("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = LinearRopeScaling(factor=float(field("rope.scaling.factor", required=True)))
    elif scaling_type not in (None, "none") and arch not in ("gpt-oss", "deepseek2"):  # yarn
        raise ValueError(f"{source}: {arch}.rope.scaling.type {scaling_type!r} is not supported")
    rope_theta = float(field("rope.freq_base", 10000.0))
    embed = gguf_tensor_name("model.embed_tokens.weight")
    if embed not in file.tensors:
        raise ValueError(f"{source}: missing tensor {embed!r}")
    if ROPE_FREQS in file.tensors:
        original = field("rope.scaling.original_context_length")
        rope_scaling = llama3_rope_scaling(
            file.read(ROPE_FREQS), rope_theta, head_dim, original, source=str(source)
        )
    num_experts = int(field("expert_count", 0))
    moe = {}
    if num_experts:
        architecture = EXPERT_ARCHITECTURES.get(arch, ARCHITECTURES[arch])
        # Mixtral and Qwen3-MoE renormalise the top-k weights (llama.cpp hard-codes it per
        # architecture), OLMoE does not; expert_weights_norm says so where a file has it.
        norm = field("expert_weights_norm", arch != "olmoe")
        moe = {
            "num_experts": num_experts,
            "num_experts_per_tok": int(field("expert_used_count", required=True)),
            "moe_intermediate_size": int(
                field("expert_feed_forward_length", field("feed_forward_length"))
            ),
            "norm_topk_prob": bool(norm),
        }
        if arch == "olmoe":
            moe.update(qk_norm_full=True, clip_qkv=field("attention.clamp_kqv"))
        if arch == "glm4moe":
            moe.update(_glm4moe_fields(field, head_dim, source))
    elif arch in ("qwen3moe", "olmoe", "glm4moe"):
        raise ValueError(f"{source}: missing metadata field '{arch}.expert_count'")
    else:
        architecture = ARCHITECTURES[arch]
    # GLM-4.5's block_count counts its multi-token-prediction blocks after the decoder.
    num_layers = int(field("block_count", required=True)) - int(field("nextn_predict_layers", 0))
    context_length = int(field("context_length", required=True))
    family = {"rope_scaling": rope_scaling}
    if arch in gguf_families.ARCHITECTURES:
        family.update(
            gguf_families.config_fields(
                arch,
                field,
                meta,
                file.read,
                file.tensors,
                hidden=hidden,
                num_heads=num_heads,
                head_dim=head_dim,
                num_layers=num_layers,
                context_length=context_length,
                source=str(source),
            )
        )
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    # A family's own attention geometry or architecture (deepseek2's latent pool) wins.
    shape = {k: family.pop(k) for k in ("architecture", "num_kv_heads", "head_dim") if k in family}
    try:
        return ModelConfig(
            architecture=shape.get("architecture", architecture),
            vocab_size=file.shape(embed)[0],
            hidden_size=hidden,
            intermediate_size=int(field("feed_forward_length", required=True)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=shape.get("num_kv_heads", int(field("attention.head_count_kv", num_heads))),
            head_dim=shape.get("head_dim", head_dim),
            rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            max_position_embeddings=context_length,
            tie_word_embeddings=gguf_tensor_name("lm_head.weight") not in file.tensors,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in file.tensors,
            qk_norm=arch in ("qwen3", "qwen3moe", "gemma3")
            or (arch == "glm4moe" and "blk.0.attn_q_norm.weight" in file.tensors),
            **{**moe, **family},
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos_ids),
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _glm4moe_fields(field: Callable, head_dim: int, source: Path) -> dict[str, Any]:
    """GLM-4.5's routing, shared experts, dense first blocks and partial rotary, as
    llama.cpp's converter writes them (Glm4MoeModel; the defaults are transformers')."""
    gating = int(field("expert_gating_func", _SIGMOID_GATING))
    if gating != _SIGMOID_GATING:
        raise ValueError(
            f"{source}: glm4moe.expert_gating_func {gating} is not supported; supported: "
            f"{_SIGMOID_GATING} (sigmoid)"
        )
    return {
        "norm_topk_prob": bool(field("expert_weights_norm", True)),
        "moe_scoring": "sigmoid",
        "router_bias": True,
        "num_expert_groups": int(field("expert_group_count", 1)),
        "topk_groups": int(field("expert_group_used_count", 1)),
        "routed_scaling_factor": float(field("expert_weights_scale", 1.0)),
        "num_shared_experts": int(field("expert_shared_count", 1)),
        "num_dense_layers": int(field("leading_dense_block_count", 1)),
        "partial_rotary_factor": int(field("rope.dimension_count", head_dim // 2)) / head_dim,
    }


# gguf.ExpertGatingFuncType.SIGMOID: llama.cpp's code for sigmoid router scores.
_SIGMOID_GATING = 2


def llama3_rope_scaling(
    factors: np.ndarray,
    rope_theta: float,
    head_dim: int,
    original_context_length: int | None,
    *,
    source: str,
) -> RopeScaling | None:
    """The llama3 rope scaling whose per-frequency divisors are `factors` (rope_freqs.weight).

    llama.cpp stores Llama 3.1's scaling as one divisor per rotary frequency: 1 for short
    wavelengths, `factor` for long ones, a smooth blend between. Every released Llama 3.x
    uses low_freq_factor 1 and high_freq_factor 4; the original context length comes from
    the metadata when given, else from a blended frequency, else 8192 (any value between
    the unscaled and scaled wavelengths gives the same divisors). The result is checked to
    reproduce every divisor.

    Returns:
      RopeScaling, or None when every divisor is 1.

    Raises:
      ValueError: the divisors are not llama3 scaling with those factors.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ValueError(
            f"{source}: tensor {ROPE_FREQS!r} has {factors.size} entries, expected {head_dim // 2}"
        )
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(factors.max())
    low, high = 1.0, 4.0
    wavelen = 2 * np.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    blended = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if original_context_length is not None:
        original = int(original_context_length)
    elif blended.any():
        # 1/divisor = (1 - s)/factor + s, with s = (original/wavelen - low) / (high - low).
        i = int(np.flatnonzero(blended)[0])
        s = (1 / factors[i] - 1 / factor) / (1 - 1 / factor)
        original = round(float(wavelen[i] * (low + s * (high - low))))
    else:
        original = 8192
    scaling = RopeScaling(
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )
    if not np.allclose(_llama3_divisors(scaling, wavelen), factors, rtol=1e-5, atol=0):
        raise ValueError(
            f"{source}: tensor {ROPE_FREQS!r} does not hold llama3 rope scaling "
            f"(factor {factor}, low_freq_factor 1, high_freq_factor 4); not supported"
        )
    return scaling


def _llama3_divisors(rs: RopeScaling, wavelen: np.ndarray) -> np.ndarray:
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = 1 / ((1 - smooth) / rs.factor + smooth)
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    return np.where(
        wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, rs.factor, blended)
    )


def generation_defaults(metadata: dict[str, Any]) -> dict[str, Any]:
    """Sampling defaults a GGUF recommends (general.sampling.*), under SamplingParams' names."""
    names = {
        "general.sampling.temp": "temperature",
        "general.sampling.top_p": "top_p",
        "general.sampling.top_k": "top_k",
        "general.sampling.min_p": "min_p",
        "general.sampling.penalty_repeat": "repetition_penalty",
    }
    return {ours: metadata[key] for key, ours in names.items() if key in metadata}


def load_gguf_model(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    mesh: Any = None,
    on_host: bool = False,
    stacked: bool | Callable[[ModelConfig], bool] = False,
    expert_parallel: bool = False,
    quantization: str | None = None,
) -> hf_checkpoint.LoadedModel:
    """Loads a GGUF file, dequantized into dtype, or with quantization its projections kept
    quantized (models/quantization.py).

    Args:
      path: a .gguf file.
      dtype: dtype of every param (default as models.hf_checkpoint.resolve_dtype).
      mesh: a Mesh of models.sharding (None: every param on the default device).
      on_host: keep params as numpy arrays, ignoring mesh.
      stacked: the layers stacked for lax.scan (hf_checkpoint.build_params), unless on_host.
      expert_parallel: experts split over the mesh (ModelConfig.with_expert_parallel).
      quantization: None: every tensor dequantized into dtype. "int8": the projections
        keep GGUF's blocks along the input dim without loss (decode_blocks): Q8_0, Q4_0,
        Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K as their own integers in int8 with the block
        scales (and minima as offsets), float16 as stored for the 32-element types, float32
        for the K-quants, one form per param name across layers (block_forms); Q2_K / Q3_K
        (and a block type whose blocks do not fit the layout) re-quantized to int8 per
        32-element block (float32 scales); F32/F16/BF16 per output channel. "fp8": float8_e4m3fn per output channel. The embedding
        table (token_embd, also the tied LM head) keeps its blocks the same way under "int8"
        (_quantized_embedding); a float one, and every one under "fp8", stays in dtype, as do
        output.weight (an untied LM head) and the norms.

    Returns:
      LoadedModel with the tokenizer, chat template, BOS/EOS texts and sampling defaults the
      file's metadata gives. eos_token_ids: tokenizer.ggml.eos_token_id, then eot/eom ids.

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file, truncated, an unsupported architecture, tensor type or
        tokenizer, a missing, misshaped or unexpected tensor; the message names the file.
    """
    from models import gguf_tokenizer

    quant.check_method(quantization)
    file = GGUFFile(path)
    config = _config(file).with_expert_parallel(expert_parallel)
    target_dtype = hf_checkpoint.resolve_dtype(dtype)
    permuted = file.arch == "llama"
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    specs = gguf_families.stored_norm_specs(config, hf_checkpoint.tensor_specs(config))
    specs = gguf_families.gpt_oss_specs(config, specs)
    wanted = {gguf_tensor_name(spec.hf_name, file.arch) for spec in specs.values()}
    wanted |= {ROPE_FREQS} | gguf_families.extra_tensors(file.arch, config.num_layers)
    # Blocks after the decoder's (GLM-4.5's multi-token-prediction blocks) are not run.
    mtp = range(config.num_layers, int(file.metadata.get(f"{file.arch}.block_count", 0)))
    unexpected = sorted(
        name for name in set(file.tensors) - wanted
        if not ((m := _BLOCK.match(name)) and int(m.group(1)) in mtp)
    )  # fmt: skip
    if unexpected:
        shown = ", ".join(repr(n) for n in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise ValueError(
            f"{file.path}: unexpected tensor(s) {shown}{more} for {config.architecture}"
        )

    for name in file.tensors:  # every type, before any tensor is dequantized
        file.check_type(name)
    built = gguf_tokenizer.build_tokenizer(file.metadata, source=str(file.path))
    tokenizer, info = built if built is not None else (None, None)

    def read(spec: hf_checkpoint.TensorSpec) -> np.ndarray:
        name = gguf_tensor_name(spec.hf_name, file.arch)
        try:
            joined = gguf_families.kv_b_rows(config, name, file.tensors, file.read)
        except ValueError as e:
            raise ValueError(f"{file.path}: {e}") from None
        if joined is not None:  # deepseek2's kv_b as llama.cpp's converter splits it
            return joined
        if name not in file.tensors:
            raise ValueError(f"{file.path}: missing tensor {name!r}")
        shape = file.shape(name)
        expected = (spec.experts, *spec.hf_shape) if spec.experts else spec.hf_shape
        if shape != expected:
            raise ValueError(
                f"{file.path}: tensor {name!r} has shape {list(shape)}, expected "
                f"{list(expected)} from the file's metadata"
            )
        return layout_rows(name, file.read(name))

    def layout_rows(name: str, w: np.ndarray) -> np.ndarray:
        """Rows of a tensor (or of its block scales) un-permuted where the file permuted
        them (llama's attn_q / attn_k)."""
        kind = name.split(".")[-2]  # "blk.3.attn_q.weight" -> "attn_q"
        return unpermute_rows(w, heads[kind]) if permuted and kind in heads else w

    quantize = None
    if quantization is not None:
        forms = block_forms(file, specs)
        quantize = functools.partial(_quantize, file, quantization, layout_rows, forms)
    params = hf_checkpoint.build_params(
        config, specs, read, dtype=target_dtype, mesh=mesh, on_host=on_host, stacked=stacked,
        quantize=quantize,
    )
    return hf_checkpoint.LoadedModel(
        config=config,
        params=params,
        tokenizer=tokenizer,
        eos_token_ids=config.eos_token_ids,
        path=file.path,
        mesh=mesh,
        chat_template=info.chat_template if info else None,
        bos_token=info.bos_token if info else None,
        eos_token=info.eos_token if info else None,
        generation_defaults=generation_defaults(file.metadata),
    )

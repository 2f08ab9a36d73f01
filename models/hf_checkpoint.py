"""Hugging Face checkpoint directories, and the pieces every loader shares.

Reads config.json, model.safetensors (or shards listed by model.safetensors.index.json),
tokenizer.json, generation_config.json (EOS ids and sampling defaults), tokenizer_config.json
or chat_template.jinja (chat template, BOS/EOS texts). torch Linear weights are stored
[out, in]; they are transposed and split into heads to give the layout documented in
models/config.py. Shared with models/gguf.py and models/orbax_checkpoint.py: LoadedModel,
the tensor map (tensor_specs) and build_params, which casts and places each tensor.
models/loader.py picks the loader for a path.

Invariants: every tensor the config implies is present with exactly its expected shape, and
no tensor of the checkpoint is left unused (an unused bias would silently change the model).
Every failure is a ValueError or FileNotFoundError whose message names the file and the field
or tensor at fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from models import mla, mxfp4
from models.config import ModelConfig

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# generation_config.json fields that are sampling defaults (SamplingParams' names).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# Tensors that some checkpoints carry and that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig  # eos_token_ids already resolved as below
    params: dict[str, Any]  # layout of models/config.py, jax arrays
    tokenizer: Any  # tokenizers.Tokenizer, or None (no tokenizer.json / tokenizer metadata)
    # generation_config.json's if present, else config.json's; a GGUF's eos, eot and eom ids.
    eos_token_ids: tuple[int, ...]
    path: Path  # the model directory, or the .gguf file
    mesh: Any = None  # jax.sharding.Mesh the params are sharded over (None: one device)
    chat_template: str | None = None  # Jinja source, rendered by models/chat_template.py
    bos_token: str | None = None  # BOS/EOS texts, the template variables bos_token/eos_token
    eos_token: str | None = None
    # Sampling defaults the model ships (temperature, top_p, top_k, min_p, repetition_penalty;
    # only those it sets), for requests that leave them unset.
    generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One HF tensor and how it maps into the params layout.

    rows: this param is rows [start, stop) of a fused HF tensor (Phi-3's qkv_proj and
    gate_up_proj): readers give the whole tensor (hf_shape), to_layout takes its rows, and
    to_hf gives those rows back.
    experts: this param stacks `experts` HF tensors, hf_name with "{expert}" formatted to
    0 .. experts - 1, each of hf_shape: readers give them stacked, [experts, *hf_shape]
    (GGUF stores them so), and to_layout / to_hf map that stack.
    interleaved: (offset, stride): this param is every stride-th element of the last axis
    of hf_name from offset (gpt-oss's gate_up_proj: gate at even columns, up at odd)."""

    hf_name: str
    hf_shape: tuple[int, ...]
    to_layout: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    rows: tuple[int, int] | None = None
    experts: int = 0
    interleaved: tuple[int, int] | None = None

    @property
    def hf_names(self) -> list[str]:
        """The HF tensors this param is read from (one, or one per expert)."""
        if not self.experts:
            return [self.hf_name]
        return [self.hf_name.format(expert=e) for e in range(self.experts)]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _linear(out_dim: int, in_dim: int, layout_shape: tuple[int, ...]):
    """torch Linear weight [out, in] <-> layout array: [in, out] transposed, then split.

    wq [D, Hq, Dh] and w_gate [D, F] split the out dim; wo [Hq, Dh, D] splits the in dim.
    """

    def to_layout(w: np.ndarray) -> np.ndarray:
        return w.T.reshape(layout_shape)

    def to_hf(x: np.ndarray) -> np.ndarray:
        return x.reshape(in_dim, out_dim).T

    return to_layout, to_hf


def _split(hf_dim: int, layout_shape: tuple[int, ...]):
    """A bias [H * Dh] <-> [H, Dh]."""
    return (lambda w: w.reshape(layout_shape)), (lambda x: x.reshape(hf_dim))


def _norm_plus_one():
    """A Gemma norm weight w (HF's model multiplies by 1 + w) <-> w + 1, in float32."""
    return (lambda w: w.astype(np.float32) + 1), (lambda x: x.astype(np.float32) - 1)


def _fused_rows(name: str, hf_shape: tuple[int, ...], start: int, stop: int, layout_shape):
    """Rows [start, stop) of a fused torch Linear weight as a layout array ([in, out] split
    as _linear does)."""
    to_layout, to_hf = _linear(stop - start, hf_shape[1], layout_shape)
    return TensorSpec(
        name, hf_shape, lambda w: to_layout(w[start:stop]), to_hf, rows=(start, stop)
    )


def tensor_specs(cfg: ModelConfig) -> dict[tuple, TensorSpec]:
    """Maps each params path (("embed",), ("layers", i, "wq"), ...) to its HF tensor."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def plain(name: str, shape: tuple[int, ...]) -> TensorSpec:
        return TensorSpec(name, shape, _identity, _identity)

    def norm(name: str, shape: tuple[int, ...]) -> TensorSpec:
        if cfg.gemma_norms:
            return TensorSpec(name, shape, *_norm_plus_one())
        return plain(name, shape)

    def linear(name: str, out_dim: int, in_dim: int, layout_shape: tuple[int, ...]):
        return TensorSpec(name, (out_dim, in_dim), *_linear(out_dim, in_dim, layout_shape))

    def bias(name: str, heads: int) -> TensorSpec:
        return TensorSpec(name, (heads * dh,), *_split(heads * dh, (heads, dh)))

    specs: dict[tuple, TensorSpec] = {("embed",): plain("model.embed_tokens.weight", (v, d))}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_norm": norm(p + "input_layernorm.weight", (d,)),
            "post_attn_norm": norm(p + "post_attention_layernorm.weight", (d,)),
            "wq": linear(p + "self_attn.q_proj.weight", hq * dh, d, (d, hq, dh)),
            "wk": linear(p + "self_attn.k_proj.weight", hkv * dh, d, (d, hkv, dh)),
            "wv": linear(p + "self_attn.v_proj.weight", hkv * dh, d, (d, hkv, dh)),
            "wo": linear(p + "self_attn.o_proj.weight", d, hq * dh, (hq, dh, d)),
            "w_gate": linear(p + "mlp.gate_proj.weight", f, d, (d, f)),
            "w_up": linear(p + "mlp.up_proj.weight", f, d, (d, f)),
            "w_down": linear(p + "mlp.down_proj.weight", d, f, (f, d)),
        }
        if cfg.attention_bias:
            layer["bq"] = bias(p + "self_attn.q_proj.bias", hq)
            layer["bk"] = bias(p + "self_attn.k_proj.bias", hkv)
            layer["bv"] = bias(p + "self_attn.v_proj.bias", hkv)
        if cfg.qk_norm:
            layer["q_norm"] = norm(p + "self_attn.q_norm.weight", (dh,))
            layer["k_norm"] = norm(p + "self_attn.k_norm.weight", (dh,))
        if cfg.post_norms:  # Gemma: HF's post_attention_layernorm is the attention output's
            layer["attn_out_norm"] = layer["post_attn_norm"]
            layer["post_attn_norm"] = norm(p + "pre_feedforward_layernorm.weight", (d,))
            layer["mlp_out_norm"] = norm(p + "post_feedforward_layernorm.weight", (d,))
        if cfg.architecture == "Phi3ForCausalLM":  # fused projections, split here
            qkv, q, kv = (hq + 2 * hkv) * dh, hq * dh, hkv * dh
            name = p + "self_attn.qkv_proj.weight"
            layer["wq"] = _fused_rows(name, (qkv, d), 0, q, (d, hq, dh))
            layer["wk"] = _fused_rows(name, (qkv, d), q, q + kv, (d, hkv, dh))
            layer["wv"] = _fused_rows(name, (qkv, d), q + kv, qkv, (d, hkv, dh))
            name = p + "mlp.gate_up_proj.weight"
            layer["w_gate"] = _fused_rows(name, (2 * f, d), 0, f, (d, f))
            layer["w_up"] = _fused_rows(name, (2 * f, d), f, 2 * f, (d, f))
        if cfg.kv_lora_rank:  # latent attention (models/mla.py)
            del layer["wq"], layer["wk"], layer["wv"], layer["wo"]
            layer.update({k: TensorSpec(*t) for k, t in mla.hf_tensors(cfg, p).items()})
        if cfg.o_bias:
            layer["bo"] = plain(p + "self_attn.o_proj.bias", (d,))
        if cfg.attention_sinks:
            layer["sinks"] = plain(p + "self_attn.sinks", (hq,))
        if cfg.has_experts(i):
            del layer["w_gate"], layer["w_up"], layer["w_down"]
            experts = _gpt_oss_expert_specs if cfg.expert_bias else _expert_specs
            layer.update(experts(cfg, p))
        if cfg.qk_norm_full:  # OLMoE: one norm over the whole projection, as [H, Dh]
            layer["q_norm"] = bias(p + "self_attn.q_norm.weight", hq)
            layer["k_norm"] = bias(p + "self_attn.k_norm.weight", hkv)
        for key, spec in layer.items():
            specs[("layers", i, key)] = spec
    specs[("final_norm",)] = norm("model.norm.weight", (d,))
    if not cfg.tie_word_embeddings:
        specs[("lm_head",)] = linear("lm_head.weight", v, d, (d, v))
    return specs


# Per-expert tensor names: Mixtral's block_sparse_moe.experts.N.w1/w3/w2, the others'
# mlp.experts.N.gate_proj/up_proj/down_proj; the router is block_sparse_moe.gate / mlp.gate.
_EXPERT_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe.", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": ("mlp.", "gate_proj", "up_proj", "down_proj"),
    "OlmoeForCausalLM": ("mlp.", "gate_proj", "up_proj", "down_proj"),
    "Glm4MoeForCausalLM": ("mlp.", "gate_proj", "up_proj", "down_proj"),
    "DeepseekV2ForCausalLM": ("mlp.", "gate_proj", "up_proj", "down_proj"),
    "DeepseekV3ForCausalLM": ("mlp.", "gate_proj", "up_proj", "down_proj"),
}


def _expert_specs(cfg: ModelConfig, prefix: str) -> dict[str, TensorSpec]:
    """A layer's router [D, E] and stacked experts [E, D, F] / [E, F, D] (from torch
    Linear weights [F, D] / [D, F] per expert)."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    block, gate, up, down = _EXPERT_NAMES[cfg.architecture]
    swap = (lambda w: np.swapaxes(w, 1, 2)), (lambda x: np.swapaxes(x, 1, 2))

    def experts(name: str, shape: tuple[int, int]) -> TensorSpec:
        return TensorSpec(f"{prefix}{block}experts.{{expert}}.{name}.weight", shape, *swap, experts=e)

    specs = {
        "router": TensorSpec(f"{prefix}{block}gate.weight", (e, d), *_linear(e, d, (d, e))),
        "w_gate_exps": experts(gate, (f, d)),
        "w_up_exps": experts(up, (f, d)),
        "w_down_exps": experts(down, (d, f)),
    }
    if cfg.router_bias:  # DeepSeek-V3 / GLM-4.5's noaux_tc score correction
        name = f"{prefix}{block}gate.e_score_correction_bias"
        specs["router_bias"] = TensorSpec(name, (e,), _identity, _identity)
    fs = cfg.shared_intermediate_size
    if fs:  # one gated MLP of every shared expert's columns, as transformers holds them
        shared = f"{prefix}{block}shared_experts."
        for key, name, out_dim, in_dim in (
            ("w_gate_shared", "gate_proj", fs, d),
            ("w_up_shared", "up_proj", fs, d),
            ("w_down_shared", "down_proj", d, fs),
        ):
            layout = _linear(out_dim, in_dim, (in_dim, out_dim))
            specs[key] = TensorSpec(f"{shared}{name}.weight", (out_dim, in_dim), *layout)
    return specs


def _gpt_oss_expert_specs(cfg: ModelConfig, prefix: str) -> dict[str, TensorSpec]:
    """gpt-oss's router (weight [E, D] and bias) and experts, stored stacked and already
    [in, out]: gate_up_proj [E, D, 2F] with gate and up interleaved (even and odd columns),
    its bias [E, 2F], down_proj [E, F, D] and its bias [E, D]."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    p = prefix + "mlp."

    def plain(name: str, shape: tuple[int, ...]) -> TensorSpec:
        return TensorSpec(p + name, shape, _identity, _identity)

    def half(name: str, shape: tuple[int, ...], offset: int) -> TensorSpec:
        return TensorSpec(p + name, shape, lambda w: w[..., offset::2], _identity,
                          interleaved=(offset, 2))  # fmt: skip

    return {
        "router": TensorSpec(p + "router.weight", (e, d), *_linear(e, d, (d, e))),
        "b_router": plain("router.bias", (e,)),
        "w_gate_exps": half("experts.gate_up_proj", (e, d, 2 * f), 0),
        "w_up_exps": half("experts.gate_up_proj", (e, d, 2 * f), 1),
        "w_down_exps": plain("experts.down_proj", (e, f, d)),
        "b_gate_exps": half("experts.gate_up_proj_bias", (e, 2 * f), 0),
        "b_up_exps": half("experts.gate_up_proj_bias", (e, 2 * f), 1),
        "b_down_exps": plain("experts.down_proj_bias", (e, d)),
    }


def _read_json(path: Path, *, required: bool = True) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path}: file not found")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON: {e}") from None
    if not isinstance(data, dict):
        # A ValueError like every other malformed-file error, so callers catch one type.
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")  # noqa: TRY004
    return data


def _eos_ids(value: Any, source: Path) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
        raise ValueError(f"{source}: field 'eos_token_id' must be an int or a list of ints")
    return tuple(values)


def _weight_files(model_dir: Path) -> tuple[dict[str, Path], Path]:
    """Maps each tensor name to the safetensors file holding it (from the index if sharded).

    Returns the map and the file that lists the tensors (the index, or model.safetensors).
    """
    index_path = model_dir / WEIGHTS_INDEX_FILE
    single = model_dir / WEIGHTS_FILE
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(f, str) for k, f in weight_map.items()
        ):
            raise ValueError(f"{index_path}: field 'weight_map' must map tensor names to files")
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise FileNotFoundError(f"{index_path}: shard {path.name!r} not found")
        return files, index_path
    if single.is_file():
        return {name: single for name in _tensor_names(single)}, single
    raise FileNotFoundError(f"{model_dir}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} found")


def _open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="np")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file: {e}") from None


def _tensor_names(path: Path) -> list[str]:
    with _open(path) as f:
        return list(f.keys())


def _read_tensor(handle, path: Path, name: str) -> np.ndarray:
    """One tensor as a numpy array; bfloat16 comes back as ml_dtypes.bfloat16, float8
    (F8_E4M3, which safetensors' numpy reader cannot return) as ml_dtypes.float8_e4m3fn."""
    from safetensors import SafetensorError

    try:
        if handle.get_slice(name).get_dtype() == "F8_E4M3":
            return _read_fp8(path, name)
        return handle.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: cannot read tensor {name!r}: {e}") from None


def _read_fp8(path: Path, name: str) -> np.ndarray:
    """An F8_E4M3 tensor of a safetensors file, read through its header (the format: an
    8-byte little-endian header size, a JSON header of dtype/shape/data_offsets, the data)."""
    import ml_dtypes

    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(size))[name]
        start, stop = entry["data_offsets"]
        f.seek(8 + size + start)
        data = f.read(stop - start)
    return np.frombuffer(data, np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(entry["shape"]).copy()


def resolve_dtype(dtype: Any):
    import jax
    import jax.numpy as jnp

    if dtype is None:
        return jnp.dtype(jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32)
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a dtype") from None
    if not jnp.issubdtype(resolved, jnp.floating):
        raise ValueError(f"dtype must be a floating point type, got {resolved}")
    return resolved


def _set(params: dict[str, Any], key: tuple, value: Any) -> None:
    if key[0] == "layers":
        params["layers"][key[1]][key[2]] = value
    else:
        params[key[0]] = value


# jax on CPU places a host array whose data is aligned to this many bytes without copying
# it (device_put aliases it; numpy's own large arrays sit 16 bytes past a page): the load's
# peak then holds a stacked array once, not twice (checked by test_stacked_loading.py).
HOST_ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """np.empty(shape, dtype) with its data aligned to HOST_ALIGNMENT bytes (a page): an
    anonymous memory map, unmapped when the last array over it goes.

    Not numpy's own allocation: numpy advises the kernel to back arrays of 4 MiB and more
    with huge pages, and where transparent huge pages are "madvise" with defrag "madvise"
    (Ubuntu's and Debian's defaults) each first touch of such memory waits for the kernel
    to compact a huge page. Measured on the 2-core VM: filling SmolLM2's stacked float32
    layers (425 MB) took about 3 s so against about 0.3 s here, most of a 7 s load."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)


def _place(value: Any, sharding: Any, name: str = ""):
    """A host array onto its sharding: each device receives only its own slice (a
    QuantizedWeight: each of its arrays, split as models.sharding.quantized_spec says)."""
    import jax

    if not isinstance(value, np.ndarray):
        if sharding is None:
            return _tree_map(lambda a: _place(a, None), value)
        from models.sharding import quantized_shardings

        return _tree_map(_place, value, quantized_shardings(sharding, value, name))
    if sharding is None:
        return jax.device_put(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def build_params(
    config: ModelConfig,
    specs: dict[tuple, TensorSpec],
    read: Callable[[TensorSpec], np.ndarray],
    *,
    dtype: Any,
    mesh: Any = None,
    on_host: bool = False,
    stacked: bool | Callable[[ModelConfig], bool] = False,
    quantize: Callable[[str, TensorSpec, np.ndarray], Any] | None = None,
) -> dict[str, Any]:
    """The params pytree: read(spec) gives each tensor in its Hugging Face shape (the reader
    checks it), here turned into the layout, cast to dtype and placed on its devices.

    quantize(name, spec, value): a layer param's stored form from its float32 layout value (a
    models.quantization.QuantizedWeight, or value itself to keep it in dtype); None: every
    param in dtype. A reader may give a QuantizedWeight of the Hugging Face layout (an fp8
    checkpoint): it is kept as stored (hf_to_layout).

    stacked: "layers" as one dict of [num_layers, ...] arrays (the scanned layout,
    models/llama.py stack_layers), filled on the host and placed name by name, each host
    array dropped once placed: the load holds the model once on the host and once on the
    devices at most, never a second device copy. Stacked, the layers are read name by name
    (every layer's q projection, then every layer's k ...) and each [num_layers, ...] array
    is placed as soon as it is full, so the host holds one of them at a time, not all."""
    if callable(stacked):  # decided from the model's config (models/loader.py load_model)
        stacked = stacked(config)
    stacked = stacked and not on_host
    shardings = _shardings(config, mesh, stacked=stacked)
    params: dict[str, Any] = {"layers": {} if stacked else [{} for _ in range(config.num_layers)]}
    items = list(specs.items())
    if stacked:
        names = list(dict.fromkeys(k[2] for k, _ in items if k[0] == "layers"))
        items.sort(
            key=lambda kv: (names.index(kv[0][2]), kv[0][1]) if kv[0][0] == "layers" else (-1, 0)
        )
    host: dict[str, np.ndarray] = {}  # stacked: name -> [rows, ...] being filled
    # Stacked, each name over the layers that have it (models/llama.py layer_at: dense MLP
    # layers before expert layers hold different names): layer -> row, and the last layer.
    rows: dict[str, list[int]] = {}
    for key, _ in items:
        if key[0] == "layers":
            rows.setdefault(key[2], []).append(key[1])
    for key, spec in items:
        value = _stored(key, spec, read(spec), dtype, quantize)
        if stacked and key[0] == "layers":
            name = key[2]
            if name not in host:
                num_rows = len(rows[name])
                host[name] = _tree_map(
                    lambda a, n=num_rows: aligned_empty((n, *a.shape), a.dtype), value
                )
                if not isinstance(value, np.ndarray) and shardings:  # refused before reading on
                    from models.sharding import quantized_shardings

                    quantized_shardings(shardings[("layers", name)], host[name], spec.hf_name)
            _set_layer(host[name], rows[name].index(key[1]), value)
            if key[1] == rows[name][-1]:  # full: placed, the host copy dropped
                params["layers"][name] = _place(
                    host.pop(name), shardings.get(("layers", name)), spec.hf_name
                )
            continue
        _set(params, key, value if on_host else _place(value, shardings.get(key), spec.hf_name))
    return params


def _tree_map(fn: Callable, *trees: Any) -> Any:
    """jax.tree.map (a param is an array, or a QuantizedWeight of two)."""
    import jax

    return jax.tree.map(fn, *trees)


def _set_layer(stacked: Any, index: int, value: Any) -> None:
    """Row index of a stacked host param (an array or a QuantizedWeight) set to value."""
    import jax

    for s, v in zip(jax.tree.leaves(stacked), jax.tree.leaves(value), strict=True):
        s[index] = v


def _stored(key: tuple, spec: TensorSpec, raw: Any, dtype: Any, quantize) -> Any:
    """A tensor read in the Hugging Face layout as the param stores it (dtype, or quantized)."""
    from models import quantization

    if quantization.is_quantized(raw):  # already quantized in the checkpoint
        return quantization.hf_to_layout(raw, spec, key[-1])
    if quantize is not None and (key[0] == "layers" or key == ("embed",)):
        name = key[2] if key[0] == "layers" else "embed"  # quantize keeps what it does not take
        value = quantize(name, spec, np.asarray(spec.to_layout(raw), dtype=np.float32))
        if quantization.is_quantized(value):
            return value
    # Cast on the host (ml_dtypes for bfloat16): jnp.asarray(x, dtype=...) would compile
    # one XLA convert per distinct tensor shape.
    return np.ascontiguousarray(spec.to_layout(raw), dtype=dtype)


def quantizer(method: str | None) -> Callable[[str, TensorSpec, np.ndarray], Any] | None:
    """build_params' quantize for quantization=method (None: None, every param in dtype): a
    layer param of models.quantization.QUANTIZED_PARAMS quantized per output channel
    (quantize_param), its errors naming spec.hf_name; the others kept in dtype."""
    if method is None:
        return None
    from models import quantization as quant

    def quantize(name: str, spec: TensorSpec, value: np.ndarray) -> Any:
        return quant.quantize_param(name, value, method, name=spec.hf_name)

    return quantize


def load_hf_model(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    mesh: Any = None,
    on_host: bool = False,
    stacked: bool | Callable[[ModelConfig], bool] = False,
    expert_parallel: bool = False,
    quantization: str | None = None,
) -> LoadedModel:
    """Loads a Hugging Face model directory.

    Args:
      path: directory with config.json, model.safetensors (or shards with
        model.safetensors.index.json), and optionally tokenizer.json,
        generation_config.json, tokenizer_config.json, special_tokens_map.json and
        chat_template.jinja.
      dtype: dtype of every param (str or jnp dtype); default bfloat16 on an accelerator,
        float32 on CPU.
      mesh: a Mesh of models.sharding; each tensor is read once on the host and each device
        receives only its shard (None: every param on the default device).
      on_host: keep params as numpy arrays (for conversion), ignoring mesh.
      stacked: the layers stacked for lax.scan (build_params), unless on_host.
      expert_parallel: experts split over the mesh (ModelConfig.with_expert_parallel).
      quantization: "int8" or "fp8": the projections quantized per output channel at load
        (models/quantization.py). A compressed-tensors fp8 checkpoint (config.json's
        quantization_config) loads its float8_e4m3fn weights and weight_scale as stored; an
        MXFP4 one (gpt-oss: each expert tensor as _blocks and _scales, models/mxfp4.py) is
        dequantized as read, one tensor at a time, then stored in dtype (or as int8 with
        its scales under quantization="int8").

    Returns:
      LoadedModel. tokenizer is None when there is no tokenizer.json (the engine can still
      run on token ids). eos_token_ids come from generation_config.json when it has
      eos_token_id, else from config.json; config.eos_token_ids is set to the same. The chat
      template, BOS/EOS texts and sampling defaults are read by `read_chat_settings`.

    Raises:
      FileNotFoundError: the directory, config.json, the weights or a shard is missing.
      ValueError: unreadable JSON or safetensors, an unsupported architecture or field, a
        missing, unexpected or wrongly shaped tensor. The message names the file and field.
    """
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory not found")
    target_dtype = resolve_dtype(dtype)
    config_path = model_dir / CONFIG_FILE
    config = read_hf_config(model_dir).with_expert_parallel(expert_parallel)

    from models import quantization as quant

    quant.check_method(quantization)
    files, weights_source = _weight_files(model_dir)
    specs = tensor_specs(config)
    wanted = {name for spec in specs.values() for name in spec.hf_names}
    fp8 = _compressed_tensors_fp8(_read_json(config_path), config_path)
    if fp8:  # each quantized weight's scale (and a static input scale, unused: dynamic)
        wanted |= {n + "_scale" for n in wanted} | {n[: -len("weight")] + "input_scale" for n in wanted}
    # gpt-oss's MXFP4 experts: W_blocks and W_scales in place of W (models/mxfp4.py)
    packed = {n for n in wanted if n not in files and n + "_blocks" in files}
    wanted |= {n + suffix for n in packed for suffix in ("_blocks", "_scales")}
    extra = _extra_layer_prefixes(_read_json(config_path), config.num_layers)
    unexpected = sorted(
        name
        for name in files
        if name not in wanted
        and not name.endswith(_IGNORED_SUFFIXES)
        and not name.startswith(extra)
        and not (config.tie_word_embeddings and name == "lm_head.weight")
    )
    if unexpected:
        shown = ", ".join(repr(n) for n in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise ValueError(
            f"{files[unexpected[0]]}: unexpected tensor(s) {shown}{more} for "
            f"{config.architecture} as described by {config_path}"
        )

    handles: dict[Path, Any] = {}
    with contextlib.ExitStack() as stack:

        def read_one(name: str, shape: tuple[int, ...] | None) -> np.ndarray:
            if name in packed:  # dequantized, [..., out, in] -> the float tensor's [..., in, out]
                blocks, scales = read_one(name + "_blocks", None), read_one(name + "_scales", None)
                file = files[name + "_blocks"]
                array = np.swapaxes(mxfp4.dequantize(blocks, scales, name=f"{file}: {name}"), -1, -2)
            else:
                file = files.get(name)
                if file is None:
                    raise ValueError(f"{weights_source}: missing tensor {name!r}")
                if file not in handles:
                    handles[file] = stack.enter_context(_open(file))
                array = _read_tensor(handles[file], file, name)
            if shape is not None and tuple(array.shape) != shape:
                raise ValueError(
                    f"{file}: tensor {name!r} has shape {list(array.shape)}, "
                    f"expected {list(shape)} from {config_path}"
                )
            return array

        def read_stored(name: str, shape: tuple[int, ...]) -> Any:
            array = read_one(name, shape)
            if array.dtype != np.dtype(quant.STORAGE_DTYPES["fp8"]):
                return array
            scale_name = name + "_scale"
            if scale_name not in files:
                raise ValueError(
                    f"{weights_source}: fp8 tensor {name!r} has no {scale_name!r} "
                    "(compressed-tensors stores one per quantized weight)"
                )
            return quant.QuantizedWeight(array, read_one(scale_name, None))

        def read(spec: TensorSpec) -> Any:
            if spec.experts:
                parts = [read_stored(n, spec.hf_shape) for n in spec.hf_names]
                if quant.is_quantized(parts[0]):
                    return quant.QuantizedWeight(
                        np.stack([p.q for p in parts]), np.stack([p.scale for p in parts])
                    )
                return np.stack(parts)
            return read_stored(spec.hf_name, spec.hf_shape)

        params = build_params(
            config, specs, read, dtype=target_dtype, mesh=mesh, on_host=on_host,
            stacked=stacked, quantize=quantizer(quantization),
        )
    return directory_model(model_dir, config, params, mesh)


def _extra_layer_prefixes(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """The tensor-name prefixes of the multi-token-prediction layers that GLM-4.5 and
    DeepSeek-V3 checkpoints append after their decoder layers (num_nextn_predict_layers;
    transformers ignores them too): left unread, as speculative decoding does not use them."""
    extra = raw.get("num_nextn_predict_layers") or 0
    return tuple(f"model.layers.{num_layers + j}." for j in range(extra))


def _compressed_tensors_fp8(raw: dict[str, Any], source: Path) -> bool:
    """Whether config.json's quantization_config is compressed-tensors fp8 weights (the
    only quantized checkpoint layout jpaged reads); any other quantization_config is refused."""
    qc = raw.get("quantization_config")
    if qc is None:
        return False
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "mxfp4":  # gpt-oss's experts, dequantized as read (load_hf_model)
        return False
    if method != "compressed-tensors":
        raise ValueError(
            f"{source}: quantization_config quant_method {method!r} is not supported; "
            "supported: compressed-tensors (fp8 weights), mxfp4 (gpt-oss's experts)"
        )
    for name, group in (qc.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise ValueError(
                f"{source}: quantization_config config_groups.{name}.weights is "
                f"{weights.get('type')!r} with {weights.get('num_bits')!r} bits; jpaged reads "
                "float 8-bit (fp8 e4m3) weights only"
            )
    return True


def directory_model(model_dir: Path, config: ModelConfig, params: Any, mesh: Any) -> LoadedModel:
    """A LoadedModel of params with the tokenizer, EOS ids and chat settings that model_dir's
    files give (a Hugging Face directory, or one converted to Orbax)."""
    tokenizer = load_tokenizer(model_dir)
    return LoadedModel(
        config=config,
        params=params,
        tokenizer=tokenizer,
        eos_token_ids=config.eos_token_ids,
        path=model_dir,
        mesh=mesh,
        **read_chat_settings(model_dir, config, tokenizer),
    )


def read_hf_config(model_dir: Path) -> ModelConfig:
    """config.json, with eos_token_ids from generation_config.json when it has them."""
    config_path = model_dir / CONFIG_FILE
    config = ModelConfig.from_hf_config(_read_json(config_path), source=str(config_path))
    gen_path = model_dir / GENERATION_CONFIG_FILE
    gen = _read_json(gen_path, required=False)
    if gen is not None and gen.get("eos_token_id") is not None:
        config = dataclasses.replace(config, eos_token_ids=_eos_ids(gen["eos_token_id"], gen_path))
    return config


def read_chat_settings(model_dir: Path, config: ModelConfig, tokenizer: Any) -> dict[str, Any]:
    """LoadedModel's chat_template, bos_token, eos_token and generation_defaults for a
    Hugging Face (or Orbax) directory.

    chat_template: chat_template.jinja if present, else tokenizer_config.json's
    "chat_template" (a string, or a list of {"name", "template"} of which "default" is used).
    bos_token/eos_token: tokenizer_config.json's, else special_tokens_map.json's, else the
    tokenizer's text for config's BOS id and first EOS id. generation_defaults: the fields of
    GENERATION_DEFAULT_FIELDS that generation_config.json sets.
    """
    tok_config_path = model_dir / TOKENIZER_CONFIG_FILE
    tok_config = _read_json(tok_config_path, required=False) or {}
    special_map = _read_json(model_dir / SPECIAL_TOKENS_MAP_FILE, required=False) or {}

    def token_text(name: str, token_id: int | None) -> str | None:
        for source in (tok_config, special_map):
            value = source.get(name)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                return value
        if tokenizer is not None and token_id is not None:
            return tokenizer.id_to_token(token_id)
        return None

    eos_id = config.eos_token_ids[0] if config.eos_token_ids else None
    gen = _read_json(model_dir / GENERATION_CONFIG_FILE, required=False) or {}
    return {
        "chat_template": _chat_template(model_dir, tok_config, tok_config_path),
        "bos_token": token_text("bos_token", config.bos_token_id),
        "eos_token": token_text("eos_token", eos_id),
        "generation_defaults": {
            k: gen[k] for k in GENERATION_DEFAULT_FIELDS if gen.get(k) is not None
        },
    }


def _chat_template(model_dir: Path, tok_config: dict[str, Any], source: Path) -> str | None:
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{jinja_path}: not readable text: {e}") from None
    template = tok_config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in template
    ):
        named = {t["name"]: t.get("template") for t in template}
        chosen = named.get("default")
        if chosen is None or isinstance(chosen, str):
            return chosen
    raise ValueError(
        f"{source}: field 'chat_template' must be a string or a list of "
        '{"name": ..., "template": ...} objects'
    )


def _shardings(config: ModelConfig, mesh: Any, *, stacked: bool = False) -> dict[tuple, Any]:
    """params path -> NamedSharding ({} without a mesh); stacked: the layers' paths are
    ("layers", name)."""
    if mesh is None:
        return {}
    import jax

    from models.sharding import param_shardings

    flat = jax.tree_util.tree_flatten_with_path(param_shardings(config, mesh, stacked=stacked))[0]
    return {tuple(getattr(k, "key", getattr(k, "idx", None)) for k in p): s for p, s in flat}


def load_tokenizer(model_dir: Path):
    """tokenizer.json as a tokenizers.Tokenizer, or None when there is none."""
    tokenizer = None
    tokenizer_path = model_dir / TOKENIZER_FILE
    if tokenizer_path.is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception)
            raise ValueError(f"{tokenizer_path}: not a readable tokenizer: {e}") from None
    return tokenizer


def save_hf_model(path: str | os.PathLike, config: dict[str, Any], params: dict[str, Any]) -> Path:
    """Writes params (layout of models/config.py) as a Hugging Face checkpoint.

    The inverse of load_hf_model's weight mapping: config.json and one model.safetensors
    that transformers can load too. Arrays are written in their own dtype (numpy, so not
    bfloat16 unless ml_dtypes provides it).

    Args:
      path: directory, created if missing.
      config: the config.json dict; must describe params.
      params: numpy (or jax) arrays in the params layout.

    Returns:
      The directory.
    """
    from safetensors.numpy import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf_config(config, source="config")
    tensors = {}
    for key, spec in tensor_specs(cfg).items():
        value = params[key[0]][key[1]][key[2]] if key[0] == "layers" else params[key[0]]
        hf = np.ascontiguousarray(spec.to_hf(np.asarray(value)))
        shape = spec.hf_shape
        if spec.rows is not None:  # a part of a fused tensor
            shape = (spec.rows[1] - spec.rows[0], *shape[1:])
        if spec.interleaved is not None:  # every stride-th column of a fused tensor
            shape = (*shape[:-1], shape[-1] // spec.interleaved[1])
        if spec.experts:
            shape = (spec.experts, *shape)
        if hf.shape != shape:
            raise ValueError(f"params{list(key)}: shape {list(value.shape)} does not match config")
        if spec.experts:
            tensors.update(zip(spec.hf_names, hf, strict=True))
        elif spec.interleaved is not None:
            offset, stride = spec.interleaved
            fused = tensors.setdefault(spec.hf_name, np.zeros(spec.hf_shape, hf.dtype))
            fused[..., offset::stride] = hf
        elif spec.rows is None:
            tensors[spec.hf_name] = hf
        else:
            fused = tensors.setdefault(spec.hf_name, np.zeros(spec.hf_shape, hf.dtype))
            fused[spec.rows[0] : spec.rows[1]] = hf
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out

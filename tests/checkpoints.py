"""Tiny random Hugging Face checkpoints made with transformers, for tests (torch is test-only).

`make_tiny_checkpoint(path, arch)` writes a checkpoint directory exactly as save_pretrained
does, plus the demo tokenizer (models.demo.build_tokenizer) so tests can feed real text, and
a generation_config.json. Everything is float32 and seeded: the same call gives the same
weights. Norm weights and biases are perturbed away from HF's init (ones, zeros) so that a
norm or bias that is dropped or misplaced shows up in outputs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")

_BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> tuple[str, int, int, int]:
    from models.demo import BOS_TOKEN, EOS_TOKEN, build_tokenizer

    tok = build_tokenizer()
    return (
        tok.to_str(),
        tok.get_vocab_size(),
        tok.token_to_id(BOS_TOKEN),
        tok.token_to_id(EOS_TOKEN),
    )


def tiny_hf_config(arch: str, **overrides: Any):
    """The transformers config object for arch ("llama", "llama3", "mistral", "qwen2", "qwen3")."""
    import transformers

    _, vocab, bos, eos = _tokenizer_json()
    kwargs: dict[str, Any] = dict(
        _BASE, vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False
    )
    if arch == "llama":
        cls = transformers.LlamaConfig
    elif arch == "llama3":
        cls = transformers.LlamaConfig
        kwargs.update(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=True,
        )
    elif arch == "mistral":
        cls = transformers.MistralConfig
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
    elif arch == "qwen3":
        cls = transformers.Qwen3Config
        kwargs.update(head_dim=32)  # not hidden_size / num_heads (16), as in real Qwen3
    else:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    kwargs.update(overrides)
    return cls(**kwargs)


def make_tiny_checkpoint(
    path: str | Path,
    arch: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Builds and saves a tiny random model of arch into path (created if missing).

    Args:
      path: output directory.
      arch: one of ARCHS.
      seed: torch.manual_seed for the weights.
      dtype: torch dtype name the weights are stored in (made in float32, then cast).
      max_shard_size: passed to save_pretrained (e.g. "20KB") to get a sharded checkpoint
        with model.safetensors.index.json.
      **overrides: transformers config fields (e.g. num_hidden_layers=1).

    Returns:
      path, holding config.json, model.safetensors (or shards and an index),
      generation_config.json (eos_token_id as a list) and tokenizer.json.
    """
    import torch
    import transformers

    out = Path(path)
    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    model = model.to(getattr(torch, dtype))
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    tokenizer_json, _, bos, eos = _tokenizer_json()
    (out / "tokenizer.json").write_text(tokenizer_json)
    generation_config = {"bos_token_id": bos, "eos_token_id": [eos]}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return out


def load_torch_model(path: str | Path):
    """The checkpoint at path as a transformers model (eval mode, float32, eager attention)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


# --- GGUF files written from a checkpoint, as llama.cpp's convert_hf_to_gguf.py does ----------

_GGUF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_GGUF_LAYER_NAMES = {
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
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def llama_cpp_permute(w, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_unpermute(w, n_head: int):
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_rope_factors(config: dict[str, Any], head_dim: int):
    """rope_freqs.weight as convert_hf_to_gguf.py computes it for rope_type "llama3"."""
    import math

    import numpy as np

    rs = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rs.get("rope_type") != "llama3":
        return None
    base = config.get("rope_theta", rs.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def add_gguf_tokenizer(writer: Any, hf_dir: str | Path, bos_id: int, eos_id: int) -> None:
    """The checkpoint's byte-level BPE tokenizer.json as a "gpt2" GGUF tokenizer with BOS
    added (special added tokens typed CONTROL)."""
    from tokenizers import Tokenizer

    path = Path(hf_dir) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    merges = json.loads(path.read_text())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(True)


def stack_expert(out: dict, names: Any, hf_name: str, w: Any, num_experts: int) -> None:
    """Puts expert weight w (HF name "model.layers.L.mlp.experts.E.<proj>.weight") at row E of
    its GGUF stack blk.L.ffn_<proj>_exps [num_experts, out, in] in out (names: gguf's tensor
    name map), making the stack on the first expert seen."""
    import numpy as np

    parts = hf_name.split(".")
    stacked = ".".join(parts[:5] + parts[6:])
    stack = out.setdefault(
        names.get_name(stacked, try_suffixes=(".weight",)),
        np.zeros((num_experts, *w.shape), w.dtype),
    )
    stack[int(parts[5])] = w


def finish_gguf(writer: Any) -> None:
    """Writes a GGUFWriter's header, metadata and tensors to its file and closes it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(
    hf_dir: str | Path,
    out: str | Path,
    tensor_type: str | Any = "F32",
    *,
    seed: int = 0,
    chat_template: str | None = None,
    skip: tuple[str, ...] = (),
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Writes the checkpoint at hf_dir as a GGUF file with gguf.GGUFWriter.

    Metadata and tensor names as llama.cpp's converter writes them; for the llama architecture
    the rows of q_proj and k_proj are permuted for GGML's rope. The tokenizer (the checkpoint's
    byte-level BPE tokenizer.json) is stored as a "gpt2" model with BOS added.

    Args:
      tensor_type: GGML type name for every tensor of 2 dimensions, or a function
        (gguf name, shape) -> type name; 1-D tensors stay F32 (as the converter keeps them).
        Types gguf.quants cannot quantize (the K-quants) get random bytes of that type, with
        every fp16 scale finite.
      seed: for those random bytes.
      chat_template: stored as tokenizer.chat_template when given.
      skip: GGUF tensor names left out of the file.
      metadata: more key/value pairs (float -> FLOAT32, int -> UINT32, str -> STRING).

    Returns:
      {Hugging Face tensor name: float32 array} holding what the file stores, dequantized and
      un-permuted: the weights a correct loader must produce.
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCHS[config["architectures"][0]]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    add_gguf_tokenizer(writer, hf_dir, config["bos_token_id"], config["eos_token_id"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        add = {float: writer.add_float32, int: writer.add_uint32, str: writer.add_string}
        add[type(value)](key, value)

    rng = np.random.default_rng(seed)
    stored: dict[str, Any] = {}
    factors = _llama3_rope_factors(config, head_dim)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    for hf_name, w in load_file(str(hf_dir / "model.safetensors")).items():
        w = w.astype(np.float32)
        name = _gguf_name(hf_name)
        if name in skip:
            continue
        n_head = {"attn_q": heads, "attn_k": kv_heads}.get(name.split(".")[-2])
        if arch == "llama" and n_head is not None:
            w = llama_cpp_permute(w, n_head)
        kind = tensor_type(name, w.shape) if callable(tensor_type) else tensor_type
        qtype = gguf.GGMLQuantizationType[kind if w.ndim == 2 else "F32"]
        if qtype == gguf.GGMLQuantizationType.F32:
            raw = w
        else:
            try:
                raw = gguf.quants.quantize(w, qtype)
            except NotImplementedError:
                # Clearing bit 6 of every byte keeps each fp16 exponent below all-ones: finite.
                byte_shape = gguf.quants.quant_shape_to_byte_shape(w.shape, qtype)
                raw = rng.integers(0, 256, size=byte_shape, dtype=np.uint8) & np.uint8(0xBF)
        writer.add_tensor(name, raw, raw_dtype=None if raw.dtype != np.uint8 else qtype)
        value = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
        if arch == "llama" and n_head is not None:
            value = llama_cpp_unpermute(value, n_head)
        stored[hf_name] = np.ascontiguousarray(value, dtype=np.float32)
    finish_gguf(writer)
    return stored


def write_hf_like(hf_dir: str | Path, out: str | Path, tensors: dict[str, Any]) -> Path:
    """A copy of the checkpoint at hf_dir with its weights replaced by tensors (write_gguf's
    return value): the Hugging Face directory a GGUF load must equal."""
    import shutil

    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copyfile(Path(hf_dir) / name, out / name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def assert_same_params(actual: Any, expected: Any) -> None:
    """Two params pytrees with the same structure, dtypes and exactly equal values."""
    import jax
    import numpy as np

    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for (path, a), e in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected)
    ):
        name = jax.tree_util.keystr(path)
        assert a.dtype == e.dtype, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)

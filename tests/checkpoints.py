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

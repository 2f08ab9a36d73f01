"""Tiny random Llama checkpoints written without torch or transformers.

`make_llama_checkpoint(path, ...)` writes what a Hugging Face Llama directory holds
(config.json, model.safetensors, tokenizer.json, generation_config.json) with
models.demo.write_llama_checkpoint: numpy weights N(0, 0.02), norms 1 plus noise, made from a
seed. The demo tokenizer is included, so tests can feed text.

Tests that only need *a* checkpoint (sharding, the kernel path, the engine) use this one, so
they also run where torch is not installed (CI's Python 3.12 stage, the GPU machine);
tests/checkpoints.py (transformers' save_pretrained) stays for the tests that compare
against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path


def make_llama_checkpoint(
    path: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
) -> Path:
    """A LlamaForCausalLM of the given size (head_dim = hidden // heads) at path."""
    from models.demo import BOS_TOKEN, EOS_TOKEN, build_tokenizer, write_llama_checkpoint

    tokenizer = build_tokenizer()
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    out = write_llama_checkpoint(
        path, seed=seed, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        intermediate=intermediate, vocab=tokenizer.get_vocab_size(), max_position_embeddings=512,
        bos_token_id=bos, eos_token_id=eos,
    )
    tokenizer.save(str(Path(out) / "tokenizer.json"))
    generation_config = {"bos_token_id": bos, "eos_token_id": [eos]}
    (Path(out) / "generation_config.json").write_text(json.dumps(generation_config) + "\n")
    return Path(out)

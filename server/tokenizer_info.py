"""GET /tokenizer_info as vLLM serves it: the tokenizer's configuration in the keys of a
Hugging Face tokenizer_config.json, plus tokenizer_class and the chat template.

vLLM answers with its tokenizer's init kwargs; jpaged loads a bare `tokenizers` tokenizer
(from tokenizer.json or a GGUF), so the same keys are read off it: bos_token and eos_token
(the texts templates write), unk_token (the model's), add_bos_token and add_eos_token (what
encoding with special tokens adds, found by encoding a word both ways), model_max_length
(the server's max_model_len), added_tokens_decoder ({id: {content, lstrip, rstrip,
normalized, single_word, special}}) and chat_template (the server's --chat-template, else
the model's). tokenizer_class is PreTrainedTokenizerFast, the class transformers loads such
a tokenizer as. Clients such as lm-evaluation-harness read it beside /tokenize.
"""

from __future__ import annotations

from typing import Any


def tokenizer_config(
    engine: Any, server_template: str | None, max_model_len: int
) -> dict[str, Any] | None:
    """The /tokenizer_info body for the engine's tokenizer, or None when it has none."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend", None)
    info: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast"
        if backend is not None
        else type(tokenizer).__name__,
        "bos_token": getattr(engine, "bos_token", None),
        "eos_token": getattr(engine, "eos_token", None),
        "model_max_length": max_model_len,
    }
    if backend is not None:
        info["unk_token"] = getattr(backend.model, "unk_token", None)
        plain = backend.encode("a", add_special_tokens=False).ids
        special = backend.encode("a", add_special_tokens=True).ids
        at = _find(special, plain)
        info["add_bos_token"] = at > 0
        info["add_eos_token"] = at >= 0 and at + len(plain) < len(special)
        info["added_tokens_decoder"] = {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(backend.get_added_tokens_decoder().items())
        }
    template = server_template or getattr(engine, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


def _find(ids: list[int], part: list[int]) -> int:
    """Where part starts in ids, or -1."""
    for i in range(len(ids) - len(part) + 1):
        if ids[i : i + len(part)] == part:
            return i
    return -1

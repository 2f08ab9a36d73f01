"""A thin wrapper over a `tokenizers.Tokenizer` with the calls the engine and users need.

Incremental detokenization is the output processor's (tokenizers' DecodeStream).
"""

from __future__ import annotations

import tokenizers


class Tokenizer:
    def __init__(self, tok: tokenizers.Tokenizer, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.backend = tok
        self.eos_token_ids = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.encode(text)}

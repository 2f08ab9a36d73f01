"""A thin wrapper over a `tokenizers.Tokenizer` with the calls the engine and users need.

Incremental detokenization (vLLM's offsets scheme) never emits half a UTF-8 character: text
is only released once the decoded tail no longer ends in the replacement character.
"""

from __future__ import annotations

import tokenizers

_REPLACEMENT = "\ufffd"


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

    def decode_incremental(
        self,
        ids: list[int],
        prefix_offset: int,
        read_offset: int,
        skip_special_tokens: bool = True,
    ) -> tuple[str, int, int]:
        """New text since read_offset, and the updated (prefix_offset, read_offset).

        ids[prefix_offset:read_offset] is context already emitted: decoding it with the new
        tokens and subtracting keeps word-boundary spaces right for every tokenizer.
        """
        prefix = self.decode(ids[prefix_offset:read_offset], skip_special_tokens)
        full = self.decode(ids[prefix_offset:], skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            return full[len(prefix) :], read_offset, len(ids)
        return "", prefix_offset, read_offset

"""The matchers of constrained sequences, on the host, over llguidance.

StructuredOutputManager is the one owner of every constrained sequence's matcher:
- a JSON constraint that sets no whitespace of its own runs with the engine's default
  (disable_any_whitespace, from StructuredOutputsConfig), fixed when the manager is made;
- a key is added once (add), advanced by every committed token (advance), and removed when
  its sequence finishes (remove); nothing else touches the matchers;
- a matcher that rejects a token marks only its key as failed (error(key)); no call raises
  into the batch for a token the grammar does not allow;
- fill_bitmask writes llguidance's layout: int32[num_rows, ceil(vocab_size / 32)], bit j of
  word w allows token 32 * w + j; rows without a constraint are all ones (-1).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

import llguidance
import llguidance.numpy
import numpy as np

from jpaged.structured_output.params import KIND_NAMES, StructuredOutputsParams, one_line
from jpaged.tokenizer import Tokenizer

# At and above this many constrained rows, masks are computed on llguidance's thread pool
# (measured on 2 CPU cores, 49,152 tokens: as fast as one by one at 8 rows, 5-20% faster at 64).
_PARALLEL_MIN_ROWS = 8


def build_ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of our tokenizer: every id's bytes, with the model's vocabulary size.

    Works from the `tokenizers.Tokenizer` JSON (what llguidance.hf.from_tokenizer does for a
    transformers tokenizer): byte-level BPE (GPT-2, Llama 3, SmolLM2, the demo) and
    SentencePiece-style BPE with byte fallback (<0x0A> tokens, "▁" for spaces). Ids at and
    above the tokenizer's size, up to vocab_size, have no bytes: a constraint never allows them.

    Args:
      tokenizer: ours; its eos_token_ids are the tokens a finished grammar allows.
      vocab_size: the model's vocabulary (logits width), >= the tokenizer's.
    Raises:
      ValueError: vocab_size below the tokenizer's size, or a tokenizer llguidance rejects.
    """
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is below the tokenizer's {tokenizer.vocab_size} tokens"
        )
    backend = copy.copy(tokenizer.backend)  # to_str must not carry padding or truncation
    backend.no_padding()
    backend.no_truncation()
    eos = list(tokenizer.eos_token_ids) or None  # None: llguidance finds it in the vocab
    try:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"structured outputs: llguidance rejects the tokenizer: {e}") from None


class StructuredOutputManager:
    """Matchers of the constrained sequences in flight, keyed by the engine (any hashable:
    a request id, or (request id, sequence index) when one request samples several)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, *, disable_any_whitespace: bool | None = None
    ) -> None:
        """disable_any_whitespace: the engine's default for JSON constraints that set no
        whitespace of their own (StructuredOutputsConfig's; None: the canonical layout)."""
        self.vocab_size = vocab_size
        self.disable_any_whitespace = disable_any_whitespace
        self.num_words = (vocab_size + 31) // 32
        self.ll_tokenizer = build_ll_tokenizer(tokenizer, vocab_size)
        # Short errors: a verbose one dumps the parser state and the grammar.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._matchers: dict[Hashable, llguidance.LLMatcher] = {}
        self._errors: dict[Hashable, str] = {}
        self._executor: llguidance.LLExecutor | None = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, key: Hashable, params: StructuredOutputsParams) -> None:
        """Starts key's matcher at the beginning of the output.

        Raises:
          ValueError: key already added, or a grammar llguidance rejects for this tokenizer.
        """
        if key in self._matchers:
            raise ValueError(f"structured outputs: {key!r} is already added")
        grammar = params.grammar_for(self.disable_any_whitespace)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValueError(
                f"structured_outputs.{params.kind}: invalid {KIND_NAMES[params.kind]}: "
                f"{one_line(matcher.get_error())}"
            )
        self._matchers[key] = matcher

    def fork(self, key: Hashable, new_key: Hashable) -> None:
        """new_key continues from key's state (a forked sequence: n > 1, beam search)."""
        if new_key in self._matchers:
            raise ValueError(f"structured outputs: {new_key!r} is already added")
        self._matchers[new_key] = self._matchers[key].deep_copy()
        if key in self._errors:
            self._errors[new_key] = self._errors[key]

    def remove(self, key: Hashable) -> None:
        """Forgets key; a no-op for a key never added, so it can be called for every finished
        sequence."""
        self._matchers.pop(key, None)
        self._errors.pop(key, None)

    def advance(self, key: Hashable, token_ids: Sequence[int]) -> None:
        """Commits key's new tokens. A token the grammar does not allow fails key alone: its
        message is kept for error(key), and later calls on key change nothing."""
        if key in self._errors:
            return
        matcher = self._matchers[key]
        if not matcher.consume_tokens([int(t) for t in token_ids]):
            self._errors[key] = one_line(matcher.get_error()) or "the matcher failed"

    def rollback(self, key: Hashable, num_tokens: int) -> None:
        """Undoes key's last num_tokens committed tokens (rejected speculative tokens).

        Raises:
          ValueError: more tokens than key has committed.
        """
        if key in self._errors or num_tokens == 0:
            return
        if not self._matchers[key].rollback(num_tokens):
            raise ValueError(
                f"structured outputs: cannot roll back {num_tokens} tokens of {key!r}: "
                f"{one_line(self._matchers[key].get_error())}"
            )

    def error(self, key: Hashable) -> str | None:
        """Why key's matcher failed (one line), or None while it has not."""
        return self._errors.get(key)

    def is_finished(self, key: Hashable) -> bool:
        """True when key's grammar is complete and allows only EOS: the engine stops the
        sequence (finish_reason "stop") without sampling that EOS. False for a failed key."""
        return key not in self._errors and self._matchers[key].is_stopped()

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """int32[num_rows, num_words], all ones: a buffer for fill_bitmask."""
        return np.full((num_rows, self.num_words), -1, np.int32)

    def fill_bitmask(self, keys: Sequence[Hashable | None], out: np.ndarray) -> None:
        """Writes row i of out for keys[i]: the tokens its grammar allows next.

        A None key (an unconstrained row), a failed key and every row past len(keys) (padding)
        get all ones. A finished key's row allows only EOS.

        Args:
          keys: one per batch row, len(keys) <= num_rows.
          out: int32[num_rows, ceil(vocab_size / 32)], C-contiguous; written in place.
        """
        if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != self.num_words:
            raise ValueError(
                f"bitmask must be int32[rows, {self.num_words}], got {out.dtype}{list(out.shape)}"
            )
        if len(keys) > out.shape[0] or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(
                f"bitmask must be C-contiguous with >= {len(keys)} rows, got {out.shape[0]}"
            )
        out.fill(-1)
        rows = [
            (self._matchers[k], i)
            for i, k in enumerate(keys)
            if k is not None and k not in self._errors
        ]
        if len(rows) >= _PARALLEL_MIN_ROWS:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, out)
        else:
            for matcher, i in rows:
                llguidance.numpy.fill_next_token_bitmask(matcher, out, i)

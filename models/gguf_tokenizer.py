"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer` from its metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`,
in id order), its merges or scores, a type per token and the special ids. Two families are
supported, as transformers' GGUF converters and llama.cpp read them:

  "gpt2"  byte-level BPE (SmolLM2, Llama 3, Qwen2/3). Tokens are spelled in GPT-2's byte
          alphabet; `tokenizer.ggml.pre` names how text is split before BPE (a regex per
          family, see _BYTE_LEVEL_SPLITS; unknown names get GPT-2's own split).
  "llama" SentencePiece BPE (Llama 2, Mistral v0.1): "▁" for spaces, prepended to the text
          (unless tokenizer.ggml.add_space_prefix is false), <0xNN> byte-fallback tokens for
          anything outside the vocabulary, merges derived from the scores when absent.

Invariants: every id of the file keeps its id; tokens typed CONTROL (3) are special added
tokens (matched whole, skipped when decoding with skip_special_tokens), USER_DEFINED (4) are
plain added tokens; BOS/EOS are added by a post-processor exactly when
tokenizer.ggml.add_bos_token / add_eos_token say so (for "llama" BOS defaults to on, as in
llama.cpp). Errors are ValueErrors naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

SPIECE_UNDERLINE = "\u2581"

# Pre-tokenizer regexes by tokenizer.ggml.pre, as llama.cpp's llama-vocab.cpp and
# transformers' GGUF converter use them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,  # Mistral NeMo
}
# Llama 3's tokenizer takes a pre-token that is itself in the vocabulary whole, before any
# merge (tokenizer.json's "ignore_merges": true; llama.cpp does the same for these names).
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe"})
# GPT-2's split after each digit is isolated (SmolLM's and StarCoder's tokenizer.json:
# Digits(individual_digits) before ByteLevel; llama.cpp's "\p{N}" split for these names).
_DIGIT_SPLIT = frozenset({"smollm", "starcoder", "refact", "codeshell"})
# Names whose split is GPT-2's own regex.
_GPT2_SPLIT = frozenset({"default", "gpt-2", "gpt2"})

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerInfo:
    """What the chat template and the engine need besides the tokenizer itself."""

    bos_token_id: int | None
    eos_token_id: int | None
    bos_token: str | None  # the token's text, as templates write it ("<s>", "<|im_start|>")
    eos_token: str | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (byte-level BPE vocabularies are written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def build_tokenizer(metadata: Mapping[str, Any], *, source: str):
    """The tokenizer of a GGUF's metadata, or None when the file describes none.

    Args:
      metadata: the file's key/value pairs ("tokenizer.ggml.tokens" -> list of str, ...).
      source: the file, for error messages.

    Returns:
      (tokenizers.Tokenizer, GGUFTokenizerInfo), or None without tokenizer.ggml.model.

    Raises:
      ValueError: an unsupported tokenizer.ggml.model, or fields missing or inconsistent.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = _str_list(metadata, "tokenizer.ggml.tokens", source)
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is not None and len(token_types) != len(tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for "
            f"{len(tokens)} tokens"
        )
    types = [int(t) for t in token_types] if token_types is not None else []

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            raise ValueError(f"{source}: tokenizer.ggml.{key} {value} is not a token id")
        return int(value)

    bos_id, eos_id = token_id("bos_token_id"), token_id("eos_token_id")
    unk_id = token_id("unknown_token_id")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens, types, source)
        add_bos_default = False
    elif kind == "llama":
        unk = tokens[unk_id] if unk_id is not None else None
        tokenizer = _sentencepiece_bpe(metadata, tokens, unk, source)
        add_bos_default = True  # llama.cpp's default for a SentencePiece vocabulary
    else:
        raise ValueError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; supported: gpt2, llama"
        )
    _add_typed_tokens(tokenizer, tokens, types)

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    _set_post_processor(
        tokenizer, bos if add_bos else None, bos_id, eos if add_eos else None, eos_id
    )
    info = GGUFTokenizerInfo(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=add_bos and bos is not None,
        add_eos_token=add_eos and eos is not None,
        chat_template=metadata.get("tokenizer.chat_template"),
    )
    return tokenizer, info


def _str_list(metadata: Mapping[str, Any], key: str, source: str) -> list[str]:
    value = metadata.get(key)
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{source}: field {key!r} must be a list of strings")
    return value


def _merges(metadata: Mapping[str, Any], source: str) -> list[tuple[str, str]] | None:
    raw = metadata.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    merges = []
    for i, merge in enumerate(_str_list(metadata, "tokenizer.ggml.merges", source)):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ValueError(f"{source}: tokenizer.ggml.merges[{i}] {merge!r} is not 'left right'")
        merges.append((left, right))
    return merges


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], types: list[int], source: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = _merges(metadata, source)
    if merges is None:
        raise ValueError(f"{source}: a 'gpt2' tokenizer needs tokenizer.ggml.merges")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        typed = types[i] if types else TOKEN_TYPE_NORMAL
        # A plain token outside the byte alphabet is respelled byte by byte (its UTF-8 bytes);
        # control and user-defined tokens keep their text: they are matched whole, never by BPE.
        if not set(token) <= alphabet and typed not in (
            TOKEN_TYPE_CONTROL,
            TOKEN_TYPE_USER_DEFINED,
        ):
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    split = _BYTE_LEVEL_SPLITS.get(pre)
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGIT_SPLIT:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        if pre not in _GPT2_SPLIT:
            logger.warning(
                "%s: tokenizer.ggml.pre %r is not known to jpaged; splitting text with GPT-2's "
                "regex, which may tokenize differently from the model's own tokenizer",
                source,
                pre,
            )
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(
    metadata: Mapping[str, Any], tokens: list[str], unk: str | None, source: str
):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = _merges(metadata, source)
    if merges is None:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError(
                f"{source}: a 'llama' tokenizer needs tokenizer.ggml.merges or one "
                "tokenizer.ggml.scores entry per token"
            )
        merges = merges_from_scores(tokens, [float(s) for s in scores])
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_UNDERLINE, prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens.

    A merge ranks by the score of the token it makes (highest first), then by the length of
    its left and right parts (longest first); ties keep vocabulary order. This is the order
    transformers derives, so both tokenize alike.
    """
    ids = {}
    for i, token in enumerate(tokens):
        ids.setdefault(token, i)
    score_of = {}
    for token, score in zip(tokens, scores):
        score_of[token] = score  # a repeated token keeps its last score, as a dict built in order
    ranked = []
    for token, score in score_of.items():
        pairs = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in ids and token[cut:] in ids
        ]
        pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        ranked.extend((score, left, right) for left, right in pairs)
    # Stable sort, descending on (score, len(left), len(right)).
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]


def _add_typed_tokens(tokenizer, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    for kind, special in ((TOKEN_TYPE_CONTROL, True), (TOKEN_TYPE_USER_DEFINED, False)):
        added = [
            AddedToken(t, normalized=False, special=special)
            for t, k in zip(tokens, types)
            if k == kind
        ]
        if added:
            (tokenizer.add_special_tokens if special else tokenizer.add_tokens)(added)


def _set_post_processor(
    tokenizer, bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None
) -> None:
    """BOS before and EOS after each sequence, for those given (nothing when neither)."""
    from tokenizers import processors

    if bos is None and eos is None:
        return
    first = f"{bos}:0 " if bos is not None else ""
    last = f" {eos}:0" if eos is not None else ""
    single = f"{first}$A:0{last}"
    pair = f"{single} {first.replace(':0', ':1')}$B:1{last.replace(':0', ':1')}"
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )

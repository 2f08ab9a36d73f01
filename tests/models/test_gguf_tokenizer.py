"""The "llama" (SentencePiece) tokenizer built from GGUF metadata equals transformers' own.

No public SentencePiece GGUF can be fetched here, so the file is written with a Llama-2-style
vocabulary (<unk> <s> </s>, the 256 <0xNN> byte tokens, pieces trained with tokenizers'
SentencePieceBPETokenizer and scored best-first, no merges: they are derived from the
scores), plus a control and a user-defined token. Byte-level ("gpt2") tokenizers are tested
on SmolLM2's real vocabulary (test_gguf_smollm2.py) and on the tiny checkpoints'
(test_gguf_loader.py).
"""

from __future__ import annotations

import gguf
import transformers

from models.gguf import GGUFFile
from models.gguf_tokenizer import build_tokenizer

_SPM_TEXT = (
    "Hello world!  The model reads pages.\nNew line\twith tab; 中文 🚀 café "
    "<|im_start|>user<tool> x  end  "
)


def _write_spm_gguf(path) -> None:
    """A Llama-2-style vocabulary: <unk> <s> </s>, 256 byte tokens, scored pieces, no merges."""
    from tokenizers import SentencePieceBPETokenizer

    from models import demo

    trainer = SentencePieceBPETokenizer()
    lines = demo.__doc__.splitlines() + demo.build_tokenizer.__doc__.splitlines()
    trainer.train_from_iterator(lines, vocab_size=400, min_frequency=2, show_progress=False)
    vocab = trainer.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    tokens += ["<|im_start|>", "<tool>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3, 4])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    path = tmp_path / "spm.gguf"
    _write_spm_gguf(path)
    ours, info = build_tokenizer(GGUFFile(path).metadata, source=str(path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in (_SPM_TEXT, "", " leading space", "  two", "x"):
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text), text
        assert ids[0] == 1  # BOS: on by default for SentencePiece vocabularies
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
    ids = ours.encode(_SPM_TEXT).ids
    assert ours.decode(ids, skip_special_tokens=False) == "<s> " + _SPM_TEXT
    assert any(ours.id_to_token(i) == "<0xF0>" for i in ids)  # 🚀 by byte fallback
    assert (info.bos_token, info.eos_token, info.add_bos_token) == ("<s>", "</s>", True)

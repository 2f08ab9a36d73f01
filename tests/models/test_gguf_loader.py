"""GGUF loading against the Hugging Face checkpoint it was converted from, and its errors.

The files are written here with gguf.GGUFWriter from the tiny checkpoints of
tests/checkpoints.py, as llama.cpp's converter writes them (names, metadata, Q/K rows permuted
for the llama architecture), in F32, Q8_0 and every other supported type; a correct loader
gives back exactly the checkpoint's params (F32) or the params of what the file stores,
dequantized by gguf.quants (the others).
"""

from __future__ import annotations

import dataclasses

import gguf
import jax
import numpy as np
import pytest
from checkpoints import (
    assert_same_params,
    finish_gguf,
    make_tiny_checkpoint,
    write_gguf,
    write_hf_like,
)

from models.gguf import llama3_rope_scaling, read_gguf_config
from models.loader import load_hf_model, load_model, read_config

GGUF_ARCHS = ("llama", "llama3", "qwen2", "qwen3")


def _same_config_but_eps(gguf_cfg, hf_cfg) -> None:
    """GGUF stores rms_norm_eps as float32; everything else is equal to the HF config."""
    assert gguf_cfg.rms_norm_eps == float(np.float32(hf_cfg.rms_norm_eps))
    assert dataclasses.replace(gguf_cfg, rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_params_equal_hf_checkpoint(tmp_path, tiny_checkpoints, arch, tensor_type):
    hf_dir = tiny_checkpoints[arch]
    path = tmp_path / f"{arch}.gguf"
    stored = write_gguf(hf_dir, path, tensor_type)
    loaded = load_model(path, dtype="float32")
    hf = load_hf_model(hf_dir, dtype="float32")
    _same_config_but_eps(loaded.config, hf.config)
    assert read_gguf_config(path) == loaded.config
    if tensor_type == "F32":
        assert_same_params(loaded.params, hf.params)
    else:
        expected = load_hf_model(write_hf_like(hf_dir, tmp_path / "qdq", stored), dtype="float32")
        assert_same_params(loaded.params, expected.params)
        # Quantization really happened: the weights moved off the checkpoint's values.
        assert not np.array_equal(loaded.params["layers"][0]["wq"], hf.params["layers"][0]["wq"])
    assert loaded.eos_token_ids == hf.eos_token_ids == (1,)
    assert loaded.path == path
    assert (loaded.bos_token, loaded.eos_token) == ("<s>", "</s>")


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path, tiny_checkpoints):
    path = tmp_path / "llama3.gguf"
    write_gguf(tiny_checkpoints["llama3"], path)
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert "rope_freqs.weight" in names and "output.weight" not in names
    cfg = read_gguf_config(path)
    assert cfg.tie_word_embeddings
    assert cfg.rope_scaling == load_hf_model(tiny_checkpoints["llama3"]).config.rope_scaling
    assert cfg.rope_scaling.original_max_position_embeddings == 64


def test_tokenizer_equals_checkpoint_tokenizer(tmp_path, tiny_checkpoints):
    """A byte-level BPE written as a "gpt2" GGUF tokenizer encodes like its tokenizer.json."""
    path = tmp_path / "llama.gguf"
    write_gguf(tiny_checkpoints["llama"], path)
    ours = load_model(path).tokenizer
    reference = load_hf_model(tiny_checkpoints["llama"]).tokenizer
    text = "The café's 2048 pages: naïve 中文 🙂\n\tdef f(x): return x  <s></s> end"
    ids = ours.encode(text).ids
    assert ids == reference.encode(text).ids
    assert ids[0] == 0  # BOS from tokenizer.ggml.add_bos_token
    assert ours.decode(ids) == reference.decode(ids) == text.replace("<s></s>", "")
    assert ours.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_every_supported_tensor_type(tmp_path):
    """K-quants, legacy quants and float types, one tensor each, dequantized into dtype."""
    hf_dir = make_tiny_checkpoint(
        tmp_path / "hf", "llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2
    )
    types = {
        "blk.0.attn_q.weight": "Q4_K",
        "blk.0.attn_k.weight": "Q5_K",
        "blk.0.attn_v.weight": "Q6_K",
        "blk.0.attn_output.weight": "Q2_K",
        "blk.0.ffn_gate.weight": "Q3_K",
        "blk.0.ffn_up.weight": "Q4_0",
        "blk.0.ffn_down.weight": "Q5_1",
        "blk.1.attn_q.weight": "F16",
        "blk.1.attn_k.weight": "BF16",
        "blk.1.attn_v.weight": "Q5_0",
        "blk.1.attn_output.weight": "Q8_0",
        "token_embd.weight": "Q4_1",
        "output.weight": "Q6_K",
    }
    path = tmp_path / "mixed.gguf"
    stored = write_gguf(hf_dir, path, lambda name, shape: types.get(name, "F32"))
    file_types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {file_types[name] for name in types} == set(types.values())
    expected = load_hf_model(write_hf_like(hf_dir, tmp_path / "qdq", stored), dtype="float32")
    assert_same_params(load_model(path, dtype="float32").params, expected.params)
    bf16 = load_model(path, dtype="bfloat16").params
    assert_same_params(
        bf16, jax.tree_util.tree_map(lambda x: np.asarray(x).astype("bfloat16"), expected.params)
    )


def test_reading_in_row_blocks_gives_the_whole_tensor(tmp_path, monkeypatch):
    """GGUFFile.read dequantizes tensors of more rows than DEQUANTIZE_ROWS block by block
    (a peak of one block's temporaries); every type, F32 included, reads the same values as
    dequantized whole, and none stays a view of the file."""
    import models.gguf as gguf_module

    hf_dir = make_tiny_checkpoint(
        tmp_path / "hf", "llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2
    )
    types = ["Q4_K", "Q6_K", "Q4_1", "Q8_0", "F16", "BF16", "Q5_0", "F32"]
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
             "blk.0.ffn_up.weight", "blk.1.attn_q.weight", "blk.1.attn_k.weight",
             "blk.1.ffn_down.weight", "blk.1.ffn_gate.weight"]  # fmt: skip
    path = tmp_path / "mixed.gguf"
    write_gguf(hf_dir, path, lambda name, shape: dict(zip(names, types)).get(name, "F32"))
    file = gguf_module.GGUFFile(path)
    assert [file.tensors[n].tensor_type.name for n in names] == types
    whole = {name: file.read(name) for name in names}
    monkeypatch.setattr(gguf_module, "DEQUANTIZE_ROWS", 7)
    for name in names:
        got = file.read(name)
        assert got.dtype == np.float32 and got.shape == file.shape(name)
        assert got.shape[0] in (128, 256)  # more rows than a block, and not a multiple
        np.testing.assert_array_equal(got, whole[name])
        assert not np.may_share_memory(got, file.tensors[name].data)


def test_the_reader_views_the_files_map_as_plain_arrays(tmp_path, tiny_checkpoints):
    """GGUFFile's reader keeps ndarray views of the memory map (numpy.memmap's views made
    opening SmolLM2 about 3x slower): the same metadata and tensor bytes as gguf's own
    reader, nothing copied."""
    import models.gguf as gguf_module

    path = tmp_path / "views.gguf"
    write_gguf(tiny_checkpoints["llama"], path, "Q8_0")
    ours, theirs = gguf_module.GGUFFile(path), gguf.GGUFReader(path)
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items()}
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        data = ours.tensors[t.name].data
        assert type(data) is np.ndarray and type(t.data) is np.memmap
        np.testing.assert_array_equal(data, t.data)
        assert not data.flags.owndata  # a view: nothing copied


def test_chat_settings_from_metadata(tmp_path, tiny_checkpoints):
    path = tmp_path / "chat.gguf"
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    sampling = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40}
    write_gguf(tiny_checkpoints["qwen3"], path, chat_template=template, metadata=sampling)
    loaded = load_model(path)
    assert loaded.chat_template == template
    assert loaded.generation_defaults == {"temperature": float(np.float32(0.7)), "top_k": 40}
    assert (loaded.bos_token, loaded.eos_token) == ("<s>", "</s>")


def test_directory_with_one_gguf(tmp_path, tiny_checkpoints):
    write_gguf(tiny_checkpoints["qwen2"], tmp_path / "model.gguf")
    (tmp_path / "README.md").write_text("a model")
    assert load_model(tmp_path).path == tmp_path / "model.gguf"
    assert read_config(tmp_path).architecture == "Qwen2ForCausalLM"
    (tmp_path / "other.gguf").write_bytes((tmp_path / "model.gguf").read_bytes())
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(model\.gguf, other\.gguf\)"):
        load_model(tmp_path)


# --- errors: each names the file and what is wrong --------------------------------------------


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text('{"this": "is json"}')
    with pytest.raises(
        ValueError, match=r"model\.gguf: not a GGUF file \(it starts with b'\{\"th'"
    ):
        load_model(path)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf: GGUF file not found"):
        load_model(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [10, 0.5, -100])
def test_truncated_gguf(tmp_path, tiny_checkpoints, keep):
    """Cut in the header, in the metadata, or in the last tensor's data."""
    path = tmp_path / "model.gguf"
    write_gguf(tiny_checkpoints["llama"], path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=r"model\.gguf: truncated or corrupt GGUF file"):
        load_model(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    finish_gguf(writer)
    with pytest.raises(
        ValueError,
        match=r"gpt2\.gguf: GGUF architecture 'gpt2' is not supported; supported: llama, "
        r"qwen2, qwen3, gemma2, gemma3, phi3, gpt-oss, deepseek2, qwen3moe, olmoe, glm4moe$",
    ):
        load_model(path)


def test_unsupported_tensor_type(tmp_path, tiny_checkpoints):
    path = tmp_path / "iq.gguf"
    write_gguf(
        tiny_checkpoints["qwen3"],
        path,
        lambda name, shape: "IQ4_NL" if name == "blk.1.ffn_up.weight" else "F32",
    )
    with pytest.raises(
        ValueError,
        match=r"iq\.gguf: tensor 'blk\.1\.ffn_up\.weight' has type IQ4_NL, which jpaged cannot "
        r"load; supported: F32, F16, BF16, Q4_0",
    ):
        load_model(path)


def test_missing_tensor(tmp_path, tiny_checkpoints):
    path = tmp_path / "m.gguf"
    write_gguf(tiny_checkpoints["qwen2"], path, skip=("blk.1.attn_k.bias",))
    with pytest.raises(ValueError, match=r"m\.gguf: missing tensor 'blk\.1\.attn_k\.bias'"):
        load_model(path)


def test_rope_freqs_that_are_not_llama3_scaling():
    factors = np.array([1.0, 1.0, 2.0, 8.0, 3.0, 8.0, 8.0, 8.0], np.float32)
    with pytest.raises(ValueError, match=r"f\.gguf: tensor 'rope_freqs\.weight' does not hold"):
        llama3_rope_scaling(factors, 500000.0, 16, None, source="f.gguf")
    assert llama3_rope_scaling(np.ones(8, np.float32), 10000.0, 16, None, source="f") is None

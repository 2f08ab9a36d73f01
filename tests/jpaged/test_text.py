"""Incremental detokenization and stop strings."""

import pytest

from jpaged import SamplingParams
from jpaged.tokenizer import Tokenizer
from models.demo import build_tokenizer


def test_incremental_decode_never_emits_half_a_character():
    tok = Tokenizer(build_tokenizer())
    text = "héllo 世界 🙂 ok"
    ids = tok.encode(text, add_special_tokens=False)
    # Byte-level BPE: some character is split over several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    out, prefix, read = "", 0, 0
    for n in range(1, len(ids) + 1):
        delta, prefix, read = tok.decode_incremental(ids[:n], prefix, read)
        assert "\ufffd" not in delta
        out += delta
    assert out == text


@pytest.fixture
def llm(demo_llm):
    return demo_llm


def test_stop_string_spanning_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = llm.generate(["a stop string test"], greedy)[0].outputs[0]
    text = ref.text
    assert len(text) > 12
    tok = llm.get_tokenizer()
    # A stop string that crosses a token boundary: the last 2 characters of one token's text
    # and the first 2 of the rest.
    head = tok.decode(ref.token_ids[:3])
    stop = text[len(head) - 2 : len(head) + 2]
    assert len(stop) == 4
    idx = text.find(stop)
    out = llm.generate(["a stop string test"], greedy.clone(stop=[stop]))[0].outputs[0]
    assert out.text == text[:idx]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        ["a stop string test"], greedy.clone(stop=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == text[: idx + len(stop)]

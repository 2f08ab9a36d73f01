"""Incremental detokenization and stop strings."""

import numpy as np
import pytest

from jpaged import SamplingParams
from jpaged.core.output_processor import OutputProcessor
from jpaged.core.sequence import RequestGroup, Sequence
from jpaged.tokenizer import Tokenizer
from models.demo import build_tokenizer


def _stream(tok, prompt, output, skip=True):
    """The texts the output processor emits token by token for prompt + output."""
    params = SamplingParams(max_tokens=len(output), skip_special_tokens=skip)
    group = RequestGroup("r", None, list(prompt), params, arrival=0)
    seq = Sequence(seq_id=0, group=group, index=0, token_ids=list(prompt),
                   num_prompt_tokens=len(prompt), seed=0)  # fmt: skip
    processor, pieces = OutputProcessor(tok), []
    for t in output:
        seq.token_ids.append(t)
        processor.process(seq)  # (stop, surplus) unused here
        pieces.append(processor.text(seq)[len("".join(pieces)) :])
    return pieces


def test_incremental_decode_never_emits_half_a_character():
    tok = Tokenizer(build_tokenizer())
    text = "héllo 世界 🙂 ok"
    ids = tok.encode(text, add_special_tokens=False)
    # Byte-level BPE: some character is split over several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, [5], ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_the_decode_stream_gives_the_texts_of_whole_decodes():
    """DecodeStream (what the engine uses) against the definition: the text of the prompt's
    last tokens plus the output, less the text of those prompt tokens; random ids, special
    tokens skipped or not. Only a character whose bytes have not all arrived may be missing,
    at the very end."""
    tok = Tokenizer(build_tokenizer())
    rng = np.random.default_rng(0)
    for trial in range(200):
        prompt = rng.integers(0, tok.vocab_size, 10).tolist()
        output = rng.integers(0, tok.vocab_size, 30).tolist()
        skip = bool(trial % 2)
        streamed = "".join(_stream(tok, prompt, output, skip))
        context = prompt[-5:]
        full = tok.decode(context + output, skip)[len(tok.decode(context, skip)) :]
        assert full.startswith(streamed), trial
        assert full[len(streamed) :] in ("", "\ufffd"), trial


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


def test_several_new_tokens_stop_at_the_one_that_completes_a_stop_string():
    """A speculative step appends several tokens at once: process reads them one at a time
    when the request has stop strings, cuts the text at the stop string and says how many
    tokens came after the one that completed it; the engine drops those (drop_last_tokens,
    logprobs and cumulative logprob with them)."""
    tok = Tokenizer(build_tokenizer())
    ids = tok.encode("hello world. more words here", add_special_tokens=False)
    upto = next(i for i in range(1, len(ids) + 1) if "." in tok.decode(ids[:i]))
    params = SamplingParams(max_tokens=64, stop=["."])
    group = RequestGroup("r", None, [5], params, arrival=0)
    seq = Sequence(seq_id=0, group=group, index=0, token_ids=[5], num_prompt_tokens=1, seed=0)
    processor = OutputProcessor(tok)
    seq.token_ids += ids[:2]  # one step of two tokens, no stop yet
    assert processor.process(seq) == (None, 0)
    seq.token_ids += ids[2:]  # the rest in one step: the stop string is inside it
    seq.logprobs = [{t: -0.5} for t in ids]
    seq.cumulative_logprob = -0.5 * len(ids)
    stop, surplus = processor.process(seq)
    assert (stop, surplus) == (".", len(ids) - upto)
    assert processor.text(seq) == "hello world"
    seq.drop_last_tokens(surplus)
    assert seq.output_token_ids == ids[:upto]
    assert len(seq.logprobs) == upto and seq.cumulative_logprob == -0.5 * upto
    with pytest.raises(ValueError, match=f"cannot drop {upto + 1} of {upto} generated tokens"):
        seq.drop_last_tokens(upto + 1)
    # Without stop strings several tokens are still decoded in one call.
    plain = Sequence(seq_id=1, group=RequestGroup("p", None, [5], SamplingParams(), arrival=0),
                     index=0, token_ids=[5, *ids], num_prompt_tokens=1, seed=0)  # fmt: skip
    assert processor.process(plain) == (None, 0)
    assert processor.text(plain) == "hello world. more words here"

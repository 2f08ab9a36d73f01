"""The OpenAI-compatible HTTP API on the fake engine, through the official openai client and
raw HTTP: the fake engine's hand-checkable tokens make every text, logprob and count exact.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_engine import FakeEngine, offline_generate
from serving_helpers import openai_client, sse_events

from jpaged.sample.sampling_params import RequestOutputKind, SamplingParams
from jpaged.structured_output import StructuredOutputsParams

USER_T5 = [{"role": "user", "content": "t5"}]


def chat_ids(messages) -> list[int]:
    return FakeEngine().chat_prompt(messages)[1]


def test_models_list_and_retrieve(server):
    c = openai_client(server)
    (card,) = c.models.list().data
    assert (card.id, card.object, card.owned_by) == ("fake", "model", "jpaged")
    assert card.model_extra["max_model_len"] == 64
    assert c.models.retrieve("fake").id == "fake"
    with pytest.raises(openai.NotFoundError) as err:
        c.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_completion_by_hand(server):
    c = openai_client(server)
    # sum([1, 2, 3]) = 6: tokens 6..10, text " t6 t7 t8 t9 t10"
    r = c.completions.create(model="fake", prompt=[1, 2, 3], max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.model == "fake" and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, " t6 t7 t8 t9 t10", "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)
    text = c.completions.create(model="fake", prompt="t5 t9 hello", max_tokens=4, temperature=0)
    want = offline_generate("t5 t9 hello", SamplingParams(temperature=0, max_tokens=4))
    assert text.choices[0].text == want.outputs[0].text
    assert text.usage.prompt_tokens == 3 and text.usage.completion_tokens == 4


def test_chat_completion_by_hand(server):
    c = openai_client(server)
    r = c.chat.completions.create(model="fake", messages=USER_T5, max_tokens=4, temperature=0)
    ids = chat_ids(USER_T5)
    want = offline_generate(ids, SamplingParams(temperature=0, max_tokens=4)).outputs[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 4)
    assert r.usage.total_tokens == len(ids) + 4
    # Content as text parts, and max_completion_tokens over max_tokens.
    parts = [{"role": "user", "content": [{"type": "text", "text": "t5"}]}]
    r2 = c.chat.completions.create(
        model="fake", messages=parts, max_tokens=9, max_completion_tokens=4, temperature=0
    )
    assert r2.choices[0].message.content == want.text


def stream_texts(chunks, kind: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            piece = (c.delta.content or "") if kind == "chat" else c.text
            texts[c.index] = texts.get(c.index, "") + piece
    return texts


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_deltas_equal_the_non_streamed_text(make_server, kind):
    c = openai_client(make_server(FakeEngine(step_delay_s=0.005)))  # a chunk per step
    common = {"model": "fake", "max_tokens": 6, "temperature": 0.8, "seed": 7, "n": 2}
    if kind == "chat":
        create, common["messages"] = c.chat.completions.create, USER_T5
    else:
        create, common["prompt"] = c.completions.create, "t1 t2"
    whole = create(**common)
    chunks = list(create(**common, stream=True, stream_options={"include_usage": True}))
    got = stream_texts(chunks, kind)
    for choice in whole.choices:
        want = choice.message.content if kind == "chat" else choice.text
        assert got[choice.index] == want
    # choice j starts at sum + offset + 7 j: the two differ, and the seed fixes both.
    assert len({c.message.content if kind == "chat" else c.text for c in whole.choices}) == 2
    with_choices = [ch for ch in chunks if ch.choices]
    for index in (0, 1):
        mine = [ch.choices[0] for ch in with_choices if ch.choices[0].index == index]
        reasons = [c.finish_reason for c in mine]
        assert len(mine) > 2 and reasons[-1] == "length" and set(reasons[:-1]) == {None}
        if kind == "chat":
            assert mine[0].delta.role == "assistant"
            assert all(c.delta.role is None for c in mine[1:])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(ch.usage is None for ch in chunks[:-1])


def test_sse_wire_format(server):
    body = {"prompt": [1], "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.http_url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        rid = r.headers["x-request-id"]
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = sse_events(raw.split("\n\n"))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == " t1 t3"  # t2 is EOS
    assert {e["id"] for e in events[:-1]} == {rid}
    assert "usage" not in events[0]  # only with stream_options.include_usage


def test_n_and_several_prompts_number_choices_as_openai(server):
    c = openai_client(server)
    r = c.completions.create(model="fake", prompt=[[10, 20], [4]], n=2, max_tokens=3, temperature=0)
    by_index = {ch.index: ch.text for ch in r.choices}
    # prompt i, choice j -> index 2 i + j; choice j starts at sum + 7 j
    assert by_index == {0: " t30 t31 t32", 1: " t37 t38 t39", 2: " t4 t5 t6", 3: " t11 t12 t13"}
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 12)
    streamed = stream_texts(
        c.completions.create(
            model="fake", prompt=[[10, 20], [4]], n=2, max_tokens=3, temperature=0, stream=True
        ),
        "completion",
    )
    assert streamed == by_index


def test_stop_strings(server):
    c = openai_client(server)
    # tokens 20, 21, 22, ...: text " t20 t21 t22 ..."
    r = c.completions.create(model="fake", prompt=[20], max_tokens=10, temperature=0, stop="t22")
    (choice,) = r.choices
    assert (choice.text, choice.finish_reason) == (" t20 t21 ", "stop")
    assert choice.model_extra["stop_reason"] == "t22"
    assert r.usage.completion_tokens == 3
    kept = c.completions.create(
        model="fake",
        prompt=[20],
        max_tokens=10,
        temperature=0,
        stop=["zz", "t22"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == " t20 t21 t22"
    chunks = list(
        c.completions.create(
            model="fake", prompt=[20], max_tokens=10, temperature=0, stop="t22", stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == " t20 t21 "
    assert all("t2 " not in ch.choices[0].text for ch in chunks)  # held back, never retracted


def test_logprobs(server):
    c = openai_client(server)
    r = c.chat.completions.create(
        model="fake", messages=USER_T5, max_tokens=2, temperature=0, logprobs=True, top_logprobs=2
    )
    first = chat_ids(USER_T5)
    t = sum(first) % 1000
    entries = r.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in entries] == [(f" t{t}", -0.5), (f" t{t + 1}", -0.5)]
    assert entries[0].bytes == list(f" t{t}".encode())
    assert [(x.token, x.logprob) for x in entries[0].top_logprobs] == [
        (f" t{t}", -0.5),
        (f" t{t + 1}", -1.5),
    ]
    plain = c.chat.completions.create(model="fake", messages=USER_T5, max_tokens=2)
    assert plain.choices[0].logprobs is None
    comp = c.completions.create(model="fake", prompt=[5], max_tokens=3, temperature=0, logprobs=1)
    lp = comp.choices[0].logprobs
    assert lp.tokens == [" t5", " t6", " t7"] and lp.token_logprobs == [-0.5] * 3
    assert lp.top_logprobs == [{" t5": -0.5}, {" t6": -0.5}, {" t7": -0.5}]
    assert lp.text_offset == [0, 3, 6]


def test_seeded_sampling_is_reproducible(server):
    c = openai_client(server)

    def text(seed):
        r = c.completions.create(model="fake", prompt=[1], max_tokens=3, temperature=1, seed=seed)
        return r.choices[0].text

    # offset (31 * seed + 1) % 1000: 342 for 11, 373 for 12; plus sum([1]) = 1
    assert text(11) == text(11) == " t343 t344 t345"
    assert text(12) == " t374 t375 t376"


def test_echo(server):
    c = openai_client(server)
    r = c.completions.create(model="fake", prompt="t1 t2", max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text == "t1 t2 t3 t4"
    ids = c.completions.create(model="fake", prompt=[3, 4], max_tokens=2, temperature=0, echo=True)
    assert ids.choices[0].text == " t3 t4 t7 t8"  # token ids are echoed as their text
    chunks = list(
        c.completions.create(
            model="fake", prompt="t1 t2", max_tokens=2, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == "t1 t2 t3 t4"


def test_every_sampling_field_reaches_the_engine(make_server):
    engine = FakeEngine()
    s = make_server(engine)
    c = openai_client(s)
    fields = {
        "n": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "seed": 123,
        "max_tokens": 5,
        "stop": ["a", "bc"],
        "logit_bias": {"5": 3, "7": 0},
    }
    extras = {
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 1,
        "stop_token_ids": [999],
        "ignore_eos": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "cache_salt": "salty",
    }
    c.completions.create(
        model="fake", prompt=[1, 2], logprobs=3, user="u1", extra_body=extras, **fields
    )
    (params, salt) = engine.received.popitem()[1]
    del extras["cache_salt"]
    delta = RequestOutputKind.DELTA
    fields["logit_bias"] = {5: 3.0}  # keys are ids; zero biases change nothing and are left out
    assert params == SamplingParams(**fields, **extras, logprobs=3, output_kind=delta)
    assert salt == "salty"
    c.chat.completions.create(
        model="fake",
        messages=USER_T5,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    (params, salt) = engine.received.popitem()[1]
    choice = StructuredOutputsParams(choice=["yes", "no"])
    want = SamplingParams(max_tokens=4, logprobs=2, structured_outputs=choice, output_kind=delta)
    assert params == want
    assert salt is None
    # response_format, with structured_outputs' options (vLLM merges them the same way)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats = {
        "json_schema": (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            {"structured_outputs": {"disable_any_whitespace": True}},
            StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        ),
        "json_object": (
            {"type": "json_object"},
            {},
            StructuredOutputsParams(json_object=True),
        ),
    }
    for fmt, extra, want in formats.values():
        c.chat.completions.create(
            model="fake", messages=USER_T5, max_tokens=2, response_format=fmt, extra_body=extra
        )
        (params, _) = engine.received.popitem()[1]
        assert params.structured_outputs == want
    # echo with logprobs asks for the prompt's logprobs too
    c.completions.create(model="fake", prompt=[1, 2], max_tokens=2, logprobs=1, echo=True)
    (params, _) = engine.received.popitem()[1]
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)


def test_unset_max_tokens_fills_the_context(make_server):
    c = openai_client(make_server())
    r = c.completions.create(model="fake", prompt=[1, 2, 3], temperature=0)
    assert r.usage.completion_tokens == 64 - 3 and r.choices[0].finish_reason == "length"
    # The serve command's --max-tokens caps it; a request's own max_tokens is kept.
    capped = openai_client(make_server(sampling_defaults={"max_tokens": 5}))
    r = capped.completions.create(model="fake", prompt=[1, 2, 3], temperature=0)
    assert r.usage.completion_tokens == 5
    r = capped.completions.create(model="fake", prompt=[1, 2, 3], temperature=0, max_tokens=7)
    assert r.usage.completion_tokens == 7


def test_request_id_header_round_trips(server):
    r = httpx.post(
        server.http_url + "/v1/completions",
        json={"prompt": [1], "max_tokens": 1},
        headers={"x-request-id": "mine-1"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "mine-1"
    assert r.json()["id"] == "mine-1"


def test_non_json_bodies_and_unknown_routes_are_openai_errors(server):
    r = httpx.post(server.http_url + "/v1/completions", content=b"\xff\xfe", timeout=10)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.http_url + "/v1/completions", json=[1, 2], timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.http_url + "/v1/engines", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


class LateFlakyEngine(FakeEngine):
    """Its step raises once a request with the prompt [666] has two tokens."""

    def step(self):
        doomed = [r for r in self._running if r.prompt_ids == [666]]
        if any(len(r.choices[0].token_ids) >= 2 for r in doomed):
            self.abort_request([r.request_id for r in doomed])
            raise RuntimeError("device fell over")
        return super().step()


def test_engine_error_is_a_500_or_an_error_event(make_server):
    s = make_server(LateFlakyEngine(step_delay_s=0.02))
    c = openai_client(s)
    with pytest.raises(openai.InternalServerError) as err:
        c.completions.create(model="fake", prompt=[666], max_tokens=4)
    assert "device fell over" in err.value.message
    with httpx.stream(
        "POST",
        s.http_url + "/v1/completions",
        json={"prompt": [666], "max_tokens": 4, "stream": True, "temperature": 0},
    ) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["text"] == " t666"  # streamed before the failure
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error"
    assert "device fell over" in events[-2]["error"]["message"]
    with pytest.raises(openai.APIError, match="device fell over"):
        list(c.completions.create(model="fake", prompt=[666], max_tokens=4, stream=True))
    r = c.completions.create(model="fake", prompt=[4], max_tokens=3, temperature=0)
    assert r.choices[0].text == " t4 t5 t6"


def test_json_body_round_trips_unicode(server):
    r = httpx.post(
        server.http_url + "/v1/chat/completions",
        content=json.dumps(
            {"messages": [{"role": "user", "content": "héllo t7"}], "max_tokens": 1}
        ),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3

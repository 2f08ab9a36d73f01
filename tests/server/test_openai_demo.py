"""`jpaged serve` on the demo model (random weights), driven by the official openai client,
gives what the offline LLM gives: text, token ids, logprobs, usage, seeded samples, stops.

One offline LLM is built first and runs every reference request; its programs land in the
session's persistent compilation cache, which the server process (started next, with an API
key, a chat template and a served model name) reads instead of compiling again. The same
LLM's engine then serves in-process for the failed-step test, which needs to reach into it.
"""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
import re
import threading
import time

import grpc
import httpx
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_helpers import RunningServer, ServeProcess, collect, request, scrape

from jpaged import LLM, SamplingParams
from jpaged.structured_output import StructuredOutputsParams
from server.proto.jpaged.v1 import generation_pb2 as pb
from server.proto.jpaged.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE = {"max_num_seqs": 4, "max_model_len": 128, "page_size": 16}
KEY = "demo-key"
NAME = "demo"
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue"]
REGEX = r"[a-z]{3}-[0-9]{2}"
BIASED = 1234  # a token the demo model does not pick after "The weather was"


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(str(demo_model_dir), **ENGINE)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def refs(llm) -> dict:
    """The offline LLM's outputs the tests compare with, made before the server starts."""
    ids = llm.llm_engine.chat_prompt(HELLO, chat_template=TEMPLATE)[1]
    chat = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, logprobs=2)
    numbers = llm.generate(["Numbers are"], greedy(16))[0].outputs[0].text
    stop = numbers[len(numbers) // 2 : len(numbers) // 2 + 2]  # two characters of its middle
    compact_json = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    choice = StructuredOutputsParams(choice=CHOICES)
    regex = StructuredOutputsParams(regex=REGEX)
    return {
        "weather": llm.generate(["The weather was"], greedy(12, logprobs=2))[0],
        "weather6": llm.generate(["The weather was"], greedy(6))[0],
        "chat_ids": ids,
        "chat": llm.generate([ids], chat)[0],
        "numbers": numbers,
        "stop": stop,
        "stopped": llm.generate(["Numbers are"], greedy(16, stop=[stop]))[0],
        # The demo model's random weights would fill flexible JSON with whitespace.
        "json": llm.generate([ids], greedy(64, structured_outputs=compact_json))[0],
        "choice": llm.generate(["Pick a colour:"], greedy(8, structured_outputs=choice))[0],
        "regex": llm.generate(["Code:"], greedy(16, structured_outputs=regex))[0],
        "echo": llm.generate(["The weather was"], greedy(2, logprobs=2, prompt_logprobs=2))[0],
    }


@pytest.fixture(scope="module")
def served(refs, demo_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(TEMPLATE)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    flags += ["--api-key", KEY, "--served-model-name", NAME, "--chat-template", str(template)]
    proc = ServeProcess(demo_model_dir, flags)
    yield proc
    assert proc.stop() == 0
    assert "msg=stopped" in "\n".join(proc.lines)


def client(served, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0, timeout=600)


def token_text(llm, t: int) -> str:
    return llm.llm_engine.tokenizer.decode([t], skip_special_tokens=False)


def test_models_and_the_api_key(served):
    (card,) = client(served).models.list().data
    assert card.id == NAME and card.model_extra["max_model_len"] == 128
    with pytest.raises(openai.AuthenticationError):
        client(served, key="wrong").models.list()
    assert httpx.get(served.url + "/health").json() == {"status": "serving"}  # probes: no key
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        stub = pb_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            collect(stub, request([5, 6], max_tokens=1))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        got = collect(
            stub, request([5, 6], max_tokens=1), metadata=(("authorization", f"Bearer {KEY}"),)
        )
        assert got.final.usage.completion_tokens == 1


def test_completion_and_logprobs_equal_the_offline_llm(served, llm, refs):
    want = refs["weather"]
    r = client(served).completions.create(
        model=NAME,
        prompt="The weather was",
        max_tokens=12,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    (choice,) = r.choices
    w = want.outputs[0]
    assert choice.model_extra["token_ids"] == w.token_ids
    assert choice.text == w.text and choice.finish_reason == w.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
    lp = choice.logprobs
    for i, (t, position) in enumerate(zip(w.token_ids, w.logprobs, strict=True)):
        assert lp.tokens[i] == token_text(llm, t)
        assert math.isclose(lp.token_logprobs[i], position[t], abs_tol=1e-5)
        by_text = {token_text(llm, k): v for k, v in position.items()}
        assert lp.top_logprobs[i] == pytest.approx(by_text, abs=1e-5)


def test_chat_completion_equals_the_offline_llm(served, llm, refs):
    ids, want = refs["chat_ids"], refs["chat"]
    r = client(served).chat.completions.create(
        model=NAME,
        messages=HELLO,
        temperature=0.8,
        seed=3,
        n=2,
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
    )
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 20)
    for choice, w in zip(r.choices, want.outputs, strict=True):
        assert choice.message.content == w.text and choice.finish_reason == w.finish_reason
        for entry, t, position in zip(
            choice.logprobs.content, w.token_ids, w.logprobs, strict=True
        ):
            assert entry.token == token_text(llm, t)
            assert math.isclose(entry.logprob, position[t], abs_tol=1e-5)
            best = sorted(position.items(), key=lambda kv: -kv[1])[:2]
            assert [x.logprob for x in entry.top_logprobs] == pytest.approx(
                [v for _, v in best], abs=1e-5
            )


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_deltas_equal_the_non_streamed_text(served, kind):
    c = client(served)
    common = {"model": NAME, "temperature": 0.9, "seed": 5, "n": 2, "max_tokens": 16}
    if kind == "chat":
        create, common["messages"] = c.chat.completions.create, HELLO
    else:
        create, common["prompt"] = c.completions.create, "Once upon a time"
    whole = create(**common)
    texts: dict[int, str] = {}
    usage = None
    for chunk in create(**common, stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            piece = (ch.delta.content or "") if kind == "chat" else ch.text
            texts[ch.index] = texts.get(ch.index, "") + piece
        usage = chunk.usage or usage
    for ch in whole.choices:
        assert texts[ch.index] == (ch.message.content if kind == "chat" else ch.text)
    # The counts agree; cached_tokens may not (the second call can hit the
    # pages the first one cached), but never exceeds the prompt.
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage, k) for k in counts] == [getattr(whole.usage, k) for k in counts]
    assert usage.completion_tokens == 32
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    # Seeded: the same call gives the same text again, another seed another text.
    assert create(**common).choices[0] == whole.choices[0]
    other = create(**{**common, "seed": 6})
    assert [ch.model_dump() for ch in other.choices] != [ch.model_dump() for ch in whole.choices]


def test_stop_strings_equal_the_offline_llm(served, refs):
    text, stop, want = refs["numbers"], refs["stop"], refs["stopped"].outputs[0]
    assert stop.strip()
    r = client(served).completions.create(
        model=NAME, prompt="Numbers are", temperature=0, max_tokens=16, stop=[stop]
    )
    (choice,) = r.choices
    assert choice.text == want.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert r.usage.completion_tokens == len(want.token_ids)


def test_compiles_are_counted_and_the_log_is_clean(served):
    m = scrape(served.url + "/metrics")
    assert m["jpaged_compiles_total"] >= 1  # read from the cache or compiled: both count
    assert m["jpaged_compile_seconds_total"] > 0
    assert not [k for k in m if k.endswith("_created")]
    log = "\n".join(served.lines)
    assert "Unable to initialize backend" not in log and "Resetting cache" not in log
    assert len(re.findall(r"compilation_cache=", log)) == 1  # stated once, in "serving"
    listening = next(i for i, line in enumerate(served.lines) if "msg=listening" in line)
    serving = next(i for i, line in enumerate(served.lines) if "msg=serving" in line)
    assert listening < serving


def test_64_concurrent_streamed_chats(served, llm):
    async def one(c, i: int):
        messages = [{"role": "user", "content": f"Question number {i}?"}]
        stream = await c.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=3 + i % 4,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        return messages, chunks[-1].usage, [ch for ch in chunks if ch.choices]

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=600
        ) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(run_all())
    for i, (messages, usage, chunks) in enumerate(results):
        prompt = len(llm.llm_engine.chat_prompt(messages, chat_template=TEMPLATE)[1])
        assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, 3 + i % 4)
        assert usage.total_tokens == prompt + 3 + i % 4
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"


def test_json_schema_response_format(served, refs):
    want = refs["json"].outputs[0]
    r = client(served).chat.completions.create(
        model=NAME,
        messages=HELLO,
        max_tokens=64,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
        },
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and choice.message.content == want.text
    value = json.loads(choice.message.content)
    jsonschema.validate(value, SCHEMA)
    assert set(value) == {"city", "sunny"} and isinstance(value["sunny"], bool)


def test_guided_choice_and_regex(served, refs):
    c = client(served)
    r = c.completions.create(
        model=NAME,
        prompt="Pick a colour:",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": CHOICES},
    )
    assert r.choices[0].text == refs["choice"].outputs[0].text
    assert r.choices[0].text in CHOICES and r.choices[0].finish_reason == "stop"
    chunks = c.completions.create(
        model=NAME,
        prompt="Code:",
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    text = "".join(ch.choices[0].text for ch in chunks)
    assert text == refs["regex"].outputs[0].text and re.fullmatch(REGEX, text)
    # The same over gRPC.
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        choice = pb.StructuredOutputs(choice=pb.Choices(choices=CHOICES))
        got = collect(
            pb_grpc.GenerationStub(ch),
            request("Pick a colour:", temperature=0, max_tokens=8, structured_outputs=choice),
            metadata=(("authorization", f"Bearer {KEY}"),),
        )
    assert got.text == {0: refs["choice"].outputs[0].text}
    assert got.finish_reason == {0: pb.FINISH_REASON_STOP}


def test_bad_constraints_are_400s_before_any_stream(served):
    c = client(served)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(
            model=NAME, messages=HELLO, response_format=bad_schema, stream=True
        )
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert "invalid JSON schema: Invalid type: objekt" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(
            model=NAME, prompt="x", stream=True, extra_body={"guided_regex": "[0-9"}
        )
    assert err.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(
            model=NAME,
            prompt="x",
            extra_body={"response_format": {"type": "json_object"}, "guided_choice": CHOICES},
        )
    assert err.value.body["param"] == "guided_choice"
    assert "got response_format and guided_choice" in err.value.body["message"]


def test_logit_bias_picks_the_first_token(served, refs):
    assert refs["weather"].outputs[0].token_ids[0] != BIASED
    r = client(served).completions.create(
        model=NAME,
        prompt="The weather was",
        max_tokens=3,
        temperature=0,
        logit_bias={str(BIASED): 100},
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].model_extra["token_ids"] == [BIASED] * 3
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        got = collect(
            pb_grpc.GenerationStub(ch),
            request("The weather was", temperature=0, max_tokens=3, logit_bias={BIASED: 100.0}),
            metadata=(("authorization", f"Bearer {KEY}"),),
        )
    assert got.token_ids == {0: [BIASED] * 3}


def test_echo_with_logprobs_carries_the_prompts_logprobs(served, llm, refs):
    want = refs["echo"]
    prompt, generated = want.prompt_token_ids, want.outputs[0]
    c = client(served)
    common = {"model": NAME, "prompt": "The weather was", "max_tokens": 2, "temperature": 0}
    r = c.completions.create(**common, echo=True, logprobs=2)
    (choice,) = r.choices
    assert choice.text == "The weather was" + generated.text
    lp = choice.logprobs
    ids = prompt + generated.token_ids
    assert lp.tokens == [token_text(llm, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # as OpenAI's
    positions = want.prompt_logprobs[1:] + generated.logprobs
    for i, (t, position) in enumerate(zip(ids[1:], positions, strict=True), start=1):
        assert math.isclose(lp.token_logprobs[i], position[t], abs_tol=1e-5)
        by_text = {token_text(llm, k): v for k, v in position.items()}
        assert lp.top_logprobs[i] == pytest.approx(by_text, abs=1e-5)
    streamed = list(c.completions.create(**common, echo=True, logprobs=2, stream=True))
    assert [t for ch in streamed for t in ch.choices[0].logprobs.tokens] == lp.tokens
    # gRPC: the prompt's logprobs in one message, one entry per prompt token after the first.
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        got = collect(
            pb_grpc.GenerationStub(ch),
            request("The weather was", temperature=0, max_tokens=2, prompt_logprobs=2),
            metadata=(("authorization", f"Bearer {KEY}"),),
        )
    (entries,) = [list(m.prompt_logprobs) for m in got.messages if m.prompt_logprobs]
    assert [e.token_id for e in entries] == prompt[1:]
    for e, position in zip(entries, want.prompt_logprobs[1:], strict=True):
        assert math.isclose(e.logprob, position[e.token_id], abs_tol=1e-5)
        best = sorted(position.items(), key=lambda kv: -kv[1])
        assert [x.token_id for x in e.top_logprobs] == [t for t, _ in best]


def test_echo_with_max_tokens_0_scores_the_prompt(served, llm, refs):
    """HELM's prompt scoring: the prompt's own logprobs, as the offline engine gives them,
    and no new token."""
    want = refs["echo"]
    prompt = want.prompt_token_ids
    r = client(served).completions.create(model=NAME, prompt="The weather was", max_tokens=0,
                                          echo=True, logprobs=2, temperature=0)  # fmt: skip
    (choice,) = r.choices
    assert (choice.text, choice.finish_reason) == ("The weather was", "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 0)
    lp = choice.logprobs
    assert lp.tokens == [token_text(llm, t) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, (t, position) in enumerate(zip(prompt[1:], want.prompt_logprobs[1:], strict=True), 1):
        assert math.isclose(lp.token_logprobs[i], position[t], abs_tol=1e-5)


@pytest.fixture
def in_process(llm):
    """The offline LLM's engine served in this process, where a test can reach into it."""
    s = RunningServer(llm.llm_engine, model_name=NAME)
    yield s
    s.close()


def test_a_dropped_stream_frees_its_pages(llm, in_process, monkeypatch):
    # The engine is held inside its 4th step until the client has dropped the stream, so the
    # request is running, and holds pages, when the test looks, however fast the model is.
    fetch = llm.llm_engine.runner.fetch
    held = threading.Event()
    go_on = threading.Event()
    steps = 0

    def slow_fetch(step):
        nonlocal steps
        steps += 1
        if steps == 4:
            held.set()
            go_on.wait(timeout=60)
        time.sleep(0.02)  # then slow enough that the drop is seen before 100 tokens
        return fetch(step)

    monkeypatch.setattr(llm.llm_engine.runner, "fetch", slow_fetch)
    s = in_process
    idle = scrape(s.http_url + "/metrics")["jpaged_kv_pages_used"]
    body = {"prompt": "A long story:", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    url = s.http_url + "/v1/completions"
    try:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=600) as r:
            # Kept referenced: an iterator dropped after a break is closed at once, and with
            # it the response, which aborts the request before the test looks.
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "[DONE]" not in first, first
            assert held.wait(timeout=60)
            assert scrape(s.http_url + "/metrics")["jpaged_kv_pages_used"] > idle
    finally:
        go_on.set()
    deadline = time.monotonic() + 30
    while True:
        m = scrape(s.http_url + "/metrics")
        if m["jpaged_kv_pages_used"] == idle and m["jpaged_num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
    assert m['jpaged_requests_total{outcome="cancelled"}'] == 1
    assert m["jpaged_generation_tokens_total"] < 100  # it stopped part-way
    r = httpx.post(url, json={**body, "max_tokens": 2}, timeout=600)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_failed_step_fails_its_requests_and_the_server_serves_on(
    llm, refs, in_process, monkeypatch
):
    # The reference comes from before the server started: once it serves, only its engine
    # thread may step the engine (a second thread stepping it raced it into donated-buffer
    # errors and, once, a hang).
    engine = llm.llm_engine
    want = refs["weather6"]
    s = in_process
    # Nothing of another test's left in the shared engine: the fault hits this request.
    s.wait_until(lambda st: st.num_running == 0 and st.num_waiting == 0, timeout=60)
    fetch = engine.runner.fetch
    calls = {"n": 0}

    def fail_once(step):
        if step.plan.decode_only:
            calls["n"] += 1
            if calls["n"] == 1:  # after the prefill: the first decode step fails
                raise RuntimeError("injected device fault")
        return fetch(step)

    monkeypatch.setattr(engine.runner, "fetch", fail_once)
    c = openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    with pytest.raises(openai.InternalServerError, match="injected device fault"):
        c.completions.create(model=NAME, prompt="The weather was", max_tokens=6, temperature=0)
    health = health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(s.http_url + "/health").status_code == 200
    r = c.completions.create(model=NAME, prompt="The weather was", max_tokens=6, temperature=0)
    assert r.choices[0].text == want.outputs[0].text
    got = collect(s.stub, request("The weather was", temperature=0, max_tokens=6), timeout=600)
    assert got.token_ids[0] == want.outputs[0].token_ids
    st = s.wait_until(lambda st: st.num_running == 0)
    assert st.pages_used == 0 and engine.stats()["num_recoveries"] == 1
    m = scrape(s.http_url + "/metrics")
    assert m['jpaged_requests_total{outcome="internal"}'] == 1

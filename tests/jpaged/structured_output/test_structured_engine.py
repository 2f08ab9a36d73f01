"""Structured outputs and logit_bias through the engine, on the demo model."""

import json
import re

import jsonschema
import pytest

from jpaged import SamplingParams
from jpaged.structured_output import StructuredOutputsParams as Constraint

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


def test_every_kind_of_constraint_holds_and_stops_when_the_grammar_is_done(demo_llm):
    cases = [
        (Constraint(regex=r"(yes|no)-[0-9]{3}"), lambda t: re.fullmatch(r"(yes|no)-[0-9]{3}", t)),
        (Constraint(choice=["alpha", "beta", "gamma"]), lambda t: t in ("alpha", "beta", "gamma")),
        (
            Constraint(json=SCHEMA, disable_any_whitespace=True),
            lambda t: set(json.loads(t)) == {"name", "ok"},
        ),
        (Constraint(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]/'), None),
    ]
    params = [greedy(max_tokens=64, structured_outputs=c) for c, _ in cases]
    params.append(SamplingParams(temperature=1.0, seed=5, max_tokens=64, n=3,
                                 structured_outputs=cases[1][0]))  # fmt: skip
    outs = demo_llm.generate([f"question {i}" for i in range(len(params))], params)
    for (constraint, check), out in zip(cases, outs, strict=False):
        (c,) = out.outputs
        assert c.finish_reason == "stop", (constraint.kind, c.text)
        if check is not None:
            assert check(c.text), (constraint.kind, c.text)
    assert re.fullmatch(r"\([0-9](,[0-9])*\)", outs[3].outputs[0].text)
    assert all(c.text in ("alpha", "beta", "gamma") for c in outs[4].outputs)
    assert demo_llm.stats()["pages_used"] == 0


def test_constraints_change_no_other_row_and_add_no_compiled_program(demo_llm):
    prompts = ["one two", "three four five", "six"]
    plain = greedy(max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in demo_llm.generate(prompts, plain)]
    compiled = demo_llm.stats()["num_compiled"]
    mixed = [plain, greedy(max_tokens=8, structured_outputs=Constraint(regex="[a-z]{5}")), plain]
    outs = demo_llm.generate(prompts, mixed)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [alone[0], alone[2]]
    assert re.fullmatch("[a-z]{5}", outs[1].outputs[0].text)
    assert demo_llm.stats()["num_compiled"] == compiled  # the same programs as without


def test_a_failing_matcher_ends_its_request_alone(demo_llm, monkeypatch):
    engine = demo_llm.llm_engine
    demo_llm.generate(["warm"], greedy(max_tokens=2, structured_outputs=Constraint(regex="a+")))
    manager = engine.constraints.manager
    real = manager.error
    monkeypatch.setattr(
        manager, "error", lambda key: "injected" if key[0].endswith("-bad") else real(key)
    )
    params = [
        greedy(max_tokens=6, ignore_eos=True),
        greedy(max_tokens=6, structured_outputs=Constraint(regex="[0-9]+")),
    ]
    engine.add_request("r-bad", "x", params[1])
    engine.add_request("r-ok", "x", params[0])
    engine.add_request("r-ok2", "y", params[1])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    bad = done["r-bad"]
    assert bad.outputs[0].finish_reason == "error" and bad.error == "structured output: injected"
    assert len(done["r-ok"].outputs[0].token_ids) == 6
    assert re.fullmatch("[0-9]+", done["r-ok2"].outputs[0].text) and done["r-ok2"].error is None


def test_logit_bias_picks_the_biased_token_and_keeps_the_models_logprobs(demo_llm):
    ref = demo_llm.generate(["bias me"], greedy(max_tokens=1, logprobs=5))[0].outputs[0]
    ranked = sorted(ref.logprobs[0].items(), key=lambda kv: -kv[1])
    second, second_lp = ranked[1]
    out = demo_llm.generate(
        ["bias me"], greedy(max_tokens=3, logprobs=5, logit_bias={second: 100.0})
    )[0].outputs[0]
    assert out.token_ids == [second] * 3
    assert out.logprobs[0][second] == pytest.approx(second_lp, abs=1e-6)
    with pytest.raises(ValueError, match="logit_bias token id 999999 is outside"):
        demo_llm.generate(["x"], greedy(logit_bias={999999: 1.0}))
    with pytest.raises(ValueError, match=r"logit_bias\[3\] must be in \[-100, 100\]"):
        SamplingParams(logit_bias={3: 101.0})


RICH_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                 "minItems": 1, "maxItems": 2},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}},
                  "required": ["name"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 3},
    },
    "required": ["id", "score", "kind", "code", "tags", "owner"],
    "additionalProperties": False,
}  # fmt: skip
REGEX = r"[a-c]{2,4}-(x|yy)[0-9]?"
CHOICES = ["red", "green", "blue", "cyan"]
GRAMMAR = 'start: item ("+" item)*\nitem: NUM | "(" start ")"\nNUM: /[0-9]/'


def parses_as_grammar(text: str) -> bool:
    """text in GRAMMAR's language: innermost "(sum)" groups reduce to a digit until one sum
    of digits is left."""
    flat = r"[0-9](\+[0-9])*"
    while True:
        reduced = re.sub(r"\(" + flat + r"\)", "0", text)
        if reduced == text:
            return re.fullmatch(flat, text) is not None
        text = reduced


def test_grammar_checker():
    assert parses_as_grammar("1+(2+(3))+4") and parses_as_grammar("7")
    assert not any(map(parses_as_grammar, ["", "1+", "(1", "()", "1(2)", "12"]))


@pytest.fixture(scope="module")
def wide_llm(demo_model_dir):
    """The demo model with room for 64 sequences of up to 512 tokens, every step in one
    bucket of 64 sequences and 128 tokens (the default buckets compiled a program for each
    batch size the tests pass through)."""
    from jpaged import LLM

    return LLM(str(demo_model_dir), max_num_seqs=64, max_model_len=512,
               max_num_batched_tokens=128, min_token_bucket=128, min_seq_bucket=64,
               page_size=16, num_pages=1024)  # fmt: skip


def test_32_sampled_requests_of_each_kind_hold_their_constraint_beside_free_ones(wide_llm):
    """Temperature 1, a seed each, all in one batch with unconstrained requests whose tokens
    equal a run without the constrained ones; every output is complete and valid."""
    llm = wide_llm
    kinds = {
        "json": Constraint(json=RICH_SCHEMA, disable_any_whitespace=True),
        "regex": Constraint(regex=REGEX),
        "choice": Constraint(choice=CHOICES),
        "grammar": Constraint(grammar=GRAMMAR),
    }
    free = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=12, ignore_eos=True)
            for i in range(8)]  # fmt: skip
    free_prompts = [f"free {i}" for i in range(8)]
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free)]
    prompts, params = [], []
    for name, constraint in kinds.items():
        for i in range(32):
            prompts.append(f"{name} {i}")
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                                         structured_outputs=constraint))  # fmt: skip
    outs = llm.generate(prompts + free_prompts, params + free)
    for out, prompt in zip(outs, prompts, strict=False):
        (c,) = out.outputs
        assert c.finish_reason == "stop", (prompt, c.text)
        kind = prompt.split()[0]
        if kind == "json":
            jsonschema.validate(json.loads(c.text), RICH_SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, c.text), c.text
        elif kind == "choice":
            assert c.text in CHOICES
        else:
            assert parses_as_grammar(c.text), c.text
    # Sampled: not every request of a kind says the same thing.
    for i, name in enumerate(kinds):
        assert len({o.outputs[0].text for o in outs[32 * i : 32 * i + 32]}) > 1, name
    assert [o.outputs[0].token_ids for o in outs[-8:]] == alone
    assert llm.stats()["pages_used"] == 0


# Bounded schemas, one feature each: a JSON output of each has a longest (compact) form.
BOUNDED = {
    "nested": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}},
                        "required": ["ok", "n"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            },
            "c": {"type": "boolean"},
        },
        "required": ["a", "c"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 6},
    "integers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "delta": {"type": "integer", "minimum": -40, "maximum": 40},
        },
        "required": ["age", "delta"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue", 7, None]},
        "maxItems": 3,
    },
    "strings": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    },
}


def longest_compact(schema: dict) -> int:
    """Characters in the schema's longest compact JSON (for the keywords BOUNDED uses; a
    string's characters count one each, as maxLength counts them)."""
    if "enum" in schema:
        return max(len(json.dumps(v, separators=(",", ":"))) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind in ("boolean", "null"):
        return {"boolean": 5, "null": 4}[kind]
    if kind == "array":
        n = schema["maxItems"]
        return 2 + n * longest_compact(schema["items"]) + max(n - 1, 0)
    items = [len(json.dumps(k)) + 1 + longest_compact(v) for k, v in schema["properties"].items()]
    return 2 + sum(items) + len(items) - 1


def test_longest_compact():
    assert longest_compact(BOUNDED["integers"]) == len('{"age":130,"delta":-40}')
    assert longest_compact(BOUNDED["enum"]) == len('["green","green","green"]')
    assert longest_compact(BOUNDED["nested"]) == len('{"a":{"b":{"ok":false,"n":null}},"c":false}')


def test_64_noise_requests_per_bounded_schema_all_close_beside_free_ones(wide_llm):
    """Issue 37: the random model at temperature 1, max_tokens twice a schema's longest
    compact form, default whitespace: every output closes and validates; the unconstrained
    requests batched with them make the tokens they make alone."""
    llm = wide_llm
    free = [SamplingParams(temperature=1.0, seed=500 + i, max_tokens=16, ignore_eos=True)
            for i in range(8)]  # fmt: skip
    free_prompts = [f"free {i}" for i in range(8)]
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free)]
    prompts, params = [], []
    for name, schema in BOUNDED.items():
        constraint = Constraint(json=schema)
        budget = 2 * longest_compact(schema)
        for i in range(64):
            prompts.append(f"{name} {i}:")
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=budget,
                                         structured_outputs=constraint))  # fmt: skip
    outs = llm.generate(
        prompts[:160] + free_prompts + prompts[160:], params[:160] + free + params[160:]
    )
    free_outs = outs[160:168]
    outs = outs[:160] + outs[168:]
    for out, prompt in zip(outs, prompts, strict=True):
        (c,) = out.outputs
        schema = BOUNDED[prompt.split()[0]]
        assert c.finish_reason == "stop", (prompt, c.text)
        value = json.loads(c.text)
        jsonschema.validate(value, schema)
        assert _same_layout(c.text, value), c.text  # the canonical layout
    for i, name in enumerate(BOUNDED):  # sampled: not all alike
        assert len({o.outputs[0].text for o in outs[64 * i : 64 * i + 64]}) > 1, name
    assert [o.outputs[0].token_ids for o in free_outs] == alone
    assert llm.stats()["pages_used"] == 0


def _same_layout(text: str, value) -> bool:
    """text is in json.dumps' layout, up to how strings and numbers are spelled."""

    def shape(t: str) -> str:
        return re.sub(r"-?[0-9]+", "0", re.sub(r'"(\\.|[^"\\])*"', '""', t))

    return shape(text) == shape(json.dumps(value))


def test_a_constrained_output_cut_short_says_length_and_one_that_closed_says_stop(demo_llm):
    constraint = Constraint(json=SCHEMA)
    (whole,) = demo_llm.generate(["cut"], greedy(max_tokens=64, structured_outputs=constraint))
    w = whole.outputs[0]
    assert w.finish_reason == "stop" and set(json.loads(w.text)) == {"name", "ok"}
    n = len(w.token_ids)
    exact, short = demo_llm.generate(
        ["cut", "cut"],
        [greedy(max_tokens=m, structured_outputs=constraint) for m in (n, n - 1)],
    )
    # The token that reached max_tokens closed the JSON: complete, so "stop".
    assert exact.outputs[0].token_ids == w.token_ids and exact.outputs[0].finish_reason == "stop"
    s = short.outputs[0]
    assert s.token_ids == w.token_ids[:-1] and s.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(s.text)
    # The context (max_model_len 128) runs out before 60 array items can close.
    long = Constraint(json={"type": "array", "items": {"type": "integer"}, "minItems": 60})
    (ctx,) = demo_llm.generate(
        ["one two three " * 10], greedy(max_tokens=120, structured_outputs=long)
    )
    c = ctx.outputs[0]
    assert c.finish_reason == "length"
    assert len(ctx.prompt_token_ids) + len(c.token_ids) == 128
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)

"""JSON outputs under each whitespace layout: validity, length, answers and mask cost.

    python scripts/bench_structured.py                      # noise, then SmolLM2, then masks
    python scripts/bench_structured.py --parts noise --num-requests 16     # a quick look

Layouts (how JSON grammars treat whitespace outside strings):
  flexible   disable_any_whitespace=False: any run of JSON whitespace (vLLM's default)
  compact    disable_any_whitespace=True: none, {"a":1,"b":[1,2]}
  canonical  jpaged's default: one space after "," and ":" only, {"a": 1, "b": [1, 2]}
             (json.dumps' layout: llguidance's item_separator and key_separator)
  one-space  whitespace_pattern="[ ]?": at most one space per gap

Parts:
  noise    the random-weights demo model at temperature 1.0 on bounded schemas: how many
           outputs are valid JSON that follows the schema (finish_reason "stop"), and the
           tokens of a valid output. max_tokens is twice the schema's longest compact form.
  smollm2  SmolLM2-135M-Instruct extracting a person's details from a sentence into a
           schema, at its default sampling (temperature 1.0) and greedy: validity, tokens
           per valid output, and answer quality (the share of name, age, city and hobbies
           equal to the sentence's).
  masks    the host cost of a token's mask per row (StructuredOutputManager.fill_bitmask,
           one row at a time) on SmolLM2's 49,152-token vocabulary, replaying the outputs
           of the smollm2 part through fresh matchers: microseconds per token.

Prints a table per part and one line `RESULT_JSON {...}` at the end. The machine's load
changes the mask times; validity and answers do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged import LLM, SamplingParams
from jpaged.structured_output import StructuredOutputsParams
from jpaged.structured_output.manager import StructuredOutputManager

LAYOUTS = ("flexible", "compact", "canonical", "one-space")

# Bounded schemas: each has a longest compact form (LONGEST, below).
NOISE_SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": -50, "maximum": 50},
            "kind": {"enum": ["cat", "dog", "bird"]},
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "ok": {"type": "boolean"},
                },
                "required": ["name", "ok"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "kind", "owner"],
        "additionalProperties": False,
    },
    "points": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 9},
                "y": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
# (name, age, city, hobbies): each becomes a sentence the model extracts from.
PEOPLE = [
    ("Maria", 34, "Lisbon", ["hiking", "chess"]),
    ("Tom", 27, "Boston", ["guitar"]),
    ("Aiko", 45, "Osaka", ["painting", "tea"]),
    ("Pierre", 61, "Lyon", ["cooking", "cycling"]),
    ("Fatima", 19, "Cairo", ["football"]),
    ("Lars", 52, "Oslo", ["skiing", "fishing"]),
    ("Priya", 38, "Mumbai", ["dance", "yoga"]),
    ("Carlos", 23, "Madrid", ["tennis"]),
    ("Anna", 70, "Vienna", ["opera", "gardening"]),
    ("Kwame", 31, "Accra", ["running", "poetry"]),
    ("Mei", 29, "Shanghai", ["photography"]),
    ("John", 44, "Denver", ["climbing", "baking"]),
    ("Olga", 56, "Kyiv", ["knitting", "reading"]),
    ("Diego", 12, "Lima", ["drawing"]),
    ("Sara", 40, "Rome", ["swimming", "films"]),
    ("Ahmed", 65, "Dubai", ["golf", "history"]),
]


def sentence(name: str, age: int, city: str, hobbies: list[str]) -> str:
    likes = " and ".join(hobbies)
    return f"{name} is {age} years old, lives in {city} and likes {likes}."


# Each noise schema's longest value: max_tokens is twice its compact JSON's characters.
LONGEST = {
    "person": {"name": "n" * 12, "age": 130, "tags": ["t" * 6] * 3},
    "nested": {"id": -50, "kind": "bird", "owner": {"name": "n" * 8, "ok": False}},
    "points": [{"x": 0, "y": 0}] * 4,
}


def budget(name: str) -> int:
    jsonschema.validate(LONGEST[name], NOISE_SCHEMAS[name])
    return 2 * len(json.dumps(LONGEST[name], separators=(",", ":")))


def constraint(schema: dict, layout: str) -> StructuredOutputsParams:
    if layout in ("flexible", "compact"):
        return StructuredOutputsParams(json=schema, disable_any_whitespace=layout == "compact")
    if layout == "canonical":
        return StructuredOutputsParams(json=schema)
    return StructuredOutputsParams(json=schema, whitespace_pattern="[ ]?")


def valid(text: str, finish_reason: str, schema: dict) -> object | None:
    """The parsed output when it is complete and follows the schema, else None."""
    if finish_reason != "stop":
        return None
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return None
    return value


def summary(outs, schema: dict) -> dict:
    texts = [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs]
    good = [(t, ids) for t, reason, ids in texts if valid(t, reason, schema) is not None]
    return {
        "valid": len(good),
        "requests": len(texts),
        "tokens_per_valid": statistics.mean(len(ids) for _, ids in good) if good else None,
        "length_finishes": sum(reason == "length" for _, reason, _ in texts),
    }


def print_row(part: str, what: str, layout: str, row: dict) -> None:
    tokens = row["tokens_per_valid"]
    extra = f"  answers {row['answers']:.3f}" if "answers" in row else ""
    print(f"{part:8} {what:18} {layout:10} valid {row['valid']:3}/{row['requests']:<3} "
          f"tokens/valid {tokens if tokens is None else round(tokens, 1)!s:>6}  "
          f"length {row['length_finishes']:3}{extra}", flush=True)  # fmt: skip


def noise(args) -> dict:
    llm = LLM("demo-random", max_num_seqs=args.num_requests, max_model_len=1024)
    rows = {}
    for name, schema in NOISE_SCHEMAS.items():
        max_tokens = budget(name)
        for layout in LAYOUTS:
            c = constraint(schema, layout)
            params = [
                SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=c)
                for i in range(args.num_requests)
            ]
            outs = llm.generate([f"{name} {i}:" for i in range(args.num_requests)], params)
            row = summary(outs, schema) | {"max_tokens": max_tokens}
            rows[f"{name}/{layout}"] = row
            print_row("noise", f"{name} ({max_tokens})", layout, row)
    return rows


def answers(value: dict, person: tuple) -> float:
    name, age, city, hobbies = person
    got = [
        value["name"].strip().lower() == name.lower(),
        value["age"] == age,
        value["city"].strip().lower() == city.lower(),
        sorted(h.strip().lower() for h in value["hobbies"]) == sorted(hobbies),
    ]
    return sum(got) / len(got)


def smollm2(args) -> tuple[dict, dict]:
    # generation_config="vllm": no model defaults, so "default" is temperature 1.0 (the
    # built-in model ships greedy, models/demo.py SMOLLM2_GENERATION_DEFAULTS)
    llm = LLM(None, max_num_seqs=len(PEOPLE), max_model_len=512, generation_config="vllm")
    chats = [
        [
            {"role": "system", "content": "You extract facts as JSON."},
            {
                "role": "user",
                "content": f"{sentence(*p)}\nGive this person's name, age, city and "
                "hobbies as a JSON object with keys name, age, city and hobbies.",
            },
        ]
        for p in PEOPLE
    ]
    rows, replays = {}, {}
    for sampling in ("default", "greedy"):
        for layout in LAYOUTS:
            c = constraint(PERSON, layout)
            if sampling == "default":  # the model's own defaults, seeded per request
                base = llm.get_default_sampling_params()
                params = [
                    base.clone(seed=i, max_tokens=args.max_tokens, structured_outputs=c)
                    for i in range(len(PEOPLE))
                ]
            else:
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                        structured_outputs=c)  # fmt: skip
            outs = llm.chat(chats, params)
            row = summary(outs, PERSON)
            values = [valid(o.outputs[0].text, o.outputs[0].finish_reason, PERSON) for o in outs]
            scores = [
                0.0 if v is None else answers(v, p) for v, p in zip(values, PEOPLE, strict=True)
            ]
            row["answers"] = statistics.mean(scores)
            rows[f"{sampling}/{layout}"] = row
            print_row("smollm2", sampling, layout, row)
            if sampling == "default":
                replays[layout] = [o.outputs[0].token_ids for o in outs]
    return rows, {"llm": llm, "replays": replays}


def masks(args, context: dict) -> dict:
    """Microseconds per row and token to fill a mask, replaying recorded outputs."""
    llm, replays = context["llm"], context["replays"]
    engine = llm.llm_engine
    rows = {}
    for layout in LAYOUTS:
        manager = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size)
        c = constraint(PERSON, layout)
        out = manager.allocate_bitmask(1)
        times = []
        for rep in range(args.mask_repeats):
            for i, ids in enumerate(replays[layout]):
                key = (rep, i)
                manager.add(key, c)
                for t in ids:
                    t0 = time.perf_counter()
                    manager.fill_bitmask([key], out)
                    times.append(time.perf_counter() - t0)
                    manager.advance(key, [t])
                manager.remove(key)
        times.sort()
        row = {
            "tokens": len(times),
            "mean_us": 1e6 * statistics.mean(times),
            "p50_us": 1e6 * times[len(times) // 2],
            "p99_us": 1e6 * times[int(len(times) * 0.99)],
        }
        rows[layout] = row
        print(f"masks    {layout:10} {row['tokens']:6} tokens: mean {row['mean_us']:7.1f} us, "
              f"p50 {row['p50_us']:7.1f}, p99 {row['p99_us']:7.1f}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="noise,smollm2,masks",
                        help="comma-separated: noise, smollm2, masks (masks needs smollm2)")  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=64, help="noise: per schema and layout")
    parser.add_argument("--max-tokens", type=int, default=160, help="smollm2: per request")
    parser.add_argument("--mask-repeats", type=int, default=3)
    args = parser.parse_args()
    parts = args.parts.split(",")
    result = {"args": vars(args)}
    if "noise" in parts:
        result["noise"] = noise(args)
    if "smollm2" in parts:
        result["smollm2"], context = smollm2(args)
        if "masks" in parts:
            result["masks"] = masks(args, context)
    print("RESULT_JSON " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

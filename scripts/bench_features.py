"""What structured outputs cost the batch, measured on one engine.

    python scripts/bench_features.py constrained [--model M] [--num-requests 32]
    python scripts/bench_features.py constrained --num-requests 64 --counts 0,64   # issue 14

constrained: a batch of greedy requests, none constrained, then the same batch with --counts
of them (default 1, then 8) constrained by a JSON schema (compact JSON): output tokens/s of
the whole batch, so the cost a constrained request puts on the others shows. Every request
makes the same number of tokens in every run: the constrained requests' lengths (greedy, so
fixed) are measured first, and an unconstrained request runs to its constrained length.

Speculative decoding is measured by scripts/bench_speculative.py.

The model defaults to the built-in SmolLM2-135M-Instruct. Each configuration runs once to
warm up (compiles) and then --repeats times; the table shows the median and the spread.
Prints one line `RESULT_JSON {...}` at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged import LLM, SamplingParams
from jpaged.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 2,
            "maxItems": 4,
        },
        "bio": {"type": "string", "maxLength": 60},
    },
    "required": ["name", "age", "city", "hobbies", "bio"],
    "additionalProperties": False,
}


def timed(llm: LLM, prompts, params, repeats: int) -> dict:
    llm.generate(prompts, params)  # warm-up: compiles the shapes
    runs = []
    for _ in range(repeats):
        llm.reset_stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        runs.append((tokens / seconds, seconds, outs))
    rates = sorted(r[0] for r in runs)
    return {
        "tokens_per_s": statistics.median(rates),
        "spread": [rates[0], rates[-1]],
        "outputs": runs[-1][2],
        "stats": llm.stats(),
    }


def constrained(args) -> dict:
    llm = LLM(args.model, max_num_seqs=args.num_requests, max_model_len=512)
    prompts = [
        f"Describe person {i} as JSON with name, age, city, hobbies and a short bio:"
        for i in range(args.num_requests)
    ]
    json_params = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    # Greedy: each constrained request's length is fixed; the unconstrained requests get the
    # same lengths (ignore_eos), so every run makes the same tokens per request.
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, json_params)]
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    rows = {}
    for num in [min(int(c), args.num_requests) for c in args.counts.split(",")]:
        params = [json_params] * num + plain[num:]
        res = timed(llm, prompts, params, args.repeats)
        for o in res["outputs"][:num]:
            json.loads(o.outputs[0].text)  # every constrained output parses
        assert [len(o.outputs[0].token_ids) for o in res["outputs"]] == lengths
        rows[f"{num} constrained"] = {
            "tokens_per_s": res["tokens_per_s"],
            "spread": res["spread"],
            "output_tokens": sum(lengths),
            "decode_steps": max(lengths),
        }
        print(f"{num:>2} of {args.num_requests} constrained: {res['tokens_per_s']:8.1f} tokens/s "
              f"(spread {res['spread'][0]:.1f}-{res['spread'][1]:.1f}; output lengths "
              f"{min(lengths)}-{max(lengths)}, mean {statistics.mean(lengths):.1f})",
              flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("constrained",))
    parser.add_argument("--model", default=None, help="(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--counts", default="0,1,8", help="constrained: how many requests are constrained, per run"
    )
    args = parser.parse_args()
    rows = constrained(args)
    print("RESULT_JSON " + json.dumps({"args": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

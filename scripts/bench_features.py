"""What structured outputs and speculative decoding cost or win, measured on one engine.

    python scripts/bench_features.py constrained [--model M] [--num-requests 32]
    python scripts/bench_features.py speculative [--model M] [--num-requests 16]

constrained: a batch of greedy requests, none constrained, then the same batch with 1 and then
8 of them constrained by a JSON schema (compact JSON): output tokens/s of the whole batch and
the mean step time, so the cost a constrained request puts on the others shows.

speculative: n-gram speculation (prompt lookup, k = 4) against none, greedy, on a workload
that copies from its prompt ("repeat this list") and on one that does not (short open
prompts), reporting tokens/s, steps and the acceptance (proposed, accepted, mean acceptance
length). The outputs of the two engines must be the same tokens; the script checks it.

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
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]


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
        f"Describe person {i} as JSON with name, age and city:" for i in range(args.num_requests)
    ]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    json_params = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    rows = {}
    for num in (0, 1, 8):
        params = [json_params] * num + [plain] * (args.num_requests - num)
        res = timed(llm, prompts, params, args.repeats)
        for o in res["outputs"][:num]:
            json.loads(o.outputs[0].text)  # every constrained output parses
        steps = max(len(o.outputs[0].token_ids) for o in res["outputs"])
        rows[f"{num} constrained"] = {
            "tokens_per_s": res["tokens_per_s"],
            "spread": res["spread"],
            "decode_steps": steps,
        }
        print(f"{num:>2} of {args.num_requests} constrained: {res['tokens_per_s']:8.1f} tokens/s "
              f"(spread {res['spread'][0]:.1f}-{res['spread'][1]:.1f})", flush=True)  # fmt: skip
    return rows


def speculative(args) -> dict:
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}  # fmt: skip
    engines = {
        "off": LLM(args.model, max_num_seqs=args.num_requests, max_model_len=1024),
        "ngram": LLM(
            args.model, max_num_seqs=args.num_requests, max_model_len=1024, speculative_config=ngram
        ),  # fmt: skip
    }
    copy = [
        "Repeat this list exactly, one item per line:\n"
        + "\n".join(f"{WORDS[(i + j) % len(WORDS)]} {j}" for j in range(12))
        + "\nList:\n"
        for i in range(args.num_requests)
    ]
    open_ended = [f"Tell me a fact about the number {i}." for i in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = {}
    for name, prompts in (("copying", copy), ("open-ended", open_ended)):
        res = {k: timed(llm, prompts, params, args.repeats) for k, llm in engines.items()}
        same = [o.outputs[0].token_ids for o in res["off"]["outputs"]] == [
            o.outputs[0].token_ids for o in res["ngram"]["outputs"]
        ]
        s = res["ngram"]["stats"]
        rows[name] = {
            "off_tokens_per_s": res["off"]["tokens_per_s"],
            "ngram_tokens_per_s": res["ngram"]["tokens_per_s"],
            "speedup": res["ngram"]["tokens_per_s"] / res["off"]["tokens_per_s"],
            "spread_off": res["off"]["spread"],
            "spread_ngram": res["ngram"]["spread"],
            "same_tokens": same,
            "proposed": s["spec_num_draft_tokens"],
            "accepted": s["spec_num_accepted_tokens"],
            "mean_acceptance_length": s["spec_mean_acceptance_length"],
        }
        r = rows[name]
        print(f"{name:>10}: off {r['off_tokens_per_s']:7.1f}, ngram {r['ngram_tokens_per_s']:7.1f} "
              f"tokens/s ({r['speedup']:.2f}x), accepted {r['accepted']}/{r['proposed']}, "
              f"mean acceptance length {r['mean_acceptance_length']:.2f}, same tokens {same}",
              flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("constrained", "speculative"))
    parser.add_argument("--model", default=None, help="(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = constrained(args) if args.what == "constrained" else speculative(args)
    print("RESULT_JSON " + json.dumps({"args": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

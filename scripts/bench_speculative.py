"""What n-gram speculative decoding wins or costs, at batch 1 and batch 8 (issue 15).

    python scripts/bench_speculative.py                      # SmolLM2-135M-Instruct, float32
    python scripts/bench_speculative.py --batch-sizes 1 --repeats 3 --max-tokens 96

Two engines on the same model, one without speculation and one with n-gram (prompt lookup)
speculation (--k proposals, lookup 1 to 4 tokens), both greedy, chat-templated prompts:

  code-edit  "rename this variable in this snippet" over short Python functions: an answer
             that did what was asked would copy most of the prompt;
  quotes     "quote the sentences about X from this passage": the answer copies spans;
  free       open questions: little to copy, so proposals are mostly rejected.

For each workload and batch size B, the prompts run B at a time (batch 1: one request alone
at a time) after warm-up passes over all the prompts, repeated until a pass compiles no new
program (at most --max-warmups): the cost governor's choices depend on timing, so one pass
may not meet every shape the timed runs meet. Output tokens/s is all output tokens over all
the passes' wall time, the median of --repeats timed passes that compiled nothing (a timed
pass that compiled a program is run again, at most --repeats times, and counted in the
report); the two engines' timed passes alternate, so a drift of the machine's speed falls on
both. The two engines' tokens must be the same (greedy speculation is
exact); the script checks it and reports the acceptance: draft tokens proposed, accepted,
and the mean acceptance length (tokens per verify step).

What the model wrote bounds what speculation can win, whatever the engine. Two ceilings,
in tokens per step with verification free, computed from the outputs of the engine without
speculation: the lookup ceiling, if every step proposed --k tokens by the n-gram rule the
engine uses (jpaged/spec_decode/ngram_proposer.py, with this script's lookup sizes); and the copy
ceiling, if every step were proposed the best --k tokens copied from anywhere in its
context (prompt and output so far: no proposer that copies can do better). The speed-up at
batch 1 can approach the lookup ceiling, not pass it.
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

import numpy as np

from jpaged import LLM, SamplingParams
from jpaged.spec_decode.ngram_proposer import matched_prefix, ngram_propose

LOOKUP = (1, 4)  # prompt_lookup_min, prompt_lookup_max
SNIPPETS = [
    (
        "def total_price(items, tax):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item.price * item.quantity\n    return subtotal * (1 + tax)\n"
    ),
    (
        "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
        "        counts[word] = counts.get(word, 0) + 1\n    return counts\n"
    ),
    (
        "def moving_average(values, window):\n    result = []\n"
        "    for i in range(len(values) - window + 1):\n"
        "        result.append(sum(values[i:i + window]) / window)\n    return result\n"
    ),
    (
        "def find_max(numbers):\n    best = numbers[0]\n    for number in numbers[1:]:\n"
        "        if number > best:\n            best = number\n    return best\n"
    ),
]
RENAMES = [("subtotal", "running_total"), ("counts", "frequency"), ("result", "averages"),
           ("best", "largest")]  # fmt: skip
PASSAGE = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. It is 330 metres tall. "
    "The river Seine flows through Paris from east to west. The Louvre is the most visited "
    "museum in the world. Paris has about two million inhabitants. The Seine is 777 "
    "kilometres long and ends in the English Channel. The tower was the tallest structure in "
    "the world until 1930."
)
TOPICS = ["the Seine", "the Eiffel Tower", "the tower", "Paris"]
QUESTIONS = [
    "Why is the sky blue?",
    "Give me three tips for sleeping better.",
    "What is a good name for a pet turtle?",
    "Explain what a compiler does.",
]


def workloads(n: int) -> dict[str, list[list[dict]]]:
    def user(text):
        return [{"role": "user", "content": text}]

    code = [
        user(f"Rename the variable `{RENAMES[i % 4][0]}` to `{RENAMES[i % 4][1]}` in this "
             f"Python function and show the whole function:\n\n{SNIPPETS[i % 4]}")
        for i in range(n)
    ]  # fmt: skip
    quotes = [
        user(f"Passage: {PASSAGE}\n\nQuote, word for word, every sentence of the passage "
             f"about {TOPICS[i % 4]}.")
        for i in range(n)
    ]  # fmt: skip
    free = [user(QUESTIONS[i % 4]) for i in range(n)]
    return {"code-edit": code, "quotes": quotes, "free": free}


def copy_ceiling(context: list[int], output: list[int], k: int) -> tuple[int, int]:
    """(tokens, steps) of output if each step accepted the longest span of at most k tokens
    that occurs earlier in the context (prompt then output so far), plus the target's token."""
    context, output = list(context), list(output)
    pos = steps = 0
    while pos < len(output):
        seen = context + output[:pos]
        want = output[pos : pos + k]
        best = max(matched_prefix(seen[start : start + k], want) for start in range(len(seen)))
        pos += best + 1
        steps += 1
    return len(output), steps


def lookup_ceiling(context: list[int], output: list[int], k: int) -> tuple[int, int]:
    """(tokens, steps) of output if each step proposed k tokens by prompt lookup (sizes LOOKUP,
    as the engine under test) and accepted the matching prefix plus the target's token."""
    seq = np.array([*context, *output], np.int32)[None]
    pos = steps = 0
    while pos < len(output):
        proposal, n = ngram_propose(
            seq, np.array([len(context) + pos]), np.array([k]), prompt_lookup_min=LOOKUP[0],
            prompt_lookup_max=LOOKUP[1],
        )  # fmt: skip
        pos += matched_prefix(proposal[0, : int(n[0])].tolist(), output[pos:]) + 1
        steps += 1
    return len(output), steps


def run(llm: LLM, conversations, params, batch: int) -> tuple[float, int, list]:
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(conversations), batch):
        outs += llm.chat(conversations[i : i + batch], params)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), outs


def _paired(row: dict) -> str:
    """The paired ratios' mean and standard error, given two pairs or more."""
    if row["paired_stderr"] is None:
        return ""
    return (f", paired {row['paired_mean']:.3f} +- {row['paired_stderr']:.3f} over "
            f"{len(row['paired_ratios'])} pairs")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="(default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument(
        "--num-prompts", type=int, default=8, help="per workload (batch 1: run one by one)"
    )
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--max-warmups",
        type=int,
        default=4,
        help="warm-up passes at most (until one compiles none)",
    )
    p.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="speculative_config's (default off)"
    )
    p.add_argument(
        "--no-cost-aware", action="store_true",
        help="speculative_config cost_aware false: no cost governor (vLLM's behaviour)",
    )
    args = p.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": LOOKUP[1],
             "prompt_lookup_min": LOOKUP[0], "disable_by_batch_size": args.disable_by_batch_size,
             "cost_aware": not args.no_cost_aware}  # fmt: skip
    common = {"max_num_seqs": max(batches), "max_model_len": 1024}
    engines = {"off": LLM(args.model, **common),
               "ngram": LLM(args.model, **common, speculative_config=ngram)}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for name, convs in workloads(args.num_prompts).items():
        for batch in batches:
            row = {"workload": name, "batch": batch}
            tokens = {}
            for label, llm in engines.items():
                warmups = 0
                while warmups < args.max_warmups:  # until a pass compiles nothing
                    before = llm.stats()["num_compiles"]
                    run(llm, convs, params, batch)
                    warmups += 1
                    if llm.stats()["num_compiles"] == before:
                        break
                row[f"{label}_warmup_passes"] = warmups
            # Timed passes alternate between the engines (off, ngram, off, ngram, ...), so a
            # drift of this machine's speed over the minutes a row takes falls on both alike.
            # A pass that compiled a program (a shape no warm-up pass met: the governor's
            # choices depend on timing) is run again, at most `repeats` times per engine.
            rates = {label: [] for label in engines}
            discarded = dict.fromkeys(engines, 0)
            last, outs, stats = {}, {}, {}
            pairs = []  # n-gram over off, for rounds in which both passes ran and were kept
            while todo := [label for label in engines
                           if len(rates[label]) < args.repeats
                           and discarded[label] < args.repeats]:  # fmt: skip
                kept = {}
                for label in todo:
                    llm = engines[label]
                    llm.reset_stats()
                    before = llm.stats()["num_compiles"]
                    seconds, n, outs[label] = run(llm, convs, params, batch)
                    stats[label] = llm.stats()
                    last[label] = n / seconds
                    if stats[label]["num_compiles"] == before:
                        rates[label].append(n / seconds)
                        kept[label] = n / seconds
                    else:
                        discarded[label] += 1
                if len(kept) == 2:
                    pairs.append(kept["ngram"] / kept["off"])
            for label in engines:
                got = rates[label] or [last[label]]  # every pass compiled: the last one
                row[f"{label}_timed_compiles"] = discarded[label]
                row[f"{label}_tokens_per_s"] = statistics.median(got)
                row[f"{label}_spread"] = [min(got), max(got)]
                tokens[label] = [o.outputs[0].token_ids for o in outs[label]]
            for key, ceiling in (("copy", copy_ceiling), ("lookup", lookup_ceiling)):
                bound = np.array(  # [prompts, (tokens, steps)]
                    [
                        ceiling(o.prompt_token_ids, o.outputs[0].token_ids, args.k)
                        for o in outs["off"]
                    ]
                )
                row[f"{key}_ceiling"] = float(bound[:, 0].sum() / bound[:, 1].sum())
            s = stats["ngram"]  # the last ngram pass
            row |= {
                "proposed": s["spec_num_draft_tokens"],
                "accepted": s["spec_num_accepted_tokens"],
                "acceptance_rate": s["spec_num_accepted_tokens"]
                / max(s["spec_num_draft_tokens"], 1),
                "mean_acceptance_length": s["spec_mean_acceptance_length"],
            }
            row["speedup"] = row["ngram_tokens_per_s"] / row["off_tokens_per_s"]
            # A pair's two passes ran one after the other: their ratio cancels the machine's
            # drift between pairs; the mean over pairs and its standard error say how far the
            # speed-up is from 1 against the pass-to-pass noise.
            row["paired_ratios"] = pairs
            row["paired_mean"] = statistics.mean(pairs) if pairs else None
            row["paired_stderr"] = (
                statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else None
            )
            row["same_tokens"] = tokens["off"] == tokens["ngram"]
            row["mean_output_tokens"] = statistics.mean(len(t) for t in tokens["off"])
            rows.append(row)
            print(f"{name:>9} batch {batch}: off {row['off_tokens_per_s']:7.1f}, ngram "
                  f"{row['ngram_tokens_per_s']:7.1f} tokens/s ({row['speedup']:.2f}x{_paired(row)}); accepted "
                  f"{row['accepted']}/{row['proposed']} ({row['acceptance_rate']:.0%}), mean "
                  f"acceptance length {row['mean_acceptance_length']:.2f} (ceilings: lookup "
                  f"{row['lookup_ceiling']:.2f}, copy "
                  f"{row['copy_ceiling']:.2f}); timed runs that compiled (run again): off "
                  f"{row['off_timed_compiles']}, ngram {row['ngram_timed_compiles']}; same tokens "
                  f"{row['same_tokens']}", flush=True)  # fmt: skip
    print("RESULT_JSON " + json.dumps({"args": vars(args), "rows": rows}))
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

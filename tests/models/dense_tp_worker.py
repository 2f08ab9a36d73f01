"""Greedy tokens of a model at tensor_parallel_size 1 and 2, on 2 simulated CPU devices (the
device count is fixed when JAX starts, so this runs in its own process).

    python dense_tp_worker.py MODEL_DIR PROMPTS_JSON MAX_TOKENS  ->  {"1": [...], "2": [...]}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The checkout's jpaged, installed or not (as tests/parallel's workers do).
sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

# First, as tests/parallel/sharded_worker.py puts it: appended after the test environment's
# flags it did not take effect (one device).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 " + os.environ.get(
    "XLA_FLAGS", ""
)
os.environ["JAX_PLATFORMS"] = "cpu"

from jpaged import LLM, SamplingParams


def main() -> None:
    path, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    tokens = {}
    for t in (1, 2):
        llm = LLM(
            path,
            tensor_parallel_size=t,
            max_num_seqs=2,
            page_size=4,
            num_pages=24,
            max_model_len=64,
            max_num_batched_tokens=32,
        )
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        tokens[t] = [o.outputs[0].token_ids for o in outs]
    print(json.dumps(tokens))


if __name__ == "__main__":
    main()

"""Greedy tokens of models at tensor_parallel_size 1 and 2, on 2 simulated CPU devices (the
device count is fixed when JAX starts, so this runs in its own process; one process for
several models, as its start and jax's import cost seconds).

    python dense_tp_worker.py PROMPTS_JSON MAX_TOKENS MODEL_DIR...
        ->  {MODEL_DIR: {"1": [...], "2": [...]}, ...}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The checkout's jpaged, installed or not (as tests/parallel's workers do).
_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]

from simulated_devices import set_simulated_devices

set_simulated_devices(2)

from jpaged import LLM, SamplingParams


def main() -> None:
    prompts, max_tokens, paths = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    results = {}
    for path in paths:
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
        results[path] = tokens
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Runs mixture-of-experts engines on 8 simulated CPU devices in a fresh process; prints one
JSON line: each family's greedy tokens and expert-weight layout per (T, expert parallel).

    python tests/parallel/moe_worker.py CKPT_ROOT FAMILY...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]

# (tensor_parallel_size, enable_expert_parallel)
CONFIGS = ((2, False), (2, True), (4, True))
ENGINE = {
    "max_num_seqs": 2,
    "max_model_len": 64,
    "max_num_batched_tokens": 16,
    "page_size": 4,
    "num_pages": 40,
    "enable_prefix_caching": True,
    "compilation_cache_dir": None,
}


def main(root: str, families: list[str]) -> dict:
    from simulated_devices import set_simulated_devices

    set_simulated_devices(8)
    from moe_families import MAX_TOKENS, prompts

    from jpaged import LLM, SamplingParams

    results = {}
    for family in families:
        for t, ep in CONFIGS:
            llm = LLM(
                str(Path(root) / family),
                tensor_parallel_size=t,
                enable_expert_parallel=ep,
                **ENGINE,
            )
            layers = llm.llm_engine.runner.params["layers"]
            layer = layers if isinstance(layers, dict) else layers[0]
            outs = llm.generate(
                prompts(160), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
            )
            results[f"{family}/{t}/{ep}"] = {
                "tokens": [o.outputs[0].token_ids for o in outs],
                "pages_used": llm.stats()["pages_used"],
                "layout": {
                    name: [
                        str(layer[name].sharding.spec),
                        list(layer[name].addressable_shards[0].data.shape),
                    ]
                    for name in ("w_gate_exps", "w_down_exps", "router", "w_gate", "w_gate_shared",
                                 "b_gate_exps", "b_down_exps", "sinks", "wkv_b", "wq_b",
                                 "wkv_a")
                    if name in layer
                },
            }
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2:])))

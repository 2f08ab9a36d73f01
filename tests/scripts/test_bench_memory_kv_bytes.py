"""scripts/bench_memory.py --preset kv-bytes (issue 56): DeepSeek-V3's KV bytes per token,
the latent pool against the same model with per-head K/V, per KV dtype; its rows are the
ones docs/memory.md records (no weights: the engine's own memory plan on the real config)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "scripts" / "bench_memory.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_memory"] = bench
_spec.loader.exec_module(bench)

# (KV dtype, MLA bytes per token, per-head K/V bytes per token, ratio)
ROWS = [
    ("bfloat16", 70_272, 4_997_120, "71.1x"),  # 61 x (512 + 64) x 2
    ("float32", 140_544, 9_994_240, "71.1x"),
    ("int8", 35_380, 2_529_792, "71.5x"),  # 61 x ((512 + 64) + 2 halves x a 2-byte scale)
]


def test_kv_bytes_preset_prints_deepseek_v3s_bytes_per_token(capsys):
    bench.kv_bytes_table()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "DeepSeek-V3: 61 layers, latent 512 + rope 64 against 128 heads of K 192 + V 128"
    )
    got = [line.split() for line in lines[2:]]
    assert got == [[n, f"{mla:,}", f"{full:,}", r] for n, mla, full, r in ROWS]
    assert 61 * (512 + 64) * 2 == ROWS[0][1] and 61 * 128 * (192 + 128) * 2 == ROWS[0][2]


def test_docs_memory_records_the_presets_rows():
    """docs/memory.md's table is the preset's output (a changed layout must change both)."""
    text = (ROOT / "docs" / "memory.md").read_text()
    for name, mla, full, ratio in ROWS:
        row = rf"\| {name}[^|]* \| {mla:,} \| {full:,} \| {ratio} \|"
        assert re.search(row, text), row

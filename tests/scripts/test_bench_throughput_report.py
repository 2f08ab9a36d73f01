"""scripts/bench_throughput.py's report: a figure not measured in the run is labelled stored on
its own line, so is a ratio formed from it, stored figures are never used on another card, and
--hf-reserve keeps time for the transformers baseline while jpaged's phases run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_throughput.py"
_spec = importlib.util.spec_from_file_location("bench_throughput", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_throughput"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

OURS = {
    "tokens_per_s": 28274.0,
    "num_compiled": 3,
    "num_buckets": 3,
    "warmup_s": 1.0,
    "compile_s": 1.0,
    "startup_s": 1.0,
    "num_recompiles": 0,
    "num_preemptions": 0,
    "output_tokens": 16,
    "expected_output_tokens": 16,
}


def _result(hardware: str, transformers: dict) -> dict:
    return {
        "phases": {"jpaged": "done"},
        "jpaged": dict(OURS),
        "jpaged_no_prefix_caching": None,
        "transformers": transformers,
        "startup": {},
        "hardware": hardware,
        "num_devices": 1,
        "jax": "0.11.2",
        "copy_bandwidth_gb_s": 3000.0,
        "workload": "W1",
    }


def _report(result: dict, capsys) -> list[str]:
    args = bench.parse_args(["--workload", "W1", "--preset", "llama-3.2-1b"])
    args.max_num_seqs, args.max_num_batched_tokens = 128, 8192
    bench.report(result, args)
    return capsys.readouterr().out.splitlines()


def test_stored_figures_on_an_h200_are_labelled_on_every_line(capsys):
    result = _result("NVIDIA H200 (gpu)", {})
    lines = _report(result, capsys)
    stored = [line for line in lines if line.startswith("transformers ")]
    assert len(stored) == 3
    assert all(line.endswith(f"({bench.STORED_TRANSFORMERS_SOURCE})") for line in stored)
    ratio = next(line for line in lines if line.startswith("ratio"))
    assert ratio == (
        "ratio jpaged / transformers' best: 2.00x, against a STORED figure "
        f"({bench.STORED_TRANSFORMERS_SOURCE}); not a same-run comparison"
    )
    assert result["ratio_vs_transformers"] == {"value": 2.0, "transformers": "stored"}
    assert result["transformers_stored"]["source"] == bench.STORED_TRANSFORMERS_SOURCE


def test_stored_h200_figures_are_never_used_on_another_card(capsys):
    result = _result("NVIDIA H100 80GB HBM3 (gpu)", {})
    lines = _report(result, capsys)
    assert not [line for line in lines if line.startswith(("transformers ", "ratio"))]
    assert "ratio_vs_transformers" not in result and "transformers_stored" not in result


def test_figures_measured_in_the_run_name_the_card_and_win_over_stored(capsys):
    theirs = {"device": "NVIDIA H200", "padded_generate": 7000.0, "generate_batch": 14137.0}
    result = _result("NVIDIA H200 (gpu)", theirs)
    lines = _report(result, capsys)
    assert [line for line in lines if line.startswith("transformers ")] == [
        f"{'transformers padded_generate':<40}{7000.0:>16.1f}   (this run, NVIDIA H200)",
        f"{'transformers generate_batch':<40}{14137.0:>16.1f}   (this run, NVIDIA H200)",
    ]
    assert "ratio jpaged / transformers' best (both this run): 2.00x" in lines
    assert result["ratio_vs_transformers"]["transformers"] == "measured in this run"


@pytest.mark.parametrize(
    ("reserve", "skip", "expected_jpaged"),
    [(120, False, 470.0), (120, True, 590.0), (0, False, 590.0)],
)
def test_hf_reserve_keeps_time_for_the_baseline(
    monkeypatch, tmp_path, reserve, skip, expected_jpaged
):
    timeouts = {}

    def fake_subprocess_json(cmd, timeout, partial=None):
        phase = "transformers" if "bench_transformers_worker.py" in cmd[1] else "jpaged"
        timeouts[phase] = timeout
        return {}

    now = [1000.0]
    monkeypatch.setattr(bench, "_subprocess_json", fake_subprocess_json)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    argv = ["--workload", "W1", "--skip-startup", "--hf-reserve", str(reserve)]
    args = bench.parse_args(argv + (["--skip-transformers"] if skip else []))
    args.model = "unused"
    result = {"phases": {}, "startup": {}, "transformers": {}}
    bench.measure(args, tmp_path / "w.json", tmp_path, 1000.0 + 600.0, result)
    # 600 s of budget less the report's 10 s, less the reserve while jpaged runs
    assert timeouts["jpaged"] == pytest.approx(expected_jpaged)
    if not skip:
        assert timeouts["transformers"] == pytest.approx(590.0)


def test_same_tokens_counts_requests_whose_digests_match():
    a = bench.token_digests([[1, 2], [3], [4, 5, 6]])
    assert len(a) == 3 and len(set(a)) == 3 and all(len(d) == 12 for d in a)
    assert bench.same_tokens(a, list(a)) == "all 3 requests"
    b = bench.token_digests([[1, 2], [3, 9], [4, 5, 6]])
    assert bench.same_tokens(a, b) == "2 of 3 requests"


def test_vllm_runs_under_its_own_python_with_its_environment(tmp_path, capsys):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    args = bench.parse_args(
        ["--workload", "W3", "--vllm-python", str(venv / "bin" / "python"),
         "--vllm-threads", "0-1", "--model", str(tmp_path)]
    )  # fmt: skip
    args.dtype, args.max_num_seqs, args.max_num_batched_tokens = "float32", 32, 2048
    cmd = bench.vllm_command(args, tmp_path / "w.json", tmp_path / "p.json")
    env = {c.split("=", 1)[0]: c.split("=", 1)[1] for c in cmd[1:4]}
    assert cmd[0] == "env" and cmd[4] == str(venv / "bin" / "python")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["LD_PRELOAD"].endswith(str(venv.resolve() / "lib" / "libiomp5.so"))
    assert cmd[cmd.index("--model") + 1] == str(tmp_path)  # a directory is used as it is
    assert cmd[-1] == "--enable-prefix-caching"  # W3 compares with prefix caching on

    result = _result("cpu (cpu)", {})
    result["jpaged"]["token_digests"] = ["a", "b"]
    result["vllm"] = {"vllm": "0.32.0+cpu", "tokens_per_s": 14137.0, "startup_s": 76.4,
                      "token_digests": ["a", "b"]}  # fmt: skip
    bench.report_vllm(result, args)
    assert capsys.readouterr().out.splitlines() == [
        f"{'vLLM 0.32.0+cpu (threads 0-1)':<40}{14137.0:>16.1f}   (this run, start-up 76s)",
        "ratio jpaged / vLLM (both this run): 2.00x; same tokens: all 2 requests",
    ]


def test_a_workers_result_is_its_last_json_line_and_none_is_an_error():
    """vLLM's engine may log to stdout after the worker's result line; a worker that prints
    no result is an error naming what it printed, never a crash of the whole run."""
    logs_after = "import json; print(json.dumps({'tokens_per_s': 2.5})); print('INFO shutting down')"
    assert bench._subprocess_json([sys.executable, "-c", logs_after], 60) == {"tokens_per_s": 2.5}
    nothing = bench._subprocess_json([sys.executable, "-c", "print('INFO only logs')"], 60)
    assert nothing == {"error": "no result line in the worker's output (last: 'INFO only logs')"}


@pytest.mark.needs_torch
def test_issue_56_presets_have_the_shapes_docs_benchmarks_md_states():
    """deepseek-v3-cpu: a 160-value latent row (5,120 bytes a token over 8 float32 layers), one
    dense layer, 32 experts in 8 groups of which 4 eligible; gptoss-cpu: 8 layers alternating
    a 128-token window and full attention, sinks, 32 experts of which 4 per token."""
    from jpaged.core.memory_plan import kv_page_bytes
    from models.config import ModelConfig

    def config(preset: str, arch: str) -> ModelConfig:
        hf = bench._hf_config(bench.PRESETS[preset]).to_dict()
        return ModelConfig.from_hf_config({**hf, "architectures": [arch]})

    ds = config("deepseek-v3-cpu", "DeepseekV3ForCausalLM")
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim, ds.num_layers) == (128, 32, 8)
    assert kv_page_bytes(ds, 1, 4) == 5120
    assert (ds.num_dense_layers, ds.num_experts, ds.num_expert_groups, ds.topk_groups) == (
        1, 32, 8, 4)  # fmt: skip
    oss = config("gptoss-cpu", "GptOssForCausalLM")
    assert oss.windows == (128, None) * 4 and oss.attention_sinks
    assert (oss.num_experts, oss.num_experts_per_tok) == (32, 4)

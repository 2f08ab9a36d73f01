#!/usr/bin/env bash
# One prepared device session for issue 8 (one H200, ~15 minutes of device time in all, at most
# 10 minutes per command). Runs the steps named on the command line, in the order given, each
# under a timeout, and stops starting new ones when the deadline is near. Needs no network.
#
#   bash scripts/gpu_session.sh tests attention W1 W3 W2     # one device run, timeout_s 600
#   DEADLINE_S=300 bash scripts/gpu_session.sh W2            # a later call: what was skipped
#
# One call is the cheapest (each machine start costs a minute or two of the budget): with the
# default deadline of 560 s the steps that do not fit are skipped and say so in session.log.
#
# Steps, in order of value:
#   tests      JAX_PLATFORMS=cuda python -m pytest -q -m gpu (tests/pallas_kernels/test_on_gpu.py)
#   attention  scripts/bench_attention.py (issue 5's decode-attention table)
#   W1         bench_throughput W1 on the llama-3.2-1b preset, with start-up cold/warm
#   W3         bench_throughput W3 on llama-3.2-1b (prefix caching on/off), no start-up runs
#   W2         bench_throughput W2 on llama-3.2-1b scaled by W2_SCALE (default 4), no start-up
#   W1-8b      bench_throughput W1 on the llama-3.1-8b preset (only if asked for)
#
# Output goes to $OUT (default ./gpu-out): session.log (environment, tests, the summary),
# one <step>.log per benchmark, and results.jsonl (one RESULT_JSON object per benchmark).
# The checkpoints and jpaged's compilation cache live under $BENCH_ROOT (default
# /tmp/jpaged-bench), so a second call on a still-warm machine reuses them.
#
# Environment: DEADLINE_S (default 560: seconds this call may take in all), W2_SCALE, PRESET
# (default llama-3.2-1b) and EXTRA_ARGS (added to every benchmark), e.g. for a CPU dry run:
#   OUT=/tmp/o PRESET=cpu-small EXTRA_ARGS='--scale 16' bash scripts/gpu_session.sh W1 W3
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
BENCH_ROOT=${BENCH_ROOT:-/tmp/jpaged-bench}
DEADLINE_S=${DEADLINE_S:-560}
W2_SCALE=${W2_SCALE:-4}
PY=${PY:-python3}
PRESET=${PRESET:-llama-3.2-1b}
EXTRA_ARGS=${EXTRA_ARGS:-}
mkdir -p "$OUT" "$BENCH_ROOT"
export JPAGED_CACHE_DIR=$BENCH_ROOT/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
START=$(date +%s)
LOG=$OUT/session.log

say() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE_S - ($(date +%s) - START))); }

# run_step NAME MIN_SECONDS MAX_SECONDS CMD...: runs CMD under a timeout of
# min(MAX_SECONDS, time left - 10); skipped when less than MIN_SECONDS is left.
run_step() {
  local name=$1 min=$2 max=$3
  shift 3
  local budget=$(($(left) - 10))
  ((budget > max)) && budget=$max
  if ((budget < min)); then
    say "SKIP $name: ${budget}s left, needs ${min}s"
    return
  fi
  say "START $name (timeout ${budget}s): $*"
  timeout --signal=INT --kill-after=15 "$budget" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  say "END $name rc=$rc$( ((rc == 124)) && echo ' (timed out)')"
  grep -h '^RESULT_JSON ' "$OUT/$name.log" | sed 's/^RESULT_JSON //' >>"$OUT/results.jsonl"
  # The human-readable summary of a benchmark: everything it printed before the JSON line.
  grep -v -e '^RESULT_JSON ' -e 'it/s\]' "$OUT/$name.log" | tail -n 25 >>"$LOG"
}

bench() {  # bench NAME MIN MAX ARGS...: scripts/bench_throughput.py with the session's settings
  local name=$1 min=$2 max=$3
  shift 3
  run_step "$name" "$min" "$max" "$PY" scripts/bench_throughput.py \
    --checkpoint-dir "$BENCH_ROOT/checkpoints" --hf-timeout $((max * 3 / 5)) "$@" $EXTRA_ARGS
}

{
  echo "gpu_session: steps: ${*:-none}; deadline ${DEADLINE_S}s; $(date -u)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  "$PY" -c 'import sys, jax, torch, transformers; print(sys.version.split()[0], "jax", jax.__version__, jax.devices(), "torch", torch.__version__, "transformers", transformers.__version__)'
  git log --oneline -1
} >>"$LOG" 2>&1

for step in "$@"; do
  case $step in
    tests)
      # tests/conftest.py defaults JAX_PLATFORMS to cpu; the GPU-marked tests skip there.
      # addopts is cleared: it asks for pytest-xdist workers, which the device may not have.
      run_step tests 30 150 env JAX_PLATFORMS=cuda "$PY" -m pytest -q -o addopts= -m gpu \
        -p no:cacheprovider -rfEs tests/pallas_kernels/test_on_gpu.py
      ;;
    attention) run_step attention 60 100 "$PY" scripts/bench_attention.py ;;
    W1) bench W1 180 300 --workload W1 --preset "$PRESET" ;;
    W3) bench W3 150 200 --workload W3 --preset "$PRESET" --skip-startup ;;
    W2) bench W2 100 200 --workload W2 --preset "$PRESET" --scale "$W2_SCALE" --skip-startup ;;
    W1-8b) bench W1-8b 240 400 --workload W1 --preset llama-3.1-8b --skip-startup ;;
    *) say "unknown step $step (tests, attention, W1, W3, W2, W1-8b)" ;;
  esac
done
say "gpu_session: done"

#!/usr/bin/env bash
# One prepared device session (one H100 or H200, ~15 minutes of device time in all, at most 10 minutes
# per command). Runs the steps named on the command line, in the order given, each under a
# timeout computed from the time actually left, and stops starting new ones when the deadline
# is near. Needs no network, and no install of the project: the repo root goes on PYTHONPATH.
#
#   bash scripts/gpu_session.sh tests attention W1 W3 W2     # one device run, timeout_s 600
#   DEADLINE_S=300 bash scripts/gpu_session.sh W2            # a later call: what was skipped
#
# One call is the cheapest (each machine start costs a minute or two of the budget): with the
# default deadline of 560 s the steps that do not fit are skipped and say so in session.log.
#
# Steps, in order of value:
#   tests      python -m pytest -m gpu tests/pallas_kernels/test_on_gpu.py (README's command;
#              on a machine without a GPU it stops at once with one line, exit 4)
#              (in order of value inside: the engine's greedy tokens through the kernels
#              first, bf16 kernels, the Mosaic GPU decode kernel, then f32)
#   attention  scripts/bench_attention.py (copy bandwidth; our decode kernels, Triton and
#              Mosaic, against jax's bundled kernel; the 64 x 2048 shape first)
#   W1         bench_throughput W1 on the llama-3.2-1b preset, with start-up cold/warm
#   W3         bench_throughput W3 on llama-3.2-1b (prefix caching on/off), no start-up runs
#   W2         bench_throughput W2 on llama-3.2-1b scaled by W2_SCALE (default 4), no start-up
#   W1-8b      bench_throughput W1 on the llama-3.1-8b preset (only if asked for)
# Each benchmark measures jpaged first and transformers last, each phase in its own process
# with the time left (--time-budget); HF_RESERVE seconds (default 90) are kept for
# transformers (--hf-reserve), so its baseline is measured on the card this call has (an
# H100's figures are not an H200's). The card's name opens session.log, ends it, and goes
# into every line of results.jsonl ("card").
#
# Output goes to $OUT (default ./gpu-out): session.log (environment, tests, the summary), one
# <step>.log per step, <step>.json rewritten by the benchmark after every phase (what a kill
# leaves is still there), and results.jsonl (each step's RESULT_JSON, or its partial JSON
# marked "partial": true). A step gets SIGINT at its timeout (benchmarks then print what they
# measured) and SIGKILL KILL_GRACE_S (default 60) seconds later; the grace is budgeted.
# The checkpoints and jpaged's compilation cache live under $BENCH_ROOT (default
# /tmp/jpaged-bench), so a second call on a still-warm machine reuses them.
#
# Environment: DEADLINE_S (default 560: seconds this call may take in all), PY (the Python
# to use; default: the first of python3.12, python3, python that imports jax and jaxlib),
# W2_SCALE, PRESET (default llama-3.2-1b), EXTRA_ARGS (added to every throughput benchmark),
# ATTENTION_ARGS (added to bench_attention), KILL_GRACE_S.
#
# Dry run on a CPU host under the GPU machine's versions (Python 3.12, jax 0.11.2, triton
# 3.6.0; the project not installed; no grpcio-health-checking/-reflection/-tools): a venv made
# that way (docs/attention.md lists its packages), then
#   JAX_PLATFORMS=cpu PY=/path/to/venv/bin/python OUT=/tmp/dry PRESET=cpu-small \
#     EXTRA_ARGS='--scale 32' ATTENTION_ARGS=--quick DEADLINE_S=560 \
#     bash scripts/gpu_session.sh tests attention W1 W3 W2
# (tests/test_gpu_session.py runs a shorter one, marked slow).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
BENCH_ROOT=${BENCH_ROOT:-/tmp/jpaged-bench}
DEADLINE_S=${DEADLINE_S:-560}
W2_SCALE=${W2_SCALE:-4}
PRESET=${PRESET:-llama-3.2-1b}
EXTRA_ARGS=${EXTRA_ARGS:-}
ATTENTION_ARGS=${ATTENTION_ARGS:-}
KILL_GRACE_S=${KILL_GRACE_S:-60}
HF_RESERVE=${HF_RESERVE:-90}
mkdir -p "$OUT" "$BENCH_ROOT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export JPAGED_CACHE_DIR=$BENCH_ROOT/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
START=$(date +%s)
LOG=$OUT/session.log

say() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE_S - ($(date +%s) - START))); }

# The Python: $PY, else the first candidate that imports jax and jaxlib.
if [[ -z ${PY:-} ]]; then
  for candidate in python3.12 python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import jax, jaxlib' 2>/dev/null; then
      PY=$(command -v "$candidate")
      break
    fi
  done
fi
if [[ -z ${PY:-} ]] || ! "$PY" -c 'import jax, jaxlib' 2>>"$LOG"; then
  say "no Python with jax and jaxlib found (set PY=/path/to/python); stopping"
  exit 2
fi

# The card: nvidia-smi's name for GPU 0, else jax's device kind (no GPU: the CPU's).
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
if [[ -z $CARD ]]; then
  CARD=$("$PY" -c 'import jax; d = jax.devices()[0]; print(f"{d.device_kind} ({d.platform})")' 2>/dev/null)
fi
CARD=${CARD:-unknown}
export CARD
say "card: $CARD"

# run_step NAME MIN MAX CMD...: runs CMD under a timeout of min(MAX, time left - grace - 10);
# skipped when that is less than MIN. {BUDGET} in CMD becomes the timeout less 5 seconds.
run_step() {
  local name=$1 min=$2 max=$3
  shift 3
  local budget=$(($(left) - KILL_GRACE_S - 10))
  ((budget > max)) && budget=$max
  if ((budget < min)); then
    say "SKIP $name: ${budget}s left, needs ${min}s"
    return
  fi
  local args=("${@//\{BUDGET\}/$((budget - 5))}")
  say "START $name (timeout ${budget}s): ${args[*]}"
  timeout --signal=INT --kill-after="$KILL_GRACE_S" "$budget" "${args[@]}" >"$OUT/$name.log" 2>&1
  local rc=$?
  say "END $name rc=$rc$( ((rc == 124)) && echo ' (timed out)')"
  # Each result goes out with the step and the card; a step killed before it could print
  # leaves what it had saved, marked partial.
  if grep -q '^RESULT_JSON ' "$OUT/$name.log"; then
    grep -h '^RESULT_JSON ' "$OUT/$name.log" | tail -n 1 | sed 's/^RESULT_JSON //' |
      "$PY" -c "$STAMP" "$name" "" >>"$OUT/results.jsonl"
  elif [[ -s $OUT/$name.json ]]; then
    "$PY" -c "$STAMP" "$name" partial <"$OUT/$name.json" >>"$OUT/results.jsonl"
  fi
  # The human-readable summary: everything printed but the JSON line and progress bars.
  grep -v -e '^RESULT_JSON ' -e 'it/s\]' "$OUT/$name.log" | tail -n 30 >>"$LOG"
}

# STAMP STEP [partial]: stdin's JSON with "step", "card" (and "partial": true) added.
STAMP='import json, os, sys
r = json.load(sys.stdin)
r.update(step=sys.argv[1], card=os.environ["CARD"], **({"partial": True} if sys.argv[2] else {}))
print(json.dumps(r))'

bench() {  # bench NAME MIN MAX ARGS...: scripts/bench_throughput.py with the session's settings
  local name=$1 min=$2 max=$3
  shift 3
  # shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
  run_step "$name" "$min" "$max" "$PY" scripts/bench_throughput.py \
    --checkpoint-dir "$BENCH_ROOT/checkpoints" --time-budget '{BUDGET}' \
    --json-out "$OUT/$name.json" --hf-reserve "$HF_RESERVE" "$@" $EXTRA_ARGS
}

{
  echo "gpu_session: steps: ${*:-none}; deadline ${DEADLINE_S}s; $(date -u)"
  echo "python: $PY"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" - <<'EOF'
import importlib, sys
import jax
print(sys.executable, sys.version.split()[0], "jax", jax.__version__, jax.devices())
for name in ("jaxlib", "triton", "torch", "transformers", "pytest"):
    try:
        print(f"  {name} {importlib.import_module(name).__version__}")
    except ImportError as e:
        print(f"  {name}: not installed ({e})")
EOF
  git log --oneline -1 2>/dev/null || true
} >>"$LOG" 2>&1

for step in "$@"; do
  case $step in
    tests)
      # README's command: tests/conftest.py runs `-m gpu` on the GPU, in one process, or
      # stops with one line where there is none. addopts is cleared: it asks for
      # pytest-xdist workers, which the device may not have installed.
      run_step tests 60 240 "$PY" -m pytest -q \
        -o addopts= -m gpu -p no:cacheprovider -rfEs --durations=10 \
        tests/pallas_kernels/test_on_gpu.py
      ;;
    attention)
      # shellcheck disable=SC2086
      run_step attention 60 150 "$PY" scripts/bench_attention.py --time-budget '{BUDGET}' \
        --json-out "$OUT/attention.json" $ATTENTION_ARGS
      ;;
    W1) bench W1 120 300 --workload W1 --preset "$PRESET" ;;
    W3) bench W3 120 200 --workload W3 --preset "$PRESET" --skip-startup ;;
    W2) bench W2 100 200 --workload W2 --preset "$PRESET" --scale "$W2_SCALE" --skip-startup ;;
    W1-8b) bench W1-8b 240 400 --workload W1 --preset llama-3.1-8b --skip-startup ;;
    *) say "unknown step $step (tests, attention, W1, W3, W2, W1-8b)" ;;
  esac
done
say "gpu_session: done on $CARD"

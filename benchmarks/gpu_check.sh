#!/usr/bin/env bash
# The whole GPU picture in one run, results in one file, within GPU_CHECK_SECONDS (default 470,
# 8 minutes). On an H200 machine (16 cores, 2026-11-30) the gpu tests took 127 s, the engine
# benchmark about 160 s and the whole suite 264 s: the suite runs whole in a second run with
# GPU_CHECK_ENGINE=0 and GPU_CHECK_SECONDS=450.
#
#     bash benchmarks/gpu_check.sh [RESULTS_DIR]      # default: $OUT, else .bench/
#
# Run from the repository root on a machine with a CUDA GPU, torch, triton and transformers.
# Packages that machine lacks travel as wheels in .whl/ (benchmarks/gpu_wheels.txt says how
# to make it); they are installed into /tmp/site first. In order, each with its own time limit
# so that one hang cannot eat the rest:
#
#   1. the GPU's name, driver and the versions of torch, triton and transformers; the native
#      CPU kernels (and their sanitized build) start building in the background;
#   2. benchmarks/gpu_profile.py: where a decode step's time goes (GPU_CHECK_PROFILE=0 skips);
#   3. the tests marked `gpu` (the whole tree), one at a time: they share the card; each
#      test's name, result and duration on its own line;
#   4. benchmarks/gpu_engine.py: offline tok/s against transformers' generate, graphs and
#      eager, and one HTTP stream through `asyncengine serve` (GPU_CHECK_ENGINE=0 skips);
#   5. the whole suite but the `gpu` tests, in parallel (tests/model and tests/worker first):
#      the CPU path must pass on a GPU machine as it does without one. It gets what is left
#      of GPU_CHECK_SECONDS, each test's result on its own line.
#
# GPU_CHECK_GPU_TESTS=0 skips step 3; GPU_CHECK_SUITE="tests/a.py::b tests/c.py" runs only those
# in step 5 (a second run's re-check of what failed in the first).
#
# Everything goes to RESULTS_DIR/gpu_check.log (and gpu_engine.json); the summary lines are
# printed last.
set -u
cd "$(dirname "$0")/.."
RESULTS=${1:-${OUT:-.bench}}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
START=$(date +%s)
SUMMARY=()

say() { echo "$*" | tee -a "$LOG"; }
section() { say ""; say "=== $1 (at $(($(date +%s) - START)) s)"; }
# run NAME SECONDS CMD...: the command's output to the log, its status to the summary.
run() {
    local name=$1 limit=$2
    shift 2
    section "$name"
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local line="$name: exit $rc in $(($(date +%s) - t0)) s"
    [ $rc -eq 124 ] && line="$line (timed out after $limit s)"
    SUMMARY+=("$line")
    say "$line"
}

export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || say "wheel install failed"
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

section "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$LOG"
nproc | sed 's/^/cpus: /' | tee -a "$LOG"
date -u +"date: %Y-%m-%d" | tee -a "$LOG"

# The image has pytest-benchmark, whose warning under xdist would be an error here.
# No -q: with -v it would cancel out, and a step cut off by its limit would not name its tests.
PYTEST=(python3 -m pytest -p no:cacheprovider -p no:benchmark --timeout 300)
XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n 14)
# Both native libraries build while the GPU steps run (niced: Triton's compiles in the gpu
# tests need the cores more): the suite's first tests, and the sanitizer test's child, which
# builds with ASan, would otherwise wait minutes for them.
BUILD='from asyncengine.kernels import cpu_native as c; c._build(c.compiler())'
nice -n 19 python3 -c "$BUILD" >>"$RESULTS/native_build.log" 2>&1 &
BUILDS=($!)
ASYNCENGINE_NATIVE_SANITIZE=address,undefined ASYNCENGINE_NATIVE_BUILD_TIMEOUT=800 \
    nice -n 19 python3 -c "$BUILD" >>"$RESULTS/native_build.log" 2>&1 &
BUILDS+=($!)
if [ "${GPU_CHECK_PROFILE:-1}" != 0 ]; then
    run "gpu_profile" 75 python3 benchmarks/gpu_profile.py --seqs 1,64 --new 32
fi
if [ "${GPU_CHECK_GPU_TESTS:-1}" != 0 ]; then
    run "gpu tests" 240 "${PYTEST[@]}" -v --durations=0 -m gpu tests
fi
if [ "${GPU_CHECK_ENGINE:-1}" != 0 ]; then
    # Timings with the builds' compilers still taking the cores ran ~25% slower at 64
    # sequences (2026-11-28): give them up to 90 s more to end first.
    for _ in $(seq 90); do
        busy=0
        for pid in "${BUILDS[@]}"; do kill -0 "$pid" 2>/dev/null && busy=1; done
        [ $busy = 0 ] && break
        sleep 1
    done
    section "native builds: $([ $busy = 0 ] && echo done || echo still running)"
    # Both models' rows took 150-160 s on an H200 (2026-11-30: at 120 s the last two served
    # rows were cut).
    run "gpu_engine" 190 python3 benchmarks/gpu_engine.py --seqs 1,64 --eager 1 --serve \
    --deadline 170 --phase-timeout 60 --json "$RESULTS/gpu_engine.json"
fi
LEFT=$((${GPU_CHECK_SECONDS:-470} - ($(date +%s) - START)))
if [ "$LEFT" -gt 45 ]; then
    run "the suite but gpu tests, on this machine" "$((LEFT - 10))" "${PYTEST[@]}" "${XDIST[@]}" \
        -v --durations=20 -m "not gpu" ${GPU_CHECK_SUITE:-tests/model tests/worker tests}
fi
section "summary"
for line in "${SUMMARY[@]}"; do say "$line"; done
# The tests' tallies and the benchmark's table, for the reply's tail.
# (-v prints "[gw3] FAILED tests/...": a suite cut off by its limit has no summary of its own.)
grep -E "(FAILED|ERROR) tests/|[0-9]+ (passed|failed)|^\| " "$LOG" | awk '!seen[$0]++' | tail -60

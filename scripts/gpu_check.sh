#!/usr/bin/env bash
# The whole GPU check, end to end, on a machine with an NVIDIA GPU: install
# without touching the machine's CuPy; the gpu tests, the cpu tests, the demo,
# doctor, the benchmark suite and the notebooks (which read the suite's
# results); then a summary. Logs, executed notebooks and benchmark results go
# to $CHECK_DIR (default /tmp/cupy_ipc-check), and, packed in one file, to
# $OUT/check.tgz when $OUT is set.
# Knobs: PYTEST_ARGS, CHECK_BUDGET (seconds for the whole, default 585), GPU_TESTS_BUDGET (default 520), BENCH_SIZES, BENCH_METHODS, BENCH_ITERS, BENCH_ROUNDS, PRE (a command run first),
# PART: "tests" (GPU and CPU tests, demo, doctor), "tools" (benchmark suite, step timer, notebooks) or "all"
# (default): the two halves fit one device call each where the whole does not. PART=groups, for a machine
# of 4 or 8 GPUs: the several-GPU tests, doctor, and the suite's cross-device matrix and all_gather for
# 2, 4 and 8 ranks (results in $CHECK_DIR/results-groups, leaving benchmarks/results alone).
set -u
cd "$(dirname "$0")/.."
PART=${PART:-all}
case "$PART" in
    all|tests|tools|groups) ;;
    *) echo "unknown PART=$PART: choose all, tests, tools or groups"; exit 2 ;;
esac
PACK=${OUT:-}
OUT=${CHECK_DIR:-/tmp/cupy_ipc-check}
rm -rf "$OUT"  # a machine kept warm between calls still has the last call's logs: the summary reads only this one's
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

if ! $PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    echo "pip install -e failed (see install.log); using PYTHONPATH"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# Jupyter and matplotlib, for a machine without an index: wheels brought in .whl/.
# The tests, the suite (plots) and the notebooks see them; the demo and doctor do not.
SITE=${PYTHONPATH:-}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/cupy_ipc-site .whl/*.whl >"$OUT/whl.log" 2>&1
    SITE="/tmp/cupy_ipc-site${SITE:+:$SITE}"
fi
nvidia-smi -L
[ -n "${PRE:-}" ] && timeout 120 bash -c "$PRE" 2>&1 | tee "$OUT/pre.log"
$PY -c "import cupy, cuda.bindings; print('cupy', cupy.__version__, 'cuda-bindings', cuda.bindings.__version__)"

set -o pipefail
gpu_rc=0 cpu_rc=0 demo_rc=0 doctor_rc=0 bench_rc=0 nb_rc=0 steps_rc=0
# Every step has a time limit, so that one that hangs leaves time for the others.
if [ "$PART" = groups ]; then
    # 270 + 60 + 250 s: one device call of at most 600 s.
    timeout 270 $PY -m pytest -q -m "gpu or multi_gpu" --timeout 200 -rfE -p no:cacheprovider tests/test_gpu_groups.py \
        2>&1 | tee "$OUT/gpu-tests.log"
    gpu_rc=$?
    timeout 60 $PY -m cupy_ipc doctor 2>&1 | tee "$OUT/doctor.log"
    doctor_rc=$?
    timeout 250 $PY benchmarks/suite.py --watchdog 240 --only peer_matrix,all_gather --out "$OUT/results-groups" 2>&1 \
        | tee "$OUT/bench.log"
    bench_rc=$?
fi
if [ "$PART" = all ] || [ "$PART" = tests ]; then
    # With the brought wheels too: test_notebooks imports nbformat to be collected (and then deselected).
    PYTHONPATH="$SITE" timeout ${GPU_TESTS_BUDGET:-520} $PY -m pytest -q -m "gpu or multi_gpu" --timeout 240 -rfEs --durations 10 -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 \
        | tee "$OUT/gpu-tests.log"
    gpu_rc=$?
    timeout 60 $PY -m cupy_ipc demo 2>&1 | tee "$OUT/demo.log"
    demo_rc=$?
    timeout 120 $PY -m cupy_ipc doctor 2>&1 | tee "$OUT/doctor.log"
    doctor_rc=$?
    # Last, with what is left of one device call (CHECK_BUDGET s, from the script's start): CI runs them too,
    # so a GPU half that has grown cuts these short rather than the demo and doctor. (Not beside the GPU tests:
    # both count the segments in /dev/shm.)
    left=$(( ${CHECK_BUDGET:-585} - SECONDS ))
    [ "$left" -lt 20 ] && left=20  # (the device call itself ends at 600 s: its summary must still print)
    PYTHONPATH="$SITE" timeout "$left" $PY -m pytest -q -m "not gpu and not multi_gpu" -p no:cacheprovider 2>&1 \
        | tee "$OUT/cpu-tests.log"
    cpu_rc=$?
    [ $cpu_rc -eq 124 ] && printf '\nstopped after %s s, the rest of the call'"'"'s time\n' "$left" >> "$OUT/cpu-tests.log"
fi
if [ "$PART" = all ] || [ "$PART" = tools ]; then
    rm -f benchmarks/results/suite.* benchmarks/results/*.png  # the committed run's: never passed off as this one's
    PYTHONPATH="$SITE" timeout 330 $PY benchmarks/suite.py --watchdog 320 \
        --methods ${BENCH_METHODS:-bare,raw,cupy_ipc,cupy_ipc-nosync,cupy_ipc-unsafe,mp,pool,vmm,torch,staging} \
        --sizes ${BENCH_SIZES:-4KiB,1MiB,64MiB,1GiB} --iters ${BENCH_ITERS:-900} --rounds ${BENCH_ROUNDS:-3} \
        --out benchmarks/results 2>&1 | tee "$OUT/bench.log"
    bench_rc=$?
    mkdir -p "$OUT/results" && cp benchmarks/results/suite.* benchmarks/results/*.png "$OUT/results/" 2>/dev/null
    # Where a message's time goes, step by step on each side.
    timeout 90 $PY benchmarks/steps.py --iters 300 > "$OUT/steps.log" 2>&1
    steps_rc=$?
    # What each call on that path costs alone.
    timeout 60 $PY benchmarks/primitives.py > "$OUT/primitives.log" 2>&1 || steps_rc=1
    PYTHONPATH="$SITE" timeout 150 $PY scripts/run_notebooks.py --write "$OUT/notebooks" 2>&1 | tee "$OUT/notebooks.log"
    nb_rc=$?
fi

echo
echo "===== cupy_ipc GPU check summary ====="
last() { [ -f "$1" ] && tail -n 1 "$1" || echo "not run (PART=$PART)"; }
echo "gpu tests: $(last "$OUT/gpu-tests.log")"
echo "cpu tests: $(last "$OUT/cpu-tests.log")"
[ -f "$OUT/notebooks.log" ] && tail -n 1 "$OUT/notebooks.log" || echo "notebooks: not run (PART=$PART)"
ran() { [ -f "$OUT/$1" ] && echo "exit $2" || echo "not run (PART=$PART)"; }
echo "demo: $(ran demo.log $demo_rc); doctor: $(ran doctor.log $doctor_rc); benchmark suite: $(ran bench.log $bench_rc); steps: $(ran steps.log $steps_rc)"
[ -f "$OUT/doctor.log" ] && tail -n 12 "$OUT/doctor.log"
[ -n "$PACK" ] && tar -czf "$PACK/check.tgz" -C "$OUT" .
[ $gpu_rc -eq 0 ] && [ $cpu_rc -eq 0 ] && [ $demo_rc -eq 0 ] && [ $doctor_rc -eq 0 ] && [ $nb_rc -eq 0 ] \
    && [ $bench_rc -eq 0 ] && [ $steps_rc -eq 0 ]

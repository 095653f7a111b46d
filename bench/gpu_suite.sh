#!/usr/bin/env bash
# The whole GPU suite in one command, for a machine with a CUDA GPU:
#
#   bench/gpu_suite.sh [OUT_DIR]        (default: gpu-results/<UTC timestamp>)
#
# Writes into OUT_DIR:
#   nvidia-smi.txt                 the device and driver
#   build.json, artifacts/         `ptxc build specs/` (verified with ptxas)
#   launch-test.json               correctness on the device (cuda backend) at launch-test shapes
#   bench/<spec>[_<n>].json        `ptxc bench` per spec at the report shapes (and BENCH_SHAPES)
#   report.json, report.html       static report; the rooflines carry the measured points
#   tune/<spec>.json, tuned/       `ptxc tune` per spec and the tuned tables it wrote
#   summary.md                     markdown tables for docs/performance.md (bench/gpu_summary.py)
#   frontend.md                    bench/frontend.py on this machine
# Environment: PYTHON (default .venv/bin/python, else python3); BENCH_SHAPES, extra --shape
# values separated by spaces (e.g. "batch=64,max_seq_len=8192 batch=1,seq_q=8192,seq_k=8192");
# TUNE=0 skips tuning, TUNE_LIMIT=N caps candidates per key. A failing step is reported and the
# suite goes on; the exit status is 1 if any step failed, 2 at once when there is no GPU.
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PTXC=("$PY" -m ptxc.cli)
OUT=${1:-gpu-results/$(date -u +%Y%m%dT%H%M%SZ)}

if ! "$PY" -c 'import sys; from ptxc.runtime.cuda import available; sys.exit(0 if available() else 2)'; then
    echo "gpu_suite: no usable CUDA device on this machine; run it where there is one" >&2
    exit 2
fi
mkdir -p "$OUT/bench" "$OUT/tune" "$OUT/tuned"
status=0
step() {   # step NAME OUTFILE CMD...: run CMD with stdout to OUTFILE, note a failure and go on
    local name=$1 out=$2
    shift 2
    echo "== $name" >&2
    if ! "$@" > "$out"; then
        echo "gpu_suite: step '$name' failed" >&2
        status=1
    fi
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
step build "$OUT/build.json" "${PTXC[@]}" build specs/ --out "$OUT/artifacts" --json
step launch-test "$OUT/launch-test.json" "${PTXC[@]}" launch-test --backend cuda "$OUT/artifacts" --json
for spec in specs/*.toml; do
    name=$(basename "$spec" .toml)
    step "bench $name" "$OUT/bench/$name.json" "${PTXC[@]}" bench "$spec" --json
    n=0
    for shape in ${BENCH_SHAPES:-}; do
        n=$((n + 1))
        step "bench $name $shape" "$OUT/bench/${name}_$n.json" "${PTXC[@]}" bench "$spec" --shape "$shape" --json
    done
done
measured=()
for f in "$OUT"/bench/*.json; do
    [ -s "$f" ] && measured+=(--measured "$f")
done
step report "$OUT/report.json" "${PTXC[@]}" report "$OUT/artifacts" --json --html "$OUT/report.html" "${measured[@]}"
if [ "${TUNE:-1}" != 0 ]; then
    for spec in specs/*.toml; do
        name=$(basename "$spec" .toml)
        step "tune $name" "$OUT/tune/$name.json" "${PTXC[@]}" tune "$spec" --out "$OUT/tuned" --json \
            ${TUNE_LIMIT:+--limit "$TUNE_LIMIT"}
    done
fi
step summary "$OUT/summary.md" "$PY" bench/gpu_summary.py "$OUT"
step frontend "$OUT/frontend.md" "$PY" bench/frontend.py --repeat 10
echo "gpu_suite: results in $OUT (status $status)" >&2
exit $status

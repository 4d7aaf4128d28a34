#!/usr/bin/env bash
# semcomm GPU check: the CUDA tests (tests/test_cuda.py) and a warm-vs-cold TTFT measurement
# (python -m benchmarks.kv.ttft --lengths 512,2048 --layers 2) on a CUDA machine, in under 6 minutes.
#
# Usage, from the repository root on the GPU machine:   bash tools/gpu_check.sh
#
# The machine is expected to have a Python whose torch sees CUDA and no network: the script
# installs nothing from a registry. It picks the first interpreter whose torch reports CUDA:
# $SEMCOMM_PY, python3, /opt/torch/.venv/bin/python3, .venv/bin/python, python. Wheels found in
# .whl/ (packages the GPU image lacks or has in other versions: cryptography, cffi, pycparser,
# and transformers/regex pinned to the versions CI uses) are installed offline into /tmp and put
# on PYTHONPATH; semcomm itself runs from src/ (no install).
#
# Writes under $OUT (default ./gpu_check_out), at most 7 files:
#   machine.txt          nvidia-smi, interpreter, torch/CUDA/transformers versions
#   pytest.log           pytest -v output of tests/test_cuda.py (CI's transformers)
#   junit.xml            the same run as JUnit XML
#   bench.log            python -m benchmarks.kv.ttft output (tables)
#   bench_kv_ttft_cuda.json   its results (cold vs warm TTFT per tier and codec, on CUDA)
#   pytest_image_transformers.log   tests/test_cuda.py again with the image's own transformers
#                        (only when the wheels pinned another version and time is left)
#   summary.txt          the short summary printed at the end
# Exit status: pytest's (0 when every CUDA test passed); 3 when no CUDA interpreter was found.
# Knobs: OUT, SEMCOMM_PY, GPU_CHECK_SECONDS (time budget, default 340), GPU_CHECK_WHEELS
# (wheel folder, default .whl), SEMCOMM_TEST_DEVICE
# (default cuda; "cpu" dry-runs the whole script on a machine without a GPU).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
DEADLINE=${GPU_CHECK_SECONDS:-340}  # whole script, seconds (the limit is 6 minutes)

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 MPLBACKEND=Agg
export SEMCOMM_TEST_DEVICE="${SEMCOMM_TEST_DEVICE:-cuda}"

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE - SECONDS)); }
# cap WANTED: WANTED seconds, or what is left before the deadline minus a margin
# (never below 5: `timeout 0` would mean no limit at all)
cap() {
    local l=$(($(left) - 15))
    if [ "$l" -lt 5 ]; then l=5; fi
    if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi
}
last_pytest_line() { grep -E '^=+ .*( passed| failed| error| skipped| no tests ran).* in [0-9.]+s' "$1" | tail -1 | tr -d '='; }

note "semcomm GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# -- 1. the machine ---------------------------------------------------------------------------
{
    echo "## uname"; uname -a
    echo "## nvidia-smi"; timeout 30 nvidia-smi 2>&1 || echo "nvidia-smi failed or missing"
    echo "## nvidia-smi query"
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm \
        --format=csv 2>&1 || true
} >"$OUT/machine.txt" 2>&1
note "gpu: $(timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo 'nvidia-smi unavailable')"

# -- 2. an interpreter whose torch sees CUDA ---------------------------------------------------
# SEMCOMM_TEST_DEVICE=cpu is a dry run of this script on a machine without a GPU: any torch will
# do, and the test bodies and the benchmark run on the CPU.
PROBE='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
[ "$SEMCOMM_TEST_DEVICE" = cpu ] && PROBE='import torch'
PY=""
tried=""
for cand in "${SEMCOMM_PY:-}" python3 /opt/torch/.venv/bin/python3 "$ROOT/.venv/bin/python" python; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || continue
    tried="$tried $cand"
    if timeout 90 "$cand" -c "$PROBE" >/dev/null 2>&1; then
        PY=$(command -v "$cand")
        break
    fi
done
if [ -z "$PY" ]; then
    note "FAIL: no Python with a CUDA-enabled torch found (tried:${tried:- nothing})."
    note "A carried .venv holds the CPU build of torch; this machine cannot download another."
    note "Set SEMCOMM_PY=/path/to/python (with CUDA torch) and rerun."
    exit 3
fi
note "python: $PY ($(left)s left)"

# -- 3. carried wheels, installed offline ------------------------------------------------------
# .whl/ pins (transformers, regex, ...) go to one folder, missing dependencies to another, so the
# tests can also run once with the image's own transformers.
PIN_DIR=/tmp/semcomm-pinned
DEP_DIR=/tmp/semcomm-deps
rm -rf "$PIN_DIR" "$DEP_DIR"
mkdir -p "$PIN_DIR" "$DEP_DIR"
pinned=() deps=()
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
for whl in "$WHEELS"/*.whl; do
    [ -e "$whl" ] || continue
    case "$(basename "$whl")" in
        transformers-* | regex-* | huggingface_hub-* | tokenizers-* | safetensors-*) pinned+=("$whl") ;;
        *) deps+=("$whl") ;;
    esac
done
install_to() {  # install_to DIR WHEEL...
    local dir=$1
    shift
    [ "$#" -gt 0 ] || return 0
    timeout "$(cap 90)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$dir" "$@" >>"$OUT/machine.txt" 2>&1 \
        || note "WARN: offline install of $* into $dir failed (see machine.txt)"
}
install_to "$DEP_DIR" "${deps[@]}"
install_to "$PIN_DIR" "${pinned[@]}"
note "wheels: ${#deps[@]} dependencies, ${#pinned[@]} pinned ($(left)s left)"
BASE_PATH="$ROOT/src:$DEP_DIR${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$ROOT/src:$PIN_DIR:$DEP_DIR${PYTHONPATH:+:$PYTHONPATH}"

VERSIONS='
import sys, torch, transformers, numpy
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("transformers", transformers.__version__, transformers.__file__)
print("numpy", numpy.__version__)
import semcomm, semcomm.engine, semcomm.fusion, semcomm.kv, semcomm.security
print("semcomm", semcomm.__version__, semcomm.__file__)
'
{ echo "## versions"; timeout "$(cap 90)" "$PY" -c "$VERSIONS" 2>&1; } >>"$OUT/machine.txt"
if grep -q '^semcomm ' "$OUT/machine.txt"; then
    note "$(grep -E '^(torch|transformers) ' "$OUT/machine.txt" | cut -d' ' -f1-6 | paste -sd';' -)"
else
    note "WARN: semcomm does not import here (see machine.txt); the tests will report why"
fi

# -- 4. the CUDA tests -------------------------------------------------------------------------
PYTEST_TIMEOUT=()
if "$PY" -c 'import pytest_timeout' >/dev/null 2>&1; then PYTEST_TIMEOUT=(-o timeout=120); fi
run_tests() {  # run_tests LOG [JUNIT]: pytest over tests/test_cuda.py; returns pytest's status
    local log=$1 junit=${2:-}
    local args=(-m pytest tests/test_cuda.py -v -rfE -p no:cacheprovider "${PYTEST_TIMEOUT[@]}")
    [ -n "$junit" ] && args+=(--junitxml "$junit")
    timeout "$(cap 210)" "$PY" "${args[@]}" >"$log" 2>&1
    local rc=$?
    [ "$rc" -eq 124 ] && echo "TIMEOUT: pytest was stopped after its time limit" >>"$log"
    return "$rc"
}
run_tests "$OUT/pytest.log" "$OUT/junit.xml"
TEST_RC=$?
note "tests/test_cuda.py (rc $TEST_RC): $(last_pytest_line "$OUT/pytest.log")"
grep -E '^(FAILED|ERROR) ' "$OUT/pytest.log" | head -20 | tee -a "$SUMMARY"
grep -q '^TIMEOUT' "$OUT/pytest.log" && note "pytest TIMED OUT"

# -- 5. warm vs cold TTFT on CUDA --------------------------------------------------------------
if [ "$(left)" -gt 60 ]; then
    timeout "$(cap 150)" "$PY" -m benchmarks.kv.ttft --lengths 512,2048 --layers 2 \
        --json "$OUT/bench_kv_ttft_${SEMCOMM_TEST_DEVICE%%:*}.json" >"$OUT/bench.log" 2>&1
    BENCH_RC=$?
    [ "$BENCH_RC" -eq 124 ] && echo "TIMEOUT: the benchmark was stopped" >>"$OUT/bench.log"
    if [ -s "$OUT/bench_kv_ttft_${SEMCOMM_TEST_DEVICE%%:*}.json" ]; then
        "$PY" - "$OUT/bench_kv_ttft_${SEMCOMM_TEST_DEVICE%%:*}.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"TTFT bench on {r['device']}: {r['model']}, chunk {r['chunk_size']}")
for n, row in r["lengths"].items():
    cold = row["cold_nostore_ttft_ms"]
    parts = []
    for name in ("memory/lossless", "disk/lossless", "memory/int8"):
        w = row["tiers"].get(name)
        if w:
            parts.append(f"{name} {w['ttft_ms']:.2f} ms ({cold / w['ttft_ms']:.1f}x)")
    print(f"  {n:>5} tokens: cold {cold:.2f} ms; warm " + ", ".join(parts))
EOF
    else
        note "benchmarks.kv.ttft wrote no JSON (rc $BENCH_RC; see bench.log)"
    fi
else
    note "benchmarks.kv.ttft skipped: $(left)s left"
fi

# -- 5b. semantic-cache lookup latency at 1M entries on this machine's CPU cores -----------------
# (no GPU involved: a quiet many-core host builds the 1M-entry HNSW graph in a few minutes;
# output appended to bench.log, results in semantic_speed_1m.json)
if [ "${GPU_CHECK_SEMANTIC:-1}" = 1 ] && [ "$(left)" -gt 150 ]; then
    timeout "$(cap 240)" "$PY" -m benchmarks.semantic.speed --sizes 1000000 --lookup-only \
        --queries 1000 --out "$OUT" --json-name semantic_speed_1m.json >>"$OUT/bench.log" 2>&1
    SEM_RC=$?
    if [ -s "$OUT/semantic_speed_1m.json" ]; then
        "$PY" - "$OUT/semantic_speed_1m.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
for n, row in r["sizes"].items():
    h, c = row["index"]["hnsw"], row["cache"]
    print(f"semantic {int(n):,} entries ({r.get('cpu_count')} cores): HNSW p50 {h['p50_ms']:.3f} ms "
          f"p99 {h['p99_ms']:.3f} recall@1 {h['recall@1']:.3f} build {h['build_s']:.0f}s; "
          f"lookup() p50 {c['p50_ms']:.3f} ms p99 {c['p99_ms']:.3f}, {c['inserts_per_s']:,.0f} inserts/s")
EOF
    else
        note "benchmarks.semantic.speed wrote no JSON (rc $SEM_RC; see bench.log)"
    fi
else
    note "semantic 1M lookup skipped: $(left)s left"
fi

# -- 6. the tests again with the image's own transformers (compatibility) ----------------------
if [ "${#pinned[@]}" -gt 0 ] && [ "$(left)" -gt 100 ]; then
    PYTHONPATH="$BASE_PATH" run_tests "$OUT/pytest_image_transformers.log"
    IMG_RC=$?
    img_tf=$(PYTHONPATH="$BASE_PATH" timeout 60 "$PY" -c 'import transformers; print(transformers.__version__)' 2>/dev/null)
    note "with the image's transformers ${img_tf:-?} (rc $IMG_RC): $(last_pytest_line "$OUT/pytest_image_transformers.log")"
    grep -E '^(FAILED|ERROR) ' "$OUT/pytest_image_transformers.log" | head -10 | tee -a "$SUMMARY"
elif [ "${#pinned[@]}" -gt 0 ]; then
    note "second run with the image's transformers skipped: $(left)s left"
fi

note "done in ${SECONDS}s; files in $OUT: $(cd "$OUT" && ls | paste -sd' ' -)"
echo "=================================== summary ==================================="
cat "$SUMMARY"
exit "$TEST_RC"

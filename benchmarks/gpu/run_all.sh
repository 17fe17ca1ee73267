#!/usr/bin/env bash
# Everything dtypeplan checks on a GPU, in one command (under 9 minutes on one H200):
#
#   bash benchmarks/gpu/run_all.sh [--dry-run] [--out DIR] [--wheelhouse DIR] [--skip-install]
#
# 1. install  what a stock CUDA torch image lacks (jsonschema, pyyaml, pytest, hypothesis and
#             their dependencies, numpy if missing; only those that do not import), each with
#             --no-deps so that torch is never touched, then dtypeplan itself (pip install
#             --no-deps -e .). From the package index, or with --wheelhouse DIR from the wheels
#             in DIR (a machine offline).
# 2. tests    the CUDA tests: tests/test_fused_adamw_kernel.py and every test module that asks
#             torch.cuda.is_available(); the log goes to DIR/gpu_tests-<date>.log.
# 3. kernel   python3 -m benchmarks.gpu.bench_fused_step (the Triton kernel at 2^30 parameters).
# 4. lowprec  python3 -m benchmarks.gpu.bench_low_precision_step (the one-pass Triton kernel of
#             the 16-bit cells, each against its bytes floor, checked against the host's
#             eager update bit for bit).
# 5. engine   python3 -m benchmarks.gpu.bench_engine_step (the engine's whole step on a 1B
#             stack against torch.optim.AdamW(fused=True) and the bytes floor).
# 6. offload  python3 -m benchmarks.bench_offload --device cuda (optimizer offload: the step of a
#             100M-parameter stack with masters and states in pinned host memory against the
#             same step on the device, and how much of the copy time the host update hides).
#
# Each step runs under `timeout`; a failing step is recorded and the next one runs. The results
# go to DIR (default benchmarks/results) with dates; the summary is printed at the end and
# written to DIR/gpu_run_all-<date>.md. The exit status is 0 only when every step passed.
#
# Step limits add up to 525 s (install 50, tests 120, kernel 110, lowprec 50, engine 150,
# offload 45).
#
# --dry-run checks the script itself on a CPU in under a minute: no install, the tests are only
# collected, the benchmarks run their --dry-run (tiny sizes on CPU), and DIR defaults to a new
# temporary folder so that no result of the repository is overwritten.

set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dry_run=0
skip_install=0
install_only=0
out=""
wheelhouse=""

usage() {
    sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

while (($#)); do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --skip-install) skip_install=1 ;;
        --install-only) install_only=1 ;; # the install step, run under timeout by the script
        --out) out="${2:?--out needs a folder}"; shift ;;
        --wheelhouse) wheelhouse="${2:?--wheelhouse needs a folder}"; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "run_all.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

if [[ -z "$out" ]]; then
    if ((dry_run)); then out="$(mktemp -d -t dtypeplan-gpu-dry-run.XXXXXX)"; else out="$repo/benchmarks/results"; fi
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$repo" || exit 2
# The checkout's dtypeplan wins over any installed copy, also in the processes tests spawn.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

date_utc="$(date -u +%F)"
python="${PYTHON:-python3}"
summary_rows=()
failures=0
started_all=$SECONDS

# run_step NAME SECONDS COMMAND...: run under timeout, record ok / failed / timed out.
run_step() {
    local name="$1" limit="$2"
    shift 2
    echo
    echo "=== $name (limit ${limit} s): $*"
    local started=$SECONDS
    timeout -k 10 "$limit" "$@"
    local rc=$?
    local took=$((SECONDS - started))
    local status="ok"
    if ((rc == 124 || rc == 137)); then
        status="TIMED OUT after ${limit} s"
    elif ((rc != 0)); then
        status="FAILED (exit $rc)"
    fi
    if [[ "$status" != "ok" ]]; then failures=$((failures + 1)); fi
    summary_rows+=("| $name | $status | $took |")
    echo "=== $name: $status in ${took} s"
}

skip_step() {
    summary_rows+=("| $1 | skipped: $2 | 0 |")
    echo
    echo "=== $1: skipped ($2)"
}

install() {
    # import name -> distribution; only the missing ones are installed, all with --no-deps.
    local wanted=(
        jsonschema:jsonschema yaml:pyyaml attrs:attrs referencing:referencing rpds:rpds-py
        jsonschema_specifications:jsonschema-specifications typing_extensions:typing-extensions
        numpy:numpy pytest:pytest iniconfig:iniconfig pluggy:pluggy packaging:packaging
        pygments:pygments hypothesis:hypothesis sortedcontainers:sortedcontainers
    )
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        wanted+=(exceptiongroup:exceptiongroup tomli:tomli)
    fi
    local missing=() pair
    for pair in "${wanted[@]}"; do
        "$python" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
    done
    local source=()
    if [[ -n "$wheelhouse" ]]; then source=(--no-index --find-links "$wheelhouse"); fi
    if ((${#missing[@]})); then
        echo "installing (--no-deps): ${missing[*]}"
        "$python" -m pip install --quiet --no-deps "${source[@]}" "${missing[@]}" || return 1
    else
        echo "nothing missing"
    fi
    # Editable; build isolation fetches a current setuptools from the index, and without it
    # (offline) the installed one must do. PYTHONPATH above makes the checkout importable even
    # where both fail, so that only warns.
    "$python" -m pip install --quiet --no-deps "${source[@]}" -e . ||
        "$python" -m pip install --quiet --no-deps --no-build-isolation -e . ||
        echo "warning: pip install -e . failed; dtypeplan is imported through PYTHONPATH"
    "$python" -c 'import dtypeplan, jsonschema, yaml, pytest, hypothesis; print("imports ok")'
}

if ((install_only)); then
    install
    exit
fi

# Test modules that need CUDA: the kernel's, and any other that asks torch for CUDA.
mapfile -t cuda_tests < <(
    { echo tests/test_fused_adamw_kernel.py; grep -l -E 'cuda\.is_available|device_count\(\)' tests/test_*.py; } |
        sort -u
)

echo "dtypeplan GPU run: $repo -> $out (dry run: $dry_run)"
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if ((dry_run)); then
    skip_step install "dry run"
    run_step tests 60 "$python" -m pytest -q --collect-only "${cuda_tests[@]}"
    run_step kernel 60 "$python" -m benchmarks.gpu.bench_fused_step --dry-run --out "$out"
    run_step lowprec 60 "$python" -m benchmarks.gpu.bench_low_precision_step --dry-run --out "$out"
    run_step engine 60 "$python" -m benchmarks.gpu.bench_engine_step --dry-run --out "$out"
    run_step offload 60 "$python" -m benchmarks.bench_offload --device cpu --dry-run --out "$out"
else
    if ((skip_install)); then
        skip_step install "--skip-install"
    else
        from_wheels=()
        if [[ -n "$wheelhouse" ]]; then from_wheels=(--wheelhouse "$wheelhouse"); fi
        run_step install 50 bash "${BASH_SOURCE[0]}" --install-only "${from_wheels[@]}"
    fi
    tests_log="$out/gpu_tests-$date_utc.log"
    # shellcheck disable=SC2016  # expanded by the inner bash, which gets them as arguments
    run_step tests 120 bash -o pipefail -c '"$0" -m pytest -q -rs "${@:2}" 2>&1 | tee "$1"' \
        "$python" "$tests_log" "${cuda_tests[@]}"
    run_step kernel 110 "$python" -m benchmarks.gpu.bench_fused_step --out "$out"
    run_step lowprec 50 "$python" -m benchmarks.gpu.bench_low_precision_step --out "$out"
    run_step engine 150 "$python" -m benchmarks.gpu.bench_engine_step --out "$out"
    run_step offload 45 "$python" -m benchmarks.bench_offload --device cuda --out "$out"
fi

summary="$out/gpu_run_all-$date_utc.md"
{
    echo "# gpu run_all ($date_utc)"
    echo
    echo "- command: \`bash benchmarks/gpu/run_all.sh$( ((dry_run)) && echo ' --dry-run')\`, $((SECONDS - started_all)) s in all"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- CUDA test modules: ${cuda_tests[*]}"
    echo
    echo "| step | status | seconds |"
    echo "| --- | --- | --- |"
    printf '%s\n' "${summary_rows[@]}"
    echo
    echo "Results in this folder: gpu_fused_step*-$date_utc.{json,md}, gpu_low_precision_step*-$date_utc.{json,md}, gpu_engine_step*-$date_utc.{json,md}, gpu_offload*-$date_utc.{json,md}."
} >"$summary"
echo
echo "=== summary ($summary)"
cat "$summary"
exit $((failures > 0))

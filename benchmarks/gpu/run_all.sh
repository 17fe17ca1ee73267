#!/usr/bin/env bash
# Everything dtypeplan checks on a GPU, in one command, on a bare machine (under 10 minutes on
# one H200, the install included):
#
#   bash benchmarks/gpu/run_all.sh [--out DIR] [--wheelhouse DIR] [--skip-install]
#   DRY_RUN=1 bash benchmarks/gpu/run_all.sh      (or --dry-run: print and check, run nothing)
#   bash benchmarks/gpu/run_all.sh --cpu-run      (every step at a tiny size on the CPU)
#
# 1. install  CUDA torch==2.13.0 (with its CUDA libraries and Triton) where the Python has no
#             CUDA build of that release, torchao==0.18.0 where it is missing (--no-deps: it
#             builds against whatever torch is there), then what else the steps import
#             (jsonschema, pyyaml, pytest, hypothesis, ...; only those that do not import, each
#             --no-deps so that torch is never touched) and dtypeplan itself (pip install
#             --no-deps -e .). From pip's configured index (PIP_INDEX_URL or pip config), else
#             its default, PyPI, whose Linux x86_64 torch wheel is the CUDA build; torch and
#             torchao from TORCH_INDEX_URL where set (e.g. https://download.pytorch.org/whl/cu128);
#             with --wheelhouse DIR from the wheels in DIR (a machine offline).
# 2. smoke    python3 -m benchmarks.gpu.smoke_engine: every update kernel from a fresh
#             optimizer, 3 steps from step 1 under torch.cuda.set_sync_debug_mode("error"), the
#             bits against the host path where a kernel claims them, memory against
#             plan.memory().
# 3. zero3    python3 -m benchmarks.gpu.zero3_one_rank: ZeRO-3 with bf16 masters on one rank of
#             an NCCL group bound to the GPU, the model built on the CPU.
# 4. tests    only the tests that need CUDA (DTYPEPLAN_CUDA_TESTS_ONLY=1: those whose skip
#             reason names CUDA); the log goes to DIR/gpu_tests-<date>.log.
# 5. kernel   python3 -m benchmarks.gpu.bench_fused_step --numel 2^28 (the fp32 Triton kernel).
# 6. lowprec  python3 -m benchmarks.gpu.bench_low_precision_step --numel 2^28 (the one-pass
#             Triton kernel of the 16-bit cells against its bytes floor, and its bits).
# 7. multichunk python3 -m benchmarks.gpu.bench_multi_chunk_step --ranks 8,64 (the multi-chunk
#             kernels on a 7B Llama's chunks of one rank of 8 and of 64, one launch against a
#             launch per chunk, the bytes floor and torch's fused AdamW on the same tensors;
#             the bits against the single-chunk kernel; the first step's table build).
# 8. engine   python3 -m benchmarks.gpu.bench_engine_step --blocks 8 (the engine's whole step
#             on a 0.27B stack against torch.optim.AdamW(fused=True) and the bytes floor).
# 9. offload  python3 -m benchmarks.bench_offload --device cuda (the step of a 100M-parameter
#             stack with masters and states in pinned host memory).
#
# Each step runs under `timeout` (limits add up to 590 s: install 180, smoke 90, zero3 45,
# tests 60, kernel 55, lowprec 45, multichunk 35, engine 50, offload 30; the fp8 step last,
# in what the others leave), and never past the whole run's budget (RUN_ALL_BUDGET_S, default
# 590 s: a step that would start with under 15 s left is skipped, one that would outlast it
# gets what is left). A failing step is recorded and the
# next one runs. DIR/gpu_run_all-<date>.json is rewritten as each step ends (a run cut short
# keeps what it did); the summary, with the paths a single GPU cannot reach, is printed at the
# end and written to DIR/gpu_run_all-<date>.md. The exit status is 0 only when every step passed.
#
# DRY_RUN=1 (--dry-run) runs nothing: it prints each step's command, the install commands this
# Python would need (pinned versions and the index URL), and checks that each Python entry
# point imports and parses its arguments (--check-args; pytest collects). With --install-only
# it prints the install commands alone (no torch needed: the bare-machine check).
# --cpu-run runs every step at a tiny size on the CPU (no install; the tests only collected).
# Both default DIR to a new temporary folder so that no result of the repository is replaced.

set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dry_run=0
if [[ "${DRY_RUN:-0}" != "0" && -n "${DRY_RUN:-}" ]]; then dry_run=1; fi
cpu_run=0
skip_install=0
install_only=0
out=""
wheelhouse=""

TORCH_PIN="torch==2.13.0"
TORCHAO_PIN="torchao==0.18.0"

usage() {
    sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

while (($#)); do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --cpu-run) cpu_run=1 ;;
        --skip-install) skip_install=1 ;;
        --install-only) install_only=1 ;; # the install step, run under timeout by the script
        --out) out="${2:?--out needs a folder}"; shift ;;
        --wheelhouse) wheelhouse="${2:?--wheelhouse needs a folder}"; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "run_all.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
if ((dry_run && cpu_run)); then echo "run_all.sh: --dry-run and --cpu-run exclude each other" >&2; exit 2; fi

python="${PYTHON:-python3}"

# pip_index: the index pip is set to use (PIP_INDEX_URL, pip config), or its default, PyPI.
pip_index() {
    if [[ -n "${PIP_INDEX_URL:-}" ]]; then echo "$PIP_INDEX_URL"; return; fi
    local configured
    configured="$("$python" -m pip config get global.index-url 2>/dev/null || true)"
    echo "${configured:-https://pypi.org/simple, the default}"
}

# pip_install ARGS...: run pip (or, in a dry run, print the command it would run).
pip_install() {
    if ((dry_run)); then
        echo "would run: $python -m pip install $*"
        return 0
    fi
    echo "running: $python -m pip install $*"
    # A system Python marked externally managed (PEP 668) takes the packages anyway: the GPU
    # machine is a throwaway one.
    PIP_BREAK_SYSTEM_PACKAGES=1 "$python" -m pip install --quiet "$@"
}

install() {
    # pip reads its own index settings; torch (and torchao) may come from TORCH_INDEX_URL.
    local source=() torch_source=()
    if [[ -n "$wheelhouse" ]]; then
        source=(--no-index --find-links "$wheelhouse")
        torch_source=("${source[@]}")
        echo "index: none, the wheels in $wheelhouse"
    elif [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        torch_source=(--index-url "$TORCH_INDEX_URL")
        echo "index: $TORCH_INDEX_URL for torch and torchao, $(pip_index) for the rest"
    else
        echo "index: $(pip_index)"
    fi
    echo "python: $("$python" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    if ! "$python" -m pip --version >/dev/null 2>&1; then
        if ((dry_run)); then echo "would run: $python -m ensurepip --upgrade"; else "$python" -m ensurepip --upgrade || return 1; fi
    fi
    # CUDA torch of the pinned release: a CPU build, another release or none is replaced.
    if "$python" -c "import sys, torch; sys.exit(not (torch.__version__.split('+')[0] == '${TORCH_PIN#torch==}' and torch.version.cuda))" 2>/dev/null; then
        echo "torch: $("$python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)') present"
    else
        echo "torch: no CUDA build of ${TORCH_PIN#torch==} here; installing it"
        pip_install "${torch_source[@]}" "$TORCH_PIN" || return 1
    fi
    if "$python" -c "import sys, importlib.metadata as m; sys.exit(m.version('torchao') != '${TORCHAO_PIN#torchao==}')" 2>/dev/null; then
        echo "torchao: present"
    else
        pip_install --no-deps "${torch_source[@]}" "$TORCHAO_PIN" || return 1
    fi
    # import name -> distribution; only the missing ones are installed, all with --no-deps.
    local wanted=(
        jsonschema:jsonschema yaml:pyyaml attrs:attrs referencing:referencing rpds:rpds-py
        jsonschema_specifications:jsonschema-specifications typing_extensions:typing-extensions
        numpy:numpy pytest:pytest iniconfig:iniconfig pluggy:pluggy packaging:packaging
        pygments:pygments hypothesis:hypothesis sortedcontainers:sortedcontainers
    )
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        wanted+=(exceptiongroup:exceptiongroup tomli:tomli)
    fi
    local missing=() pair
    for pair in "${wanted[@]}"; do
        "$python" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
    done
    if ((${#missing[@]})); then
        pip_install --no-deps "${source[@]}" "${missing[@]}" || return 1
    else
        echo "nothing else missing"
    fi
    # Editable; build isolation fetches a current setuptools from the index, and without it
    # (offline) the installed one must do. PYTHONPATH below makes the checkout importable even
    # where both fail, so that only warns.
    if ((dry_run)); then
        echo "would run: $python -m pip install --no-deps -e ."
        return 0
    fi
    pip_install --no-deps "${source[@]}" -e . ||
        pip_install --no-deps --no-build-isolation -e . ||
        echo "warning: pip install -e . failed; dtypeplan is imported through PYTHONPATH"
    "$python" -c 'import torch, torchao, triton, dtypeplan, jsonschema, yaml, pytest, hypothesis; print("imports ok: torch", torch.__version__, "cuda", torch.version.cuda)'
}

cd "$repo" || exit 2
if ((install_only)); then
    install
    exit
fi

if [[ -z "$out" ]]; then
    if ((dry_run || cpu_run)); then out="$(mktemp -d -t dtypeplan-gpu-dry-run.XXXXXX)"; else out="$repo/benchmarks/results"; fi
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
# The checkout's dtypeplan wins over any installed copy, also in the processes tests spawn.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

date_utc="$(date -u +%F)"
budget="${RUN_ALL_BUDGET_S:-590}"
summary_rows=()
json_steps=()
failures=0
started_all=$SECONDS
json="$out/gpu_run_all-$date_utc.json"
mode="gpu"
if ((dry_run)); then mode="dry run"; elif ((cpu_run)); then mode="cpu run"; fi

write_json() {
    local joined
    joined="$(IFS=,; echo "${json_steps[*]}")"
    printf '{"benchmark": "gpu_run_all", "date": "%s", "mode": "%s", "commit": "%s", "elapsed_s": %d, "steps": [%s]}\n' \
        "$date_utc" "$mode" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
        $((SECONDS - started_all)) "$joined" >"$json"
}

record() { # NAME STATUS SECONDS LIMIT
    summary_rows+=("| $1 | $2 | $3 | $4 |")
    json_steps+=("{\"step\": \"$1\", \"status\": \"$2\", \"seconds\": $3, \"limit_s\": $4}")
    write_json
}

# run_step NAME SECONDS COMMAND...: run under timeout (within the budget), record the outcome.
run_step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((budget - (SECONDS - started_all)))
    if ((left < 15)); then
        echo "=== $name: skipped (the run's ${budget} s budget is spent)"
        failures=$((failures + 1))
        record "$name" "skipped: no time left" 0 "$limit"
        return
    fi
    if ((limit > left)); then limit=$left; fi
    echo
    echo "=== $name (limit ${limit} s): $*"
    if ((dry_run)); then
        record "$name" "printed" 0 "$limit"
        return
    fi
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
    record "$name" "$status" "$took" "$limit"
    echo "=== $name: $status in ${took} s"
}

# check_entry NAME COMMAND...: (dry run) the entry point imports and parses its arguments.
check_entry() {
    local name="$1"
    shift
    if "$@" >"$out/check-$name.log" 2>&1; then
        grep -E '^(ok|FAILED) |collected' "$out/check-$name.log" | sed "s/^/    $name: /"
    else
        echo "    $name: FAILED to import or parse its arguments:"
        tail -n 20 "$out/check-$name.log" | sed 's/^/      /'
        failures=$((failures + 1))
        summary_rows+=("| $name | entry point FAILED | 0 | 0 |")
        json_steps+=("{\"step\": \"$name\", \"status\": \"entry point FAILED\", \"seconds\": 0, \"limit_s\": 0}")
        write_json
    fi
}

skip_step() {
    echo
    echo "=== $1: skipped ($2)"
    record "$1" "skipped: $2" 0 0
}

# Test modules with a test that needs CUDA (a skip reason naming it); conftest keeps only those.
mapfile -t cuda_tests < <(grep -l -E 'reason=.*CUDA' tests/test_*.py | sort -u)
numel=$((1 << 28))

echo "dtypeplan GPU run: $repo -> $out ($mode)"
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>/dev/null ||
    echo "torch: not importable yet (the install step brings it)"
gpus=0
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi

tests_log="$out/gpu_tests-$date_utc.log"
if ((cpu_run)); then
    skip_step install "cpu run"
    run_step smoke 60 "$python" -m benchmarks.gpu.smoke_engine --dry-run --out "$out"
    run_step zero3 60 "$python" -m benchmarks.gpu.zero3_one_rank --dry-run --out "$out"
    run_step tests 60 env DTYPEPLAN_CUDA_TESTS_ONLY=1 "$python" -m pytest -q -p no:cacheprovider --collect-only "${cuda_tests[@]}"
    run_step kernel 60 "$python" -m benchmarks.gpu.bench_fused_step --dry-run --out "$out"
    run_step lowprec 60 "$python" -m benchmarks.gpu.bench_low_precision_step --dry-run --out "$out"
    run_step multichunk 60 "$python" -m benchmarks.gpu.bench_multi_chunk_step --dry-run --out "$out"
    run_step engine 60 "$python" -m benchmarks.gpu.bench_engine_step --dry-run --out "$out"
    run_step offload 60 "$python" -m benchmarks.bench_offload --device cpu --dry-run --out "$out"
    run_step fp8 120 "$python" -m benchmarks.gpu.bench_fp8_step --dry-run --out "$out"
else
    if ((skip_install)); then
        skip_step install "--skip-install"
    elif ((dry_run)); then
        echo
        echo "=== install (limit 180 s): the commands this Python needs"
        install || failures=$((failures + 1))
        record install "printed" 0 180
    else
        from_wheels=()
        if [[ -n "$wheelhouse" ]]; then from_wheels=(--wheelhouse "$wheelhouse"); fi
        run_step install 180 bash "${BASH_SOURCE[0]}" --install-only "${from_wheels[@]}"
    fi
    run_step smoke 90 "$python" -m benchmarks.gpu.smoke_engine --out "$out"
    run_step zero3 45 "$python" -m benchmarks.gpu.zero3_one_rank --out "$out"
    # shellcheck disable=SC2016  # expanded by the inner bash, which gets them as arguments
    run_step tests 60 bash -o pipefail -c 'DTYPEPLAN_CUDA_TESTS_ONLY=1 "$0" -m pytest -q -rs -p no:cacheprovider "${@:2}" 2>&1 | tee "$1"' \
        "$python" "$tests_log" "${cuda_tests[@]}"
    run_step kernel 55 "$python" -m benchmarks.gpu.bench_fused_step --numel "$numel" --out "$out"
    run_step lowprec 45 "$python" -m benchmarks.gpu.bench_low_precision_step --numel "$numel" --out "$out"
    run_step multichunk 35 "$python" -m benchmarks.gpu.bench_multi_chunk_step --ranks 8,64 --out "$out"
    run_step engine 50 "$python" -m benchmarks.gpu.bench_engine_step --blocks 8 --out "$out"
    run_step offload 30 "$python" -m benchmarks.bench_offload --device cuda --out "$out"
    # Last: its compiles are the least certain cost; the budget cuts it before the others.
    run_step fp8 180 "$python" -m benchmarks.gpu.bench_fp8_step --out "$out"
    if ((dry_run)); then
        echo
        echo "=== entry points (import, parse the arguments above)"
        check_entry modules "$python" -m benchmarks.gpu.check_entry_points \
            "benchmarks.gpu.smoke_engine --out $out" \
            "benchmarks.gpu.zero3_one_rank --out $out" \
            "benchmarks.gpu.bench_fused_step --numel $numel --out $out" \
            "benchmarks.gpu.bench_low_precision_step --numel $numel --out $out" \
            "benchmarks.gpu.bench_multi_chunk_step --ranks 8,64 --out $out" \
            "benchmarks.gpu.bench_engine_step --blocks 8 --out $out" \
            "benchmarks.bench_offload --device cuda --out $out" \
            "benchmarks.gpu.bench_fp8_step --out $out"
        check_entry tests env DTYPEPLAN_CUDA_TESTS_ONLY=1 "$python" -m pytest -q -p no:cacheprovider --collect-only "${cuda_tests[@]}"
    fi
fi

summary="$out/gpu_run_all-$date_utc.md"
{
    echo "# gpu run_all ($date_utc, $mode)"
    echo
    echo "- command: \`bash benchmarks/gpu/run_all.sh\` ($mode), $((SECONDS - started_all)) s in all (budget ${budget} s)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- GPUs: $gpus; CUDA test modules: ${cuda_tests[*]}"
    echo
    echo "| step | status | seconds | limit s |"
    echo "| --- | --- | --- | --- |"
    printf '%s\n' "${summary_rows[@]}"
    echo
    if ((gpus < 2)); then
        echo "## What one GPU cannot reach"
        echo
        echo "With $gpus GPU(s) no collective carries data between devices: at one rank NCCL's"
        echo "all-gathers, reduce-scatters and all-reduces are copies. Not run here:"
        echo
        echo "- ZeRO 1-3 across ranks: the gradient reduce-scatter / all-reduce, the parameter all-gather, and their overlap with backward;"
        echo "- hybrid layouts (shard_group_size below the world): the shard and replica subgroups made under the device-bound default group (comm/_groups.py), HSDP's all-reduce across groups and its wait off the compute stream;"
        echo "- the int8 / fp8 block-quantized wire across ranks, and the checks that every rank holds the same plan;"
        echo "- pipeline parallelism (stages on different GPUs) and tests/test_hot_path.py's NCCL variant (it needs two GPUs, else it runs on gloo);"
        echo "- multi-node links: the inter-node bandwidth the across-groups traffic figures assume."
        echo
    else
        echo "$gpus GPUs are present, but every step here runs one rank: the multi-rank paths (ZeRO 1-3 across ranks, hybrid layouts, the quantized wire, pipeline stages) are not run by this script."
        echo
    fi
    echo "Results in this folder: gpu_smoke_engine*, gpu_zero3_one_rank*, gpu_fused_step*, gpu_low_precision_step*, gpu_multi_chunk_step*, gpu_engine_step*, offload* (-$date_utc.{json,md}), gpu_tests-$date_utc.log, and gpu_run_all-$date_utc.json (rewritten as each step ends)."
} >"$summary"
write_json
echo
echo "=== summary ($summary)"
cat "$summary"
exit $((failures > 0))

#!/usr/bin/env bash
# Run the GPU test suite and the GPU benchmarks on a bare GPU machine with no network.
#
#   benchmarks/gpu_run.sh OUT_DIR [tests|bench|scale|all]     (default: tests)
#   benchmarks/gpu_run.sh OUT_DIR scale --tiny                 (the CPU rehearsal of scale)
#
# `tests` and `bench` are meant as two device calls, each with its own time limit (a device
# command runs at most 10 minutes): the suite first, then the benchmark on the warm machine,
# which reuses .gpuvenv and the JIT-built DeepSpeed ops (TORCH_EXTENSIONS_DIR in the repo).
#
# From the repo root of a copy of the working tree that includes wheels/ (filled by
# benchmarks/gpu_wheels.sh where PyPI is reachable), e.g. through the device tool:
# command `benchmarks/gpu_run.sh "$OUT"` with carry ["wheels"].
#
# Steps (each logged to OUT_DIR/<step>.log; a failed step does not stop the others):
#   machine     nvidia-smi, torch/CUDA versions and devices -> OUT_DIR/machine.txt    (both)
#   venv        .gpuvenv with --system-site-packages (the machine's torch/transformers),  (both;
#               test needs from wheels/ (pip --no-index), zerotier built editable   bench reuses
#               offline, both native libraries must report "loaded"               a working one)
#   pytest      python -m pytest -m cuda -> OUT_DIR/junit-cuda.xml                      (tests)
#               A stuck test fails alone: pytest-timeout, PYTEST_TIMEOUT s per test (default
#               150, signal method: the session goes on). The step's own limit stops pytest
#               with SIGINT, so pytest still writes the junit xml of every test that ran.
#   bench_*     zerotier bench pcie/mem/adam/step/io --quick -> OUT_DIR/bench_node.json (tests)
#   cpu_adam    bench_cpu_adam.py --states-only: each state dtype's GB/s beside the host's   (tests)
#               STREAM copy/triad in the same rounds (issue 36 item 5) -> OUT_DIR/cpu_adam.log
#   bench_deps  deepspeed (no ops: JIT-built when used) and torchao from wheels/        (bench)
#   ds_ops      DeepSpeed's CPU Adam op JIT-built (kept in .gpu_torch_extensions) before    (scale)
#               the list, so that no case's time limit is spent compiling it
#   scale       bench_gpu.py --cases $SCALE_CASES --out OUT_DIR/scale: issue 36's priority   (scale)
#               list in one table (bench_gpu.md, rewritten after every case), within
#               SCALE_SECONDS (default 540, passed on as --time-limit): 7B's exact zerotier
#               cases against ds-z2-offload and torchao with gradient offload, then 20B compact
#               (zt-compact-auto), then the rest, then issue 34's optimizer.step_on = cpu / device /
#               auto cases (7B exact and compact on host, 20B compact `auto`, 20B exact: n/a with
#               its needs); 1 warm-up + 2 timed steps, no torch.profiler
#               steps. With --tiny (the rehearsal, CI: tests/test_bench_gpu.py) the same list
#               runs at bench_gpu's tiny size on the CPU with $PYTHON, no venv or peers: every
#               step of this script, bench_gpu, the cases and predict_table.py, not a result.
#   bench_gpu   benchmarks/bench_gpu.py --out OUT_DIR/bench_gpu $BENCH_GPU_ARGS        (bench)
#               (bench_gpu.json, bench_gpu.md, cases.log), its own limit GPU_BENCH_SECONDS
#               (default 420), passed on as --time-limit so the table is written before it;
#               each case has its own limit too (--case-timeout). With wheels/libaio (from
#               gpu_wheels.sh) the compiler finds libaio, so DeepSpeed's async_io op builds
#               (ZeRO-Infinity); without it that row reads n/a.
# then OUT_DIR/summary.txt: exit code and duration per step, pytest counts.
# Every step runs under `timeout`; the whole run ends within GPU_RUN_SECONDS (default 570).
# Exit code: 0 if every step passed (a missing bench_gpu.py counts as skipped), else 1.
# e.g. the 7B comparison (optimizer on host) as its own call:
#   BENCH_GPU_ARGS="--size 7b --cases zt-opt-host,zt-opt-host-early,ds-z2-offload,torchao-offload" \
#       benchmarks/gpu_run.sh "$OUT" bench
#
# Environment: PYTHON (default python3) is the interpreter whose packages are reused.
# If PYTHON belongs to a virtualenv (local testing on a machine whose python3 has no torch,
# e.g. PYTHON=/work/main/.venv/bin/python), its site-packages are added to .gpuvenv by a
# .pth file, since --system-site-packages only reaches the base interpreter's packages.
set -u

USAGE="usage: benchmarks/gpu_run.sh OUT_DIR [tests|bench|scale|all] [--tiny]"
OUT="${1:?$USAGE}"
MODE="${2:-tests}"
TINY="${3:-}"
case "$MODE" in tests|bench|scale|all) ;; *) echo "$USAGE" >&2; exit 2 ;; esac
case "$TINY" in "") ;; --tiny) [[ "$MODE" == scale ]] || { echo "--tiny goes with scale" >&2; exit 2; } ;;
    *) echo "$USAGE" >&2; exit 2 ;; esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
mkdir -p "$OUT" || exit 1
OUT="$(cd "$OUT" && pwd)"

export OUT ROOT
export PYTHON="${PYTHON:-python3}"
export WHEELS="$ROOT/wheels"
export VENV="$ROOT/.gpuvenv"
export VPY="$VENV/bin/python"
[[ -n "$TINY" ]] && VPY="$PYTHON"   # the rehearsal: this machine's interpreter, no venv
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONUNBUFFERED=1
# `zerotier bench` saves here, not in ~/.cache; in the repo so that the bench call on the warm
# machine plans with the rates the tests call measured (copied to OUT_DIR/bench_node.json)
export ZEROTIER_BENCH_FILE="$ROOT/.gpu_bench_node.json"
export TORCH_EXTENSIONS_DIR="$ROOT/.gpu_torch_extensions"  # DeepSpeed's JIT ops survive between calls
export PYTEST_TIMEOUT="${PYTEST_TIMEOUT:-150}"

RUN_START=$(date +%s)
DEADLINE=$((RUN_START + ${GPU_RUN_SECONDS:-570}))
FAILED=0
SUMMARY=()

# step NAME BUDGET_S FUNCTION [SIGNAL]: run FUNCTION under timeout (its budget, capped by the
# time left), log to OUT/NAME.log, record exit code and duration. At the limit `timeout` sends
# SIGNAL (default TERM) to the step's process group, and KILL 20 s later.
step() {
    local name="$1" budget="$2" fn="$3" sig="${4:-TERM}" log="$OUT/$1.log"
    local left=$((DEADLINE - $(date +%s) - 5))
    (( budget > left )) && budget=$left
    if (( budget < 10 )); then
        echo "not started: no time left" >"$log"
        SUMMARY+=("$(printf '%-12s rc=%-4s %4ss  not started: no time left' "$name" 124 0)")
        FAILED=1
        return
    fi
    echo "== $name (budget ${budget}s)"
    local t0=$(date +%s)
    STEP_BUDGET=$budget timeout -s "$sig" --kill-after=20 "$budget" bash -c "$fn" >"$log" 2>&1
    local rc=$? dt=$(($(date +%s) - t0)) note=""
    if (( rc == 124 || rc == 137 )); then note="  timed out after ${budget}s"; fi
    if (( rc == 99 )); then note="  skipped: $(tail -n 1 "$log")"; rc=0; fi
    echo "exit code: $rc" >>"$log"
    (( rc != 0 )) && FAILED=1
    SUMMARY+=("$(printf '%-12s rc=%-4s %4ss%s' "$name" "$rc" "$dt" "$note")")
    echo "   rc=$rc ${dt}s$note"
}

vpip() { "$VPY" -m pip install --no-index --find-links "$WHEELS" "$@"; }

machine() {
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "host: $(uname -srm)"
        if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
        command -v nvcc >/dev/null && nvcc --version | tail -n 2
        "$PYTHON" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.1f} GiB sm_{p.major}{p.minor}")
EOF
    } 2>&1 | tee "$OUT/machine.txt"
    return "${PIPESTATUS[0]}"
}

venv() {
    set -e
    if [[ "$MODE" =~ ^(bench|scale)$ && -x "$VPY" ]] && "$VPY" -c 'import zerotier, pytest' 2>/dev/null; then
        echo "reusing $VENV (built by the tests call)"; return 0
    fi
    "$PYTHON" -m venv --clear --system-site-packages "$VENV" \
        || { "$PYTHON" -m venv --clear --without-pip --system-site-packages "$VENV"
             "$VPY" "$(ls "$WHEELS"/pip-*.whl | head -n 1)/pip" install --no-index --find-links "$WHEELS" pip; }
    # PYTHON inside a virtualenv: make that virtualenv's packages visible too (see header).
    "$PYTHON" - "$VPY" <<'EOF'
import pathlib, site, subprocess, sys
if sys.prefix != sys.base_prefix:
    target = subprocess.check_output([sys.argv[1], "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    pathlib.Path(target, "_gpu_run_base_venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    print("added", site.getsitepackages(), "to", target)
EOF
    vpip "setuptools>=64" wheel
    vpip crc32c pytest pytest-timeout pyyaml "tomli; python_version < '3.11'" numpy psutil py-cpuinfo tqdm
    vpip --no-build-isolation --no-deps -e .
    "$VPY" - <<'EOF'
import sys, torch
import zerotier, zerotier._native as n
print("torch", torch.__version__, "from", torch.__file__)
assert not torch.__file__.startswith(sys.prefix + "/"), "torch was installed into .gpuvenv: the machine's torch must be reused"
print("zerotier from", zerotier.__file__)
status = n.status()
print(status)
sys.exit(0 if all(v == "loaded" for v in status.values()) else 1)
EOF
}

bench_deps() {
    set -e
    if "$VPY" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("deepspeed") and u.find_spec("torchao")))'; then
        echo "deepspeed and torchao already in $VENV (an earlier bench call)"; return 0
    fi
    vpip deepspeed
    vpip --no-deps torchao
    "$VPY" -c 'import deepspeed, torchao; print("deepspeed", deepspeed.__version__, "torchao", torchao.__version__)'
}

ds_ops() {
    "$VPY" -c 'from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False); print("CPUAdamBuilder: loaded")'
}

# exec: pytest itself gets the step's SIGINT, ends the session and writes the xml; SIGINT is
# handled even where the caller started this script with it ignored (a background job).
run_pytest() {
    exec "$VPY" -c 'import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main(sys.argv[1:]))' -m cuda -v -rA --junitxml "$OUT/junit-cuda.xml" \
        -p timeout --timeout "$PYTEST_TIMEOUT" --timeout-method signal
}

cpu_adam_roofline() { "$VPY" benchmarks/bench_cpu_adam.py --states-only --repeats 5; }

node_bench() {  # zerotier bench SECTION --quick, saved to $ZEROTIER_BENCH_FILE
    local dir="$(mktemp -d "$ROOT/.gpu_bench.XXXX")"
    "$VPY" -m zerotier.cli bench "$1" --quick --path "$dir"
    local rc=$?
    rm -rf "$dir"
    return $rc
}

# libaio carried by gpu_wheels.sh: CFLAGS/LDFLAGS for DeepSpeed's is_compatible() probe (it compiles
# with them), CPATH/LIBRARY_PATH for the JIT build (torch's ninja build ignores CFLAGS/LDFLAGS; gcc
# reads these for -laio), LD_LIBRARY_PATH to load the built op (it has no rpath; the loader reads the
# variable when the process starts, so it is set here, before python).
libaio_env() {
    local aio="$WHEELS/libaio"
    if [[ ! -f "$aio/include/libaio.h" ]]; then
        echo "libaio: not carried (run benchmarks/gpu_wheels.sh): ZeRO-Infinity will be n/a"; return 0
    fi
    export CFLAGS="-I$aio/include ${CFLAGS:-}" LDFLAGS="-L$aio/lib ${LDFLAGS:-}"
    export CPATH="$aio/include${CPATH:+:$CPATH}" LIBRARY_PATH="$aio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$aio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "libaio: $aio"
}

bench_gpu() {
    if [[ ! -f benchmarks/bench_gpu.py ]]; then
        echo "benchmarks/bench_gpu.py missing"
        return 99
    fi
    libaio_env
    # exec: the step's SIGINT reaches bench_gpu.py itself, which stops its case and writes the table
    # word splitting of BENCH_GPU_ARGS is intended (several options)
    # shellcheck disable=SC2086
    exec "$VPY" benchmarks/bench_gpu.py --out "$OUT/bench_gpu" --time-limit $((STEP_BUDGET - 15)) ${BENCH_GPU_ARGS:-}
}

# issue 36's priority list ([Note: the workload] in benchmarks/gpu_model.py; predictions: predict_table.py)
SCALE_FIRST="7b:zt-opt-host,7b:ds-z2-offload,7b:torchao-offload-grads,7b:zt-opt-host-early,7b:zt-opt-host-spec,7b:zt-opt-host-delayed"
SCALE_THEN="20b:zt-compact-auto"
SCALE_REST="7b:zt-compact-host,7b:zt-params-host,13b:zt-compact-auto,13b:ds-z2-offload,7b:ds-z3-offload,7b:torchao-offload,7b:ds-zenflow,2.7b:zt-compact-nvme,2.7b:ds-infinity,30b:zt-compact-auto,7b:zt-opt-split"
# issue 34: where the optimizer's update runs (optimizer.step_on), after issue 36's list
SCALE_STEP_ON="7b:zt-opt-host-on-auto,7b:zt-opt-host-on-cpu,7b:zt-opt-host-on-device,7b:zt-compact-host-on-auto,7b:zt-compact-host-on-cpu,7b:zt-compact-host-on-device,20b:zt-compact-auto-on-auto,20b:zt-compact-auto-on-cpu,20b:zt-compact-auto-on-device,20b:zt-opt-host-on-auto"
export SCALE_CASES="${SCALE_CASES:-$SCALE_FIRST,$SCALE_THEN,$SCALE_REST,$SCALE_STEP_ON}"

scale() {
    local extra=(--steps 2 --warmup 1 --no-profile --case-timeout "${SCALE_CASE_SECONDS:-240}")
    if [[ -n "$TINY" ]]; then
        extra=(--tiny --steps 1 --warmup 1 --threads 1 --case-timeout 60 --min-case-seconds 3 --nvme-path "$OUT")
    else
        libaio_env
    fi
    # exec: the step's SIGINT reaches bench_gpu.py itself, which stops its case and writes the table
    exec "$VPY" benchmarks/bench_gpu.py --cases "$SCALE_CASES" --out "$OUT/scale" \
        --time-limit $((STEP_BUDGET - 10)) "${extra[@]}"
}

export MODE TINY
export BENCH_GPU_ARGS="${BENCH_GPU_ARGS:-}"
export -f vpip machine venv bench_deps ds_ops run_pytest node_bench cpu_adam_roofline libaio_env bench_gpu scale

step machine      60 machine
[[ -z "$TINY" ]] && step venv 180 venv
if [[ "$MODE" == scale ]]; then
    if [[ -z "$TINY" ]]; then
        step bench_deps 90 bench_deps
        step ds_ops 150 ds_ops
    fi
    step scale "${SCALE_SECONDS:-540}" scale INT
elif [[ "$MODE" != bench ]]; then
    step pytest      400 run_pytest INT   # ~200-330 s expected (the stress tests: four child runs each)
    for section in pcie mem adam step io; do
        step "bench_$section" 45 "node_bench $section"
    done
    step cpu_adam 45 cpu_adam_roofline
fi
if [[ "$MODE" =~ ^(bench|all)$ ]]; then
    step bench_deps   90 bench_deps
    step bench_gpu   "${GPU_BENCH_SECONDS:-420}" bench_gpu INT
fi

counts="pytest: not in this call (mode $MODE)"
[[ "$MODE" =~ ^(tests|all)$ ]] && counts="$("$PYTHON" - "$OUT/junit-cuda.xml" <<'EOF' 2>&1
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as exc:
    print(f"pytest: no results ({type(exc).__name__}: {exc})"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
print(f"pytest: {passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped ({n['tests']} tests)")
EOF
)"
{
    printf '%s\n' "${SUMMARY[@]}"
    echo "$counts"
    echo "total: $(($(date +%s) - RUN_START))s, $( ((FAILED)) && echo "FAILED" || echo "all steps passed")"
} | tee "$OUT/summary.txt"
[[ -f "$ZEROTIER_BENCH_FILE" ]] && cp "$ZEROTIER_BENCH_FILE" "$OUT/bench_node.json"
[[ -f "$OUT/bench_gpu/bench_gpu.md" ]] && { echo; cat "$OUT/bench_gpu/bench_gpu.md"; }
[[ -f "$OUT/scale/bench_gpu.md" ]] && { echo; cat "$OUT/scale/bench_gpu.md"; }
# The device tool brings back at most 8 files from OUT_DIR: past that, the logs go into one archive.
if (( $(find "$OUT" -type f | wc -l) > 8 )); then
    (cd "$OUT" && find . -name '*.log' -print0 | tar czf logs.tar.gz --null -T - --remove-files) \
        && echo "logs: $OUT/logs.tar.gz ($(find "$OUT" -type f | wc -l) files in $OUT)"
fi
exit "$FAILED"

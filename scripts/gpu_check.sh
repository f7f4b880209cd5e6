#!/usr/bin/env bash
# The GPU check: measurements first, written as they happen, every phase under its own time limit and the whole
# check under a time budget (default 450 s; with the preflight and the table at most 480 s), then a table. docs/gpu_check.md says
# what each phase measures.
#
#   bash scripts/gpu_check.sh [OUT_DIR]           on a GPU; default OUT_DIR: bench/results/gpu
#   bash scripts/gpu_check.sh --fake OUT_DIR      the same phases on the fake driver (tests/fakecuda), tiny shapes
#
# OUT_DIR gets 5 files (the device tool returns at most 8): results.jsonl (one JSON object per measurement,
# appended and flushed as soon as it exists), stdout.log and stderr.log (every phase's output, as it goes),
# correctness.log (the output of each tests/gpu case) and table.txt (the table printed at the end).
#
# First line written: the preflight (driver library, cuDriverGetVersion, cuda-bindings), 10 s at most.
# Phases, in order (limit in seconds, LIMITS below; they add up to the budget, 450): install 50 (pip), versions 20,
# floor 25, layer-max 70, layer-min 60 (the fp16 layer with the GEMV/tiled crossover parameter at its maximum, then at
# its minimum: one process per path), layer-quant 60 (int8 and int4 g128 at tokens 1 and 16, the profile's own path),
# layers 30, correctness 70, transformers 65; then the table, 20. A phase that would start with less than 15 s of the
# budget left is skipped, and a limit is cut to what is left. A failing or timed-out phase is recorded and the next
# one runs.
# Install: the SDK of this checkout, offline. Already importable from here: used as it is. Else, where setuptools
# >= 68 and wheel are in the image: `pip install --no-deps --no-build-isolation --no-index -e .`. Else (or with
# COLIBRI_GPU_CHECK_INSTALL=pythonpath): a temporary folder on PYTHONPATH holding colibri_sdk/ as links to sdk/*
# plus the kernels/ and profiles/ folders the package expects (pyproject.toml package-dir).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
fake=0
if [ "${1:-}" = "--fake" ]; then
  fake=1
  shift
fi
out="${1:-bench/results/gpu}"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
python="${PYTHON:-python3}"
# Phase limits in seconds, in order; their sum is the default budget (450), so no phase is starved by the ones
# before it running to their limits. COLIBRI_GPU_CHECK_LIMIT_SCALE (an integer, default 1) multiplies every limit
# and the default budget: the fake driver's CPU emulation on a shared machine is slower than a GPU.
scale="${COLIBRI_GPU_CHECK_LIMIT_SCALE:-1}"
declare -A LIMITS=([install]=50 [versions]=20 [floor]=25 [layer-max]=70 [layer-min]=60 [layer-quant]=60 [layers]=30
                   [correctness]=70 [transformers]=65)
for name in "${!LIMITS[@]}"; do LIMITS[$name]=$((LIMITS[$name] * scale)); done
budget="${COLIBRI_GPU_CHECK_BUDGET_S:-$((450 * scale))}"
started=$SECONDS
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
: >"$out/results.jsonl"
: >"$out/stdout.log"
: >"$out/stderr.log"
: >"$out/correctness.log"
rm -f "$out/table.txt"

# ---- the fake driver ------------------------------------------------------------------------------------------
if [ "$fake" = 1 ]; then
  fakelib="${COLIBRI_GPU_CHECK_FAKE_LIB:-}"
  if [ -z "$fakelib" ] || [ ! -f "$fakelib/libcuda.so.1" ]; then
    fakelib="$(mktemp -d)"
    g++ -O1 -std=c++17 -shared -fPIC -fvisibility=hidden tests/fakecuda/driver/*.cpp -o "$fakelib/libcuda.so.1" \
      -ldl -pthread || { echo "g++ could not build the fake driver"; exit 2; }
  fi
  export LD_LIBRARY_PATH="$fakelib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export COLIBRI_GPU_CHECK_FAKE=1
  # An H200-like fake device; its driver one minor older than NVRTC 12.9, so PTX JIT cases skip with the reason.
  export COLIBRI_FAKE_CUDA_CC="${COLIBRI_FAKE_CUDA_CC:-9.0}" COLIBRI_FAKE_CUDA_DRIVER="${COLIBRI_FAKE_CUDA_DRIVER:-12080}"
  export PYTHONPATH="$root/tests/fakecuda:$root/tests/kernels${PYTHONPATH:+:$PYTHONPATH}"
  fake_flag=(--fake)
  echo "FAKE DRIVER ($fakelib/libcuda.so.1): kernels run on the CPU emulation; no number is a GPU measurement"
else
  fake_flag=()
fi

# ---- 0. preflight: the first line written, whatever happens next --------------------------------------------------
# The driver library, its version and the cuda-bindings import, each with its error: a machine without a usable
# driver says so in line 1 instead of in a failed phase minutes later.
preflight_py='
import ctypes, json, sys, time
out = {"phase": "preflight", "name": "driver", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
try:
    lib = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int(0)
    rc_init = lib.cuInit(0)
    rc = lib.cuDriverGetVersion(ctypes.byref(v))
    out.update(driver_library="libcuda.so.1", cuInit=int(rc_init), driver_version=int(v.value) if rc == 0 else None)
except OSError as exc:
    out.update(driver_library=None, driver_error=str(exc)[:200])
try:
    import cuda.bindings
    out["cuda_bindings"] = getattr(cuda.bindings, "__version__", "?")
except Exception as exc:
    out["cuda_bindings"] = None
    out["cuda_bindings_error"] = f"{type(exc).__name__}: {exc}"[:200]
ok = out.get("driver_version") is not None and out.get("cuInit") == 0 and out["cuda_bindings"] is not None
out["status"] = "ok" if ok else "fail"
if not ok:
    out["reason"] = out.get("driver_error") or out.get("cuda_bindings_error") or "cuInit returned %s" % out.get("cuInit")
print(json.dumps(out))
'
if ! timeout 10 "$python" -c "$preflight_py" >>"$out/results.jsonl" 2>>"$out/stderr.log"; then
  printf '{"phase": "preflight", "name": "driver", "status": "fail", "time": "%s", "reason": "the preflight did not finish in 10 s"}\n' \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$out/results.jsonl"
fi
echo "[preflight] $(tail -n 1 "$out/results.jsonl")"

# record STATUS PHASE SECONDS LIMIT RC [REASON]: the check's own line for a phase (plain values only).
record() {
  local reason=""
  [ -n "${6:-}" ] && reason=", \"reason\": \"${6//\"/\'}\""
  printf '{"phase": "check", "name": "phase", "status": "%s", "phase_name": "%s", "seconds": %s, "limit_s": %s, "rc": %s, "time": "%s"%s}\n' \
    "$1" "$2" "$3" "$4" "$5" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$reason" >>"$out/results.jsonl"
}

# phase NAME LIMIT_S COMMAND...: run under `timeout`, output appended to the logs (stdout also shown), recorded.
phase() {
  local name="$1" limit="$2"
  shift 2
  local left=$((budget - (SECONDS - started)))
  if [ "$left" -lt 15 ]; then
    record skip "$name" 0 0 0 "not run: ${left} s of the ${budget} s budget left"
    echo "[$name] skipped: the time budget is spent"
    return 0
  fi
  [ "$limit" -gt $((left - 5)) ] && limit=$((left - 5))
  echo "===== [$name] limit ${limit} s, $(date -u +%H:%M:%S)" >>"$out/stderr.log"
  echo "===== [$name] limit ${limit} s, $(date -u +%H:%M:%S)" | tee -a "$out/stdout.log"
  local t=$SECONDS
  export COLIBRI_GPU_CHECK_DEADLINE=$(($(date +%s) + limit - 5))
  timeout --kill-after=5 "$limit" "$@" 2>>"$out/stderr.log" | tee -a "$out/stdout.log"
  local rc=${PIPESTATUS[0]}
  local status=ok reason=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status=fail reason="timed out after ${limit} s"
  elif [ "$rc" -ne 0 ]; then
    status=fail reason="exit status $rc: $(tail -n 1 "$out/stderr.log" | cut -c1-300)"
  fi
  record "$status" "$name" $((SECONDS - t)) "$limit" "$rc" "$reason"
  echo "[$name] $status in $((SECONDS - t)) s${reason:+ ($reason)}"
  [ "$status" = ok ] || tail -n 5 "$out/stderr.log" | sed 's/^/    /'
  return 0
}

# ---- 1. install -------------------------------------------------------------------------------------------------
from_here() {  # is colibri_sdk importable, and from this checkout?
  "$python" - "$root" <<'EOF'
import os, sys
import colibri_sdk
from colibri_sdk import catalog
here = os.path.dirname(os.path.realpath(colibri_sdk.__file__)) == os.path.realpath(os.path.join(sys.argv[1], "sdk"))
sys.exit(0 if here and any(catalog.kernel_dir().glob("*.cu")) else 1)
EOF
}
pythonpath_shim() {  # colibri_sdk/ as links: sdk/* and each package-dir entry of pyproject.toml outside sdk/
  local shim
  shim="$(mktemp -d)/site"
  mkdir -p "$shim/colibri_sdk" || return 1
  local entry
  for entry in "$root"/sdk/*; do
    [ "$(basename "$entry")" = __pycache__ ] || ln -s "$entry" "$shim/colibri_sdk/$(basename "$entry")"
  done
  local sub dir
  while read -r sub dir; do
    case "$dir" in sdk | sdk/*) ;; *) [ -e "$shim/colibri_sdk/$sub" ] || ln -s "$root/$dir" "$shim/colibri_sdk/$sub" ;; esac
  done < <(grep -o '"colibri_sdk\.[A-Za-z0-9_]*" *= *"[^"]*"' pyproject.toml | sed -E 's/"colibri_sdk\.([^"]*)" *= *"([^"]*)"/\1 \2/')
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
}
install_sdk() {
  local t=$SECONDS mode="" why=""
  if [ "${COLIBRI_GPU_CHECK_INSTALL:-}" != pythonpath ] && from_here 2>/dev/null; then
    mode=installed
  elif [ "${COLIBRI_GPU_CHECK_INSTALL:-}" != pythonpath ] && "$python" -c \
      "import setuptools, wheel, sys; sys.exit(0 if int(setuptools.__version__.split('.')[0]) >= 68 else 1)" 2>/dev/null; then
    if timeout "${LIMITS[install]}" "$python" -m pip install -q --no-deps --no-build-isolation --no-index -e "$root" \
        >>"$out/stdout.log" 2>>"$out/stderr.log" && from_here 2>>"$out/stderr.log"; then
      mode=pip
    else
      why="pip install -e failed (stderr.log); "
    fi
  else
    why="setuptools >= 68 with wheel not importable, or COLIBRI_GPU_CHECK_INSTALL=pythonpath; "
  fi
  if [ -z "$mode" ]; then
    if pythonpath_shim && from_here 2>>"$out/stderr.log"; then
      mode=pythonpath
    else
      record fail install $((SECONDS - t)) "${LIMITS[install]}" 1 "${why}the PYTHONPATH fallback cannot import colibri_sdk either"
      echo "[install] FAILED: ${why}no way to import colibri_sdk from $root"
      return 1
    fi
  fi
  export COLIBRI_GPU_CHECK_INSTALL="$mode"
  record ok install $((SECONDS - t)) "${LIMITS[install]}" 0 "${why}colibri_sdk from $root ($mode)"
  echo "[install] ok in $((SECONDS - t)) s: ${why}colibri_sdk from $root ($mode)"
}
echo "===== [install] $(date -u +%H:%M:%S)" | tee -a "$out/stdout.log"
install_sdk

# ---- 2. measurements, then correctness, then the comparison -------------------------------------------------------
bench=("$python" bench/gpu_bench.py)
fl=(--out "$out" ${fake_flag[@]+"${fake_flag[@]}"})
total=0
for name in "${!LIMITS[@]}"; do total=$((total + LIMITS[$name])); done
printf '{"phase": "check", "name": "limits", "status": "ok", "time": "%s", "sum_s": %s, "budget_s": %s}\n' \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$total" "$budget" >>"$out/results.jsonl"
phase versions "${LIMITS[versions]}" "${bench[@]}" versions "${fl[@]}"
phase floor "${LIMITS[floor]}" "${bench[@]}" floor "${fl[@]}"
phase layer-max "${LIMITS[layer-max]}" "${bench[@]}" layer --crossover max "${fl[@]}"
phase layer-min "${LIMITS[layer-min]}" "${bench[@]}" layer --crossover min "${fl[@]}"
phase layer-quant "${LIMITS[layer-quant]}" "${bench[@]}" layer-quant "${fl[@]}"
phase layers "${LIMITS[layers]}" "${bench[@]}" layers "${fl[@]}"
phase correctness "${LIMITS[correctness]}" "${bench[@]}" correctness "${fl[@]}"
phase transformers "${LIMITS[transformers]}" "${bench[@]}" transformers "${fl[@]}"

# ---- 3. the table ---------------------------------------------------------------------------------------------------
echo
echo "== GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - started)) s): $out"
timeout 20 "$python" bench/gpu_bench.py table --out "$out" 2>>"$out/stderr.log" \
  || { echo "the table could not be printed; the raw lines:"; cat "$out/results.jsonl"; }
exit 0

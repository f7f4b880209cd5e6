#!/usr/bin/env bash
# The GPU check, in one go: install, build every shipped profile, run the kernel and GPU tests, run the GPU
# benchmark, print a short table. Everything is written under OUT_DIR. Expected to take under 5 minutes on one
# GPU (never measured yet); the step time limits add up to 7 minutes.
#
#   bash scripts/gpu_check.sh [OUT_DIR]          default OUT_DIR: bench/results/gpu
#
# Success: every step PASS, and the gpu-tests step reports 0 skipped for lack of a GPU (the step fails if any
# tests/gpu test skipped with "no usable CUDA GPU"). Commit OUT_DIR's summary.txt, gpu_bench.txt / .json,
# pytest-*.xml and the *.log files (not the bundles/ folder).
#
# Install: where cuda-bindings, NVRTC, PyYAML and pytest are already there (the lent H200 image: cuda-bindings 13,
# NVRTC 13), only the SDK is installed, offline. Otherwise `pip install -e ".[build,cuda]" pytest`; offline
# machines: put the wheels in a folder and set COLIBRI_WHEELS=/that/folder (or use shared/wheels).
# Each step has its own time limit; a failed step is reported in the table and the script goes on.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-bench/results/gpu}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
declare -a summary=()
step() {  # step NAME LIMIT_S LOG COMMAND...: run with a time limit, record PASS/FAIL and the duration
  local name="$1" limit="$2" log="$3"
  shift 3
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  local status="PASS"
  [ $rc -eq 0 ] || status="FAIL (rc $rc$([ $rc -eq 124 ] && echo ', timed out'))"
  summary+=("$(printf '%-22s %-26s %4ss  %s' "$name" "$status" "$((SECONDS - start))" "${log#"$root"/}")")
  echo "[$name] $status in $((SECONDS - start)) s (log: $log)"
  tail -n 3 "$log" | sed 's/^/    /'
  return $rc
}

# 1. Install what is missing.
wheels="${COLIBRI_WHEELS:-$root/shared/wheels}"
install() {
  local deps="import cuda.bindings.driver, cuda.bindings.nvrtc, yaml, numpy, pytest"
  if "$python" -c "import colibri_sdk; $deps" 2>/dev/null \
     && [ "$("$python" -c 'import colibri_sdk, os; print(os.path.realpath(colibri_sdk.__path__[0]))')" = "$root/sdk" ]; then
    echo "already installed (editable, from $root)"
  elif "$python" -c "$deps" 2>/dev/null; then
    # The dependencies are there: install only the SDK, offline, editable (so this checkout's code is what runs).
    "$python" -m pip install --no-deps --no-index --no-build-isolation -e . || return 1
  elif [ -d "$wheels" ]; then
    "$python" -m pip install --no-index --find-links "$wheels" -e ".[build,cuda]" pytest || return 1
  else
    "$python" -m pip install --retries 1 --timeout 10 -e ".[build,cuda]" pytest || return 1
  fi
  "$python" - <<'EOF'
import platform
from colibri_sdk.runtime.driver import probe_driver
print("python", platform.python_version())
try:
    import cuda.bindings
    print("cuda-bindings", cuda.bindings.__version__)
    from colibri_sdk.aot.nvrtc import nvrtc_version
    print("nvrtc", nvrtc_version())
except Exception as exc:
    print("cuda-bindings / NVRTC:", exc)
print("driver probe", probe_driver())
EOF
}
export python wheels root out
export -f install
step install 60 "$out/install.log" bash -c install

# 2. Build every shipped profile with the embedded demo model, for the profile's own arch (no GPU involved).
#    The shipped profiles name CUDA 12 (JetPack 6); where the installed NVRTC is another major, each profile is
#    retargeted to it (target.toolkit and min_driver only; the arch and the kernel parameters stay).
build_all() {
  "$python" - "$out/bundles" <<'EOF'
import copy, sys
from pathlib import Path
sys.path.insert(0, "tests/gpu")
from gpu_support import build, retarget_toolkit
from colibri_sdk.aot.nvrtc import nvrtc_version
from colibri_sdk.profile import load_profile, packaged_dir
major = nvrtc_version()[0]
for path in sorted(packaged_dir().glob("*.yaml")):
    data = copy.deepcopy(load_profile(path.stem, toolchain=False).data)
    if data["target"]["toolkit"] != major:
        print(f"{path.stem}: toolkit {data['target']['toolkit']} -> {major} (installed NVRTC)")
        retarget_toolkit(data, major)
    print(path.stem, "->", build(data, None, Path(sys.argv[1]) / path.stem))
EOF
}
export -f build_all
step build-profiles 90 "$out/build.log" bash -c build_all

# 3. Tests: the kernels on the CPU emulation (quick), then the CUDA backend on the GPU against the reference.
step kernel-tests 60 "$out/pytest-kernels.log" "$python" -m pytest tests/kernels -q -ra -p no:cacheprovider \
  --junitxml="$out/pytest-kernels.xml"
gpu_tests() {  # fails when any GPU test skipped for lack of a GPU: a green table must mean the GPU ran them
  "$python" -m pytest tests/gpu -q -ra -p no:cacheprovider --junitxml="$out/pytest-gpu.xml" || return $?
  "$python" - "$out/pytest-gpu.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
skips = [s.get("message", "") for s in ET.parse(sys.argv[1]).iter("skipped")]
no_gpu = [m for m in skips if "no usable CUDA GPU" in m]
if no_gpu:
    sys.exit(f"{len(no_gpu)} GPU tests skipped for lack of a GPU ({no_gpu[0]}): this is not a GPU pass")
print(f"{len(skips)} skipped for other reasons")
EOF
}
export -f gpu_tests
step gpu-tests 120 "$out/pytest-gpu.log" bash -c gpu_tests

# 4. Benchmark: graph vs eager vs transformers, bandwidth floor.
step gpu-bench 150 "$out/bench.log" "$python" bench/gpu_bench.py --out "$out" --iters 100

echo
gpu="$("$python" -c 'from colibri_sdk.runtime.driver import probe_driver; ok, why = probe_driver(); print(why if ok else "none: " + why)' 2>&1 | tail -n 1)"
echo "== GPU check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ)); GPU: $gpu $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
for log in "$out/pytest-kernels.log" "$out/pytest-gpu.log"; do
  [ -f "$log" ] && echo "$(basename "$log" .log): $(grep -E "passed|failed|error" "$log" | tail -n 1)" | tee -a "$out/summary.txt"
done
[ -f "$out/gpu_bench.txt" ] && tee -a "$out/summary.txt" <"$out/gpu_bench.txt"
exit 0

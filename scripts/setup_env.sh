#!/usr/bin/env bash
# Create .venv (if missing) and install colibri-sdk with the given extras into it (a normal, non-editable
# install, as a user gets it). Skips the install when the sources, pyproject.toml and extras are unchanged
# since the last one.
# Usage: source scripts/setup_env.sh EXTRAS     (e.g. "build" or "all")
set -euo pipefail
extras="${1:-all}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The CPU build of torch is needed only by the tests (transformers is their numerical reference).
# Where a local wheel folder exists, pip finds torch there instead of downloading a CUDA build.
if [ -d /opt/wheels ]; then export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"; fi
# A .venv without pip is what `python3 -m venv` leaves behind where python3-venv (ensurepip) was missing: recreate it.
if [ ! -x "$root/.venv/bin/python" ] || ! "$root/.venv/bin/python" -m pip --version >/dev/null 2>&1; then
  python3 -m venv --clear "$root/.venv" || {
    echo "python3 -m venv failed; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 1; }
fi
# shellcheck disable=SC1091
source "$root/.venv/bin/activate"
stamp="$root/.venv/.colibri-install"
state="$extras $(cd "$root" && find pyproject.toml sdk kernels profiles -type f -not -name '*.pyc' | LC_ALL=C sort \
  | xargs sha256sum | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$state" ]; then
  return 0 2>/dev/null || exit 0
fi
# --no-compile: no byte code written for every installed module (torch and transformers hold thousands; about 45 s
# of CPU on 2 cores); Python writes it for the modules a program imports, on their first import.
python -m pip install -q --no-compile --upgrade pip
if [[ "$extras" == *all* || "$extras" == *test* ]]; then
  # The CPU build of torch, named by its `+cpu` local version so that no CUDA build can match: PyPI's plain
  # `torch==2.13.0` is the CUDA 13 build (it pulls cuda-bindings>=13, against the build extra's cuda-python<13).
  # First a local wheel, offline (pip's find-links, e.g. /opt/wheels), then its dependencies from the usual index;
  # else PyTorch's CPU wheel index, with a short network timeout so that an unreachable index fails, not hangs.
  if python -m pip install -q --no-compile --no-index --no-deps "torch==2.13.0+cpu" >/dev/null 2>&1; then
    python -m pip install -q --no-compile "torch==2.13.0+cpu"
  else
    echo "note: no local torch 2.13.0+cpu wheel; installing it from https://download.pytorch.org/whl/cpu"
    python -m pip install -q --no-compile --timeout 30 --retries 1 --index-url https://download.pytorch.org/whl/cpu \
      "torch==2.13.0+cpu"
  fi
fi
python -m pip install -q --no-compile "$root[$extras]"
echo "$state" >"$stamp"

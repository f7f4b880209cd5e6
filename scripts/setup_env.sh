#!/usr/bin/env bash
# Create .venv (if missing) and install colibri-sdk with the given extras into it.
# Usage: source scripts/setup_env.sh EXTRAS     (e.g. "build" or "all")
set -euo pipefail
extras="${1:-all}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The CPU build of torch is needed only by the tests (transformers is their numerical reference).
# Where a local wheel folder exists, pip finds torch there instead of downloading a CUDA build.
if [ -d /opt/wheels ]; then export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"; fi
if [ ! -x "$root/.venv/bin/python" ]; then
  python3 -m venv "$root/.venv"
fi
# shellcheck disable=SC1091
source "$root/.venv/bin/activate"
python -m pip install -q --upgrade pip
if [[ "$extras" == *all* || "$extras" == *test* ]]; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q "$root[$extras]"

#!/usr/bin/env bash
# Quick start, part 1: on a fresh Debian/Ubuntu machine (no GPU needed), install colibri-sdk into .venv,
# build the embedded demo model for the Jetson Orin profile, verify the bundle and run it.
# A GPU is used when one is present; otherwise the NumPy CPU backend runs the same bundle.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/setup_env.sh build
out="${1:-bundles/orin-demo}"
# No BLAS thread variable is needed: the CPU backend chooses its BLAS threads itself (docs/runtime.md).
set -x
colibri-sdk build --profile profiles/orin.yaml --demo -o "$out" --force
colibri-sdk inspect "$out"
colibri-sdk verify "$out"
colibri-sdk run "$out" --iters 50

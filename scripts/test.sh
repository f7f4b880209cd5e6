#!/usr/bin/env bash
# Set up everything the tests need on a fresh Debian/Ubuntu machine and run them.
#   - OpenSSH server (deploy tests start their own sshd on 127.0.0.1); installed with apt when running as root
#   - .venv with colibri-sdk[all]: NVRTC 12 + CUDA headers from pip, transformers + CPU torch, paramiko, pytest-xdist
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k format`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq openssh-server openssh-client >/dev/null
  else
    echo "note: sshd is not installed and this is not root: deploy tests will be skipped (apt-get install openssh-server)"
  fi
fi
# libcolibri (tests/c_runtime) needs OpenSSL's libcrypto headers; cmake is optional (scripts/c_runtime.sh falls back to cc)
if [ ! -f /usr/include/openssl/evp.h ] && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq libssl-dev >/dev/null
fi
source scripts/setup_env.sh all
# The tests need the CPU build of torch and cuda-bindings 12 (the build extra's cuda-python<13): a CUDA torch or
# cuda-bindings 13 in .venv is refused here in one line, before any test runs.
python - <<'CHECK'
import importlib.metadata as metadata
import sys

import torch

problems = []
if torch.version.cuda is not None:
    problems.append(f"torch {torch.__version__} is a CUDA {torch.version.cuda} build; the tests need the CPU build")
try:
    bindings = metadata.version("cuda-bindings")
except metadata.PackageNotFoundError:
    bindings = None
if bindings and int(bindings.split(".")[0]) >= 13:
    problems.append(f"cuda-bindings {bindings} is installed; the tests need cuda-bindings 12 (cuda-python<13)")
if problems:
    sys.exit(f"scripts/test.sh: wrong .venv: {'; '.join(problems)} (rm -r .venv and run again: scripts/setup_env.sh "
             "installs torch==2.13.0+cpu)")
CHECK
# pytest's temporary folders (about 3.5 GB of bundles, venvs and device stores per run): on tmpfs (/dev/shm) where it
# has 8 GB free, in a folder of this run that is removed at exit. On a disk they cost writeback while the tests run
# and, when pytest later removes old runs' folders, a minute or more of unlinking (on a filesystem mounted with
# `discard`, every freed extent is trimmed). Elsewhere, or with --basetemp given, pytest's default
# ($TMPDIR/pytest-of-$USER, the last 3 runs kept). COLIBRI_TEST_TMPFS=0 turns the tmpfs folder off.
basetemp=()
if [ "${COLIBRI_TEST_TMPFS:-1}" != 0 ] && [[ " $* " != *" --basetemp"* ]] && [ -d /dev/shm ] && [ -w /dev/shm ]; then
  free_kb="$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')"
  if [ "${free_kb:-0}" -ge $((8 * 1024 * 1024)) ]; then
    run_tmp="$(mktemp -d /dev/shm/colibri-tests-XXXXXX)"
    trap 'rm -rf "$run_tmp"' EXIT
    basetemp=(--basetemp "$run_tmp/pytest")
  fi
fi
# One pytest worker per core (pytest-xdist); each test file runs on one worker, so its module fixtures are made once.
# `bash scripts/test.sh -n 0` runs everything in one process.
python -m pytest -q -ra -n auto --dist loadfile ${basetemp[@]+"${basetemp[@]}"} "$@"

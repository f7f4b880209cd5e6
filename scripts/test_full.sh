#!/usr/bin/env bash
# The whole test suite with the cases the default run leaves out for time: the full-size emulated cases (pytest
# marker `full`, COLIBRI_TEST_FULL=1) and the C runtime on the shipped demo bundles (COLIBRI_C_FULL=1). Tens of
# minutes on 2 cores. Extra arguments go to pytest, as with scripts/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
COLIBRI_TEST_FULL=1 COLIBRI_C_FULL=1 bash scripts/test.sh "$@"

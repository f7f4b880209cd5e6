#!/usr/bin/env bash
# libcolibri, the C runtime (docs/c_runtime.md): build it, or build and test it on the fake CUDA driver.
#   bash scripts/c_runtime.sh build [DIR]   library (plain and with AddressSanitizer + UBSan), the fake libcuda.so.1
#                                           (tests/fakecuda), the C tests, the example and the bench program, into
#                                           DIR (default build/c_runtime)
#   bash scripts/c_runtime.sh test [DIR]    build, then run tests/c_runtime (pytest: every shipped profile end to
#                                           end, every status code, tampered bundles) with the sanitizer build, plus
#                                           the shipped profiles' demo bundles as `colibri-sdk build` writes them
#                                           (COLIBRI_C_FULL=1: minutes of kernel emulation; CI's pytest skips them)
# Needs a C compiler, g++ (the fake driver), OpenSSL's libcrypto headers (libssl-dev) and, for `test`, the Python
# environment of scripts/setup_env.sh (bundles are built by colibri-sdk). Uses cmake when present (and COLIBRI_NO_CMAKE
# is unset), else the one-line cc build of docs/c_runtime.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmd="${1:-test}"
out="${2:-$root/build/c_runtime}"
lib="$root/sdk/libcolibri"
cc="${CC:-cc}"

build_library() {  # build_library DIR SANITIZE(ON|OFF)
  local dir="$1" sanitize="$2"
  if command -v cmake >/dev/null 2>&1 && [ -z "${COLIBRI_NO_CMAKE:-}" ]; then
    cmake -S "$lib" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOLIBRI_SANITIZE="$sanitize" >/dev/null
    cmake --build "$dir" >/dev/null
  else  # the documented one-line build, shared and static
    local flags=(-std=c11 -O2 -g -fPIC -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter
                 -I"$lib/include" -I"$lib/third_party/cjson")
    [ "$sanitize" = ON ] && flags+=(-fsanitize=address,undefined -fno-omit-frame-pointer)
    mkdir -p "$dir/obj"
    "$cc" "${flags[@]}" -shared "$lib"/src/*.c "$lib/third_party/cjson/cJSON.c" -o "$dir/libcolibri.so" \
      -lcrypto -ldl -lpthread -lm
    (cd "$dir/obj" && "$cc" "${flags[@]}" -c "$lib"/src/*.c "$lib/third_party/cjson/cJSON.c")
    ar rcs "$dir/libcolibri.a" "$dir"/obj/*.o
  fi
}

build() {
  mkdir -p "$out"
  build_library "$out/lib" OFF
  build_library "$out/lib-asan" ON
  g++ -O1 -std=c++17 -shared -fPIC -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter \
    "$root"/tests/fakecuda/driver/*.cpp -o "$out/libcuda.so.1" -ldl -pthread
  local san=(-fsanitize=address,undefined -fno-omit-frame-pointer)
  local wrap=(-Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc)
  "$cc" -std=c11 -O1 -g -Wall -Wextra "${san[@]}" -I"$lib/include" "$root"/tests/c_runtime/colibri_test/*.c \
    "$out/lib-asan/libcolibri.a" "${wrap[@]}" -lcrypto -ldl -lpthread -lm -o "$out/colibri_test"
  "$cc" -std=c11 -O1 -g -Wall -Wextra -I"$lib/include" "$root"/tests/c_runtime/colibri_test/*.c \
    "$out/lib/libcolibri.a" "${wrap[@]}" -lcrypto -ldl -lpthread -lm -o "$out/colibri_test_plain"
  "$cc" -std=c11 -O2 -Wall -Wextra -I"$lib/include" "$root/examples/jetson_qc/c/qc_loop.c" \
    -L"$out/lib" -Wl,-rpath,"$out/lib" -lcolibri -lm -o "$out/qc_loop"
  "$cc" -std=c11 -O2 -Wall -Wextra -I"$lib/include" "$root/bench/c_runtime_bench.c" \
    -L"$out/lib" -Wl,-rpath,"$out/lib" -lcolibri -lm -o "$out/c_runtime_bench"
  g++ -O2 -shared -fPIC "$root/bench/noop_kernels.cpp" -o "$out/libnoop_kernels.so"
  echo "built into $out"
}

case "$cmd" in
  build) build ;;
  test)
    build
    if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
    COLIBRI_C_BUILD="$out" COLIBRI_C_FULL=1 "$py" -m pytest "$root/tests/c_runtime" -q -ra -p no:cacheprovider
    ;;
  *) echo "usage: bash scripts/c_runtime.sh build|test [DIR]" >&2; exit 2 ;;
esac

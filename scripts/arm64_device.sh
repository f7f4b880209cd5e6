#!/usr/bin/env bash
# An emulated arm64 device for the deploy path (docs/deploy.md, "An arm64 device"): a Debian arm64 root run with
# qemu-user-static through binfmt_misc, its own sshd on 127.0.0.1, reached by `colibri-sdk deploy` like a Jetson.
#   bash scripts/arm64_device.sh setup        the root, once: debootstrap --arch arm64 (python3, python3-venv,
#                                             openssh-server) into $COLIBRI_ARM64_ROOT, default
#                                             ${XDG_CACHE_HOME:-~/.cache}/colibri-sdk/arm64-root; a finished root is
#                                             kept and reused (a failed one is left as ROOT.partial and redone)
#   bash scripts/arm64_device.sh test [ARGS]  setup, then tests/deploy/test_arm64_device.py (pytest ARGS appended):
#                                             --install-runtime from aarch64 wheels fetched here with pip download,
#                                             deploy --verify --verify-backend cpu there, its output against this
#                                             machine's CPU backend
#   bash scripts/arm64_device.sh path         print the root's folder
# Needs root (debootstrap, chroot, binfmt_misc, sshd), apt (qemu-user-static, binfmt-support, debootstrap are
# installed when missing), Debian's archive for the root and PyPI for the wheels (both once, then cached), and the
# Python environment of scripts/setup_env.sh. COLIBRI_ARM64_SUITE (default bookworm: Python 3.11, glibc 2.36) and
# COLIBRI_ARM64_MIRROR (default http://deb.debian.org/debian) choose the release; a JetPack 6 device has Ubuntu
# 22.04's Python 3.10 and glibc 2.35, which no Debian release has.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmd="${1:-test}"
[ $# -gt 0 ] && shift
cache="${XDG_CACHE_HOME:-$HOME/.cache}/colibri-sdk"
arm64_root="${COLIBRI_ARM64_ROOT:-$cache/arm64-root}"  # not "root": setup_env.sh sets that
suite="${COLIBRI_ARM64_SUITE:-bookworm}"
mirror="${COLIBRI_ARM64_MIRROR:-http://deb.debian.org/debian}"
marker="$arm64_root/.colibri-arm64-root"   # written last: a root with it is complete
user=colibri                         # the device's login, as on a Jetson set up by deploy/README.md
# The CPU qemu emulates (qemu-aarch64-static -cpu help): Orin's Cortex-A78AE is ARMv8.2-A without SVE, the closest
# model is cortex-a76; qemu's default "max" has SVE, which OpenBLAS then uses and TCG runs about 6x slower.
export COLIBRI_ARM64_CPU="${COLIBRI_ARM64_CPU:-cortex-a76}"
export QEMU_CPU="$COLIBRI_ARM64_CPU"

die() { echo "arm64_device.sh: $*" >&2; exit 1; }

host_packages() {  # qemu-user-static (the emulator), binfmt-support (registers it), debootstrap
  local missing=()
  [ -x /usr/bin/qemu-aarch64-static ] || missing+=(qemu-user-static)
  command -v update-binfmts >/dev/null 2>&1 || missing+=(binfmt-support)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "needs ${missing[*]} and there is no apt-get: install them by hand"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } \
    || die "apt-get install ${missing[*]} failed"
}

binfmt() {  # aarch64 ELF files run through qemu-aarch64-static, also inside the chroot (the F flag, or the copy)
  local entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
  if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
      || die "binfmt_misc cannot be mounted here (mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc failed): \
this machine (a container without CAP_SYS_ADMIN?) cannot run aarch64 programs transparently"
  fi
  if [ ! -e "$entry" ]; then
    update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || update-binfmts --import qemu-aarch64 >/dev/null 2>&1 || true
  fi
  [ -e "$entry" ] && [ "$(head -1 "$entry")" = enabled ] \
    || die "no enabled binfmt_misc entry for aarch64 ($entry): update-binfmts --enable qemu-aarch64 failed"
}

setup() {
  [ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, binfmt_misc, sshd); running as uid $(id -u)"
  host_packages
  binfmt
  if [ -f "$marker" ]; then
    echo "arm64 root: $arm64_root ($(cat "$marker"))"
    return 0
  fi
  local partial="$arm64_root.partial" started=$SECONDS
  rm -rf "$partial"
  mkdir -p "$(dirname "$arm64_root")"
  echo "arm64 root: debootstrap --arch arm64 $suite into $partial (minutes under qemu)"
  debootstrap --arch=arm64 --variant=minbase --foreign --include=python3,python3-venv,openssh-server \
    "$suite" "$partial" "$mirror" >"$partial.log" 2>&1 \
    || die "debootstrap (first stage) failed, see $partial.log: $(tail -1 "$partial.log")"
  local interpreter  # for a binfmt entry without the F flag: the emulator at its path inside the root too
  interpreter="$(awk '$1 == "interpreter" {print $2}' /proc/sys/fs/binfmt_misc/qemu-aarch64)"
  mkdir -p "$partial$(dirname "$interpreter")"
  cp -L /usr/bin/qemu-aarch64-static "$partial$interpreter"
  chroot "$partial" /debootstrap/debootstrap --second-stage >>"$partial.log" 2>&1 \
    || die "debootstrap --second-stage under qemu failed, see $partial.log: $(tail -1 "$partial.log")"
  chroot "$partial" /usr/sbin/useradd --create-home --shell /bin/sh "$user"
  chroot "$partial" /usr/sbin/usermod --password "*" "$user"  # no password, not locked: sshd (no PAM) refuses a locked one
  rm -f "$partial/etc/ssh/ssh_host_"*  # the tests give sshd their own host key
  chroot "$partial" /usr/bin/python3 -c 'import platform, sys; assert platform.machine() == "aarch64", platform.machine()' \
    || die "python3 in $partial does not run as aarch64"
  local about
  about="$suite arm64, $(chroot "$partial" /usr/bin/python3 -c 'import platform; print("Python", platform.python_version(), "glibc", platform.libc_ver()[1])'), made in $((SECONDS - started)) s"
  echo "$about" >"$partial/.colibri-arm64-root"
  rm -rf "$arm64_root"
  mv "$partial" "$arm64_root"
  mv "$partial.log" "$arm64_root.log"
  echo "arm64 root: $arm64_root ($about)"
}

case "$cmd" in
  setup) setup ;;
  path) echo "$arm64_root" ;;
  test)
    started=$SECONDS
    setup
    cd "$here"
    # shellcheck disable=SC1091
    source scripts/setup_env.sh all
    rc=0
    COLIBRI_ARM64=1 COLIBRI_ARM64_ROOT="$arm64_root" python -m pytest -q -rA -n 0 -p no:cacheprovider tests/deploy/test_arm64_device.py \
      "$@" || rc=$?
    echo "arm64_device.sh test: $((SECONDS - started)) s in all (exit status $rc)"
    exit "$rc"
    ;;
  *) die "unknown command '$cmd': expected setup, test or path" ;;
esac

"""`colibri-sdk verify BUNDLE [--backend auto|cpu|cuda] [--no-selftest] [--rebuild [--kernels DIR]]`: check a
bundle's schema and every file's size and sha256 (manifest.json included), the reading rules (no links, listed files
only) and that the weights are finite; with `--rebuild`, compile its kernels again (no NVRTC cache) from the sources
and options its manifest records and compare every cubin and PTX byte for byte; then run its self-test on a backend
(docs/build.md, "Reading rules" and "Checking a bundle against its sources").

Exit codes: 0 every check passed; 1 a check failed or could not run (one error line: a bad checksum, a failed
self-test, a bundle too old for --rebuild, another NVRTC version, kernel sources that differ from the recorded ones);
3 --rebuild ran and an image differs from NVRTC's output (one line per image on stdout, then the error line);
2 bad usage.
"""

from __future__ import annotations

import argparse
import sys

EXIT_IMAGES_DIFFER = 3


def register(sub) -> None:
    p = sub.add_parser("verify", help="check a bundle's checksums and schema, then run its self-test")
    p.add_argument("bundle", metavar="BUNDLE", help="a bundle folder")
    p.add_argument(
        "--backend", choices=("auto", "cpu", "cuda"), default="auto", help="backend for the self-test (default: auto)"
    )
    p.add_argument("--no-selftest", action="store_true", help="check checksums and schema only")
    p.add_argument("--rebuild", action="store_true",
                   help="also compile the kernels again with NVRTC (no cache) from the sources and options the "
                   "manifest records and compare every cubin and PTX byte for byte (needs the build extra; exit 3 "
                   "when an image differs)")
    # --kernels DIR: the kernel sources to rebuild from, in place of the installed ones; not in --help (as build's).
    p.add_argument("--kernels", metavar="DIR", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..bundle import Bundle
    from ..errors import BundleError
    from .progress import StepBars

    bundle = Bundle.open(args.bundle, verify=False)
    with StepBars(quiet=args.quiet, desc_prefix="verify: ") as bars:
        bundle.verify(progress=bars)
    files = bundle.manifest["files"]
    print(f"{bundle.path}: schema {bundle.manifest['schema_version']}, {len(files)} files + manifest, checksums ok")
    if args.rebuild:
        from ..aot.rebuild import rebuild_and_compare

        report = rebuild_and_compare(bundle, kernel_dir=args.kernels)
        if not report.identical:
            for mismatch in report.mismatches:
                print(f"  rebuild: {mismatch.line()}")
            print(f"colibri-sdk verify: error: {bundle.path}: {len(report.mismatches)} of {report.images} kernel images "
                  f"differ from what NVRTC {report.nvrtc_version} compiles from the recorded sources and options (a "
                  "planted NVRTC cache entry, or a file edited with its checksums recomputed); do not ship it: build it "
                  "again with --no-cache", file=sys.stderr)
            return EXIT_IMAGES_DIFFER
        print(f"  rebuild: {report.images} images ({report.compilations} compilations, NVRTC {report.nvrtc_version}, "
              "no cache) identical to the bundle's")
    elif args.kernels is not None:
        raise BundleError("--kernels DIR is for --rebuild; add --rebuild (or drop --kernels)")
    if args.no_selftest:
        return 0
    try:
        from ..runtime import Runtime
    except ImportError as exc:
        raise BundleError(f"the self-test needs colibri_sdk.runtime, which cannot be imported here ({exc})") from exc
    with Runtime.load(bundle.path, backend=args.backend, verify=False) as runtime:
        result = runtime.self_test()
    shapes = len(runtime.shapes)
    print(f"  self-test: {result}" + (f" (every shape: {shapes})" if shapes > 1 else ""))
    if not result.passed:
        raise BundleError(f"{bundle.path}: self-test failed on the {runtime.backend_name} backend: {result}")
    return 0

"""`colibri-sdk verify BUNDLE [--backend auto|cpu|cuda] [--no-selftest]`: check a bundle's schema and every file's
size and sha256 (manifest.json included), the reading rules (no links, listed files only) and that the weights are
finite, then run its self-test on a backend (docs/build.md, "Reading rules")."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("verify", help="check a bundle's checksums and schema, then run its self-test")
    p.add_argument("bundle", metavar="BUNDLE", help="a bundle folder")
    p.add_argument(
        "--backend", choices=("auto", "cpu", "cuda"), default="auto", help="backend for the self-test (default: auto)"
    )
    p.add_argument("--no-selftest", action="store_true", help="check checksums and schema only")
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
    if args.no_selftest:
        return 0
    try:
        from ..runtime import Runtime
    except ImportError as exc:
        raise BundleError(f"the self-test needs colibri_sdk.runtime, which cannot be imported here ({exc})") from exc
    with Runtime.load(bundle.path, backend=args.backend, verify=False) as runtime:
        result = runtime.self_test()
    print(f"  self-test: {result}")
    if not result.passed:
        raise BundleError(f"{bundle.path}: self-test failed on the {runtime.backend_name} backend: {result}")
    return 0

"""Compile the kernel catalogue for one profile and check the results against the profile.

For each `colibri_sdk.catalog.KERNELS` entry: read kernels/<source>, compile it with the profile's arch and the
catalogue's compile-time constants, then check that the cubin's ELF header names the arch, that every catalogue
symbol was compiled, that no entry function spills (unless `allow_spills`), and that static shared memory fits the
profile's `hardware.shared_memory_per_block`.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import catalog
from ..errors import CompileError
from .cubin import check_cubin_arch
from .nvrtc import CompiledSource, compile_options, compile_source, include_folders
from .rebuild import record_inputs


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """One catalogue kernel compiled for a profile.

    Attributes:
        spec: the catalogue entry.
        defines: the -D constants it was compiled with.
        output: cubin, PTX, log and ptxas resources.
        inputs: what a rebuild needs besides arch, defines and NVRTC version (`rebuild.record_inputs`: the sha256
            of the source and the headers, the options without machine paths); the manifest's `kernels[].inputs`.
    """

    spec: catalog.KernelSpec
    defines: dict
    output: CompiledSource
    inputs: dict = dataclasses.field(default_factory=dict)

    @property
    def resources(self) -> dict:
        return self.output.resources


def check_resources(spec: catalog.KernelSpec, resources: dict, profile) -> None:
    """Every symbol compiled, no spills unless allowed, static shared memory within the per-block limit.

    Raises:
        CompileError: naming the kernel, symbol, value and limit.
    """
    missing = [s for s in spec.symbols if s not in resources]
    if missing:
        raise CompileError(
            f"{spec.source}: entry point(s) {missing} not compiled (found {sorted(resources)}); "
            f'each catalogue symbol must be an extern "C" __global__ function'
        )
    limit = profile.hardware["shared_memory_per_block"]
    for symbol in spec.symbols:
        r = resources[symbol]
        spills = r["spill_store_bytes"] + r["spill_load_bytes"]
        if spills and not profile.allow_spills:
            raise CompileError(
                f"{spec.source}: {symbol} spills registers ({r['spill_store_bytes']} bytes stored, "
                f"{r['spill_load_bytes']} bytes loaded, {r['registers']} registers); allowed: 0 unless the profile "
                f"sets allow_spills: true (or lower kernels.{spec.name}.threads / tile sizes)"
            )
        if r["shared_bytes"] > limit:
            raise CompileError(
                f"{spec.source}: {symbol} uses {r['shared_bytes']} bytes of static shared memory; allowed: at most "
                f"{limit} (hardware.shared_memory_per_block of the profile)"
            )


def compile_kernel(spec: catalog.KernelSpec, profile, header, kernel_dir: Path, cache=None) -> CompiledKernel:
    """Compile and check one catalogue kernel for `profile` (a `colibri_sdk.profile.Profile`), through `cache` (an
    `colibri_sdk.aot.cache.NvrtcCache`) when given. The checks run on cached output as on fresh output.

    Raises:
        CompileError: the source is missing, NVRTC fails (log with file and line), the cubin names another SM, or
            a resource check fails.
    """
    path = Path(kernel_dir) / spec.source
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CompileError(f"kernel source {path} cannot be read: {exc.strerror}") from exc
    defines = catalog.compile_defines(profile.to_dict(), header)
    compile_fn = compile_source if cache is None else cache.compile_source
    output = compile_fn(source, spec.source, profile.arch, defines, [Path(kernel_dir)], toolkit=profile.toolkit)
    check_cubin_arch(output.cubin, profile.arch, f"{spec.source} cubin")
    check_resources(spec, output.resources, profile)
    # The options as compile_source runs them (not a cache entry's own record of them, which is only as good as
    # the cache folder).
    options = compile_options(profile.arch, defines, include_folders([kernel_dir]))
    return CompiledKernel(spec, defines, output, record_inputs(source, Path(kernel_dir), options))


def compile_catalog(profile, header, kernel_dir: Path | None = None, workers: int = 2,
                    cache=None) -> list[CompiledKernel]:
    """Compile the catalogue kernels of `profile` (`catalog.kernels_for`: the capacity kernel only with a
    `capacity`), in catalogue order.

    Args:
        profile: a validated `Profile`.
        header: the weights' `colibri_sdk.format.Header` (sizes become compile-time constants).
        kernel_dir: folder of the .cu sources; default `catalog.kernel_dir()`.
        workers: NVRTC compilations run at once (NVRTC programs are independent; the calls release the GIL).
        cache: an `NvrtcCache` to answer and keep compilations (None: NVRTC runs for every kernel).

    Raises:
        CompileError: see `compile_kernel`; the first failure in catalogue order is raised.
    """
    folder = Path(kernel_dir) if kernel_dir is not None else catalog.kernel_dir()
    if workers <= 1:
        return [compile_kernel(spec, profile, header, folder, cache)
                for spec in catalog.kernels_for(profile.to_dict())]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(compile_kernel, spec, profile, header, folder, cache)
                   for spec in catalog.kernels_for(profile.to_dict())]
        return [f.result() for f in futures]

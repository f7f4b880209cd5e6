"""A MoE layer stack run on the GPU straight from the launch plan: `catalog.launch_plan(profile, header)`, the
kernels `colibri_sdk.aot.kernels.compile_catalog` compiles for the profile, the scratch buffers of
`catalog.device_buffers`, and one weights buffer (the .colibri data after the header, byte for byte) filled on the
device by colibri_bench_fill. No .colibri file, no bundle, no checksum, no self-test.

Launch arguments, as in the plan's JSON: {"kind": "buffer", "name"}, {"kind": "weights", "offset"} (bytes into the
weights buffer), {"kind": "null"}, and scalars {"kind": "i32"|"u32"|"i64"|"u64"|"f32", "value"}. The forward pass,
as the CUDA backend enqueues it: the input copy into `io_buffers["input"]` (and, where the plan names one, the
valid-token count into `io_buffers["valid_tokens"]`, an int32), every launch, the output copy.

Timings (CUDA events, microseconds):
  per kernel: a busy-wait kernel first keeps the GPU busy while the host enqueues every launch with an event after
      each, so kernel i's time is event i -> event i+1 with no host gap (`gap_free` says whether the host finished
      enqueueing before the wait ended);
  forward, graph: events around cuGraphLaunch of the captured forward pass;
  forward, eager: events around the same copies and launches enqueued one by one from Python.
"""

from __future__ import annotations

import copy
import time

import numpy as np

from device import FAKE, Device, fake_nvrtc_cache, pointer_args, spin, stats_us

SCALAR_KINDS = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64, "f32": np.float32}
# Profile parameters that set where the GEMV path hands over to the tiled / tensor-core path (first found is used).
CROSSOVER_NAMES = ("max_pairs", "crossover_pairs", "gemv_max_pairs", "crossover", "gemv_max_tokens")
PATH_NAMES = {"small_batch": "gemv", "gate_up": "tiled"}
SPIN_CYCLES = 1_000_000  # about 0.5 ms at 2 GHz: longer than the host needs to enqueue one layer's launches


class PlanError(RuntimeError):
    """The launch plan names something this runner does not know (an argument kind, a buffer, a symbol)."""


def mixtral_header(layers: int, hidden: int, inter: int, experts: int, top_k: int):
    """An fp16 header, Mixtral routing (softmax over the top-k logits) and residual layers."""
    from colibri_sdk.format import Header
    from colibri_sdk.format.constants import COMPOSITION_RESIDUAL, ROUTING_TOPK_SOFTMAX

    return Header(layers, experts, top_k, hidden, inter, dtype=1, routing=ROUTING_TOPK_SOFTMAX,
                  composition=COMPOSITION_RESIDUAL)


def quant_header(layers: int, hidden: int, inter: int, experts: int, top_k: int, storage: str):
    """A v2 header of int8 per-row ("int8") or int4 group-128 ("int4_g128") experts, fp16 scales, fp32 router,
    Mixtral routing and residual layers."""
    from colibri_sdk.format import HeaderV2
    from colibri_sdk.format.constants import COMPOSITION_RESIDUAL, QUANT_INT4, QUANT_INT8, ROUTING_TOPK_SOFTMAX

    quant, group = {"int8": (QUANT_INT8, 0), "int4_g128": (QUANT_INT4, 128)}[storage]
    return HeaderV2(layers, experts, top_k, hidden, inter, dtype=1, quant=quant, group_size=group,
                    routing=ROUTING_TOPK_SOFTMAX, composition=COMPOSITION_RESIDUAL)


def weights_bytes(profile: dict, header) -> int:
    """Bytes of the weights buffer: the .colibri data size (or the catalogue's own figure where it has one) plus
    catalog.WEIGHTS_TAIL_BYTES, as the CUDA backend allocates it (the GEMV's last 16-byte vector of a row may read
    past the data)."""
    from colibri_sdk import catalog

    own = getattr(catalog, "weights_bytes", None)
    return (int(own(profile, header)) if own else int(header.data_size)) + catalog.WEIGHTS_TAIL_BYTES


def io_buffers(profile: dict, header) -> dict:
    from colibri_sdk import catalog

    try:
        return dict(catalog.io_buffers(header))
    except TypeError:
        return dict(catalog.io_buffers(profile, header))


def crossover_param():
    """(kernel, Param) of the GEMV / tiled crossover in the catalogue, or None."""
    from colibri_sdk import catalog

    for spec in catalog.KERNELS:
        for param in spec.params:
            if param.name in CROSSOVER_NAMES:
                return spec.name, param
    return None


def base_profile(arch: str) -> dict:
    """The shipped profile for `arch` (else the H200 one with its arch replaced), retargeted to the installed
    NVRTC major (target.toolkit, and target.min_driver raised to a driver of that major)."""
    from colibri_sdk.aot.nvrtc import nvrtc_version
    from colibri_sdk.profile import load_profile, packaged_names

    chosen = None
    for name in ["h200", *packaged_names()]:
        data = load_profile(name, toolchain=False).data
        if data["target"]["arch"] == arch:
            chosen = copy.deepcopy(data)
            break
    if chosen is None:
        chosen = copy.deepcopy(load_profile("h200", toolchain=False).data)
        chosen["target"]["arch"] = arch
    major = nvrtc_version()[0]
    chosen["target"]["toolkit"] = major
    chosen["target"]["min_driver"] = max(chosen["target"]["min_driver"], 1000 * major)
    chosen["dtype"] = "fp16"
    return chosen


def launch_plan(data: dict, header) -> list[dict]:
    """`catalog.launch_plan` as a list of launches (also where it is given as {"launches": [...]})."""
    from colibri_sdk import catalog

    plan = catalog.launch_plan(data, header)
    return list(plan["launches"] if isinstance(plan, dict) else plan)


def path_label(plan: list[dict]) -> str:
    """"gemv" or "tiled" (or the kernel's catalogue name, for a path added later): the kernel of the first launch
    whose symbol names gate_up."""
    for launch in plan:
        if "gate_up" in launch["symbol"]:
            return PATH_NAMES.get(launch["kernel"], launch["kernel"])
    return "+".join(sorted({launch["kernel"] for launch in plan}))


def path_profiles(base: dict, tokens: int, header, variant: str | None = None) -> list[tuple[str, dict, bool]]:
    """[(path label, profile dict, is the profile's own setting)] for `tokens`: the crossover parameter at its
    maximum ("max") and at its minimum ("min"), so each path of the plan runs, one entry per distinct plan.

    variant: only that setting's entry ([] when it gives the same plan as "max", or when the catalogue has no
    crossover parameter and variant is "min"); None: both.
    """
    data = copy.deepcopy(base)
    data["shape"] = {"batch": 1, "tokens": tokens}
    default_label = path_label(launch_plan(data, header))
    found = crossover_param()
    variants = {"max": data}
    if found:
        kernel, param = found
        variants = {}
        for name, value in (("max", param.maximum), ("min", param.minimum)):
            v = copy.deepcopy(data)
            v["kernels"][kernel][param.name] = value
            v["kernels"][kernel].pop("max_pairs_quantized", None)  # optional: the forced value then holds for all
            variants[name] = v
    out, seen = [], set()
    for name, v in variants.items():
        label = path_label(launch_plan(v, header))
        if label not in seen:
            seen.add(label)
            if variant in (None, name):
                out.append((label, v, label == default_label))
    return out


def selected_experts(device: Device, weights: int, header, x: np.ndarray, layer: int = 0) -> list[int]:
    """Experts that tokens x (tokens, hidden) float32 select at `layer`: top-k of x @ router, the router read back
    from the weights buffer as fp16 (H, E) and widened to float32."""
    from colibri_sdk.format.constants import HEADER_SIZE

    h, e = header.hidden_size, header.num_experts
    dtype = router_dtype(header)
    offset = header.tensor_offset("router", layer) - HEADER_SIZE
    router = device.to_host(weights + offset, h * e * dtype.itemsize).view(dtype).reshape(h, e).astype(np.float32)
    logits = x.astype(np.float32) @ router
    top = np.argsort(-logits, axis=1, kind="stable")[:, : header.top_k]
    return sorted(int(v) for v in np.unique(top))


def router_dtype(header) -> np.dtype:
    """The router's stored dtype: fp16 in a v1 file, as its block says in a v2 file (fp32 for int8/int4 experts)."""
    block = getattr(header, "block", None)
    return np.dtype(block("router").dtype) if block else np.dtype(np.float16)


def expert_bytes(header) -> int:
    """gate + up + down of one expert as stored (with scales and zero points), in bytes."""
    if hasattr(header, "blocks"):
        return sum(b.tensor_bytes for b in header.blocks() if b.tensor in ("gate_proj", "up_proj", "down_proj"))
    return 3 * header.hidden_size * header.intermediate_size * header.itemsize


def router_bytes(header) -> int:
    return header.hidden_size * header.num_experts * router_dtype(header).itemsize


class LayerRun:
    """The compiled kernels, scratch buffers, pinned input/output and prepared launches of one profile, over a
    weights buffer shared between runs.

    Args:
        device: the `Device`.
        data: a profile dict (validated here with the installed NVRTC).
        header: the weights' `Header`.
        weights: device address of the weights buffer (`weights_bytes(data, header)` bytes).

    Raises:
        PlanError: the plan names an unknown argument kind, buffer or symbol.
        CompileError, CudaError: NVRTC or a driver call failed.
    """

    def __init__(self, device: Device, data: dict, header, weights: int):
        from colibri_sdk import catalog
        from colibri_sdk.aot.kernels import compile_catalog
        from colibri_sdk.profile import Profile

        self.device, self.header, self.weights = device, header, weights
        profile = Profile.from_dict(data)
        self.data = profile.to_dict()
        self.plan = launch_plan(self.data, header)
        self.path = path_label(self.plan)
        t = time.perf_counter()
        compiled = compile_catalog(profile, header, workers=4, cache=fake_nvrtc_cache())
        self.compile_s = time.perf_counter() - t
        self.resources = {s: r for kernel in compiled for s, r in kernel.resources.items()}  # ptxas, per symbol
        self.functions = {}
        if FAKE:
            # the CPU emulation is built for the kernels the plan launches only (g++ time); their modules alone load
            launched = {launch["symbol"] for launch in self.plan}
            compiled = [kernel for kernel in compiled if launched & set(kernel.spec.symbols)]
        units = [(kernel.spec.source, kernel.spec.symbols) for kernel in compiled] if FAKE else None
        for kernel in compiled:
            module = device.load(kernel.output.cubin, (catalog.kernel_dir(), units, kernel.defines))
            for symbol in kernel.spec.symbols:
                self.functions[symbol] = device.function(module, symbol)
        self.buffer_sizes = catalog.device_buffers(self.data, header)
        self.buffers = {name: device.alloc(size) for name, size in sorted(self.buffer_sizes.items())}
        self.io = io_buffers(self.data, header)
        for role, name in self.io.items():
            if name not in self.buffers:
                raise PlanError(f"io_buffers names {name!r} for {role}; the device buffers are {sorted(self.buffers)}")
        self.launches = [self._prepare(launch) for launch in self.plan]
        self.tokens = self.data["shape"]["batch"] * self.data["shape"]["tokens"]
        self.io_bytes = self.tokens * header.hidden_size * 4
        self.in_ptr, self.in_view = device.pinned(self.io_bytes)
        self.out_ptr, self.out_view = device.pinned(self.io_bytes)
        self.valid_ptr, self.valid_view = device.pinned(4)
        self.valid_view.view(np.int32)[0] = self.tokens
        self.graph = None

    def _prepare(self, launch: dict) -> tuple:
        values = []
        for arg in launch["args"]:
            kind = arg.get("kind")
            if kind == "buffer":
                if arg["name"] not in self.buffers:
                    raise PlanError(f"launch {launch['symbol']} names buffer {arg['name']!r}; "
                                    f"known: {sorted(self.buffers)}")
                values.append((np.uint64, self.buffers[arg["name"]]))
            elif kind == "weights":
                values.append((np.uint64, self.weights + int(arg["offset"])))
            elif kind == "null":
                values.append((np.uint64, 0))
            elif kind in SCALAR_KINDS:
                values.append((SCALAR_KINDS[kind], arg["value"]))
            else:
                raise PlanError(f"launch {launch['symbol']}: argument kind {kind!r}; known: buffer, weights, null, "
                                f"{', '.join(SCALAR_KINDS)}")
        if launch["symbol"] not in self.functions:
            raise PlanError(f"launch plan names {launch['symbol']!r}; compiled: {sorted(self.functions)}")
        params, keep = pointer_args(values)
        function, shared = self.functions[launch["symbol"]], int(launch.get("shared_bytes", 0))
        if shared > 48 << 10:
            self.device.allow_shared(function, shared)
        return function, tuple(launch["grid"]), tuple(launch["block"]), shared, params, keep

    # ---- one forward pass -----------------------------------------------------------------------------------
    def set_input(self, x: np.ndarray, valid: int | None = None) -> None:
        """x: float32 (tokens, hidden) at the profile's shape; valid: the valid-token count (default: all)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        assert x.shape == (self.tokens, self.header.hidden_size), (x.shape, self.tokens)
        self.in_view[:] = x.reshape(-1).view(np.uint8)
        self.valid_view.view(np.int32)[0] = self.tokens if valid is None else int(valid)

    def enqueue(self, launches: bool = True) -> None:
        d, cu = self.device, self.device.cu
        d.check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(self.buffers[self.io["input"]]), self.in_ptr, self.io_bytes,
                                     d.stream), "cuMemcpyHtoDAsync")
        if "valid_tokens" in self.io:
            d.check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(self.buffers[self.io["valid_tokens"]]), self.valid_ptr, 4,
                                         d.stream), "cuMemcpyHtoDAsync")
        if launches:  # the plan's "pdl" launches after the first (it follows the input copy) with the attribute
            for i, (function, grid, block, shared, params, _) in enumerate(self.launches):
                d.launch(function, grid, block, shared, params, pdl=i > 0 and bool(self.plan[i].get("pdl")))
        d.check(cu.cuMemcpyDtoHAsync(self.out_ptr, cu.CUdeviceptr(self.buffers[self.io["output"]]), self.io_bytes,
                                     d.stream), "cuMemcpyDtoHAsync")

    def run(self, x: np.ndarray, valid: int | None = None) -> np.ndarray:
        """One eager forward pass; returns the output (tokens, hidden) float32."""
        self.set_input(x, valid)
        self.enqueue()
        self.device.sync()
        return self.out_view.view(np.float32).reshape(self.tokens, self.header.hidden_size).copy()

    # ---- timings --------------------------------------------------------------------------------------------
    def time_kernels(self, bench_kernels: dict, iters: int, warm: int) -> tuple[list[dict], bool]:
        """Per-launch event times (the inputs in the buffers are those of the last forward pass).
        Returns ([stats per launch], gap_free)."""
        d = self.device
        events = [d.event() for _ in range(len(self.launches) + 1)]
        samples: list[list[float]] = [[] for _ in self.launches]
        gap_free = True
        for it in range(warm + iters):
            keep = spin(d, bench_kernels, SPIN_CYCLES)
            t = time.perf_counter()
            d.record(events[0])
            for i, (function, grid, block, shared, params, _) in enumerate(self.launches):
                d.launch(function, grid, block, shared, params)
                d.record(events[i + 1])
            enqueue_ms = (time.perf_counter() - t) * 1e3
            d.sync()
            del keep
            if it >= warm:
                for i in range(len(self.launches)):
                    samples[i].append(d.elapsed_ms(events[i], events[i + 1]))
                gap_free &= enqueue_ms < SPIN_CYCLES / 2.5e6  # the wait lasts >= 0.4 ms at <= 2.5 GHz
        return [stats_us(s) for s in samples], gap_free

    def time_eager(self, iters: int, warm: int) -> dict:
        d = self.device
        start, stop = d.event(), d.event()
        samples, wall = [], []
        for it in range(warm + iters):
            t = time.perf_counter()
            d.record(start)
            self.enqueue()
            d.record(stop)
            ms = d.elapsed_ms(start, stop)
            if it >= warm:
                samples.append(ms)
                wall.append((time.perf_counter() - t) * 1e3)
        return {**stats_us(samples), "wall_median_us": round(1e3 * float(np.median(wall)), 3)}

    def time_graph(self, iters: int, warm: int) -> dict:
        d = self.device
        if self.graph is None:
            self.graph = d.capture(self.enqueue)
        start, stop = d.event(), d.event()
        samples, wall = [], []
        for it in range(warm + iters):
            t = time.perf_counter()
            d.record(start)
            d.graph_launch(self.graph[1])
            d.record(stop)
            ms = d.elapsed_ms(start, stop)
            if it >= warm:
                samples.append(ms)
                wall.append((time.perf_counter() - t) * 1e3)
        return {**stats_us(samples), "wall_median_us": round(1e3 * float(np.median(wall)), 3)}

    def close(self) -> None:
        if self.graph is not None:
            self.device.destroy_graph(*self.graph)
            self.graph = None
        for ptr in self.buffers.values():
            self.device.free(ptr)
        self.buffers = {}

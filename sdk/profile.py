"""Device profiles (profiles/*.yaml): the target arch and toolkit, the fixed shape, the kernel tile sizes, and the
hardware facts the build checks against. Spec: docs/profiles.md.

    profile = load_profile("orin")                 # the packaged profiles/orin.yaml
    profile = load_profile("my/board.yaml")        # a path is used as it is
    profile.arch, profile.compute_capability, profile.to_dict()

Validation is strict: an unknown or duplicate key, a missing key, a wrong type, a value out of range, shared memory
above the arch's limit, or an arch / toolkit the installed NVRTC cannot build for is a ProfileError naming the key
path, the value seen and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable

from .catalog import KERNELS, MAX_TOP_K, gemv_max_tokens
from .kernel_table import Param
from .errors import ProfileError
from .yaml_reader import parse_yaml

DTYPES = ("fp16", "fp32")
AGGREGATIONS = ("ordered", "atomic")
MAX_TOKENS = 65536  # batch * tokens: the kernels index (token, slot) pairs with 32-bit integers, kept far below
MAX_SHAPE_VALUES = 8  # entries of a shape.batch / shape.tokens list: every (batch, tokens) pair is compiled

# Shared memory per arch (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability", table
# "Maximum amount of shared memory per thread block" with opt-in, and "... per SM"), bytes.
# Without opt-in a block may use 48 KiB on every arch listed.
SHARED_MEMORY_PER_BLOCK = 49152
ARCH_SHARED_MEMORY: dict[int, tuple[int, int]] = {
    # cc: (per block with opt-in, per SM)
    70: (98304, 98304),
    72: (98304, 98304),
    75: (65536, 65536),
    80: (166912, 167936),
    86: (101376, 102400),
    87: (166912, 167936),
    89: (101376, 102400),
    90: (232448, 233472),
    100: (232448, 233472),
    120: (101376, 102400),
}

_ARCH = re.compile(r"sm_([1-9][0-9]{1,2})")  # ASCII digits, no leading zero: what NVRTC's -arch accepts


def parse_arch(arch: str) -> tuple[int, int]:
    """"sm_87" → (8, 7); "sm_100" → (10, 0). Raises ProfileError for anything else."""
    match = _ARCH.fullmatch(arch) if isinstance(arch, str) else None
    if not match:
        raise ProfileError(f"target.arch = {arch!r}; allowed: sm_XY, e.g. 'sm_87' (no 'a'/'f' feature suffix)")
    digits = match.group(1)
    return int(digits[:-1]), int(digits[-1])


def _show(value) -> str:
    """repr() cut to a few items and 120 characters: a value in an error message may be a YAML alias bomb whose
    full repr would take minutes and gigabytes."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, 80, 80
    text = short.repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# ---- a tiny declarative schema --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Leaf:
    """One scalar key: its type(s), an optional check returning a reason, and the allowed values for messages."""

    types: tuple[type, ...]
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    required: bool = True

    def validate(self, value, key: str, source: str) -> None:
        type_ok = isinstance(value, self.types) and not (isinstance(value, bool) and bool not in self.types)
        names = " or ".join(t.__name__ for t in self.types)
        if not type_ok:
            raise ProfileError(
                f"{source}: {key} = {_show(value)} ({type(value).__name__}); allowed: {names}"
                + (f", {self.allowed}" if self.allowed else "")
            )
        if self.check is not None and not self.check(value):
            raise ProfileError(f"{source}: {key} = {_show(value)}; allowed: {self.allowed}")


def _int(lo: int, hi: int, extra: str = "", check=None, required=True) -> Leaf:
    def ok(v):
        return lo <= v <= hi and (check is None or check(v))

    return Leaf((int,), ok, f"an integer in {lo}..{hi}" + (f", {extra}" if extra else ""), required)


def _sizes(values) -> bool:
    """An int 1..MAX_TOKENS, or a list of 1..MAX_SHAPE_VALUES such ints in increasing order (no repeats)."""
    if isinstance(values, list):
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        return ok and 1 <= len(values) <= MAX_SHAPE_VALUES and values == sorted(set(values)) and all(
            1 <= v <= MAX_TOKENS for v in values)
    return 1 <= values <= MAX_TOKENS


def _shape_leaf() -> Leaf:
    return Leaf((int, list), _sizes, f"an integer in 1..{MAX_TOKENS}, or a list of 1..{MAX_SHAPE_VALUES} such "
                "integers in increasing order (one compiled shape per batch x tokens pair)")


def shape_values(value) -> list[int]:
    """A validated shape.batch / shape.tokens value (int or list) as a list."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def shape_list(shape: dict) -> list[tuple[int, int]]:
    """Every (batch, tokens) of a validated profile `shape` mapping (the product of its batch and tokens values),
    smallest first: ordered by batch*tokens, then batch, then tokens (the order of the manifest's `shapes`)."""
    pairs = [(b, t) for b in shape_values(shape["batch"]) for t in shape_values(shape["tokens"])]
    return sorted(pairs, key=lambda bt: (bt[0] * bt[1], bt[0], bt[1]))


def _choice(values: tuple[str, ...]) -> Leaf:
    return Leaf((str,), lambda v: v in values, f"one of {list(values)}")


def _kernel_schema() -> dict:
    schema = {}
    for kernel in KERNELS:
        if kernel.params:  # a kernel without parameters (capacity, expert_quant) has no profile section
            schema[kernel.name] = {p.name: p for p in kernel.params}
    return schema


SCHEMA: dict = {
    "name": Leaf((str,), lambda v: bool(re.fullmatch(r"[A-Za-z0-9._-]+", v)), "letters, digits, '.', '_', '-'"),
    "description": Leaf((str,), required=False),
    "target": {
        "arch": Leaf((str,), lambda v: bool(_ARCH.fullmatch(v)), "sm_XY, e.g. 'sm_87'"),
        "toolkit": _int(11, 99, "the CUDA major version the build's NVRTC must have"),
        "min_driver": _int(11000, 99990, "cuDriverGetVersion encoding 1000*major + 10*minor", lambda v: v % 10 == 0),
        "unified_memory": Leaf((bool,), allowed="true or false"),
    },
    "hardware": {
        "sm_count": _int(1, 1024),
        "shared_memory_per_block": _int(1024, SHARED_MEMORY_PER_BLOCK, "bytes without opt-in"),
        "shared_memory_per_block_optin": _int(1024, 1 << 20, "bytes"),
        "shared_memory_per_sm": _int(1024, 1 << 20, "bytes"),
        "memory_bandwidth_gbs": Leaf((int, float), lambda v: 0 < v < 1e5, "a number of GB/s in (0, 100000)"),
    },
    "dtype": _choice(DTYPES),
    "shape": {
        "batch": _shape_leaf(),
        "tokens": _shape_leaf(),
    },
    "kernels": _kernel_schema(),
    "aggregation": _choice(AGGREGATIONS),
    "allow_spills": Leaf((bool,), allowed="true or false"),
    "top_k": _int(1, MAX_TOP_K, "experts per token in place of the model's own k (docs/build.md, \"Top-k override\")",
                  required=False),
    "capacity": Leaf((dict,), allowed="a mapping {factor, mode: hard|soft, policy: score|position, min_capacity, order: policy|choice}", required=False),
    "streams": _int(1, 64, "calls Runtime.submit keeps in flight (default 1)", required=False),
    "programmatic_dependent_launch": Leaf((bool,), allowed="true or false (default false; sm_90 and newer with "
                                          "target.min_driver >= 12030: docs/profiles.md)", required=False),
}
PDL_MIN_CC = 90  # griddepcontrol (PTX ISA 7.8): sm_90 and newer
PDL_MIN_DRIVER = 12030  # stream capture keeps a programmatic edge in the graph (CUgraphEdgeData) from CUDA 12.3


def _validate(data, schema: dict, path: str, source: str) -> None:
    if not isinstance(data, dict):
        where = path or "the profile"
        raise ProfileError(
            f"{source}: {where} is {type(data).__name__} {_show(data)}; allowed: a mapping of {sorted(schema)}"
        )
    for key in data:
        if key not in schema:
            full = f"{path}.{key}" if path else str(key)
            where = f" in {path}" if path else ""
            raise ProfileError(f"{source}: unknown key {_show(full)}; allowed keys{where}: {sorted(schema)}")
    for key, rule in schema.items():
        full = f"{path}.{key}" if path else key
        if key not in data:
            if isinstance(rule, (Leaf, Param)) and not rule.required:
                continue
            raise ProfileError(f"{source}: missing key {full!r}")
        value = data[key]
        if isinstance(rule, dict):
            _validate(value, rule, full, source)
        elif isinstance(rule, Leaf):
            rule.validate(value, full, source)
        else:  # a catalogue Param
            reason = rule.check(value)
            if reason:
                raise ProfileError(
                    f"{source}: {full} = {_show(value)}: {reason}; allowed: {rule.allowed()} ({rule.doc})"
                )


# Keys of the profile a bundle's manifest records that check_recorded leaves to the manifest's own rules: free text
# (checked there as printable) and `shape` (it must give exactly the compiled shapes: bundle.records).
_RECORDED_ELSEWHERE = ("name", "description", "shape")


def check_recorded(data: dict, source: str) -> None:
    """Validate the profile a bundle's manifest records (`manifest["profile"]`): every known key it holds by the
    schema's rule (type, range, choices), as a profile file is checked. Keys may be missing (a bundle built before a
    key existed records a partial profile; a key the catalogue needs is refused when it plans) and keys this SDK does not know are left
    to the manifest's schema_version; `name` and `description` are free text there.

    Raises:
        ProfileError: the first value the schema refuses, naming its key path, the value and what is allowed.
    """
    _validate_present(data, SCHEMA, "", source)
    if "capacity" in data:  # its keys and values, as a profile file's (inspect describes it from these)
        from .capacity import Capacity

        Capacity.from_dict(data["capacity"], f"{source}: capacity")


def _validate_present(data, schema: dict, path: str, source: str) -> None:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: {path or 'the profile'} is {type(data).__name__} {_show(data)}; "
                           f"allowed: a mapping of {sorted(schema)}")
    for key, rule in schema.items():
        if key not in data or (not path and key in _RECORDED_ELSEWHERE):
            continue
        full = f"{path}.{key}" if path else key
        if isinstance(rule, dict):
            _validate_present(data[key], rule, full, source)
        else:
            _validate({key: data[key]}, {key: rule}, path, source)


def _check_limits(data: dict, source: str) -> None:
    """Cross-key checks: the shape's size, shared memory against the arch's hardware limits, expert capacity."""
    if "capacity" in data:
        from .capacity import Capacity

        Capacity.from_dict(data["capacity"], f"{source}: capacity")
    batch, tokens = shape_list(data["shape"])[-1]
    if batch * tokens > MAX_TOKENS:
        raise ProfileError(f"{source}: shape batch*tokens = {batch * tokens}; allowed: at most {MAX_TOKENS}")
    threads = data["kernels"]["small_batch"]["threads"]
    if batch * tokens > gemv_max_tokens(threads):
        raise ProfileError(
            f"{source}: shape batch*tokens = {batch * tokens} (batch {batch} x tokens {tokens}); allowed: at most "
            f"{gemv_max_tokens(threads)} at kernels.small_batch.threads = {threads} (the GEMV kernels' 16 KiB "
            "shared-memory tiles, kernels/small_batch.cu); lower kernels.small_batch.threads or the shape"
        )
    major, minor = parse_arch(data["target"]["arch"])
    cc = major * 10 + minor
    if cc not in ARCH_SHARED_MEMORY:
        known = ", ".join(f"sm_{c}" for c in sorted(ARCH_SHARED_MEMORY))
        raise ProfileError(
            f"{source}: target.arch = {data['target']['arch']!r}: shared memory limits unknown; allowed: {known}"
        )
    optin_limit, sm_limit = ARCH_SHARED_MEMORY[cc]
    hw = data["hardware"]
    arch = data["target"]["arch"]
    checks = (
        ("shared_memory_per_block_optin", hw["shared_memory_per_block"], optin_limit,
         f"shared_memory_per_block ({hw['shared_memory_per_block']}) .. {optin_limit} ({arch} opt-in limit)"),
        ("shared_memory_per_sm", hw["shared_memory_per_block_optin"], sm_limit,
         f"shared_memory_per_block_optin ({hw['shared_memory_per_block_optin']}) .. {sm_limit} ({arch} per-SM limit)"),
    )
    for key, lo, hi, allowed in checks:
        if not lo <= hw[key] <= hi:
            raise ProfileError(f"{source}: hardware.{key} = {hw[key]}; allowed: {allowed}")
    toolkit, driver = data["target"]["toolkit"], data["target"]["min_driver"]
    if data.get("programmatic_dependent_launch") and (cc < PDL_MIN_CC or driver < PDL_MIN_DRIVER):
        raise ProfileError(
            f"{source}: programmatic_dependent_launch = true with target.arch = {arch!r}, target.min_driver = "
            f"{driver}; allowed: sm_90 or newer (griddepcontrol) and min_driver >= {PDL_MIN_DRIVER} (CUDA 12.3: "
            "graphs keep the programmatic edge), else false"
        )
    if driver < toolkit * 1000:
        raise ProfileError(
            f"{source}: target.min_driver = {driver} is a CUDA {driver // 1000}.x driver; allowed: at least "
            f"{toolkit * 1000} (CUDA {toolkit}.0): code built by CUDA {toolkit} (target.toolkit) needs a CUDA "
            f"{toolkit} driver"
        )


def check_toolchain(data: dict, source: str) -> None:
    """The installed NVRTC must have the profile's toolkit major and support its arch.

    Raises:
        ProfileError: naming target.toolkit (with the pip package to install) or target.arch (with the archs the
            installed NVRTC supports).
    """
    from .aot import nvrtc

    major, minor = nvrtc.nvrtc_version()
    toolkit = data["target"]["toolkit"]
    if major != toolkit:
        raise ProfileError(
            f"{source}: target.toolkit = {toolkit}, but the installed NVRTC is {major}.{minor}; "
            f"allowed: {major}, or install NVRTC {toolkit}: {nvrtc.toolkit_hint(toolkit, major)}"
        )
    cc_major, cc_minor = parse_arch(data["target"]["arch"])
    supported = nvrtc.supported_archs()
    if cc_major * 10 + cc_minor not in supported:
        raise ProfileError(
            f"{source}: target.arch = {data['target']['arch']!r} is not supported by the installed NVRTC "
            f"{major}.{minor}; allowed: {', '.join(f'sm_{a}' for a in supported)}"
        )


# ---- the profile ----------------------------------------------------------------------------------------------
def packaged_dir() -> Path:
    """The folder of the shipped profiles: inside the installed package, or profiles/ of a source checkout."""
    from . import profiles

    return Path(profiles.__file__).parent


def packaged_names() -> list[str]:
    """Names of the shipped profiles (file stems), sorted."""
    return sorted(p.stem for p in packaged_dir().glob("*.yaml"))


def resolve(ref: str | os.PathLike) -> Path:
    """A profile reference → its file. A name without a path separator or .yaml/.yml suffix (e.g. "orin") names a
    shipped profile; anything else is a path used as it is.

    Raises:
        ProfileError: no shipped profile of that name, no such file, a folder, or not a regular file.
    """
    text = os.fspath(ref)
    try:
        is_path = os.sep in text or "/" in text or text.endswith((".yaml", ".yml")) or Path(text).is_file()
        path = Path(text) if is_path else packaged_dir() / f"{text}.yaml"
        is_file, is_dir = path.is_file(), is_path and path.is_dir()
        exists = is_path and path.exists()
    except OSError as exc:  # e.g. EACCES on a folder above it: Path.is_file raises what is not "no such file"
        raise ProfileError(f"profile {text!r}: cannot examine it: {exc.strerror}") from None
    if not is_file:
        if is_dir:
            raise ProfileError(f"profile {text!r} is a folder; allowed: a .yaml file or a shipped profile name")
        if exists:  # a device, FIFO or socket: reading it could block or never end
            raise ProfileError(f"profile {text!r} is not a regular file; allowed: a .yaml file or a shipped profile "
                               "name")
        if is_path:
            raise ProfileError(f"profile file {text!r} not found")
        raise ProfileError(f"no shipped profile named {text!r}; allowed: {packaged_names()} or a path to a .yaml file")
    return path


@dataclasses.dataclass(frozen=True)
class Profile:
    """A validated device profile.

    Attributes:
        data: the profile as plain Python values (the YAML structure).
        source: the file it was read from ("<dict>" when built from a dict).
    """

    data: dict
    source: str = "<dict>"

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>", *, toolchain: bool = True) -> "Profile":
        """Validate a profile given as a dict (deep-copied).

        Args:
            toolchain: also check the installed NVRTC against target.toolkit and target.arch.

        Raises:
            ProfileError: the first violation, naming the key path, the value and what is allowed.
        """
        data = copy.deepcopy(data)
        _validate(data, SCHEMA, "", source)
        if toolchain:
            check_toolchain(data, source)
        _check_limits(data, source)
        return cls(data, source)

    def to_dict(self) -> dict:
        """A deep copy of the profile as plain dicts, lists, strings, numbers and booleans."""
        return copy.deepcopy(self.data)

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def stem(self) -> str:
        """The file name without .yaml (what `--profile` takes for a shipped profile), else the name."""
        return Path(self.source).stem if self.source.endswith((".yaml", ".yml")) else self.name

    @property
    def arch(self) -> str:
        return self.data["target"]["arch"]

    @property
    def compute_capability(self) -> tuple[int, int]:
        return parse_arch(self.arch)

    @property
    def toolkit(self) -> int:
        return self.data["target"]["toolkit"]

    @property
    def min_driver(self) -> int:
        return self.data["target"]["min_driver"]

    @property
    def dtype(self) -> str:
        return self.data["dtype"]

    @property
    def shape(self) -> tuple[int, int]:
        """(batch, tokens) of the largest shape (the only one when shape.batch and shape.tokens are integers)."""
        return self.shapes[-1]

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every compiled (batch, tokens), smallest first (`shape_list`): the product of shape.batch and
        shape.tokens when they are lists."""
        return shape_list(self.data["shape"])

    def for_shape(self, batch: int, tokens: int) -> "Profile":
        """This profile with the scalar shape (batch, tokens), one of `shapes`: what the catalogue's functions
        (compile_defines, sizes, launch_plan) take for one compiled shape.

        Raises:
            ProfileError: (batch, tokens) is not one of `shapes`.
        """
        if (batch, tokens) not in self.shapes:
            raise ProfileError(f"{self.source}: shape batch {batch} x tokens {tokens}; allowed: {self.shapes}")
        data = copy.deepcopy(self.data)
        data["shape"] = {"batch": int(batch), "tokens": int(tokens)}
        return dataclasses.replace(self, data=data)

    @property
    def aggregation(self) -> str:
        return self.data["aggregation"]

    @property
    def allow_spills(self) -> bool:
        return self.data["allow_spills"]

    @property
    def hardware(self) -> dict:
        return dict(self.data["hardware"])


def load_profile(ref: str | os.PathLike, *, toolchain: bool = True) -> Profile:
    """Read and validate a profile: a shipped name ("orin") or a path to a YAML file.

    Args:
        toolchain: also check the installed NVRTC (toolkit major, supported archs). The build needs it; reading
            a profile for anything else does not.

    Raises:
        ProfileError: no such profile, invalid YAML, or a schema violation (see `Profile.from_dict`).
    """
    path = resolve(ref)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{source}: cannot read: {exc}") from exc
    return Profile.from_dict(parse_yaml(text, source), source, toolchain=toolchain)

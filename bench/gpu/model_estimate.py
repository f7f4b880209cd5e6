"""Resident blocks per SM from a kernel's ptxas resources, and the time model's estimates
(bench/results/kernel_model.json, bench/kernel_model.py) beside the GPU check's measured times, so that the first
GPU run calibrates the model. Every value here is an ESTIMATE, not a measurement.

Occupancy rules (CUDA C++ Programming Guide, "Compute Capabilities", table of technical specifications): 65536
32-bit registers per SM, allocated per warp in units of 256; 1 KiB of shared memory reserved per block (sm_80 and
later); at most 2048 threads per SM on sm_80 and sm_90, 1536 on sm_86, sm_87 and sm_89; at most 32 blocks per SM on
sm_80 and sm_90, 16 on sm_86 and sm_87, 24 on sm_89.
"""

from __future__ import annotations

import json
from pathlib import Path

REGISTERS_SM = 65536
REGISTER_UNIT = 256
SHARED_RESERVED = 1024
ARCH_LIMITS = {  # arch: (max threads per SM, max blocks per SM)
    "sm_80": (2048, 32), "sm_86": (1536, 16), "sm_87": (1536, 16), "sm_89": (1536, 24), "sm_90": (2048, 32),
}
ARCH_DEVICE = {"sm_87": "orin", "sm_80": "a100", "sm_89": "rtx4090", "sm_90": "h200"}  # the model's device keys
RESULTS = Path(__file__).resolve().parents[1] / "results" / "kernel_model.json"


def resident_blocks(arch: str, threads: int, registers: int | None, shared_bytes: int | None,
                    shared_per_sm: int) -> int:
    """Blocks of one kernel resident per SM (at least 1) by threads, registers and static shared memory."""
    max_threads, max_blocks = ARCH_LIMITS.get(arch, (2048, 32))
    warps = -(-threads // 32)
    limit = min(max_blocks, max_threads // max(threads, 1))
    if registers:
        per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        limit = min(limit, REGISTERS_SM // (per_warp * warps))
    if shared_bytes is not None:
        limit = min(limit, shared_per_sm // (shared_bytes + SHARED_RESERVED))
    return max(limit, 1)


class Estimates:
    """The committed estimates: est(arch, storage, tokens) -> {"layer_us", "kernels": {symbol: us}} or None."""

    def __init__(self, path: Path = RESULTS):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            data = {}
        self._cases = {(c["device"], c["storage"], c["tokens"]): c for c in data.get("cases", [])}

    def est(self, arch: str, storage: str, tokens: int) -> dict | None:
        case = self._cases.get((ARCH_DEVICE.get(arch), storage, tokens))
        if case is None:
            return None
        return {"layer_us": case["est_layer_us"], "floor_fraction": case["est_floor_fraction"],
                "kernels": {k["symbol"]: k["time_us"] for k in case["kernels"]}}

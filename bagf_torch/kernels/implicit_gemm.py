"""Kernel family ``implicit_gemm``: fp32 direct convolution as an implicit GEMM (csrc/kernels/implicit_gemm.cuh).

GEMM view: M = K (output channels), N = N*P*Q (output pixels), reduction over C*R*S. One block computes a
BM x BN tile of the output, stepping BK at a time through C*R*S; each thread keeps a TM x TN register tile.

Knobs (template parameters) and the validity rules enforced before anything is compiled:

========  ===========================  =====================================================================
knob      values                       rule
========  ===========================  =====================================================================
BM        16 32 64 128                 TM <= BM (both powers of two, so TM divides BM)
BN        16 32 64 128 256             TN <= BN
BK        4 8 16 32                    BK % VEC == 0
TM, TN    1 2 4 8                      threads = (BM/TM)*(BN/TN) is a multiple of 32 in [32, 1024]
DB        0 1 (double buffering)       threads % BN == 0 (each thread gathers one fixed column of the input
                                       tile, so its output pixel is decoded once per block, not per K-step)
VEC       1 4 (float4 weight loads)    shared memory 4*(1+DB)*BK*(BM+1+BN) bytes <= the device's opt-in
                                       per-block limit (227 KiB on sm_90)
                                       estimated registers per thread <= 255 and
                                       * threads <= 65536 (else it spills)
========  ===========================  =====================================================================

Every configuration is valid for every problem: shapes are run-time arguments, all accesses are
bounds-checked, and VEC=4 falls back to scalar loads inside the kernel when C*R*S % 4 != 0.
"""

from __future__ import annotations

from typing import Mapping

from .geometry import LaunchGeometry
from .space import (MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM, Config, Space, loader_rule, register_rule,  # noqa: F401
                    shared_memory_rule, template_expression, thread_count_rule)

FAMILY = "implicit_gemm"
SOURCE = "implicit_gemm.cuh"
KERNEL = "bagf::implicit_gemm_conv2d"
TEMPLATE_ORDER = ("BM", "BN", "BK", "TM", "TN", "DB", "VEC")
MIN_ARCH = 50

PARAMS: dict[str, tuple[int, ...]] = {
    "BM": (16, 32, 64, 128),
    "BN": (16, 32, 64, 128, 256),
    "BK": (4, 8, 16, 32),
    "TM": (1, 2, 4, 8),
    "TN": (1, 2, 4, 8),
    "DB": (0, 1),
    "VEC": (1, 4),
}

# Hand-picked starting point, the "untuned" configuration the seeds compare against: the classic 64x64
# SGEMM tile with 4x4 per thread (256 threads), 8-deep K-steps, double buffered, float4 weight loads.
DEFAULT: Config = {"BM": 64, "BN": 64, "BK": 8, "TM": 4, "TN": 4, "DB": 1, "VEC": 4}

# sm_90's opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200).
SM90_SMEM_LIMIT = 232448


def threads(c: Mapping[str, int]) -> int:
    return (c["BM"] // c["TM"]) * (c["BN"] // c["TN"])


def smem_bytes(c: Mapping[str, int]) -> int:
    stages = 2 if c["DB"] else 1
    return 4 * stages * c["BK"] * (c["BM"] + 1 + c["BN"])


def estimated_registers(c: Mapping[str, int]) -> int:
    """Live registers per thread: accumulators, fragments, the staging registers of one K-step's global loads
    (held across the multiply when DB=1, between load and store otherwise), plus ~32 for addressing.
    Checked against ptxas's report in tests/test_nvcc.py."""
    t = threads(c)
    a_loads = -(-(c["BM"] * c["BK"] // c["VEC"]) // t) * c["VEC"]
    b_loads = -(-c["BK"] // max(1, t // c["BN"]))
    return c["TM"] * c["TN"] + c["TM"] + c["TN"] + a_loads + b_loads + 32


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    """What the host needs to launch one instantiation: tile sizes for the grid, block size, shared memory."""
    return LaunchGeometry(bm=c["BM"], bn=c["BN"], threads=threads(c), smem=smem_bytes(c))


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """Readable, filename-safe name of one instantiation, e.g. ``implicit_gemm_bm64_bn64_bk8_tm4_tn4_db1_v4_sm90``."""
    return (f"{FAMILY}_bm{c['BM']}_bn{c['BN']}_bk{c['BK']}_tm{c['TM']}_tn{c['TN']}"
            f"_db{c['DB']}_v{c['VEC']}_{arch}")


def name_expression(c: Mapping[str, int]) -> str:
    """The C++ name NVRTC instantiates, e.g. ``bagf::implicit_gemm_conv2d<64, 64, 8, 4, 4, 1, 4>``."""
    return template_expression(KERNEL, TEMPLATE_ORDER, c)


def _rules(smem_limit: int):
    def tile(c):
        if c["TM"] > c["BM"] or c["TN"] > c["BN"]:
            return f"register tile {c['TM']}x{c['TN']} larger than block tile {c['BM']}x{c['BN']}"
        return None

    def vector(c):
        if c["BK"] % c["VEC"]:
            return f"BK={c['BK']} is not a multiple of VEC={c['VEC']}"
        return None

    return (tile, thread_count_rule(threads), loader_rule(threads), vector, shared_memory_rule(smem_bytes, smem_limit),
            register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    """The family's search space for a device with ``smem_limit`` bytes of opt-in shared memory per block."""
    return Space(FAMILY, PARAMS, _rules(smem_limit))

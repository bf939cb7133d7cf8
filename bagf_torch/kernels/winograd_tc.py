"""Kernel family ``winograd_tc``: the fused Winograd F(2x2,3x3) / F(4x4,3x3) convolution of the ``winograd``
family with its Winograd-domain products on tensor cores (csrc/kernels/winograd_tc.cuh).

Same dataflow, transforms, output stage, applicability (3x3, stride 1, dilation 1) and launch geometry as
:mod:`.winograd` (the kernels share ``wino::channel_loop`` and ``wino::output_round``); the E independent
BK x BT x BC products run as mma.sync m16n8k8 with three TF32 products per fragment pair ("3xTF32", as in
:mod:`.implicit_gemm_tc`), so the error stays at fp32 level and the correctness check's tolerance is the one
every family meets. Why a family of its own and not a knob of ``winograd``: the thread layout is by warps and
mma tiles (WK, WT, WE) where the FFMA kernel has per-thread register tiles (TK, TT, EG); one family with both
would make half of every configuration meaningless.

========  =====================  =================================================================
knob      values                 rule
========  =====================  =================================================================
MT        2 4                    output tile: F(MTxMT, 3x3); E = (MT+2)^2 Winograd points
BK        16 32 64               output channels per block; BK % (16*WK) == 0
BT        16 32 64               output tiles per block; BT % (8*WT) == 0
BC        8 16                   input channels per chunk (shared memory 4*E*BC*(BK+BT+16) bytes)
WK, WT    1 2 4                  warps along output channels / tiles (warp tile: whole 16 x 8 mma tiles)
WE        1 2 3 4 6 8 9 12 ...   warp groups over the E points: E % WE == 0; threads 32*WK*WT*WE in
                                 [64, 1024]
DB        0 1                    1: prefetch the next chunk's raw patches and weights into registers
SPLIT     1 2 4 8 16             input-channel slices (grid.z), added atomically into a zeroed output
========  =====================  =================================================================
"""

from __future__ import annotations

from typing import Mapping

from . import winograd as _wg
from .geometry import LaunchGeometry
from .space import (Config, Space, register_rule, resident_blocks, shared_memory_rule, template_expression,
                    thread_count_rule)

FAMILY = "winograd_tc"
SOURCE = "winograd_tc.cuh"
KERNEL = "bagf::winograd_tc_conv2d"
TEMPLATE_ORDER = ("MT", "BK", "BT", "BC", "WK", "WT", "WE", "DB", "SPLIT")
MIN_ARCH = 80  # mma.sync TF32, as implicit_gemm_tc

PARAMS: dict[str, tuple[int, ...]] = {
    "MT": (2, 4),
    "BK": (16, 32, 64),
    "BT": (16, 32, 64),
    "BC": (8, 16),
    "WK": (1, 2, 4),
    "WT": (1, 2, 4),
    "WE": (1, 2, 3, 4, 6, 8, 9, 12, 16, 18, 36),
    "DB": (0, 1),
    "SPLIT": (1, 2, 4, 8, 16),
}

# Hand-picked start, the FFMA family's block shape: F(4x4), 32 channels x 16 tiles, 8-channel chunks, warps
# 2 x 1 (16 x 16 warp tiles: one mma row, two columns) x 4 groups of 9 points (256 threads, 72 accumulators).
DEFAULT: Config = {"MT": 4, "BK": 32, "BT": 16, "BC": 8, "WK": 2, "WT": 1, "WE": 4, "DB": 0, "SPLIT": 1}

# The tuner's start point before split sizing: F(2x2), 32 channels x 32 tiles per block, 16-channel chunks,
# one 32 x 32 warp tile per point (2 x 4 mma tiles, so each fragment's split serves 4 or 2 products) and 8
# warps of 2 points each. In the H200 sample (benchmarks/results/winograd_tc_sample_h200.md, 120 random
# configurations) it was the best on all seven N=32/128 problems (AlexNet conv3-5 and a 3x3 256@56 layer).
START: Config = {"MT": 2, "BK": 32, "BT": 32, "BC": 16, "WK": 1, "WT": 1, "WE": 8, "DB": 0, "SPLIT": 1}

PAD = 8  # shared-memory row padding (winograd_tc.cuh: BK+8, BT+8)
H200_SMS = _wg.H200_SMS
SM90_SMEM_LIMIT = _wg.SM90_SMEM_LIMIT
applies = _wg.applies
points = _wg.points


def threads(c: Mapping[str, int]) -> int:
    return 32 * c["WK"] * c["WT"] * c["WE"]


def out_rounds(c: Mapping[str, int]) -> int:
    """Passes of the output stage over the tiles (warp columns WT; the kernel's ``wino::out_rounds``)."""
    return _wg.rounds_for(c, c["WT"], PAD)


def smem_bytes(c: Mapping[str, int]) -> int:
    return _wg.smem_bytes_for(c, c["WT"], PAD)


def accumulators(c: Mapping[str, int]) -> int:
    """Accumulator registers per thread: E/WE points x the warp tile's (BK/WK) x (BT/WT) outputs / 32 lanes."""
    return points(c) // c["WE"] * (c["BK"] // c["WK"]) * (c["BT"] // c["WT"]) // 32


def estimated_registers(c: Mapping[str, int]) -> int:
    """Accumulators, the split fragments of one reduction step (A: 8 per 16-row mma tile, B: 4 per 8-column
    one), the live transform tile (2 x (MT+2)^2, as for ``winograd``), DB's prefetch registers and ~30 for
    addressing."""
    frags = 8 * (c["BK"] // c["WK"] // 16) + 4 * (c["BT"] // c["WT"] // 8)
    return (accumulators(c) + frags + 2 * points(c) + _wg.prefetch_registers(c, threads(c)) + 30)


def blocks_per_sm(c: Mapping[str, int]) -> int:
    return resident_blocks(threads(c), smem_bytes(c), estimated_registers(c))


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    """As ``winograd``: grid x over ceil(tiles / BT) (tile = MT), y over ceil(K / BK), z = SPLIT."""
    return _wg.launch_for(c, threads(c), smem_bytes(c))


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``winograd_tc_f4_bk32_bt16_bc8_wk2_wt1_we4_db0_s1_sm90``."""
    return (f"{FAMILY}_f{c['MT']}_bk{c['BK']}_bt{c['BT']}_bc{c['BC']}_wk{c['WK']}_wt{c['WT']}_we{c['WE']}"
            f"_db{c['DB']}_s{c['SPLIT']}_{arch}")


def name_expression(c: Mapping[str, int]) -> str:
    return template_expression(KERNEL, TEMPLATE_ORDER, c)


def default_for(problem, sms: int = H200_SMS) -> Config:
    """START with the input-channel split sized to the problem, by the ``winograd`` family's rule
    (``winograd.sized_start``: at least 2 blocks per SM, at least 2 chunks per slice)."""
    return _wg.sized_start(START, problem, sms)


def _rules(smem_limit: int):
    def warp_tiles(c):
        if c["BK"] % (16 * c["WK"]) or c["BT"] % (8 * c["WT"]):
            return (f"warp tile {c['BK']}/{c['WK']} x {c['BT']}/{c['WT']} is not whole 16 x 8 mma tiles")
        return None

    return (_wg.points_rule("WE"), warp_tiles, thread_count_rule(threads, minimum=64), shared_memory_rule(smem_bytes, smem_limit),
            register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    return Space(FAMILY, PARAMS, _rules(smem_limit))

"""Kernel family ``implicit_gemm_tc``: fp32 implicit-GEMM convolution on tensor cores, 3xTF32 (csrc/kernels/implicit_gemm_tc.cuh).

Same GEMM view as ``implicit_gemm`` (M = K output channels, N = N*P*Q output pixels, reduction over C*R*S),
but the block's BM x BN tile is cut into WM x WN warp tiles that issue ``mma.sync.m16n8k8`` TF32 products,
and tiles stream through a STAGES-deep ``cp.async`` pipeline (the im2col gather included: out-of-range
elements are zero-filled copies).
Each operand is split into a TF32 "big" part and a TF32 remainder, and three products are accumulated in
fp32, so the result has fp32 accuracy (the tuner's check against float64 applies unchanged; single TF32
fails it). Needs sm_80 or newer.

Knobs (template parameters) and the validity rules enforced before anything is compiled:

========  ===================  =====================================================================
knob      values               rule
========  ===================  =====================================================================
BM        32 64 128            warp tile BM/WM is a multiple of 16 (the mma's M)
BN        32 64 128            warp tile BN/WN is a multiple of 8 (the mma's N)
BK        8 16 32              (multiples of the mma's K = 8)
WM, WN    1 2 4                threads = 32*WM*WN; threads % BN == 0 (input loader: one pixel column
                               per thread)
STAGES    2 3 4                cp.async pipeline depth; shared memory 4*STAGES*(BM*(BK+4) + BK*(BN+8))
                               bytes <= the device's opt-in per-block limit
SPLIT     1 2 4 8 16 32        split-K slices (grid.z); the host zeroes the output and slices add
                               atomically. Estimated registers per thread <= 255 and * threads <= 65536
========  ===================  =====================================================================

Every configuration is valid for every problem: shapes are run-time arguments and all accesses are bounds
checked. SPLIT > 1 makes the summation order vary from run to run (atomics): results differ by float
rounding only, within the same tolerance.
"""

from __future__ import annotations

import math
from typing import Mapping

from .geometry import LaunchGeometry
from .space import (MAX_BLOCKS_PER_SM, MAX_REGISTERS_PER_THREAD, MAX_THREADS_PER_SM, REGISTERS_PER_SM,  # noqa: F401
                    SM90_SMEM_PER_SM, Config, Space, loader_rule, register_rule, resident_blocks, size_split,
                    shared_memory_rule, template_expression)

FAMILY = "implicit_gemm_tc"
SOURCE = "implicit_gemm_tc.cuh"
KERNEL = "bagf::implicit_gemm_tc_conv2d"
TEMPLATE_ORDER = ("BM", "BN", "BK", "WM", "WN", "STAGES", "SPLIT")
MIN_ARCH = 80

PARAMS: dict[str, tuple[int, ...]] = {
    "BM": (32, 64, 128),
    "BN": (32, 64, 128),
    "BK": (8, 16, 32),
    "WM": (1, 2, 4),
    "WN": (1, 2, 4),
    "STAGES": (2, 3, 4),
    "SPLIT": (1, 2, 4, 8, 16, 32),
}

# Hand-picked start: 64x64 block of four 32x32 warp tiles (128 threads), 16-deep K-steps, 3-stage pipeline.
DEFAULT: Config = {"BM": 64, "BN": 64, "BK": 16, "WM": 2, "WN": 2, "STAGES": 3, "SPLIT": 1}

H200_SMS = 132


LARGE_GRID_TILE: Config = {"BM": 128, "BN": 64, "WM": 4, "WN": 2, "STAGES": 2}
"""The block a start point takes where its grid fills the GPU (at least 2 blocks per SM): 128 output channels x 64
pixels, 8 warps of 32 x 32, a 2-stage pipeline (on the N=32 sweep's nine problems 3 stages screened 1.2-3.7% slower
on eight and 3.7% faster on one, ResNet-18's 1x1 stride-2 conv from 64 channels)."""

SMALL_GRID_TILE: Config = {"BM": 128, "BN": 32, "WM": 4, "WN": 2, "STAGES": 3}
"""The block a start point takes where ``LARGE_GRID_TILE``'s grid would leave SMs idle: 128 output channels x 32
pixels, 8 warps of 32 x 16."""


def default_for(problem, sms: int = H200_SMS) -> Config:
    """A 128-channel block, shaped by the grid, with split-K sized to the problem: ``LARGE_GRID_TILE`` (128 x 64)
    where its grid has at least 2 blocks per SM, else ``SMALL_GRID_TILE`` (128 x 32) and the smallest SPLIT that
    gives at least 2 blocks per SM while every slice keeps at least 4 K-tiles. A batch-1 layer has too few output
    tiles to fill the GPU (AlexNet conv4 at N=1: 3x4 = 12 blocks of 64x64 for 132 SMs), so without split-K most
    SMs idle.

    Measured on the H200. At N=1 (the recording, benchmarks/data/implicit_gemm_tc_h200.json.gz), on AlexNet
    conv2-conv5 DEFAULT with split-K takes 1.14-1.40x the recorded optimum and DEFAULT itself 5-14x; the 128 x 32
    block with split-K 1.00-1.48x (conv1 1.07x against 1.67x; 3x3 256@56 1.32x against 1.44x), the geomean of the
    six small-grid problems 1.17x against 1.34x (the 1.48x is conv5, whose optimum there is one noisy per-call
    sample: against its re-recording by queued GPU time, implicit_gemm_tc_n1_h200.json.gz, 1.16x). At N=32
    (benchmarks/results/family_sweep_implicit_gemm_tc_h200_tc_n32: 480 configurations of BM 64/128, BN 32-128,
    BK 8/16, SPLIT 1/2 on ResNet-18's stride-2 3x3 and 1x1 convs, two ResNet-50 1x1 convs and AlexNet conv2, each
    screened from a CUDA graph) the best block is 128 channels tall on eight of the nine (AlexNet conv2, K = 192,
    keeps 64); this rule's start is 0.85-1.00 of the best on all nine, DEFAULT 0.52-0.84. The tuner starts each
    search here (implicit_gemm_tf32 too, whose start is this rule, not measured in TF32 mode); DEFAULT stays the
    "untuned" reference.
    """
    p, q = problem.out_hw

    def blocks(c: Mapping[str, int]) -> int:
        return -(-(problem.n * p * q) // c["BN"]) * -(-problem.k // c["BM"])

    c = dict(DEFAULT, **LARGE_GRID_TILE)
    if blocks(c) < 2 * sms:
        c.update(SMALL_GRID_TILE)
    tiles = -(-(problem.c * problem.r * problem.s) // c["BK"])
    c["SPLIT"] = size_split(PARAMS["SPLIT"], blocks(c), tiles, 4, sms)
    return c


SM90_SMEM_LIMIT = 232448


def blocks_per_sm(c: Mapping[str, int]) -> int:
    """Blocks of ``c`` one SM can hold at once (shared memory, estimated registers, threads), at least 1."""
    return resident_blocks(threads(c), smem_bytes(c), estimated_registers(c))


def features(problem, c: Mapping[str, int], sms: int = H200_SMS) -> dict[str, float]:
    """What a configuration means for ``problem``, beyond its knobs: the search's model (``ax_bo``'s GP) gets
    these next to the knobs, so that it can see how BM, BN and SPLIT combine into parallelism and per-block
    work, which no single knob says (the fastest SPLIT depends on BM and BN through the grid).

    - ``log2_blocks_per_sm``: grid blocks (ceil(N*P*Q/BN) x ceil(K/BM) x SPLIT) per SM, log2;
    - ``log2_k_tiles``: K-tiles each split-K slice reduces (ceil(ceil(C*R*S/BK) / SPLIT)), log2;
    - ``log2_resident``: blocks one SM holds at once (``blocks_per_sm``), log2.
    """
    p, q = problem.out_hw
    grid = -(-(problem.n * p * q) // c["BN"]) * -(-problem.k // c["BM"]) * c["SPLIT"]
    k_tiles = -(-(-(-(problem.c * problem.r * problem.s) // c["BK"])) // c["SPLIT"])
    return {"log2_blocks_per_sm": math.log2(grid / sms), "log2_k_tiles": math.log2(k_tiles),
            "log2_resident": math.log2(blocks_per_sm(c))}


def warps_in_flight(problem, c: Mapping[str, int], sms: int = H200_SMS) -> float:
    """Warps one SM runs at once for ``problem``: min(resident blocks, grid blocks per SM) x warps per block.

    How the search ranks the start point's neighbours before any time is known (``ax_bo``'s
    ``initial_order``): a batch-1 layer leaves most of the GPU idle, so the move that puts the most warps in
    flight is the likeliest to be faster. On the H200 recording's five problems that need a search, the
    one-knob neighbours of the start point that lower it (64-thread blocks, BN=128, a smaller SPLIT, BM=128)
    reach 0.58 of the optimum on average, the others 0.72 (22 and 42 neighbours). It is a prior, not a
    model: the highest is not always the fastest (BN=32 on conv3x3_256_56 at N=1: 0.57 against 0.70 for
    the start), and the way to most optima passes through a neighbour that lowers it (BM=128 halves the
    grid; 5 of the 7 optima have BM=128 and get their warps back with WM=4), which is why ax ranks only the
    first two of its initial design by it (docs/strategies.md). Those figures are for neighbours of DEFAULT with
    split-K; ``default_for``'s start is a 128-row block of 8 warps already.
    """
    p, q = problem.out_hw
    grid = -(-(problem.n * p * q) // c["BN"]) * -(-problem.k // c["BM"]) * c["SPLIT"]
    return min(blocks_per_sm(c), grid / sms) * threads(c) / 32


ESTIMATE = {"warp_flops_per_us": 1.0e5, "saturating_warps": 8, "sm_bytes_per_us": 3.0e4, "step_us": 0.02,
            "block_us": 2.0, "dram_bytes_per_us": 4.0e6, "atomic_bytes_per_us": 3.0e6, "warp_tile_penalty": 1.0}
"""Constants of ``estimated_time``, per SM where a rate: plausible orders of magnitude for an H200, picked from a
small grid of such values (3 x 3 x 3 x 3 x 4 x 3 x 3) by how well the estimate ranks the 7 complete problems of the
H200 recording (mean fraction of the optimum among the 16 best-estimated); with any one problem left out the same
values won on 6 of the 7 folds, and the left-out problems' mean was 0.887 against 0.905 on all 7 (docs/strategies.md,
"Cold start")."""


def estimated_time(problem, c: Mapping[str, int], sms: int = H200_SMS) -> float:
    """A roofline-style estimate of ``c``'s time on ``problem`` in microseconds, from the launch geometry alone.

    Each SM runs ceil(grid / SMs) blocks in waves of ``blocks_per_sm``; a block costs a fixed ``block_us``
    (prologue, pipeline fill, epilogue) plus its K-steps (K-tiles per split-K slice), each bound by the SM's
    tensor-core rate (per warp, up to ``saturating_warps`` in flight, lower for small warp tiles, whose
    fragments are loaded and split for fewer products), by its share of the L2 -> SM bandwidth for the A and B
    tiles, or by a minimum step latency; the whole is at least the DRAM time of the I/O model's traffic
    (``iobound.implicit_gemm_tc_traffic``), plus the split-K atomics. It ranks configurations before anything is
    measured (ax's ``cold_order``, when the search starts with no start point and no warm start); its absolute
    values mean little. On the H200 recording's 7 complete problems the 8 best-estimated configurations hold 0.873
    of the optimum in the mean (8 random valid ones: 0.75 in expectation over every valid configuration, 0.775 over those the recording timed in full), the single best-estimated 0.789; it is
    a poor guide on AlexNet conv5 at N=1 (the optimum, 128 x 32 with SPLIT 16, ranks 621st of 2898) and puts the
    95% set first on the two larger problems. Small tiles with a large SPLIT are what it overrates."""
    from ..iobound import implicit_gemm_tc_traffic

    k = ESTIMATE
    p, q = problem.out_hw
    grid = -(-(problem.n * p * q) // c["BN"]) * -(-problem.k // c["BM"]) * c["SPLIT"]
    k_tiles = -(-(-(-(problem.c * problem.r * problem.s) // c["BK"])) // c["SPLIT"])
    resident = blocks_per_sm(c)
    per_sm = -(-grid // sms)
    together, waves = min(resident, per_sm), -(-per_sm // resident)
    warps = c["WM"] * c["WN"]
    tile_efficiency = 1.0 / (1.0 + k["warp_tile_penalty"] * 16 * (c["WM"] / c["BM"] + c["WN"] / c["BN"]))
    rate = k["warp_flops_per_us"] * min(together * warps, k["saturating_warps"]) * tile_efficiency
    step = max(together * 2 * c["BM"] * c["BN"] * c["BK"] / rate,
               together * 4 * (c["BM"] + c["BN"]) * c["BK"] / k["sm_bytes_per_us"], k["step_us"])
    t = implicit_gemm_tc_traffic(problem, c)
    words = t.words_read_input + t.words_read_weight + t.words_written + t.words_read_output
    return (max(waves * (k["block_us"] + k_tiles * step), 4 * words / k["dram_bytes_per_us"])
            + 4 * t.words_read_output / k["atomic_bytes_per_us"])


def threads(c: Mapping[str, int]) -> int:
    return 32 * c["WM"] * c["WN"]


def smem_bytes(c: Mapping[str, int]) -> int:
    return 4 * c["STAGES"] * (c["BM"] * (c["BK"] + 4) + c["BK"] * (c["BN"] + 8))


def estimated_registers(c: Mapping[str, int]) -> int:
    """Accumulators, split fragments (big + small) and the input rows' (c, r, s) counters, plus ~40 for
    addressing (cp.async needs no staging registers)."""
    t = threads(c)
    mi, ni = c["BM"] // c["WM"] // 16, c["BN"] // c["WN"] // 8
    acc = mi * ni * 4
    frags = mi * 8 + ni * 4
    b_loads = -(-c["BK"] // max(1, t // c["BN"]))
    return acc + frags + 3 * b_loads + 40


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    """What the host needs to launch one instantiation: tile sizes for the grid, block size, shared memory,
    split-K slices."""
    return LaunchGeometry(bm=c["BM"], bn=c["BN"], threads=threads(c), smem=smem_bytes(c), split=c["SPLIT"])


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``implicit_gemm_tc_bm64_bn64_bk16_wm2_wn2_st3_s1_sm90``."""
    return (f"{FAMILY}_bm{c['BM']}_bn{c['BN']}_bk{c['BK']}_wm{c['WM']}_wn{c['WN']}"
            f"_st{c['STAGES']}_s{c['SPLIT']}_{arch}")


def name_expression(c: Mapping[str, int]) -> str:
    return template_expression(KERNEL, TEMPLATE_ORDER, c)


def _rules(smem_limit: int):
    def warp_tile(c):
        wtm, wtn = c["BM"] // c["WM"], c["BN"] // c["WN"]
        if c["BM"] % c["WM"] or wtm % 16:
            return f"warp tile over M is BM/WM = {c['BM']}/{c['WM']}, not a multiple of 16"
        if c["BN"] % c["WN"] or wtn % 8:
            return f"warp tile over N is BN/WN = {c['BN']}/{c['WN']}, not a multiple of 8"
        return None

    return (warp_tile, loader_rule(threads), shared_memory_rule(smem_bytes, smem_limit),
            register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    return Space(FAMILY, PARAMS, _rules(smem_limit))

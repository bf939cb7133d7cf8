"""Kernel family ``winograd``: fused fp32 Winograd F(2x2,3x3) / F(4x4,3x3) convolution (csrc/kernels/winograd.cuh).

One kernel per configuration, no workspace: each block transforms its input tiles and filters in shared
memory, accumulates the (m+2)^2 Winograd-domain products over input channels in registers and applies the
inverse transform and bias before it writes the output. The output tile m is a knob (``MT``), so F(2x2) and
F(4x4) are one family and the tuner's budget split between them is the strategy's business, not a fixed share.
Only 3x3, stride-1, dilation-1 convolutions qualify (:func:`applies`); the tuner skips the family elsewhere
and the host op refuses such a plan for any other problem (ATen answers).

Accuracy: F(4x4) transforms have constants up to 8 (A^T) and 1/24 (G), so its fp32 error is several times
direct convolution's (benchmarks/results/winograd_error_cpu.md: norm 1.5e-6 to 1.9e-6, max 6e-6 to 9e-6 on
the AlexNet and ResNet-like 3x3 layers). The tuner's correctness check (``tuning.measure.CudaChecker``:
relative norm error < 1e-4, max < 1e-3 against float64) is the enforced tolerance: a candidate above it on a
layer is rejected like any wrong kernel.

Knobs (template parameters) and the validity rules enforced before anything is compiled:

========  =====================  =================================================================
knob      values                 rule
========  =====================  =================================================================
MT        2 4                    output tile: F(MTxMT, 3x3); E = (MT+2)^2 Winograd points
BK        16 32 64               output channels per block
BT        16 32 64               output tiles per block
BC        4 8 16                 input channels per chunk (shared memory 4*E*BC*(BK+BT+8) bytes)
TK, TT    2 4 8                  register tile per thread over channels x tiles, per Winograd point
EG        1 2 3 ... 18 36        thread groups over the E points: E % EG == 0; threads
                                 EG*(BK/TK)*(BT/TT) in [64, 1024], a multiple of 32
DB        0 1                    1: prefetch the next chunk's raw patches and weights into registers
                                 while this chunk's products run (more registers, see below)
SPLIT     1 2 4 8 16             input-channel slices (grid.z), added atomically into a zeroed output
========  =====================  =================================================================

Shared memory is the larger of the loop's buffers and the output stage's E*BK*(BT/ROUNDS+1) floats
(ROUNDS as in the kernel's ``out_rounds``); it must fit the device's opt-in limit, and the estimated
registers must not spill.
"""

from __future__ import annotations

from typing import Mapping

from .. import winograd_math as _transforms
from .geometry import LaunchGeometry
from .space import (Config, Space, register_rule, resident_blocks, shared_memory_rule, size_split,
                    template_expression, thread_count_rule)

FAMILY = "winograd"
SOURCE = "winograd.cuh"
KERNEL = "bagf::winograd_conv2d"
TEMPLATE_ORDER = ("MT", "BK", "BT", "BC", "TK", "TT", "EG", "DB", "SPLIT")
MIN_ARCH = 70

PARAMS: dict[str, tuple[int, ...]] = {
    "MT": (2, 4),
    "BK": (16, 32, 64),
    "BT": (16, 32, 64),
    "BC": (4, 8, 16),
    "TK": (2, 4, 8),
    "TT": (2, 4, 8),
    "EG": (1, 2, 3, 4, 6, 8, 9, 12, 16, 18, 36),
    "DB": (0, 1),
    "SPLIT": (1, 2, 4, 8, 16),
}

# Hand-picked start: F(2x2), 32 channels x 32 tiles per block, 8-channel chunks, 4x4 register tiles, the 16
# Winograd points over 4 thread groups (256 threads, 64 accumulators each).
DEFAULT: Config = {"MT": 2, "BK": 32, "BT": 32, "BC": 8, "TK": 4, "TT": 4, "EG": 4, "DB": 0, "SPLIT": 1}

H200_SMS = 132
SM90_SMEM_LIMIT = 232448


def applies(problem) -> str | None:
    """None when the family computes ``problem`` (3x3, stride 1, dilation 1, groups 1), else why not."""
    return _transforms.applies(problem)


def points(c: Mapping[str, int]) -> int:
    """E = (MT+2)^2, the Winograd-domain points per tile."""
    return (c["MT"] + 2) ** 2


def threads(c: Mapping[str, int]) -> int:
    return c["EG"] * (c["BK"] // c["TK"]) * (c["BT"] // c["TT"])


def rounds_for(c: Mapping[str, int], columns: int, pad: int) -> int:
    """Passes of the output stage over the tiles (the kernels' ``wino::out_rounds``): the fewest, a power of
    two dividing the ``columns`` of threads (or warps) along the tiles, whose E x BK x (BT/rounds + 1)
    accumulator copy fits in the loop's buffers (rows padded by ``pad`` words)."""
    e, bk, bt = points(c), c["BK"], c["BT"]
    loop = e * c["BC"] * (bk + pad + bt + pad)
    r = 1
    while r < columns and columns % (2 * r) == 0 and e * bk * (bt // r + 1) > loop:
        r *= 2
    return r


def smem_bytes_for(c: Mapping[str, int], columns: int, pad: int) -> int:
    """The larger of the loop's buffers (U and V, rows padded by ``pad``) and the output stage's copy."""
    e, bk, bt = points(c), c["BK"], c["BT"]
    loop = e * c["BC"] * (bk + pad + bt + pad)
    out = e * bk * (bt // rounds_for(c, columns, pad) + 1)
    return 4 * max(loop, out)


def out_rounds(c: Mapping[str, int]) -> int:
    """Passes of the output stage over the tiles (threads along the tiles: BT/TT; rows padded by 4)."""
    return rounds_for(c, c["BT"] // c["TT"], 4)


def smem_bytes(c: Mapping[str, int]) -> int:
    return smem_bytes_for(c, c["BT"] // c["TT"], 4)


def prefetch_registers(c: Mapping[str, int], nthreads: int | None = None) -> int:
    """Registers DB=1 holds across the products: every input patch ((MT+2)^2 words) and filter (9) each of
    the block's ``nthreads`` threads (default: this family's) gathers for the next chunk."""
    if not c["DB"]:
        return 0
    t = nthreads or threads(c)
    return -(-c["BC"] * c["BT"] // t) * points(c) + -(-c["BK"] * c["BC"] // t) * 9


def estimated_registers(c: Mapping[str, int]) -> int:
    """Accumulators (E/EG points x TK x TT) plus the live transform tile (2 x (MT+2)^2 while a tile is
    transformed; the accumulators are live then too), the prefetch registers of DB=1 and ~30 for addressing.
    (ptxas on 48 sampled DB=0 configurations: 55-255 registers, within -20%/+25% of this, no spills.)"""
    acc = points(c) // c["EG"] * c["TK"] * c["TT"]
    return acc + 2 * points(c) + prefetch_registers(c) + c["TK"] + c["TT"] + 30


def blocks_per_sm(c: Mapping[str, int]) -> int:
    """Blocks of ``c`` one SM can hold at once (shared memory, estimated registers, threads), at least 1."""
    return resident_blocks(threads(c), smem_bytes(c), estimated_registers(c))


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    """Grid: x over ceil(tiles / BT) with tile = MT (the host counts N x ceil(P/MT) x ceil(Q/MT) tiles),
    y over ceil(K / BK), z = SPLIT."""
    return launch_for(c, threads(c), smem_bytes(c))


def launch_for(c: Mapping[str, int], nthreads: int, smem: int) -> LaunchGeometry:
    """The plan geometry of a fused Winograd kernel (both Winograd families grid the same way)."""
    return LaunchGeometry(bm=c["BK"], bn=c["BT"], threads=nthreads, smem=smem, split=c["SPLIT"], tile=c["MT"])


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``winograd_f2_bk32_bt32_bc8_tk4_tt4_eg4_db0_s1_sm90``."""
    return (f"{FAMILY}_f{c['MT']}_bk{c['BK']}_bt{c['BT']}_bc{c['BC']}_tk{c['TK']}_tt{c['TT']}_eg{c['EG']}"
            f"_db{c['DB']}_s{c['SPLIT']}_{arch}")


def name_expression(c: Mapping[str, int]) -> str:
    return template_expression(KERNEL, TEMPLATE_ORDER, c)


# The tuner's start point before split sizing: F(4x4), 32 channels x 16 tiles, 4 x 8 register tiles, the 36
# points over 12 groups (192 threads, 96 accumulators each). In the H200 samples (benchmarks/data/samples/,
# benchmarks/results/winograd_sample_h200.md) it is the best sampled configuration (with SPLIT 2) on
# AlexNet conv4/conv5 at N=32, conv3 at N=128 and the 3x3 256@56 layer at N=32, 1-5% ahead of the best
# TK=TT=4 ones (EG=4); cuDNN still wins at N=128 (FFT).
START: Config = {"MT": 4, "BK": 32, "BT": 16, "BC": 8, "TK": 4, "TT": 8, "EG": 12, "DB": 0, "SPLIT": 1}


def sized_start(start: Config, problem, sms: int = H200_SMS) -> Config:
    """``start`` (a fused Winograd configuration, of either Winograd family) with the input-channel split sized
    to the problem: the smallest SPLIT that gives at least 2 blocks per SM while every slice keeps at least 2
    chunks (AlexNet conv3 at N=1 has 16 F(4x4) tiles: 1 x 12 blocks without a split, for 132 SMs). On the
    H200 sample the N=1 AlexNet layers' best configurations split 8-16 ways (2-3 chunks per slice); at least
    4 chunks per slice, the tensor-core family's rule, would cap conv3 at 4."""
    c = dict(start)
    blocks = -(-problem.tiles(c["MT"]) // c["BT"]) * -(-problem.k // c["BK"])
    c["SPLIT"] = size_split(PARAMS["SPLIT"], blocks, -(-problem.c // c["BC"]), 2, sms)
    return c


def default_for(problem, sms: int = H200_SMS) -> Config:
    """START with the input-channel split sized to the problem (:func:`sized_start`)."""
    return sized_start(START, problem, sms)


def points_rule(knob: str):
    """A validity rule: the thread (or warp) groups ``knob`` divide the E Winograd points."""
    def points_divide(c):
        if points(c) % c[knob]:
            return (f"{knob}={c[knob]} does not divide the {points(c)} Winograd points of "
                    f"F({c['MT']}x{c['MT']},3x3)")
        return None
    return points_divide


def _rules(smem_limit: int):
    return (points_rule("EG"), thread_count_rule(threads, minimum=64), shared_memory_rule(smem_bytes, smem_limit),
            register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    return Space(FAMILY, PARAMS, _rules(smem_limit))

"""Kernel family ``direct``: fp32 direct convolution with 2-D output tiles (csrc/kernels/direct.cuh).

The near-I/O-optimal direct dataflow of the I/O lower-bound paper (docs/iobound.md): a block keeps TH x TW output pixels of one image times BK output
channels in registers and streams the input channels through shared memory BC at a time; the input patch of
the tile, halo included, is copied once per chunk ((TH-1)*stride+(R-1)*dil+1 by (TW-1)*stride+(S-1)*dil+1 words
per channel), the chunk's BK x BC x R x S weights too, and each thread accumulates TK output channels x PX
pixels of one output row over (c, r, s) with FFMA. Any kernel size, stride, padding and dilation (groups 1).
Its target is AlexNet conv1 (3 -> 64 channels, 11x11, stride 4), where implicit GEMM gathers every input
word R*S/stride^2 ~ 7.6 times and pads C*R*S = 363 to its K-step.

Knobs (template parameters) and the validity rules enforced before anything is compiled:

========  =====================  =================================================================
knob      values                 rule
========  =====================  =================================================================
TH, TW    2 4 8 16 / 4 8 16 32   output tile rows x columns (one image); grid.x = N*ceil(P/TH)*ceil(Q/TW)
BK        16 32 64               output channels per block (grid.y = ceil(K/BK))
BC        1 2 4 8                input channels per chunk
TK        4 8                    output channels per thread (TK divides BK; float4 weight reads)
PX        2 4 8                  consecutive pixels of one output row per thread (PX divides TW);
                                 TK*PX >= 16: at least 3 FMAs per shared-memory load (a tap costs PX
                                 scalar + TK/4 vector loads for TK*PX FMAs); threads
                                 (BK/TK)*(TH*TW/PX) in [64, 1024], a multiple of 32
DB        0 1                    1: two shared-memory stages, the next chunk's cp.async copies overlap
                                 this chunk's products
SPLIT     1 2 4 8                input-channel slices (grid.z), added atomically into a zeroed output
G         0 1 2 3 4              0: any filter geometry (run-time loops over the filter taps). 1-4: the
                                 kernel is compiled for one filter width and column stride (GEOMETRIES:
                                 11 wide at stride 4, 7 at 2, 5 at 1, 3 at 1; dilation 1) and keeps
                                 each filter row's input window in registers; valid only for problems
                                 of that geometry (:func:`problem_rule`), the host refuses other calls
========  =====================  =================================================================

Why G: with the filter width and stride known at compile time, a thread loads the (PX-1)*KU+KS input words its
PX pixels read along one filter row into registers once and runs the KS taps fully unrolled on them, so AlexNet
conv1 (TK=PX=8) does 704 FMAs per 61 shared-memory loads per filter row, where the run-time loop does 64 FMAs
per 10 loads and recomputes its addresses per tap (benchmarks/results/direct_sample_h200.md: the run-time kernel reached 16.5
TFLOP/s on conv1, a third of the SGEMM ceiling).

Shared memory depends on the problem: ``STAGES*4*BC*(R*S*(BK+4) + rows*pitch)`` bytes (:func:`smem_bytes`,
rows x pitch from :func:`patch`, the kernel's ``bagf::halo_patch``). The host sizes it per call from the
``smem_patch`` and ``smem_taps`` coefficients :func:`launch` returns, and refuses (ATen answers) a call whose
patch would not fit the device. The space's shared-memory rule uses AlexNet conv1's geometry (11x11, stride 4,
the largest footprint in the models this project tunes), so every valid configuration fits conv1 and any
smaller footprint; a configuration too large for some other problem fails there as a typed "launch" failure
(the host's refusal), and :func:`applies` leaves the family out of a problem that not even the smallest
tile fits. Estimated registers must not spill.
"""

from __future__ import annotations

from typing import Mapping

from .geometry import LaunchGeometry
from .space import (Config, Space, register_rule, resident_blocks, shared_memory_rule, size_split,
                    template_expression, thread_count_rule)

FAMILY = "direct"
SOURCE = "direct.cuh"
KERNEL = "bagf::direct_conv2d"
TEMPLATE_ORDER = ("TH", "TW", "BK", "BC", "TK", "PX", "DB", "SPLIT")
MIN_ARCH = 80  # cp.async

PARAMS: dict[str, tuple[int, ...]] = {
    "TH": (2, 4, 8, 16),
    "TW": (4, 8, 16, 32),
    "BK": (16, 32, 64),
    "BC": (1, 2, 4, 8),
    "TK": (4, 8),
    "PX": (2, 4, 8),
    "DB": (0, 1),
    "SPLIT": (1, 2, 4, 8),
    "G": (0, 1, 2, 3, 4),
}

GEOMETRIES: dict[int, tuple[int, int]] = {0: (0, 0), 1: (11, 4), 2: (7, 2), 3: (5, 1), 4: (3, 1)}
"""G -> (KS, KU): the filter width and column stride a specialised kernel is compiled for ((0, 0): any)."""

# Hand-picked start for conv1: 8 x 16 pixels x 64 channels per block (55x55 -> 7 x 4 tiles per image), one
# channel per chunk (C = 3), 8 channels x 4 pixels per thread (32 FMAs per 3 shared-memory loads), 256
# threads, double-buffered. Shared memory at conv1: 2*4*(121*68 + 39*71) = 87976 bytes.
DEFAULT: Config = {"TH": 8, "TW": 16, "BK": 64, "BC": 1, "TK": 8, "PX": 4, "DB": 1, "SPLIT": 1, "G": 0}

H200_SMS = 132
SM90_SMEM_LIMIT = 232448

REFERENCE = {"r": 11, "s": 11, "stride": (4, 4), "dilation": (1, 1)}
"""The filter geometry the space's shared-memory rule is checked at (AlexNet conv1)."""


def _geometry(problem) -> tuple[int, int, tuple[int, int], tuple[int, int]]:
    if problem is None:
        return REFERENCE["r"], REFERENCE["s"], REFERENCE["stride"], REFERENCE["dilation"]
    return problem.r, problem.s, tuple(problem.stride), tuple(problem.dilation)


def patch(c: Mapping[str, int], problem=None) -> tuple[int, int, int]:
    """(rows, cols, pitch) of one channel's input patch of a TH x TW tile, as ``bagf::halo_patch`` computes it
    (conv_params.h): the odd pitch puts rows read at a stride in different banks. ``problem`` None: conv1."""
    r, s, (sh, sw), (dh, dw) = _geometry(problem)
    rows = (c["TH"] - 1) * sh + (r - 1) * dh + 1
    cols = (c["TW"] - 1) * sw + (s - 1) * dw + 1
    return rows, cols, cols | 1


def stages(c: Mapping[str, int]) -> int:
    return 2 if c["DB"] else 1


def smem_taps(c: Mapping[str, int]) -> int:
    """Shared-memory bytes per filter tap (R*S): the weights of every stage, rows padded to BK+4."""
    return 4 * stages(c) * c["BC"] * (c["BK"] + 4)


def smem_patch(c: Mapping[str, int]) -> int:
    """Shared-memory bytes per word of one channel's patch (rows x pitch), over the chunk and the stages."""
    return 4 * stages(c) * c["BC"]


def smem_bytes(c: Mapping[str, int], problem=None) -> int:
    """Dynamic shared memory of ``c`` on ``problem`` (None: AlexNet conv1's 11x11 stride-4 geometry)."""
    r, s, _, _ = _geometry(problem)
    rows, _, pitch = patch(c, problem)
    return smem_taps(c) * r * s + smem_patch(c) * rows * pitch


def threads(c: Mapping[str, int]) -> int:
    return (c["BK"] // c["TK"]) * (c["TH"] * c["TW"] // c["PX"])


def geometry(c: Mapping[str, int]) -> tuple[int, int]:
    """(KS, KU) of ``c``: the filter width and column stride its kernel is compiled for, (0, 0) for any (a config
    without G, e.g. from an older cache, is generic)."""
    return GEOMETRIES[c.get("G", 0)]


def window(c: Mapping[str, int]) -> int:
    """Input words a thread holds in registers per filter row: (PX-1)*KU+KS when specialised (G > 0), else the
    PX operands of one tap."""
    ks, ku = geometry(c)
    return (c["PX"] - 1) * ku + ks if ks else c["PX"]


def estimated_registers(c: Mapping[str, int]) -> int:
    """Accumulators TK*PX, the operands of one tap (TK weights + the input window) and ~30 for addressing and
    loop state. (ptxas for sm_90: TK=8, PX=4 uses 64; TK=4, PX=2 uses 56, both without spills.)"""
    return c["TK"] * c["PX"] + c["TK"] + window(c) + 30


def problem_rule(c: Mapping[str, int], problem) -> str | None:
    """None when ``c`` may run ``problem``: any geometry for G = 0, else the problem's filter width, column stride
    and column dilation must be the ones the kernel was compiled for (the tuner searches only these)."""
    ks, ku = geometry(c)
    if ks and (problem.s, problem.stride[1], problem.dilation[1]) != (ks, ku, 1):
        return (f"compiled for {ks}-wide filters at column stride {ku}; this problem has {problem.s} at "
                f"{problem.stride[1]} (dilation {problem.dilation[1]})")
    return None


def geometry_for(problem) -> int:
    """The G whose specialised kernel computes ``problem``, or 0."""
    return next((g for g in GEOMETRIES if g and problem_rule({"G": g}, problem) is None), 0)


def blocks_per_sm(c: Mapping[str, int], problem=None) -> int:
    """Blocks of ``c`` one SM can hold at once on ``problem`` (shared memory, registers, threads), at least 1."""
    return resident_blocks(threads(c), smem_bytes(c, problem), estimated_registers(c))


def tiles(c: Mapping[str, int], problem) -> int:
    """Output tiles (grid.x): N * ceil(P/TH) * ceil(Q/TW)."""
    p, q = problem.out_hw
    return problem.n * -(-p // c["TH"]) * -(-q // c["TW"])


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    """Grid: x over the N * ceil(P/TH) * ceil(Q/TW) output tiles (``tile`` = TH rows, ``tile_w`` = TW columns,
    one tile per block: ``bn`` = 1), y over ceil(K/BK), z = SPLIT. Shared memory per call is
    ``smem_patch * rows * pitch + smem_taps * R * S`` (the host's ``halo_patch``); ``smem`` is the conv1 size."""
    ks, ku = geometry(c)
    return LaunchGeometry(bm=c["BK"], bn=1, threads=threads(c), smem=smem_bytes(c), split=c["SPLIT"], tile=c["TH"],
                          tile_w=c["TW"], smem_patch=smem_patch(c), smem_taps=smem_taps(c), fix_s=ks, fix_u=ku)


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``direct_th8_tw16_bk64_bc1_tk8_px4_db1_s1_sm90``, or ``..._s1_w11u4_sm90`` specialised (G = 1)."""
    ks, ku = geometry(c)
    return (f"{FAMILY}_th{c['TH']}_tw{c['TW']}_bk{c['BK']}_bc{c['BC']}_tk{c['TK']}_px{c['PX']}_db{c['DB']}"
            f"_s{c['SPLIT']}" + (f"_w{ks}u{ku}" if ks else "") + f"_{arch}")


def name_expression(c: Mapping[str, int]) -> str:
    """``bagf::direct_conv2d<TH, ..., SPLIT>``, with ``, KS, KU`` appended when specialised."""
    ks, ku = geometry(c)
    base = template_expression(KERNEL, TEMPLATE_ORDER, c)
    return base[:-1] + f", {ks}, {ku}>" if ks else base


def applies(problem, smem_limit: int = SM90_SMEM_LIMIT) -> str | None:
    """None when the family computes ``problem``; else why not: groups > 1, or a filter footprint whose patch
    and weights do not fit shared memory with any valid configuration (the least is a small tile, one
    channel per chunk, one stage)."""
    if problem.groups != 1:
        return f"groups={problem.groups}: the direct family handles groups=1 only"
    least = min(_footprints(), key=lambda c: smem_bytes(c, problem))
    need = smem_bytes(least, problem)
    if need > smem_limit:
        rows, cols, _ = patch(least, problem)
        return (f"even the smallest tile's input patch ({rows}x{cols} per channel) and {problem.r}x{problem.s} "
                f"filters need {need} bytes of shared memory ({name(least)}), device limit {smem_limit}")
    return None


_FOOTPRINTS: list[Config] = []


def _footprints() -> list[Config]:
    """One valid configuration per distinct shared-memory footprint (TH, TW, BK, BC, DB), computed once."""
    if not _FOOTPRINTS:
        seen = {}
        for c in space().valid_configs():
            seen.setdefault((c["TH"], c["TW"], c["BK"], c["BC"], c["DB"]), c)
        _FOOTPRINTS.extend(seen.values())
    return _FOOTPRINTS


def default_for(problem, sms: int = H200_SMS) -> Config:
    """DEFAULT with the block sized to the problem: the largest block (of 8 or 4 rows x 16 columns x 64, 32 or
    16 channels) whose grid gives every SM a block (conv1 at N=1 has 28 tiles of 8 x 16 for 132 SMs, so it
    gets 4 x 16 x 32: 112 blocks), then the smallest SPLIT that gives 2 blocks per SM while each slice keeps
    at least 2 chunks (C = 3 never splits; a 256-channel layer at N=1 does). G: the kernel specialised to the
    problem's filter geometry when there is one (:func:`geometry_for`)."""
    valid, g = space(), geometry_for(problem)
    ladder = [dict(DEFAULT, TH=th, BK=bk, G=g) for th, bk in ((8, 64), (8, 32), (4, 64), (4, 32), (8, 16), (4, 16))]
    ladder = [c for c in ladder if valid.is_valid(c)]
    k_blocks = {c["BK"]: -(-problem.k // c["BK"]) for c in ladder}
    blocks = [tiles(c, problem) * k_blocks[c["BK"]] for c in ladder]
    pick = next((i for i, b in enumerate(blocks) if b >= sms), max(range(len(ladder)), key=blocks.__getitem__))
    c = ladder[pick]
    c["SPLIT"] = size_split(PARAMS["SPLIT"], blocks[pick], -(-problem.c // c["BC"]), 2, sms)
    return c


def _rules(smem_limit: int):
    def divides(c):
        if c["BK"] % c["TK"]:
            return f"TK={c['TK']} does not divide BK={c['BK']}"
        if c["TW"] % c["PX"]:
            return f"PX={c['PX']} does not divide TW={c['TW']}"
        return None

    def register_tile(c):
        if c["TK"] * c["PX"] < 16:
            return (f"a {c['TK']}x{c['PX']} register tile does {c['TK'] * c['PX']} FMAs per {c['PX']} + "
                    f"{c['TK'] // 4} shared-memory loads; TK*PX must be at least 16")
        return None

    return (divides, register_tile, thread_count_rule(threads, minimum=64), shared_memory_rule(smem_bytes, smem_limit),
            register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    return Space(FAMILY, PARAMS, _rules(smem_limit))

"""Kernel family ``implicit_gemm_h16``: fp16 and bf16 implicit-GEMM convolution on tensor cores, NCHW and NHWC
(channels_last) (csrc/kernels/implicit_gemm_h16.cuh).

GEMM view as ``implicit_gemm_tc`` (M = K output channels, N = N*P*Q output pixels, reduction over C*R*S), with
``mma.sync.m16n8k16`` on 16-bit operands and fp32 sums: the arithmetic of cuDNN's fp16/bf16 convolutions. The
reduction runs in the memory format's order, (c, r, s) for NCHW and (r, s, c) for NHWC, so that the weight rows
are contiguous (a channels_last weight for NHWC: the host passes one) and an NHWC input with C % 8 == 0 is read
16 bytes at a time. The output has the input's dtype and memory format; bias is added in fp32 before the one
rounding to it.

DT and NHWC are knobs that a problem fixes (:func:`problem_rule`): DT is the dtype (0 fp16, 1 bf16), NHWC the
memory format (0 NCHW, 1 channels_last); the tuner searches the tile knobs for the problem's pair.

ST is the main loop's data path. ST = 2 gathers each K-step into registers while the previous one is multiplied and
stores it into the other of two shared-memory buffers (every format and shape). ST = 3 or 4 is a ring of ST
shared-memory stages filled by 16-byte ``cp.async`` copies ST-1 K-steps ahead (zero-filled where a run is padding
or past the tensor), so global latency hides behind ST-1 K-steps of products instead of one: it needs every
16-byte run contiguous and aligned, which an NHWC input with C % 8 == 0 and a weight with C*R*S % 8 == 0 are
(:func:`problem_rule`). The kernel checks the same (and the pointers' 16-byte alignment) at run time: a launch that
fails it takes ST = 2's path in the same kernel, never a misaligned copy.

Knobs (template parameters) and the validity rules enforced before anything is compiled:

========  ===================  =====================================================================
knob      values               rule
========  ===================  =====================================================================
DT        0 1                  the problem's dtype: 0 float16, 1 bfloat16
NHWC      0 1                  the problem's memory format: 0 NCHW (contiguous), 1 channels_last
BM        32 64 128            warp tile BM/WM is a multiple of 16 (the mma's M)
BN        32 64 128 256        warp tile BN/WN is a multiple of 8 (the mma's N)
BK        16 32 64             (multiples of the mma's K = 16)
WM, WN    1 2 4                threads = 32*WM*WN; estimated registers per thread <= 255 and
                               * threads <= 65536
ST        2 3 4                shared-memory stages: 2 the register double buffer, 3-4 the cp.async
                               pipeline (NHWC only; on a problem: C % 8 == 0 and C*R*S % 8 == 0).
                               Shared memory ST*2*(BM+BN)*(BK+8) bytes <= the device's opt-in
                               per-block limit
SPLIT     1 2 4 8 16           split-K slices (grid.z, not a template parameter); slice z reduces
                               K-steps [z*steps/SPLIT, (z+1)*steps/SPLIT) (an even split); on a
                               problem (:func:`problem_rule`): floor(steps / SPLIT) >= 2, i.e. every
                               slice 2 K-steps or more, and the workspace SPLIT * tiles * BM * BN * 4
                               bytes <= 32 MiB (a grid too small to fill the GPU: batch 1, late layers)
========  ===================  =====================================================================

Shapes are run-time arguments and every access is bounds-checked (C = 3 and channel counts that are not multiples
of 8 take 2-byte loads): a configuration without split-K runs every problem of its dtype and format. With split-K
the slices' fp32 sums meet in a workspace and the last slice of each tile adds them in slice order, so the output
does not depend on which slice finishes last (csrc/kernels/implicit_gemm_h16.cuh).

The correctness check (``tuning.measure.Workspace``) bounds a candidate's error against float64 by twice what
cuDNN's own convolution in the same dtype and format misses by on the same data.
"""

from __future__ import annotations

from typing import Mapping

from .geometry import LaunchGeometry
from .space import (Config, Space, register_rule, resident_blocks, shared_memory_rule, template_expression,
                    thread_count_rule)

FAMILY = "implicit_gemm_h16"
SOURCE = "implicit_gemm_h16.cuh"
KERNEL = "bagf::implicit_gemm_h16_conv2d"
TEMPLATE_ORDER = ("DT", "NHWC", "BM", "BN", "BK", "WM", "WN", "ST")
"""The template parameters; SPLIT is the launch's grid.z, so configurations that differ only in it share a cubin."""
MIN_ARCH = 80  # mma.sync m16n8k16 with bf16, cvt.rn.bf16.f32, ldmatrix
KERNEL_ARGS = ("const unsigned short*, const unsigned short*, const unsigned short*, unsigned short*, "
               "const bagf::Conv2dParams, float*")
"""The kernel's parameter list (16-bit values travel as unsigned short): x, w, bias, y, the shape, the split-K
workspace (null without split-K)."""

DTYPES: dict[str, int] = {"float16": 0, "bfloat16": 1}
"""The problem's dtype name (``ConvProblem.dtype``) -> DT."""
LAYOUTS: dict[str, int] = {"nchw": 0, "nhwc": 1}
"""The problem's memory format (``ConvProblem.layout``) -> NHWC."""

FORMATS: tuple[tuple[str, str], ...] = tuple((d, l) for d in DTYPES for l in LAYOUTS)
"""The (dtype, layout) pairs this family computes (``kernels.format_refuses``)."""

PARAMS: dict[str, tuple[int, ...]] = {
    "DT": (0, 1),
    "NHWC": (0, 1),
    "BM": (32, 64, 128),
    "BN": (32, 64, 128, 256),
    "BK": (16, 32, 64),
    "WM": (1, 2, 4),
    "WN": (1, 2, 4),
    "ST": (2, 3, 4),
    "SPLIT": (1, 2, 4, 8, 16),
}

# Hand-picked start: a 128x128 block of four 64x64 warp tiles would need ~244 registers; 128 x 64 of 2 x 2 warps
# (64 x 32 warp tiles, 128 threads), 32-deep K-steps, the register double buffer (ST = 2 runs every problem of its
# format). DT, NHWC and, where the problem allows the cp.async pipeline, ST are the problem's (default_for).
DEFAULT: Config = {"DT": 1, "NHWC": 1, "BM": 128, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "ST": 2, "SPLIT": 1}
LEGACY: Config = {"SPLIT": 1, "ST": 2}
"""What a configuration recorded before a knob ran stands for (kernels.complete_config): before SPLIT no split-K,
before ST the register double buffer."""

PIPELINE_STAGES: tuple[int, ...] = (3, 4)
"""The ST values of the cp.async pipeline (the 16-byte path of both operands: :func:`pipeline_refuses`)."""

SPLIT_WORKSPACE_LIMIT = 32 << 20
"""Bytes of fp32 partial sums a split-K configuration may ask for on its problem (:func:`problem_rule`)."""

SM90_SMEM_LIMIT = 232448
H200_SMS = 132


def threads(c: Mapping[str, int]) -> int:
    return 32 * c["WM"] * c["WN"]


def smem_bytes(c: Mapping[str, int]) -> int:
    """ST stages (2: the two buffers of the register path) of the BM x BK weight tile and the BN x BK input tile,
    2-byte elements, rows padded by 8: ST * 2 * (BM + BN) * (BK + 8)."""
    return c.get("ST", LEGACY["ST"]) * 2 * (c["BM"] + c["BN"]) * (c["BK"] + 8)


def estimated_registers(c: Mapping[str, int]) -> int:
    """Live registers per thread: the fp32 accumulators, one K-step's fragments, the staging registers of the
    next K-step's loads (4 per 8-element chunk) with the B chunks' pixel and digit registers (7 each), plus ~40
    for addressing. On 24 sampled configurations it was within 30 of ptxas's count for sm_90 (nvcc 13.0: 48-254
    registers, estimates 65-248); the space's register rule uses it. The same for every ST: a pipelined kernel
    (ST >= 3) keeps the register path for launches its 16-byte rule refuses, and its cp.async path needs no
    staging registers (ptxas: the same count as ST = 2's within a few registers)."""
    t = threads(c)
    mi, ni = c["BM"] // c["WM"] // 16, c["BN"] // c["WN"] // 8
    a_loads = -(-(c["BM"] * c["BK"] // 8) // t)
    b_loads = -(-(c["BN"] * c["BK"] // 8) // t)
    return 4 * mi * ni + 4 * mi + 2 * ni + 4 * a_loads + 11 * b_loads + 40


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    return LaunchGeometry(bm=c["BM"], bn=c["BN"], threads=threads(c), smem=smem_bytes(c), split=c["SPLIT"],
                          dtype=1 + c["DT"], nhwc=c["NHWC"])


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``implicit_gemm_h16_bf16_nhwc_bm128_bn64_bk32_wm2_wn2_st2_s1_sm90`` (a configuration recorded without
    ST or SPLIT is named with :data:`LEGACY`'s values)."""
    c = {**LEGACY, **c}
    return (f"{FAMILY}_{'bf16' if c['DT'] else 'fp16'}_{'nhwc' if c['NHWC'] else 'nchw'}_bm{c['BM']}_bn{c['BN']}"
            f"_bk{c['BK']}_wm{c['WM']}_wn{c['WN']}_st{c['ST']}_s{c['SPLIT']}_{arch}")


def name_expression(c: Mapping[str, int]) -> str:
    """e.g. ``bagf::implicit_gemm_h16_conv2d<1, 1, 128, 64, 32, 2, 2, 2>`` (whatever SPLIT: a launch parameter;
    without ST, :data:`LEGACY`'s 2)."""
    return template_expression(KERNEL, TEMPLATE_ORDER, {**LEGACY, **c})


def applies(problem) -> str | None:
    """None for a float16 or bfloat16 problem in NCHW or channels_last."""
    if (problem.dtype, problem.layout) not in FORMATS:
        return f"computes float16 and bfloat16 in NCHW or channels_last; this problem is {problem.dtype} {problem.layout}"
    return None


def pipeline_refuses(problem) -> str | None:
    """Why the cp.async pipeline (ST >= 3) cannot serve ``problem``, or None: its copies are whole 16-byte runs, 8
    channels of one pixel of an NHWC input (C % 8 == 0) and 8 elements of a weight row (C*R*S % 8 == 0)."""
    if problem.layout != "nhwc":
        return f"the cp.async pipeline (ST >= 3) reads channels_last inputs; this problem is {problem.layout}"
    if problem.c % 8:
        return f"the cp.async pipeline (ST >= 3) copies 8 channels at a time; C = {problem.c} is not a multiple of 8"
    crs = problem.c * problem.r * problem.s
    if crs % 8:
        return f"the cp.async pipeline (ST >= 3) copies 8-element weight runs; C*R*S = {crs} is not a multiple of 8"
    return None


def split_range(z: int, k_steps: int, split: int) -> range:
    """The K-steps slice ``z`` of ``split`` reduces: [z*k_steps // split, (z+1)*k_steps // split), the kernel's
    integer arithmetic. The slices cover every step once, in order, and their sizes differ by at most one."""
    return range(z * k_steps // split, (z + 1) * k_steps // split)


def problem_rule(c: Mapping[str, int], problem) -> str | None:
    """None when ``c`` was compiled for the problem's dtype and memory format; with ST >= 3, the problem's operands
    are 16-byte runs (:func:`pipeline_refuses`); with split-K, every slice gets at least 2 K-steps of the problem's
    reduction (the even split :func:`split_range` gives each floor(steps / SPLIT) or one more), within
    :data:`SPLIT_WORKSPACE_LIMIT` bytes of partial sums."""
    want = (DTYPES.get(problem.dtype), LAYOUTS.get(problem.layout))
    if (c["DT"], c["NHWC"]) != want:
        return (f"compiled for {'bfloat16' if c['DT'] else 'float16'} {'nhwc' if c['NHWC'] else 'nchw'}; "
                f"this problem is {problem.dtype} {problem.layout}")
    if c.get("ST", LEGACY["ST"]) in PIPELINE_STAGES:
        why = pipeline_refuses(problem)
        if why is not None:
            return why
    k_steps = -(-(problem.c * problem.r * problem.s) // c["BK"])
    return split_refuses(c.get("SPLIT", 1), k_steps, tiles(c, problem), c["BM"], c["BN"])


def split_refuses(split: int, k_steps: int, tiles: int, bm: int, bn: int, steps: str = "K-steps",
                  workspace: bool = True) -> str | None:
    """Why a split-K of ``split`` must not run a problem of ``k_steps`` reduction steps (of the kernel's own size,
    named ``steps``) on ``tiles`` output tiles of ``bm`` x ``bn``, or None: every slice of the even split gets 2
    steps or more, and the partial sums (:func:`split_workspace_bytes`) fit :data:`SPLIT_WORKSPACE_LIMIT` unless
    ``workspace`` is False (the TMA families' split-K in clusters hands them over in shared memory). The 16-bit
    families' shared rule (implicit_gemm_wgmma_h16 sums its slices the same way)."""
    if split == 1:
        return None
    if k_steps // split < 2:
        return f"split-K of {split} leaves under 2 of the problem's {k_steps} {steps} per slice"
    if not workspace:
        return None
    need = split_workspace_bytes(split, tiles, bm, bn)
    if need > SPLIT_WORKSPACE_LIMIT:
        return (f"split-K of {split} needs {need >> 20} MiB of partial sums on this problem (at most "
                f"{SPLIT_WORKSPACE_LIMIT >> 20})")
    return None


def split_workspace_bytes(split: int, tiles: int, bm: int, bn: int) -> int:
    """The split-K workspace the host allocates (bagf_ext.cpp split_workspace_floats): each slice's fp32 sums of
    every bm x bn tile, then one counter per tile; 0 without split-K."""
    return 0 if split == 1 else 4 * tiles * (split * bm * bn + 1)


def tiles(c: Mapping[str, int], problem) -> int:
    """Output tiles (blocks per slice) of ``c`` on ``problem``: ceil(N*P*Q / BN) * ceil(K / BM)."""
    p, q = problem.out_hw
    return -(-(problem.n * p * q) // c["BN"]) * -(-problem.k // c["BM"])


def workspace_bytes(c: Mapping[str, int], problem) -> int:
    """The split-K workspace the host allocates for ``c`` on ``problem`` (0 without split-K)."""
    return split_workspace_bytes(c.get("SPLIT", 1), tiles(c, problem), c["BM"], c["BN"])


def default_for(problem, sms: int = H200_SMS) -> Config:
    """DEFAULT with the problem's DT and NHWC, and ST = 3 where the problem allows the cp.async pipeline
    (:func:`pipeline_refuses`; 3 stages hide two K-steps of load latency for half the shared memory of 4); where its
    grid would give fewer than 2 blocks per SM, a 64 x 64 block (2 x 2 warps of 32 x 32) for twice the blocks, and
    where that still leaves SMs idle, the largest split-K that keeps within 2 blocks per SM (and
    :func:`problem_rule`)."""
    c = dict(DEFAULT)
    c["DT"], c["NHWC"] = DTYPES.get(problem.dtype, 1), LAYOUTS.get(problem.layout, 1)
    if c["NHWC"] and pipeline_refuses(problem) is None:
        c["ST"] = PIPELINE_STAGES[0]
    if tiles(c, problem) < 2 * sms:
        c.update(BM=64, BN=64)
    blocks = tiles(c, problem)
    fits = [s for s in PARAMS["SPLIT"] if s * blocks <= 2 * sms and problem_rule(dict(c, SPLIT=s), problem) is None]
    c["SPLIT"] = max(fits, default=1)
    return c


def blocks_per_sm(c: Mapping[str, int]) -> int:
    """Blocks of ``c`` one SM can hold at once (shared memory, estimated registers, threads), at least 1."""
    return resident_blocks(threads(c), smem_bytes(c), estimated_registers(c))


def _rules(smem_limit: int):
    def tile(c):
        if (c["BM"] // c["WM"]) % 16 or (c["BN"] // c["WN"]) % 8 or c["BM"] < 16 * c["WM"] or c["BN"] < 8 * c["WN"]:
            return (f"warp tile {c['BM']}/{c['WM']} x {c['BN']}/{c['WN']} is not whole 16x8 mma tiles")
        return None

    def pipeline(c):
        if c["ST"] in PIPELINE_STAGES and not c["NHWC"]:
            return f"ST = {c['ST']} is the cp.async pipeline of channels_last inputs; NCHW takes ST = 2"
        return None

    return (tile, pipeline, thread_count_rule(threads), shared_memory_rule(smem_bytes, smem_limit),
            register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    """The family's search space for a device with ``smem_limit`` bytes of opt-in shared memory per block."""
    return Space(FAMILY, PARAMS, _rules(smem_limit))

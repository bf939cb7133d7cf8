"""Kernel family ``implicit_gemm_wgmma_h16``: fp16 and bf16 implicit-GEMM convolution of channels_last tensors on
Hopper's wgmma (csrc/kernels/implicit_gemm_wgmma_h16.cuh).

The arithmetic of ``implicit_gemm_h16`` and of cuDNN's fp16/bf16 convolutions (16-bit operands exact in the
products, fp32 sums, bias added in fp32 before the one rounding to the output dtype), issued by whole warpgroups as
``wgmma.mma_async`` with both operands read by the tensor cores from 128-byte-swizzled shared memory: the input's
im2col tile (output pixels x 64 reduction steps, gathered 16 bytes = 8 channels at a time) and the weight's tile
(a channels_last weight's KRSC rows). It serves channels_last problems with C % 8 == 0 on sm_90 (compiled for
sm_90a); NCHW and other channel counts are ``implicit_gemm_h16``'s.

Knobs (template parameters, SPLIT the launch's grid.z) and the validity rules enforced before anything is compiled:

========  ==================  ======================================================================
knob      values              rule
========  ==================  ======================================================================
DT        0 1                 the problem's dtype: 0 float16, 1 bfloat16
WN        64 128 192 256      wgmma's N: output channels per block
MI        1 2                 64-pixel row blocks per warpgroup; MI*WN/2 fp32 accumulators per
                              thread, at most 128
WG        1 2                 warpgroups: BN = 64*MI*WG output pixels per block, 128*WG threads
STAGES    3 4 5 6             cp.async ring depth (copies run STAGES-2 k tiles ahead, one wgmma
                              group in flight); shared memory STAGES*KS*(BN + WN)*128 + 1024 bytes
                              <= the device's opt-in limit
KS        1 2                 64-step sub-tiles per k tile: a stage, a barrier and a wgmma group per
                              64*KS reduction steps
SPLIT     1 2 4 8 16          split-K slices, ``implicit_gemm_h16``'s even split and workspace: on a
                              problem every slice gets >= 2 k tiles and the partial sums fit 32 MiB
========  ==================  ======================================================================

On a problem (:func:`problem_rule`) the configuration's DT is the problem's and C % 8 == 0 (every copy a whole
16-byte run). The kernel checks the 16-byte path again per launch (C and the pointers' alignment) and fills the
tiles by 2-byte loads where it does not hold: slower, never a misaligned copy. Every access is bounds-checked
against the run-time shape.

The correctness check (``tuning.measure.Workspace``) bounds a candidate's error against float64 by twice what
cuDNN's own convolution in the same dtype and format misses by on the same data.

Speed on the H200, bf16 channels_last, the whole space timed against cuDNN in CUDA graphs
(benchmarks/results/family_sweep_implicit_gemm_wgmma_h16_h200_bf16_nhwc.md): the best tiles reach 354-412 TFLOP/s on
AlexNet's conv2-5 at N = 128: on par with cuDNN on conv2-3 (142.7 / 69.6 us; cuDNN 139.7-150.7 / 69.7-75.4 us over
three runs that day: 0.98-1.08x), 0.72-0.87x on conv4-5 (cuDNN 71.4-82.1 / 54.6-63.0 us); at N = 32 1.10x / 1.37x on
conv2 / conv3 in the sweep (conv3 1.35x in the layer benchmark), 0.79x / 0.90x on conv4 / conv5; at N = 1, 64 x 64
tiles split 4-8 ways, 0.81-1.03x. Every k tile costs each thread a cp.async wait and a block barrier before its
wgmma group, and the copies are issued by the same warps that issue the products. Warp specialization with cp.async
was built and measured, and is not here: a producer warpgroup copying the same tiles and signalling each stage through
mbarriers (its threads fence their landed copies for the async proxy, then arrive), the consumer warpgroups only
waiting and issuing wgmma, computed the same bits as this kernel but ran at a median 0.86-0.98x of it with the same
tile on AlexNet's conv2-5 at N = 32 and 128, 0.65-0.77x with this kernel's usual best tile (128 x 128, two
warpgroups), and never ahead of this kernel's best; signalling two tiles behind the last issue or as many as the ring
allows made no difference (benchmarks/results/family_sweep_implicit_gemm_wgmma_h16_h200_bf16_nhwc_ws.md). The
gather itself (one 16-byte cp.async per 8 channels of a pixel, bounds-tested per thread) is what a faster variant
would change: ``implicit_gemm_tma_h16`` computes the same products with the TMA unit's im2col-mode copies (one per
tile of output pixels) and reaches 484-546 TFLOP/s on the same layers.
"""

from __future__ import annotations

import math
from typing import Mapping

from . import implicit_gemm_h16 as _h16
from . import implicit_gemm_wgmma as _wgmma
from .geometry import LaunchGeometry
from .space import Config, Space, register_rule, resident_blocks, shared_memory_rule, template_expression

FAMILY = "implicit_gemm_wgmma_h16"
SOURCE = "implicit_gemm_wgmma_h16.cuh"
KERNEL = "bagf::implicit_gemm_wgmma_h16_conv2d"
TEMPLATE_ORDER = ("DT", "WN", "MI", "WG", "STAGES", "KS")
"""The template parameters; SPLIT is the launch's grid.z, so configurations that differ only in it share a cubin."""
MIN_ARCH = 90
KERNEL_ARGS = ("const unsigned short*, const unsigned short*, const unsigned short*, unsigned short*, "
               "const bagf::Conv2dParams, float*")
"""The kernel's parameter list: x, w, bias, y (16-bit values as unsigned short), the shape, the split-K workspace."""
BK = 64
"""Reduction steps per sub-tile: one 128-byte swizzle row of 16-bit values (a k tile is KS of them)."""

DTYPES: dict[str, int] = {"float16": 0, "bfloat16": 1}
FORMATS: tuple[tuple[str, str], ...] = (("float16", "nhwc"), ("bfloat16", "nhwc"))
"""The (dtype, layout) pairs this family computes (``kernels.format_refuses``)."""

PARAMS: dict[str, tuple[int, ...]] = {
    "DT": (0, 1),
    "WN": (64, 128, 192, 256),
    "MI": (1, 2),
    "WG": (1, 2),
    "STAGES": (3, 4, 5, 6),
    "KS": (1, 2),
    "SPLIT": (1, 2, 4, 8, 16),
}

# 128 output channels x 128 pixels per block (two warpgroups, one m64n128k16 instruction each per k16 step), a
# 4-deep ring (129 KB of shared memory); default_for sets DT, sizes WN, WG and SPLIT to the problem and deepens the
# ring to 5 stages where it stays small.
DEFAULT: Config = {"DT": 1, "WN": 128, "MI": 1, "WG": 2, "STAGES": 4, "KS": 1, "SPLIT": 1}

RING5_LIMIT = 170 << 10
"""The start point's 5-stage ring where it takes at most this many bytes (WN = 128 and 64 tiles: 161 KB and 81 KB);
WN = 192's 201 KB ring ran 14% slower than its 4-stage one on AlexNet conv2 (:func:`default_for`)."""
STATIC_SMEM = 16
"""Static shared memory of the kernel (split-K's arrival flag), besides the dynamic ring."""
H200_SMS = 132
SM90_SMEM_LIMIT = 232448
INT32_MAX = 2**31 - 1


def bm(c: Mapping[str, int]) -> int:
    """Output channels per block (grid.y)."""
    return c["WN"]


def bn(c: Mapping[str, int]) -> int:
    """Output pixels per block (grid.x)."""
    return 64 * c["MI"] * c["WG"]


def threads(c: Mapping[str, int]) -> int:
    return 128 * c["WG"]


def smem_bytes(c: Mapping[str, int]) -> int:
    """The ring, STAGES x KS x (BN input rows + WN weight rows) x 128 bytes, and 1024 bytes to align it to the
    swizzle's atom."""
    return c["STAGES"] * c["KS"] * (bn(c) + bm(c)) * 128 + 1024


def estimated_registers(c: Mapping[str, int]) -> int:
    """The accumulators (MI*WN/2 per thread) plus 120 for the copy plan, the cursor and addressing, at most 255.
    ptxas with nvcc 13.0 on the space's 54 bf16 kernels: 114-143 registers at 32 accumulators, 148-219 at 64,
    204-249 at 96, 252-255 at 128 (KS = 2 the upper ends), no spills."""
    return min(255, c["MI"] * c["WN"] // 2 + 120)


def applies(problem) -> str | None:
    """None for a float16 or bfloat16 channels_last problem with C % 8 == 0 (every copy a whole 16-byte run)."""
    if (problem.dtype, problem.layout) not in FORMATS:
        return f"computes float16 and bfloat16 channels_last; this problem is {problem.dtype} {problem.layout}"
    if problem.c % 8:
        return f"copies 8 channels at a time; C = {problem.c} is not a multiple of 8 (implicit_gemm_h16's)"
    return None


def k_tiles(problem, c: Mapping[str, int] = DEFAULT) -> int:
    """k tiles of ``c`` (KS sub-tiles of 64 reduction steps each) in ``problem``'s reduction."""
    return -(-(problem.c * problem.r * problem.s) // (BK * c["KS"]))


def tiles(c: Mapping[str, int], problem) -> int:
    """Output tiles (blocks per slice) of ``c`` on ``problem``."""
    p, q = problem.out_hw
    return -(-(problem.n * p * q) // bn(c)) * -(-problem.k // bm(c))


def workspace_bytes(c: Mapping[str, int], problem) -> int:
    """The split-K workspace the host allocates for ``c`` on ``problem`` (0 without split-K)."""
    return _h16.split_workspace_bytes(c.get("SPLIT", 1), tiles(c, problem), bm(c), bn(c))


def problem_rule(c: Mapping[str, int], problem) -> str | None:
    """None when ``c`` was compiled for the problem's dtype, every copy is a whole 16-byte run (C % 8 == 0), the
    kernel's 32-bit indices hold for the last blocks (N*P*Q + BN and (K + WN) * C*R*S below 2^31), and a split-K
    configuration gives every slice 2 k tiles or more within implicit_gemm_h16's ``SPLIT_WORKSPACE_LIMIT`` bytes."""
    if c["DT"] != DTYPES.get(problem.dtype):
        return f"compiled for {'bfloat16' if c['DT'] else 'float16'}; this problem is {problem.dtype}"
    if problem.c % 8:
        return f"copies 8 channels at a time; C = {problem.c} is not a multiple of 8 (implicit_gemm_h16's)"
    p, q = problem.out_hw
    if problem.n * p * q + bn(c) > INT32_MAX or (problem.k + bm(c)) * problem.c * problem.r * problem.s > INT32_MAX:
        return "the kernel's 32-bit pixel indices and weight offsets would pass 2^31 - 1 in the last blocks"
    return _h16.split_refuses(c.get("SPLIT", 1), k_tiles(problem, c), tiles(c, problem), bm(c), bn(c), "k tiles")


def default_for(problem, sms: int = H200_SMS) -> Config:
    """DEFAULT with the problem's DT; the instruction width WN that pads the K output channels least, the nearest to
    128 on a tie (the wider of two as near: K = 384 and 256 take 128, K = 192 takes 192, K = 64 takes 64); a 5-deep
    ring where it takes at most :data:`RING5_LIMIT` bytes, else 4. Where the grid has fewer tiles than a quarter of
    the SMs (batch 1), 64 x 64 tiles of one warpgroup (WN = 64, WG = 1); then the largest SPLIT whose slices still
    fit one wave (SPLIT x tiles <= SMs, and :func:`problem_rule`). From the whole space timed on AlexNet's conv2-5 in
    bf16 channels_last (benchmarks/results/family_sweep_implicit_gemm_wgmma_h16_h200_bf16_nhwc.md): WN = 128 with 5
    stages was the best tile on conv3-5 at N = 32 and on conv4-5 at N = 128 (conv3 at N = 128 took 2 row blocks and
    4 stages); WN = 192 with 4 stages on conv2 (K = 192), 5 stages 14% slower there; 64 x 64 tiles split 4-8 ways at
    N = 1."""
    c = dict(DEFAULT)
    c["DT"] = DTYPES.get(problem.dtype, 1)
    c["WN"] = instruction_width(problem.k)
    if tiles(c, problem) < sms // 4:
        c.update(WN=64, WG=1)
    c["STAGES"] = 5 if smem_bytes(dict(c, STAGES=5)) <= RING5_LIMIT else 4
    c["SPLIT"] = one_wave_split(c, tiles(c, problem), lambda s: problem_rule(dict(c, SPLIT=s), problem), sms)
    return c


def one_wave_split(c: Mapping[str, int], blocks: int, refuses, sms: int = H200_SMS) -> int:
    """The largest SPLIT whose slices of ``blocks`` output tiles still fit one wave (SPLIT x blocks <= SMs) and that
    ``refuses`` (SPLIT -> reason or None) lets through; 1 where none does. Also implicit_gemm_tma_h16's start."""
    return max((s for s in PARAMS["SPLIT"] if s * blocks <= sms and refuses(s) is None), default=1)


def grid_features(blocks: int, k_steps: int, split: int, resident: int, sms: int = H200_SMS) -> dict[str, float]:
    """What a configuration means for a problem beyond its knobs, for ax's model: grid blocks per SM (``blocks``
    output tiles x ``split`` slices), k tiles per slice (of ``k_steps``), and blocks one SM holds at once
    (``resident``), each log2. Also implicit_gemm_tma_h16's."""
    return {"log2_blocks_per_sm": math.log2(blocks * split / sms),
            "log2_k_tiles": math.log2(max(1, -(-k_steps // split))),
            "log2_resident": math.log2(resident)}


def blocks_per_sm(c: Mapping[str, int]) -> int:
    return resident_blocks(threads(c), smem_bytes(c), estimated_registers(c))


def features(problem, c: Mapping[str, int], sms: int = H200_SMS) -> dict[str, float]:
    """:func:`grid_features` of ``c`` on ``problem``."""
    return grid_features(tiles(c, problem), k_tiles(problem, c), c["SPLIT"], blocks_per_sm(c), sms)


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    return LaunchGeometry(bm=bm(c), bn=bn(c), threads=threads(c), smem=smem_bytes(c), split=c["SPLIT"],
                          dtype=1 + c["DT"], nhwc=1)


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``implicit_gemm_wgmma_h16_bf16_wn128_mi1_wg2_st4_ks1_s1_sm90``."""
    return (f"{FAMILY}_{'bf16' if c['DT'] else 'fp16'}_wn{c['WN']}_mi{c['MI']}_wg{c['WG']}_st{c['STAGES']}"
            f"_ks{c['KS']}_s{c['SPLIT']}_{arch}")


def name_expression(c: Mapping[str, int]) -> str:
    """e.g. ``bagf::implicit_gemm_wgmma_h16_conv2d<1, 128, 1, 2, 4, 1>`` (whatever SPLIT: a launch parameter)."""
    return template_expression(KERNEL, TEMPLATE_ORDER, c)


gpu_arch = _wgmma.gpu_arch  # sm_90a: wgmma needs the architecture-specific target
arch_rule = _wgmma.arch_rule  # searched on sm_90 GPUs only


def accumulator_rule(c: Mapping[str, int]) -> str | None:
    """MI*WN/2 fp32 accumulators per thread fit the registers (at most 128); also implicit_gemm_tma_h16's rule."""
    if c["MI"] * c["WN"] > 256:
        return f"MI*WN/2 = {c['MI'] * c['WN'] // 2} accumulators per thread; at most 128 fit the registers"
    return None


def instruction_width(k: int) -> int:
    """The wgmma N (a WN value) that pads K output channels least, the nearest to 128 on a tie (the wider of two as
    near): K = 384 and 256 take 128, K = 192 takes 192, K = 64 takes 64. Also implicit_gemm_tma_h16's start."""
    return min(PARAMS["WN"], key=lambda wn: (-(-k // wn) * wn, abs(wn - 128), -wn))


def _rules(smem_limit: int):
    return (accumulator_rule, shared_memory_rule(smem_bytes, smem_limit - STATIC_SMEM),
            register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    """The family's search space for a device with ``smem_limit`` bytes of opt-in shared memory per block."""
    return Space(FAMILY, PARAMS, _rules(smem_limit))

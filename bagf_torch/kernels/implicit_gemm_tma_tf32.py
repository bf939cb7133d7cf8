"""Kernel family ``implicit_gemm_tma_tf32``: fp32 implicit-GEMM convolution with one TF32 product per multiply on
Hopper's wgmma, both operand tiles copied by the TMA unit, for TF32 mode (PyTorch's default for fp32 convolutions),
NCHW and channels_last (csrc/kernels/implicit_gemm_tma_h16.cuh with DT = 2).

``implicit_gemm_tma_h16``'s kernel, data path, schedule and epilogue on fp32 tensors: a 128-byte swizzle row holds
32 fp32 channels where it held 64 16-bit ones, so a k tile is one filter tap's block of 32 channels and a stage's
four 32-byte k steps are ``wgmma ... m64nNk8.f32.tf32.tf32`` instead of k16. The host maps the fp32 tensors as TF32
(``CU_TENSOR_MAP_DATA_TYPE_TFLOAT32``) and the TMA unit rounds every value to TF32 to nearest as it copies: on the
H200 these plans miss the float64 convolution by exactly cuDNN's TF32 error (1.97e-4 of the output's norm on AlexNet
conv3 at N = 2, both), the same as with each stage rounded once more in shared memory (``cvt.rna``, by the producer
warpgroup's idle warps: that pass cost more than half the speed and changed nothing, so it is gone). Truncating both
operands, what the tensor cores do with operands read as plain fp32, would miss by 2.6x as much (emulated on the CPU),
past the check's bound of twice cuDNN's error. So the arithmetic is ``implicit_gemm_tf32``'s and cuDNN's. It applies
only to problems tuned in TF32 mode (``ConvProblem.tf32``, part of every plan's key), so a
strict-fp32 caller never gets one of its plans; the correctness check's tolerance is twice what cuDNN's own TF32
convolution misses by on the same data (``tuning.measure.Workspace``).

Knobs (template parameters; SPLIT, the launch's grid.z, and CR are launch parameters) and the validity rules enforced
before anything is compiled:

========  ==================  ======================================================================
knob      values              rule
========  ==================  ======================================================================
DT        2                   fp32 tensors rounded to TF32 by the copies, TF32 products
NHWC      0 1                 the problem's memory format: 0 NCHW (the plan's second kernel makes a
                              channels_last copy of the input per call, the output is written NCHW),
                              1 channels_last
WN        64 128 192 256      wgmma's N: output channels per block (one weight copy's rows)
MI        1 2                 64-pixel row blocks per consumer warpgroup; MI*WN/2 fp32 accumulators
                              per thread, at most 128
WG        1 2                 consumer warpgroups: BN = 64*MI*WG output pixels per block (one im2col
                              copy), 128*(WG + 1) threads
STAGES    3 4 5 6             ring depth; shared memory STAGES*(BN + WN)*128 + 1024 bytes (and an NCHW
                              staging buffer with SK = 2) <= the device's opt-in limit
SPLIT     1 2 4 8 16          split-K slices in implicit_gemm_h16's ordered hand-over: on a problem
                              every slice gets >= 2 k tiles and the partial sums fit 32 MiB
SK        0 1 2               1: stream-K (SPLIT = 1), implicit_gemm_tma_h16's: the blocks the device
                              holds at once share all tiles' k tiles evenly; 2: persistent blocks
                              (SPLIT = 1), each taking whole tiles in turn
CR        0 1                 1: split-K in clusters (SPLIT 2, 4 or 8, SK = 0), implicit_gemm_tma_h16's:
                              a tile's slices hand over in distributed shared memory, no workspace
========  ==================  ======================================================================

Problems: C % 4 == 0 (the maps' 16-byte strides) and the windows the TMA maps can describe
(``implicit_gemm_tma_h16.map_refuses``); others go to the other families or cuDNN.

Speed on the H200 against cuDNN's TF32 kernels, NCHW (PyTorch's default layout), in CUDA graphs
(benchmarks/results/family_sweep_implicit_gemm_tma_tf32_h200_tf32_nchw.md): the best tiles run AlexNet's conv2-5
1.03-1.42x faster at N = 128 and 1.26-1.71x at N = 32 (183-279 TFLOP/s); 128 x 128 tiles of two consumer warpgroups
with 4 stages are the best on conv4-5, 256 x 128 on conv3 at N = 128, WN = 192 on conv2. Those times include the
per-call copies: the input to channels_last by the plan's second kernel (ATen's copy, before it, cost conv4 at
N = 128 28 us more) and the weight to KRSC (an NCHW weight: 1.2-3.5 MB on conv2-5); and the NCHW output tile is
staged through shared memory (conv3 / conv2 at N = 128: 128.2 / 244.8 us before, 105.4 / 205.7 us with it). conv4
at N = 128: 161.6 us NCHW, 131.7 us on a channels_last input, cuDNN 167 / 124 us.

What bounds the 128 x 128 tile is not settled (303 TFLOP/s on conv3 at N = 128 channels_last, probe_cl's run: 75% of
the 402.8 TFLOP/s a TF32 torch.mm reached in the layer benchmark's run). It reads 32 KB
from L2 per k tile, about 8 TB/s summed at N = 128, and stream-K (SK = 1), which spreads the same tiles over every SM,
made each k tile slower, not the grid faster (family_sweep_implicit_gemm_tma_tf32_h200_tf32_nchw_sk.md: never the best;
conv4 at N = 32 channels_last 38.5 us in 86 blocks, 48.4 us in stream-K's 132). But clusters of two blocks sharing
the weight tile by TMA multicast, a quarter fewer L2 reads per k tile, were never faster either (1-5% slower in
256 x 128 tiles, up to 24% in 128 x 128; family_sweep_implicit_gemm_tma_tf32_probe_cl.md) and were taken out: L2
traffic alone is not the bound. Reading the input in place does not pay either, so an NCHW plan keeps its copy: TF32
wgmma reads only K-major operands from shared memory, so the input has to be its register operand, and a version
whose producer warpgroup gathered each k tile with one 4-byte cp.async per value (the consumers rounding their
fragments to TF32) was correct but slower on every 3x3 and 5x5 layer (conv2 at N = 128: 371 us against 203 us with
the copy), ahead only on the 1x1 1024->256 layer (3% at N = 32, 15% or more at N = 128, both behind cuDNN;
family_sweep_implicit_gemm_tma_tf32_h200_tf32_nchw_xg*.md), and was taken out. Tuned with the library's defaults
(bench_layers_h200_tf32.md) it takes conv2-5 at N = 32 and 128 and conv2 at N = 1.
"""

from __future__ import annotations

from typing import Mapping

from . import implicit_gemm_h16 as _h16
from . import implicit_gemm_tma_h16 as _th
from . import implicit_gemm_wgmma_h16 as _wh
from .geometry import LaunchGeometry
from .implicit_gemm_tf32 import applies as _tf32_mode
from .space import Config, Space, register_rule, shared_memory_rule, template_expression

FAMILY = "implicit_gemm_tma_tf32"
TF32_PRODUCTS = True  # one TF32 product per multiply: left out where that alone misses the check (Tuner)
SOURCE = _th.SOURCE
KERNEL = _th.KERNEL
TEMPLATE_ORDER = _th.TEMPLATE_ORDER
MIN_ARCH = 90
KERNEL_ARGS = ("const __grid_constant__ bagf::TmaMap, const __grid_constant__ bagf::TmaMap, const float*, float*, "
               "const bagf::Conv2dParams, float*")
"""The kernel's parameter list: the input's and the weight's TMA maps (by value), bias, y, the shape, the split-K
workspace."""
AUX_KERNEL_ARGS = "const float*, float*, int, int, int"
"""An NCHW plan's second kernel's parameter list (implicit_gemm_tma_h16.TRANSPOSE_KERNEL): x, its channels_last copy,
C, H*W, N."""
BK = 32
"""Channels per k tile: one 128-byte swizzle row of fp32 values per pixel and per output channel."""

LAYOUTS = _th.LAYOUTS
FORMATS: tuple[tuple[str, str], ...] = tuple(("float32", layout) for layout in LAYOUTS)
"""The (dtype, layout) pairs this family computes (``kernels.format_refuses``)."""
PARAMS: dict[str, tuple[int, ...]] = {**{k: v for k, v in _th.PARAMS.items() if k != "PP"}, "DT": (2,)}
"""implicit_gemm_tma_h16's knobs but its polyphase plans (PP: its gather and weight kernels are 16-bit only)."""

DEFAULT: Config = {"DT": 2, "NHWC": 0, "WN": 128, "MI": 1, "WG": 2, "STAGES": 4, "SPLIT": 1, "SK": 0, "CR": 0}
LEGACY: Config = {"SK": 0, "CR": 0}
"""Configurations recorded before stream-K and before split-K in clusters."""

STATIC_SMEM = _th.STATIC_SMEM
SM90_SMEM_LIMIT = _wh.SM90_SMEM_LIMIT
H200_SMS = _wh.H200_SMS

bm = _th.bm
bn = _th.bn
threads = _th.threads
smem_bytes = _th.smem_bytes
estimated_registers = _th.estimated_registers
blocks_per_sm = _th.blocks_per_sm
tiles = _th.tiles
gpu_arch = _th.gpu_arch
arch_rule = _th.arch_rule


def applies(problem) -> str | None:
    """None for a float32 problem tuned in TF32 mode with C % 4 == 0."""
    if (problem.dtype, problem.layout) not in FORMATS:
        return f"computes float32; this problem is {problem.dtype} {problem.layout}"
    if (why := _tf32_mode(problem)) is not None:
        return why
    if problem.c % 4:
        return f"copies 4 channels (16 bytes) at a time; C = {problem.c} is not a multiple of 4"
    return None


def k_tiles(problem) -> int:
    """k tiles (one filter tap's block of 32 channels each) in ``problem``'s reduction: R*S*ceil(C / 32)."""
    return problem.r * problem.s * -(-problem.c // BK)


def problem_rule(c: Mapping[str, int], problem) -> str | None:
    """None when ``c`` was compiled for the problem's memory format, C % 4 == 0, the maps can describe the window,
    the epilogue's 32-bit output offsets hold, a split-K configuration gives every slice 2 k tiles or more within
    implicit_gemm_h16's workspace limit, and a stream-K one counts all tiles' k tiles in 32 bits. (The TF32 mode is
    :func:`applies`'s; ``kernels.family_refuses`` asks both.)"""
    c = {**LEGACY, **c}
    if c["NHWC"] != LAYOUTS.get(problem.layout):
        return f"compiled for {'nhwc' if c['NHWC'] else 'nchw'}; this problem is {problem.layout}"
    if problem.c % 4:
        return f"copies 4 channels (16 bytes) at a time; C = {problem.c} is not a multiple of 4"
    return _th.map_refuses(problem) or _th.grid_refuses(c, problem, k_tiles(problem))


def default_for(problem, sms: int = H200_SMS) -> Config:
    """implicit_gemm_tma_h16's start rule (``sized_start``: the instruction width WN that pads K least, 64 x 64 tiles
    of one warpgroup where the grid has under a quarter of the SMs in tiles, the deepest ring of at most 4 stages
    that fits -- 4 was the best depth on AlexNet's conv3-5 -- then the largest SPLIT whose slices still fit one
    wave)."""
    c = dict(DEFAULT)
    c["NHWC"] = LAYOUTS.get(problem.layout, 0)
    return _th.sized_start(c, problem, 4, problem_rule, sms)


def features(problem, c: Mapping[str, int], sms: int = H200_SMS) -> dict[str, float]:
    """implicit_gemm_wgmma_h16's :func:`~.implicit_gemm_wgmma_h16.grid_features` of ``c`` on ``problem``."""
    return _th.grid_features(c, problem, k_tiles(problem), sms)


def persistent_blocks(c: Mapping[str, int], problem, sms: int = H200_SMS) -> int:
    """implicit_gemm_tma_h16's :func:`~.implicit_gemm_tma_h16.persistent_blocks`."""
    return _th.persistent_blocks(c, problem, sms)


def stream_k_blocks(c: Mapping[str, int], problem, sms: int = H200_SMS) -> int:
    """implicit_gemm_tma_h16's :func:`~.implicit_gemm_tma_h16.stream_k_blocks` with this family's k tiles."""
    return _th.stream_k_blocks(c, problem, k_tiles(problem), sms)


def workspace_bytes(c: Mapping[str, int], problem, sms: int = H200_SMS) -> int:
    """The split-K or stream-K workspace the host allocates for ``c`` on ``problem`` (implicit_gemm_tma_h16's)."""
    return _th.workspace_bytes(c, problem, k_tiles(problem), sms)


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    c = {**LEGACY, **c}
    return LaunchGeometry(bm=bm(c), bn=bn(c), threads=threads(c), smem=smem_bytes(c), split=c["SPLIT"], dtype=0,
                          nhwc=c["NHWC"], tma=1, stream_k=c["SK"], split_cluster=c["CR"], tf32=1)


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``implicit_gemm_tma_tf32_wn128_mi1_wg2_st4_s1_sm90`` (channels_last), ``..._tf32_nchw_wn128...``,
    ``..._st4_sk_sm90`` (stream-K), ``..._st4_pt_sm90`` (persistent blocks), ``..._st4_c4_sm90`` (split-K of 4 in
    clusters)."""
    c = {**LEGACY, **c}
    return (f"{FAMILY}{'' if c['NHWC'] else '_nchw'}_wn{c['WN']}_mi{c['MI']}_wg{c['WG']}_st{c['STAGES']}"
            f"_{_th.split_name(c)}_{arch}")


def name_expression(c: Mapping[str, int]) -> str:
    """e.g. ``bagf::implicit_gemm_tma_h16_conv2d<2, 128, 1, 2, 4, 1, 0>`` (whatever SPLIT: a launch parameter); an NCHW
    plan's also names its input copy:
    ``bagf::implicit_gemm_tma_h16_conv2d<2, 128, 1, 2, 4, 0, 0>;bagf::nchw_to_nhwc<2>``."""
    return _th.name_expression({**LEGACY, **c})


def start_alternatives(problem, sms: int = H200_SMS, arch: str | None = None) -> list[Config]:
    """implicit_gemm_tma_h16's: the start's split-K in clusters where the start splits, its persistent blocks where
    its grid has more tiles than the GPU has SMs."""
    return _th.twin_alternatives(default_for(problem, sms), problem, arch, sms)


def _rules(smem_limit: int):
    return (_wh.accumulator_rule, _th.stream_k_rule, _th.cluster_rule,
            shared_memory_rule(smem_bytes, smem_limit - STATIC_SMEM), register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    """The family's search space for a device with ``smem_limit`` bytes of opt-in shared memory per block."""
    return Space(FAMILY, PARAMS, _rules(smem_limit))

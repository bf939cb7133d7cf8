"""Kernel family ``implicit_gemm_tma_h16``: fp16 and bf16 implicit-GEMM convolution on Hopper's wgmma with both operand
tiles copied by the TMA unit (csrc/kernels/implicit_gemm_tma_h16.cuh), channels_last and NCHW.

The arithmetic, tiles, products and epilogue of ``implicit_gemm_wgmma_h16`` (fp32 sums, bias in fp32 before the one
rounding to the output dtype, split-K's ordered hand-over; an NCHW tile is stored through shared memory), with
another data path: the input's im2col tile is one
im2col-mode TMA copy (BN output pixels x 64 channels of one filter tap; the TMA unit walks the pixels across rows
and images and fills the padding with zeros) and the weight's tile one tiled copy, issued by one thread of a
producer warpgroup into a STAGES-deep ring whose stages are handed over by mbarriers; the WG consumer warpgroups
only wait and issue wgmma. The reduction runs tap by tap in blocks of 64 channels (channels past C are zeros), so
any C % 8 == 0 is served by whole copies. The host encodes the two maps per call (csrc/bagf_ext.cpp
``encode_tma_maps``) and sends to ATen what they cannot describe (a tensor read in place off 16-byte alignment,
stride above 8, padding above 128, a filter window past the im2col box's range): the problem rule keeps such problems
out of the space. An NCHW problem (what ``.to(torch.bfloat16)`` alone gives; cuDNN's NCHW 16-bit kernels take 1.4-1.9x its
channels_last ones on AlexNet) runs the same kernel on a channels_last copy of the input made per call by the plan's
second kernel (``nchw_to_nhwc``, 64 x 64 tiles through shared memory; a cubin compiled before it falls back to
ATen's copy) and a KRSC copy of the weight, and the epilogue writes the NCHW output, staged through the ring (through
a buffer of its own with persistent blocks; from the registers with stream-K).

Knobs (template parameters; SPLIT, the launch's grid.z, and CR are launch parameters) and the validity rules enforced
before anything is compiled:

========  ==================  ======================================================================
knob      values              rule
========  ==================  ======================================================================
DT        0 1                 the problem's dtype: 0 float16, 1 bfloat16
NHWC      0 1                 the problem's memory format: 0 NCHW (the output written NCHW), 1
                              channels_last
WN        64 128 192 256      wgmma's N: output channels per block (one weight copy's rows)
MI        1 2                 64-pixel row blocks per consumer warpgroup; MI*WN/2 fp32 accumulators
                              per thread, at most 128
WG        1 2                 consumer warpgroups: BN = 64*MI*WG output pixels per block (one im2col
                              copy), 128*(WG + 1) threads
STAGES    3 4 5 6             ring depth; shared memory STAGES*(BN + WN)*128 + 1024 bytes (and an NCHW
                              staging buffer with SK = 2) <= the device's opt-in limit
SPLIT     1 2 4 8 16          split-K slices, ``implicit_gemm_h16``'s even split and workspace: on a
                              problem every slice gets >= 2 k tiles and the partial sums fit 32 MiB
SK        0 1 2               1: stream-K (SPLIT = 1): a grid of the blocks the device holds at once
                              (:func:`stream_k_blocks`) shares all tiles' k tiles evenly, each block
                              walking its share tile by tile; a tile split between blocks is summed in
                              k order by the last of them to finish (two workspace slots per block).
                              2: persistent blocks (SPLIT = 1): a grid of the blocks the device holds
                              at once (:func:`persistent_blocks`), each taking whole tiles in turn
CR        0 1                 1: split-K in clusters (SPLIT 2, 4 or 8, SK = 0): the host launches a
                              tile's slices as one thread block cluster and they hand their sums over
                              in distributed shared memory (:func:`cluster_rule`), no workspace
PP        0 1                 1: the polyphase form (:func:`polyphase_problem`) of a strided problem of
                              fewer than 64 channels, dilation 1 (:func:`polyphase_refuses`); every
                              other rule then holds for the form
========  ==================  ======================================================================

A polyphase plan (PP = 1) is for the strided convolutions of few channels, AlexNet's conv1 (C = 3, 11x11, stride 4)
above all, which the maps cannot take as they are (C % 8 != 0) and whose k tiles would be mostly zeros (3 of 64
channels). Its stride-1 form over s_h s_w C channels (48 for conv1) and ceil(R / s_h) x ceil(S / s_w) taps (3 x 3)
computes the same sums (csrc/kernels/conv_params.h ``PolyphaseParams``); the plan's cubin holds two more kernels,
``polyphase_gather`` (the input's form: one read of the input, one write of the form, which is as large as the input
padded to whole strides) and ``polyphase_weight`` (the weight's, K x 9 x 48 values for conv1), launched per call
before the GEMM on the form. The form's products are the direct convolution's with zeros added (taps past R and S,
channels past s_h s_w C), so its error is the direct GEMM's. Where R % s_h or S % s_w is not 0 (conv1: 11 % 4) the
zero taps meet input values the strided window skips, so an Inf there gives NaN (0 x Inf) in outputs whose direct sums
never read it; finite inputs give the direct sums.

Persistent blocks (SK = 2) are for the grids of several waves (N = 32 and 128): a block that has consumed its
tile's last k tile stores it while its producer already fills the ring with its next tile's, where a new block would
start from an empty ring and an idle SM; the products and their order are SK = 0's (the same bits), no workspace.
Its NCHW tiles are staged through a buffer of their own after the ring (:func:`stage_bytes`: the producer is
refilling the ring the SK = 0 store stages through; stored from the registers, NCHW tiles ran 1.2x slower on
AlexNet's conv3 at N = 128 in TF32). On the H200 (bench_layers_h200_tf32.md, bench_layers_h200_fp16_nhwc.md) the
tuner took them on AlexNet's conv2-5 at N = 128 in TF32 and float16 channels_last (1.09-1.44x cuDNN).

Split-K in clusters (CR = 1) is for the small grids split-K serves (batch 1): the workspace hand-over costs each
call a memset of the tiles' counters before the launch (a node of its own in a CUDA graph) and, in the last slice
of each tile, a round trip through L2 behind a fence and an atomic, and that last slice reduces and stores the
whole tile alone. In a cluster each slice puts its sums in its own shared memory and, after a cluster barrier,
reduces and stores its share of the tile's channels from all of them, in slice order, so a CR = 1 plan gives its
workspace twin's bits. CR is a launch parameter like SPLIT: both share one cubin. On the H200 the tuner took them on
AlexNet's conv2-5 at N = 1 in float16 channels_last (1.24-1.47x cuDNN) and on conv2 / conv3 in TF32 (1.37x / 1.52x).

Stream-K is for the grids whose last wave is part empty: AlexNet's conv4 at N = 128 in 128 x 128 tiles is 338
tiles, 2.56 waves on 132 SMs (Nsight Compute, TF32: tensor pipe busy 66% over the kernel), and at N = 32 86 tiles,
0.65 of one wave (49%). In TF32 it did not pay there (implicit_gemm_tma_tf32's notes: each k tile got slower with
every SM busy); not yet measured in 16 bits, whose tiles move half the bytes per product.

The correctness check (``tuning.measure.Workspace``) bounds a candidate's error against float64 by twice what
cuDNN's own convolution in the same dtype and format misses by on the same data.

Speed on the H200, bf16 channels_last, the whole space timed against cuDNN in CUDA graphs
(benchmarks/results/family_sweep_implicit_gemm_tma_h16_h200_bf16_nhwc.md): the best tiles run AlexNet's conv2-5 at
484-546 TFLOP/s at N = 128 (1.21-1.37x cuDNN; ``implicit_gemm_wgmma_h16``'s best, gathering per thread, reached
354-412) and at 1.18-1.74x cuDNN at N = 32; 128 x 128 tiles of two consumer warpgroups with 4-5 stages are the best
on conv3-5, WN = 192 with 3 stages on conv2 (K = 192). Tuned with the library's defaults
(bench_layers_h200_{bf16_nhwc,fp16_nhwc,bf16_nchw}.md) it takes conv2-5 at N = 32 and 128 and, in 64 x 64 tiles
split 1-8 ways, conv3-5 at N = 1 (and conv2 there in NCHW and in fp16 channels_last). In NCHW its plans stage each
output tile through the idle ring (32 channels at a time, each thread storing one pixel per channel plane) instead of
storing from the registers, where each warp store wrote 8 runs of 16 bytes: with it, and the plan's own input copy,
it takes conv2-5 at every N in bfloat16 and float16 NCHW (1.08-1.81x cuDNN in graphs,
bench_layers_h200_{bf16,fp16}_nchw.md), where before, in bfloat16, cuDNN's NCHW kernels kept conv4-5 at N = 128.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from . import implicit_gemm_h16 as _h16
from . import implicit_gemm_wgmma as _wgmma
from . import implicit_gemm_wgmma_h16 as _wh
from .geometry import LaunchGeometry
from .space import Config, Space, register_rule, resident_blocks, shared_memory_rule, template_expression

FAMILY = "implicit_gemm_tma_h16"
SOURCE = "implicit_gemm_tma_h16.cuh"
KERNEL = "bagf::implicit_gemm_tma_h16_conv2d"
TEMPLATE_ORDER = ("DT", "WN", "MI", "WG", "STAGES", "NHWC", "SK")
"""The template parameters; SPLIT is the launch's grid.z, so configurations that differ only in it share a cubin."""
MIN_ARCH = 90
KERNEL_ARGS = ("const __grid_constant__ bagf::TmaMap, const __grid_constant__ bagf::TmaMap, const unsigned short*, "
               "unsigned short*, const bagf::Conv2dParams, float*")
"""The kernel's parameter list: the input's and the weight's TMA maps (by value), bias, y (16-bit values as unsigned
short), the shape, the split-K or stream-K workspace."""
GATHER_KERNEL = "bagf::polyphase_gather"
"""A polyphase plan's second kernel (template parameters DT and the input's NHWC): the input's polyphase form, made
before each launch."""
WEIGHT_KERNEL = "bagf::polyphase_weight"
"""A polyphase plan's third kernel (template parameter DT): the weight's polyphase form, made before each launch."""
POLYPHASE_KERNEL_ARGS = "const unsigned short*, unsigned short*, const bagf::PolyphaseParams"
"""GATHER_KERNEL's and WEIGHT_KERNEL's parameter list: the input (or weight), its form, the form's extents."""
TRANSPOSE_KERNEL = "bagf::nchw_to_nhwc"
"""An NCHW plan's second kernel (template parameter DT): the input's copy to channels_last, made before each launch."""
AUX_KERNEL_ARGS = "const unsigned short*, unsigned short*, int, int, int"
"""TRANSPOSE_KERNEL's parameter list: x (NCHW), the channels_last copy, C, H*W, N."""
BK = 64
"""Channels per k tile: one 128-byte swizzle row of 16-bit values per pixel and per output channel."""

DTYPES = _wh.DTYPES
LAYOUTS: dict[str, int] = {"nchw": 0, "nhwc": 1}
"""The problem's memory format (``ConvProblem.layout``) -> NHWC."""
FORMATS: tuple[tuple[str, str], ...] = tuple((d, layout) for d in DTYPES for layout in LAYOUTS)
"""The (dtype, layout) pairs this family computes (``kernels.format_refuses``)."""
LEGACY: Config = {"NHWC": 1, "SK": 0, "CR": 0, "PP": 0}
"""Configurations recorded before the NCHW kernels were channels_last ones, before stream-K, before split-K in
clusters and before polyphase plans."""

PARAMS: dict[str, tuple[int, ...]] = {
    "DT": (0, 1),
    "NHWC": (0, 1),
    "WN": (64, 128, 192, 256),
    "MI": (1, 2),
    "WG": (1, 2),
    "STAGES": (3, 4, 5, 6),
    "SPLIT": (1, 2, 4, 8, 16),
    "SK": (0, 1, 2),
    "CR": (0, 1),
    "PP": (0, 1),
}

# 128 output channels x 128 pixels per block (two consumer warpgroups), a 5-deep ring (161 KB); default_for sets DT
# and sizes WN, WG, STAGES and SPLIT to the problem.
DEFAULT: Config = {"DT": 1, "NHWC": 1, "WN": 128, "MI": 1, "WG": 2, "STAGES": 5, "SPLIT": 1, "SK": 0, "CR": 0,
                   "PP": 0}

STATIC_SMEM = 16 + 2 * 8 * 6
"""Static shared memory (the arrival flags of split-K's and stream-K's hand-overs, the deepest ring's full and empty
mbarriers), besides the ring."""
H200_SMS = _wh.H200_SMS
SM90_SMEM_LIMIT = _wh.SM90_SMEM_LIMIT
INT32_MAX = _wh.INT32_MAX
SHIFTED_REGISTERS = 168
"""With two consumer warpgroups (384 threads) each thread gets 168 registers at launch; the producer gives its back
(setmaxnreg 40) and the consumers take 232."""


def bm(c: Mapping[str, int]) -> int:
    """Output channels per block (grid.y)."""
    return c["WN"]


def bn(c: Mapping[str, int]) -> int:
    """Output pixels per block (grid.x)."""
    return 64 * c["MI"] * c["WG"]


def threads(c: Mapping[str, int]) -> int:
    """The consumer warpgroups and the producer warpgroup."""
    return 128 * (c["WG"] + 1)


def stage_bytes(c: Mapping[str, int]) -> int:
    """The NCHW store's own staging buffer after the ring, 32 channels x (BN + 4) floats, for persistent blocks
    (SK = 2, NHWC = 0: the producer refills the ring the SK = 0 store stages through); 0 otherwise."""
    c = {**LEGACY, **c}
    return 32 * (bn(c) + 4) * 4 if c["SK"] == 2 and not c["NHWC"] else 0


def smem_bytes(c: Mapping[str, int]) -> int:
    """The ring, STAGES x (BN input rows + WN weight rows) x 128 bytes, 1024 bytes to align it to the swizzle's atom,
    and :func:`stage_bytes`."""
    return ring_bytes(c) + 1024 + stage_bytes(c)


def estimated_registers(c: Mapping[str, int]) -> int:
    """Registers per thread at launch: 168 with two consumer warpgroups (the consumers take 232 after the producer
    gives its back); with one, the accumulators plus 80 for addressing and the epilogue, at most 255. ptxas with
    nvcc 13.0: 140 registers at 64 accumulators with one consumer warpgroup, no spills at 128 with two."""
    if c["WG"] == 2:
        return SHIFTED_REGISTERS
    return min(255, c["MI"] * c["WN"] // 2 + 80)


def applies(problem) -> str | None:
    """None for a float16 or bfloat16 problem (NCHW or channels_last) with C % 8 == 0 (the maps' 16-byte
    strides), or one whose polyphase form a plan can run (:func:`polyphase_refuses`)."""
    if (problem.dtype, problem.layout) not in FORMATS:
        return f"computes float16 and bfloat16; this problem is {problem.dtype} {problem.layout}"
    if problem.c % 8 and (why := polyphase_refuses(problem)) is not None:
        return (f"copies 8 channels at a time; C = {problem.c} is not a multiple of 8 (implicit_gemm_h16's), and no "
                f"polyphase plan takes it: {why}")
    return None


def k_tiles(problem) -> int:
    """k tiles (one filter tap's block of 64 channels each) in ``problem``'s reduction: R*S*ceil(C / 64)."""
    return problem.r * problem.s * -(-problem.c // BK)


MAX_POLYPHASE_STRIDE = 8
"""The largest stride a polyphase plan takes (csrc/bagf_ext.cpp ``unsupported_reason``): s_h s_w C channels."""
POLYPHASE_WEIGHT_STEP = 1 << 18
"""The weight kernel's grid-stride step (csrc/bagf_ext.cpp ``kPolyphaseWeightStep``)."""
MAX_PADDING = 65535
"""The most padding the host takes for a 16-bit plan (csrc/bagf_ext.cpp ``unsupported_reason``); the maps bound it to
128 for the other plans (:func:`map_refuses`)."""


def polyphase_problem(problem):
    """The stride-1 problem a polyphase plan's kernel runs (csrc/kernels/conv_params.h ``polyphase_form``): C s_h s_w
    channels rounded up to 8, ceil(R / s_h) x ceil(S / s_w) taps over the (P + R' - 1) x (Q + S' - 1) pixels its
    outputs read, no padding, the same outputs, dtype and layout."""
    sh, sw = problem.stride
    p, q = problem.out_hw
    rp, sp = -(-problem.r // sh), -(-problem.s // sw)
    return dataclasses.replace(problem, c=-(-(sh * sw * problem.c) // 8) * 8, h=p + rp - 1, w=q + sp - 1, r=rp, s=sp,
                               stride=(1, 1), padding=(0, 0), dilation=(1, 1))


def polyphase_refuses(problem) -> str | None:
    """Why no polyphase plan takes ``problem``, or None: it takes dilation 1, strides of 1 to
    :data:`MAX_POLYPHASE_STRIDE` (not both 1), padding of at most :data:`MAX_PADDING`, fewer than 64 input channels
    (one k tile: with more, the form's zero taps cost more than the padded channels it saves), and a form of at most
    65535 rows (the gather's grid.y) that the maps can describe and whose input and weight hold fewer than 2^31 values
    (the weight 2^18 fewer: the host's bound for its kernel's grid-stride loop)."""
    sh, sw = problem.stride
    if problem.dilation != (1, 1) or not (1 <= sh <= MAX_POLYPHASE_STRIDE and 1 <= sw <= MAX_POLYPHASE_STRIDE) or (
            sh == sw == 1):
        return f"a polyphase plan takes dilation 1 and strides of 1 to {MAX_POLYPHASE_STRIDE}, not both 1"
    if max(problem.padding) > MAX_PADDING:
        return f"padding above {MAX_PADDING} (the 16-bit kernels' window arithmetic)"
    if problem.c >= BK:
        return f"a polyphase plan takes fewer than {BK} channels; C = {problem.c}"
    p, q = problem.out_hw
    if p < 1 or q < 1:
        return "no output pixels"
    form = polyphase_problem(problem)
    if (form.h > 65535 or form.n * form.c * form.h * form.w > INT32_MAX
            or form.k * form.c * form.r * form.s > INT32_MAX - POLYPHASE_WEIGHT_STEP):
        return "the polyphase form passes 65535 rows or 2^31 values"
    return map_refuses(form)


def plan_problem(c: Mapping[str, int], problem):
    """The problem ``c``'s kernel runs: ``problem``'s polyphase form where PP = 1, else ``problem``."""
    return polyphase_problem(problem) if c.get("PP", 0) else problem


def tiles(c: Mapping[str, int], problem) -> int:
    """Output tiles (blocks per slice) of ``c`` on ``problem``."""
    p, q = problem.out_hw
    return -(-(problem.n * p * q) // bn(c)) * -(-problem.k // bm(c))


STREAM_K_MIN_ITERS = 8
"""Stream-K gives each block at least this many k tiles where the problem has few (csrc/bagf_ext.cpp
``kStreamKMinIters``): fewer blocks, not shares of a handful of tiles each."""


def stream_k_blocks(c: Mapping[str, int], problem, k: int, sms: int = H200_SMS) -> int:
    """Blocks of a stream-K launch of ``c`` on ``problem`` of ``k`` k tiles per output tile, as the host sizes it: the
    blocks the device holds at once (here estimated by :func:`blocks_per_sm`; the host asks the driver's occupancy),
    fewer where that would leave a block under :data:`STREAM_K_MIN_ITERS` k tiles."""
    work = tiles(c, problem) * k
    return max(1, min(sms * blocks_per_sm(c), work // STREAM_K_MIN_ITERS))


def persistent_blocks(c: Mapping[str, int], problem, sms: int = H200_SMS) -> int:
    """Blocks of a persistent launch (SK = 2) of ``c`` on ``problem``, as the host sizes it: the blocks the device holds
    at once (here estimated by :func:`blocks_per_sm`; the host asks the driver's occupancy), at most one per tile."""
    return max(1, min(sms * blocks_per_sm(c), tiles(c, problem)))


def workspace_bytes(c: Mapping[str, int], problem, k: int | None = None, sms: int = H200_SMS) -> int:
    """The workspace the host allocates for ``c`` on ``problem`` of ``k`` k tiles per output tile (default: this
    family's :func:`k_tiles`): split-K's slices of every tile and a counter per tile, or stream-K's two tiles per
    block and a counter per tile (bounded by the grid, not the problem: a tile holds at most 256 x 128 floats, so
    at most 2 x 132 x 32768 floats, 33 MiB, on an H200), 0 for neither. The host sizes stream-K's grid by the
    driver's occupancy; ``blocks_per_sm`` estimates it."""
    c = {**LEGACY, **c}
    if c["CR"] or c["SK"] == 2:
        return 0
    if c["SK"]:
        return 4 * (2 * stream_k_blocks(c, problem, k_tiles(plan_problem(c, problem)) if k is None else k, sms)
                    * bm(c) * bn(c)
                    + tiles(c, problem))
    return _h16.split_workspace_bytes(c.get("SPLIT", 1), tiles(c, problem), bm(c), bn(c))


def map_refuses(problem) -> str | None:
    """Why the host could not encode the TMA maps of ``problem`` (csrc/bagf_ext.cpp ``encode_tma_maps``), or None:
    stride at most 8 (the im2col traversal step), padding at most 128 and the far corner of the output pixels'
    window corners within [-128, 127] (the im2col box's corners), the filter's extent (R - 1) * dilation at most 127
    (the taps' offsets)."""
    p, q = problem.out_hw
    dims = ((problem.h, p, problem.r, problem.stride[0], problem.padding[0], problem.dilation[0]),
            (problem.w, q, problem.s, problem.stride[1], problem.padding[1], problem.dilation[1]))
    for extent, out, k, s, pad, d in dims:
        upper = (out - 1) * s + 1 - extent - pad
        if s > 8 or pad > 128 or not -128 <= upper <= 127 or (k - 1) * d > 127:
            return ("the TMA maps cannot describe this window: stride above 8, padding above 128, or a filter "
                    "extent or far corner out of the im2col box's range")
    return None


def problem_rule(c: Mapping[str, int], problem) -> str | None:
    """None when ``c`` was compiled for the problem's dtype, C % 8 == 0, the maps can describe the window
    (:func:`map_refuses`), the epilogue's 32-bit indices hold for the last blocks (N*P*Q + BN and N*P*Q*K below
    2^31), and a split-K configuration gives every slice 2 k tiles or more within implicit_gemm_h16's
    ``SPLIT_WORKSPACE_LIMIT`` bytes; with PP = 1, when a polyphase plan takes the problem (:func:`polyphase_refuses`)
    and the rest holds for its form."""
    c = {**LEGACY, **c}
    if (c["DT"], c["NHWC"]) != (DTYPES.get(problem.dtype), LAYOUTS.get(problem.layout)):
        return (f"compiled for {'bfloat16' if c['DT'] else 'float16'} {'nhwc' if c['NHWC'] else 'nchw'}; this "
                f"problem is {problem.dtype} {problem.layout}")
    if c["PP"]:
        why = polyphase_refuses(problem)
    elif problem.c % 8:
        return f"copies 8 channels at a time; C = {problem.c} is not a multiple of 8 (implicit_gemm_h16's)"
    else:
        why = map_refuses(problem)
    return why or grid_refuses(c, problem, k_tiles(plan_problem(c, problem)))


def stream_k_rule(c: Mapping[str, int]) -> str | None:
    """Stream-K (SK = 1) divides the work itself, and persistent blocks (SK = 2) take whole tiles: SPLIT = 1."""
    if c.get("SK", 0) and c["SPLIT"] != 1:
        return "stream-K (SK = 1) and persistent blocks (SK = 2) take no split-K; SPLIT must be 1"
    return None


MAX_CLUSTER_SPLIT = 8
"""The most slices split-K in clusters takes: the portable cluster size (csrc/bagf_ext.cpp ``kMaxClusterSplit``)."""


def cluster_share(rank: int, ranks: int, wn: int, nhwc: int, channels: int) -> range:
    """The channel groups of 8 that rank ``rank`` of a split-K cluster of ``ranks`` reduces and stores in a tile of
    ``wn`` output channels whose first ``channels`` lie below K (csrc/kernels/implicit_gemm_tma_h16.cuh
    ``wgt::cluster_share``): in units of 1 group (channels_last) or 4 (an NCHW tile, staged 32 channels a pass), the
    units that hold channels split evenly over the ranks as split-K's slices are (``implicit_gemm_h16.split_range``)."""
    unit = 1 if nhwc else 4
    units = min(wn // 8 // unit, -(-channels // (8 * unit)))
    share = _h16.split_range(rank, units, ranks)
    return range(unit * share.start, unit * share.stop)


def ring_bytes(c: Mapping[str, int]) -> int:
    """The ring's bytes, STAGES x (BN + WN) x 128 (:func:`smem_bytes` without the alignment's 1024)."""
    return c["STAGES"] * (bn(c) + bm(c)) * 128


def cluster_rule(c: Mapping[str, int]) -> str | None:
    """Split-K in clusters (CR = 1) needs SPLIT of 2 to :data:`MAX_CLUSTER_SPLIT`, no stream-K, and a ring that holds
    the tile's fp32 sums (4 x WN x BN bytes: the slices hand them over there; csrc/bagf_ext.cpp's load_plan checks the
    same)."""
    if not c.get("CR", 0):
        return None
    if c.get("SK", 0) or not 2 <= c["SPLIT"] <= MAX_CLUSTER_SPLIT:
        return f"split-K in clusters (CR = 1) takes SPLIT 2 to {MAX_CLUSTER_SPLIT} without stream-K"
    if 4 * bm(c) * bn(c) > ring_bytes(c):
        return (f"split-K in clusters hands a tile's {4 * bm(c) * bn(c)} bytes of sums over in the ring, which has "
                f"{ring_bytes(c)}")
    return None


def grid_refuses(c: Mapping[str, int], problem, k: int) -> str | None:
    """Why ``c``'s grid cannot run ``problem`` of ``k`` k tiles, or None: the epilogue's 32-bit indices must hold for
    the last blocks (N*P*Q + BN and N*P*Q*K below 2^31), a split-K configuration must give every slice 2 k tiles
    or more within implicit_gemm_h16's ``SPLIT_WORKSPACE_LIMIT`` bytes, and a stream-K one count all tiles' k tiles
    in 32 bits. Also implicit_gemm_tma_tf32's."""
    p, q = problem.out_hw
    last = problem.n * p * q + bn(c)
    if last > INT32_MAX or last * problem.k > INT32_MAX:
        return "the epilogue's 32-bit output offsets would pass 2^31 - 1 in the last blocks"
    if c.get("SK", 0) == 2:  # (whole tiles, no workspace: the epilogue's rule bounds the tile count)
        return None
    if c.get("SK", 0):  # (stream-K's workspace is bounded by the grid: workspace_bytes)
        if tiles(c, problem) * k > INT32_MAX:
            return "stream-K's 32-bit iteration count would pass 2^31 - 1 (all tiles' k tiles)"
        return None
    return _h16.split_refuses(c.get("SPLIT", 1), k, tiles(c, problem), bm(c), bn(c), "k tiles",
                              workspace=not c.get("CR", 0))  # (split-K in clusters has none)


def default_for(problem, sms: int = H200_SMS) -> Config:
    """DEFAULT with the problem's DT, a polyphase plan where C % 8 != 0 (the only plan the family has for it), and
    :func:`sized_start`'s tiles, ring (at most 5 stages) and split."""
    c = dict(DEFAULT)
    c["DT"] = DTYPES.get(problem.dtype, 1)
    c["NHWC"] = LAYOUTS.get(problem.layout, 1)
    c["PP"] = 1 if problem.c % 8 else 0
    return sized_start(c, problem, 5, problem_rule, sms)


def sized_start(c: Config, problem, max_stages: int, rule, sms: int = H200_SMS) -> Config:
    """``c`` with implicit_gemm_wgmma_h16's tile rule (the instruction width WN that pads K least; 64 x 64 tiles of
    one warpgroup where the grid has under a quarter of the SMs in tiles), the deepest ring of at most
    ``max_stages`` stages that fits the device, then the largest SPLIT whose slices still fit one wave and that the
    family's problem ``rule`` lets through. Also implicit_gemm_tma_tf32's start."""
    c["WN"] = _wh.instruction_width(problem.k)
    if tiles(c, problem) < sms // 4:
        c.update(WN=64, WG=1)
    c["STAGES"] = deepest_ring(c, max_stages)
    c["SPLIT"] = _wh.one_wave_split(c, tiles(c, problem), lambda s: rule(dict(c, SPLIT=s), problem), sms)
    return c


def deepest_ring(c: Mapping[str, int], max_stages: int) -> int:
    """The most STAGES, at most ``max_stages``, whose ring fits the device's opt-in shared memory with ``c``'s tile.
    Also implicit_gemm_tma_tf32's (through :func:`sized_start`)."""
    return max(s for s in PARAMS["STAGES"] if s <= max_stages and smem_bytes(dict(c, STAGES=s))
               <= SM90_SMEM_LIMIT - STATIC_SMEM)


def blocks_per_sm(c: Mapping[str, int]) -> int:
    return resident_blocks(threads(c), smem_bytes(c), estimated_registers(c))


def features(problem, c: Mapping[str, int], sms: int = H200_SMS) -> dict[str, float]:
    """implicit_gemm_wgmma_h16's :func:`~.implicit_gemm_wgmma_h16.grid_features` of ``c`` on ``problem`` (on its
    polyphase form's k tiles where PP = 1)."""
    return grid_features(c, problem, k_tiles(plan_problem(c, problem)), sms)


def grid_features(c: Mapping[str, int], problem, k: int, sms: int = H200_SMS) -> dict[str, float]:
    """implicit_gemm_wgmma_h16's grid features of ``c`` on ``problem`` of ``k`` k tiles per tile; a stream-K grid as
    its blocks, each with its share of the k tiles. Also implicit_gemm_tma_tf32's."""
    c = {**LEGACY, **c}
    if c["SK"] == 2:  # (each block: its tiles' k tiles, one after another)
        blocks = persistent_blocks(c, problem, sms)
        return _wh.grid_features(blocks, -(-tiles(c, problem) // blocks) * k, 1, blocks_per_sm(c), sms)
    if c["SK"]:
        blocks = stream_k_blocks(c, problem, k, sms)
        return _wh.grid_features(blocks, -(-tiles(c, problem) * k // blocks), 1, blocks_per_sm(c), sms)
    return _wh.grid_features(tiles(c, problem), k, c["SPLIT"], blocks_per_sm(c), sms)


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    c = {**LEGACY, **c}
    return LaunchGeometry(bm=bm(c), bn=bn(c), threads=threads(c), smem=smem_bytes(c), split=c["SPLIT"],
                          dtype=1 + c["DT"], nhwc=c["NHWC"], tma=1, stream_k=c["SK"], split_cluster=c["CR"],
                          polyphase=c["PP"])


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``implicit_gemm_tma_h16_bf16_wn128_mi1_wg2_st5_s1_sm90`` (channels_last), ``..._bf16_nchw_wn128...``,
    ``..._bf16_pp_wn128...`` (polyphase), ``..._st5_sk_sm90`` (stream-K), ``..._st5_pt_sm90`` (persistent blocks),
    ``..._st5_c4_sm90`` (split-K of 4 in clusters)."""
    c = {**LEGACY, **c}
    return (f"{FAMILY}_{'bf16' if c['DT'] else 'fp16'}{'' if c['NHWC'] else '_nchw'}{'_pp' if c['PP'] else ''}"
            f"_wn{c['WN']}_mi{c['MI']}_wg{c['WG']}_st{c['STAGES']}_{split_name(c)}_{arch}")


def split_name(c: Mapping[str, int]) -> str:
    """``s<SPLIT>``, ``c<SPLIT>`` for split-K in clusters, ``sk`` for stream-K or ``pt`` for persistent blocks. Also
    implicit_gemm_tma_tf32's."""
    sk = c.get("SK", 0)
    return "pt" if sk == 2 else "sk" if sk else f"c{c['SPLIT']}" if c.get("CR", 0) else f"s{c['SPLIT']}"



def name_expression(c: Mapping[str, int]) -> str:
    """e.g. ``bagf::implicit_gemm_tma_h16_conv2d<1, 128, 1, 2, 5, 1, 0>`` (whatever SPLIT and CR: launch parameters); an
    NCHW plan's cubin also holds its input copy, ``...;bagf::nchw_to_nhwc<1>`` (:data:`TRANSPOSE_KERNEL`), a
    polyphase plan's its form's kernels instead, ``...;bagf::polyphase_gather<1, 1>;bagf::polyphase_weight<1>``
    (:data:`GATHER_KERNEL` of the input's format, :data:`WEIGHT_KERNEL`)."""
    c = {**LEGACY, **c}
    main = template_expression(KERNEL, TEMPLATE_ORDER, c)
    if c["PP"]:
        return f"{main};{GATHER_KERNEL}<{c['DT']}, {c['NHWC']}>;{WEIGHT_KERNEL}<{c['DT']}>"
    return main if c["NHWC"] else f"{main};{TRANSPOSE_KERNEL}<{c['DT']}>"


gpu_arch = _wgmma.gpu_arch  # sm_90a: wgmma and the TMA need the architecture-specific target
arch_rule = _wgmma.arch_rule  # searched on sm_90 GPUs only


def start_alternatives(problem, sms: int = H200_SMS, arch: str | None = None) -> list[Config]:
    """Second starts the start rule cannot choose between, each measured beside the start (one more compile each, in
    the up-front wave, but for the CR = 1 twin, which shares the start's cubin): the start's
    :func:`twin_alternatives`, then :func:`wide_alternatives`, :func:`narrow_alternatives` and
    :func:`unsplit_alternatives`."""
    start = default_for(problem, sms)
    return (twin_alternatives(start, problem, arch, sms) + wide_alternatives(start, problem, arch, sms)
            + narrow_alternatives(start, problem, arch, sms) + unsplit_alternatives(start, problem, arch, sms))


WIDE_MIN_WAVES = 4
""":func:`wide_alternatives` asks for a grid of at least this many waves of 256-channel tiles."""


def wide_alternatives(start: Config, problem, arch: str | None, sms: int = H200_SMS) -> list[Config]:
    """Persistent 256 x 128 tiles (WN = 256, MI = 1, WG = 2, SK = 2, the deepest ring of at most 5 stages) where the
    start takes 128 channels, K is a multiple of 256 (no padded channels) and that grid has at least
    :data:`WIDE_MIN_WAVES` waves; on sm_90 GPUs only. In the bf16 channels_last sweep of 3x3 256@56 on an H100
    (benchmarks/results/family_sweep_implicit_gemm_tma_h16_h100_bf16_nhwc_pairs.md) this tile was the best plan at
    N = 32 and 128, 3-8% faster than the best 128-channel persistent tile (9% than the start's twin at N = 32): each
    input tile is read once per 256 channels, not twice."""
    if arch != "sm_90" or start["WN"] != 128 or problem.k % 256:
        return []
    wide = dict(start, WN=256, MI=1, WG=2, SK=2, SPLIT=1, CR=0)
    wide["STAGES"] = deepest_ring(wide, 5)
    return [wide] if tiles(wide, problem) >= WIDE_MIN_WAVES * sms else []


NARROW_MIN_GAIN = 0.15
""":func:`narrow_alternatives` asks the 64-channel tiles to fill at least this much more of the device's last wave."""


def wave_fill(c: Mapping[str, int], problem, sms: int = H200_SMS) -> float:
    """The share of the blocks' turns that hold a tile: ``c``'s tiles over whole waves of the blocks the device holds at
    once (1.0 where the last wave is full). One slice's tiles: for SPLIT = 1 (:func:`narrow_alternatives` asks only
    where the start does not split)."""
    slots = sms * blocks_per_sm(c)
    n = tiles(c, problem)
    return n / (-(-n // slots) * slots)


def narrow_alternatives(start: Config, problem, arch: str | None, sms: int = H200_SMS) -> list[Config]:
    """The start's persistent twin in 64-channel tiles (WN = 64, SK = 2, SPLIT = 1) where the start takes 128 channels,
    has more tiles than ``sms`` and the narrow tiles' :func:`wave_fill` is at least :data:`NARROW_MIN_GAIN` above
    the start's; on sm_90 GPUs only. 3x3 128@28 at N = 32 is 196 tiles of 128 channels (1.5 waves on 132 SMs) and
    392 of 64 (2.97): on an H100 in bf16 channels_last, 22.2 against 23.8 us for the start's persistent twin."""
    if arch != "sm_90" or start["WN"] != 128 or start.get("SK", 0) or tiles(start, problem) <= sms:
        return []
    narrow = dict(start, WN=64, SK=2, SPLIT=1, CR=0)
    return [narrow] if wave_fill(narrow, problem, sms) - wave_fill(start, problem, sms) >= NARROW_MIN_GAIN else []


def unsplit_alternatives(start: Config, problem, arch: str | None, sms: int = H200_SMS) -> list[Config]:
    """The start's tile in one consumer warpgroup without a split (WG = 1, MI = 1, SPLIT = 1, the deepest ring of at
    most 6 stages) where the start, two warpgroups of 64-pixel rows, splits its k tiles; on sm_90 GPUs only. The
    start splits only to fill one wave (SPLIT x tiles <= SMs, SPLIT >= 2), so the tiles of half the pixels, at most
    twice as many, fill at most that wave unsplit: each tile's sums in one block, no hand-over of partial sums. 3x3
    256@56 at N = 1 is 50 tiles of 128 x 128, the start split 2 ways (in clusters, its twin), or 98 tiles of 64 pixels
    x 128 channels: in the bf16 channels_last sweeps on an H100
    (benchmarks/results/family_sweep_implicit_gemm_tma_h16_h100_bf16_nhwc_n1*.md) 13.5 us against 14.6 us for cuDNN
    and 14.7 us for the best plan of two warpgroups of 3-5 stages without persistent blocks."""
    if arch != "sm_90" or start["WG"] != 2 or start["MI"] != 1 or start["SPLIT"] < 2:  # (a split is never stream-K)
        return []
    whole = dict(start, WG=1, SPLIT=1, CR=0)
    whole["STAGES"] = deepest_ring(whole, 6)
    return [whole]


def twin_alternatives(start: Config, problem, arch: str | None, sms: int = H200_SMS) -> list[Config]:
    """``start`` with CR = 1 when it splits and :func:`cluster_rule` lets that through, or with SK = 2 when it does
    not split and its tiles pass ``sms``; on sm_90 GPUs only. implicit_gemm_tma_tf32's second starts."""
    if arch != "sm_90" or start.get("SK", 0):
        return []
    if start["SPLIT"] > 1:
        twin = dict(start, CR=1)
        return [twin] if cluster_rule(twin) is None else []
    return [dict(start, SK=2)] if tiles(start, problem) > sms else []


def _rules(smem_limit: int):
    return (_wh.accumulator_rule, stream_k_rule, cluster_rule, shared_memory_rule(smem_bytes, smem_limit - STATIC_SMEM),
            register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    """The family's search space for a device with ``smem_limit`` bytes of opt-in shared memory per block."""
    return Space(FAMILY, PARAMS, _rules(smem_limit))

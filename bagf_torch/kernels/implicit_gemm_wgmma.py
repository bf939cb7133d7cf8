"""Kernel family ``implicit_gemm_wgmma``: implicit-GEMM convolution on Hopper's wgmma, one TF32 product per multiply,
for TF32 mode (csrc/kernels/implicit_gemm_wgmma.cuh).

The arithmetic of ``implicit_gemm_tf32`` and of cuDNN's TF32 convolutions (operands rounded to TF32 to nearest,
fp32 sums), issued by whole warpgroups as ``wgmma.mma_async`` with the weights read by the tensor cores straight
from 128-byte-swizzled shared memory: mma.sync's TF32 rate on the H200 is 312 TFLOP/s, wgmma's ~495. It applies
only to problems tuned in TF32 mode (``ConvProblem.tf32``, part of every plan's key) and only on sm_90 (compiled
for sm_90a); in TF32 mode the correctness check's tolerance follows cuDNN's own TF32 error on the same data
(``tuning.measure.Workspace``).

Knobs (template parameters) and the validity rules enforced before anything is compiled:

========  ==================  ======================================================================
knob      values              rule
========  ==================  ======================================================================
WN        64 128 192 256      wgmma's N: output channels per instruction
NB        1 2                 instructions side by side: BM = WN*NB output channels per block; the
                              accumulators, WN*NB/2 registers per thread, plus ~100 fit 255
WG        1 2                 warpgroups: BN = 64*WG output pixels per block, 128*WG threads
STAGES    3 4 5 6             cp.async pipeline depth (one wgmma group in flight, so >= 3); shared
                              memory 4*STAGES*(BM*32 + 32*(BN+8)) bytes <= the device's opt-in limit
SPLIT     1 2 4 8 16          split-K slices (grid.z); the host zeroes the output and slices add
                              atomically
========  ==================  ======================================================================

Speed on the H200 (benchmarks/results/bench_layers_h200_tf32.{md,log}): the best candidates of a 7 s search run at
0.54-0.61x of cuDNN's TF32 kernels on AlexNet conv2-5 at N = 32 and 128 (the search's own timings), so cuDNN keeps
those plans; at N = 1 the family was kept on conv2 with split-K, 2.06x cuDNN eager and 0.94x in a CUDA graph.

The reduction step is fixed at 32 (one 128-byte swizzle row of weights). Every configuration is valid for every
problem: shapes are run-time arguments and all accesses are bounds checked; 16-byte weight copies only when
C*R*S % 4 == 0 and the weights are 16-byte aligned (else 4-byte copies). SPLIT > 1 makes the summation order
vary from run to run (atomics): results differ by float rounding only.
"""

from __future__ import annotations

import math
from typing import Mapping

from .geometry import LaunchGeometry
from .implicit_gemm_tf32 import applies as _tf32_mode
from .space import Config, Space, register_rule, resident_blocks, shared_memory_rule, template_expression

FAMILY = "implicit_gemm_wgmma"
TF32_PRODUCTS = True  # one TF32 product per multiply: left out where that alone misses the check (Tuner)
SOURCE = "implicit_gemm_wgmma.cuh"
KERNEL = "bagf::implicit_gemm_wgmma_conv2d"
TEMPLATE_ORDER = ("WN", "NB", "WG", "STAGES", "SPLIT")
MIN_ARCH = 90
BK = 32

PARAMS: dict[str, tuple[int, ...]] = {
    "WN": (64, 128, 192, 256),
    "NB": (1, 2),
    "WG": (1, 2),
    "STAGES": (3, 4, 5, 6),
    "SPLIT": (1, 2, 4, 8, 16),
}

# 128 output channels x 128 pixels per block (two warpgroups, one m64n128k8 instruction each per k-step of 8), a
# 4-deep pipeline (135 KB of shared memory); default_for sizes WN and SPLIT to the problem.
DEFAULT: Config = {"WN": 128, "NB": 1, "WG": 2, "STAGES": 4, "SPLIT": 1}

H200_SMS = 132
SM90_SMEM_LIMIT = 232448


def applies(problem) -> str | None:
    """None in TF32 mode; a strict-fp32 problem must not get TF32 products (implicit_gemm_tf32's rule)."""
    return _tf32_mode(problem)


def _grid(problem, c: Mapping[str, int]) -> tuple[int, int]:
    """(blocks of one split slice, k tiles of the whole reduction) for ``problem``."""
    p, q = problem.out_hw
    blocks = -(-(problem.n * p * q) // bn(c)) * -(-problem.k // bm(c))
    return blocks, -(-(problem.c * problem.r * problem.s) // BK)


def default_for(problem, sms: int = H200_SMS) -> Config:
    """DEFAULT with the instruction width WN that pads the K output channels least (the widest on a tie: the input
    tile's gather, the kernel's main cost besides the tensor cores, is shared by more channels), e.g. 192 for
    K = 384, 256 for K = 256, 64 for K = 64; and the smallest SPLIT that fills every SM once (one block per SM),
    while each slice keeps at least 4 k tiles: a batch-1 layer has too few pixels to fill 132 SMs (AlexNet conv4 at
    N = 1: 2 x 2 blocks)."""
    c = dict(DEFAULT)
    c["WN"] = min(PARAMS["WN"], key=lambda wn: (-(-problem.k // wn) * wn, -wn))
    blocks, tiles = _grid(problem, c)
    for split in PARAMS["SPLIT"]:
        if tiles / split < 4:
            break
        c["SPLIT"] = split
        if blocks * split >= sms:
            break
    return c


def bm(c: Mapping[str, int]) -> int:
    return c["WN"] * c["NB"]


def bn(c: Mapping[str, int]) -> int:
    return 64 * c["WG"]


def threads(c: Mapping[str, int]) -> int:
    return 128 * c["WG"]


def smem_bytes(c: Mapping[str, int]) -> int:
    return 4 * c["STAGES"] * (bm(c) * BK + BK * (bn(c) + 8))


def estimated_registers(c: Mapping[str, int]) -> int:
    """The accumulators (WN*NB/2 per thread) plus ~100: two sets of rounded fragments (32), the weights' copy
    plan and addressing. ptxas with nvcc 13.0 (WG=2, STAGES=4): 153 for WN=128 NB=1, 188 for WN=192, 217 for WN=256,
    no spills."""
    return bm(c) // 2 + 100


def blocks_per_sm(c: Mapping[str, int]) -> int:
    return resident_blocks(threads(c), smem_bytes(c), estimated_registers(c))


def features(problem, c: Mapping[str, int], sms: int = H200_SMS) -> dict[str, float]:
    """What a configuration means for ``problem`` beyond its knobs, for ax's model: grid blocks per SM (split
    slices included), k tiles per slice, and blocks one SM holds at once, each log2."""
    blocks, tiles = _grid(problem, c)
    return {"log2_blocks_per_sm": math.log2(blocks * c["SPLIT"] / sms),
            "log2_k_tiles": math.log2(max(1, -(-tiles // c["SPLIT"]))),
            "log2_resident": math.log2(blocks_per_sm(c))}


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    return LaunchGeometry(bm=bm(c), bn=bn(c), threads=threads(c), smem=smem_bytes(c), split=c["SPLIT"], tf32=1)


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``implicit_gemm_wgmma_wn128_nb1_wg2_st4_s1_sm90``."""
    return f"{FAMILY}_wn{c['WN']}_nb{c['NB']}_wg{c['WG']}_st{c['STAGES']}_s{c['SPLIT']}_{arch}"


def name_expression(c: Mapping[str, int]) -> str:
    return template_expression(KERNEL, TEMPLATE_ORDER, c)


def gpu_arch(c: Mapping[str, int], arch: str) -> str:
    """wgmma needs the architecture-specific sm_90a; on any other target the kernel's static_assert fails the
    compile with its reason."""
    return arch + "a" if arch == "sm_90" else arch


def arch_rule(c: Mapping[str, int], arch: str) -> str | None:
    """wgmma compiles only for sm_90a: on another GPU the tuner leaves the family out."""
    return None if arch == "sm_90" else f"wgmma needs an sm_90 GPU, not {arch}"


def _rules(smem_limit: int):
    return (shared_memory_rule(smem_bytes, smem_limit), register_rule(threads, estimated_registers))


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    return Space(FAMILY, PARAMS, _rules(smem_limit))

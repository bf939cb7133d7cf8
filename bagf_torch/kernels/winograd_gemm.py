"""Kernel family ``winograd_gemm``: fp32 Winograd F(m x m, 3x3), m = 2, 4, 5, 6, not fused
(csrc/kernels/winograd_gemm.cuh).

A plan runs two launches of one kernel around a GEMM on the current stream: the filter transform U = G g G^T
and the input transform V = B^T d B (stages 0 and 1, one launch), the E = (MT+2)^2 independent K x C by C x T
products M[e] = U[e] V[e] as one batched SGEMM through cuBLAS (``at::bmm_out``: fp32 with TF32 off), and the
inverse transform with bias (stage 2). U, V and M are workspaces from torch's caching allocator, allocated per
call.

Why a second Winograd dataflow next to the fused ones: at N >= 32 the fused kernels spend most of their time
in the transforms and the output stage, so the products run at a fraction of the SM's FFMA rate
(bench_layers_h200_s5_final.md: F(4x4) at 93-94% of the direct fp32 roof is ~18 TFLOP/s of real work). Here
the products run as one large GEMM near the SGEMM roof and the transforms are memory-bound passes; the price
is the global-memory round trip of V and M (iobound.winograd_gemm_traffic), which the fused kernels avoid.
The GEMM is cuBLAS's, not a template of ours: its tile shapes are cuBLAS's heuristic, and this family tunes
what is ours (the tile size, the workspace layouts the GEMM reads and writes, the transforms' blocks).

TF32: the host refuses the plan (ATen answers, one warning) while torch lets cuBLAS use TF32 for fp32
matmuls (``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision`` other than
"highest"), since the GEMM would then round its operands to TF32 although the convolution is fp32.

Accuracy is the fused families' (the same transforms, the same products in another order): the tuner's
correctness check (relative norm < 1e-4, max < 1e-3 against float64) rejects a candidate above it.

Knobs (template parameters):

========  ===============  =====================================================================
knob      values           meaning
========  ===============  =====================================================================
MT        2 4 5 6          output tile: F(MTxMT, 3x3); E = (MT+2)^2 Winograd points (5 and 6: the
                           Toom-Cook matrices of bagf_torch.winograd.toom_cook; 13x13 maps need 441
                           products per channel pair with F(5x5), 576 with F(4x4) or F(6x6))
TB        64 128 256 512   threads per block of the three transform stages
VL        0 1              V layout: 0 [E][C][T] (threads along tiles), 1 [E][T][C] (along channels)
ML        0 1              M layout: 0 [E][K][T] (the GEMM computes U V), 1 [E][T][K] (V^T U^T)
========  ===============  =====================================================================

No shared memory (staging stage 2's stores through it, a row of tiles at a time, was correct but 3-14% slower
on the H200: benchmarks/results/ab_bagf_wg_staged_out_h200_s7.md). 60 of the 64 combinations are valid: F(6x6)
with 512 threads would need about 152 registers per thread (the register rule).
"""

from __future__ import annotations

from typing import Mapping

from .. import winograd as _transforms
from .space import Config, Space, register_rule, template_expression, thread_count_rule

FAMILY = "winograd_gemm"
SOURCE = "winograd_gemm.cuh"
KERNEL = "bagf::winograd_gemm_stage"
TEMPLATE_ORDER = ("MT", "TB", "VL", "ML")
MIN_ARCH = 70
KERNEL_ARGS = "const float*, const float*, const float*, float*, bagf::Conv2dParams, float*, float*, const float*, int"
"""The kernel's parameter list (the other families take the first five): x, w, bias, y, shape, the U, V and M
workspaces, the stage (0 filters, 1 input tiles, 2 outputs)."""

PARAMS: dict[str, tuple[int, ...]] = {
    "MT": (2, 4, 5, 6),
    "TB": (64, 128, 256, 512),
    "VL": (0, 1),
    "ML": (0, 1),
}

DEFAULT: Config = {"MT": 4, "TB": 256, "VL": 0, "ML": 0}


def applies(problem) -> str | None:
    """None when the family computes ``problem`` (3x3, stride 1, dilation 1, groups 1), else why not."""
    return _transforms.applies(problem)


def points(c: Mapping[str, int]) -> int:
    """E = (MT+2)^2, the Winograd-domain points per tile (the GEMM's batch)."""
    return (c["MT"] + 2) ** 2


def threads(c: Mapping[str, int]) -> int:
    return c["TB"]


def smem_bytes(c: Mapping[str, int]) -> int:
    return 0


def estimated_registers(c: Mapping[str, int]) -> int:
    """The input stage holds the A x A patch and its transform (2 E words) plus ~24 for addressing."""
    return 2 * points(c) + 24


def tiles(c: Mapping[str, int], problem) -> int:
    """T = N * ceil(P/MT) * ceil(Q/MT), the GEMM's column count."""
    return problem.tiles(c["MT"])


def workspace_words(c: Mapping[str, int], problem) -> dict[str, int]:
    """Words of the three per-call workspaces: U (E x K x C), V (E x C x T), M (E x K x T)."""
    e, t = points(c), tiles(c, problem)
    return {"U": e * problem.k * problem.c, "V": e * problem.c * t, "M": e * problem.k * t}


def launch(c: Mapping[str, int]) -> dict[str, int]:
    """The host's plan: ``gemm`` = 1 (three stages around a batched SGEMM, grids sized per call), ``tile`` = MT
    (so the host's Winograd refusal applies), ``layout`` = VL + 2*ML."""
    return {"bm": 1, "bn": c["TB"], "threads": c["TB"], "smem": 0, "split": 1, "tile": c["MT"], "gemm": 1,
            "layout": c["VL"] + 2 * c["ML"]}


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``winograd_gemm_f4_tb256_vl0_ml0_sm90``."""
    return f"{FAMILY}_f{c['MT']}_tb{c['TB']}_vl{c['VL']}_ml{c['ML']}_{arch}"


def name_expression(c: Mapping[str, int]) -> str:
    return template_expression(KERNEL, TEMPLATE_ORDER, c)


def default_for(problem, sms: int = 132) -> Config:
    """DEFAULT whatever the problem: nothing in it depends on the problem's size."""
    return dict(DEFAULT)


def space(smem_limit: int = 0) -> Space:
    return Space(FAMILY, PARAMS, (thread_count_rule(threads, minimum=64), register_rule(threads, estimated_registers)))

"""Kernel family ``winograd_gemm``: Winograd F(m x m, 3x3), m = 2, 4, 5, 6, not fused, fp32 transforms and products
on float32, float16 and bfloat16 tensors in NCHW or channels_last (csrc/kernels/winograd_gemm.cuh).

It computes 3x3 stride-1 convolutions, and strided ones with filters of up to 3s x 3s at stride s as the 3x3
stride-1 convolution of their s x s polyphase components (``winograd_math.polyphase``: C s^2 channels, the filter
zero-padded to 3s x 3s; :func:`applies`). AlexNet's conv1 (11x11, stride 4, C = 3) runs as 3x3 over 48
channels: 1.19x its direct products before F(4x4)'s 4x (F(5x5)'s 4.6x) fewer, where implicit GEMM on it runs
at about half the fp32 roof (671 us at N = 128: benchmarks/results/profile_ncu_h200.md). The transforms read the input and the filters in
place through that index map; nothing is copied.

A plan runs two launches of one kernel around a GEMM on the current stream: the filter transform U = G g G^T
and the input transform V = B^T d B (stages 0 and 1, one launch), the E = (MT+2)^2 independent K x C by C x T
products M[e] = U[e] V[e] as one batched GEMM, and the inverse transform with bias (stage 2). U, V and M are
workspaces from torch's caching allocator, allocated per call.

The GEMM is a knob (GE). GE = 0: cuBLASLt's strided-batch SGEMM (fp32 on the FFMA pipe), called from the host
extension with the heuristic's first algorithm for the shape, whatever torch's TF32 flags say, so that a plan runs
the GEMM its check and its timing saw in every process; ``at::bmm_out``'s cuBLAS SGEMM only where cuBLASLt cannot
be loaded or takes no such shape (with TF32 off: under the flags such a call is ATen's).
GE > 0: our own batched GEMM on tensor cores with fp32 accuracy from three TF32 products
(csrc/kernels/gemm_tf32x3.cuh), compiled into the same cubin as the transforms, with the block tile of
:data:`GEMMS`. On the H200 its best tile is 1.32-1.53x faster than cuBLAS on AlexNet's conv3-5 products
(benchmarks/results/gemm_tf32x3_probe_h200.md); its error against float64 is ~5x fp32's (1.4-1.8e-6 against
2.5-2.9e-7 on those products: the small parts are truncated to TF32), far inside the correctness check.
It needs sm_80 (mma.sync TF32, cp.async): on older GPUs GE > 0 fails to compile and the tuner records that.

GE = 6, 7: the same product on Hopper's warpgroup instruction (csrc/kernels/gemm_wgmma.cuh, wgmma with TF32,
compiled for sm_90a; on any other GPU it fails to compile, which the tuner records). wgmma reads its
shared-memory operand as it is, so U's small parts (U - trunc_tf32(U)) come from memory: stage 0 writes them as
E more batches after U (template flag US, host layout bit 2), doubling U's workspace. On the H200 its tiles
are 1.26-1.48x gemm_tf32x3's best at N = 128 and 1.02-1.23x at N = 32 on AlexNet's conv3-5 products
(benchmarks/results/gemm_wgmma_probe_h200.md); error against float64 1.6-3.0e-6.

Why a second Winograd dataflow next to the fused ones: at N >= 32 the fused kernels spend most of their time
in the transforms and the output stage, so the products run at a fraction of the SM's FFMA rate
(F(4x4) at 93-94% of the direct fp32 roof is ~18 TFLOP/s of real work on AlexNet's conv3-5 at N = 128;
benchmarks/results/winograd_tc_sample_h200.md has the fused families' best sampled times). Here
the products run as one large GEMM near the SGEMM roof and the transforms are memory-bound passes; the price
is the global-memory round trip of V and M (iobound.winograd_gemm_traffic), which the fused kernels avoid.
With GE = 0 the GEMM is cuBLAS's: its tile shapes are cuBLAS's heuristic, and this family tunes what is ours
(the tile size, the workspace layouts the GEMM reads and writes, the transforms' blocks).

TF32: cuBLASLt's GEMM computes in fp32 whatever torch's flags say (csrc/cublaslt_plan.h, ``resolve_sgemm``), so
the plan computes what its check passed whatever the program set. at::bmm_out follows torch's TF32 flags for fp32
matmuls: while a program allows TF32 there (``torch.backends.cuda.matmul.allow_tf32`` or
``torch.set_float32_matmul_precision`` other than "highest"), a call cuBLASLt cannot take is ATen's answer.

Accuracy is the fused families' (the same transforms, the same products in another order): the tuner's
correctness check (relative norm < 1e-4, max < 1e-3 against float64) rejects a candidate above it.

Knobs (template parameters; GE picks the second kernel):

========  ===============  =====================================================================
knob      values           meaning
========  ===============  =====================================================================
MT        2 4 5 6          output tile: F(MTxMT, 3x3); E = (MT+2)^2 Winograd points (5 and 6: the
                           Toom-Cook matrices of bagf_torch.winograd_math.toom_cook; 13x13 maps need 441
                           products per channel pair with F(5x5), 576 with F(4x4) or F(6x6))
TB        64 128 256 512   threads per block of the three transform stages
VL        0 1              V layout: 0 [E][C][T] (threads along tiles), 1 [E][T][C] (along channels)
ML        0 1              M layout: 0 [E][K][T] (the GEMM computes U V), 1 [E][T][K] (V^T U^T)
GE        0 1 ... 7        the GEMM: 0 cuBLAS SGEMM; 1-5 gemm_tf32x3 with GEMMS[GE]'s tile; 6-7
                           gemm_wgmma with WGMMA_GEMMS[GE]'s tile (sm_90a; stage 0 then also writes
                           U's small parts). GE > 0 needs VL = ML = 0 (row-major U[e] times V[e])
SO        0 1              1: stage 2 (inverse transform) takes whole images of one channel per block and
                           writes them out through shared memory in contiguous runs (needs ML = 0 and
                           TB*MT*MT floats <= 48 KB of static shared memory), and NHWC = 0
DT        0 1 2            the problem's dtype (float32, float16, bfloat16): the input, weight and bias
                           are read in it and widened, the output rounded to it once; transforms,
                           workspaces and GEMM are fp32 whatever it is (so 16-bit plans carry fp32's
                           products: the check bounds them by twice cuDNN's 16-bit error)
NHWC      0 1              the problem's memory format: 1 channels_last input and output, KRSC weight
                           (the host converts a weight in the other format per call); DT and NHWC are
                           fixed by the problem (problem_rule), the tile knobs searched for it
========  ===============  =====================================================================

No shared memory (staging stage 2's stores through it, a row of tiles at a time, was correct but 3-14% slower
on the H200: benchmarks/results/ab_winograd_gemm_staged_out_h200.md), except SO = 1's whole-image planes of stage 2,
static: without them, on conv4 at N = 128 with F(5x5), the per-tile stores write 6-8 L2 sectors per sector of
output and stage 2 runs at 1.0-1.5 TB/s (ncu: benchmarks/results/ncu_winograd_gemm_stages_h200.log). 291 of the 1024 combinations of the tile knobs are
valid (1368 of 6144 with DT and NHWC, 291 per dtype and NCHW): F(6x6) with 512 threads would need about 152
registers per thread (the register rule), GE > 0 takes only VL = ML = 0, and SO = 1 takes ML = 0, NCHW and
TB*MT*MT <= 12288.

In channels_last the start point (:func:`default_for`) takes VL = ML = 1 with cuBLAS's GEMM: threads along
channels in the input and output stages, so that both read and write contiguous channel runs.
"""

from __future__ import annotations

from typing import Mapping

from .. import winograd_math as _transforms
from .geometry import LaunchGeometry
from .space import (Config, Space, register_rule, shared_memory_rule, template_expression,
                    thread_count_rule)

FAMILY = "winograd_gemm"
SOURCE = "winograd_gemm.cuh"
KERNEL = "bagf::winograd_gemm_stage"
TEMPLATE_ORDER = ("MT", "TB", "VL", "ML", "DT", "NHWC", "SO")
GEMM_KERNEL = "bagf::gemm_tf32x3"
GEMMS: dict[int, tuple[int, int, int, int, int, int, int]] = {
    1: (64, 64, 32, 2, 2, 4, 1),
    2: (64, 128, 32, 1, 4, 2, 1),
    3: (128, 64, 32, 2, 2, 3, 2),
    4: (64, 128, 32, 1, 4, 4, 1),
    5: (128, 128, 32, 2, 4, 3, 1),
}
"""GE -> gemm_tf32x3's (BM, BN, BK, WM, WN, STAGES, MINB). Of twelve tiles measured on AlexNet's conv3-5 products
at N = 32 and 128 (benchmarks/results/gemm_tf32x3_probe_h200.md), 1 and 3 are the fastest at N = 32 (T = 288 columns), 2 and 4
at N = 128 (T = 1152); 5, the largest, is there for larger products (ResNet-style layers at 56 x 56)."""
WGMMA_GEMM_KERNEL = "bagf::gemm_wgmma"
WGMMA_GEMMS: dict[int, tuple[int, int, int, int]] = {
    6: (128, 1, 2, 4),
    7: (64, 1, 1, 4),
}
"""GE -> gemm_wgmma's (WN, NB, WG, STAGES): block tile WN*NB output channels x 64*WG Winograd tiles, k tile 32. Of
seven tiles measured on AlexNet's conv3-5 products (benchmarks/results/gemm_wgmma_probe_h200.md), 6 is the fastest on
15 of 18 (N = 32 and 128), 7 on the three N = 32, F(5x5) products (T = 288: more, smaller blocks)."""
MIN_ARCH = 70
KERNEL_ARGS = "const void*, const void*, const void*, void*, bagf::Conv2dParams, float*, float*, const float*, int"
"""The kernel's parameter list: x, w, bias, y (of the plan's dtype, DT), shape, the fp32 U, V and M workspaces, the
stage (0 filters, 1 input tiles, 2 outputs, 3 filters and input tiles)."""
GEMM_KERNEL_ARGS = "const float*, const float*, float*, int, int, int, long long, long long, long long"
"""gemm_tf32x3's parameter list: A, B, C, M, N, K, the three batch strides."""

PARAMS: dict[str, tuple[int, ...]] = {
    "MT": (2, 4, 5, 6),
    "TB": (64, 128, 256, 512),
    "VL": (0, 1),
    "ML": (0, 1),
    "GE": (0, 1, 2, 3, 4, 5, 6, 7),
    "SO": (0, 1),
    "DT": (0, 1, 2),
    "NHWC": (0, 1),
}

DEFAULT: Config = {"MT": 4, "TB": 256, "VL": 0, "ML": 0, "GE": 1, "SO": 0, "DT": 0, "NHWC": 0}
LEGACY: Config = {"GE": 0, "SO": 0, "DT": 0, "NHWC": 0}
"""What a configuration recorded before the GE, SO, DT and NHWC knobs existed ran: cuBLAS's GEMM, unstaged
outputs, float32 NCHW (kernels.complete_config)."""

DTYPES: dict[str, int] = {"float32": 0, "float16": 1, "bfloat16": 2}
"""The problem's dtype name -> DT (the host's LaunchGeometry.dtype uses the same numbers)."""
LAYOUTS: dict[str, int] = {"nchw": 0, "nhwc": 1}
"""The problem's memory format -> NHWC."""
FORMATS: tuple[tuple[str, str], ...] = tuple((d, l) for d in DTYPES for l in LAYOUTS)
"""Every dtype in both memory formats: the tensors are read and written in them, the transforms, workspaces and
GEMM are fp32 (kernels.format_refuses)."""


def problem_rule(c: Mapping[str, int], problem) -> str | None:
    """None when ``c`` was compiled for the problem's dtype and memory format (DT, NHWC)."""
    want = (DTYPES.get(problem.dtype), LAYOUTS.get(problem.layout))
    if (c.get("DT", 0), c.get("NHWC", 0)) != want:
        return f"compiled for DT={c.get('DT', 0)}, NHWC={c.get('NHWC', 0)}; this problem is {problem.dtype} {problem.layout}"
    return None


def applies(problem) -> str | None:
    """None when the family computes ``problem`` (3x3, stride 1, dilation 1, groups 1; or stride s > 1 with
    filters of up to 3s x 3s through their polyphase components, ``winograd_math.polyphase_applies``), else why not."""
    return _transforms.polyphase_applies(problem)


def channels(problem) -> int:
    """C' = C s^2, the GEMM's reduction: the input channels, times s^2 polyphase components at stride s."""
    return problem.c * _transforms.phase_stride(problem) ** 2


def points(c: Mapping[str, int]) -> int:
    """E = (MT+2)^2, the Winograd-domain points per tile (the GEMM's batch)."""
    return (c["MT"] + 2) ** 2


def threads(c: Mapping[str, int]) -> int:
    return c["TB"]


def uses_wgmma(c: Mapping[str, int]) -> bool:
    """True when the plan's GEMM is gemm_wgmma (GE 6-7): sm_90a, and U carries its small parts."""
    return c["GE"] in WGMMA_GEMMS


def u_planes(c: Mapping[str, int]) -> int:
    """U's batches per point in the workspace: 2 with gemm_wgmma (U, then U - trunc_tf32(U)), else 1."""
    return 2 if uses_wgmma(c) else 1


def gemm_tile(c: Mapping[str, int]) -> tuple[int, int, int, int, int, int, int] | None:
    """(BM, BN, BK, WM, WN, STAGES, MINB) of the plan's gemm_tf32x3 (GE 1-5), None otherwise."""
    return GEMMS.get(c["GE"])


def gemm_block(c: Mapping[str, int]) -> tuple[int, int, int, int] | None:
    """(BM, BN, BK, STAGES) of the plan's own GEMM block, None for cuBLAS (GE = 0)."""
    if uses_wgmma(c):
        wn, nb, wg, stages = WGMMA_GEMMS[c["GE"]]
        return wn * nb, 64 * wg, 32, stages
    tile = gemm_tile(c)
    if tile is None:
        return None
    bm, bn, bk, _, _, stages, _ = tile
    return bm, bn, bk, stages


def tile_smem_bytes(tile: tuple[int, ...]) -> int:
    """Dynamic shared memory of gemm_tf32x3 with ``tile`` = (BM, BN, BK, WM, WN, STAGES, MINB): STAGES x
    (BM x (BK+8) + BK x (BN+4)) floats, its padded operand tiles."""
    bm, bn, bk, _, _, st, _ = tile
    return 4 * st * (bm * (bk + 8) + bk * (bn + 4))


def wgmma_smem_bytes(tile: tuple[int, int, int, int]) -> int:
    """Dynamic shared memory of gemm_wgmma with ``tile`` = (WN, NB, WG, STAGES): STAGES x (2 planes of BM x 32
    + 32 x (BN + 8)) floats (A's big and small parts, B's padded tile)."""
    wn, nb, wg, st = tile
    return 4 * st * (2 * wn * nb * 32 + 32 * (64 * wg + 8))


def gemm_threads(c: Mapping[str, int]) -> int:
    """Threads per block of the plan's own GEMM (0 for cuBLAS)."""
    if uses_wgmma(c):
        return 128 * WGMMA_GEMMS[c["GE"]][2]
    tile = gemm_tile(c)
    return 0 if tile is None else 32 * tile[3] * tile[4]


def gemm_smem_bytes(c: Mapping[str, int]) -> int:
    """Dynamic shared memory of the plan's own GEMM (0 for cuBLAS)."""
    if uses_wgmma(c):
        return wgmma_smem_bytes(WGMMA_GEMMS[c["GE"]])
    tile = gemm_tile(c)
    return 0 if tile is None else tile_smem_bytes(tile)


def staged_smem_bytes(c: Mapping[str, int]) -> int:
    """Static shared memory of the transform kernel: stage 2's output planes when SO = 1 (TB*MT*MT floats)."""
    return 4 * c["TB"] * c["MT"] ** 2 if c.get("SO") else 0


def staged_images(c: Mapping[str, int], problem) -> int:
    """Whole images per block of the staged stage 2 (SO = 1): TB // tiles per image; 0 when an image has more
    tiles than the block threads (that launch then runs per tile, as SO = 0)."""
    per_img = -(-problem.out_hw[0] // c["MT"]) * -(-problem.out_hw[1] // c["MT"])
    return c["TB"] // per_img if c.get("SO") and c["ML"] == 0 else 0


def smem_bytes(c: Mapping[str, int]) -> int:
    """The transform kernel's (the plan's first kernel) dynamic shared memory: none (SO = 1's planes are static,
    :func:`staged_smem_bytes`). The plan's own GEMM has its own, :func:`gemm_smem_bytes`, passed to the host as
    ``gemm_smem``."""
    return 0


def estimated_registers(c: Mapping[str, int]) -> int:
    """The input stage holds the A x A patch and its transform (2 E words) plus ~24 for addressing."""
    return 2 * points(c) + 24


def tiles(c: Mapping[str, int], problem) -> int:
    """T = N * ceil(P/MT) * ceil(Q/MT), the GEMM's column count."""
    return problem.tiles(c["MT"])


def workspace_words(c: Mapping[str, int], problem) -> dict[str, int]:
    """Words of the three per-call workspaces: U (E x K x C', twice with gemm_wgmma), V (E x C' x T), M (E x K x T);
    C' = :func:`channels`."""
    e, t, cc = points(c), tiles(c, problem), channels(problem)
    return {"U": u_planes(c) * e * problem.k * cc, "V": e * cc * t, "M": e * problem.k * t}


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    """The host's plan: ``gemm`` = 1 (the transform stages around a batched GEMM, grids sized per call),
    ``tile`` = MT (so the host's Winograd refusal applies), ``layout`` = VL + 2*ML + 4*(U carries its small
    parts, gemm_wgmma) + 8*SO (staged stage 2, whose grid the host sizes); with our own GEMM (GE > 0)
    also its block tile, threads and shared memory (``gemm_bm``, ``gemm_bn``, ``gemm_threads``, ``gemm_smem``)."""
    block = gemm_block(c)
    own = {} if block is None else {"gemm_bm": block[0], "gemm_bn": block[1], "gemm_threads": gemm_threads(c),
                                    "gemm_smem": gemm_smem_bytes(c)}
    return LaunchGeometry(bm=1, bn=c["TB"], threads=c["TB"], smem=0, tile=c["MT"], gemm=1,
                          layout=c["VL"] + 2 * c["ML"] + 4 * (u_planes(c) - 1) + 8 * c["SO"],
                          dtype=c.get("DT", 0), nhwc=c.get("NHWC", 0), **own)


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``winograd_gemm_f4_tb256_vl0_ml0_sm90`` (cuBLAS's GEMM), ``winograd_gemm_f5_tb64_vl0_ml0_ge6_so1_sm90``
    (the names of configurations from before the GE and SO knobs are unchanged)."""
    ge = f"_ge{c['GE']}" if c["GE"] else ""
    so = "_so1" if c.get("SO") else ""
    fmt = (f"_{('fp32', 'fp16', 'bf16')[c.get('DT', 0)]}{'_nhwc' if c.get('NHWC') else ''}"
           if c.get("DT") or c.get("NHWC") else "")  # (float32 NCHW names as before the knobs)
    return f"{FAMILY}_f{c['MT']}_tb{c['TB']}_vl{c['VL']}_ml{c['ML']}{ge}{so}{fmt}_{arch}"


def name_expression(c: Mapping[str, int]) -> str:
    """The transform kernel's instantiation (with US = 1 for gemm_wgmma), then (GE > 0) the GEMM's, separated by
    ';' (one cubin)."""
    if uses_wgmma(c):
        stages = template_expression(KERNEL, TEMPLATE_ORDER, c)[:-1] + ", 1>"  # US = 1: U's small parts too
        return f"{stages};{WGMMA_GEMM_KERNEL}<{', '.join(map(str, WGMMA_GEMMS[c['GE']]))}>"
    stages = template_expression(KERNEL, TEMPLATE_ORDER, c)
    tile = gemm_tile(c)
    if tile is None:
        return stages
    return f"{stages};{GEMM_KERNEL}<{', '.join(map(str, tile))}>"


def staging_rule(c: Mapping[str, int]) -> str | None:
    """SO = 1 stages stage 2's outputs along tiles of one channel (M stored [E][K][T]) in TB*MT*MT floats of
    static shared memory, at most 48 KB."""
    if c["SO"] and c["ML"]:
        return f"SO=1 (staged outputs) needs ML=0, not ML={c['ML']}"
    if c["SO"] and c.get("NHWC"):
        return "SO=1 (staged outputs) writes whole NCHW planes; not with NHWC=1"
    if staged_smem_bytes(c) > 48 * 1024:
        return (f"SO=1 with TB={c['TB']}, MT={c['MT']} needs {staged_smem_bytes(c)} bytes of static shared memory "
                "(> 48 KB)")
    return None


def gpu_arch(c: Mapping[str, int], arch: str) -> str:
    """The NVRTC target for this configuration on a GPU of ``arch`` ("sm_90"): gemm_wgmma needs the
    architecture-specific sm_90a; anything else compiles for ``arch`` (where gemm_wgmma's static_assert then
    makes the compile fail with its reason)."""
    return arch + "a" if uses_wgmma(c) and arch == "sm_90" else arch


def gemm_rule(c: Mapping[str, int]) -> str | None:
    """Our GEMM multiplies row-major U[e] (K x C) by row-major V[e] (C x T) into M[e] (K x T): VL = ML = 0."""
    if c["GE"] and (c["VL"] or c["ML"]):
        return f"GE={c['GE']} (our GEMM) takes only VL=0 and ML=0, not VL={c['VL']}, ML={c['ML']}"
    return None


def default_for(problem, sms: int = 132, arch: str | None = None) -> Config:
    """DEFAULT with the output tile of F(4x4, 3x3) or F(5x5, 3x3) that multiplies less on ``problem``
    (``winograd_math.multiplies``: the edge tiles' padding counted; a tie keeps 4, the more accurate); on an sm_90 GPU
    the wgmma GEMM whose blocks fit the K x T products better (:func:`wgmma_start`), and staged outputs (SO = 1).

    The tile is the knob that costs most when wrong, and a short tuning budget lives on its start (a compile of
    this family takes 3.5-4.3 s on the H200's host): 13x13 outputs (AlexNet's conv3-5) take 3 x 3 tiles of 5
    against 4 x 4 of 4, 23% fewer products, and F(5x5) won all six of them at N = 32 and 128 in the recorded space
    (benchmarks/results/param_analysis_h200_winograd_gemm.md); at 56x56 and 28x28, where the two tie, F(4x4) won
    at N = 32. F(2x2) and F(6x6) stay in the search, not in the start: the first multiplies 1.8x more per output,
    and the best F(6x6) plan was 1.16x the optimum (geomean over that recording's problems)."""
    m = min((4, 5), key=lambda m: (_transforms.multiplies(problem, m), m))
    fmt = {"DT": DTYPES.get(problem.dtype, 0), "NHWC": LAYOUTS.get(problem.layout, 0)}
    if fmt["NHWC"]:
        # channels_last: threads along channels in the input and output stages (VL = ML = 1, each reading and
        # writing contiguous channel runs), which our GEMM's row-major operands do not take: cuBLAS's
        return dict(DEFAULT, MT=m, VL=1, ML=1, GE=0, SO=0, **fmt)
    if arch != "sm_90":
        return dict(DEFAULT, MT=m, **fmt)
    return dict(DEFAULT, MT=m, GE=wgmma_start(problem.k, tiles(dict(DEFAULT, MT=m), problem)), SO=1, **fmt)


def gemm_blocks(c: Mapping[str, int], problem) -> int | None:
    """Blocks of the plan's own GEMM launch (E x ceil(K/BM) x ceil(T/BN)); None for cuBLAS's (GE = 0)."""
    if not c["GE"]:
        return None
    if uses_wgmma(c):
        wn, nb, wg, _ = WGMMA_GEMMS[c["GE"]]
        bm, bn = wn * nb, 64 * wg
    else:
        bm, bn = GEMMS[c["GE"]][:2]
    return points(c) * -(-problem.k // bm) * -(-tiles(c, problem) // bn)


def start_alternatives(problem, sms: int = 132, arch: str | None = None) -> list[Config]:
    """Second start points, measured right after :func:`default_for`'s (as warm-start seeds are) where the sweep of
    ResNet-18's 3x3 stride-1 layers at N = 32 on the H200 (benchmarks/results/family_sweep_winograd_gemm_h200_resnet18_n32.md)
    found the start's tile or GEMM far from the best, for reasons the start's rules do not see:

    * the start's GEMM launch fills fewer than two waves of the GPU's SMs: F(2x2)'s four times as many columns
      fill them (512 channels on 7x7 maps: F(4x4)'s 144 blocks on 132 SMs ran at 0.86 of F(2x2) with the same
      128 x 128 wgmma blocks, the family's best there; 7 s tunings kept F(4x4), 25 s ones found F(2x2));
    * K <= 64, where wgmma's tiles are 64 x 64 (GE 7): gemm_tf32x3's 64 x 128 tile (GE 2) was 0.99 of the best
      on 64 channels at 56x56, the start 0.90 (AlexNet's conv1, K = 64: 25 s tunings kept GE 2, 4 or 7).

    Each costs one compile (in the up-front wave) and one timing; without an sm_90 start (no wgmma) there are none."""
    start = default_for(problem, sms, arch)
    if arch != "sm_90" or not uses_wgmma(start):
        return []
    out = []
    blocks = gemm_blocks(start, problem)
    if blocks is not None and blocks < 2 * sms and start["MT"] != 2:
        small = dict(start, MT=2, SO=0)
        small["GE"] = wgmma_start(problem.k, tiles(small, problem))
        out.append(small)
    if problem.k <= 64:
        out.append(dict(start, GE=2, SO=0))
    return out


def wgmma_start(k: int, t: int) -> int:
    """The wgmma GEMM to start from for a K x T output per Winograd point: 6 (blocks of 128 channels x 128 columns),
    unless padding K x T to its blocks costs over 10% more than padding it to 7's 64 x 64 blocks. Of the products
    measured (benchmarks/results/gemm_wgmma_probe_h200.md: AlexNet's conv3-5, K = 256 and 384, F(4x4) to F(6x6),
    N = 32 and 128), 7 was the fastest exactly on the three with T = 288 (128-column blocks pad it to 384, 64-column
    ones to 320), 6 on the 15 others (T = 512, 1152 and 2048: no padding with either). With K = 64 (AlexNet's conv1)
    a 128-channel block is half padding: every 25 s tuning of conv1 at N = 32 and 128 kept a 64-channel GEMM tile,
    GE 4 and 7 in benchmarks/results/first_call_alexnet_h200_25s.md, GE 7 and 2 in bench_layers_h200.md."""
    def padded(ge: int) -> float:
        wn, nb, wg, _ = WGMMA_GEMMS[ge]
        rows, cols = wn * nb, 64 * wg
        return (-(-k // rows) * rows / k) * (-(-t // cols) * cols / t)

    return 7 if padded(6) > 1.1 * padded(7) else 6


def arch_rule(c: Mapping[str, int], arch: str) -> str | None:
    """gemm_wgmma (GE 6-7) compiles only for sm_90a, and bfloat16 outputs (DT = 2: ``cvt.rn.bf16.f32``) for sm_80
    and newer: on another GPU the tuner leaves them out of the search."""
    if uses_wgmma(c) and arch != "sm_90":
        return f"GE={c['GE']} (wgmma) needs an sm_90 GPU, not {arch}"
    if c.get("DT") == 2 and _sm(arch) < 80:
        return f"DT=2 (bfloat16) needs sm_80 or newer, not {arch}"
    return None


def _sm(arch: str) -> int:
    """80 for "sm_80", 90 for "sm_90" (a malformed name: 0)."""
    digits = "".join(ch for ch in arch.split("_")[-1] if ch.isdigit())
    return int(digits) if digits else 0


def space(smem_limit: int = 0) -> Space:
    """Every configuration; with ``smem_limit`` (the device's opt-in bytes per block, which the tuner passes) only
    those whose own GEMM's shared memory fits it (the host refuses the others at load: on sm_86/89, 99 KB, the
    largest GEMM tiles, 106-110 KB, each cost a compile to learn it). The transform stages use none."""
    rules = [thread_count_rule(threads, minimum=64), register_rule(threads, estimated_registers), gemm_rule,
             staging_rule]
    if smem_limit:
        rules.append(shared_memory_rule(gemm_smem_bytes, smem_limit))
    return Space(FAMILY, PARAMS, tuple(rules))

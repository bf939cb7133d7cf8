"""Kernel family ``cublaslt_1x1``: a 1x1 convolution at stride 1 without padding as cuBLASLt GEMMs with the bias in the
same call (``LaunchGeometry.blas``; the host side is csrc/cublaslt_plan.h).

A 1x1 convolution is a matrix product: each output pixel's K channels are the weight [K][C] times the pixel's C input
channels. In channels_last that is one GEMM over all N*H*W pixels, the bias added by cuBLASLt's epilogue; in NCHW a
strided batch of one GEMM per image (the weight shared, batch stride 0), where the bias runs along a dimension the
epilogue cannot add along, so it comes in as the GEMM's C (beta = 1): one image's worth of it, broadcast per call (a
small copy beside the GEMM), batch stride 0, or, where cuBLASLt takes no such C, the whole output filled with it
first and C = D. The products are cuBLASLt's own kernels (torch's copy of the library, found at run time): in TF32
mode one TF32 product per multiply, asked for explicitly (CUBLAS_COMPUTE_32F_FAST_TF32: torch's matmul TF32 flag is
off by default and is not the convolution's), in strict fp32 fp32 products, in float16 and bfloat16 fp32 sums
(split-K partial sums too). On the H200 cuBLAS's TF32 GEMM took ResNet's 1x1 NCHW layers 1.27-1.78x faster than
cuDNN's TF32 convolution, without the bias (``benchmarks/results/conv1x1_gemm_probe_h200.md``); adding the bias as
ATen's ``baddbmm`` (the whole output written with the bias first) lost that gain. What the bias costs here, with the
epilogue (channels_last) or as C (NCHW: a copy of K*H*W values per call, or of the whole output), is not measured
yet.

What is tuned is which algorithm runs: cuBLASLt's heuristic lists up to eight for the call's shape and alignments,
best first, and ALG picks an entry of that list; WS is the workspace the heuristic may give them (none, or 32 MiB,
which admits split-K algorithms). The host asks the heuristic once per shape a plan sees. So a plan names a position
in cuBLASLt's list, not a kernel: under another cuBLAS version the same entry may be another algorithm (any of them
computes the product; the error check ran on the one tuned), and a shape whose list is shorter than ALG + 1 runs
through ATen with one warning.

| knob | values | meaning |
|---|---|---|
| ALG | 0-7 | the entry of the heuristic's list |
| WS | 0, 1 | workspace limit: 0, or 32 MiB |
| DT | 0, 1, 2 | float32, float16, bfloat16 (fixed by the problem) |
| NHWC | 0, 1 | NCHW or channels_last (fixed by the problem) |
| TF | 0, 1 | TF32 products (fixed by the problem: 1 in TF32 mode; float32 only) |

Nothing is compiled (``LIBRARY``): a configuration loads at once, with no cubin. The runtime's tuner searches the
family unless ``BAGF_CUBLASLT=0`` (``kernels.families_for``); a cached or imported plan of it is used either way.
"""

from __future__ import annotations

from typing import Mapping

from .geometry import LaunchGeometry
from .space import Config, Space

FAMILY = "cublaslt_1x1"
TF32_PRODUCTS = True  # in TF32 mode (TF = 1): left out where that alone misses the check (Tuner)
SOURCE = ""  # (a library family: no kernel source, no cubin)
KERNEL = ""
LIBRARY = "cublasLt"
MIN_ARCH = 80  # (TF32 and bfloat16 products)
FORMATS = tuple((dt, fmt) for dt in ("float32", "float16", "bfloat16") for fmt in ("nchw", "nhwc"))

WORKSPACE_MIB = 32
"""The workspace limit of WS = 1 (torch's own cuBLASLt workspace on Hopper is of this order)."""

PARAMS: dict[str, tuple[int, ...]] = {
    "ALG": tuple(range(8)),
    "WS": (0, 1),
    "DT": (0, 1, 2),
    "NHWC": (0, 1),
    "TF": (0, 1),
}
DEFAULT: Config = {"ALG": 0, "WS": 1, "DT": 0, "NHWC": 0, "TF": 0}

_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
_DT_NAMES = {0: "fp32", 1: "fp16", 2: "bf16"}


def _tf32_fp32_only(c: Mapping[str, int]) -> str | None:
    return "TF32 products are for float32 only" if c["TF"] and c["DT"] != 0 else None


def space(smem_limit: int = 0) -> Space:
    """Every configuration (``smem_limit`` does not apply: cuBLASLt sizes its own kernels)."""
    return Space(FAMILY, PARAMS, (_tf32_fp32_only,))


def applies(problem) -> str | None:
    """None for a 1x1 convolution at stride 1 without padding (any dilation: a 1x1 filter has no taps apart)."""
    if (problem.r, problem.s) != (1, 1) or tuple(problem.stride) != (1, 1) or tuple(problem.padding) != (0, 0):
        return "a cuBLASLt plan computes 1x1 convolutions at stride 1 without padding"
    if getattr(problem, "groups", 1) != 1:
        return "grouped convolution"
    return None


def problem_rule(c: Mapping[str, int], problem) -> str | None:
    """The problem fixes DT, NHWC and TF."""
    if c["DT"] != _DTYPES.get(problem.dtype, -1):
        return f"DT={c['DT']} is not the problem's dtype ({problem.dtype})"
    if c["NHWC"] != (problem.layout == "nhwc"):
        return f"NHWC={c['NHWC']} is not the problem's memory format ({problem.layout})"
    if c["TF"] != (problem.dtype == "float32" and bool(problem.tf32)):
        return f"TF={c['TF']} is not the problem's TF32 mode"
    return None


def default_for(problem, sms: int = 132) -> Config:
    """The heuristic's first choice with a workspace, in the problem's dtype, format and TF32 mode."""
    dt = _DTYPES.get(problem.dtype, 0)
    return {"ALG": 0, "WS": 1, "DT": dt, "NHWC": int(problem.layout == "nhwc"),
            "TF": int(dt == 0 and bool(problem.tf32))}


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``cublaslt_1x1_fp32_nchw_tf32_a0_ws32_sm90``."""
    fmt = "nhwc" if c["NHWC"] else "nchw"
    return (f"{FAMILY}_{_DT_NAMES[c['DT']]}_{fmt}{'_tf32' if c['TF'] else ''}_a{c['ALG']}"
            f"_ws{WORKSPACE_MIB * c['WS']}_{arch}")


def name_expression(c: Mapping[str, int]) -> str:
    """No template to instantiate: the library's name (what logs and digests read)."""
    return LIBRARY


def threads(c: Mapping[str, int]) -> int:
    return 0


def smem_bytes(c: Mapping[str, int]) -> int:
    return 0


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    return LaunchGeometry(blas=2 if c["TF"] else 1, blas_algo=c["ALG"], blas_ws=WORKSPACE_MIB * c["WS"],
                          dtype=c["DT"], nhwc=c["NHWC"], tf32=c["TF"])

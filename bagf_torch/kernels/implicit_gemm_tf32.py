"""Kernel family ``implicit_gemm_tf32``: implicit-GEMM convolution with one TF32 product per multiply, for TF32 mode
(csrc/kernels/implicit_gemm_tc.cuh's ``implicit_gemm_tf32_conv2d``).

PyTorch runs fp32 convolutions with cuDNN's TF32 kernels by default (``torch.backends.cudnn.allow_tf32`` is
True): operands rounded to TF32 (10-bit mantissa), products on the tensor cores, fp32 sums. A caller in that
mode accepts that error, and this family computes the same way: ``implicit_gemm_tc``'s kernel (same tiles,
pipeline, split-K and knobs) with each operand rounded to TF32 once and one ``mma.sync`` per product instead of
three. It applies only to problems tuned in TF32 mode (``ConvProblem.tf32``, part of every plan's key), so a
strict-fp32 caller never gets one of its plans; in TF32 mode the correctness check's tolerance follows what
cuDNN's own TF32 convolution misses by on the same data (``tuning.measure.Workspace``). Where cuDNN computes a
problem without TF32 (AlexNet conv1, C = 3) the bounds are fp32's and TF32 products cannot meet them: the tuner
leaves this family out there (``TF32_PRODUCTS``, ``Tuner._within_reach``) and searches ``implicit_gemm_tc``.

Knobs, validity rules, launch geometry, start point and the search's features are ``implicit_gemm_tc``'s. Its
register estimate counts both parts of the split fragments, which one product does not need: an upper bound, so
the space may leave out a few large tiles that would fit.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from . import implicit_gemm_tc as _tc
from .geometry import LaunchGeometry
from .space import Config, Space, template_expression

FAMILY = "implicit_gemm_tf32"
TF32_PRODUCTS = True  # one TF32 product per multiply: left out where that alone misses the check (Tuner)
SOURCE = _tc.SOURCE
KERNEL = "bagf::implicit_gemm_tf32_conv2d"
TEMPLATE_ORDER = _tc.TEMPLATE_ORDER
MIN_ARCH = _tc.MIN_ARCH
PARAMS: dict[str, tuple[int, ...]] = dict(_tc.PARAMS)
DEFAULT: Config = dict(_tc.DEFAULT)

default_for = _tc.default_for
features = _tc.features
warps_in_flight = _tc.warps_in_flight
threads = _tc.threads
smem_bytes = _tc.smem_bytes
estimated_registers = _tc.estimated_registers  # (three products' split fragments: an upper bound for one)


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    """``implicit_gemm_tc``'s geometry, marked as TF32 products (the op sends a call made with TF32 off to ATen)."""
    return dataclasses.replace(_tc.launch(c), tf32=1)


blocks_per_sm = _tc.blocks_per_sm


def applies(problem) -> str | None:
    """None in TF32 mode; a strict-fp32 problem must not get TF32 products."""
    if not getattr(problem, "tf32", False):
        return ("one TF32 product per multiply is for TF32 mode only (torch.backends.cudnn.allow_tf32 = True when "
                "tuned); this problem is strict fp32")
    return None


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``implicit_gemm_tf32_bm64_bn64_bk16_wm2_wn2_st3_s1_sm90``."""
    return FAMILY + _tc.name(c, arch)[len(_tc.FAMILY):]


def name_expression(c: Mapping[str, int]) -> str:
    return template_expression(KERNEL, TEMPLATE_ORDER, c)


def space(smem_limit: int = _tc.SM90_SMEM_LIMIT) -> Space:
    return Space(FAMILY, PARAMS, _tc._rules(smem_limit))

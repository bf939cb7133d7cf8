"""Kernel family ``winograd_tf32``: the fused Winograd F(2x2,3x3) convolution of ``winograd_tc`` with one TF32
product per Winograd-domain multiply, for TF32 mode (csrc/kernels/winograd_tc.cuh's ``winograd_tf32_conv2d``).

``winograd_tc`` computes its products at fp32 accuracy: three TF32 ``mma.sync`` per fragment pair on operands split
into TF32 "big" and "small" parts. A caller in TF32 mode (PyTorch's default for fp32 convolutions,
``torch.backends.cudnn.allow_tf32``) accepts cuDNN's TF32 error, and there one product per multiply does: the same
kernel with each Winograd-domain operand (the transformed filter U and input V, computed in fp32 in shared memory)
rounded to TF32 to nearest (ties away, as ``cvt.rna.tf32.f32``) and fp32 sums -- a third of the tensor-core work and
no split. F(2x2) only: with TF32 products its error is 1.62-1.98x a TF32 direct convolution's (cuDNN's own TF32
error) on AlexNet's and two ResNet layers, within the correctness check's bound of twice cuDNN's, where F(4x4) to
F(6x6) miss by 27-47x (benchmarks/results/winograd_error_tf32_cpu.md, the CPU emulation of this arithmetic). It
applies only to problems tuned in TF32 mode (``ConvProblem.tf32``, part of every plan's key), so a strict-fp32
caller never gets one of its plans; the check's tolerance is twice cuDNN's TF32 error on the same data
(``tuning.measure.Workspace``), which every candidate must pass before it can win.

Where it is meant to pay: ``winograd_tc``'s F(2x2) plans already take AlexNet's conv3-5 and the 3x3 128@28 layer at
N = 1 in TF32 mode (1.29-1.85x cuDNN's TF32 kernels, bench_layers_h200_tf32.md, bench_layers_extra_h200_tf32.md) with
three products; this family runs the same tiles with one. On the H200 it took conv4 / conv5 at N = 1 (1.73x / 1.78x
cuDNN TF32, error 1.66x cuDNN's TF32 error; bench_layers_h200_tf32.md).

Knobs, validity rules, launch geometry, start point and features are ``winograd_tc``'s, with MT = 2 only. Its register
estimate counts the split fragments, which one product does not need: an upper bound.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from . import winograd as _wg
from . import winograd_tc as _wtc
from .implicit_gemm_tf32 import applies as _tf32_mode
from .geometry import LaunchGeometry
from .space import Config, Space, template_expression

FAMILY = "winograd_tf32"
TF32_PRODUCTS = True  # one TF32 product per multiply: left out where that alone misses the check (Tuner)
SOURCE = _wtc.SOURCE
KERNEL = "bagf::winograd_tf32_conv2d"
TEMPLATE_ORDER = _wtc.TEMPLATE_ORDER
MIN_ARCH = _wtc.MIN_ARCH
PARAMS: dict[str, tuple[int, ...]] = {**_wtc.PARAMS, "MT": (2,)}
DEFAULT: Config = dict(_wtc.START)

H200_SMS = _wtc.H200_SMS
SM90_SMEM_LIMIT = _wtc.SM90_SMEM_LIMIT
points = _wtc.points
threads = _wtc.threads
smem_bytes = _wtc.smem_bytes
estimated_registers = _wtc.estimated_registers  # (three products' split fragments: an upper bound for one)
blocks_per_sm = _wtc.blocks_per_sm


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    """``winograd_tc``'s geometry, marked as TF32 products (the op sends a call made with TF32 off to ATen)."""
    return dataclasses.replace(_wtc.launch(c), tf32=1)


default_for = _wtc.default_for


def applies(problem) -> str | None:
    """None for a problem ``winograd`` computes (3x3, stride 1, dilation 1) tuned in TF32 mode."""
    return _wg.applies(problem) or _tf32_mode(problem)


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    """e.g. ``winograd_tf32_f2_bk32_bt32_bc16_wk1_wt1_we8_db0_s1_sm90``."""
    return FAMILY + _wtc.name(c, arch)[len(_wtc.FAMILY):]


def name_expression(c: Mapping[str, int]) -> str:
    return template_expression(KERNEL, TEMPLATE_ORDER, c)


def space(smem_limit: int = SM90_SMEM_LIMIT) -> Space:
    return Space(FAMILY, PARAMS, _wtc._rules(smem_limit))

"""Kernel families: one module each with knobs, validity rules, default configuration and launch geometry.

The contract of a family module is ``family.KernelFamily`` (required: FAMILY, SOURCE, KERNEL, MIN_ARCH, PARAMS,
DEFAULT, space, name, name_expression, threads, smem_bytes, launch -> ``LaunchGeometry``) and
``family.FamilyHooks`` (optional: LEGACY, applies, default_for, problem_rule, arch_rule, gpu_arch, features,
warps_in_flight, estimated_registers); each member's docs there say who reads it. A family whose plan is
several launches around a batched GEMM says so with ``gemm`` and ``layout`` in its LaunchGeometry; when the GEMM
is its own kernel, name_expression() names both kernels ("a;b", one cubin) and launch() sets ``gemm_bm``,
``gemm_bn``, ``gemm_threads`` and ``gemm_smem`` (see kernels.winograd_gemm). A new family is registered once,
in ``FAMILIES`` below (docs/adding-a-family.md).
"""

from . import (cublaslt_1x1, direct, implicit_gemm, implicit_gemm_h16, implicit_gemm_tc, implicit_gemm_tf32,
               implicit_gemm_tma_h16, implicit_gemm_tma_tf32, implicit_gemm_wgmma, implicit_gemm_wgmma_h16, winograd,
               winograd_gemm, winograd_tc, winograd_tf32)
from .. import settings
from .family import OPTIONAL, REQUIRED, FamilyHooks, KernelFamily
from .geometry import LaunchGeometry
from .space import Config, Space, config_key

FAMILIES: dict[str, KernelFamily] = {
    f.FAMILY: f for f in (implicit_gemm_tc, implicit_gemm_tf32, implicit_gemm_wgmma, winograd_tc, winograd_tf32,
                          winograd, winograd_gemm, implicit_gemm, direct, implicit_gemm_h16, implicit_gemm_wgmma_h16,
                          implicit_gemm_tma_h16, implicit_gemm_tma_tf32, cublaslt_1x1)}
"""Every family, in the order the tuner tries them (its budget split is by measured default speed, so the order
only breaks ties and decides whose start point is measured first; ``direct`` is last so that the first family,
which the tuner names when cuDNN wins, is unchanged)."""


def families_for(capability: tuple[int, int]) -> list:
    """The families the runtime's tuner searches on a device of compute capability ``capability`` (e.g. (9, 0)):
    those that run there, ``cublaslt_1x1`` unless ``BAGF_CUBLASLT=0`` (a cached or imported plan of it is used either
    way)."""
    cc = 10 * capability[0] + capability[1]
    return [f for f in FAMILIES.values() if cc >= f.MIN_ARCH and (f is not cublaslt_1x1 or settings.cublaslt())]


DEFAULT_FORMATS: tuple[tuple[str, str], ...] = (("float32", "nchw"),)
"""The (dtype, memory format) pairs a family computes when it does not say (its ``FORMATS``): float32, NCHW."""


def formats(family) -> tuple[tuple[str, str], ...]:
    """The (dtype, layout) pairs ``family`` (a family module) computes: its ``FORMATS``, else float32 NCHW."""
    return getattr(family, "FORMATS", DEFAULT_FORMATS)


def format_refuses(family, problem) -> str | None:
    """Why ``family`` cannot compute ``problem``'s dtype and memory format (``ConvProblem.dtype``, ``.layout``), or
    None."""
    pair = (problem.dtype, problem.layout)
    if pair in formats(family):
        return None
    return f"{family.FAMILY} computes {', '.join(' '.join(f) for f in formats(family))}; not {' '.join(pair)}"


def supported_formats() -> frozenset[tuple[str, str]]:
    """Every (dtype, layout) pair some family computes: what TunedConv2d sends to the tuner (others go to ATen)."""
    return frozenset(f for family in FAMILIES.values() for f in formats(family))


def complete_config(family: str, config) -> dict:
    """``config`` with the knobs a family gained after it was recorded set to the value they stand for in older
    records (the family's ``LEGACY``, e.g. winograd_gemm's GE = 0: before the knob, the GEMM was cuBLAS's), so a
    configuration read from a recording or an old cache compiles to the kernel that was measured.

    >>> complete_config("winograd_gemm", {"MT": 5, "TB": 64, "VL": 0, "ML": 0})["GE"]
    0
    """
    legacy = getattr(FAMILIES.get(family), "LEGACY", {})
    return {**{k: v for k, v in legacy.items() if k not in config}, **config}


def family_refuses(family: str, config, problem) -> str | None:
    """Why ``family``'s plan ``config`` must not run ``problem`` (the family's ``applies`` and ``problem_rule``), or
    None; "aten" and families this bagf_torch does not know are never refused here. What the tuner searches obeys
    both already; an imported plan is held to them too (e.g. a TF32 plan filed under a strict-fp32 problem)."""
    module = FAMILIES.get(family)
    if module is None or config is None:
        return None
    applies = getattr(module, "applies", None)
    why = format_refuses(module, problem)
    if why is None and applies is not None:
        why = applies(problem)
    if why is None and getattr(module, "problem_rule", None) is not None:
        why = module.problem_rule(complete_config(family, config), problem)
    return why


def family_name(family: str, config) -> str:
    """Readable name of a plan: ``aten`` or the family's instantiation name."""
    if config is None or family not in FAMILIES:
        return family
    return FAMILIES[family].name(config)


__all__ = ["Config", "FAMILIES", "FamilyHooks", "KernelFamily", "LaunchGeometry", "OPTIONAL", "REQUIRED", "Space",
           "complete_config", "config_key", "direct", "families_for", "family_name", "family_refuses",
           "format_refuses", "formats", "implicit_gemm", "implicit_gemm_h16", "supported_formats", "implicit_gemm_tc",
           "implicit_gemm_tf32", "implicit_gemm_tma_h16", "implicit_gemm_tma_tf32", "implicit_gemm_wgmma", "implicit_gemm_wgmma_h16", "winograd",
           "winograd_gemm", "winograd_tc", "winograd_tf32"]

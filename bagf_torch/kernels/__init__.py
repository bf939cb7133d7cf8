"""Kernel families: one module each with knobs, validity rules, default configuration and launch geometry.

A family module has FAMILY, SOURCE (its .cuh), MIN_ARCH (compute capability as 10*major+minor), PARAMS,
DEFAULT, space(smem_limit), name(config), name_expression(config), threads(config), smem_bytes(config) and
launch(config) (the ``LaunchGeometry`` the host's plan needs, kernels.geometry: bm, bn, threads, smem, split,
optionally tile; a family whose shared memory depends on the filter geometry sets tile_w, smem_patch and
smem_taps, see kernels.direct). Optional: applies(problem) -> None or why the family
cannot compute ``problem`` (the tuner then leaves it out), default_for(problem, sms[, arch]) (a start point sized to
the problem, or to the GPU when it takes ``arch``), estimated_registers(config), problem_rule(config, problem) and
arch_rule(config, arch) (configurations the tuner searches only for some problems or GPUs), and
gpu_arch(config, arch) (the NVRTC target for a configuration, e.g. winograd_gemm's wgmma GEMM: sm_90a). A family whose plan is several launches around a batched GEMM says
so with ``gemm`` and ``layout`` in launch(); when the GEMM is its own kernel, name_expression() names both
kernels ("a;b", one cubin) and launch() sets ``gemm_bm``, ``gemm_bn``, ``gemm_threads`` and ``gemm_smem`` (see
kernels.winograd_gemm). LEGACY (optional): the values of knobs added after configurations were recorded.
"""

from . import direct, implicit_gemm, implicit_gemm_tc, winograd, winograd_gemm, winograd_tc
from .geometry import LaunchGeometry
from .space import Config, Space, config_key

REQUIRED = ("FAMILY", "SOURCE", "KERNEL", "MIN_ARCH", "PARAMS", "DEFAULT", "space", "name", "name_expression",
            "threads", "smem_bytes", "launch")
"""What a family module must define (the compiler, the tuner, the isolated worker and the cache use these)."""

FAMILIES = {f.FAMILY: f for f in (implicit_gemm_tc, winograd_tc, winograd, winograd_gemm, implicit_gemm, direct)}
"""Every family, in the order the tuner tries them (its budget split is by measured default speed, so the order
only breaks ties and decides whose start point is measured first; ``direct`` is last so that the first family,
which the tuner names when cuDNN wins, is unchanged)."""


def families_for(capability: tuple[int, int]) -> list:
    """The families that run on a device of compute capability ``capability`` (e.g. (9, 0))."""
    cc = 10 * capability[0] + capability[1]
    return [f for f in FAMILIES.values() if cc >= f.MIN_ARCH]


def complete_config(family: str, config) -> dict:
    """``config`` with the knobs a family gained after it was recorded set to the value they stand for in older
    records (the family's ``LEGACY``, e.g. winograd_gemm's GE = 0: before the knob, the GEMM was cuBLAS's), so a
    configuration read from a recording or an old cache compiles to the kernel that was measured.

    >>> complete_config("winograd_gemm", {"MT": 5, "TB": 64, "VL": 0, "ML": 0})["GE"]
    0
    """
    legacy = getattr(FAMILIES.get(family), "LEGACY", {})
    return {**{k: v for k, v in legacy.items() if k not in config}, **config}


def family_name(family: str, config) -> str:
    """Readable name of a plan: ``aten`` or the family's instantiation name."""
    if config is None or family not in FAMILIES:
        return family
    return FAMILIES[family].name(config)


__all__ = ["Config", "FAMILIES", "LaunchGeometry", "REQUIRED", "Space", "complete_config", "config_key", "direct", "families_for", "family_name",
           "implicit_gemm", "implicit_gemm_tc", "winograd", "winograd_gemm", "winograd_tc"]

"""The kernel-family contract: what a family module defines, and who reads each member.

A family is one module (e.g. ``bagf_torch.kernels.implicit_gemm``) registered once, in ``kernels.FAMILIES``.
``KernelFamily`` lists what every family must define; ``FamilyHooks`` the optional members, which the package
looks up with ``getattr``/``hasattr`` and does without when absent (estimated_registers and TEMPLATE_ORDER:
the compile test needs them of every registered family). Both are ``typing.Protocol`` classes that
describe modules, so the ``self`` of each method stands for nothing: a family defines plain module functions
with the parameters after it (parameter names are free; the number of positional parameters and their defaults
are what callers rely on). docs/adding-a-family.md walks through one family; tests/test_family_contract.py
checks every registered family against these.
"""

from __future__ import annotations

from typing import Mapping, Protocol, runtime_checkable

from .geometry import LaunchGeometry
from .space import Config, Space


@runtime_checkable
class KernelFamily(Protocol):
    """What every family module defines (``KernelCompiler``, the tuner, the isolated worker and the cache use
    these)."""

    FAMILY: str
    """The family's name: its key in ``FAMILIES``, in cache rows and in recordings."""
    SOURCE: str
    """The kernel source NVRTC compiles (``#include``d by name from csrc/kernels/, or an absolute path)."""
    KERNEL: str
    """The C++ name of the kernel template, e.g. ``bagf::implicit_gemm_conv2d``."""
    MIN_ARCH: int
    """Lowest compute capability the kernels compile for, as 10*major+minor (``families_for`` filters on it)."""
    PARAMS: Mapping[str, tuple[int, ...]]
    """Knob -> allowed values, smallest first; the cache validates imported configurations against it."""
    DEFAULT: Config
    """The hand-picked configuration: the untuned start point and the one every test compiles."""

    def space(self, smem_limit: int = ...) -> Space:
        """The knobs and validity rules for a device with ``smem_limit`` bytes of opt-in shared memory per block
        (the tuner passes the device's; without it, the H200's)."""

    def name(self, config: Mapping[str, int], arch: str = "sm90") -> str:
        """Readable, filename-safe name of one instantiation (logs, reports, the cubin cache)."""

    def name_expression(self, config: Mapping[str, int]) -> str:
        """The C++ name NVRTC instantiates; "first;second" for a plan of two kernels in one cubin (three for a
        polyphase TMA plan)."""

    def threads(self, config: Mapping[str, int]) -> int:
        """Threads per block of the plan's first kernel."""

    def smem_bytes(self, config: Mapping[str, int]) -> int:
        """Dynamic shared memory per block of the plan's first kernel, in bytes."""

    def launch(self, config: Mapping[str, int]) -> LaunchGeometry:
        """What the host extension needs to launch the loaded instantiation (``KernelCompiler`` hands it to
        ``load_plan``)."""


class FamilyHooks(Protocol):
    """The optional members of a family module: a family defines any subset, with these parameters."""

    FORMATS: tuple[tuple[str, str], ...]
    """The (dtype, memory format) pairs the family computes, e.g. ("bfloat16", "nhwc") (``ConvProblem.dtype`` and
    ``.layout``); the tuner leaves it out of other problems (``kernels.format_refuses``). Without it, float32 NCHW
    only. A family with several sets ``dtype`` and ``nhwc`` in its LaunchGeometry per configuration."""
    KERNEL_ARGS: str
    """The kernel's C++ parameter list, for tests/test_nvcc.py's explicit instantiations; without it, the fp32
    families' ``const float*, const float*, const float*, float*, const bagf::Conv2dParams``."""
    LEGACY: Config
    """Values of knobs added after configurations were recorded, meaning what older records ran
    (``kernels.complete_config``; e.g. winograd_gemm's GE = 0: cuBLAS's GEMM)."""
    LIBRARY: str
    """A plan that calls a library (``cublaslt_1x1``: "cublasLt") in place of a kernel of ours: nothing is compiled
    (SOURCE and KERNEL are empty, name_expression gives the library's name), ``KernelCompiler`` loads a configuration
    at once with no cubin (its LaunchGeometry says which library call), and the cache stores its plans without cubin
    digests. Without it, a CUDA C++ kernel family. TEMPLATE_ORDER and estimated_registers do not apply to one."""
    TF32_PRODUCTS: bool
    """True for a family computing one TF32 product per multiply in TF32 mode (operands rounded to TF32, fp32 sums):
    the tuner leaves it out of a problem whose check bounds the convolution of TF32-rounded operands clearly misses
    (``Tuner._within_reach``; in TF32 mode where cuDNN computes at fp32 accuracy, as on C = 3 layers). Without it,
    False."""
    TEMPLATE_ORDER: tuple[str, ...]
    """The knobs in the order of the kernel template's parameters; tests/test_nvcc.py builds the default's
    mangled name from it."""

    def applies(self, problem) -> str | None:
        """None when the family computes ``problem``, else why not; the tuner leaves the family out for it
        (``Tuner.families_for``). Without it, every problem."""

    def default_for(self, problem, sms: int = ..., *, arch: str = ...) -> Config:
        """The tuner's start point sized to the problem (and the GPU's ``sms``); ``arch`` (e.g. "sm_90") is
        passed only when the function has that parameter (``Tuner.start_config``). Without it, DEFAULT."""

    def start_alternatives(self, problem, sms: int = ..., arch: str | None = ...) -> list[Config]:
        """More start points, measured right after ``default_for``'s as warm-start seeds are (``Tuner.tune``), and
        compiled with the start points up front (``Tuner.prefetch_starts``): where a cheap rule cannot tell which of
        two starts is better, both are measured. Without it, none."""

    def problem_rule(self, config: Mapping[str, int], problem) -> str | None:
        """None when ``config`` may run ``problem``, else why not: an extra rule of the space the tuner searches
        for that problem, also applied to warm-start seeds (e.g. direct's kernels for one filter geometry)."""

    def arch_rule(self, config: Mapping[str, int], arch: str) -> str | None:
        """None when ``config`` compiles for ``arch`` (e.g. "sm_90"), else why not: an extra rule of the space
        the tuner searches on that GPU (winograd_gemm's wgmma GEMM needs sm_90)."""

    def gpu_arch(self, config: Mapping[str, int], arch: str) -> str:
        """The NVRTC target for ``config`` on a GPU of ``arch`` (``KernelSpec.target``; winograd_gemm's wgmma
        GEMM: sm_90a). Without it, ``arch``."""

    def features(self, problem, config: Mapping[str, int], sms: int = ...) -> dict[str, float]:
        """Problem-aware inputs for a strategy that models the space (ax's ``features`` option, through
        ``tuning.tuner.search_features``)."""

    def warps_in_flight(self, problem, config: Mapping[str, int], sms: int = ...) -> float:
        """How a strategy that starts with a local design ranks the start point's neighbours before any time is
        known (ax's ``initial_order`` option, through ``tuning.tuner.search_initial_order``)."""

    def estimated_time(self, problem, config: Mapping[str, int], sms: int = ...) -> float:
        """An analytical estimate of ``config``'s time on ``problem`` (any unit: only the order is used), how a
        strategy that starts with nothing measured ranks the space (ax's ``cold_order`` option, through
        ``tuning.tuner.search_cold_order``)."""

    def estimated_registers(self, config: Mapping[str, int]) -> int:
        """Registers per thread the space's register rule uses; tests/test_nvcc.py samples by it."""


def members(protocol: type) -> tuple[str, ...]:
    """A protocol's member names in the order they are declared (data members first)."""
    data = tuple(protocol.__dict__.get("__annotations__", {}))
    methods = tuple(k for k, v in protocol.__dict__.items() if callable(v) and not k.startswith("_"))
    return data + methods


REQUIRED: tuple[str, ...] = members(KernelFamily)
"""What a family module must define."""

OPTIONAL: tuple[str, ...] = members(FamilyHooks)
"""What a family module may define."""

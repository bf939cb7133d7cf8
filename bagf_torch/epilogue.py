"""The pooling epilogue of a converted conv: ``nn.ReLU`` then ``nn.MaxPool2d`` in one launch.

In a ``nn.Sequential``, ``convert`` replaces the ``nn.MaxPool2d`` that follows a converted conv (directly, or
after an ``nn.ReLU``) with a :class:`FusedMaxPool2d` and that ReLU with ``nn.Identity``: the pair becomes one
kernel of ours (csrc/kernels/pool_epilogue.cuh), max_pool2d(relu(y)) in one pass over the conv's output, instead of
ATen's relu and max_pool2d. The answer is ATen's to the bit (max and ReLU are exact; a NaN propagates as ATen's
does). It pays most where ATen's pooling is slow: channels_last at small batches, where AlexNet's three
MaxPool2d in bfloat16 at N = 1 cost the H200 more GPU time than its five convs
(benchmarks/results/module_times_h200_alexnet_n1_bfloat16_nhwc.md).

``FusedMaxPool2d`` is an ``nn.MaxPool2d`` (same attributes, no parameters or buffers, so state dicts are unchanged)
with a ``relu`` flag. Calls our kernel cannot serve run ATen's ``relu`` and ``max_pool2d``: CPU tensors, dtypes
other than float32 / float16 / bfloat16, a gradient to record, torch.compile and torch.export traces (Inductor
fuses the pair itself), TorchScript, tensor subclasses and dispatch modes, and any device where the kernel failed
to build (logged once). Modules with hooks of their own are not fused (``convert(model, fuse=False)`` fuses none).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from . import log
from .nn import _compiling, _foreign, _stream_capturing

_NAMES = [f"bagf::relu_max_pool2d<{dt}, {nhwc}, {relu}>" for dt in range(3) for nhwc in (0, 1) for relu in (0, 1)]
"""The kernel's twelve instantiations, in the order ``bagf_ext.load_pool_epilogue`` takes their lowered names."""

_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))


class _Kernels:
    """What ``jit.compiler.KernelSpec`` reads of a kernel family, for the epilogue's one cubin (all instantiations):
    its digest, disk cache and NVRTC compile are a plan's."""

    SOURCE = "pool_epilogue.cuh"

    @staticmethod
    def name(config, arch: str) -> str:
        from .cache import SHARED_CUBIN_PREFIX  # (``cache prune`` keeps the newest cubin of this name)

        return f"{SHARED_CUBIN_PREFIX}{arch}"

    @staticmethod
    def name_expression(config) -> str:
        return ";".join(_NAMES)


_state: dict[int, bool] = {}  # device index -> loaded (True) or failed (False)
_lock = threading.Lock()


def _ready(device: int) -> bool:
    """Whether the epilogue's kernels are loaded on CUDA device ``device``: built (or read from the cache's cubins)
    and loaded on the first call there; a failure is logged once and the device keeps ATen's pooling."""
    state = _state.get(device)
    if state is not None:
        return state
    with _lock:
        state = _state.get(device)
        if state is not None:
            return state
        try:
            from . import runtime
            from .jit.compiler import KernelSpec
            from .jit.extension import load
            from .outcome import Outcome

            ext = load()
            if not ext.pool_epilogue_loaded(device):
                compiler = runtime.get().device(device).compiler
                got = compiler.cubin(KernelSpec(_Kernels, {}, compiler.arch))
                if isinstance(got, Outcome):
                    raise RuntimeError(got.detail)
                cubin, lowered, _ = got
                ext.load_pool_epilogue(cubin, lowered, device)
            state = True
        except Exception as e:  # (a build error, no NVRTC, a cubin that does not load: ATen's pooling is the answer)
            log.once(f"pool-epilogue:{device}", f"FusedMaxPool2d: the pooling kernel cannot run on cuda:{device} "
                     f"({e}); using ATen's relu and max_pool2d there")
            state = False
        _state[device] = state
        return state


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _plain(x) -> bool:
    """Whether our kernel may read ``x`` eagerly: a dense CUDA tensor of ours (no subclass with a dispatch of its own,
    no mode, transform or trace recording), with no gradient to record."""
    if _compiling() or torch.jit.is_scripting():
        return False
    if not isinstance(x, torch.Tensor) or not x.is_cuda or x.dtype not in _DTYPES or x.dim() != 4:
        return False
    if _foreign(x, x, None) or (x.requires_grad and torch.is_grad_enabled()):
        return False
    return 0 < x.numel() <= 2**31 - 1


class FusedMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` of ``relu(input)`` (``relu=True``) or of ``input``, in one kernel on CUDA tensors.

    What ``convert`` puts in place of an ``nn.ReLU`` -> ``nn.MaxPool2d`` pair after a converted conv; ATen's ops
    answer whatever the kernel does not take (see the module's docs).
    """

    relu = True  # (a class default: TorchScript reads the instance's)

    def __init__(self, *args, relu: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if self.return_indices:
            raise ValueError("FusedMaxPool2d computes no indices: return_indices must be False")
        self.relu = bool(relu)

    @classmethod
    def from_pool(cls, pool: nn.MaxPool2d, relu: bool) -> "FusedMaxPool2d":
        return cls(pool.kernel_size, pool.stride, pool.padding, pool.dilation, ceil_mode=pool.ceil_mode, relu=relu)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, relu={self.relu}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            x = torch.relu(input) if self.relu else input
            return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        return self._fused_forward(input)

    @torch.jit.unused
    def _fused_forward(self, input: torch.Tensor) -> torch.Tensor:
        # (a first call inside a CUDA graph capture is captured with ATen's ops: no compile while capturing)
        if _plain(input) and (_state.get(input.get_device()) or (not _stream_capturing()
                                                                 and _ready(input.get_device()))):
            from .jit.extension import loaded

            try:
                return loaded().relu_max_pool2d(input, _pair(self.kernel_size), _pair(self.stride),
                                                _pair(self.padding), _pair(self.dilation), self.ceil_mode, self.relu)
            except RuntimeError as e:  # arguments ATen refuses (its own error follows), or a launch that failed
                log.once(f"pool-epilogue-call:{e}", f"FusedMaxPool2d: {e}; using ATen's relu and max_pool2d")
        x = torch.relu(input) if self.relu else input
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None))


def fuse(seq: nn.Sequential, is_conv) -> int:
    """In ``seq`` (an ``nn.Sequential``, changed in place), replace each ``nn.MaxPool2d`` that follows a module
    for which ``is_conv`` is true, directly or after one ``nn.ReLU``, with a :class:`FusedMaxPool2d`, and that ReLU
    with ``nn.Identity``. Exact ``nn.ReLU`` / ``nn.MaxPool2d`` types only (a subclass's forward may differ), no
    ``return_indices``, no hooks on any of the three. Returns how many pairs were fused."""
    names = list(seq._modules)
    fused = 0
    i = 0
    while i < len(names) - 1:
        # (a hook on the conv sees its output: with an in-place ReLU after it, the output as the ReLU left it)
        if not is_conv(seq._modules[names[i]]) or _hooked(seq._modules[names[i]]):
            i += 1
            continue
        j = i + 1
        relu = type(seq._modules[names[j]]) is nn.ReLU and not _hooked(seq._modules[names[j]])
        if relu:
            j += 1
        pool = seq._modules[names[j]] if j < len(names) else None
        if type(pool) is nn.MaxPool2d and not pool.return_indices and not _hooked(pool):
            if relu:
                seq._modules[names[i + 1]] = nn.Identity()
            seq._modules[names[j]] = FusedMaxPool2d.from_pool(pool, relu)
            seq._modules[names[j]].train(pool.training)
            fused += 1
        i = j
    return fused

"""The epilogues of a converted conv: ``nn.ReLU`` then ``nn.MaxPool2d`` in one launch, and ``nn.ReLU`` in the conv's.

``convert`` makes each ``nn.Sequential`` that holds a converted conv followed by an ``nn.MaxPool2d`` (directly, or
after one ``nn.ReLU``) or by an ``nn.ReLU`` a :class:`FusedSequential`: the same modules, the same state dict, and a
forward that runs
- such a ReLU -> MaxPool2d pair as one kernel of ours (csrc/kernels/pool_epilogue.cuh), max_pool2d(relu(y)) in one
  pass over the conv's output, instead of ATen's relu and max_pool2d. The answer is ATen's to the bit (a NaN as a
  NaN): the kernel applies ATen's ReLU to each element (a NaN kept; -0.0 kept or made +0.0 as this torch's ReLU
  does, asked once per device), then takes the window's maximum by ATen's rule (a NaN wins, the first of equals
  stays, a window with no input is -inf), into the strides ATen's output would have. It pays most where ATen's
  pooling is slow: channels_last at small batches, where AlexNet's three MaxPool2d in bfloat16 at N = 1 cost more GPU
  time than its five convs (benchmarks/results/module_times_h100_alexnet_n1_bfloat16_nhwc.md);
- a conv -> ReLU pair with no pool after it as the conv's own launch with the ReLU in its epilogue, where the conv's
  plan for the call is a TMA plan (``TunedConv2d._relu_forward``; the same ReLU of the output as rounded, to the
  bit): one launch and one pass over the output fewer, which a batch-1 eager forward, host-bound, feels most
  (AlexNet's conv3 and conv4). Other plans run the two modules (a call not yet planned takes its plan first, as the
  conv's own call would).

Every module stays where it was and keeps its type, so whatever calls them one by one (a slice of the Sequential, a
loop that collects each layer's output, a hook, torch.fx's feature extractors) sees what it saw before: only the
container's own forward fuses, and only a pair it calls in sequence. A pair is called module by module (ATen) when
the ReLU, the pool or the conv has hooks (or a global module hook is set) or a forward set on its instance, the pool
returns indices or is a subclass, the conv of a conv -> ReLU pair is a subclass, and for calls the kernel does not
take: CPU tensors, dtypes other than float32 / float16 / bfloat16, a gradient to record, inputs that are neither
contiguous nor channels_last (and, before a pool after an out-of-place ReLU, those that are both: C = 1 or a 1x1 map,
where ATen's ReLU output has other strides; a conv -> ReLU pair gives its output those strides), torch.compile and
torch.export traces (Inductor fuses the pair itself), TorchScript, tensor subclasses (any: ATen's ops keep their type)
and dispatch modes, a call inside a CUDA graph capture before the process has the pooling kernel loaded, the ReLU's
sign rule asked on the device and the conv's plan loaded (``tune_model`` does all three, as does a call outside a
capture), and any device where the kernel failed to build (logged once).
``convert(model, fuse=False)`` leaves the containers as they are.
"""

from __future__ import annotations

import operator
import threading
import weakref

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.nn.modules.utils import _pair

from . import log, runtime
from .jit.extension import load as _extension
from .nn import TunedConv2d, _compiling, _foreign, _relu_mode, _stream_capturing

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
_keeps_negative_zero: dict[int, bool] = {}  # device index -> whether ATen's relu(-0.0) is -0.0 there (torch's choice)


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
            ext = _extension()
            with torch.cuda.device(device):  # (the module loads into this device's context, whatever the thread's)
                if not ext.pool_epilogue_loaded(device):
                    cubin, lowered = _cubin(device)
                    ext.load_pool_epilogue(cubin, lowered, device)
                # torch's ReLU has kept -0.0 in some versions and made it +0.0 in others: ask it, once
                zero = torch.relu(torch.tensor([-0.0], device=f"cuda:{device}"))
                _keeps_negative_zero[device] = bool(torch.signbit(zero).item())
            state = True
        except Exception as e:  # (a build error, no NVRTC, a cubin that does not load: ATen's pooling is the answer)
            log.once(f"pool-epilogue:{device}", f"FusedSequential: the pooling kernel cannot run on cuda:{device} "
                     f"({e}); using ATen's relu and max_pool2d there")
            state = False
        _state[device] = state
        return state


def _cubin(device: int) -> tuple[bytes, str]:
    """The kernel's cubin and lowered names from the runtime's cache for ``device``, compiled and stored there first
    if the cache lacks it; raises what went wrong."""
    from .jit.compiler import KernelSpec
    from .outcome import Outcome

    compiler = runtime.get().device(device).compiler
    got = compiler.cubin(KernelSpec(_Kernels, {}, compiler.arch))
    if isinstance(got, Outcome):
        raise RuntimeError(got.detail)
    return got[0], got[1]


def _plain(x) -> bool:
    """Whether our kernel may read ``x`` eagerly: a dense CUDA tensor of ours (no subclass with a dispatch of its own,
    no mode, transform or trace recording), with no gradient to record."""
    if _compiling() or torch.jit.is_scripting():
        return False
    # (exactly a Tensor: a subclass, even one with only __torch_function__, gets its own type back from ATen's ops)
    if type(x) is not torch.Tensor or not x.is_cuda or x.dtype not in _DTYPES or x.dim() != 4:
        return False
    if _foreign(x, x, None) or (x.requires_grad and torch.is_grad_enabled()) or x.is_neg() or x.is_conj():
        return False
    # (dense in one of the two formats, as a conv's output is: the output then has the format ATen's would)
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        return False
    return 0 < x.numel() <= 2**31 - 1


_LIMIT = 65535  # (the host's bound on kernel, stride and dilation)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None))


def _global_hooks() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or getattr(_module, "_global_backward_pre_hooks", None))


def _pool_args(pool: nn.MaxPool2d) -> tuple | None:
    """``_pool_args_of(pool)``, remembered while the pool's arguments stay the same (a forward asks for it per
    pair)."""
    sig = (type(pool), pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode, pool.return_indices)
    memo = _args_memo.get(pool)
    if memo is None or memo[0] != sig:
        memo = _args_memo[pool] = (sig, _pool_args_of(pool))
    return memo[1]


_args_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""pool module -> (its arguments, ``_pool_args_of``'s answer); beside the module, not in it (torch.jit.script of the
model would have to type an attribute of the module's own)."""


def _pool_args_of(pool: nn.MaxPool2d) -> tuple | None:
    """(kernel, stride, padding, dilation, ceil_mode) of a pool the kernel computes as ATen does, else None: an exact
    nn.MaxPool2d without indices, its sizes two ints each within the kernel's limits, padding at most half the
    kernel (ATen's own rule; it raises otherwise, and then it should)."""
    if type(pool) is not nn.MaxPool2d or pool.return_indices:
        return None
    try:  # (integers only, numpy's too: ATen refuses 2.0 and True, and then it should say so)
        k, s, p, d = (tuple(operator.index(v) for v in _pair(a) if not isinstance(v, bool))
                      for a in (pool.kernel_size, pool.stride, pool.padding, pool.dilation))
    except TypeError:
        return None
    if not all(len(t) == 2 for t in (k, s, p, d)):
        return None
    if not all(0 < k[i] <= _LIMIT and 0 < s[i] <= _LIMIT and 0 < d[i] <= _LIMIT and 0 <= p[i] <= k[i] // 2
               for i in range(2)):
        return None
    return k, s, p, d, bool(pool.ceil_mode)


def pairs(modules: list) -> dict[int, tuple[int, bool]]:
    """The fusable pairs of a Sequential's module list: {index of a TunedConv2d: (index of the MaxPool2d after it,
    whether an nn.ReLU stands between)}. Types only (hooks and the pool's arguments are checked per call)."""
    found = {}
    for i, m in enumerate(modules[:-1]):
        if not isinstance(m, TunedConv2d):
            continue
        j = i + 1
        relu = type(modules[j]) is nn.ReLU
        if relu:
            j += 1
        if j < len(modules) and type(modules[j]) is nn.MaxPool2d:
            found[i] = (j, relu)
    return found


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def relu_pairs(modules: list) -> dict[int, int]:
    """The conv -> ReLU pairs of a Sequential's module list that no pool follows (those are :func:`pairs`'): {index
    of an exact TunedConv2d: index of the exact ``nn.ReLU`` after it}, whose forward runs as one launch where the conv's
    plan is a TMA plan (``TunedConv2d._relu_forward``: the ReLU in its epilogue). Types only."""
    return {i: i + 1 for i, m in enumerate(modules[:-1]) if type(m) is TunedConv2d  # (a subclass's forward may differ)
            and type(modules[i + 1]) is nn.ReLU
            and not (i + 2 < len(modules) and type(modules[i + 2]) is nn.MaxPool2d)}


def relu_max_pool2d(x: torch.Tensor, pool: nn.MaxPool2d, relu: bool, relu_inplace: bool = True
                    ) -> torch.Tensor | None:
    """``pool(relu(x))`` (or ``pool(x)``) by the epilogue kernel, or None where it does not take the call.
    ``relu_inplace``: the ReLU is ``nn.ReLU(inplace=True)`` (it decides the output's strides where ``x`` is both
    contiguous and channels_last: ATen's out-of-place relu gives such a tensor contiguous strides)."""
    args = _pool_args(pool)
    if args is None or not _plain(x):
        return None
    if relu and not relu_inplace and x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return None  # (C = 1 or a 1x1 map, where the two formats' strides differ in the size-1 dimensions only)
    device = x.get_device()
    # (a first call inside a CUDA graph capture is captured with ATen's ops: no compile or load while capturing)
    if not (_state.get(device) or (not _stream_capturing() and _ready(device))):
        return None
    k, s, p, d, ceil = args
    try:
        return _extension().relu_max_pool2d(x, k, s, p, d, ceil, relu, _keeps_negative_zero.get(device, False))
    except RuntimeError as e:
        if "failed with" in str(e):  # (a launch that failed: this device keeps ATen's pooling from now on)
            _state[device] = False
        # (else an output that would be empty: ATen's max_pool2d raises its own error)
        log.once("pool-epilogue-call", f"FusedSequential: the pooling kernel refused a call ({e}); ATen's relu and "
                 "max_pool2d answer such calls")
        return None


class FusedSequential(nn.Sequential):
    """``nn.Sequential`` whose forward runs each ``nn.ReLU`` -> ``nn.MaxPool2d`` pair after a ``TunedConv2d`` as one
    kernel, and each ``nn.ReLU`` after one in the conv's epilogue where its plan is a TMA plan (see the module's
    docs); the same modules, state dict and answer as the ``nn.Sequential`` it was.

    >>> import torch, bagf_torch
    >>> m = bagf_torch.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2)))
    >>> type(m).__name__, [type(x).__name__ for x in m]
    ('FusedSequential', ['TunedConv2d', 'ReLU', 'MaxPool2d'])
    """

    def forward(self, input):
        if torch.jit.is_scripting():
            for module in self:
                input = module(input)
            return input
        return self._fused_forward(input)

    __jit_ignored_attributes__ = ["_bagf_pairs"]  # (TorchScript runs the plain loop: not its to type)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_bagf_pairs", None)  # (a memo of this process's module list)
        return state

    @torch.jit.unused
    def _fused_forward(self, input):
        modules = tuple(self._modules.values())
        memo = self.__dict__.get("_bagf_pairs")
        if memo is None or memo[0] != modules:  # (the list changed: append, insert, item assignment...)
            listed = list(modules)
            memo = self.__dict__["_bagf_pairs"] = (modules, pairs(listed), relu_pairs(listed))
        found, relus = (memo[1], memo[2]) if not _compiling() else ({}, {})
        i, n = 0, len(modules)
        while i < n:
            module = modules[i]
            r = relus.get(i)
            # (a forward set on the instance, as a patch or a test does, is what the module's call runs: not fused)
            if r is not None and not (_hooked(module) or _hooked(modules[r]) or _global_hooks()
                                      or "forward" in module.__dict__ or "forward" in modules[r].__dict__):
                out = module._relu_forward(input)
                if out is not None:
                    if not modules[r].inplace and out.is_contiguous() and out.is_contiguous(
                            memory_format=torch.channels_last):
                        # (K = 1 or a 1x1 map: ATen's out-of-place ReLU gives contiguous strides, which address
                        # the same elements here)
                        out = out.as_strided(out.shape, _contiguous_strides(out.shape))
                    input = out
                    i = r + 1
                    continue
            input = module(input)
            pair = found.get(i)
            if pair is not None:
                j, relu = pair
                # (the conv's forward hooks see its output: with an in-place ReLU after it, as the ReLU left it; a
                # forward set on the ReLU's or the pool's instance is what their calls run)
                if not (module._forward_hooks or _hooked(modules[j]) or (relu and _hooked(modules[i + 1]))
                        or _global_hooks() or "forward" in modules[j].__dict__
                        or (relu and "forward" in modules[i + 1].__dict__)):
                    out = relu_max_pool2d(input, modules[j], relu, not relu or modules[i + 1].inplace)
                    if out is not None:
                        input = out
                        i = j
            i += 1
        return input


def prepare(model: nn.Module, device: int) -> bool:
    """Build (or read from the cache) and load the pooling kernel on CUDA device ``device`` if ``model`` has a pair to
    fuse: ``tune_model`` does, so that its cache serves the kernel's cubin too (a serving process then compiles
    nothing) and a first call inside a CUDA graph capture runs it. Returns whether it is ready there (False: no pair
    in ``model``, or the build failed, logged)."""
    if not _holds(model, pairs):
        return False
    if not _ready(device):
        return False
    # loaded earlier in this process, maybe from another cache (the runtime's cache can change: a new
    # BAGF_CACHE_DIR and runtime.reset()): this one must hold the cubin too, or a serving process would compile it
    try:
        with torch.cuda.device(device):
            _cubin(device)
    except Exception as e:  # (the kernel stays loaded and in use here; only the cache lacks it)
        log.once(f"pool-epilogue-store:{device}", f"FusedSequential: the pooling kernel's cubin could not be stored in "
                 f"the cache ({e}); a serving process will compile it on its first call")
    return True


def prepare_relu(model: nn.Module, device: int, dtypes) -> bool:
    """Ask how torch's ReLU treats -0.0 on CUDA device ``device`` in each of ``dtypes`` (one synchronisation each,
    once per process) if ``model`` has a conv -> ReLU pair to run in a plan's epilogue: ``tune_model`` does, so that a
    first call inside a CUDA graph capture, which cannot synchronise to ask, runs the pair as one launch too (its plan
    from the cache: ``TunedConv2d._relu_forward``). Returns whether ``model`` has such a pair."""
    if not _holds(model, relu_pairs):
        return False
    for dtype in dtypes:
        _relu_mode(torch.device("cuda", device), dtype)
    return True


def _holds(model: nn.Module, finder) -> bool:
    """Whether a FusedSequential in ``model`` has pairs by ``finder`` (:func:`pairs`, :func:`relu_pairs`)."""
    return any(isinstance(m, FusedSequential) and finder(list(m._modules.values())) for m in model.modules())


def fuse(model: nn.Module) -> int:
    """Make every exact ``nn.Sequential`` in ``model`` (itself included) that holds a fusable pair a
    :class:`FusedSequential`, in place (its class only: modules, parameters, hooks and state dict stay). Returns how
    many containers changed."""
    changed = 0
    for m in model.modules():
        if type(m) is not nn.Sequential:
            continue
        listed = list(m._modules.values())
        if pairs(listed) or relu_pairs(listed):
            m.__class__ = FusedSequential
            changed += 1
    return changed

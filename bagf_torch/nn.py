"""``TunedConv2d`` (a drop-in ``nn.Conv2d``) and ``convert(model)``."""

from __future__ import annotations

import time
import weakref

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import nn

from . import log, runtime
from .jit import extension as _jit_extension
from .kernels import supported_formats
from .ops import ATEN
from .problem import ConvProblem, cudnn_tf32, memory_layout, out_extent

_INT32_MAX = 2**31 - 1

RECHECK_S = 1.0
"""How long a shape that ATen serves *for now* (BAGF_TUNE=0 with no cached plan, tuning in the background, another
process tuning it) keeps ATen before the layer asks the runtime again: one cache lookup per shape per second
instead of one per call (a lookup is a SQLite read, tens of microseconds, longer than a batch-1 conv)."""

_BAD_CALL = "a call nn.Conv2d rejects"  # e.g. a wrong channel count: nn.Conv2d's own error is the answer

# Bound once: each lookup through ``torch.backends`` / ``torch.compiler`` costs more than the check it makes,
# and the fast path below runs on every call (on the H200's host, Python is several times slower than here).
_F32 = torch.float32
_tf32 = cudnn_tf32
# (dynamo's trace only: torch.compiler.is_compiling is True in every thread while any thread compiles from torch
# 2.13 on, which sent other threads' eager calls down the traced path; non-strict export's fake inputs are caught
# by the eager path's _wrapped)
_compiling = torch.compiler.is_dynamo_compiling
_any_autocast = torch._C._is_any_autocast_enabled  # 0.1 us; the per-device question only when it says yes
# (asked only for calls of a kernel's plan, which need CUDA; a CPU build's stand-in raises)
_stream_capturing = torch._C._cuda_isCurrentStreamCapturing
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # device index -> the current stream's handle


def _exporting() -> bool:
    """Whether torch.export is tracing. Not ``torch.compiler.is_exporting()``: torch 2.11's dynamo folds that call to
    True under every torch.compile (the compiled graph then ran torch's conv, never a plan); the flag it reads is
    what dynamo reads here, as 2.13's does for the call."""
    return getattr(torch.compiler, "_is_exporting_flag", False)


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_FORMATS = supported_formats()
"""(dtype name, layout) pairs some kernel family computes (ConvProblem.dtype, .layout); other inputs go to ATen."""
_TAKEN = frozenset((d, c) for d, name in _DTYPE_NAMES.items() for c in (True, False)
                   if (name, "nchw" if c else "nhwc") in _FORMATS)
"""The same as (torch dtype, input.is_contiguous()) pairs, which the forward's fast path tests: an input that is not
contiguous there is channels_last or goes to ATen (``_format``)."""


_TAKEN_DTYPES = frozenset(d for d, _ in _TAKEN)


def _format(x: torch.Tensor) -> tuple[str, str] | None:
    """(dtype name, "nchw" or "nhwc") of ``x`` as ConvProblem.from_call names them, None for other dtypes or
    strides."""
    name, layout = _DTYPE_NAMES.get(x.dtype), memory_layout(x)
    return None if name is None or layout == "strided" else (name, layout)


def _compile_constant(fn):
    """``torch.compiler.assume_constant_result`` without its import of ``torch._dynamo`` (with sympy, 1.6 s of every
    ``import bagf_torch`` on a 2-core CPU, for programs that never compile): the attribute dynamo reads when it
    meets the function, which the decorator sets and has set since torch 2.0."""
    fn._dynamo_marked_constant = True
    return fn


@_compile_constant
def _tf32_at_trace() -> bool:
    """The TF32 flag as torch.compile's traced forward reads it: dynamo cannot trace the flag's read (a torch.*
    call returning a bool), so the mode at trace time is a constant of the graph, as the plan it picks is. No guard
    comes with it: a graph compiled in one mode keeps that mode's plan after the flag changes, until it is compiled
    again (``torch._dynamo.reset()``). A TF32-mode plan of TF32 products then sends calls made with TF32 off to
    ATen in the op (``LaunchGeometry.tf32``): strict fp32, at torch's speed."""
    return cudnn_tf32()


def _trace_problem(c: int, k: int, r: int, s: int, stride: tuple, padding: tuple, dilation: tuple, bias: bool,
                   dtype: str, layout: str, tf32: bool, n: int = 1, h: int = 1, w: int = 1) -> ConvProblem:
    """The problem of a traced layer's geometry (``_traced_forward``'s tuple, as the two functions below take it) at
    N, H and W."""
    return ConvProblem(n=n, c=c, h=h, w=w, k=k, r=r, s=s, stride=stride, padding=padding, dilation=dilation,
                       groups=1, bias=bias, dtype=dtype, layout=layout, tf32=tf32)


@_compile_constant
def _cached_plans_at_trace(c: int, k: int, r: int, s: int, stride: tuple, padding: tuple, dilation: tuple,
                           bias: bool, dtype: str, layout: str, tf32: bool, device: int) -> tuple:
    """((N, H, W), handle) of the cached kernel plans of a layer of this geometry on ``device``
    (``Runtime.cached_plans``): what torch.compile's trace of a layer with a dynamic size compares that size with (a
    guard), so that a planned size gets its own graph with its plan. A cache read and a load, never a tuning (it
    waits for one another thread is running); a constant of the graph (a plan stored later is taken when the graph
    is compiled again)."""
    like = _trace_problem(c, k, r, s, stride, padding, dilation, bias, dtype, layout, tf32)
    try:
        return tuple(runtime.get().cached_plans(like, device))
    except Exception as e:  # (a broken cache or toolchain: torch's conv in the graph, as for a shape with no plan)
        log.once(f"trace-plans:{type(e).__name__}", f"bagf_torch could not read cached plans while compiling "
                 f"({type(e).__name__}: {e}); the compiled graph runs torch's conv2d for them")
        return ()


def _static(shape) -> bool:
    """Whether every size of ``shape`` is one number, not a symbol, in the graph torch.compile is tracing (dynamo
    presents a symbolic size as an int to ``type`` and ``isinstance``; ``has_static_value`` is the question it
    answers while tracing, since torch 2.8 at least). Called only while tracing, when dynamo has imported
    symbolic_shapes (with sympy) already."""
    from torch.fx.experimental.symbolic_shapes import has_static_value

    return all(has_static_value(size) for size in shape)


@_compile_constant
def _plan_at_trace(n: int, h: int, w: int, c: int, k: int, r: int, s: int, stride: tuple, padding: tuple,
                   dilation: tuple, bias: bool, dtype: str, layout: str, tf32: bool, device: int) -> int:
    """The plan handle of this static-shape problem on ``device`` as an eager first call would take it
    (``Runtime.lookup``): the cached plan, else tuned now when tuning is on (BAGF_TUNE), else ATEN (tuning off with
    nothing cached, tuning in the background, another process tuning it). What ``torch.compile(model)(x)`` runs for
    a layer this process has not called eagerly: dynamo calls this for real while it traces (a constant of the
    graph, as the plan is), so compiling a model tunes its convolutions as its first eager call would."""
    problem = _trace_problem(c, k, r, s, stride, padding, dilation, bias, dtype, layout, tf32, n, h, w)
    try:
        return runtime.get().lookup(problem, device)[0]
    except Exception as e:  # (a broken cache or toolchain: torch's conv in the graph, as the eager call would run)
        log.once(f"trace-plan:{type(e).__name__}", f"bagf_torch could not plan {problem.short()} while compiling "
                 f"({type(e).__name__}: {e}); the compiled graph runs torch's conv2d for it")
        return ATEN


def _autocast_on(x: torch.Tensor) -> bool:
    """Whether autocast is on for ``x``'s device (``x.is_cuda`` first: ``x.device.type`` costs half a microsecond)."""
    return torch.is_autocast_enabled("cuda" if x.is_cuda else x.device.type)


def _op():
    """The bagf::conv2d overload (registered once the extension is loaded), looked up per call: no cache, so a
    test's stand-in namespace is seen."""
    return torch.ops.bagf.conv2d.default


def _extension_loaded():
    """The host extension (``bagf_ext``), or None before it is loaded. (Read straight from the loader's module: an
    import statement here cost half a microsecond on every inference call.)"""
    return _jit_extension._ext


def _inference_call():
    """The op's CUDA kernel without the dispatcher (``bagf_ext.conv2d_inference``), or None before the
    extension is loaded. Only for calls that need no gradient, outside torch.compile and tracing."""
    ext = _extension_loaded()
    return None if ext is None else ext.conv2d_inference


def _plan_query(name: str, handle: int) -> bool:
    """``bagf_ext.<name>(handle)``, a question about a loaded plan; False before the extension is loaded and for a
    handle it has no plan for (a test's stand-in handle: the op's call falls back to ATen anyway)."""
    ext = _extension_loaded()
    if ext is None:
        return False
    try:
        return bool(getattr(ext, name)(handle))
    except RuntimeError:
        return False


def _reads_krsc(handle: int) -> bool:
    """Whether plan ``handle`` reads its weight KRSC (channels_last; ``bagf_ext.plan_reads_krsc``): every TMA plan and
    every channels_last kernel of ours (not a cuBLASLt plan)."""
    return _plan_query("plan_reads_krsc", handle)


def _needs_dispatcher(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether a call must go through the dispatcher: a gradient to record."""
    return torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))


_PLAIN = (torch.Tensor, nn.Parameter)
_PLAIN_DISPATCH = torch._C._disabled_torch_dispatch_impl  # torch.Tensor's __torch_dispatch__, a plain subclass's too
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_is_tracing = torch._C._is_tracing  # (torch.jit.is_tracing without its Python frame)
_AUTOCAST_CASTS = frozenset((torch.float32, torch.float16, torch.bfloat16))
"""The dtypes autocast casts (it leaves float64 and non-floating tensors as they are)."""


def _wrapped(t) -> bool:
    """``t`` is not a tensor with storage of its own our kernel can read: an FX proxy, or a tensor subclass with its
    own ``__torch_dispatch__`` (FakeTensor, DTensor, a functional or logging wrapper). A plain subclass (no dispatch
    of its own) is its storage, as a Parameter is."""
    return type(t) not in _PLAIN and (not isinstance(t, torch.Tensor)
                                      or type(t).__torch_dispatch__ is not _PLAIN_DISPATCH)


def _foreign(x, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether a call is for ATen whatever the plan: an input, weight or bias our op cannot read (``_wrapped``), a
    TorchDispatchMode on the stack (FlopCounterMode, FakeTensorMode...), a functorch transform (vmap, jvp, grad), a
    forward-mode AD level or a torch.jit.trace recording (a plan handle means nothing outside this process). Our op
    is one CUDA kernel over dense tensors, with none of their rules; nn.Conv2d's forward has them all. (About 0.2 us
    per call.)"""
    if not (type(x) in _PLAIN and type(w) in _PLAIN and (b is None or type(b) in _PLAIN)) and (
            _wrapped(x) or _wrapped(w) or (b is not None and _wrapped(b))):
        return True
    return _dispatch_modes() > 0 or _functorch_active() or _forward_ad._current_level >= 0 or _is_tracing()


def _numeric_padding(conv: nn.Conv2d) -> tuple[int, int] | None:
    """Symmetric numeric padding equivalent to ``conv.padding``; None for asymmetric 'same' padding."""
    pad = conv.padding
    if isinstance(pad, str):
        if pad == "valid":
            return (0, 0)
        out = []
        for d, k in zip(conv.dilation, conv.kernel_size):
            total = d * (k - 1)
            if total % 2:
                return None
            out.append(total // 2)
        return (out[0], out[1])
    return (int(pad[0]), int(pad[1]))


class TunedConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose CUDA forward runs bagf_torch's tuned kernels.

    Same constructor, parameters and state dict as ``nn.Conv2d`` (state dicts load both ways). On the first
    forward for each input shape the layer looks up a tuned plan in the on-disk cache, or tunes one
    (BAGF_TUNE=1), then reuses it. float32, float16 and bfloat16 in NCHW or channels_last (with the
    weight in the input's dtype), are tuned; under ``torch.autocast`` to float16 or bfloat16 the input, weight and
    bias are cast to that dtype first, as nn.Conv2d's forward casts them. Anything the kernels do not handle (CPU
    tensors, other dtypes, other strides, autocast to another dtype, padding_mode other than
    'zeros', groups > 1, asymmetric 'same' padding, empty batches or weights, input, weight or output of more than
    2^31 elements) runs through ``nn.Conv2d.forward`` with one log line the first time per reason. Backward always
    uses ATen's convolution backward.

    Example::

        >>> import torch, bagf_torch
        >>> conv = bagf_torch.TunedConv2d(3, 8, kernel_size=3, padding=1)
        >>> conv(torch.randn(2, 3, 16, 16)).shape    # CPU: ATen fallback, one log line
        torch.Size([2, 8, 16, 16])
    """

    # Class defaults (a module unpickled from an older state has none of its own), not annotated: TorchScript would
    # read an annotation as a module attribute's type.
    _bagf_last = None  # tuple | None: the last plan entry used
    _bagf_frozen = False  # ``freeze_weights``
    # torch.jit.script compiles the forward's first branch only: this process's memos (dicts keyed by shapes, tuples)
    # are not its to type, and a layer that had been called could not be scripted
    __jit_ignored_attributes__ = ["_bagf_plans", "_bagf_last", "_bagf_told", "_bagf_krsc", "_bagf_pinned"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._bagf_reset()

    def _bagf_reset(self) -> None:
        """Forget what this layer learnt about its calls (a new weight, a copy, a recording pass)."""
        self.__dict__["_bagf_plans"] = {}
        self.__dict__["_bagf_last"] = None  # the last entry used, checked before the dict
        self.__dict__["_bagf_told"] = set()  # kinds of input the kernels never take, already checked and logged
        self.__dict__["_bagf_krsc"] = None  # the weight's KRSC copy with frozen weights (``_krsc_weight``)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> "TunedConv2d":
        """A TunedConv2d sharing ``conv``'s parameters, buffers and hooks (weights are not copied)."""
        new = cls.__new__(cls)
        new.__dict__.update(conv.__dict__)
        new._bagf_reset()
        return new

    def __getstate__(self):
        # Plan handles index this process's loaded kernels: never let them travel with a pickle or deepcopy.
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_bagf_")}
        state.update(_bagf_plans={}, _bagf_last=None, _bagf_told=set(), _bagf_krsc=None,
                     _bagf_frozen=self._bagf_frozen)
        return state

    def _apply(self, *args, **kwargs):
        # .to(), .cuda(), .half() and the like move or convert the weight: what the layer learnt is void. (The copies
        # graphs captured earlier read stay pinned: a .to() that changes nothing, model.cuda() on a CUDA model, leaves
        # those graphs valid; freeze_weights lets them go.)
        out = super()._apply(*args, **kwargs)
        self._bagf_reset()
        return out

    @staticmethod
    def _device_reason(x: torch.Tensor) -> str | None:
        return None if x.is_cuda else "input is not a CUDA tensor"

    def _unsupported(self, x: torch.Tensor) -> str | None:
        """Why the tuned kernels cannot take ``x`` (a short reason, logged once per reason), or None. Under autocast,
        of ``x`` and the weight cast to autocast's dtype, as the forward casts them."""
        w = self.weight
        reason = self._device_reason(x)
        if reason is not None:
            return reason
        cast = None
        if _any_autocast() and _autocast_on(x):  # nn.Conv2d's forward returns autocast's dtype
            cast = torch.get_autocast_dtype(x.device.type)
            if cast not in _TAKEN_DTYPES:
                return f"autocast to {cast} (tuned under autocast: float16, bfloat16)"
        fmt = _format(x)
        if cast is not None and fmt is not None:
            fmt = (_DTYPE_NAMES[cast], fmt[1])
        if fmt is not None and fmt not in _FORMATS:
            return (f"{fmt[0]} {'channels_last' if fmt[1] == 'nhwc' else 'NCHW'} input (tuned: "
                    f"{', '.join(sorted(' '.join(f) for f in _FORMATS))})")
        if fmt is None and x.dtype not in _DTYPE_NAMES:
            return f"dtype {x.dtype} (tuned: float32, float16, bfloat16)"
        if cast is None and w.dtype != x.dtype:
            return f"weight dtype {w.dtype} differs from the input's {x.dtype}"
        if self.padding_mode != "zeros":
            return f"padding_mode={self.padding_mode!r} (kernels implement zero padding)"
        if self.groups != 1:
            return "groups > 1 (grouped and depthwise convs are not tuned yet)"
        if x.dim() != 4:
            return "unbatched (3-D) input"
        if x.shape[1] != w.shape[1] * self.groups:
            return _BAD_CALL  # checked before anything is tuned: such a call is not a problem to tune
        if min(self.stride) < 1 or min(self.dilation) < 1 or (
                not isinstance(self.padding, str) and min(self.padding) < 0):
            return _BAD_CALL  # nor is a stride or dilation below 1 or a negative padding: nn.Conv2d says which
        if fmt is None:
            return "non-contiguous input (neither NCHW nor channels_last)"
        if (not w.is_contiguous() and fmt[1] == "nchw") or w.device != x.device:
            # (channels_last plans read the weight KRSC; the host converts one in another format)
            return "weight is not a contiguous tensor on the input's device"
        if x.shape[0] == 0:
            return "empty batch"
        if w.shape[0] == 0 or w.shape[1] == 0:
            return "weight without output or input channels"
        if isinstance(self.padding, str) and _numeric_padding(self) is None:
            return "asymmetric 'same' padding (even kernel extent)"
        if x.numel() > _INT32_MAX:
            return "input with more than 2^31 elements"
        if w.numel() > _INT32_MAX:
            return "weight with more than 2^31 elements"
        # The kernels index the output with 32 bits too; a problem whose output is larger must not even be
        # tuned (the checker would launch a candidate into it).
        (ph, pw), (sh, sw), (dh, dw) = _numeric_padding(self), self.stride, self.dilation
        p = out_extent(x.shape[2], w.shape[2], sh, ph, dh)
        q = out_extent(x.shape[3], w.shape[3], sw, pw, dw)
        if p <= 0 or q <= 0:  # ATen raises its own error for this, as nn.Conv2d would
            return "kernel larger than the padded input"
        if x.shape[0] * w.shape[0] * p * q > _INT32_MAX:
            return "output with more than 2^31 elements"
        return None

    def _lookup(self, x: torch.Tensor, padding: tuple[int, int]) -> tuple:
        """What calls like ``x`` run, from the runtime's plan for their problem: the entry ``_remember`` keeps."""
        problem = ConvProblem.from_call(x, self.weight, self.bias, self.stride, padding, self.dilation, 1)
        generation = runtime.GENERATION  # before the lookup: a plan stored while it runs moves it past this
        try:
            handle, final = runtime.get().lookup(problem, x.get_device())
        except Exception as e:  # a broken toolchain or tuner must not break the user's forward
            log.once(f"tune-error:{type(e).__name__}", f"bagf_torch could not tune {problem.short()} "
                     f"({type(e).__name__}: {e}); using torch's conv2d for it")
            handle, final = ATEN, True
        if handle != ATEN:
            return self._kernel_entry(handle, padding)
        # ATen standing in for now (BAGF_TUNE=0, tuning in the background, another process tuning it): ask again
        return ("aten",) if final else ("later", time.monotonic() + RECHECK_S, generation)

    def _kernel_entry(self, handle: int, padding: tuple[int, int]) -> tuple:
        """The entry of a call that runs plan ``handle``: the op's arguments after the tensors, and whether the plan
        reads its weight KRSC (then inference calls with frozen weights pass ``_krsc_weight``'s copy)."""
        return ("kernel", handle, list(self.stride), list(padding), list(self.dilation), _reads_krsc(handle))

    def _krsc_weight(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` in KRSC (channels_last) for a layer with frozen weights (``freeze_weights``) whose plan reads it so,
        which would otherwise convert it on every call (a copy kernel, and several microseconds of host time): a copy
        made at the first such call outside a CUDA graph capture, made again when ``w`` is another tensor or has
        another version or storage (an in-place update, ``load_state_dict``, ``.data =``; the old storage is held
        while its copy is, so a new one cannot take its address). Writes through ``.data`` (``w.data.copy_(...)``)
        change none of those: what freezing asks the caller not to do. A capture takes the copy as it is (``w``
        itself when there is none yet, or a stale one: the op's conversion is captured) and pins it: the layer
        keeps every copy a graph reads until ``freeze_weights`` is called again. An inference tensor has no version
        counter: the op converts it. Streams: another stream's first use of a copy waits for the copy's event and
        records the stream with the caching allocator, so the copy is complete before it is read and not reused
        while it is."""
        kept = self.__dict__.get("_bagf_krsc")
        if kept is not None and kept[0]() is w and kept[1] == w._version and kept[2].data_ptr() == w.data_ptr():
            copy = kept[3]
            if copy is w:
                return w
            if _stream_capturing():
                pinned = self.__dict__.setdefault("_bagf_pinned", [])
                if not any(p is copy for p in pinned):
                    pinned.append(copy)
            elif copy.is_cuda and _raw_stream is not None:
                stream = _raw_stream(copy.device.index)
                if stream not in kept[5]:  # a stream other than the copy's own, first use
                    current = torch.cuda.current_stream(copy.device)
                    current.wait_event(kept[4])
                    copy.record_stream(current)
                    kept[5].add(stream)
            return copy
        if _stream_capturing() or w.is_inference():
            return w
        krsc = w.contiguous(memory_format=torch.channels_last)  # (``w`` itself when it is KRSC already)
        event, streams = None, set()
        if krsc is not w and krsc.is_cuda and _raw_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(krsc.device))
            streams.add(_raw_stream(krsc.device.index))
        self.__dict__["_bagf_krsc"] = (weakref.ref(w), w._version, w.detach(), krsc, event, streams)
        return krsc

    def _remember(self, x: torch.Tensor, entry: tuple) -> None:
        """Calls like ``x`` (shape, device, TF32 flag, dtype and contiguity: NCHW or channels_last, as every call that
        gets here) take ``entry`` from the fast path from now on (see ``_tuned_forward``; never called while
        compiling)."""
        key = (x.shape, x.get_device(), _tf32(), x.dtype, x.is_contiguous())
        self.__dict__.setdefault("_bagf_plans", {})[key] = entry
        self.__dict__["_bagf_last"] = (*key, entry)  # (not through nn.Module.__setattr__: it costs a microsecond)

    def _plan_entry(self, x: torch.Tensor) -> tuple | None:
        plans = self.__dict__.get("_bagf_plans")
        if not plans:
            return None
        key = (x.shape, x.get_device(), _tf32(), x.dtype, x.is_contiguous())
        entry = plans.get(key)
        if entry is not None:
            self.__dict__["_bagf_last"] = (*key, entry)
        return entry

    def _tell(self, x: torch.Tensor, kind) -> str | None:
        """Why the kernels do not take ``x`` (``_unsupported``), logged the first time per reason in the process;
        ``kind`` (a (dtype, contiguous) pair, "autocast"), when given, is remembered so that such calls are not checked
        again."""
        if kind is not None:
            self.__dict__.setdefault("_bagf_told", set()).add(kind)
        reason = self._unsupported(x)
        if reason is not None and reason is not _BAD_CALL:
            log.once(f"fallback:{reason}", f"TunedConv2d: {reason}; running nn.Conv2d's forward (ATen)")
        return reason

    def _traced_forward(self, input: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The forward torch.compile traces: nothing written, no clock, no logging in the traced code (each would
        break the graph); for a static shape the kernel this layer already runs for such calls (in the TF32 mode of
        the trace), else the plan an eager first call would take (``_plan_at_trace``, which dynamo runs for real: the
        cache's, else tuned while compiling, else torch's conv); for a dynamic shape the cached plan of a size it
        takes (a guard), else torch's conv. Under autocast, torch's conv: autocast's casts stay in the graph as
        nn.Conv2d's forward makes them (the eager forward's own casts are not traced)."""
        if _exporting() or (_any_autocast() and _autocast_on(input)) or self._unsupported(input) is not None:
            # (torch.export: a plan handle means nothing in the process that loads the exported program)
            return self._conv_forward(input, w, b)
        # A plan serves one static shape. The table is searched by comparing sizes, not by hashing them: a hash
        # specialises every size (a recompile per batch size until torch gives up). A comparison of a dynamic size
        # with a planned one is a guard (size != planned) on the dynamic graph, which torch's automatic dynamic
        # compiles at a second batch size: a planned size then keeps its own static graph with its plan, and every
        # other size shares the dynamic graph of torch's conv.
        device, tf32, dtype, contiguous = input.get_device(), _tf32_at_trace(), input.dtype, input.is_contiguous()
        entry = None
        for key, value in self.__dict__.get("_bagf_plans", {}).items():
            if key[1:] == (device, tf32, dtype, contiguous) and len(key[0]) == input.dim() and all(
                    size == want for size, want in zip(input.shape, key[0])):
                entry = value
                break
        if entry is None:  # not run eagerly in this process
            padding = _numeric_padding(self)
            geometry = (self.in_channels, self.out_channels, *self.kernel_size, tuple(self.stride), padding,
                        tuple(self.dilation), b is not None, *_format(input), tf32 and dtype is _F32, device)
            handle = ATEN
            if _static(input.shape):  # its plan as an eager first call takes it (the cache's, else tuned now)
                handle = _plan_at_trace(input.shape[0], input.shape[2], input.shape[3], *geometry)
            else:  # a dynamic size: the plan the cache holds for one of the sizes it takes (a guard on it)
                for (n, h, width), planned in _cached_plans_at_trace(*geometry):
                    if input.shape[0] == n and input.shape[2] == h and input.shape[3] == width:
                        handle = planned
                        break
            if handle == ATEN:
                return self._conv_forward(input, w, b)
            return _op()(input, w, b, list(self.stride), list(padding), list(self.dilation), handle)
        if entry[0] != "kernel":
            return self._conv_forward(input, w, b)
        return _op()(input, w, b, entry[2], entry[3], entry[4], entry[1])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # TorchScript compiles this branch only (``torch.jit.script`` of a model: torch's conv, as a scripted
        # nn.Conv2d runs); the tuned forward is Python that TorchScript cannot compile, and is left out of it.
        if torch.jit.is_scripting():
            return self._conv_forward(input, self.weight, self.bias)
        return self._tuned_forward(input)

    @torch.jit.unused
    def _tuned_forward(self, input: torch.Tensor) -> torch.Tensor:
        # The parameters straight from _parameters: ``self.weight`` goes through nn.Module.__getattr__, which
        # costs more per call than the whole fast path below. (A parametrized or weight-normed module keeps its
        # weight elsewhere: then the attribute.)
        params = self._parameters
        own = True  # ``w`` is the layer's own weight tensor, the same from call to call (``_krsc_weight``)
        try:
            w, b = params["weight"], params["bias"]
        except KeyError:
            w, b, own = self.weight, self.bias, False
        if _compiling():
            return self._traced_forward(input, w, b)
        if type(input) not in _PLAIN and _wrapped(input):  # (an FX proxy or a wrapper: before anything reads it)
            return self._conv_forward(input, w, b)
        if _any_autocast() and _autocast_on(input):
            # What nn.Conv2d's forward does under autocast: input, weight and bias cast to autocast's dtype (the
            # memory format kept), the conv in that dtype; here by the kernels of that dtype. (Our op has no autocast
            # kernel: it computes the dtype it is given.) Calls that ATen answers anyway are left to autocast's own
            # casts: a float64 tensor (autocast casts none), a padding mode other than zeros (nn.Conv2d pads first,
            # in the input's dtype).
            cast = torch.get_autocast_dtype(input.device.type)
            if (input.dtype not in _AUTOCAST_CASTS or w.dtype not in _AUTOCAST_CASTS
                    or (b is not None and b.dtype not in _AUTOCAST_CASTS) or self.padding_mode != "zeros"):
                return self._conv_forward(input, w, b)
            if cast not in _TAKEN_DTYPES:
                if "autocast" not in self.__dict__.get("_bagf_told", ()):
                    self._tell(input, "autocast")
                return self._conv_forward(input, w, b)
            # the weight in the input's memory format in the same copy (a channels_last plan reads it KRSC; the
            # host would otherwise convert it again)
            fmt = torch.channels_last if memory_layout(input) == "nhwc" else torch.preserve_format
            input, w, b = input.to(cast), w.to(dtype=cast, memory_format=fmt), None if b is None else b.to(cast)
            own = False
        # Input the kernels never take (a dtype and memory format no family computes, other strides): nn.Conv2d's
        # forward at once, for two checks; the reason is logged once. (memory_layout's rule, spelt out: every
        # call passes here.)
        dtype, contiguous = input.dtype, input.is_contiguous()
        if (dtype is not _F32 or not contiguous) and ((dtype, contiguous) not in _TAKEN or (
                not contiguous and not input.is_contiguous(memory_format=torch.channels_last))):
            kind = (dtype, contiguous) if dtype in _TAKEN_DTYPES else dtype  # (one kind per dtype never taken)
            if kind not in self.__dict__.get("_bagf_told", ()):
                self._tell(input, kind)
            return self._conv_forward(input, w, b)
        # The plan table: what calls like this one (same shape, device, TF32 flag, dtype and format) run, learnt on
        # the first such call; the last entry used first, else the table. It skips the support checks and the runtime's
        # lookup, which cost several microseconds per call (batch-1 calls are host-bound). An entry is
        # - ("kernel", handle, stride, padding, dilation, krsc): our kernel, while the weight still has the input's
        #   dtype (and, for an NCHW input, is contiguous); with ``krsc`` (the plan reads the weight KRSC) a call that
        #   needs no gradient passes the layer's KRSC copy of it when its weights are frozen;
        # - ("aten",): the plan is torch's conv (cuDNN won);
        # - ("unsupported",): a call the kernels do not take for another reason (device, groups, padding...);
        # - ("later", until, generation): ATen for now (no plan with BAGF_TUNE=0, another process tuning it),
        #   until ``until`` or until the runtime's GENERATION moves (a plan may have appeared).
        # Every ATen answer is exactly nn.Conv2d's forward, self._conv_forward.
        last = self._bagf_last
        if (last is not None and last[0] == input.shape and last[1] == input.get_device() and last[2] is _tf32()
                and last[3] is dtype and last[4] is contiguous):
            hit = last[5]
        else:
            hit = self._plan_entry(input)
        if hit is not None:
            kind = hit[0]
            if kind == "kernel":
                if w.dtype is dtype and (not contiguous or w.is_contiguous()):
                    if _foreign(input, w, b):  # (only where a kernel would run: aten entries need no such check)
                        return self._conv_forward(input, w, b)
                    if _needs_dispatcher(input, w, b):
                        return _op()(input, w, b, hit[2], hit[3], hit[4], hit[1])
                    if hit[5] and own and self._bagf_frozen:
                        w = self._krsc_weight(w)
                    return (_inference_call() or _op())(input, w, b, hit[2], hit[3], hit[4], hit[1])
            elif kind == "aten" or kind == "unsupported" or (
                    kind == "later" and time.monotonic() < hit[1] and hit[2] == runtime.GENERATION):
                return self._conv_forward(input, w, b)
        if _foreign(input, w, b):  # (neither checked, looked up nor tuned: a first call under a transform or mode)
            return self._conv_forward(input, w, b)
        entry = self._first_entry(input)
        if entry is None or entry[0] != "kernel":  # not taken, cuDNN won the tuning, or no plan yet: the stock path,
            return self._conv_forward(input, w, b)  # without the op's extra hop
        return _op()(input, w, b, entry[2], entry[3], entry[4], entry[1])

    def _first_entry(self, input: torch.Tensor) -> tuple | None:
        """The plan-table entry of the first call like ``input`` (the table has none): the call checked (the reason
        logged once where the kernels do not take it: None), then the runtime's plan for it, looked up or tuned now,
        remembered (``_remember``) and returned."""
        reason = self._tell(input, None)
        if reason is not None:
            if reason is not _BAD_CALL:
                self._remember(input, ("unsupported",))
            return None
        entry = self._lookup(input, _numeric_padding(self))
        self._remember(input, entry)
        return entry

    @torch.jit.unused
    def _relu_forward(self, input: torch.Tensor) -> torch.Tensor | None:
        """``relu(self(input))`` as one launch, the ReLU in the plan's epilogue, for FusedSequential's conv -> ReLU
        pairs (the caller has checked that neither module has hooks): where calls like ``input`` run a TMA plan of
        this layer (its plan table, or the runtime's plan on a first call), eagerly, with no gradient to record; None
        otherwise (no plan yet, torch's conv, another kernel, anything the fast path of ``_tuned_forward`` would not
        hand to the kernel), and the caller calls the two modules. The answer is torch's ReLU of what
        ``self(input)`` gives, to the bit (``wgh::out`` in csrc/kernels/implicit_gemm_wgmma_h16.cuh)."""
        if _compiling() or type(input) not in _PLAIN or (_any_autocast() and _autocast_on(input)):
            return None
        params = self._parameters
        own = True
        try:
            w, b = params["weight"], params["bias"]
        except KeyError:
            w, b, own = self.weight, self.bias, False
        dtype, contiguous = input.dtype, input.is_contiguous()
        if not contiguous and not input.is_contiguous(memory_format=torch.channels_last):
            return None
        hit = self._plan_entry(input)
        if hit is None:
            # The pair's first call like ``input`` (after tune_model, or in a process serving the cache): the plan
            # looked up (or tuned) and remembered here, as the conv's own first call would, so that this call, a
            # first call inside a CUDA graph capture too, runs as one launch. A dtype and format no family computes
            # is left to the conv's call, which says why.
            if ((dtype is not _F32 or not contiguous) and (dtype, contiguous) not in _TAKEN) or _foreign(input, w, b):
                return None
            hit = self._first_entry(input)
        if (hit is None or hit[0] != "kernel" or w.dtype is not dtype or (contiguous and not w.is_contiguous())
                or _foreign(input, w, b) or _needs_dispatcher(input, w, b)):
            return None
        ext = _extension_loaded()
        if ext is None or not _fuses_relu(hit[1]):
            return None
        mode = _relu_mode(input.device, dtype)
        if mode is None:
            return None
        if hit[5] and own and self._bagf_frozen:
            w = self._krsc_weight(w)
        return ext.conv2d_relu_inference(input, w, b, hit[2], hit[3], hit[4], hit[1], mode)


_FUSES_RELU: dict[int, bool] = {}
"""Plan handle -> whether its epilogue runs a ReLU (``bagf_ext.plan_fuses_relu``: the TMA plans). Handles are never
reused in a process."""
_RELU_MODES: dict[tuple, int] = {}
"""(device, dtype) -> ``conv2d_relu_inference``'s relu argument: 2 where torch's ReLU keeps -0.0 there, else 1."""


def _fuses_relu(handle: int) -> bool:
    """``bagf_ext.plan_fuses_relu(handle)``, asked once per handle of the loaded extension."""
    fuses = _FUSES_RELU.get(handle)
    if fuses is None:
        fuses = _plan_query("plan_fuses_relu", handle)
        if _extension_loaded() is not None:
            _FUSES_RELU[handle] = fuses
    return fuses


def _relu_mode(device: torch.device, dtype: torch.dtype) -> int | None:
    """2 where torch's ReLU keeps -0.0 on ``device`` in ``dtype``, 1 where it makes it +0.0, asked once (one
    synchronisation); None during a CUDA graph capture before it was asked (the capture cannot synchronise)."""
    key = (device, dtype)
    mode = _RELU_MODES.get(key)
    if mode is None:
        if device.type == "cuda" and _stream_capturing():
            return None
        zero = torch.relu(torch.full((1,), -0.0, device=device, dtype=dtype))
        mode = _RELU_MODES[key] = 2 if bool(torch.signbit(zero).item()) else 1
    return mode


def freeze_weights(model: nn.Module, frozen: bool = True) -> nn.Module:
    """Promise that the convolution weights of ``model``'s TunedConv2d layers will not change behind their backs,
    so that a layer whose plan reads its weight in another layout (the TMA plans on NCHW inputs read it KRSC) keeps
    a converted copy instead of converting the weight on every inference call, in eager mode and in CUDA graphs
    captured afterwards. Returns ``model``.

    Call it after ``convert`` (it sets TunedConv2d layers only). In eager mode a layer notices an in-place update of
    the parameter, ``load_state_dict`` and ``.data =`` and converts again; it does not notice writes through
    ``.data`` (``weight.data.copy_(...)``, as some EMA helpers do) or raw pointers. A CUDA graph captured after
    freezing reads the copies it was captured with (the layer keeps them alive, stale or not): after changing
    weights, call ``freeze_weights(model)`` again, which drops every copy and so voids the graphs captured before,
    run the model once, and capture again (it waits for the device when there are such copies to free). Each copy
    costs its weight's size in device memory, and a layer keeps each copy a capture took, so memory grows with every
    refresh followed by a capture until the next ``freeze_weights``. ``frozen=False`` undoes it (graphs captured
    while frozen are void too): every call converts, and a graph captured afterwards reads the weight as it is at
    each replay, as nn.Conv2d's does.

    >>> import torch, bagf_torch
    >>> m = bagf_torch.freeze_weights(bagf_torch.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))))
    >>> m[0]._bagf_frozen
    True
    """
    for module in model.modules():
        if isinstance(module, TunedConv2d):
            # the copies graphs captured earlier read (those graphs are void now): freed once no replay can be running
            for device in {p.device for p in module.__dict__.get("_bagf_pinned", ()) if p.is_cuda}:
                torch.cuda.synchronize(device)
            module.__dict__["_bagf_frozen"] = bool(frozen)
            module.__dict__["_bagf_krsc"] = None
            module.__dict__["_bagf_pinned"] = []
    return model


def convert(model: nn.Module, fuse: bool = True) -> nn.Module:
    """Swap every ``nn.Conv2d`` in ``model`` for a ``TunedConv2d`` in place, keeping its parameters.

    Returns ``model`` (or the new module if ``model`` itself is an ``nn.Conv2d``). Subclasses of
    ``nn.Conv2d`` (other than TunedConv2d) are left alone: their forward may differ.

    With ``fuse`` (the default), each ``nn.Sequential`` where an ``nn.MaxPool2d`` or an ``nn.ReLU`` follows a
    converted conv becomes a :class:`~bagf_torch.epilogue.FusedSequential`: the same modules in the same places,
    whose forward runs a ReLU and pool after a conv as one kernel, and a ReLU after a conv whose plan is a TMA plan
    in that plan's epilogue, to the bit what ATen's ops give (AlexNet's and VGG's features). Modules called one by
    one (a slice, a loop over the layers, hooks) answer as before.

    >>> import torch, bagf_torch
    >>> m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    >>> type(bagf_torch.convert(m)[0]).__name__
    'TunedConv2d'
    """
    if type(model) is nn.Conv2d:
        return TunedConv2d.from_conv(model)
    _swap(model)
    if fuse:
        from . import epilogue

        epilogue.fuse(model)
    return model


def _swap(model: nn.Module) -> None:
    for name, child in list(model.named_children()):
        if type(child) is nn.Conv2d:
            setattr(model, name, TunedConv2d.from_conv(child))
        else:
            _swap(child)

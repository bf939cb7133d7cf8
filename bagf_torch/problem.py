"""``ConvProblem``: everything that decides which kernel is right for a call, and its cache key."""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch

_LEGACY_TF32 = torch._C._get_cudnn_allow_tf32


def _fp32_precision_tf32() -> bool:
    """cuDNN's fp32 convolution precision through torch's ``fp32_precision`` settings: the conv setting, else
    cuDNN's, else the global one ("none" defers to the next); PyTorch's default allows TF32."""
    for owner in ("cudnn.conv", "cudnn", ""):
        obj = torch.backends
        try:
            for part in filter(None, owner.split(".")):
                obj = getattr(obj, part)
            value = obj.fp32_precision
        except AttributeError:
            continue
        if value != "none":
            return value == "tf32"
    return True


def cudnn_tf32() -> bool:
    """Whether cuDNN may run fp32 convolutions in TF32 in this process: what "stock" means for an fp32 conv,
    part of every problem's key. ``torch.backends.cudnn.allow_tf32`` cannot be read once a program has set the
    newer ``torch.backends.cudnn.conv.fp32_precision`` (torch raises "mix of the legacy and new APIs"): then
    the newer setting answers."""
    try:
        return _LEGACY_TF32()
    except RuntimeError:
        return _fp32_precision_tf32()


@contextlib.contextmanager
def cudnn_conv_mode(*, benchmark: bool | None = None, tf32: bool | None = None, enabled: bool | None = None,
                    deterministic: bool | None = None):
    """cuDNN's settings for a block of conv calls, restored after; None leaves a setting as it is.

    TF32 goes through the API the process uses: the legacy ``allow_tf32`` while it can be read, else
    ``torch.backends.cudnn.conv.fp32_precision``. ``torch.backends.cudnn.flags`` reads and sets the legacy
    flag, which raises ("a mix of the legacy and new APIs") once a program has set ``conv.fp32_precision``
    apart from the RNN's; it also resets ``benchmark_limit`` and ``depthwise_kernel``, which this leaves alone."""
    c = torch._C
    saved = (c._get_cudnn_enabled(), c._get_cudnn_benchmark(), c._get_cudnn_deterministic())
    conv = getattr(torch.backends.cudnn, "conv", None)
    legacy, old_tf32 = True, None
    if tf32 is not None:
        try:
            old_tf32 = c._get_cudnn_allow_tf32()
        except RuntimeError:  # the newer API is in use
            legacy, old_tf32 = False, conv.fp32_precision
    try:
        if enabled is not None:
            c._set_cudnn_enabled(enabled)
        if benchmark is not None:
            c._set_cudnn_benchmark(benchmark)
        if deterministic is not None:
            c._set_cudnn_deterministic(deterministic)
        if tf32 is not None:
            if legacy:
                c._set_cudnn_allow_tf32(tf32)
            else:
                conv.fp32_precision = "tf32" if tf32 else "ieee"
        yield
    finally:
        c._set_cudnn_enabled(saved[0])
        c._set_cudnn_benchmark(saved[1])
        c._set_cudnn_deterministic(saved[2])
        if tf32 is not None:
            if legacy:
                c._set_cudnn_allow_tf32(old_tf32)
            else:
                conv.fp32_precision = old_tf32


def _pair(v) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(x) for x in v)
    if len(t) == 1:
        return (t[0], t[0])
    if len(t) != 2:
        raise ValueError(f"expected an int or a pair, got {v!r}")
    return t  # type: ignore[return-value]


def memory_layout(x: torch.Tensor) -> str:
    """"nchw" for a contiguous tensor, "nhwc" for one that is channels_last and not contiguous, "strided" otherwise:
    the rule every part of the package (the problem's key, the forward's dispatch, the op's output, the benchmarks'
    children) names a call's memory format by. A tensor that is both (C = 1 or H = W = 1) is "nchw".

    >>> x = torch.empty(2, 3, 4, 5)
    >>> memory_layout(x), memory_layout(x.to(memory_format=torch.channels_last)), memory_layout(x.transpose(2, 3))
    ('nchw', 'nhwc', 'strided')
    >>> memory_layout(torch.empty(2, 1, 4, 5).to(memory_format=torch.channels_last))
    'nchw'
    """
    if x.is_contiguous():
        return "nchw"
    return "nhwc" if x.is_contiguous(memory_format=torch.channels_last) else "strided"


def out_extent(size, k, stride, pad, dil):
    """The output's extent along one axis of a convolution (torch's formula): ``size`` input elements padded by
    ``pad`` on both sides, a ``k``-tap filter dilated by ``dil``, stride ``stride``. Zero or negative when the
    dilated filter is larger than the padded input. Plain arithmetic, so it takes ints and symbolic sizes
    (torch.SymInt, as the op's fake implementation sees them) alike.

    >>> out_extent(224, 11, 4, 2, 1), out_extent(13, 3, 1, 1, 1), out_extent(10, 3, 1, 2, 2)
    (55, 13, 10)
    """
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


_SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class ConvProblem:
    """One 2-D convolution problem: shapes, geometry, dtype and memory format (NCHW = contiguous).

    >>> p = ConvProblem(n=1, c=3, h=224, w=224, k=64, r=11, s=11, stride=(4, 4), padding=(2, 2))
    >>> p.out_hw, p.macs
    ((55, 55), 70276800)
    """

    n: int
    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    bias: bool = True
    dtype: str = "float32"
    layout: str = "nchw"
    tf32: bool = False  # torch.backends.cudnn.allow_tf32 at the call: decides what "stock" means for fp32

    @classmethod
    def from_call(cls, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding,
                  dilation, groups: int) -> "ConvProblem":
        """The problem of ``F.conv2d(x, weight, bias, stride, padding, dilation, groups)``; padding must be
        numeric (string padding is resolved by the caller)."""
        n, c, h, w = x.shape
        k, _, r, s = weight.shape
        return cls(n=int(n), c=int(c), h=int(h), w=int(w), k=int(k), r=int(r), s=int(s),
                   stride=_pair(stride), padding=_pair(padding), dilation=_pair(dilation),
                   groups=int(groups), bias=bias is not None,
                   dtype=str(x.dtype).replace("torch.", ""), layout=memory_layout(x),
                   tf32=bool(x.dtype == torch.float32 and cudnn_tf32()))

    @property
    def out_hw(self) -> tuple[int, int]:
        (sh, sw), (ph, pw), (dh, dw) = self.stride, self.padding, self.dilation
        return out_extent(self.h, self.r, sh, ph, dh), out_extent(self.w, self.s, sw, pw, dw)

    def tiles(self, m: int) -> int:
        """Output tiles of m x m (a Winograd F(m x m) problem's tile count): N * ceil(P/m) * ceil(Q/m).

        >>> ConvProblem(n=2, c=1, h=13, w=13, k=1, r=3, s=3, padding=(1, 1)).tiles(4)
        32
        """
        p, q = self.out_hw
        return self.n * -(-p // m) * -(-q // m)

    @property
    def macs(self) -> int:
        p, q = self.out_hw
        return self.n * self.k * p * q * (self.c // self.groups) * self.r * self.s

    @property
    def flops(self) -> int:
        return 2 * self.macs

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stride"], d["padding"], d["dilation"] = list(self.stride), list(self.padding), list(self.dilation)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ConvProblem":
        d = dict(d)
        for f in ("stride", "padding", "dilation"):
            d[f] = _pair(d[f])
        return cls(**d)

    def short(self) -> str:
        """Compact human-readable form for logs and tables."""
        p, q = self.out_hw
        return (f"N{self.n} C{self.c} {self.h}x{self.w} -> K{self.k} {p}x{q} k{self.r}x{self.s} "
                f"s{self.stride[0]}{'x' + str(self.stride[1]) if self.stride[1] != self.stride[0] else ''} "
                f"p{self.padding[0]}{'x' + str(self.padding[1]) if self.padding[1] != self.padding[0] else ''}"
                + (f" d{self.dilation[0]}" if self.dilation != (1, 1) else "")
                + ("" if (self.dtype, self.layout) == ("float32", "nchw") else
                   f" {_SHORT_DTYPES.get(self.dtype, self.dtype)} {self.layout}"))


def fingerprint(problem: ConvProblem, env: Mapping[str, Any]) -> str:
    """sha256 of everything that changes the answer: the environment (GPU name and compute capability,
    driver/runtime/NVRTC versions, torch and bagf_torch versions, kernel source and launch code hashes) and the problem
    (shapes, geometry, dtype, layout). Any change means a different key, hence a re-tune."""
    blob = json.dumps({"env": dict(env), "problem": problem.as_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()

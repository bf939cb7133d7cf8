"""The op as PyTorch sees it: ``torch.ops.bagf.conv2d``.

Schema (defined once, in csrc/bagf_ext.cpp's ``TORCH_LIBRARY(bagf, m)``)::

    bagf::conv2d(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, int[2] dilation,
                 int plan) -> Tensor

``plan`` is a handle from the runtime (a loaded kernel) or :data:`ATEN` (-1) for ATen's conv2d. Kernels: CUDA (the tuned
kernel on the current stream, or ATen when the plan cannot take the call), CPU (ATen) and Autograd (forward
through the op, backward through ``at::convolution_backward``), all in C++, so a call runs no Python.
The fake (meta) implementation below lets torch.compile trace it; it is registered when the extension loads.
"""

from __future__ import annotations

import threading

import torch

from .problem import memory_layout, out_extent

ATEN = -1
"""The ``plan`` value meaning "torch's own conv" (ATen's conv2d): what the runtime serves a problem with when
no tuned kernel is the plan, and the tuner's candidate handle for cuDNN."""

_registered = False
_lock = threading.Lock()


def register_fake() -> None:
    """Register the shape function for torch.compile / FakeTensor (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return

        @torch.library.register_fake("bagf::conv2d")
        def _conv2d_fake(input, weight, bias, stride, padding, dilation, plan):
            torch._check(input.dim() == 4 and weight.dim() == 4,
                         lambda: "bagf::conv2d expects a 4-D NCHW input and a 4-D KCRS weight")
            torch._check(min(stride) >= 1 and min(dilation) >= 1 and min(padding) >= 0,
                         lambda: f"bagf::conv2d: stride and dilation must be at least 1 and padding at least 0, got "
                                 f"stride {list(stride)}, padding {list(padding)}, dilation {list(dilation)}")
            p = out_extent(input.shape[2], weight.shape[2], stride[0], padding[0], dilation[0])
            q = out_extent(input.shape[3], weight.shape[3], stride[1], padding[1], dilation[1])
            # the kernels' rule, which the CUDA op keeps for ATen's answers too: channels_last out for a
            # channels_last input (one that is not also contiguous), else contiguous; the input's dtype
            fmt = torch.channels_last if memory_layout(input) == "nhwc" else torch.contiguous_format
            return input.new_empty((input.shape[0], weight.shape[0], p, q)).contiguous(memory_format=fmt)

        _registered = True

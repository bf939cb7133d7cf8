"""``LaunchGeometry``: everything the host extension needs to launch one loaded kernel family instantiation.

A family's ``launch(config)`` returns one; ``KernelCompiler`` hands it to the extension's
``load_plan(cubin, lowered_name, device, geometry)`` through :meth:`LaunchGeometry.to_host`, and
csrc/bagf_ext.cpp keeps it in its plan table as ``struct LaunchGeometry`` (same field names, same defaults).
The field docs say what the host does with each value; load_plan refuses a plan whose values are out of the
ranges named here ("error" in its result, a typed "resources" failure in the tuner).

Grid of an ordinary plan (``gemm`` = 0): x over ceil(columns / ``bn``), y over ceil(K / ``bm``), z = ``split``,
with ``threads`` threads and ``smem`` bytes of dynamic shared memory per block; the columns are the output
pixels N*P*Q, or the output tiles when ``tile`` > 1 or ``tile_w`` > 1.

>>> from bagf_torch.kernels import implicit_gemm
>>> g = implicit_gemm.launch(implicit_gemm.DEFAULT)
>>> g.bm, g.bn, g.threads, g.smem, g.split, g.tile, g.gemm
(64, 64, 256, 8256, 1, 1, 0)
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LaunchGeometry:
    """The launch fields of one plan (csrc/bagf_ext.cpp's ``LaunchGeometry``); all ints, keyword-only."""

    bm: int = 0
    """Output channels per block: grid.y = ceil(K / bm). Unused by a ``gemm`` plan."""
    bn: int = 0
    """Columns per block: grid.x = ceil(columns / bn), columns = output pixels or output tiles. Unused by a
    ``gemm`` plan."""
    threads: int = 0
    """Threads per block of every launch of the plan's first kernel; load_plan refuses it above what the kernel's
    registers allow. A ``gemm`` plan's transform stages also size their grids by it (one item per thread)."""
    smem: int = 0
    """Dynamic shared memory per block in bytes, set as the kernel's maximum at load; an ordinary plan's launches
    ask for exactly this unless ``smem_patch`` or ``smem_taps`` is set (a ``gemm`` plan's stages ask for none)."""
    split: int = 1
    """Split-K slices, grid.z (1 to 65535); > 1 in a float32 plan without ``tma``: the host zeroes the output and
    the slices add atomically; in a 16-bit or ``tma`` one (an implicit GEMM only): the host passes a workspace of
    ``split`` fp32 sums per bm x bn tile and a zeroed counter per tile, the last slice of a tile adds them up in
    order (and refuses, to ATen, a call whose workspace would pass 1 GiB); with ``split_cluster`` the slices hand
    over inside a cluster instead."""
    tile: int = 1
    """1: the columns are output pixels (N*P*Q). m > 1 with ``tile_w`` = 0: Winograd F(m x m, 3x3), the columns
    are m x m output tiles (N * ceil(P/m) * ceil(Q/m)) and the host takes only 3x3 stride-1 dilation-1 calls
    (a ``gemm`` plan also strided ones through their polyphase components); at most 8. With ``tile_w`` > 0:
    a direct plan's tile rows, at most 64."""
    tile_w: int = 0
    """0: tiles are ``tile`` x ``tile``. > 0 (at most 256): a direct plan's ``tile`` x ``tile_w`` output tiles
    (N * ceil(P/tile) * ceil(Q/tile_w)), any filter geometry."""
    smem_patch: int = 0
    """> 0 (a direct plan): the host sizes dynamic shared memory per call as smem_patch bytes per word of the
    tile's input patch (``bagf::halo_patch`` rows x pitch) plus ``smem_taps`` bytes per filter tap (R*S), lets
    the kernel use the device's opt-in maximum, and sends a call that would not fit to ATen."""
    smem_taps: int = 0
    """Bytes per filter tap (R*S) of that per-call size (see ``smem_patch``); >= 0."""
    gemm: int = 0
    """1: a non-fused Winograd plan: stages 0 and 1 of the first kernel, a batched GEMM, stage 2, grids sized per
    call, workspaces U, V, M from torch's caching allocator; needs ``tile`` in 2, 4, 5, 6. 0: one launch."""
    layout: int = 0
    """A ``gemm`` plan's workspace layouts (0 to 15): bit 0 V stored [E][T][C] (else [E][C][T]), bit 1 M stored
    [E][T][K] (else [E][K][T]), bit 2 U followed by its small parts (2E batches, the wgmma GEMM's A; own GEMM
    only), bit 3 stage 2 staged through shared memory, whole images per block (not with bit 1)."""
    fix_s: int = 0
    """> 0: the kernel is specialised to filters fix_s wide at column stride ``fix_u``, dilation 1 (a direct
    plan's KS); the host sends calls with another geometry to ATen. Both positive or both 0."""
    fix_u: int = 0
    """The specialised column stride (a direct plan's KU), see ``fix_s``."""
    gemm_bm: int = 0
    """The plan's own batched GEMM (the cubin's second kernel; without one the GEMM is cuBLASLt's, else
    ``at::bmm_out``): output rows per block, grid.y = ceil(K / gemm_bm); at least 16 when there is one."""
    gemm_bn: int = 0
    """Its output columns per block, grid.x = ceil(T / gemm_bn) (grid.z = E); at least 16 when there is one."""
    gemm_threads: int = 0
    """Its threads per block; at least 32, and load_plan refuses it above what the GEMM's registers allow."""
    gemm_smem: int = 0
    """Its dynamic shared memory per block in bytes, set as its maximum at load and asked for by each launch."""
    dtype: int = 0
    """The tensors' dtype: 0 float32, 1 float16, 2 bfloat16 (input, weight, bias and output alike); the host
    sends a call of another dtype to ATen and allocates the output in this one. A 16-bit plan is one implicit-GEMM
    launch (``gemm`` = 0, ``tile`` = 1, split-K as ``split`` says) or a non-fused Winograd plan (``gemm`` = 1)."""
    nhwc: int = 0
    """1: the input and output are channels_last (NHWC) and the kernel reads the weight as KRSC (the host passes a
    channels_last weight, converting one that is not); 0: all contiguous NCHW. The host sends a call in the other
    format to ATen, and to a channels_last plan also an input that is both contiguous and channels_last (C = 1 or
    H = W = 1: NCHW to TunedConv2d's key and to the op's output rule)."""
    tma: int = 0
    """1: the kernel takes the TMA maps of the input and the weight (encoded by the host per call, in place of their
    pointers): an implicit GEMM (``gemm`` = 0) of ``bm``, ``bn`` <= 256 whose maps view a channels_last input and a
    KRSC weight (the host copies an NCHW plan's input, and any weight in another format, per call), in a 16-bit
    dtype or in float32 (mapped as TF32: the TMA unit rounds each value to TF32 as it copies; TF32-mode plans only).
    The host sends to ATen a call the maps cannot describe (channels not a whole number of 16 bytes: C % 8 != 0 in
    16 bits, C % 4 != 0 in float32; a tensor read in place off 16-byte alignment, stride above 8, padding above
    128, a window wider than the im2col box's range)."""
    stream_k: int = 0
    """2 (a ``tma`` plan with ``split`` = 1 only): persistent blocks, a one-dimensional grid of the blocks the device
    holds at once (at most one per output tile), each taking whole tiles in turn, no workspace. 1 (the same): stream-K.
    The host launches a one-dimensional grid of the blocks the device holds at once (the driver's occupancy of the
    kernel times the SMs; fewer where a block would get under 8 k tiles) and passes a workspace of two bm x bn fp32
    tiles per block and a zeroed counter per output tile; the blocks share all tiles' k tiles evenly and the last block
    of a shared tile sums it in k order."""
    blas: int = 0
    """1 or 2: a cuBLASLt plan (csrc/cublaslt_plan.h), no cubin (load_plan is handed none) and no kernel fields set:
    a 1x1 stride-1 unpadded convolution as cuBLASLt GEMMs in ``dtype`` and the ``nhwc`` format, fp32 sums, the bias
    in the GEMM's epilogue (channels_last) or as its C (NCHW: one image's broadcast of it made per call, or the
    output filled with it first where cuBLASLt takes no such C); 2 (float32 only) with TF32 products
    (CUBLAS_COMPUTE_32F_FAST_TF32). The host resolves each call shape's GEMM once (descriptors and cuBLASLt's
    heuristic for the call's alignments) and sends to ATen a call of another filter, stride or padding, or one whose
    shape has no ``blas_algo``-th algorithm."""
    blas_algo: int = 0
    """A cuBLASLt plan's entry (0 to 7) of the list cuBLASLt's heuristic gives for the call's shape, best first."""
    blas_ws: int = 0
    """A cuBLASLt plan's workspace limit in MiB (0 to 256) for the heuristic; the chosen algorithm's workspace comes
    from torch's caching allocator per call."""
    split_cluster: int = 0
    """1 (a ``tma`` plan without ``stream_k``, ``split`` 2 to 8, whose ``smem`` holds a bm x bn tile of fp32 sums
    besides 1024 bytes): split-K in clusters. The host launches the grid in thread block clusters of (1, 1, ``split``)
    blocks, the slices of one tile, which hand their sums over in distributed shared memory: no workspace, nothing to
    zero before the launch. load_plan refuses a kernel of which no such cluster fits the device at once."""
    tf32: int = 0
    """1: the plan computes fp32 convolutions with TF32 products, as cuDNN does with PyTorch's TF32 flag on (the
    families tuned only in that mode). The op sends to ATen a call made while cuDNN's TF32 is off
    (``torch.backends.cudnn.allow_tf32`` or ``cudnn.conv.fp32_precision``): a graph torch.compile'd in TF32 mode
    keeps its plans after the flag changes, and strict fp32 is what such a call asks for. (A captured CUDA graph
    replays its kernels whatever the flag, as it does cuDNN's.)"""
    polyphase: int = 0
    """1 (a 16-bit ``tma`` implicit GEMM whose cubin holds its gather and weight kernels after it: three names): the
    plan runs on the polyphase form of a strided call (csrc/kernels/conv_params.h ``PolyphaseParams``). Per call the
    host makes the form's input (s_h s_w C channels rounded up to 8, stride 1, no padding) and the form's KRSC weight
    (ceil(R / s_h) x ceil(S / s_w) taps) with the second and third kernels, then launches the first on them; it sends
    to ATen a call of dilation other than 1, of 64 channels or more, of strides outside 1-8 or both 1, whose form
    passes 65535 rows or 32-bit indexing, or whose weight's strides pass 32 bits, and the form to the TMA checks
    above."""

    def __post_init__(self):
        for f in dataclasses.fields(self):  # ints only (numpy integers become ints; floats and strings raise)
            object.__setattr__(self, f.name, operator.index(getattr(self, f.name)))

    def as_dict(self) -> dict[str, int]:
        """Field name -> value, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_host(self, ext):
        """The same values as the extension module ``ext``'s ``LaunchGeometry``, which ``load_plan`` takes."""
        return ext.LaunchGeometry(**self.as_dict())


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LaunchGeometry))
"""The field names in declaration order (the order of the host struct's members)."""

"""Winograd F(m x m, 3 x 3) convolution in plain torch: the transforms, a reference implementation, its error.

This is the numerical design of the Winograd families, kept apart from the GPU kernels so that
its accuracy can be measured anywhere (CPU included) and the kernels can be checked against it:

    Y = A^T [ (G g G^T) . (B^T d B) ] A        per (m+2) x (m+2) input tile d, 3x3 filter g, m x m output tile

with Lavin and Gray's matrices for F(2, 3) (interpolation points 0, 1, -1, infinity) and F(4, 3) (0, 1, -1,
2, -2, infinity), and Toom-Cook matrices made by :func:`toom_cook` for F(5, 3) (0, 1, -1, 2, -2, 1/2, infinity)
and F(6, 3) (0, 1, -1, 2, -2, 1/2, -1/2, infinity). F(2x2, 3x3) needs 16 multiplies per 4 outputs (2.25x fewer
than direct), F(4x4, 3x3) 36 per 16 (4x), F(5x5) 49 per 25 (4.6x), F(6x6) 64 per 36 (5.1x), at the price of
larger transform constants and so a larger fp32 error, which :func:`fp32_error` measures against a float64
direct convolution (AlexNet conv3/conv4 and a 3x3 256@56 layer, norm: F2 3e-7, F4 1.9e-6, F5 2.9e-6,
F6 3.7e-6; max 1.4e-5 at most: all far inside the tuner's check). F(5x5) matters on 13x13 maps (AlexNet
conv3-5): 3 x 3 tiles of 49 points make 441 products per channel pair where F(4x4)'s 4 x 4 tiles of 36 make
576 (and F(6x6)'s 3 x 3 of 64 also 576). Only the non-fused family (kernels.winograd_gemm) offers 5 and 6.

Only stride 1, dilation 1, 3x3 filters and groups=1 qualify (:func:`applies`) for the fused families; the
non-fused one also takes a stride-s problem with filters of up to 3s x 3s as the stride-1 3x3 convolution of
its s x s polyphase components (:func:`polyphase`, :func:`polyphase_applies`): AlexNet's conv1 (11x11, stride
4, 3 channels) becomes 3x3 over 48 channels, 1.19x the products before Winograd's 4-5x fewer.
"""

from __future__ import annotations

from fractions import Fraction as Fr

import torch
import torch.nn.functional as F

from .problem import ConvProblem

# (B^T, G, A^T) as exact fractions; converted to the working dtype on use.
_MATRICES = {
    2: (
        [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [Fr(1, 2), Fr(1, 2), Fr(1, 2)], [Fr(1, 2), Fr(-1, 2), Fr(1, 2)], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]],
    ),
    4: (
        [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
         [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
        [[Fr(1, 4), 0, 0], [Fr(-1, 6), Fr(-1, 6), Fr(-1, 6)], [Fr(-1, 6), Fr(1, 6), Fr(-1, 6)],
         [Fr(1, 24), Fr(1, 12), Fr(1, 6)], [Fr(1, 24), Fr(-1, 12), Fr(1, 6)], [0, 0, 1]],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
    ),
}

POINTS = {5: (0, 1, -1, 2, -2, Fr(1, 2)), 6: (0, 1, -1, 2, -2, Fr(1, 2), Fr(-1, 2))}
"""The finite interpolation points of the generated F(m, 3) (infinity is the last point of each). For F(5, 3)
this set had the smallest norm error of three tried (with 1/2, -1/2, 2 or -2 instead of -2, 1/2: 2.9-3.0e-6
against 2.8e-6 on conv4, 2.5e-6 each on the 56x56 layer)."""


def toom_cook(m: int, r: int, points) -> tuple[list[list[Fr]], list[list[Fr]], list[list[Fr]]]:
    """Exact ``(B^T, G, A^T)`` of the 1-D Winograd/Toom-Cook algorithm F(m, r) on the ``m + r - 2`` distinct
    finite ``points`` plus infinity: ``y = A^T [(G g) . (B^T d)]`` is the correlation
    ``y_i = sum_k g_k d_(i+k)`` for every d (length m+r-1) and g (length r).

    A^T is the Vandermonde matrix of the points (``A^T[i][j] = a_j^i``; infinity contributes only to the last
    output), G the Lagrange weights (``G[j][k] = a_j^k / prod_(l != j) (a_j - a_l)``; infinity picks ``g_(r-1)``),
    and B^T the unique matrix that makes the identity hold, solved exactly over the rationals (column l of
    B^T from the m*r equations ``sum_j A^T[i][j] G[j][k] B^T[j][l] = [l == i+k]``). With points (0, 1, -1,
    2, -2) it gives Lavin and Gray's F(4, 3) exactly.

    >>> bt, g, at = toom_cook(2, 3, (0, 1, -1))
    >>> [[int(v) for v in row] for row in at]
    [[1, 1, 1, 0], [0, 1, -1, 1]]
    """
    n = m + r - 1
    pts = [Fr(p) for p in points]
    if len(pts) != n - 1 or len(set(pts)) != n - 1:
        raise ValueError(f"F({m}, {r}) needs {n - 1} distinct finite points, got {list(points)}")
    at = [[a ** i for a in pts] + [Fr(int(i == m - 1))] for i in range(m)]
    g = []
    for j, a in enumerate(pts):
        f = Fr(1)
        for l, b in enumerate(pts):
            if l != j:
                f *= a - b
        g.append([a ** k / f for k in range(r)])
    g.append([Fr(int(k == r - 1)) for k in range(r)])
    bt = [[Fr(0)] * n for _ in range(n)]
    for col in range(n):
        rows = [[at[i][j] * g[j][k] for j in range(n)] + [Fr(int(col == i + k))] for i in range(m) for k in range(r)]
        pivots = []
        for c in range(n):  # Gauss-Jordan elimination, exact
            pr = next((x for x in range(len(pivots), len(rows)) if rows[x][c] != 0), None)
            if pr is None:
                continue
            top = len(pivots)
            rows[top], rows[pr] = rows[pr], rows[top]
            rows[top] = [v / rows[top][c] for v in rows[top]]
            for x in range(len(rows)):
                if x != top and rows[x][c] != 0:
                    rows[x] = [a - rows[x][c] * b for a, b in zip(rows[x], rows[top])]
            pivots.append(c)
        if len(pivots) != n or any(any(v != 0 for v in row) for row in rows[n:]):
            raise ArithmeticError(f"no exact B^T for F({m}, {r}) on points {list(points)}")
        for i, c in enumerate(pivots):
            bt[c][col] = rows[i][n]
    return bt, g, at


for _m, _points in POINTS.items():
    _MATRICES[_m] = toom_cook(_m, 3, _points)

TILES = tuple(_MATRICES)
"""The output tile sizes m implemented: F(2x2, 3x3), F(4x4, 3x3), F(5x5, 3x3) and F(6x6, 3x3)."""


def matrices(m: int, dtype: torch.dtype = torch.float64, device=None) -> tuple[torch.Tensor, ...]:
    """``(BT, G, AT)`` of F(m x m, 3 x 3) as tensors: BT (a x a), G (a x 3), AT (m x a), a = m + 2."""
    if m not in _MATRICES:
        raise ValueError(f"F({m}x{m}, 3x3) is not implemented; m must be one of {TILES}")
    return tuple(torch.tensor([[float(v) for v in row] for row in mat], dtype=dtype, device=device)
                 for mat in _MATRICES[m])


def applies(problem: ConvProblem) -> str | None:
    """None when Winograd F(m, 3) computes ``problem``; else why not."""
    if (problem.r, problem.s) != (3, 3):
        return f"filter {problem.r}x{problem.s} is not 3x3"
    if tuple(problem.stride) != (1, 1) or tuple(problem.dilation) != (1, 1):
        return "stride and dilation must be 1"
    if problem.groups != 1:
        return "groups must be 1"
    return None


MAX_PHASE_STRIDE = 8
"""The largest stride the non-fused family runs through its polyphase components (:func:`polyphase_applies`)."""
PHASE_INFLATION = 2.0
"""A stride-s problem qualifies for the polyphase form when its 3s x 3s zero-padded filter has at most this many
times the real taps (9 s^2 <= PHASE_INFLATION * R * S): AlexNet's conv1, 11x11 at stride 4, pads 121 taps to
144 (1.19x), which F(4x4, 3x3)'s 4x fewer products repay; a 3x3 filter at stride 2 would pad 9 taps to 36, eating
all of F(4x4)'s saving (the tuner then spends no evaluations on it)."""


def polyphase_applies(problem: ConvProblem) -> str | None:
    """None when the non-fused Winograd family (``kernels.winograd_gemm``) computes ``problem``: a 3x3 stride-1
    problem (:func:`applies`), or a stride-s one (s > 1 on both axes, dilation 1, groups 1, R and S at most 3s,
    :data:`PHASE_INFLATION`) as the stride-1 3x3 convolution of its s x s polyphase components
    (:func:`polyphase`); else why not.

    >>> polyphase_applies(ConvProblem(n=1, c=3, h=224, w=224, k=64, r=11, s=11, stride=(4, 4), padding=(2, 2)))
    >>> polyphase_applies(ConvProblem(n=1, c=3, h=224, w=224, k=64, r=3, s=3, stride=(2, 2), padding=(1, 1)))
    'the 6x6 polyphase filter would be 4.0x the 3x3 real taps (more than 2.0x)'
    """
    sh, sw = problem.stride
    if (sh, sw) == (1, 1):
        return applies(problem)
    if sh != sw:
        return f"strides {sh} and {sw} differ"
    if tuple(problem.dilation) != (1, 1):
        return "dilation must be 1"
    if problem.groups != 1:
        return "groups must be 1"
    if sh > MAX_PHASE_STRIDE:
        return f"stride {sh} is above {MAX_PHASE_STRIDE}"
    if max(problem.r, problem.s) > 3 * sh:
        return f"filter {problem.r}x{problem.s} is larger than 3s x 3s = {3 * sh}x{3 * sh}"
    inflation = 9 * sh * sh / (problem.r * problem.s)
    if inflation > PHASE_INFLATION:
        return (f"the {3 * sh}x{3 * sh} polyphase filter would be {inflation:.1f}x the {problem.r}x{problem.s} real "
                f"taps (more than {PHASE_INFLATION}x)")
    return None


def phase_stride(problem: ConvProblem) -> int:
    """s of the polyphase form: the problem's stride (1 for a plain 3x3 problem)."""
    return problem.stride[0]


def polyphase(x: torch.Tensor, w: torch.Tensor, stride: int, padding: tuple[int, int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x', w')`` with ``F.conv2d(x', w') == F.conv2d(x, w, stride=s, padding=padding)`` (stride 1, no padding
    on the right): the s x s polyphase components of the padded input as C s^2 channels, channel
    ``c' = (c*s + ph)*s + pw`` holding ``x_padded[c][s*h + ph][s*w + pw]`` (P+2 x Q+2 of them; rows past the
    padded input are zeros), and the filter's taps ``w[k][c][s*i + ph][s*j + pw]`` as 3x3 filters over the same
    channels (zero past R and S). This is the index map csrc/kernels/winograd_gemm.cuh's stages 0 and 1 use.

    >>> x, w = torch.randn(2, 3, 23, 21, dtype=torch.float64), torch.randn(5, 3, 11, 10, dtype=torch.float64)
    >>> xp, wp = polyphase(x, w, 4, (2, 1))
    >>> tuple(xp.shape), tuple(wp.shape)
    ((2, 48, 7, 6), (5, 48, 3, 3))
    >>> bool(torch.allclose(F.conv2d(xp, wp), F.conv2d(x, w, stride=4, padding=(2, 1))))
    True
    """
    s = stride
    n, c, h, wd = x.shape
    k, _, r, sk = w.shape
    if max(r, sk) > 3 * s:
        raise ValueError(f"a {r}x{sk} filter does not fit the 3x3 polyphase form at stride {s} (needs <= {3 * s})")
    p = (h + 2 * padding[0] - r) // s + 1
    q = (wd + 2 * padding[1] - sk) // s + 1
    hp, wp = s * (p + 2), s * (q + 2)  # rows and columns the polyphase 3x3 windows read (F.pad crops if fewer)
    xs = F.pad(x, (padding[1], wp - wd - padding[1], padding[0], hp - h - padding[0]))
    xs = xs.reshape(n, c, p + 2, s, q + 2, s).permute(0, 1, 3, 5, 2, 4).reshape(n, c * s * s, p + 2, q + 2)
    ws = F.pad(w, (0, 3 * s - sk, 0, 3 * s - r))
    ws = ws.reshape(k, c, 3, s, 3, s).permute(0, 1, 3, 5, 2, 4).reshape(k, c * s * s, 3, 3)
    return xs.contiguous(), ws.contiguous()


def multiplies(problem: ConvProblem, m: int) -> int:
    """Elementwise products of the Winograd domain: (m+2)^2 per (output tile, K, C); C s^2 channels at stride s
    (the polyphase form)."""
    return (m + 2) ** 2 * problem.tiles(m) * problem.k * problem.c * phase_stride(problem) ** 2


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) rounded to TF32, 10 explicit mantissa bits, to nearest with ties away from zero: the operand
    a tensor-core TF32 product sees after ``cvt.rna.tf32.f32``, as float32. Relative change at most 2^-11.

    >>> tf32_round(torch.tensor([1 + 2**-11, 1 + 2**-12, -(1 + 2**-11), float("nan"), float("inf")])).tolist()
    [1.0009765625, 1.0, -1.0009765625, nan, inf]
    """
    t = t.to(torch.float32).contiguous()
    bits = t.view(torch.int32)
    sign = bits & -(2**31)
    magnitude = ((bits & 0x7FFFFFFF) + 0x1000) & -0x2000  # half an ulp of TF32 up, then the 13 low bits cleared
    return torch.where(torch.isnan(t), t, (sign | magnitude).view(torch.float32))  # (the carry would end a NaN)


def tf32_operands_conv2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride=1, padding=0,
                         dilation=1) -> torch.Tensor:
    """The float64 direct convolution of ``x`` and ``w`` rounded to TF32 (:func:`tf32_round`), the bias as it is:
    what a convolution of one TF32 product per multiply and fp32 sums computes, but for its summation error."""
    return F.conv2d(tf32_round(x).double(), tf32_round(w).double(), None if bias is None else bias.double(), stride,
                    padding, dilation)


def conv2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, padding: tuple[int, int], m: int,
           stride: int = 1, tf32: bool = False, products: torch.dtype | None = None) -> torch.Tensor:
    """Stride-1 3x3 convolution by Winograd F(m x m, 3 x 3), computed in ``x``'s dtype (all transforms and
    the elementwise products included), NCHW in, NKPQ out. The reference the GPU kernels are checked
    against, and what :func:`fp32_error` measures. ``stride`` s > 1: the convolution of an up to 3s x 3s
    filter at stride s, through its :func:`polyphase` components (as the non-fused family computes it).
    ``tf32``: the Winograd-domain products take TF32-rounded operands (:func:`tf32_round`) and sum in float32, the
    transforms stay float32 (``x`` must be float32): a tensor-core TF32 product's arithmetic. ``products``
    (torch.bfloat16 or torch.float16): the same with the Winograd-domain operands rounded to that dtype (to nearest
    even, as ``cvt.rn`` does) instead: a 16-bit tensor-core product's arithmetic."""
    if stride > 1:
        x, w = polyphase(x, w, stride, padding)
        padding = (0, 0)
    bt, g, at = matrices(m, x.dtype, x.device)
    a = m + 2
    n, c, h, wd = x.shape
    k = w.shape[0]
    p, q = h + 2 * padding[0] - 2, wd + 2 * padding[1] - 2
    th, tw = -(-p // m), -(-q // m)
    # pad so that th x tw overlapping a x a tiles (stride m) fit: rows beyond the output read zeros
    xp = F.pad(x, (padding[1], tw * m + 2 - wd - padding[1], padding[0], th * m + 2 - h - padding[0]))
    d = xp.unfold(2, a, m).unfold(3, a, m)                       # N, C, th, tw, a, a
    v = torch.einsum("ij,nctujl,lk->nctuik", bt, d, bt.T)          # B^T d B
    u = torch.einsum("ij,kcjl,lm->kcim", g, w, g.T)                # G g G^T: K, C, a, a
    if tf32:
        u, v = tf32_round(u), tf32_round(v)
    elif products is not None:
        u, v = u.to(products).to(x.dtype), v.to(products).to(x.dtype)
    mm = torch.einsum("kcij,nctuij->nktuij", u, v)                 # sum over C, per Winograd point
    y = torch.einsum("ij,nktujl,lm->nktuim", at, mm, at.T)         # A^T M A: N, K, th, tw, m, m
    y = y.permute(0, 1, 2, 4, 3, 5).reshape(n, k, th * m, tw * m)[:, :, :p, :q]
    if bias is not None:
        y = y + bias.view(1, -1, 1, 1)
    return y.contiguous()


def _error_data(problem: ConvProblem, seed: int, dtype: torch.dtype | None = None) -> tuple:
    """The data the error probes measure on (unit-normal input, weights scaled by 1/sqrt(fan-in), a unit-normal
    bias, as the tuner's check uses), float32, each tensor rounded to ``dtype`` first when given; with the Winograd
    padding, the phase stride and the float64 direct convolution of those values: (x, w, b, pad, s, ref)."""
    why = polyphase_applies(problem)
    if why is not None:
        raise ValueError(f"Winograd does not apply to {problem.short()}: {why}")
    g = torch.Generator().manual_seed(seed)
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype).float())
    x = cast(torch.randn(problem.n, problem.c, problem.h, problem.w, generator=g))
    fan_in = problem.c * problem.r * problem.s
    w = cast(torch.randn(problem.k, problem.c, problem.r, problem.s, generator=g) / fan_in ** 0.5)
    b = cast(torch.randn(problem.k, generator=g)) if problem.bias else None
    pad, s = tuple(problem.padding), phase_stride(problem)
    ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), s, pad)
    return x, w, b, pad, s, ref


def fp32_error(problem: ConvProblem, m: int, seed: int = 0, tf32: bool = False) -> dict[str, float]:
    """Error of F(m x m, 3 x 3) computed in float32 against a float64 direct convolution, on realistic data
    (unit-normal input, weights scaled by 1/sqrt(fan-in), as the tuner's check uses), with the error of a
    float32 direct convolution (``F.conv2d``) on the same data beside it. Errors are relative to the
    reference: ``max`` = max |err| / max |ref|, ``norm`` = ||err|| / ||ref|| (the tuner's check). ``tf32``: both
    with TF32 products (the Winograd-domain operands rounded, see :func:`conv2d`; the direct convolution's input
    and weights rounded, as a TF32 implicit GEMM such as cuDNN's rounds them)."""
    x, w, b, pad, s, ref = _error_data(problem, seed)

    def err(y: torch.Tensor) -> tuple[float, float]:
        e = y.double() - ref
        return float(e.abs().max() / ref.abs().max()), float(e.norm() / ref.norm())

    wino_max, wino_norm = err(conv2d(x, w, b, pad, m, s, tf32=tf32))
    direct_max, direct_norm = err(F.conv2d(tf32_round(x), tf32_round(w), b, s, pad) if tf32 else F.conv2d(x, w, b, s, pad))
    return {"winograd_max": wino_max, "winograd_norm": wino_norm, "direct_max": direct_max,
            "direct_norm": direct_norm}


def h16_error(problem: ConvProblem, m: int, dtype: torch.dtype, seed: int = 0) -> dict[str, float]:
    """Error of F(m x m, 3 x 3) on ``dtype`` (torch.bfloat16 or torch.float16) tensors against a float64 direct
    convolution of the same 16-bit values, on :func:`fp32_error`'s data rounded to ``dtype``: with 16-bit products
    (``winograd16_*``: the transforms in float32, the Winograd-domain operands rounded to ``dtype``, products summed
    in float32, the bias added in float32 and the output rounded once to ``dtype``) and with float32 products
    (``winograd32_*``, what winograd_gemm computes for 16-bit tensors), beside the direct convolution summed in
    float32 and rounded once (``direct_*``: what the 16-bit implicit GEMMs compute; on the H200 cuDNN's 16-bit
    error on AlexNet's layers is 1.28-1.30x it, benchmarks/results/bench_layers_h200_{bf16,fp16}_nhwc.md).
    ``max`` = max |err| / max |ref|, ``norm`` = ||err|| / ||ref||."""
    x, w, b, pad, s, ref = _error_data(problem, seed, dtype)

    def err(y: torch.Tensor) -> tuple[float, float]:
        e = y.to(dtype).double() - ref  # (the one rounding to the output dtype)
        return float(e.abs().max() / ref.abs().max()), float(e.norm() / ref.norm())

    out = {}
    for key, y in (("winograd16", conv2d(x, w, b, pad, m, s, products=dtype)),
                   ("winograd32", conv2d(x, w, b, pad, m, s)), ("direct", F.conv2d(x, w, b, s, pad))):
        out[f"{key}_max"], out[f"{key}_norm"] = err(y)
    return out


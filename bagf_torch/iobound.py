"""I/O lower bounds for convolution and a per-configuration global-memory traffic model (docs/architecture.md,
"The I/O lower bound"; docs/iobound.md has the derivation).

Everything is counted in *words* (one fp32 element = one word) of global-memory traffic:

* :func:`direct_lower_bound` and :func:`winograd_lower_bound` - lower bounds for a fast memory of ``M`` words;
* :func:`implicit_gemm_traffic` - the words the ``implicit_gemm`` kernel as written requests from global
  memory, in closed form, plus (on request) the distinct input words each block touches;
* :func:`implicit_gemm_tc_traffic` - the same for ``implicit_gemm_tc`` (cp.async tiles, split-K memset and
  atomics);
* :func:`winograd_traffic` - the same for the fused ``winograd`` kernel (A x A input patches with halo, 3x3
  filters, split over input channels);
* :func:`direct_traffic` - the same for the ``direct`` kernel (2-D output tiles, the input patch with its halo
  once per channel chunk, split over input channels);
* :func:`implicit_gemm_wgmma_traffic` and :func:`implicit_gemm_tma_tf32_traffic` - the same for the Hopper
  kernels (the TMA copies read only what lies inside the tensors; the TMA kernel's split-K partials and an NCHW
  plan's per-call copies in ``Traffic.workspace_*``);
* :func:`winograd_gemm_traffic` - the same for the non-fused ``winograd_gemm`` pipeline (transform stages, a
  batched SGEMM through cuBLAS modelled with an assumed block tile, :data:`GEMM_TILE`, and the inverse
  transform; the U, V, M workspaces in ``Traffic.workspace_*``);
* :func:`traffic` / :func:`fast_memory_words` - dispatch on the family (module or ``FAMILY`` name);
* :func:`prune` - bound-guided pruning of a family's search space: drop configurations whose
  modelled traffic is more than ``factor`` times the best modelled traffic for the problem. Measured on the
  H200 tc recording it is a weak predictor (split-K wins while adding traffic), so the tuner's
  ``BAGF_PRUNE_FACTOR`` is off by default (docs/iobound.md).

Each closed-form traffic model equals, exactly, a replay of its kernel's loop nest in Python that counts
words element by element (``brute_force_*`` in tests/iobound_oracles.py, small shapes only; tests/test_iobound.py
compares them).

>>> from bagf_torch.problem import ConvProblem
>>> from bagf_torch.kernels import implicit_gemm as ig
>>> p = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
>>> t = implicit_gemm_traffic(p, ig.DEFAULT)
>>> t.total >= direct_lower_bound(p, t.fast_memory_words)
True

Pure Python + numpy; importing this module imports torch only through ``ConvProblem``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Iterable, Mapping

import numpy as np

from .problem import ConvProblem

__all__ = [
    "Traffic", "used_input_words", "compulsory_words", "effective_stride", "direct_lower_bound",
    "direct_tile_reads_per_mac", "winograd_lower_bound", "implicit_gemm_fast_memory_words",
    "implicit_gemm_traffic", "implicit_gemm_tc_fast_memory_words", "implicit_gemm_tc_traffic",
    "winograd_fast_memory_words", "winograd_traffic", "direct_fast_memory_words", "direct_traffic",
    "GEMM_TILE", "winograd_gemm_fast_memory_words", "winograd_gemm_traffic",
    "traffic", "fast_memory_words", "has_model", "prune",
]


# --------------------------------------------------------------------------------------------- helpers
def _valid_taps(out: int, stride: int, pad: int, dil: int, taps: int, size: int) -> list[np.ndarray]:
    """For each tap r, the boolean mask over output positions o whose input index o*stride - pad + r*dil lies
    in [0, size) (i.e. is not padding)."""
    o = np.arange(out)
    return [((o * stride - pad + r * dil) >= 0) & ((o * stride - pad + r * dil) < size) for r in range(taps)]


def _used_axis(out: int, stride: int, pad: int, dil: int, taps: int, size: int) -> int:
    """Distinct in-bounds input indices along one axis that some (output, tap) pair reads."""
    o = np.arange(out)[:, None]
    r = np.arange(taps)[None, :]
    idx = (o * stride - pad + r * dil).ravel()
    return int(np.unique(idx[(idx >= 0) & (idx < size)]).size)


def used_input_words(problem: ConvProblem) -> int:
    """Input elements read by at least one multiply (padding excluded; rows/columns that a large stride or
    the output cropping skips are excluded too, since no correct kernel has to load them)."""
    p, q = problem.out_hw
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    rows = _used_axis(p, sh, ph, dh, problem.r, problem.h)
    cols = _used_axis(q, sw, pw, dw, problem.s, problem.w)
    return problem.n * problem.c * rows * cols


def compulsory_words(problem: ConvProblem) -> dict[str, int]:
    """Words every kernel must move at least once: used input, weights, bias, output."""
    p, q = problem.out_hw
    return {
        "input": used_input_words(problem),
        "weight": problem.k * (problem.c // problem.groups) * problem.r * problem.s,
        "bias": problem.k if problem.bias else 0,
        "output": problem.n * problem.k * p * q,
    }


def effective_stride(stride: int, dil: int, taps: int) -> int:
    """Distinct input elements per output element along one axis, asymptotically, for a long run of outputs.

    docs/architecture.md uses ``u`` (valid when u <= R and dilation is 1). In general the indices o*u + r*d lie in the
    lattice gcd(u, d)*Z (at most u/gcd(u, d) new ones per output) and there are only ``taps`` of them per
    output, so the density is at most min(u / gcd(u, d), taps). E.g. u=4, R=3: 3 (not 4: a 3-wide window
    stepping by 4 skips a column); u=2, d=2: 1 (only even columns are ever read)."""
    return max(1, min(stride // math.gcd(stride, dil), taps))


# ----------------------------------------------------------------------------------------- lower bounds
def direct_tile_reads_per_mac(x: float, y: float, z: float, r: int, s: int, u: float = 1.0) -> float:
    """Global reads per MAC of the simple tile model: a tile of x*y output pixels of z output channels, per
    input channel, reads x*y*u^2 input words and z*R*S weight words for x*y*z*R*S MACs."""
    return (x * y * u * u + z * r * s) / (x * y * z * r * s)


def direct_lower_bound(problem: ConvProblem, fast_memory_words: float) -> float:
    """Lower bound on global-memory words moved by any direct convolution with ``fast_memory_words`` (M) words
    of fast memory.

    Exactly what is computed (eh, ew from :func:`effective_stride`; eh = ew = u for docs/architecture.md's case u <= R,
    dilation 1)::

        core  = 2 * MACs / sqrt(R*S*M / (eh*ew))         # reads of input + weights
        bound = max(core, |I_used| + |W| + |bias|) + |O|  # plus the output written once

    ``core`` is docs/architecture.md's ``2*MACs/sqrt(R*S*M/u^2)``: minimising :func:`direct_tile_reads_per_mac` under
    x*y*z = M gives x*y*u^2 = z*R*S and 2*u/sqrt(R*S*M) reads per MAC. It counts *reads* of input and
    weights only (the tile's outputs live in fast memory), so the output writes are added, not maxed.
    The compulsory reads are combined with ``max``, not a sum: the core term already counts every input
    and weight read, the compulsory ones included, so summing would double count and could exceed what
    a real kernel moves (the tests check the bound against every configuration's modelled traffic).

    Approximate where: the derivation assumes rectangular output tiles that fill fast memory with
    accumulators and ignores halos (which only add traffic), so it is a model bound, not a Hong-Kung proof
    for every schedule; for u > R or dilation > 1 the density ``e`` replaces ``u`` (see
    :func:`effective_stride`). Groups are handled through MACs (which uses C/groups).

    >>> p = ConvProblem(n=1, c=256, h=13, w=13, k=384, r=3, s=3, padding=(1, 1))
    >>> round(direct_lower_bound(p, 6160) / 1e6, 3)
    1.335
    """
    if fast_memory_words <= 0:
        raise ValueError(f"fast_memory_words must be positive, got {fast_memory_words}")
    eh = effective_stride(problem.stride[0], problem.dilation[0], problem.r)
    ew = effective_stride(problem.stride[1], problem.dilation[1], problem.s)
    core = 2.0 * problem.macs / math.sqrt(problem.r * problem.s * fast_memory_words / (eh * ew))
    comp = compulsory_words(problem)
    return max(core, comp["input"] + comp["weight"] + comp["bias"]) + comp["output"]


def winograd_lower_bound(problem: ConvProblem, m: int, r: int, fast_memory_words: float,
                         fused: bool = False) -> float:
    """Lower bound (the seed's composite model) on global words for Winograd F(m x m, r x r)::

        T     = N * ceil(P/m) * ceil(Q/m)                       # tiles
        core  = 2 * (m+r-1)^2 * K * C * T / sqrt(M)             # (m+r-1)^2 GEMMs, K x C by C x T
        bound = core + |I_used| + |W| + |bias| + |O|             # + transforms' compulsory traffic

    Here the terms are *summed*: following the seed's composite-algorithm theory the element-wise GEMMs read
    transformed operands (which the compulsory input/weight reads of the transforms do not cover), so the
    sub-computations' bounds add. Approximate where: a fully fused kernel that transforms in fast memory
    never stores the transformed operands, so this is a bound for the unfused (or seed-style) pipeline,
    not for every schedule; the Hong-Kung constant is taken as in the direct bound.
    Requires stride 1, dilation 1, groups 1 and an r x r kernel; or stride s > 1 on both axes and a kernel of at
    most rs x rs, the polyphase form (``winograd_math.polyphase``: C s^2 channels of r x r filters, zero past the
    real taps) with C s^2 in the core term and the original problem's compulsory words. That is a bound for
    the polyphase algorithm, not for the convolution: a schedule that skipped the zero taps could move less.

    ``fused=True`` is the bound for a kernel that transforms in fast memory (the ``winograd`` family): its
    only global reads are raw input and weights, each transformed word being made from about one raw word
    read, so the core term bounds its raw reads and the compulsory reads combine with ``max``, as in
    :func:`direct_lower_bound`: ``max(core, |I_used| + |W| + |bias|) + |O|``. Checked against the fused
    kernel's modelled traffic over its whole space (tests/test_iobound.py); the summed form exceeded it on
    few-tile problems (a one-tile problem moves exactly the compulsory words).

    >>> p = ConvProblem(n=1, c=256, h=13, w=13, k=384, r=3, s=3, padding=(1, 1))
    >>> winograd_lower_bound(p, 4, 3, 8192) > 0
    True
    """
    st = problem.stride[0]
    if problem.stride != (st, st) or problem.dilation != (1, 1) or problem.groups != 1:
        raise ValueError(f"Winograd F({m}x{m}, {r}x{r}) needs equal strides, dilation 1 and groups 1; got "
                         f"stride {problem.stride}, dilation {problem.dilation}, groups {problem.groups}")
    if (st == 1 and (problem.r, problem.s) != (r, r)) or max(problem.r, problem.s) > r * st:
        raise ValueError(f"Winograd F({m}x{m}, {r}x{r}) at stride {st} needs an {r}x{r} kernel (at stride 1) or one "
                         f"of at most {r * st}x{r * st} (polyphase); got {problem.r}x{problem.s}")
    if m < 1 or fast_memory_words <= 0:
        raise ValueError(f"need m >= 1 and fast_memory_words > 0; got m={m}, M={fast_memory_words}")
    tiles = problem.tiles(m)
    core = 2.0 * (m + r - 1) ** 2 * problem.k * problem.c * st * st * tiles / math.sqrt(fast_memory_words)
    comp = compulsory_words(problem)
    if fused:
        return max(core, comp["input"] + comp["weight"] + comp["bias"]) + comp["output"]
    return core + sum(comp.values())


# ---------------------------------------------------------------------- implicit_gemm: traffic model
@dataclass(frozen=True)
class Traffic:
    """Global-memory words one launch of a kernel configuration moves (1 word = 4 bytes for fp32).

    ``words_read_*`` are *requests* as the kernel is written: every load instruction's elements count, so
    an input element gathered by several im2col columns (overlapping halos) or by several blocks counts
    each time (no L1/L2 reuse). ``words_read_input_unique`` is the clearly separate variant that models
    perfect reuse within a block (its distinct input elements, summed over blocks); None unless asked for.
    ``fast_memory_words`` is per block: shared memory words (both stages if DB) + accumulator registers.
    ``grid`` is the launch grid (x, y[, SPLIT]); for a pipeline of several launches (``winograd_gemm``), the
    block count of each launch in order.
    """

    words_read_input: int
    words_read_weight: int
    words_read_bias: int
    words_written: int
    fast_memory_words: int
    blocks: int
    grid: tuple[int, ...]
    words_read_input_unique: int | None = None
    words_read_bias_unique: int = 0
    words_read_output: int = 0
    """Split-K: the read half of the atomic read-modify-writes (one per atomicAdd); 0 without split-K."""
    words_memset: int = 0
    """Split-K: the zeroing of the output before the launch (also included in ``words_written``)."""
    workspace_written: tuple[tuple[str, int], ...] = ()
    """Words stored to global workspaces, by name: a non-fused pipeline's between its launches (``winograd_gemm``:
    ``(("U", words), ("V", words), ("M", words))``), ``implicit_gemm_tma_tf32``'s split-K partials and counters
    and an NCHW plan's per-call copies; () for kernels that keep everything on chip."""
    workspace_read: tuple[tuple[str, int], ...] = ()
    """The loads from those workspaces (the GEMM's U and V operand tiles, the inverse transform's M; the split-K
    partials the finishing slice adds; the originals the per-call copies read), same form."""

    @property
    def words_written_workspace(self) -> int:
        """Words stored to the workspaces, all of them (0 for the fused kernels)."""
        return sum(words for _, words in self.workspace_written)

    @property
    def words_read_workspace(self) -> int:
        """Words loaded from the workspaces, all of them (0 for the fused kernels)."""
        return sum(words for _, words in self.workspace_read)

    @property
    def total(self) -> int:
        """Requested words: input + weight + bias reads, output writes, split-K's read-modify-write reads, and a
        non-fused pipeline's workspace writes and reads."""
        return (self.words_read_input + self.words_read_weight + self.words_read_bias + self.words_written
                + self.words_read_output + self.words_written_workspace + self.words_read_workspace)

    @property
    def total_unique(self) -> int:
        """Words with perfect reuse inside a block: distinct input and weight/bias words per block + writes."""
        if self.words_read_input_unique is None:
            raise ValueError("words_read_input_unique was not computed: pass unique=True")
        # Each block already reads each weight of its panel once; its bias words are read BN/TN times.
        return (self.words_read_input_unique + self.words_read_weight + self.words_read_bias_unique
                + self.words_written + self.words_read_output + self.words_written_workspace
                + self.words_read_workspace)


def implicit_gemm_fast_memory_words(config: Mapping[str, int]) -> int:
    """Shared memory words (``STAGES*BK*(BM+1+BN)``) + accumulator registers (``TM*TN*threads = BM*BN``)."""
    stages = 2 if config["DB"] else 1
    return stages * config["BK"] * (config["BM"] + 1 + config["BN"]) + config["BM"] * config["BN"]


def _geometry(config: Mapping[str, int]) -> dict[str, int]:
    t = (config["BM"] // config["TM"]) * (config["BN"] // config["TN"])
    step = t // config["BN"]  # B_ROW_STEP; validity requires t % BN == 0
    b_loads = -(-config["BK"] // step)
    a_vecs = config["BM"] * config["BK"] // config["VEC"]
    return {"T": t, "TX": config["BN"] // config["TN"], "TY": config["BM"] // config["TM"], "STEP": step,
            "B_LOADS": b_loads, "L": b_loads * step, "A_VECS": a_vecs, "A_LOADS": -(-a_vecs // t)}


def _row_load_counts(crs: int, bk: int, rows_loaded: int) -> np.ndarray:
    """How many times the B-tile loader requests im2col row kk, for kk in [0, CRS).

    K-step t loads rows t*BK + j for j < L = B_LOADS*B_ROW_STEP, not j < BK: when the thread count is
    larger than BK*BN the extra threads gather rows of the *next* K-step too and only the store is skipped
    (``row < BK``), so those rows are requested twice. Count = #{t : 0 <= kk - t*BK < L}."""
    kk = np.arange(crs)
    hi = kk // bk
    lo = np.maximum(0, -(-(kk - rows_loaded + 1) // bk))
    return hi - lo + 1


def _check_problem(problem: ConvProblem) -> None:
    if problem.groups != 1:
        raise ValueError(f"implicit_gemm handles groups=1 only, got groups={problem.groups}")


def implicit_gemm_traffic(problem: ConvProblem, config: Mapping[str, int], unique: bool = False) -> Traffic:
    """Closed-form global-memory traffic of ``implicit_gemm`` (csrc/kernels/implicit_gemm.cuh) for one problem.

    Grid ceil(NPQ/BN) x ceil(K/BM). Per block, as the kernel is written:

    * weights: the BM x CRS panel, rows clipped at K (bounds-checked loads; the float4 path loads the same
      elements) -> total ``ceil(NPQ/BN) * K * CRS``;
    * input: the CRS x BN im2col panel gathered from the input, one load per (row, column) whose tap is not
      padding and whose pixel exists; rows beyond a K-step that the loader over-fetches count again (see
      ``_row_load_counts``) -> total ``ceil(K/BM) * N * sum_rs rowloads(r,s) * |P_r| * |Q_s|`` where
      ``|P_r|`` counts output rows whose tap r lands inside the image;
    * bias: each of the BN/TN threads along pixels loads its channels' bias -> ``ceil(NPQ/BN) * K * BN/TN``;
    * writes: the clipped BM x BN output tile -> ``K * N*P*Q`` in total.

    ``unique=True`` also computes ``words_read_input_unique``: per block, the distinct input elements its
    panel gathers (C times the union of its pixels' in-bounds receptive fields), summed over blocks - the
    traffic if L1/shared memory caught every re-read inside a block, but nothing across blocks.
    """
    _check_problem(problem)
    g = _geometry(config)
    p, q = problem.out_hw
    rs = problem.r * problem.s
    crs = problem.c * rs
    npq = problem.n * p * q
    gx, gy = -(-npq // config["BN"]), -(-problem.k // config["BM"])
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    rows_ok = np.array([m.sum() for m in _valid_taps(p, sh, ph, dh, problem.r, problem.h)], dtype=np.int64)
    cols_ok = np.array([m.sum() for m in _valid_taps(q, sw, pw, dw, problem.s, problem.w)], dtype=np.int64)
    loads = _row_load_counts(crs, config["BK"], g["L"]).reshape(problem.c, problem.r, problem.s).sum(axis=0)
    per_m_block = problem.n * int((loads * rows_ok[:, None] * cols_ok[None, :]).sum())
    unique_input = _unique_input_words(problem, config["BN"]) * gy if unique else None
    return Traffic(
        words_read_input=gy * per_m_block,
        words_read_weight=gx * problem.k * crs,
        words_read_bias=gx * problem.k * g["TX"] if problem.bias else 0,
        words_written=problem.k * npq,
        fast_memory_words=implicit_gemm_fast_memory_words(config),
        blocks=gx * gy,
        grid=(gx, gy),
        words_read_input_unique=unique_input,
        words_read_bias_unique=gx * problem.k if problem.bias else 0,
    )


def _unique_input_words(problem: ConvProblem, bn: int) -> int:
    """Sum over pixel blocks [n0, n0+BN) of C * |distinct in-bounds (image, ih, iw) they read|. A block's
    pixels split into per-image pq ranges; images are disjoint, so each range's footprint is counted on its
    own and memoised by (start, stop) (blocks repeat the same few ranges)."""
    p, q = problem.out_hw
    pq, npq = p * q, problem.n * p * q
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    hh = np.arange(problem.r) * dh
    ww = np.arange(problem.s) * dw

    @lru_cache(maxsize=None)
    def footprint(a: int, b: int) -> int:
        mask = np.zeros((problem.h, problem.w), dtype=bool)
        for oh in range(a // q, (b - 1) // q + 1):
            lo, hi = max(a, oh * q) - oh * q, min(b, (oh + 1) * q) - oh * q  # ow in [lo, hi)
            ih = oh * sh - ph + hh
            iw = (np.arange(lo, hi)[:, None] * sw - pw + ww[None, :]).ravel()
            ih = ih[(ih >= 0) & (ih < problem.h)]
            iw = np.unique(iw[(iw >= 0) & (iw < problem.w)])
            mask[np.ix_(ih, iw)] = True
        return int(mask.sum())

    total = 0
    for n0 in range(0, npq, bn):
        n1 = min(n0 + bn, npq)
        while n0 < n1:
            img_end = (n0 // pq + 1) * pq
            stop = min(n1, img_end)
            total += footprint(n0 - (n0 // pq) * pq, stop - (n0 // pq) * pq)
            n0 = stop
    return problem.c * total


# ------------------------------------------------------------------- implicit_gemm_tc: traffic model
def _split_output(out: int, split: int) -> dict[str, int]:
    """The output's words for a kernel whose ``split`` slices add into it (``Traffic`` fields): SPLIT = 1,
    ``out`` stores; SPLIT > 1, the host's memset of ``out`` words + ``split * out`` atomicAdds (every slice,
    empty ones too), each counted as one read and one write."""
    if split == 1:
        return {"words_written": out, "words_read_output": 0, "words_memset": 0}
    return {"words_written": out + split * out, "words_read_output": split * out, "words_memset": out}


def implicit_gemm_tc_fast_memory_words(config: Mapping[str, int]) -> int:
    """Shared memory words as allocated, padding included (``STAGES*(BM*(BK+4) + BK*(BN+8))``) + the
    accumulator registers (``MI*NI*4`` per thread x threads = ``BM*BN``). Fragments and addressing registers
    are not counted; counting the padding makes ``M`` larger, so the bound at ``M`` is lower (conservative)."""
    return (config["STAGES"] * (config["BM"] * (config["BK"] + 4) + config["BK"] * (config["BN"] + 8))
            + config["BM"] * config["BN"])


def _tc_geometry(config: Mapping[str, int]) -> dict[str, int]:
    t = 32 * config["WM"] * config["WN"]
    step = t // config["BN"]  # B_ROW_STEP; validity requires t % BN == 0
    a_vecs = config["BM"] * config["BK"] // 4
    return {"T": t, "STEP": step, "B_LOADS": -(-config["BK"] // step), "A_VECS": a_vecs,
            "A_LOADS": -(-a_vecs // t), "WTM": config["BM"] // config["WM"], "WTN": config["BN"] // config["WN"]}


def implicit_gemm_tc_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Closed-form global-memory traffic of ``implicit_gemm_tc`` (csrc/kernels/implicit_gemm_tc.cuh).

    Grid ceil(NPQ/BN) x ceil(K/BM) x SPLIT; slice z reduces K-tiles [z*ceil(T/SPLIT), ...) of the
    T = ceil(CRS/BK) tiles (trailing slices may be empty). Counted as the kernel is written, every request
    once, no cache reuse:

    * weights: each K-tile copies the BM x BK panel, bounds-checked (float4 copies when CRS % 4 == 0, else
      scalar ones; out-of-range copies have src-size 0 and read nothing); over the slices of one block column
      every k in [0, CRS) is covered once -> ``ceil(NPQ/BN) * K * CRS`` whatever SPLIT is;
    * input: the B tile gathers only rows < BK (the loader skips the over-fetched rows, unlike
      ``implicit_gemm``), one word per (im2col row, pixel) whose tap is inside the image; padding and
      tails are zero-filled copies with src-size 0 and are *not* counted (they read nothing) ->
      ``ceil(K/BM) * N * C * sum_rs |P_r| * |Q_s|``;
    * bias: one ``__ldg`` per output element in slice 0 (no per-thread reuse) -> ``K * NPQ``;
    * output: SPLIT = 1: ``K * NPQ`` stores. SPLIT > 1: the host zeroes the output (``K * NPQ`` writes,
      ``words_memset``) and every slice, empty ones too, atomically adds its partial sum to every element
      of its tile: ``SPLIT * K * NPQ`` read-modify-writes, counted as one read (``words_read_output``) and
      one write each. (The SM sends one word per ``RED``; the read-modify-write happens in L2. Counting it
      twice is the memory-side view; the SM-side view would count ``SPLIT * K * NPQ`` words.)
    """
    _check_problem(problem)
    p, q = problem.out_hw
    crs = problem.c * problem.r * problem.s
    npq = problem.n * p * q
    split = config["SPLIT"]
    gx, gy = -(-npq // config["BN"]), -(-problem.k // config["BM"])
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    rows_ok = np.array([m.sum() for m in _valid_taps(p, sh, ph, dh, problem.r, problem.h)], dtype=np.int64)
    cols_ok = np.array([m.sum() for m in _valid_taps(q, sw, pw, dw, problem.s, problem.w)], dtype=np.int64)
    out = problem.k * npq
    return Traffic(
        words_read_input=gy * problem.n * problem.c * int(rows_ok.sum() * cols_ok.sum()),
        words_read_weight=gx * problem.k * crs,
        words_read_bias=out if problem.bias else 0,
        fast_memory_words=implicit_gemm_tc_fast_memory_words(config),
        blocks=gx * gy * split,
        grid=(gx, gy, split),
        **_split_output(out, split),
    )


def implicit_gemm_wgmma_fast_memory_words(config: Mapping[str, int]) -> int:
    """Shared memory words as allocated (``STAGES*(BM*32 + 32*(BN+8))``, BM = WN*NB, BN = 64*WG) + the accumulator
    registers (``BM*BN`` per block). Fragments and addressing registers are not counted (conservative, as for
    ``implicit_gemm_tc``)."""
    bm, bn = config["WN"] * config["NB"], 64 * config["WG"]
    return config["STAGES"] * (bm * 32 + 32 * (bn + 8)) + bm * bn


def implicit_gemm_wgmma_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Closed-form global-memory traffic of ``implicit_gemm_wgmma`` (csrc/kernels/implicit_gemm_wgmma.cuh).

    Grid ceil(NPQ/BN) x ceil(K/BM) x SPLIT, BM = WN*NB, BN = 64*WG, k tiles of 32. Its loads are
    ``implicit_gemm_tc``'s (see :func:`implicit_gemm_tc_traffic`): the weights' BM x 32 panel per k tile,
    bounds-checked (``ceil(NPQ/BN) * K * CRS``), and one word per (im2col row, pixel) whose tap is in the image
    (``ceil(K/BM) * N * C * sum_rs |P_r| * |Q_s|``); the output as stores or split-K atomics. The bias differs:
    the epilogue loads it once per thread and channel for the thread's two pixels, whether or not they lie past
    N*P*Q, so a block of slice 0 reads its K-clipped channels BN/2 times -> ``ceil(NPQ/BN) * K * BN/2``.
    """
    _check_problem(problem)
    p, q = problem.out_hw
    crs = problem.c * problem.r * problem.s
    npq = problem.n * p * q
    split = config["SPLIT"]
    bm, bn = config["WN"] * config["NB"], 64 * config["WG"]
    gx, gy = -(-npq // bn), -(-problem.k // bm)
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    rows_ok = np.array([m.sum() for m in _valid_taps(p, sh, ph, dh, problem.r, problem.h)], dtype=np.int64)
    cols_ok = np.array([m.sum() for m in _valid_taps(q, sw, pw, dw, problem.s, problem.w)], dtype=np.int64)
    return Traffic(
        words_read_input=gy * problem.n * problem.c * int(rows_ok.sum() * cols_ok.sum()),
        words_read_weight=gx * problem.k * crs,
        words_read_bias=gx * problem.k * (bn // 2) if problem.bias else 0,
        fast_memory_words=implicit_gemm_wgmma_fast_memory_words(config),
        blocks=gx * gy * split,
        grid=(gx, gy, split),
        **_split_output(problem.k * npq, split),
    )


def implicit_gemm_tma_tf32_fast_memory_words(config: Mapping[str, int]) -> int:
    """The ring, ``STAGES * (BN + BM)`` 128-byte rows of 32 words (the 1024 bytes the kernel allocates to align it
    are not counted), + the accumulator registers (``BM * BN`` over the consumer threads)."""
    bm, bn = config["WN"], 64 * config["MI"] * config["WG"]
    return config["STAGES"] * (bn + bm) * 32 + bm * bn


def implicit_gemm_tma_tf32_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Closed-form global-memory traffic of ``implicit_gemm_tma_tf32`` (csrc/kernels/implicit_gemm_tma_h16.cuh with
    DT = 2; fp32 words).

    Grid ceil(NPQ/BN) x ceil(K/BM) x SPLIT, BM = WN, BN = 64*MI*WG. The TMA copies read only what lies inside the
    tensors (the maps fill the rest with zeros): per block and k tile (a tap and 32 channels), the in-image taps of
    its BN pixels, so the input is ``ceil(K/BM) * N * C * sum_rs |P_r| * |Q_s|`` words as ``implicit_gemm_wgmma``'s,
    and the weight's BM x 32 panel within K and C, ``ceil(NPQ/BN) * K * CRS``. The epilogue reads the bias once per
    output element (the finishing slice only; an NCHW plan's staged epilogue otherwise, below) and writes the output
    once. With SPLIT > 1 the slices hand over in order through a workspace: every slice writes its whole BM x BN
    partial tile, the last to arrive reads all SPLIT of them, and each tile's counter is zeroed by the host and
    incremented once per slice (an atomic: a read and a write); split-K in clusters (CR = 1) hands over in
    distributed shared memory, no global traffic. With stream-K (SK = 1) the grid is the G blocks of
    the host's launch (here the H200's, as ``implicit_gemm_tma_h16.stream_k_blocks`` estimates it), which share the
    tiles' k tiles evenly: each k tile is still copied once, and a tile whose k tiles lie in the shares of several
    blocks is handed over as split-K's slices are, one partial tile and one atomic per sharing block (every tile's
    counter zeroed). Persistent blocks (SK = 2): SK = 0's traffic (every tile whole, once) on the grid of the host's
    launch. An NCHW plan adds the per-call copies, counted as workspaces: the input to
    channels_last (N*C*H*W words read and written, by the plan's own kernel) and the weight to KRSC by the host
    (K*CRS; a channels_last plan is taken to get a channels_last weight, which is read in place). An NCHW plan
    without stream-K stages its stores through shared memory: each consumer thread reads the bias of its two channels of
    every 8 once per tile, so each channel of a tile is read by the 32 WG threads that hold it (``ceil(NPQ/BN) * K *
    32 * WG``)."""
    _check_problem(problem)
    p, q = problem.out_hw
    crs = problem.c * problem.r * problem.s
    npq = problem.n * p * q
    split = config["SPLIT"]
    bm, bn = config["WN"], 64 * config["MI"] * config["WG"]
    gx, gy = -(-npq // bn), -(-problem.k // bm)
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    rows_ok = np.array([m.sum() for m in _valid_taps(p, sh, ph, dh, problem.r, problem.h)], dtype=np.int64)
    cols_ok = np.array([m.sum() for m in _valid_taps(q, sw, pw, dw, problem.s, problem.w)], dtype=np.int64)
    out = problem.k * npq
    staged = not config["NHWC"] and config.get("SK", 0) != 1  # (stream-K stores from the registers)
    written, read = [], []
    if not config["NHWC"]:
        x_words, w_words = problem.n * problem.c * problem.h * problem.w, problem.k * crs
        written += [("x channels_last", x_words), ("w KRSC", w_words)]
        read += [("x channels_last", x_words), ("w KRSC", w_words)]
    tiles = gx * gy
    grid = (gx, gy, split)
    from .kernels import implicit_gemm_tma_tf32 as tma_tf32  # (the host's grid rules)

    if config.get("SK", 0) == 2:  # persistent blocks: SK = 0's copies and stores, whole tiles in turn
        grid = (tma_tf32.persistent_blocks(config, problem), 1, 1)
    elif config.get("SK", 0):
        num_k = tma_tf32.k_tiles(problem)
        work, blocks = tiles * num_k, tma_tf32.stream_k_blocks(config, problem)
        first = np.arange(tiles, dtype=np.int64) * num_k  # each tile's first k tile; its owners by sk_owner
        parts = ((first + num_k) * blocks - 1) // work - ((first + 1) * blocks - 1) // work + 1
        shared = int(parts[parts > 1].sum())
        written += [("stream-K partials", shared * bm * bn), ("stream-K counters", tiles + shared)]
        read += [("stream-K partials", shared * bm * bn), ("stream-K counters", shared)]
        grid = (blocks, 1, 1)
    elif split > 1 and not config.get("CR", 0):  # (in clusters the slices hand over in shared memory)
        written += [("split-K partials", split * tiles * bm * bn), ("split-K counters", tiles + split * tiles)]
        read += [("split-K partials", split * tiles * bm * bn), ("split-K counters", split * tiles)]
    return Traffic(
        words_read_input=gy * problem.n * problem.c * int(rows_ok.sum() * cols_ok.sum()),
        words_read_weight=gx * problem.k * crs,
        words_read_bias=0 if not problem.bias else gx * problem.k * 32 * config["WG"] if staged else out,
        words_written=out,
        fast_memory_words=implicit_gemm_tma_tf32_fast_memory_words(config),
        blocks=grid[0] * grid[1] * grid[2],
        grid=grid,
        workspace_written=tuple(written),
        workspace_read=tuple(read),
    )


def _check_winograd_gemm_problem(problem: ConvProblem) -> None:
    from .kernels import winograd_gemm as wgg

    why = wgg.applies(problem)
    if why is not None:
        raise ValueError(f"the winograd_gemm family computes 3x3 stride-1 convolutions and strided ones through "
                         f"their polyphase components only: {why} (the tuner skips the family there)")


# --------------------------------------------------------------------------- winograd: traffic model
def _check_winograd_problem(problem: ConvProblem) -> None:
    from .kernels import winograd as wg

    why = wg.applies(problem)
    if why is not None:
        raise ValueError(f"the winograd family computes 3x3, stride-1, dilation-1, groups-1 convolutions only: {why} "
                         "(the tuner skips the family there: kernels.winograd.applies)")


def _halo_in_bounds(out: int, tile: int, stride: int, pad: int, span: int, size: int) -> int:
    """Sum over the ceil(out/tile) tiles along one axis of the in-bounds input rows of the tile's ``span``-row
    patch (rows tile_index*tile*stride - pad + a, a in [0, span)); padding rows are predicated-off or
    zero-filled loads and read nothing."""
    idx = np.arange(-(-out // tile))[:, None] * tile * stride - pad + np.arange(span)[None, :]
    return int(((idx >= 0) & (idx < size)).sum())


def _patch_rows_in_bounds(out: int, mt: int, pad: int, size: int) -> int:
    """:func:`_halo_in_bounds` of Winograd F(MT x MT, 3x3): stride 1, an A = MT+2 row patch per tile."""
    return _halo_in_bounds(out, mt, 1, pad, mt + 2, size)


def _phase_rows_in_bounds(out: int, mt: int, st: int, pad: int, size: int) -> int:
    """:func:`_patch_rows_in_bounds` summed over the ``st`` polyphase components of one axis (winograd_gemm at
    stride s): component ph's patch of a tile reads rows s*(tile_index*MT + a) + ph - pad, a in [0, MT+2)."""
    a = st * (np.arange(-(-out // mt))[:, None, None] * mt + np.arange(mt + 2)[None, :, None])
    idx = a + np.arange(st)[None, None, :] - pad
    return int(((idx >= 0) & (idx < size)).sum())


def winograd_fast_memory_words(config: Mapping[str, int], family: "ModuleType | None" = None) -> int:
    """Shared memory words as allocated (``kernels.winograd.smem_bytes / 4``: the larger of the channel
    loop's buffers ``E*BC*(BK+4 + BT+4)``, the transformed filters U and input tiles V with padding, and the
    output stage's copy of the accumulators ``E*BK*(BT/ROUNDS + 1)``, which reuses them) + the accumulator
    registers (``E/EG*TK*TT`` per thread x threads = ``E*BK*BT``), as :func:`implicit_gemm_tc_fast_memory_words`
    counts (fragments, the live transform tile and addressing registers not counted). With TT=8 the output
    stage can pass over the tiles in fewer rounds and need more than the loop's buffers. ``family``: the
    ``winograd`` module (default) or ``winograd_tc``, whose buffers are padded to BK+8, BT+8 and whose
    accumulators, in mma fragments, are the same E*BK*BT words.
    """
    from .kernels import winograd as wg

    e = (config["MT"] + 2) ** 2
    return (family or wg).smem_bytes(config) // 4 + e * config["BK"] * config["BT"]


def winograd_traffic(problem: ConvProblem, config: Mapping[str, int],
                     family: "ModuleType | None" = None) -> Traffic:
    """Closed-form global-memory traffic of the fused Winograd kernel (csrc/kernels/winograd.cuh; with
    ``family`` = the ``winograd_tc`` module, winograd_tc.cuh: the same channel loop and output stage, so the
    same words; only the fast memory differs).

    Tiles NT = N * ceil(P/MT) * ceil(Q/MT); grid ceil(NT/BT) x ceil(K/BK) x SPLIT; slice z takes chunks
    [z*per, min(chunks, (z+1)*per)) of the chunks = ceil(C/BC) (per = ceil(chunks/SPLIT); trailing slices may
    be empty and still run the output stage). Counted as the kernel is written, every request once, no cache
    reuse (like :func:`implicit_gemm_tc_traffic`):

    * input: per chunk each block loads, for every (channel < C, tile < NT), the tile's A x A patch
      (A = MT+2, halo included) with bounds checks; padding is predicated off and reads nothing. The slices
      of a block column cover every channel once, so the total is
      ``ceil(K/BK) * N * C * rowsin * colsin`` (``rowsin`` = sum over tile rows of the patch rows inside the
      image), about ``ceil(K/BK) * (A/MT)^2 * |I|``: neighbouring patches overlap by 2 rows/columns and
      each block re-reads them (no L1/L2 reuse modelled);
    * weights: 9 words per (k < K, c < C) per block row -> ``ceil(NT/BT) * 9 * K * C``, whatever SPLIT is;
    * bias: one ``__ldg`` per in-range (tile, k) item of the output stage, slice 0 only -> ``NT * K``;
    * output: each (tile, k) writes its in-bounds MT x MT outputs -> ``K * N*P*Q`` per slice. SPLIT = 1:
      stores. SPLIT > 1: the host's memset (``K*NPQ``, ``words_memset``) + ``SPLIT * K * NPQ`` atomicAdds,
      empty slices included, each one read (``words_read_output``) and one write, as for implicit_gemm_tc.

    >>> p = ConvProblem(n=1, c=256, h=13, w=13, k=256, r=3, s=3, padding=(1, 1))
    >>> c = {"MT": 2, "BK": 32, "BT": 32, "BC": 8, "TK": 4, "TT": 4, "EG": 4, "DB": 0, "SPLIT": 1}
    >>> t = winograd_traffic(p, c)
    >>> t.grid, t.words_read_weight == t.grid[0] * 9 * 256 * 256
    ((2, 8, 1), True)
    >>> t.total >= winograd_lower_bound(p, 2, 3, t.fast_memory_words)
    True
    """
    _check_winograd_problem(problem)
    mt, split = config["MT"], config["SPLIT"]
    p, q = problem.out_hw
    (ph, pw) = problem.padding
    tiles = problem.tiles(mt)
    gx, gy = -(-tiles // config["BT"]), -(-problem.k // config["BK"])
    patch = _patch_rows_in_bounds(p, mt, ph, problem.h) * _patch_rows_in_bounds(q, mt, pw, problem.w)
    return Traffic(
        words_read_input=gy * problem.n * problem.c * patch,
        words_read_weight=gx * 9 * problem.k * problem.c,
        words_read_bias=tiles * problem.k if problem.bias else 0,
        fast_memory_words=winograd_fast_memory_words(config, family),
        blocks=gx * gy * split,
        grid=(gx, gy, split),
        **_split_output(problem.k * problem.n * p * q, split),
    )


# --------------------------------------------------------------------- winograd_gemm: traffic model
GEMM_TILE = (128, 128, 8)
"""The block tile (rows, columns, reduction step) assumed for cuBLAS's batched SGEMM in :func:`winograd_gemm_traffic`.
An assumption, not a measurement: cuBLAS picks its kernel by heuristics we do not see (and may split the
reduction, use other tiles or serve operand re-reads from L2). 128 x 128 x 8 with 256 threads holding 8 x 8
accumulators each and double-buffered operand tiles is the classic fp32 SGEMM block."""


def winograd_gemm_tile(config: Mapping[str, int]) -> tuple[int, int, int, int]:
    """(BM, BN, BK, stages) of the pipeline's GEMM block: the plan's own GEMM's when GE > 0
    (``kernels.winograd_gemm.gemm_block``: gemm_tf32x3's GEMMS or gemm_wgmma's WGMMA_GEMMS), else the assumed
    cuBLAS block :data:`GEMM_TILE` with two stages."""
    from .kernels import winograd_gemm as _wgg

    block = _wgg.gemm_block(config) if config.get("GE", 0) else None
    return (*GEMM_TILE, 2) if block is None else block


def _wgg_staged_images(config: Mapping[str, int], problem: ConvProblem) -> int:
    """Whole images per block of winograd_gemm's staged stage 2 (SO = 1), 0 when it runs per tile."""
    from .kernels import winograd_gemm as _wgg

    return _wgg.staged_images(config, problem)


def _u_planes(config: Mapping[str, int]) -> int:
    """U's batches per point: 2 when the plan's GEMM is gemm_wgmma (U, then its small parts), else 1."""
    from .kernels import winograd_gemm as _wgg

    return _wgg.u_planes(config) if "GE" in config else 1


def winograd_gemm_fast_memory_words(config: Mapping[str, int]) -> int:
    """The GEMM block's fast memory: its BM x BN accumulators + its pipeline's stages of BK x BM (two planes,
    big and small parts, for gemm_wgmma) and BK x BN operand tiles (:func:`winograd_gemm_tile`; for cuBLAS,
    128*128 + 2*8*(128+128) = 20480 words, an
    assumption). The transform stages keep one tile in registers (``kernels.winograd_gemm.estimated_registers``)
    and no shared memory."""
    bm, bn, bk, stages = winograd_gemm_tile(config)
    return bm * bn + stages * bk * (_u_planes(config) * bm + bn)


def _gemm_shape(problem: ConvProblem, config: Mapping[str, int], tiles: int) -> tuple[int, int]:
    """(rows, columns) of each of the E products as launch_gemm_plan's cuBLASLt (or at::bmm_out) GEMM computes
    them: ML=0, M[e] = U[e] V[e] is K x T; ML=1, M^T[e] = V^T[e] U^T[e] is T x K. The reduction is C either way."""
    return (problem.k, tiles) if config["ML"] == 0 else (tiles, problem.k)


def winograd_gemm_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Closed-form global-memory traffic of the non-fused Winograd pipeline ``winograd_gemm``
    (csrc/kernels/winograd_gemm.cuh, ``launch_gemm_plan`` in csrc/bagf_ext.cpp): four launches, every request
    once, no cache reuse (as the other models). A = MT+2, E = A^2, T = N*ceil(P/MT)*ceil(Q/MT):

    * stage 0, one thread per (k, c): 9 filter words (``words_read_weight`` = 9*K*C), E words of U stored (2E
      with gemm_wgmma, GE 6-7: U's small parts too, which the GEMM then reads as a second A panel);
    * stage 1, one thread per (c, tile): the tile's A x A input patch, bounds-checked (padding reads nothing)
      -> ``words_read_input`` = N*C*rowsin*colsin, as the fused kernel's per block row; E words of V stored;
    * at stride s > 1 (the polyphase form, ``winograd_math.polyphase``) C is C' = C s^2 everywhere above except the
      raw reads: stage 0 reads each of the K*C*R*S filter words once (a phase's taps past R or S are zeros, not
      loads), stage 1 the in-bounds rows s*(tile*MT + a) + ph - pad of each component;
    * the GEMM, E products of (K x C) by (C x T): a block per BM x BN tile of the product
      (:func:`winograd_gemm_tile`: our gemm_tf32x3's tile for GE > 0; for cuBLAS **modelled, not read**,
      :data:`GEMM_TILE`; rows K and columns T for ML=0, the transpose for ML=1) reads its operand panels once
      each, clipped at the edges, and writes its output tile once; the result is never read (beta = 0). So
      per point U is read ceil(T/BN) times and V ceil(K/BM) times (ML=0;
      ML=1 swaps the ceilings, the same counts for the square tile), M written once. ATen hands the
      transposed views of V and U to cuBLAS as transpose flags (``prepare_batch_matrix_for_cublas`` accepts a
      view with one unit stride), so no copy is counted. cuBLAS's real kernel is unknown and may differ
      (other tiles, split reductions with workspace, L2 hits on the re-reads);
    * stage 2, one thread per (k, tile): E words of M, one bias word when the problem has bias
      (``words_read_bias`` = K*T), the in-bounds MT x MT outputs (``words_written`` = K*N*P*Q).

    The workspaces are counted in ``workspace_written`` (U: E*K*C, twice with gemm_wgmma; V: E*C*T, M: E*K*T)
    and ``workspace_read``
    (U and V: the GEMM's operand reads, M: E*K*T); VL, ML and TB change no count (only coalescing and the
    transform stages' block counts). ``grid``: the blocks of stage 0, stage 1, the modelled GEMM and stage 2.

    Never below ``winograd_lower_bound(problem, MT, 3, M, fused=False)`` at this M: each compulsory term is a
    term of the model (stage 1 reads every used input word, stage 0 the weights, stage 2 writes the output and
    reads bias) and the GEMM's operand reads, E*K*C*T*(1/BM + 1/BN) before ceilings, are at least the core
    2*E*K*C*T/sqrt(M) because 1/BM + 1/BN >= 2/sqrt(BM*BN) >= 2/sqrt(M).

    >>> from bagf_torch.kernels import winograd_gemm as wgg
    >>> p = ConvProblem(n=1, c=256, h=13, w=13, k=256, r=3, s=3, padding=(1, 1))
    >>> t = winograd_gemm_traffic(p, wgg.DEFAULT)
    >>> dict(t.workspace_written) == wgg.workspace_words(wgg.DEFAULT, p)
    True
    >>> t.total >= winograd_lower_bound(p, 4, 3, t.fast_memory_words)
    True
    """
    _check_winograd_gemm_problem(problem)
    mt, tb = config["MT"], config["TB"]
    e = (mt + 2) ** 2
    p, q = problem.out_hw
    (ph, pw) = problem.padding
    st = problem.stride[0]
    k, c = problem.k, problem.c * st * st  # the GEMM's reduction: C' = C s^2 polyphase channels at stride s
    tiles = problem.tiles(mt)
    rows, cols = _gemm_shape(problem, config, tiles)
    bm, bn, _, _ = winograd_gemm_tile(config)
    gm, gn = -(-rows // bm), -(-cols // bn)
    a_reads, b_reads = gn * rows * c, gm * c * cols  # per point: row panels once per block column, and so on
    u_reads, v_reads = (a_reads, b_reads) if config["ML"] == 0 else (b_reads, a_reads)
    planes = _u_planes(config)  # gemm_wgmma: stage 0 writes U's small parts too, the GEMM reads both
    patch = _phase_rows_in_bounds(p, mt, st, ph, problem.h) * _phase_rows_in_bounds(q, mt, st, pw, problem.w)
    g_imgs = _wgg_staged_images(config, problem)  # SO = 1: stage 2's blocks take whole images
    grid = (-(-k * c // tb), -(-c * tiles // tb), e * gm * gn,
            k * -(-problem.n // g_imgs) if g_imgs else -(-k * tiles // tb))
    return Traffic(
        words_read_input=problem.n * problem.c * patch,
        words_read_weight=k * problem.c * problem.r * problem.s,
        words_read_bias=k * tiles if problem.bias else 0,
        words_written=k * problem.n * p * q,
        fast_memory_words=winograd_gemm_fast_memory_words(config),
        blocks=sum(grid),
        grid=grid,
        workspace_written=(("U", planes * e * k * c), ("V", e * c * tiles), ("M", e * k * tiles)),
        workspace_read=(("U", planes * e * u_reads), ("V", e * v_reads), ("M", e * k * tiles)),
    )


# ----------------------------------------------------------------------------- direct: traffic model
def _check_direct_problem(problem: ConvProblem) -> None:
    if problem.groups != 1:
        raise ValueError(f"the direct family handles groups=1 only, got groups={problem.groups}")


def direct_fast_memory_words(config: Mapping[str, int], problem: ConvProblem | None = None) -> int:
    """Shared memory words as allocated on ``problem`` (``kernels.direct.smem_bytes / 4``: every stage's
    BC x R*S x (BK+4) weights and BC x rows x pitch input patch, padding included; None: AlexNet conv1's
    geometry) + the accumulator registers ``BK*TH*TW``."""
    from .kernels import direct as dr

    return dr.smem_bytes(config, problem) // 4 + config["BK"] * config["TH"] * config["TW"]


def direct_traffic(problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """Closed-form global-memory traffic of the ``direct`` kernel (csrc/kernels/direct.cuh).

    Grid N*ceil(P/TH)*ceil(Q/TW) tiles x ceil(K/BK) x SPLIT; slice z takes the channel chunks
    [z*per, min(chunks, (z+1)*per)) of chunks = ceil(C/BC), per = ceil(chunks/SPLIT). As the kernel is written,
    every request once, no cache reuse:

    * input: per chunk each block copies, for every channel < C of the chunk, its tile's whole patch of
      (TH-1)*stride+(R-1)*dil+1 rows x (TW-1)*stride+(S-1)*dil+1 columns (also rows/columns no tap reads when
      the stride exceeds the kernel, and rows below a partial tile); out-of-image words are zero-filled copies
      and read nothing. Slices cover each channel once -> ``ceil(K/BK) * N * C * rowsin * colsin``;
    * weights: each block copies its BK x C x R x S panel (clipped at K), chunk by chunk ->
      ``tiles * K * C * R * S`` whatever SPLIT is;
    * bias: each thread loads its TK channels' bias (k < K) in slice 0 -> ``tiles * K * TH*TW/PX``;
    * output: the in-bounds (k, pixel) of every tile, per slice; SPLIT > 1 as for the other families
      (memset + atomics counted as a read and a write).
    """
    _check_direct_problem(problem)
    th, tw, bk, split = config["TH"], config["TW"], config["BK"], config["SPLIT"]
    p, q = problem.out_hw
    (sh, sw), (ph, pw), (dh, dw) = problem.stride, problem.padding, problem.dilation
    rows = (th - 1) * sh + (problem.r - 1) * dh + 1
    cols = (tw - 1) * sw + (problem.s - 1) * dw + 1
    n_tiles = problem.n * -(-p // th) * -(-q // tw)
    gy = -(-problem.k // bk)
    patch = _halo_in_bounds(p, th, sh, ph, rows, problem.h) * _halo_in_bounds(q, tw, sw, pw, cols, problem.w)
    return Traffic(
        words_read_input=gy * problem.n * problem.c * patch,
        words_read_weight=n_tiles * problem.k * problem.c * problem.r * problem.s,
        words_read_bias=n_tiles * problem.k * (th * tw // config["PX"]) if problem.bias else 0,
        fast_memory_words=direct_fast_memory_words(config, problem),
        blocks=n_tiles * gy * split,
        grid=(n_tiles, gy, split),
        **_split_output(problem.k * problem.n * p * q, split),
    )


# ------------------------------------------------------------------------------------ any family
_MODELS = {
    "implicit_gemm": (implicit_gemm_traffic, implicit_gemm_fast_memory_words),
    "implicit_gemm_tc": (implicit_gemm_tc_traffic, implicit_gemm_tc_fast_memory_words),
    "implicit_gemm_tf32": (implicit_gemm_tc_traffic, implicit_gemm_tc_fast_memory_words),  # the same kernel's loads
    "implicit_gemm_wgmma": (implicit_gemm_wgmma_traffic, implicit_gemm_wgmma_fast_memory_words),
    "implicit_gemm_tma_tf32": (implicit_gemm_tma_tf32_traffic, implicit_gemm_tma_tf32_fast_memory_words),
    "winograd": (winograd_traffic, winograd_fast_memory_words),
    "winograd_tc": (lambda problem, config: winograd_traffic(problem, config, _winograd_tc()),
                    lambda config: winograd_fast_memory_words(config, _winograd_tc())),
    "winograd_tf32": (lambda problem, config: winograd_traffic(problem, config, _winograd_tc()),  # the same kernel
                      lambda config: winograd_fast_memory_words(config, _winograd_tc())),
    "direct": (direct_traffic, direct_fast_memory_words),
    "winograd_gemm": (winograd_gemm_traffic, winograd_gemm_fast_memory_words),
}


def _winograd_tc() -> ModuleType:
    from .kernels import winograd_tc

    return winograd_tc


def _family_name(family: "str | ModuleType") -> str:
    name = family if isinstance(family, str) else getattr(family, "FAMILY", None)
    if name not in _MODELS:
        raise ValueError(f"no traffic model for kernel family {name!r}; modelled families: {sorted(_MODELS)}. "
                         "Add one to bagf_torch/iobound.py (_MODELS) with a brute-force test, or leave "
                         "pruning off for it")
    return name


def has_model(family: "str | ModuleType") -> bool:
    """Whether :func:`traffic` can model ``family`` (a family module or its ``FAMILY`` name)."""
    name = family if isinstance(family, str) else getattr(family, "FAMILY", None)
    return name in _MODELS


def traffic(family: "str | ModuleType", problem: ConvProblem, config: Mapping[str, int]) -> Traffic:
    """The traffic model of ``family`` (a family module or its ``FAMILY`` name) for one configuration.

    >>> from bagf_torch.kernels import implicit_gemm_tc as tc
    >>> p = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
    >>> traffic(tc, p, tc.DEFAULT) == traffic("implicit_gemm_tc", p, tc.DEFAULT)
    True
    """
    return _MODELS[_family_name(family)][0](problem, config)


def fast_memory_words(family: "str | ModuleType", config: Mapping[str, int]) -> int:
    """Fast memory (shared memory + accumulator registers, words) one block of ``family`` uses. For ``direct``
    it depends on the filter geometry: this is AlexNet conv1's; ``traffic(...).fast_memory_words`` has the
    problem's."""
    return _MODELS[_family_name(family)][1](config)


# ------------------------------------------------------------------------------------------ pruning
def prune(family: "str | ModuleType", configs: Iterable[Mapping[str, int]], problem: ConvProblem,
          factor: float = 4.0, always: Iterable[Mapping[str, int]] = (),
          ) -> tuple[list[dict[str, int]], list[tuple[dict[str, int], float]]]:
    """Bound-guided pruning: keep the configurations of ``family`` whose modelled traffic
    (:func:`traffic`, requested words) is within ``factor`` of the best one for ``problem``.

    Returns ``(kept, pruned)``; ``pruned`` lists ``(config, traffic / best_traffic)`` so the caller can log
    the cut. Order of ``kept`` follows the input. The minimum-traffic configuration is always kept, and so is
    every configuration in ``always`` that is among ``configs`` (the tuner passes the family's DEFAULT).
    Traffic is only a proxy for time (it ignores occupancy, latency hiding and, for split-K, the parallelism
    it buys), hence a generous factor; docs/iobound.md has how well it predicts on a real recording.

    >>> from bagf_torch.kernels import implicit_gemm as ig
    >>> p = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
    >>> kept, cut = prune(ig, ig.space().valid_configs(), p, factor=4.0)
    >>> len(kept) > 0 and len(kept) + len(cut) == len(ig.space().valid_configs())
    True
    """
    if factor < 1:
        raise ValueError(f"factor must be >= 1 (1 keeps only the best), got {factor}")
    model = _MODELS[_family_name(family)][0]
    configs = [dict(c) for c in configs]
    if not configs:
        return [], []
    keep = {tuple(sorted(c.items())) for c in always}
    totals = [model(problem, c).total for c in configs]
    best = min(totals)
    kept, pruned = [], []
    for c, t in zip(configs, totals):
        if t <= factor * best or tuple(sorted(c.items())) in keep:
            kept.append(c)
        else:
            pruned.append((c, t / best))
    return kept, pruned

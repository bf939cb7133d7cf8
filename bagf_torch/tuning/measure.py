"""On-GPU checking and timing of candidates (the checker and benchmarker the Tuner is given).

Timing follows ``triton.testing.do_bench``: a short estimate, warm-up, then per-iteration CUDA events on the
current stream, median and quantiles, repetitions sized to a millisecond budget. The L2 cache is not flushed
by default: in a network the previous layer's output is usually still in L2, as it is here.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..ops import ATEN  # the candidate handle for torch's own conv (cuDNN): the op's plan value for ATen
from ..problem import ConvProblem, cudnn_conv_mode
from .common import Outcome

# fp32 with fp32 accumulation over C*R*S <= a few thousand terms lands near 1e-6 relative; 1e-4 leaves room
# for any summation order while a wrong index, a missed tile or an unwritten element is far above it.
REL_TOL = 1e-4

# In TF32 mode, and in float16 and bfloat16, a candidate may miss the float64 reference by this many times what
# cuDNN's own convolution misses it by, in the same mode, dtype and memory format on the same data (each of the two
# measures), and never by less than the fp32 check allows: no plan is less accurate than what the caller already
# accepts by running cuDNN that way.
CUDNN_ERROR_FACTOR = 2.0
TF32_ERROR_FACTOR = CUDNN_ERROR_FACTOR


def output_error(out: torch.Tensor, ref: torch.Tensor, ref_norm: float, ref_max: float) -> tuple[float, float]:
    """(error norm / reference norm, largest error / largest reference magnitude) of ``out`` against the float64
    ``ref``: the two measures the correctness check bounds."""
    err = out.double() - ref
    return float(err.norm()) / max(ref_norm, 1e-30), float(err.abs().max()) / max(ref_max, 1e-30)


class Workspace:
    """Fresh random tensors for one problem on one device, and their float64 reference (computed once)."""

    def __init__(self, problem: ConvProblem, device: torch.device, seed: int | None = None, frozen: bool = False):
        self.frozen = frozen  # op_call passes a KRSC plan the weight's KRSC copy, as a frozen TunedConv2d does
        self._w_krsc: torch.Tensor | None = None
        self._tf32_operand_error: tuple[float, float] | None = None
        g = torch.Generator(device=device)
        # fresh data per workspace without touching the user's global RNG (torch.seed() would reseed it)
        g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") % (2**63))
        p = problem
        self.problem = p
        # the problem's dtype and memory format (a 16-bit problem's data rounded once; the reference computes on
        # exactly those values)
        dtype = getattr(torch, p.dtype)
        fmt = torch.channels_last if p.layout == "nhwc" else torch.contiguous_format
        self.x = torch.randn(p.n, p.c, p.h, p.w, device=device, generator=g).to(dtype).contiguous(memory_format=fmt)
        fan_in = p.c * p.r * p.s
        self.w = (torch.randn(p.k, p.c, p.r, p.s, device=device, generator=g) / math.sqrt(fan_in)).to(
            dtype).contiguous(memory_format=fmt)
        self.b = torch.randn(p.k, device=device, generator=g).to(dtype) if p.bias else None
        self.args = (list(p.stride), list(p.padding), list(p.dilation))
        ph, pq = p.out_hw
        self.out = torch.empty(p.n, p.k, ph, pq, device=device, dtype=dtype, memory_format=fmt)
        # (TF32 left as it is: it does not touch float64, and cuDNN's flags are the process's, which a background
        # tuner's workspace would flip under the user's calls: their TF32 mode decides which plans they take)
        with cudnn_conv_mode(enabled=True, benchmark=False, deterministic=False):
            self.ref = F.conv2d(self.x.double(), self.w.double(), None if self.b is None else self.b.double(),
                                p.stride, p.padding, p.dilation)
        self.ref_norm = float(self.ref.norm())
        self.ref_max = float(self.ref.abs().max()) if self.ref.numel() else 0.0
        # The check's bounds (judge_output): fp32's, or in TF32 mode and in 16-bit dtypes what cuDNN in that mode,
        # dtype and format misses by here (benchmark mode: the algorithm the tuner's baseline times), times
        # CUDNN_ERROR_FACTOR.
        self.rel_tol, self.max_tol = REL_TOL, 10 * REL_TOL
        self.cudnn_error: tuple[float, float] | None = None
        if (p.tf32 or dtype is not torch.float32) and self.ref.numel():
            with cudnn_conv_mode(enabled=True, benchmark=True, deterministic=False, tf32=p.tf32):
                theirs = F.conv2d(self.x, self.w, self.b, p.stride, p.padding, p.dilation)
            self.cudnn_error = output_error(theirs, self.ref, self.ref_norm, self.ref_max)
            del theirs
            self.rel_tol = max(REL_TOL, CUDNN_ERROR_FACTOR * self.cudnn_error[0])
            self.max_tol = max(10 * REL_TOL, CUDNN_ERROR_FACTOR * self.cudnn_error[1])

    def tf32_operand_error(self) -> tuple[float, float] | None:
        """In TF32 mode (float32 problems only), the error against the float64 reference of the convolution of this
        workspace's operands rounded to TF32, summed exactly (``winograd_math.tf32_operands_conv2d``): the error every family with ``TF32_PRODUCTS`` makes before its own summation
        order adds to it (a Winograd one rounds transformed operands, larger still), so where it exceeds the
        check's bounds no such family can pass. Where cuDNN's "TF32" kernel computes at fp32 accuracy (C = 3
        layers: 2e-7) the bounds are fp32's, and TF32 products miss them about twofold on random data such as
        this. None in strict fp32 and in 16-bit dtypes. Computed on first use (one float64 convolution), then kept."""
        p = self.problem
        if not (p.tf32 and p.dtype == "float32") or not self.ref.numel():
            return None
        if self._tf32_operand_error is None:
            from ..winograd_math import tf32_operands_conv2d

            with cudnn_conv_mode(enabled=True, benchmark=False, deterministic=False):  # (float64: TF32 as it is)
                rounded = tf32_operands_conv2d(self.x, self.w, self.b, p.stride, p.padding, p.dilation)
            self._tf32_operand_error = output_error(rounded, self.ref, self.ref_norm, self.ref_max)
        return self._tf32_operand_error

    def op_call(self, handle: int) -> Callable[[], torch.Tensor]:
        """The call a user's inference forward makes (allocating its output, as F.conv2d does): TunedConv2d's
        fast path, the op's kernel without the dispatcher (``conv2d_inference``; these tensors need no
        gradient). The weight as the workspace holds it (KCRS for an NCHW problem): a plan that reads it KRSC converts
        it in the call, as a TunedConv2d does unless its weights are frozen (``freeze_weights``); with ``frozen`` such
        a plan gets the weight's KRSC copy, as a frozen layer's call does."""
        x, w, b, (s, p, d) = self.x, self.w, self.b, self.args
        from ..jit import extension

        ext = extension.loaded()
        if self.frozen and ext.plan_reads_krsc(handle):
            if self._w_krsc is None:
                self._w_krsc = w.contiguous(memory_format=torch.channels_last)
            w = self._w_krsc
        op = ext.conv2d_inference
        s, p, d = list(s), list(p), list(d)
        return lambda: op(x, w, b, s, p, d, handle)

    def aten_call(self) -> Callable[[], torch.Tensor]:
        p = self.problem
        x, w, b = self.x, self.w, self.b
        return lambda: F.conv2d(x, w, b, p.stride, p.padding, p.dilation)


def judge_output(out: torch.Tensor, ref: torch.Tensor, ref_norm: float, ref_max: float,
                 rel_tol: float = REL_TOL, max_tol: float | None = None) -> str | None:
    """Why ``out`` is wrong against the float64 reference ``ref`` (whose norm and largest magnitude are given), or
    None: every output finite, the error's norm within ``rel_tol`` of the reference's and its worst element within
    ``max_tol`` (default 10 x ``rel_tol``) of the reference's largest. What every candidate passes before it is
    cached."""
    max_tol = 10 * rel_tol if max_tol is None else max_tol
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        return f"{bad} of {out.numel()} outputs unwritten or not finite"
    rel, worst = output_error(out, ref, ref_norm, ref_max)
    if rel > rel_tol or worst > max_tol:
        return f"relative error {rel:.2e} (max {worst:.2e}) > {rel_tol:.2g} (max {max_tol:.2g})"
    return None


class CudaChecker:
    """Runs a candidate once into a NaN-poisoned output (``conv2d_inference`` with ``out``: the plan itself, never
    ATen) and compares it with the float64 reference, within the workspace's bounds (fp32's, or in TF32 mode
    those cuDNN's TF32 error sets) unless ``rel_tol`` is given (then ``judge_output``'s default max)."""

    def __init__(self, ext, rel_tol: float | None = None):
        self.ext = ext
        self.rel_tol = rel_tol

    def check(self, ws: Workspace, handle: int) -> Outcome | None:
        """None if the candidate is right; else a typed failure ("launch" or "wrong") saying how."""
        ws.out.fill_(float("nan"))
        s, p, d = ws.args
        try:
            self.ext.conv2d_inference(ws.x, ws.w, ws.b, s, p, d, handle, out=ws.out)
            torch.cuda.current_stream().synchronize()
        except RuntimeError as e:
            return Outcome("launch", detail=str(e))
        bounds = (ws.rel_tol, ws.max_tol) if self.rel_tol is None else (self.rel_tol, None)
        why = judge_output(ws.out, ws.ref, ws.ref_norm, ws.ref_max, *bounds)
        return None if why is None else Outcome("wrong", detail=why)


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    reps: int


QUEUED_MAX = 200
"""At most this many calls per queued timing: well inside a stream's launch queue (a call is at most a memset and
two kernels)."""
QUEUED_MIN = 10
"""At least this many (a host too slow to queue them within the longest sleep halves the count down to it)."""
QUEUED_SWITCH_S = 5e-5
"""The interpreter's thread switch interval while finalists are re-timed (Python's default is 5 ms). torch's CUDA
ops release the GIL, so with another thread busy in Python (a strategy step left running, the first compiles)
every call of a timing loop can wait a whole interval to get it back: at 5 ms, 200 calls of cuDNN's conv take a
second to issue, longer than any GPU sleep queued ahead of them (on the H200, 4953 us per call against 57 us of
GPU time). Restored after, when the last timing that lowered it ends."""
HOST_PACED_US = 60.0
"""A candidate (or cuDNN) whose per-call event timing comes in under this many microseconds is timed by GPU time
(queued calls, as the finalists are) instead. An eager call costs the host 13-25 us on the H200 (torch's conv and
our op, benchmarks/results/bench_layers_overhead_h200.md), more with the strategy and compiles busy on other threads,
so below this a span between events can be the host's pace: at batch 1 every candidate and cuDNN measured 17-28 us
that way while their GPU times ranged from under 10 us up, and the search could not tell them apart."""
QUEUED_ROUNDS = 3
"""Queued timings per such candidate; the median is its time."""

QUEUED_SLEEP_CYCLES = 2_000_000
"""The shortest GPU sleep of a queued timing and the first of a re-timing, about a millisecond of the H200's clock: 200
calls' host cost at ~5 us (a search's later timings start from QUEUED_SLEEP_MARGIN times the last host time)."""
QUEUED_MAX_SLEEP_CYCLES = 64 * QUEUED_SLEEP_CYCLES
"""The longest (about 65 ms)."""
QUEUED_SLEEP_MARGIN = 2.0
"""After a queued timing, the next one's first sleep lasts this many times as long as the host took to queue its
calls (in the GPU's cycles, measured by that sleep: the clock is the GPU's own), within the first and the longest
sleep. So the sleep follows the host both ways: one slow moment (a compile wave, the strategy's model fit) does not
leave every later short candidate of the search behind the longest sleep, ~65 ms of idle GPU per timing."""

_host_clock = time.perf_counter  # (a module attribute: the tests' simulated stream replaces it)


def _graph_pool():
    """One memory pool for the finalists' graphs (None where this torch has no CUDA graphs: each capture then fails
    and the finalists are timed queued)."""
    try:
        return torch.cuda.graph_pool_handle()
    except (RuntimeError, AttributeError, AssertionError):
        return None


_switch_lock = threading.Lock()
_switch_depth = 0
_switch_saved = 0.0


@contextlib.contextmanager
def short_switch_interval():
    """``QUEUED_SWITCH_S`` as the interpreter's switch interval for the block; nested and concurrent blocks are
    counted, the first in saves the process's interval and the last out restores it."""
    global _switch_depth, _switch_saved
    with _switch_lock:
        if _switch_depth == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, QUEUED_SWITCH_S))
        _switch_depth += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_depth -= 1
            if _switch_depth == 0:
                sys.setswitchinterval(_switch_saved)


class CudaBenchmarker:
    """Times callables with CUDA events: ``warmup_ms`` of warm-up, then ``rep_ms`` of timed repetitions."""

    def __init__(self, warmup_ms: float = 5.0, rep_ms: float = 25.0, min_reps: int = 10, max_reps: int = 2000):
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.min_reps = min_reps
        self.max_reps = max_reps
        self._sleep_cycles = QUEUED_SLEEP_CYCLES

    def _events(self, fn: Callable[[], object], reps: int) -> list[float]:
        stream = torch.cuda.current_stream()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record(stream)
            fn()
            e.record(stream)
        stream.synchronize()
        return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]

    def time(self, fn: Callable[[], object], cutoff_us: float | None = None) -> Outcome:
        """Median microseconds of ``fn``; a "timeout" outcome when its estimate exceeds ``cutoff_us``. An estimate
        under ``HOST_PACED_US`` (the host may have paced it) is replaced by the GPU time of queued calls
        (:meth:`queued`), whatever the cut-off."""
        try:
            fn()
            est = statistics.median(self._events(fn, 5))
        except RuntimeError as e:
            return Outcome("launch", detail=str(e))
        if est < HOST_PACED_US and getattr(torch.cuda, "_sleep", None) is not None:
            # (before the cut-off: a host-paced estimate says nothing of the GPU time the cut-off is about, and
            # timing a short call costs little)
            try:
                gpu = self._gpu_time(fn)
            except RuntimeError as e:
                return Outcome("launch", detail=str(e))
            if gpu is not None:
                return gpu
        if cutoff_us is not None and est > cutoff_us:
            return Outcome("timeout", detail=f"estimated {est:.1f} us > cut-off {cutoff_us:.1f} us")
        t = self.timing(fn, est)
        return Outcome("ok", time_us=t.median_us, detail=f"p20 {t.p20_us:.2f} p80 {t.p80_us:.2f} n={t.reps}")

    def queued_times(self, fn: Callable[[], object]) -> tuple[list[float], int]:
        """``QUEUED_ROUNDS`` queued timings of ``fn`` (with the short switch interval, as the finalists' re-timing),
        sorted, those the host could not queue in time left out, and the calls per timing: how a call under
        ``HOST_PACED_US`` is timed, here and by benchmarks/record_space.py."""
        with short_switch_interval():
            (times,), (calls,) = self._queued_rounds([fn], QUEUED_ROUNDS)
        return sorted(times), calls

    def _gpu_time(self, fn: Callable[[], object]) -> Outcome | None:
        """``fn``'s GPU time per call, the median of :meth:`queued_times`; None when the host could queue none of
        them in time."""
        times, calls = self.queued_times(fn)
        if not times:
            return None
        return Outcome("ok", time_us=statistics.median(times),
                       detail=f"GPU time (queued): min {times[0]:.2f} max {times[-1]:.2f} n={len(times)}x{calls}")

    def timing(self, fn: Callable[[], object], est_us: float | None = None) -> Timing:
        if est_us is None:
            fn()
            est_us = statistics.median(self._events(fn, 5))
        est_ms = max(est_us / 1000.0, 1e-3)
        for _ in range(max(1, int(self.warmup_ms / est_ms))):
            fn()
        reps = int(min(self.max_reps, max(self.min_reps, self.rep_ms / est_ms)))
        times = sorted(self._events(fn, reps))
        q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
        return Timing(statistics.median(times), q[0], q[3], len(times))

    @staticmethod
    def _call(ws: Workspace, handle: int) -> Callable[[], object]:
        return ws.aten_call() if handle == ATEN else ws.op_call(handle)

    def measure(self, ws: Workspace, handle: int, cutoff_us: float | None = None) -> Outcome:
        """Time one candidate (or cuDNN for ``ATEN``, in benchmark mode, TF32 as the problem says)."""
        with cudnn_conv_mode(enabled=True, benchmark=True, deterministic=False, tf32=ws.problem.tf32):
            return self.time(self._call(ws, handle), cutoff_us)

    def remeasure(self, ws: Workspace, handles: Sequence[int], rounds: int = 5) -> list[float]:
        """Re-time the finalists and cuDNN interleaved, by GPU time replayed from a CUDA graph of each (``_capture``;
        ``queued`` calls for one that cannot be captured); medians in microseconds, in the order of ``handles``; NaN
        for a handle none of whose timings could keep the host out of the span. The winner is picked from these.

        Either every handle is timed from its graph or, where one cannot be captured, every handle is timed queued:
        the two measures differ by the launch gaps, so they are never compared with each other.

        A graph is what a plan's GPU time is judged by (the layer benchmark's graph columns): queued eager calls also
        pay the GPU's gaps between a call's launches, which a graph closes, and at batch 1 in bf16 that put a split-K
        plan at 11.2 us ahead of cuDNN's 11.8 where their graphs take 11.0 and 10.3. Our plans' host cost per call
        is below torch's conv (benchmarks/results/bench_layers_overhead_h200.md), so a plan that wins by GPU time is
        not slower eager either (it may be faster eager where cuDNN keeps the plan: at N = 1 a call's host cost can
        exceed its GPU time). Timed call by call between events, a span would hold the host's pace whenever the host
        is slower than the GPU, e.g. with a search step or compiles busy on other threads.

        The graphs share one memory pool (they are replayed one after another, never at once, and their outputs are
        never read) and are released before this returns."""
        self._sleep_cycles = QUEUED_SLEEP_CYCLES
        with short_switch_interval(), cudnn_conv_mode(enabled=True, benchmark=True, deterministic=False,
                                                       tf32=ws.problem.tf32):
            fns = [self._call(ws, h) for h in handles]
            counts = [self._queued_calls(fn) for fn in fns]
            graphs: list = []

            def release() -> None:
                while graphs:
                    graphs.pop()[0].reset()

            try:
                pool = _graph_pool()
                for fn, n in zip(fns, counts):
                    captured = self._capture(fn, n, pool)
                    if captured is None:  # all by graphs or none: a queued time also holds launch gaps
                        release()
                        break
                    graphs.append(captured)
                per, _ = self._queued_rounds(fns, rounds, counts, graphs or None)
            finally:
                release()
            return [statistics.median(t) if t else math.nan for t in per]

    @staticmethod
    def _capture(fn: Callable[[], object], calls: int, pool=None):
        """(graph, calls): ``calls`` calls of ``fn`` captured in one CUDA graph (in ``pool``) after a warm-up call on
        a side stream, uploaded by one replay; or None where the call cannot be captured (it is then timed queued).
        Each call's output is dropped before the next, so the pool holds about one call's tensors. The capture is
        thread-local (a strategy step left running on another thread neither breaks it nor is captured) and on a
        stream of its own, not torch.cuda.graph's shared default one. A failed capture leaves the caller's current
        stream as it was."""
        stream = torch.cuda.current_stream()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                fn()
            stream.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                for _ in range(calls):
                    fn()
            graph.replay()  # the first replay uploads the graph: not part of any timing
            return graph, calls
        except (RuntimeError, AssertionError):  # (AssertionError: torch without CUDA, the tests' simulated stream)
            if isinstance(stream, torch.cuda.Stream):  # (torch.cuda.graph leaves its own current when capture fails)
                torch.cuda.set_stream(stream)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return None

    @staticmethod
    def _replay(graph, calls: int) -> float:
        """GPU microseconds per call of one timed replay of a captured graph."""
        stream = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        return 1000.0 * start.elapsed_time(end) / calls

    def _queued_rounds(self, fns: Sequence[Callable[[], object]], rounds: int, counts: list[int] | None = None,
                       graphs: Sequence | None = None) -> tuple[list[list[float]], list[int]]:
        """``rounds`` round-robin timings of ``fns``: a replay of each one's graph where ``graphs`` holds one per fn
        (``_capture``), else a queued timing (each fn its own call count, ``counts`` or from ``_queued_calls``, as ``_queued``
        settles it). Per fn the timings whose calls were all queued in time (a host-paced timing is only an upper
        bound: left out), and the call counts they ended on."""
        counts = list(counts) if counts is not None else [self._queued_calls(fn) for fn in fns]
        per: list[list[float]] = [[] for _ in fns]
        for _ in range(rounds):
            for i, fn in enumerate(fns):
                if graphs is not None:
                    us = self._replay(*graphs[i])
                else:
                    us, counts[i] = self._queued(fn, counts[i])
                if us == us:
                    per[i].append(us)
        return per, counts

    def _queued_calls(self, fn: Callable[[], object]) -> int:
        """About ``rep_ms`` of calls of ``fn`` (QUEUED_MIN to QUEUED_MAX), from a short event timing (an upper
        bound of its GPU time)."""
        fn()
        est = max(statistics.median(self._events(fn, 3)), 1.0)
        return int(min(QUEUED_MAX, max(QUEUED_MIN, 1000.0 * self.rep_ms / est)))

    def queued(self, fn: Callable[[], object], calls: int | None = None) -> float:
        """GPU microseconds per call of ``fn``: ``calls`` calls (by default ``_queued_calls``) issued while a GPU
        sleep holds the stream, so that they run back to back whatever the host does meanwhile (other threads, the
        GIL). The sleep starts at QUEUED_SLEEP_MARGIN times the last timing's host time and grows until the host
        queues them all before it ends, up to QUEUED_MAX_SLEEP_CYCLES; past
        that the count halves, down to QUEUED_MIN. NaN when the host cannot queue even those within the longest
        sleep (the span would be the host's pace). Without ``torch.cuda._sleep``, one timed batch."""
        if calls is None:
            calls = self._queued_calls(fn)
        return self._queued(fn, calls)[0]

    def _queued(self, fn: Callable[[], object], calls: int) -> tuple[float, int]:
        """``queued``'s time and the call count it settled on (what the next round of a re-timing starts from)."""
        fn()
        sleep = getattr(torch.cuda, "_sleep", None)
        stream = torch.cuda.current_stream()
        cycles = self._sleep_cycles  # sized by the last queued timing's host (QUEUED_SLEEP_MARGIN)
        while True:
            slept, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            stream.synchronize()
            if sleep is not None:
                slept.record(stream)
                sleep(cycles)
            start.record(stream)
            t0 = _host_clock()
            for _ in range(calls):
                fn()
            end.record(stream)
            host_s = _host_clock() - t0
            in_time = sleep is None or not start.query()  # the GPU still asleep: every call was queued behind it
            end.synchronize()
            if in_time:
                if sleep is not None:
                    sleep_ms = slept.elapsed_time(start)
                    if sleep_ms > 0:
                        want = QUEUED_SLEEP_MARGIN * host_s * 1000.0 / sleep_ms * cycles
                        self._sleep_cycles = int(min(QUEUED_MAX_SLEEP_CYCLES, max(QUEUED_SLEEP_CYCLES, want)))
                return 1000.0 * start.elapsed_time(end) / calls, calls
            if cycles < QUEUED_MAX_SLEEP_CYCLES:
                cycles = min(4 * cycles, QUEUED_MAX_SLEEP_CYCLES)  # (a sized start is no power of 4)
            elif calls > QUEUED_MIN:
                calls = max(QUEUED_MIN, calls // 2)
            else:
                return math.nan, calls

    def interleaved(self, fns: Sequence[Callable[[], object]], rounds: int = 5) -> list[float]:
        """Median over ``rounds`` of round-robin timings, so clock or thermal drift hits every candidate alike."""
        per: list[list[float]] = [[] for _ in fns]
        for _ in range(rounds):
            for i, fn in enumerate(fns):
                per[i].append(self.timing(fn).median_us)
        return [statistics.median(t) for t in per]

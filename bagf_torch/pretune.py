"""Pre-tuning a whole model: ``tune_model(model, example_inputs)``.

It runs the model once per example input with every TunedConv2d's plan lookup intercepted, so it learns
exactly the problems the layers would ask the runtime for (same checks, same ``ConvProblem``) without tuning
anything; deduplicates them (AlexNet at N=1, 32, 128 has 15); tunes each one that the cache does not hold
yet, with a progress bar; and returns a ``ModelReport`` (per problem: layers, plan, time against cuDNN,
speedup, trials, tuning seconds) that prints as a table and serialises to JSON.

Under ``torchrun`` the unique problems are sharded across ranks and the winners gathered (see
``bagf_torch.distributed``). The tuning step is a plain function ``step(problem, device, progress) ->
record`` so that it can be replaced (tests use one that replays recorded timings on a CPU).

>>> import torch, bagf_torch                                              # doctest: +SKIP
>>> model = bagf_torch.models.alexnet().cuda().eval()                     # doctest: +SKIP
>>> torch.backends.cudnn.allow_tf32 = False                               # doctest: +SKIP
>>> xs = [torch.randn(n, 3, 224, 224, device="cuda") for n in (1, 32)]    # doctest: +SKIP
>>> report = bagf_torch.tune_model(model, xs, budget=20)                  # doctest: +SKIP
>>> print(report); report.save("alexnet_tuning.json")                     # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from . import log, runtime
from .kernels import FAMILIES
from .nn import TunedConv2d
from .ops import ATEN
from .problem import ConvProblem, cudnn_conv_mode
from .tuning.common import TrialEvent
from .tuning.measure import short_switch_interval

__all__ = ["Discovery", "LayerReport", "ModelReport", "Progress", "RuntimeTuneStep", "discover", "tune_model"]


# ---- discovery -------------------------------------------------------------------------------------------

@dataclass
class Discovery:
    """What one run of the model asked for: unique problems in first-call order, where each was used."""

    problems: list[ConvProblem] = field(default_factory=list)
    layers: dict[ConvProblem, list[str]] = field(default_factory=dict)   # names of the layers using it
    devices: dict[ConvProblem, int] = field(default_factory=dict)        # device of the first call
    unsupported: list[tuple[str, str]] = field(default_factory=list)     # (layer, reason), run by ATen
    calls: int = 0                                                       # TunedConv2d calls seen
    uses: dict[ConvProblem, dict[int, int]] = field(default_factory=dict)  # forward index -> calls in it
    stock_us: dict[ConvProblem, float] = field(default_factory=dict)  # torch's conv, GPU us per call (time_stock)


def _call_list(example_inputs) -> list:
    """One entry per forward: a Tensor, or a list of them, means one call each; a tuple or dict element is
    one call's positional or keyword arguments. A tuple at the top is refused: it reads as one call's arguments
    (as torch.export and torch.jit.trace take them) as well as one input per forward."""
    if isinstance(example_inputs, torch.Tensor):
        return [example_inputs]
    if isinstance(example_inputs, dict):
        return [example_inputs]
    if isinstance(example_inputs, tuple):
        raise ValueError("example_inputs is a tuple: give a list with one entry per forward, e.g. [x1, x32] for "
                         "two forwards, or [(x, y)] for one forward with two positional arguments")
    calls = list(example_inputs)
    if not calls:
        raise ValueError("example_inputs is empty; give one input per batch size, e.g. "
                         "[torch.randn(n, 3, 224, 224, device='cuda') for n in (1, 32)]")
    return calls


def _forward(model: nn.Module, call) -> None:
    if isinstance(call, dict):
        model(**call)
    elif isinstance(call, (tuple, list)):
        model(*call)
    else:
        model(call)


def discover(model: nn.Module, example_inputs) -> Discovery:
    """Run ``model`` once per example input (eval mode, no grad) and record every problem its TunedConv2d
    layers would look up, and how often each forward asks for it, without tuning. Layer plan memos, training
    flags and the runtime are left as they were. Raises ValueError when the model has no TunedConv2d (convert
    it first). A ``torch.compile``d model is discovered through the module it wraps, and one compiled in place
    (``model.compile()``) runs eagerly for it: a graph compiled here would keep this pass's ATen answers. Not
    for a process that serves meanwhile: the runtime's lookups answer ATen and compiled code runs eagerly, in
    every thread, while it runs."""
    inner = getattr(model, "_orig_mod", None)  # (torch.compile's OptimizedModule)
    if isinstance(inner, nn.Module):
        model = inner
    names = {m: name for name, m in model.named_modules() if isinstance(m, TunedConv2d)}
    if not names:
        plain = sum(1 for m in model.modules() if type(m) is nn.Conv2d)
        raise ValueError(f"the model has no TunedConv2d layers ({plain} plain nn.Conv2d); call "
                         "bagf_torch.convert(model) first")
    found = Discovery()
    current: list[str] = []
    forward = [0]

    def pre_hook(module, args, kwargs):
        # every call asks the runtime, a layer called again with the same shape too (its memo would skip the
        # lookup, and the problem's calls per forward would be undercounted)
        module.__dict__.update(_bagf_plans={}, _bagf_last=None)
        current.append(names[module])
        found.calls += 1
        x = args[0] if args else kwargs.get("input")  # (forward's one argument, given by name or not)
        reason = module._unsupported(x) if isinstance(x, torch.Tensor) else "no tensor input"
        if reason is not None:
            found.unsupported.append((names[module], reason))

    def post_hook(module, args, output):
        current.pop()

    def record(problem: ConvProblem, device: int) -> int:
        if problem not in found.layers:
            found.problems.append(problem)
            found.layers[problem] = []
            found.devices[problem] = device
        layer = current[-1] if current else "?"
        if layer not in found.layers[problem]:
            found.layers[problem].append(layer)
        uses = found.uses.setdefault(problem, {})
        uses[forward[0]] = uses.get(forward[0], 0) + 1
        return ATEN  # run the call through torch's conv: nothing is tuned or loaded

    rt = runtime.get()
    saved_tables = {m: (m.__dict__.get("_bagf_plans"), m.__dict__.get("_bagf_last")) for m in names}
    modes = {m: m.training for m in model.modules()}
    hooks = []
    try:
        for m in names:
            # every layer asks the runtime, even one that already has a plan (its table would skip the lookup
            # this pass records)
            m.__dict__.update(_bagf_plans={}, _bagf_last=None)
            hooks.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
            hooks.append(m.register_forward_hook(post_hook))
        # an instance attribute: shadows Runtime.lookup (which TunedConv2d and plan_handle ask) for this runtime
        rt.lookup = lambda problem, device: (record(problem, device), True)
        model.eval()
        # cuDNN benchmark mode for this pass: torch keeps ONE algorithm per conv shape per process, and the first
        # call decides it -- a heuristic pick (benchmark off) is cached and then reused even in benchmark mode.
        # Measured on the H200: AlexNet conv3 at N=128 ran 1024 us with the heuristic pick against 415-450 us
        # with benchmark's (FFT); a recording pass with benchmark off would pin the heuristic one, and the tuner
        # would then compare our kernels with a 2.4x slower cuDNN (python benchmarks/probes/cudnn_contexts.py).
        # A model compiled in place (``model.compile()``) runs eagerly for this pass: its graph would be compiled
        # with the ATen answers this pass gives as its constants, and kept for the calls after it. (The stance is
        # set when it is made, so it is made inside the stack that undoes it.)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(cudnn_conv_mode(benchmark=True))
            if "torch._dynamo" in sys.modules:  # (nothing is compiled in a process that never imported dynamo)
                stack.enter_context(torch.compiler.set_stance("force_eager"))
            for i, call in enumerate(_call_list(example_inputs)):
                forward[0] = i
                _forward(model, call)
    finally:
        with contextlib.suppress(AttributeError):
            del rt.lookup
        for h in hooks:
            h.remove()
        for m, (plans, last) in saved_tables.items():  # drop the ATEN entries the recording run left
            m.__dict__.update(_bagf_plans={} if plans is None else plans, _bagf_last=last)
        for m, was in modes.items():
            m.training = was
    return found


def time_stock(found: Discovery) -> dict[ConvProblem, float]:
    """``stock_us`` of every discovered problem on its GPU (nothing off the GPU). A problem whose timing fails
    is left out, with one warning: only the split of the tuning seconds depends on it, and a pass with a
    problem left out is split by the roofline estimate (``allot_seconds``)."""
    out: dict[ConvProblem, float] = {}
    failed: list[str] = []
    for p in found.problems:
        if found.devices.get(p, -1) < 0:
            continue
        try:
            out[p] = stock_us(p, found.devices[p])
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at a large batch
            failed.append(f"{p.short()} ({type(e).__name__}: {e})")
    if failed:
        log.logger().warning(f"timing torch's conv failed on {len(failed)} problems, first {failed[0]}; their "
                             "forwards' tuning seconds are split by a roofline estimate instead")
    return out


STOCK_REPS = 10
"""Back-to-back calls per timing in ``stock_us``; the median of STOCK_ROUNDS such timings is the answer."""
STOCK_ROUNDS = 3


def stock_us(problem: ConvProblem, device: int) -> float:
    """torch's own conv on ``problem`` (cuDNN in benchmark mode, the problem's TF32 mode): GPU microseconds
    per call, timed on random data apart from the model, its calls queued behind a GPU sleep so that the
    host's launch cost at small N is not in the span (a layer's span inside an eager forward measured the
    host at N=1 and gave AlexNet's conv1 7 s and conv5, the slower layer, 4.4 s)."""
    dev = torch.device("cuda", device)
    fmt = torch.channels_last if problem.layout == "nhwc" else torch.contiguous_format
    dtype = getattr(torch, problem.dtype)
    x = torch.randn(problem.n, problem.c, problem.h, problem.w, device=dev, dtype=dtype).to(memory_format=fmt)
    w = torch.randn(problem.k, problem.c // problem.groups, problem.r, problem.s, device=dev, dtype=dtype)
    b = torch.randn(problem.k, device=dev, dtype=dtype) if problem.bias else None
    sleep = getattr(torch.cuda, "_sleep", None)
    times = []
    # the short switch interval: the start points' compiles run beside this on a Python thread (tune_model)
    with torch.no_grad(), torch.cuda.device(dev), cudnn_conv_mode(benchmark=True, tf32=problem.tf32), \
            short_switch_interval():
        def call():
            return torch.nn.functional.conv2d(x, w, b, problem.stride, problem.padding, problem.dilation,
                                              problem.groups)

        call()  # cuDNN's algorithm search for this shape
        cycles = 2_000_000  # about a millisecond of GPU clock, while the host queues the calls
        while len(times) < STOCK_ROUNDS:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(dev)
            if sleep is not None:
                sleep(cycles)
            start.record()
            for _ in range(STOCK_REPS):
                call()
            end.record()
            behind = sleep is None or not start.query()  # the GPU still asleep: every call was queued in time
            end.synchronize()
            if not behind and cycles < 64_000_000:  # the host was slower than the sleep: a longer one
                cycles *= 4
                continue
            times.append(1e3 * start.elapsed_time(end) / STOCK_REPS)
    return statistics.median(times)


# ---- seconds per problem -------------------------------------------------------------------------------

# The rates of the roofline estimate below: what cuDNN and our kernels reach on an H200 on large 3x3 layers
# (strict fp32 about 54 TFLOP/s, TF32 about 160; benchmarks/results/bench_layers_h200*.md) and a sustained
# HBM read+write rate. Only their ratio matters: the estimate ranks problems within one forward pass.
_FLOPS_FP32 = 50e12
_FLOPS_TF32 = 150e12
_BYTES_PER_S = 4e12

MIN_SHARE_SECONDS = 2.0
"""The least a problem gets when seconds are allotted by share (and never more than the per-problem budget):
cuDNN's baseline, the measurement of the start points compiled up front and the finalists' re-timing fit in
it (about 1.5 s on the H200, ``first_call.py``'s phases), a search batch hardly does."""


def estimated_seconds(problem: ConvProblem) -> float:
    """A roofline estimate of one call's GPU time: its multiply-adds at a conv's sustained rate or the words
    every kernel must move at HBM's, whichever is longer (``iobound.compulsory_words``)."""
    from . import iobound

    rate = _FLOPS_TF32 if problem.tf32 else _FLOPS_FP32
    words = sum(iobound.compulsory_words(problem).values())
    element = torch.finfo(getattr(torch, problem.dtype)).bits // 8
    return max(problem.flops / rate, words * element / _BYTES_PER_S)


def allot_seconds(found: Discovery, seconds: float) -> dict[ConvProblem, float]:
    """Tuning seconds per problem of a model: ``seconds`` (the per-problem budget) for each problem whose share
    of its forward pass's conv time is at least an even share, less for the others in proportion, at
    least ``MIN_SHARE_SECONDS``.

    Why: a model's pre-tuning time is what its user waits, and a problem's tuning can win back at most its
    own share of the forward. ResNet-18 at N=32 spends 0.7% of its conv time in each of three 1x1 stride-2
    layers and 24% in four 3x3 64-channel ones; an even budget spent 7 s on each. The share is
    the problem's time in the pass over the pass's sum, per example input (one batch size each); a problem
    used by several passes takes its largest share. With P unique problems in a pass, a problem gets
    ``seconds x P x share``, capped at ``seconds``: an even split keeps every problem at ``seconds``.

    A problem's time in a pass is its calls there times torch's own conv on it (``Discovery.stock_us``,
    measured on the GPU), or, where not all of a pass's problems were timed, times ``estimated_seconds``: the
    estimate misjudges layers cuDNN runs far from the roofline (AlexNet's conv1, C=3: 90 us estimated, 207 us
    measured at N=32), which are the ones with the most to win."""
    out: dict[ConvProblem, float] = {}
    uses: dict[int, dict[ConvProblem, int]] = {}
    for p in found.problems:
        for i, calls in (found.uses.get(p) or {0: 1}).items():
            uses.setdefault(i, {})[p] = calls
    passes: dict[int, dict[ConvProblem, float]] = {}
    for i, calls in uses.items():
        timed = all((found.stock_us.get(p) or 0) > 0 for p in calls)
        passes[i] = {p: n * (found.stock_us[p] if timed else estimated_seconds(p)) for p, n in calls.items()}
    least = min(seconds, MIN_SHARE_SECONDS)
    for times in passes.values():
        total = sum(times.values())
        for p, t in times.items():
            share = t / total if total > 0 else 1.0 / len(times)
            out[p] = max(out.get(p, 0.0), min(seconds, max(least, seconds * len(times) * share)))
    return out


# ---- progress ------------------------------------------------------------------------------------------

class Progress(Protocol):
    """What a tuning step reports while it tunes one problem."""

    def cudnn(self, time_us: float) -> None: ...
    def trial(self, status: str, time_us: float | None) -> None: ...


class _Bar:
    """A tqdm bar over this rank's problems, counted in trials (each problem is worth its budget of trials,
    so the ETA follows the tuning work; a problem that stops early or is cached fills its share at once).
    Shows the problem, trials, best time so far against cuDNN."""

    def __init__(self, problems: int, per_problem: int, enabled: bool | None, label: str, position: int):
        self.per_problem = max(1, per_problem)
        self._quiet = enabled is False
        self._bar = None
        if enabled is not False:
            from tqdm.auto import tqdm

            # disable=None: tqdm's own test, no bar when stderr is not a terminal (logs get one line per problem)
            bar = tqdm(total=problems * self.per_problem, unit="trial", desc=label, position=position,
                       dynamic_ncols=True, smoothing=0.1, leave=True, disable=None if enabled is None else False)
            self._bar = None if bar.disable else bar
        self.start(None)

    def start(self, problem: ConvProblem | None) -> None:
        self.problem = problem
        self.trials = 0
        self.best: float | None = None
        self.cudnn_us: float | None = None
        self._show()

    def cudnn(self, time_us: float) -> None:
        self.cudnn_us = time_us
        self._show()

    def trial(self, status: str, time_us: float | None) -> None:
        self.trials += 1
        if status == "ok" and time_us is not None and (self.best is None or time_us < self.best):
            self.best = time_us
        if self._bar is not None and self.trials <= self.per_problem:
            self._bar.update(1)
        self._show()

    def finish(self, note: str) -> None:
        if self._bar is not None:
            self._bar.update(max(0, self.per_problem - min(self.trials, self.per_problem)))
            self._bar.write(note, file=sys.stderr)  # (tqdm's write goes to stdout unless told: the bar's stream)
        elif not self._quiet:
            print(note, file=sys.stderr, flush=True)

    def _show(self) -> None:
        if self._bar is None or self.problem is None:
            return
        best = "-" if self.best is None else f"{self.best:.1f}us"
        ref = "" if self.cudnn_us is None else f" cuDNN {self.cudnn_us:.1f}us"
        self._bar.set_postfix_str(f"{self.problem.short()} | trials {self.trials} | best {best}{ref}",
                                  refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---- the tuning step -----------------------------------------------------------------------------------

Record = dict
"""A winner, ready to travel between processes (pickle) and be written to any cache: ``key``, the
``put_plan`` fields (problem, env, family, config, time_us, aten_us, default_us, evaluations, tune_seconds,
cubin_digests), ``cubins`` (dicts: digest, name, lowered_name, cubin bytes), ``trials`` (rows),
``cached`` (True when it came from the cache rather than this run), ``host`` and ``rank``."""

TuneStep = Callable[[ConvProblem, int, Progress], Record]


class _ProgressListener:
    """A Tuner listener that reports to a ``Progress``: cuDNN's baseline time, then every candidate's status
    and time (a baseline that did not run has no time to show and is not a candidate)."""

    def __init__(self, progress: Progress):
        self.progress = progress

    def __call__(self, event: TrialEvent) -> None:
        if event.phase != "baseline":
            self.progress.trial(event.outcome.status, event.outcome.time_us)
        elif event.outcome.ok:
            self.progress.cudnn(event.outcome.time_us)


class RuntimeTuneStep:
    """The real tuning step: the process's runtime tunes ``problem`` on CUDA ``device`` (or finds it in the
    cache) and the stored winner comes back as a Record with its cubins and trials."""

    def __init__(self, budget: int | None = None, seconds: float | None = None, strategy: str | None = None,
                 seed: int | None = None):
        self.budget, self.seconds, self.strategy, self.seed = budget, seconds, strategy, seed
        self.allotted: dict[ConvProblem, float] = {}  # seconds per problem where not ``seconds`` (allot_seconds)

    def evaluations(self) -> int:
        from . import settings

        return self.budget or settings.budget_evaluations()

    def per_problem_seconds(self) -> float:
        from . import settings

        return self.seconds or settings.budget_seconds()

    def seconds_for(self, problem: ConvProblem | None) -> float:
        return self.allotted.get(problem, self.per_problem_seconds())

    def allot(self, seconds: dict[ConvProblem, float]) -> None:
        self.allotted = dict(seconds)

    def _tuner_options(self, problem: ConvProblem | None = None) -> dict:
        from .tuning.common import Budget

        return dict(budget=Budget(self.evaluations(), self.seconds_for(problem)), strategy=self.strategy,
                    seed=self.seed)

    def prepare(self, problems: Sequence[tuple[ConvProblem, int]]) -> int:
        """Before the first problem is tuned: every family's start point for each problem, compiled in one
        parallel wave per device (``Runtime.prefetch_starts``). Returns how many configurations it asked for."""
        options = self._tuner_options()
        by_device: dict[int, list[ConvProblem]] = {}
        for problem, device in problems:
            by_device.setdefault(device, []).append(problem)
        rt = runtime.get()
        return sum(rt.prefetch_starts(probs, device, tuner_options=options) for device, probs in by_device.items())

    def __call__(self, problem: ConvProblem, device: int, progress: Progress) -> Record:
        from .jit.compiler import KernelSpec

        rt = runtime.get()
        dev = rt.device(device)
        t0 = time.perf_counter()
        key, row, tuned_now = rt.pretune(problem, device, tuner_options=self._tuner_options(problem),
                                         listeners=[_ProgressListener(progress)])
        wall = time.perf_counter() - t0  # the whole step: cache look, claim, tuning, storing, loading the winner
        phases = dict(rt.results[-1].phases) if tuned_now and rt.results else {}
        cache = rt.cache()
        cubins = []
        family = FAMILIES.get(row["family"])
        for digest in row["cubin_digests"]:
            hit = cache.get_cubin(digest)
            if hit is not None and family is not None:
                cubins.append({"digest": digest, "name": KernelSpec(family, row["config"], dev.compiler.arch).name,
                               "lowered_name": hit[1], "cubin": hit[0]})
        rec = make_record(key, row, cubins=cubins, trials=cache.trials(key) if tuned_now else [],
                          cached=not tuned_now, wall_seconds=wall, phases=phases)
        rec["budget_seconds"] = self.seconds_for(problem) if tuned_now else None  # a cached plan was given none
        return rec


def make_record(key: str, plan: dict, *, cubins: Sequence[dict] = (), trials: Sequence[dict] = (),
                cached: bool = False, rank: int = 0, wall_seconds: float | None = None,
                phases: dict | None = None) -> Record:
    """A Record from a plan (a cache row or the same fields). ``wall_seconds``: the tuning step's wall time in
    this process; ``phases``: the tuner's seconds per phase (setup, compile, check, measure, strategy,
    finalists)."""
    fields = ("problem", "env", "family", "config", "time_us", "aten_us", "default_us", "evaluations",
              "tune_seconds", "cubin_digests")
    record = {f: plan[f] for f in fields}
    record["cubin_digests"] = list(record["cubin_digests"])
    record.update(key=key, cubins=list(cubins), trials=list(trials), cached=bool(cached),
                  host=socket.gethostname(), rank=rank, wall_seconds=wall_seconds, phases=dict(phases or {}))
    return record


# ---- the report ----------------------------------------------------------------------------------------

def _plan_name(family: str, config: dict | None) -> str:
    fam = FAMILIES.get(family)
    if config is None or fam is None:
        return "aten (cuDNN)" if family == "aten" else family
    return fam.name(config)


@dataclass
class LayerReport:
    """One unique problem: the layers (calls) that use it and its plan."""

    problem: ConvProblem
    layers: list[str]
    plan: str
    family: str
    config: dict | None
    time_us: float
    aten_us: float | None
    evaluations: int
    tune_seconds: float
    cached: bool
    rank: int = 0
    wall_seconds: float | None = None  # the tuning step's wall time (None: not measured, e.g. a cached plan)
    phases: dict = field(default_factory=dict)  # the tuner's seconds per phase when it tuned now
    budget_seconds: float | None = None  # the seconds it was given (allot_seconds; None: not said)

    @property
    def speedup(self) -> float | None:
        return None if not self.aten_us or not self.time_us else self.aten_us / self.time_us

    def as_dict(self) -> dict[str, Any]:
        return {"problem": self.problem.as_dict(), "short": self.problem.short(), "layers": list(self.layers),
                "plan": self.plan, "family": self.family, "config": self.config, "time_us": self.time_us,
                "aten_us": self.aten_us, "speedup": self.speedup, "evaluations": self.evaluations,
                "tune_seconds": self.tune_seconds, "cached": self.cached, "rank": self.rank,
                "wall_seconds": self.wall_seconds, "phases": dict(self.phases), "budget_seconds": self.budget_seconds}


@dataclass
class ModelReport:
    """The result of ``tune_model``: one row per unique problem, the layers left to ATen and why, totals."""

    rows: list[LayerReport]
    unsupported: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    world_size: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    """What produced the report, where a caller says (the tune command: GPU, versions, date, the command line, its
    settings and wall time); written to and read from the JSON as is."""
    prefetch: dict[str, Any] = field(default_factory=dict)
    """This rank's up-front wave of every problem's start points: ``configs`` asked for, ``seconds`` (part of
    ``seconds``, before the first problem's tuning: the compiles, and the strategy's imports beside them; it
    overlaps the stock timing); empty when there was none."""
    setup: dict[str, float] = field(default_factory=dict)
    """Where ``seconds`` went before the first problem's tuning: ``discover_s`` (the forward passes that find the
    problems), ``stock_s`` (torch's conv timed per problem, when seconds are split by share), ``prefetch_wait_s``
    (the start points' wave still running after that) and ``before_tuning_s`` (all of it)."""

    @property
    def tuned(self) -> int:
        """Problems tuned in this run (the others came from the cache)."""
        return sum(1 for r in self.rows if not r.cached)

    def conv_time_by_batch(self) -> dict[int, tuple[float, float]]:
        """Per batch size: (cuDNN us, planned us) summed over the conv layers of one forward (a layer called
        twice in one forward with the same shape counts once)."""
        out: dict[int, list[float]] = {}
        for r in self.rows:
            if r.aten_us is None:
                continue
            acc = out.setdefault(r.problem.n, [0.0, 0.0])
            acc[0] += r.aten_us * len(r.layers)
            acc[1] += r.time_us * len(r.layers)
        return {n: (a, b) for n, (a, b) in sorted(out.items())}

    def as_dict(self) -> dict[str, Any]:
        return {"rows": [r.as_dict() for r in self.rows], "unsupported": [list(u) for u in self.unsupported],
                "seconds": self.seconds, "world_size": self.world_size, "tuned": self.tuned, "meta": self.meta,
                "prefetch": self.prefetch, "setup": self.setup,
                "conv_time_by_batch": {str(n): {"cudnn_us": a, "planned_us": b}
                                       for n, (a, b) in self.conv_time_by_batch().items()}}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1, sort_keys=True)

    def save(self, path) -> None:
        from pathlib import Path

        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelReport":
        rows = [LayerReport(problem=ConvProblem.from_dict(r["problem"]), layers=list(r["layers"]), plan=r["plan"],
                            family=r["family"], config=r["config"], time_us=r["time_us"], aten_us=r["aten_us"],
                            evaluations=r["evaluations"], tune_seconds=r["tune_seconds"], cached=r["cached"],
                            rank=r.get("rank", 0), wall_seconds=r.get("wall_seconds"),
                            phases=dict(r.get("phases") or {}), budget_seconds=r.get("budget_seconds"))
                for r in d["rows"]]
        return cls(rows=rows, unsupported=[tuple(u) for u in d.get("unsupported", [])],
                   seconds=d.get("seconds", 0.0), world_size=d.get("world_size", 1), meta=dict(d.get("meta") or {}),
                   prefetch=dict(d.get("prefetch") or {}), setup=dict(d.get("setup") or {}))

    def __str__(self) -> str:
        head = (f"{'problem':<46} {'layers':<22} {'cuDNN us':>9} {'plan us':>9} {'speedup':>8} {'trials':>6} "
                f"{'tune s':>9}  plan")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            layers = ",".join(r.layers)
            layers = layers if len(layers) <= 22 else layers[:19] + "..."
            speed = "-" if r.speedup is None else f"{r.speedup:.2f}x"
            aten = "-" if r.aten_us is None else f"{r.aten_us:.1f}"
            tune = "cached" if r.cached else f"{r.tune_seconds:.1f}" + (
                f"/{r.budget_seconds:.1f}" if r.budget_seconds is not None else "")
            lines.append(f"{r.problem.short():<46} {layers:<22} {aten:>9} {r.time_us:9.1f} {speed:>8} "
                         f"{r.evaluations:6d} {tune:>9}  {r.plan}")
        for n, (a, b) in self.conv_time_by_batch().items():
            lines.append(f"N={n}: all convs {a:.1f} us with cuDNN -> {b:.1f} us planned ({a / b:.2f}x)")
        given = sorted(r.budget_seconds for r in self.rows if not r.cached and r.budget_seconds is not None)
        if given and given[0] < given[-1]:
            full = sum(1 for g in given if g == given[-1])
            lines.append(f"tuning seconds by each problem's share of its forward's conv time: {full} at "
                         f"{given[-1]:.1f} s, {len(given) - full} at {given[0]:.1f}-{given[-full - 1]:.1f} s "
                         "(tune --even: all at the full budget)")
        for layer, reason in dict.fromkeys(self.unsupported):
            lines.append(f"not tuned: {layer}: {reason} (runs through ATen)")
        lines.append(f"{len(self.rows)} unique problems, {self.tuned} tuned now, "
                     f"{len(self.rows) - self.tuned} from the cache, in {self.seconds:.1f} s"
                     + (f" on {self.world_size} ranks" if self.world_size > 1 else "")
                     + (f" ({self.prefetch['seconds']:.1f} s of it compiling {self.prefetch['configs']} start points "
                        "up front, the strategy's imports beside them)" if self.prefetch.get("configs") else ""))
        return "\n".join(lines)


def _layer_report(problem: ConvProblem, layers: list[str], rec: Record) -> LayerReport:
    return LayerReport(problem=problem, layers=layers, plan=_plan_name(rec["family"], rec["config"]),
                       family=rec["family"], config=rec["config"], time_us=float(rec["time_us"]),
                       aten_us=None if rec["aten_us"] is None else float(rec["aten_us"]),
                       evaluations=int(rec["evaluations"]), tune_seconds=float(rec["tune_seconds"]),
                       cached=bool(rec["cached"]), rank=int(rec.get("rank", 0)),
                       wall_seconds=rec.get("wall_seconds"), phases=dict(rec.get("phases") or {}),
                       budget_seconds=rec.get("budget_seconds"))


# ---- the API -------------------------------------------------------------------------------------------

def tune_model(model: nn.Module, example_inputs, *, budget: int | None = None, seconds: float | None = None,
               strategy: str | None = None, seed: int | None = None, progress: bool | None = True,
               step: TuneStep | None = None, group=None, even: bool = False) -> ModelReport:
    """Pre-tune every TunedConv2d problem of ``model`` for the given example inputs; return a ModelReport.

    ``example_inputs``: a Tensor, or a list with one entry per forward (a Tensor, a tuple of positional
    arguments or a dict of keyword arguments), e.g. one input per batch size. Inputs must be on the GPU the
    model will run on, in the dtype, memory format and TF32 mode (``torch.backends.cudnn.allow_tf32``) of
    production: all of them are part of the problem key. ``budget`` (evaluations) and ``seconds`` bound the
    search per problem (default BAGF_BUDGET and BAGF_TIME_BUDGET), ``seconds`` in full for each problem with at
    least an even share of its forward's stock conv time and less for the others (``allot_seconds``; ``even``:
    every problem gets ``seconds``); ``strategy`` and ``seed`` as in
    BAGF_STRATEGY / BAGF_SEED. Problems already in the cache are not tuned again. ``progress``: True shows a
    tqdm bar on stderr, None shows it when stderr is a terminal (one line per problem otherwise), False is
    silent.

    Inside an initialised ``torch.distributed`` process group (``torchrun``; or ``group``), the unique
    problems are split across ranks, each rank tunes its share on its own GPU, and every rank gets the whole
    report; rank 0 writes every winner (with its cubins) into its cache. ``step`` replaces the tuning step
    (``step(problem, device, progress) -> Record``; tests replay recorded timings with it).

    Example::

        >>> report = bagf_torch.tune_model(model, [torch.randn(n, 3, 224, 224, device="cuda")  # doctest: +SKIP
        ...                                        for n in (1, 32, 128)], budget=20)
        >>> print(report)                                                                       # doctest: +SKIP
    """
    from . import distributed

    t0 = time.perf_counter()
    found = discover(model, example_inputs)
    setup: dict[str, float] = {"discover_s": time.perf_counter() - t0}
    if step is None:
        off_gpu = [p for p in found.problems if found.devices[p] < 0]
        if off_gpu or not found.problems and found.unsupported:
            why = found.unsupported[0][1] if found.unsupported else "inputs are not on a CUDA device"
            raise ValueError(f"nothing to tune: {why}; move the model and example inputs to the GPU (.cuda()), "
                             "in the dtype and memory format production will run (float32 NCHW; float16 or bfloat16, "
                             "NCHW or channels_last)")
        step = RuntimeTuneStep(budget=budget, seconds=seconds, strategy=strategy, seed=seed)
        from . import epilogue

        for device in sorted({found.devices[p] for p in found.problems}):  # (a fused model's pooling kernel too)
            epilogue.prepare(model, device)
            epilogue.prepare_relu(model, device,  # (and the ReLU epilogue's sign rule in the problems' dtypes there)
                                  {getattr(torch, p.dtype) for p in found.problems if found.devices[p] == device})
    per_problem = step.evaluations() if hasattr(step, "evaluations") else (budget or 1)
    ctx = distributed.Context.current(group)
    mine = distributed.shard(found.problems, ctx.world_size, ctx.rank)
    label = "tuning" if ctx.world_size == 1 else f"rank {ctx.rank} tuning"
    prefetch: dict[str, Any] = {}
    prepare = getattr(step, "prepare", None)
    wave = None
    if prepare is not None and mine:
        # one compile wave for the whole share's start points, before the first problem's budget starts; only a
        # head start: a failure here leaves each tuning to compile its own. The compiles run on the host while
        # torch's conv is timed on the GPU below (on the H200 the wave took about 6 s of ResNet-18's pre-tuning).
        if progress is not False:
            print(f"{label}: compiling the start points of {len(mine)} problems up front", file=sys.stderr, flush=True)
        wave = _Background(lambda: prepare([(p, found.devices[p]) for p in mine]))
    try:
        if hasattr(step, "allot"):  # a step used again for an even run must not keep an earlier split
            if not even:
                t1 = time.perf_counter()
                found.stock_us = time_stock(found)
                setup["stock_s"] = time.perf_counter() - t1
            step.allot({} if even else allot_seconds(found, step.per_problem_seconds()))
    finally:  # the wave ends before tune_model does, however it ends (no compiles left running into the cache)
        if wave is not None:
            t1 = time.perf_counter()
            try:
                prefetch = {"configs": wave.result(), "seconds": wave.seconds}
            except Exception as e:
                log.logger().warning(f"compiling the start points up front failed ({type(e).__name__}: {e}); each "
                                     "problem's tuning compiles its own")
            setup["prefetch_wait_s"] = time.perf_counter() - t1
    setup["before_tuning_s"] = time.perf_counter() - t0
    bar = _Bar(len(mine), per_problem, progress, label, position=ctx.rank)
    records: list[Record] = []
    try:
        for problem in mine:
            bar.start(problem)
            rec = step(problem, found.devices[problem], bar)
            rec["rank"] = ctx.rank
            records.append(rec)
            speed = "" if not rec["aten_us"] else f" ({rec['aten_us'] / rec['time_us']:.2f}x vs cuDNN)"
            bar.finish(f"{'cached' if rec['cached'] else 'tuned '} {problem.short()}: "
                       f"{_plan_name(rec['family'], rec['config'])} {rec['time_us']:.1f} us{speed}")
    finally:
        bar.close()
    everything = ctx.all_gather(records)
    if ctx.world_size > 1 and ctx.rank == 0:
        distributed.write_records(runtime.get().cache(), everything)
    by_key = {ConvProblem.from_dict(r["problem"]): r for r in everything}
    rows = [_layer_report(p, found.layers[p], by_key[p]) for p in found.problems if p in by_key]
    missing = [p.short() for p in found.problems if p not in by_key]
    if missing:
        raise RuntimeError(f"no winner came back for {len(missing)} problems ({missing[0]}, ...); a rank "
                           "must have skipped its share")
    return ModelReport(rows=rows, unsupported=found.unsupported, seconds=time.perf_counter() - t0,
                       world_size=ctx.world_size, prefetch=prefetch, setup=setup)


class _Background:
    """``fn()`` on a daemon thread, started at once; ``result()`` waits for it and returns its value or raises
    its exception; ``seconds`` is how long it ran."""

    def __init__(self, fn: Callable[[], Any]):
        import threading

        self._value: Any = None
        self._error: BaseException | None = None
        self.seconds = 0.0

        def run() -> None:
            t = time.perf_counter()
            try:
                self._value = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
                self._error = e
            finally:
                self.seconds = time.perf_counter() - t

        self._thread = threading.Thread(target=run, name="bagf-prefetch", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


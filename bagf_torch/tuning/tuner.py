"""The Tuner: a plain object that searches one problem's kernel space with a strategy.

Its compiler, checker and benchmarker are passed in, so its logic runs on a CPU in tests with fakes that
replay recorded timings (the real ones live in ``jit.compiler`` and ``tuning.measure``).

For one problem it: measures torch's own conv (cuDNN) and the family's default configuration; lets the
strategy propose configurations, each of which is compiled (in parallel batches), checked against a float64
reference and only then timed (with an early cut-off for hopeless candidates); re-measures the best few
interleaved with cuDNN; and returns the winner, which is "aten" when nothing beats cuDNN.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Sequence

import torch

from .. import iobound, log, shutdown
from ..kernels import format_refuses
from ..kernels.space import Config, Space, config_key
from ..ops import ATEN
from ..problem import ConvProblem
from . import strategies
from .backend import TrialBackend
from .common import Budget, Outcome, Phase, TrialEvent, TrialListener, tuning_context


STALL_WARN_S = 5.0
"""How long a strategy step must have run, when the tuner abandons it at its family's deadline, to be reported as a
stall (a warning) rather than the end of the family's share (logged at INFO). An Ax step took 0.4 s on average on
the H200's host (5.5 s of model fits and 4.7 s of acquisition over 27 generations in a profiled AlexNet tuning); its
generation has also stalled for minutes inside pandas. At short budgets most families' last step outlasts their
share: a warning for each (five in a ResNet-18 pre-tuning at 7 s per problem) would be noise. Either way the step is
abandoned at the deadline and costs the tuning nothing more; a share shorter than this never warns, a hung step
in it included (its thread, a daemon, is left to finish or not)."""


@contextlib.contextmanager
def _single_threaded_torch():
    """Run the search with one intra-op thread. Ax/BoTorch fit GPs on a few dozen points; with torch's thread
    pool the fit spends its time waking threads: 15-40 s per Ax generation on 2 cores against 0.6-1.5 s
    single-threaded (measured on the CI machine, implicit_gemm space, 20 evaluations), and tuning stalled for
    minutes on the 16-core H200 host. Process-wide while a problem is tuned; restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


ATEN_MARGIN = 1.02
"""A kernel replaces cuDNN only when its re-timed GPU time times this is at most cuDNN's: the re-timing and a CUDA
graph's replay differ by a few percent at N = 1 (on the H200 a TF32 plan re-timed below cuDNN replayed 6% above it in
a graph), and a plan that ties cuDNN gains nothing but the risk of being slower."""


class BudgetSpent(Exception):
    """The tuner's time budget leaves no room for the batch a search asked for: the search ends there, and the
    tuner chooses among what was measured."""


class _Deadline:
    """The wall-clock budget of one tuning, end to end, and what its steps have been seen to cost.

    Before a batch is compiled, ``fits`` keeps only the candidates whose compile waves (``workers`` NVRTC
    compiles at a time) and checks and timings are expected to end in time, from the costs measured so far in
    this run. Costs are kept per family: an NVRTC compile of winograd_gemm's wgmma kernels takes several times
    one of implicit_gemm's, and a check at batch 128 of a slow family several times one of a fast family. A
    family not yet seen is taken to cost what the costliest seen family costs. A batch whose cubins all came
    from the cache says nothing about compiling (it is a load): only real compiles update the compile cost,
    else the start points' cached loads drive it to zero and the next real wave runs past the budget.

    The finalists' interleaved re-timing keeps a reserve: at least one round of every finalist and cuDNN, up to
    ``MAX_ROUNDS`` rounds within ``RESERVE_FRACTION`` of the budget; it runs as many rounds as are left
    (``finalist_rounds``, at least one). Until a cost has been seen once it is taken as zero, so the overshoot
    is bounded by one step: one compile wave, one check and timing, or one round of re-timing; and when the
    prefetch wave of the start points runs past the end, by one load, check and timing per family (``one_start``:
    28-38 ms each on the H200 in TF32 mode, up to about 90 ms in 16 bits: 0.3-0.8 s over nine families) and one
    round of re-timing."""

    MAX_ROUNDS = 5
    RESERVE_FRACTION = 0.2
    MIN_EVAL_S = 0.05  # the slack ``one_start`` leaves beyond an evaluation's cost seen so far (none, at first)

    def __init__(self, clock: Callable[[], float], end: float, seconds: float, workers: int, finalists: int,
                 waves: dict[str, float] | None = None):
        self.clock = clock
        self.end = end
        self.seconds = seconds
        self.workers = workers
        self.finalists = finalists
        # family -> one wave of parallel NVRTC compiles. ``waves`` is the compiler's own record, kept across the
        # problems a process tunes: a later problem's start points come from the cubin cache, so its tuning
        # would otherwise see its first real compile wave only when it had already run past the budget (on the
        # H200 a wave of winograd_gemm's wgmma kernels took AlexNet conv5 at N=32 to 10.8 s of a 5 s budget).
        self.wave_s: dict[str, float] = waves if waves is not None else {}
        self.eval_s: dict[str, float] = {}  # family -> check + timing of one compiled candidate
        self.time_s: float | None = None    # one timing of a candidate that ran (what the re-timing repeats)

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else 0.5 * (old + new)

    @staticmethod
    def _cost(costs: dict[str, float], family: str) -> float:
        return costs[family] if family in costs else max(costs.values(), default=0.0)

    def compiled(self, families: Sequence[str], compiles: int, seconds: float, unfinished: int = 0) -> None:
        """``compiles`` NVRTC compiles (cache hits not counted) of ``families`` took ``seconds`` in all; with
        ``unfinished`` more still running when the wait for them ended, the wave took longer than ``seconds``: that
        is a lower bound on a wave, kept if it is above the estimate."""
        if unfinished:
            wave = seconds / math.ceil((compiles + unfinished) / self.workers)
            for f in set(families):
                self.wave_s[f] = max(self.wave_s.get(f, 0.0), wave)
        elif compiles:
            wave = seconds / math.ceil(compiles / self.workers)
            for f in set(families):
                self.wave_s[f] = self._mean(self.wave_s.get(f), wave)

    def evaluated(self, family: str, seconds: float) -> None:
        self.eval_s[family] = self._mean(self.eval_s.get(family), seconds)

    def timed(self, seconds: float) -> None:
        self.time_s = self._mean(self.time_s, seconds)

    def _round(self) -> float:
        return (self.finalists + 1) * (self.time_s or 0.0)

    def reserve(self) -> float:
        if not math.isfinite(self.end):
            return 0.0
        one = self._round()
        return max(one, min(self.MAX_ROUNDS * one, self.RESERVE_FRACTION * self.seconds))

    def search_end(self) -> float:
        """When the search must stop so that the finalists' re-timing ends within the budget."""
        return self.end - self.reserve()

    def start_end(self) -> float:
        """When the families' compiled start points must stop being measured: one round of re-timing before the
        end. A start point is each family's one sure measurement, and its compile is paid already (the
        prefetch wave); a wave that ate the search's time must not leave a family unmeasured for the sake of
        re-timing rounds 2 to 5 (on the H200 AlexNet conv1 at N=128 kept implicit_gemm_tc at 768 us, 2.1x the
        unmeasured winograd_gemm start, after a 6 s wave of a 7 s budget)."""
        return self.end - (self._round() if math.isfinite(self.end) else 0.0)

    def one_start(self, family: str) -> float:
        """The end of the measuring of ``family``'s start point compiled by the prefetch wave: ``start_end``, or, when
        the wave has run past it, room from now for that one check and timing (its cost as seen so far) plus
        ``MIN_EVAL_S`` (the evaluator also lets a start that is loading finish its measurement). A family's start
        point is measured even then: the overshoot is one load and evaluation per family (tens of milliseconds
        each), and unmeasured every family is out of the running (on the H200 AlexNet conv1 at N = 1, the first
        problem of a process with a cold cubin cache, ended with no evaluation and cuDNN's 1.00x after a 4.9 s wave
        of its 6.4 s, where its start points would have run at 1.47x)."""
        return max(self.start_end(), self.clock() + self._cost(self.eval_s, family) + self.MIN_EVAL_S)

    def fits(self, family: str, n: int, end: float, built: int = 0) -> int:
        """How many of ``n`` candidates of ``family`` can be compiled, checked and timed before ``end``, the
        first ``built`` of them already compiled (prefetched start points), every other one taken to need a
        compile (a cache hit only makes the batch end early)."""
        if n == 0 or not math.isfinite(end):
            return n
        left = end - self.clock()
        if left <= 0:
            return 0
        wave, each = self._cost(self.wave_s, family), self._cost(self.eval_s, family)
        k = n
        while k > 0 and math.ceil(max(0, k - built) / self.workers) * wave + k * each > left:
            k -= 1
        return k

    def finalist_rounds(self, count: int) -> int:
        if not self.time_s or not math.isfinite(self.end):
            return self.MAX_ROUNDS
        left = self.end - self.clock()
        return max(1, min(self.MAX_ROUNDS, int(left / (count * self.time_s))))


class _Search:
    """One strategy run in a thread of its own, its evaluations done on the tuner's thread.

    The GPU work stays on the calling thread (its device, its stream, its CUDA context); the strategy's own
    thinking (Ax's model fit and candidate generation: seconds per generation) runs beside it and can be
    abandoned: when no request comes before the hard end (``limit[0]``, read at each wait), the tuner stops
    waiting, answers any later request of that thread with ``BudgetSpent`` and goes on with what was measured.
    Ax's generation has stalled for over two minutes inside pandas; a tuning budget that waits on it is no
    budget. The thread also has a fresh autograd/inference-mode/autocast state of its own (thread-local in
    torch), entered explicitly by ``strategies.run`` (``tuning_context(grad=True)``)."""

    def __init__(self, strategy: str, space: Space, evaluate, budget: Budget, seed: int, prior, options: dict,
                 clock: Callable[[], float]):
        self.strategy, self.space, self.evaluate, self.budget = strategy, space, evaluate, budget
        self.seed, self.prior, self.options, self.clock = seed, prior, options, clock
        self.abandoned = False  # no longer waited for (a stall, or an error on the tuner's side)
        self.stalled = False  # a step did not come back before its deadline
        self.step_s = 0.0  # how long the step in flight had run when it was abandoned
        self._requests: queue.Queue = queue.Queue()
        self._lock = threading.Lock()

    def _remote(self, configs):
        reply: queue.Queue = queue.Queue(maxsize=1)
        with self._lock:
            if self.abandoned:
                raise BudgetSpent("the tuner abandoned this search")
            self._requests.put(("evaluate", list(configs), reply))
        kind, value = reply.get()
        if kind == "error":
            raise value
        return value

    def _body(self) -> None:
        try:  # (strategies.run enters tuning_context(grad=True) itself)
            strategies.run(self.strategy, self.space, self._remote, self.budget, self.seed, clock=self.clock,
                           prior=self.prior, **self.options)
            self._requests.put(("done", None, None))
        except BaseException as e:  # handed to the tuner's thread, which decides
            self._requests.put(("failed", e, None))

    def _abandon(self) -> None:
        with self._lock:
            self.abandoned = True
        while True:  # a request that slipped in before the flag was set gets its answer too
            try:
                kind, _, reply = self._requests.get_nowait()
            except queue.Empty:
                return
            if kind == "evaluate":
                reply.put(("error", BudgetSpent("the tuner abandoned this search")))

    ENDING_GRACE_S = 2.0
    """How long the strategy thread gets to wind up once told the budget is spent, before that counts as a
    stall: at the deadline the wait would otherwise time out at once and call a normal ending abandoned."""

    FIRST_REQUEST_S = 1.0
    """How long the strategy may take to ask for its first batch even past its family's share (never past
    ``hard_end``): Ax builds its client and experiment first, and a family whose share is shorter than that was
    otherwise abandoned as stalled before it had asked for anything."""

    def run(self, limit: list[float], hard_end: float = math.inf) -> None:
        thread = threading.Thread(target=self._body, daemon=True, name=f"bagf-search-{self.space.family}")
        started = step = self.clock()  # step: since when the strategy has been thinking
        first_by = max(limit[0], min(hard_end, started + self.FIRST_REQUEST_S))
        thread.start()
        shutdown.track(thread)  # a step abandoned at its deadline may still be in torch when the program ends
        ending = False  # told BudgetSpent: the thread's last message is on its way
        first = True  # no message from the thread yet
        try:
            while True:
                left = self.ENDING_GRACE_S if ending else (first_by if first else limit[0]) - self.clock()
                # The search ends without a stall when the family's time ran out inside the tuner's own evaluation,
                # or the budget left the strategy less than FIRST_REQUEST_S to set up (it gets BudgetSpent at its
                # next request, if it makes one).
                spent = not ending and ((not first and left <= 0)
                                        or (first and first_by - started < self.FIRST_REQUEST_S))
                try:
                    kind, payload, reply = self._requests.get(timeout=max(0.0, left) if math.isfinite(left) else None)
                except queue.Empty:
                    self.stalled = not spent
                    self.step_s = self.clock() - step
                    self._abandon()
                    return
                first = False
                if kind == "evaluate":
                    try:
                        reply.put(("ok", self.evaluate(payload)))
                    except BaseException as e:  # BudgetSpent included: the strategy ends and says so
                        ending = ending or isinstance(e, BudgetSpent)
                        reply.put(("error", e))
                    step = self.clock()
                elif kind == "done":
                    return
                elif isinstance(payload, BudgetSpent):
                    return
                else:
                    raise payload
        except BaseException:
            self._abandon()
            raise
        finally:
            # A thread that outlives this (abandoned in a stall) must not keep the tuner's workspace -- GPU
            # tensors -- or its trials alive through the evaluator's closure.
            self.evaluate = None


def _compiles(built: Sequence) -> int:
    """How many of a batch's candidates NVRTC compiled now, not loaded from the cubin cache; a compiler that does
    not say (``compile_seconds``) is taken to have compiled each. Compile errors are not counted: a failure the
    compiler remembers comes back at once, and counting it would pull the estimate toward zero (its time, when
    NVRTC did run, stays in the batch's seconds, so the estimate errs high). A compile not waited for to the end
    (None, ``KernelCompiler.compile_within``) is not counted either."""
    n = 0
    for b in built:
        if b is not None and not isinstance(b, Outcome):
            s = getattr(b, "compile_seconds", None)
            n += s is None or s > 0
    return n


def sized_start(family: ModuleType, problem: ConvProblem, sms: int | None = None,
                arch: str | None = None) -> Config | None:
    """``family.default_for(problem[, sms][, arch=arch])``, ``arch`` (e.g. "sm_90") passed only to a
    ``default_for`` that takes it (a start point that depends on the GPU: winograd_gemm's GEMM); None for a family
    without one. ``Tuner.start_config`` and the replay (benchmarks/strategies.py) size starts through this."""
    if not hasattr(family, "default_for"):
        return None
    kw = {"arch": arch} if arch and "arch" in inspect.signature(family.default_for).parameters else {}
    return family.default_for(problem, sms, **kw) if sms else family.default_for(problem, **kw)


def family_alternatives(family: ModuleType, problem: ConvProblem, sms: int | None = None,
                        arch: str | None = None) -> list[Config]:
    """``family.start_alternatives(problem, sms, arch)`` (the GPU's SMs, 132 when unknown); [] for a family without
    it. Used by ``Tuner.start_alternatives`` and the replay."""
    alternatives = getattr(family, "start_alternatives", None)
    return [] if alternatives is None else [dict(c) for c in alternatives(problem, sms or 132, arch)]


def _bound_to(family: ModuleType, name: str, problem: ConvProblem, sms: int | None):
    """``family.<name>(problem, config[, sms])`` as a function of the configuration, or None when the family
    has no such function."""
    fn = getattr(family, name, None)
    if fn is None:
        return None
    if sms:
        return lambda config: fn(problem, config, sms)
    return lambda config: fn(problem, config)


def search_features(family: ModuleType, problem: ConvProblem, sms: int | None = None):
    """The problem-aware inputs a strategy that models the space may use (ax's ``features`` option):
    ``family.features(problem, config[, sms])`` bound to ``problem``, or None when the family has none."""
    return _bound_to(family, "features", problem, sms)


def search_initial_order(family: ModuleType, problem: ConvProblem, sms: int | None = None):
    """How a strategy that starts with a local design may rank the start point's neighbours before any time
    is known (ax's ``initial_order`` option): ``family.warps_in_flight(problem, config[, sms])`` bound to
    ``problem``, or None when the family has none."""
    return _bound_to(family, "warps_in_flight", problem, sms)


def search_cold_order(family: ModuleType, problem: ConvProblem, sms: int | None = None):
    """How a strategy that starts with nothing measured may rank the whole space before any time is known (ax's
    ``cold_order`` option, higher first): minus ``family.estimated_time(problem, config[, sms])`` bound to
    ``problem``, or None when the family has none."""
    estimate = _bound_to(family, "estimated_time", problem, sms)
    return None if estimate is None else (lambda config: -estimate(config))


SEARCH_HOOKS = (("features", search_features), ("initial_order", search_initial_order),
                ("cold_order", search_cold_order))
"""The problem-aware options a strategy may take, and how each is made from the family and the problem."""


def search_options(strategy: str, family: ModuleType, problem: ConvProblem, sms: int | None = None,
                   options: dict | None = None) -> dict:
    """``options`` with each of ``SEARCH_HOOKS`` that ``strategy`` takes added for ``family`` on ``problem`` where
    ``options`` does not set it (the caller's setting wins, None too: that option left out). The tuner and the
    replay (benchmarks/strategies.py) give a search the same inputs through this."""
    out = dict(options or {})
    known = strategies.STRATEGIES[strategy].OPTIONS
    for option, make in SEARCH_HOOKS:
        if option in known and option not in out:
            out[option] = make(family, problem, sms)
    return out


@dataclass
class Trial:
    family: str
    config: Config | None
    outcome: Outcome


REACH_MARGIN = 1.25
"""``Tuner._within_reach`` leaves a family out only where the error its arithmetic makes before any summation misses
a check bound by more than this factor (TF32 products on C = 3 layers miss fp32's by about 2x)."""


@dataclass
class TuneResult:
    """The winner of one tuning run and how it was reached."""

    problem: ConvProblem
    family: str                 # kernel family, or "aten"
    config: Config | None       # None for "aten"
    handle: int                 # op plan handle; ATEN (-1) for torch's conv
    time_us: float              # winner's re-measured median
    aten_us: float              # cuDNN's re-measured median
    default_us: float | None    # the winning family's start configuration (first measurement; the
    #                             problem-sized default, see Tuner.start_config); for "aten", the first family's
    evaluations: int            # candidates that reached the GPU
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    trials: list[Trial] = field(default_factory=list)
    defaults: dict[str, float | None] = field(default_factory=dict)  # family -> its start's time (None: failed)
    pruned: dict[str, tuple[int, int]] = field(default_factory=dict)  # family -> (kept, valid) when pruning ran
    left_out: dict[str, str] = field(default_factory=dict)  # family -> why its arithmetic cannot pass the check here

    @property
    def speedup(self) -> float:
        return self.aten_us / self.time_us


class Tuner:
    """Tunes one problem at a time, over one or several kernel families.

    ``backend`` (a ``tuning.backend.TrialBackend``) is where the trials run: its compiler, checker, benchmarker
    and workspace, on this process's GPU, in an isolated worker, or replayed from a recording.

    Algorithm is a tuning dimension: ``family`` may be a list of families. Each family is searched as its
    own experiment (one strategy run over its own space), with the budget split by measured speed: every
    family's start configuration (``start_config``: its default, sized to the problem where the family
    knows how) is measured first; families slower than ``cutoff_factor`` x the best
    default get nothing more; the others share the remaining evaluations and seconds in proportion to their
    default's speed (1/time), fastest family first, and time a family leaves unused passes on. One experiment
    per family rather than one Ax experiment with a family choice: the families' knobs differ (a joint space
    would be conditional, which Ax's GP handles poorly), and a per-family space keeps each search's
    encoding small and dense.

    ``prune_factor`` (0 = off): before a family's search, its space is restricted to the configurations whose
    modelled global-memory traffic (``iobound.prune``) is within that factor of the best for the problem; the
    family's DEFAULT is always kept. Families without a traffic model are searched whole.

    ``finalists``: the fastest this many candidates, and cuDNN, are re-timed in interleaved rounds before the
    winner is chosen. Five, not three: at batch 1 the best candidates are within 1-2 us of each other at ~30 us
    and one search-time sample can misorder them (with three, AlexNet conv2 at N=1 kept a neighbour of the
    optimum 5% slower on 2 of 4 seeds); the extra re-timing costs well under a second.

    A family that defines ``applies(problem)`` (Winograd: 3x3 stride 1 only) is left out of a problem it does
    not apply to; when none applies the winner is cuDNN.

    ``listeners``: each is called with a ``TrialEvent`` for every trial the moment its outcome is final, in the
    order of ``TuneResult.trials``, on the tuner's thread (the runtime writes trials to the cache this way, the
    model pre-tuning feeds its progress bar). The listeners of a check or a timing run within that step's
    measured time, so the budget's cost of a candidate includes them; one that raises is logged once and tuning
    goes on.
    """

    def __init__(self, backend: TrialBackend, family, strategy: str = "ax", budget: Budget = Budget(40), seed: int = 0,
                 strategy_options: dict | None = None, finalists: int = 5, cutoff_factor: float = 4.0,
                 space_limit: int | None = None, sms: int | None = None, prune_factor: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter, listeners: Sequence[TrialListener] = ()):
        self.backend = backend
        self.compiler = backend.compiler
        self.clock = clock  # what the seconds budget is measured with (tests pass a fake one)
        self.checker = backend.checker
        self.bench = backend.benchmarker
        self.workspace = backend.workspace
        self.families = list(family) if isinstance(family, (list, tuple)) else [family]
        self.family = self.families[0]
        self.strategy = strategy
        self.budget = budget
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            # (numpy's generators, which the strategies seed, refuse a negative one: inside the search, which the
            # tuner survives by keeping the start point, a silent loss of the whole tuning)
            raise ValueError(f"seed must be a whole number 0 or above (as BAGF_SEED), got {seed!r}")
        self.seed = seed
        self.strategy_options = dict(strategy_options or {})
        self.finalists = finalists
        self.cutoff_factor = cutoff_factor
        self.spaces = {f.FAMILY: (f.space(space_limit) if space_limit else f.space()) for f in self.families}
        self.space = self.spaces[self.family.FAMILY]
        if prune_factor and prune_factor < 1:
            raise ValueError(f"prune_factor must be 0 (off) or >= 1, got {prune_factor}")
        self.prune_factor = prune_factor
        self.sms = sms  # the device's SM count, for families whose start point depends on it
        self.listeners = list(listeners)

    def _tell(self, family: str, config: Config | None, outcome: Outcome, name: str, phase: Phase) -> None:
        """Hand one trial's final outcome to every listener, in order. A listener is an observer: its failure
        (a cache that cannot be written, a closed console) must not cost the user the tuning."""
        if not self.listeners:
            return
        event = TrialEvent(family, None if config is None else dict(config), outcome, name, phase)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception as e:
                who = getattr(listener, "__qualname__", type(listener).__qualname__)
                log.once(f"trial-listener:{who}:{type(e).__name__}",
                         f"a tuning listener ({who}) raised {type(e).__name__}: {e} on {event.line()}; tuning goes "
                         "on, and its later failures of this kind are not logged")

    def search_space(self, family: ModuleType, problem: ConvProblem) -> tuple[Space, tuple[int, int] | None]:
        """The space the strategy searches for ``family`` on ``problem``: the whole space, or with
        ``prune_factor`` set and a traffic model for the family, the part ``iobound.prune`` keeps (DEFAULT
        and the start configuration included). Also returns (kept, valid) when it pruned."""
        space = self.spaces[family.FAMILY]
        rule = getattr(family, "problem_rule", None)
        if rule is not None:  # configurations compiled for one problem geometry (direct's G) only where they apply
            space = Space(space.family, space.params, tuple(space.rules) + (lambda c: rule(c, problem),))
        arch_rule, arch = getattr(family, "arch_rule", None), getattr(self.compiler, "arch", None)
        if arch_rule is not None and arch:  # configurations that compile for one GPU only (winograd_gemm's wgmma)
            space = Space(space.family, space.params, tuple(space.rules) + (lambda c: arch_rule(c, arch),))
        if not self.prune_factor or not iobound.has_model(family):
            return space, None
        valid = space.valid_configs()
        default = [c for c in (family.DEFAULT, self.start_config(family, problem)) if space.is_valid(c)]
        kept, pruned = iobound.prune(family, valid, problem, self.prune_factor, always=default)
        reason = f"pruned: modelled traffic more than {self.prune_factor:g}x the best for {problem.short()}"
        log.logger().info(f"{family.FAMILY} on {problem.short()}: bound-guided pruning (x{self.prune_factor:g}) "
                          f"kept {len(kept)} of {len(valid)} configurations")
        return space.restrict(kept, reason), (len(kept), len(valid))

    def families_for(self, problem: ConvProblem) -> list[ModuleType]:
        """The tuner's families that compute ``problem`` (those without ``applies`` take every problem) on this
        GPU: a family whose ``arch_rule`` refuses its DEFAULT on the compiler's architecture (implicit_gemm_wgmma
        off sm_90) is left out, else its start point would be compiled, fail, and cost every problem an evaluation."""
        arch = getattr(self.compiler, "arch", None)

        def runs_here(f) -> bool:
            rule = getattr(f, "arch_rule", None)
            return rule is None or not arch or rule(f.DEFAULT, arch) is None

        return [f for f in self.families
                if format_refuses(f, problem) is None
                and (getattr(f, "applies", None) is None or f.applies(problem) is None) and runs_here(f)]

    @staticmethod
    def _within_reach(families: list[ModuleType], ws, problem: ConvProblem) -> tuple[list[ModuleType], dict[str, str]]:
        """``families`` less those whose arithmetic cannot pass this workspace's check, and {family: why} of those:
        a family with ``TF32_PRODUCTS`` (one TF32 product per multiply) where the convolution of the operands
        rounded to TF32 already misses one of the check's bounds by more than ``REACH_MARGIN`` times
        (``Workspace.tf32_operand_error``: in TF32 mode where cuDNN computes at fp32 accuracy, as on C = 3 layers,
        about twice). Their start points would be compiled, run and found wrong, in the problem's budget, and the
        search would spend more on them. (A kernel's own fp32 summation error is independent of the rounding's and
        orders of magnitude smaller: it could not bring a family back under a bound missed by the margin.) A
        workspace without the measure (an isolated worker's) leaves every family in."""
        if not any(getattr(f, "TF32_PRODUCTS", False) for f in families):
            return families, {}
        measure = getattr(ws, "tf32_operand_error", None)
        error = measure() if measure is not None else None
        rel_tol, max_tol = getattr(ws, "rel_tol", None), getattr(ws, "max_tol", None)
        if error is None or rel_tol is None or max_tol is None or (
                error[0] <= REACH_MARGIN * rel_tol and error[1] <= REACH_MARGIN * max_tol):
            return families, {}
        why = (f"TF32 products: the operands rounded to TF32 alone miss the float64 reference by {error[0]:.2e} "
               f"(max {error[1]:.2e}), beyond the check's {rel_tol:.2g} (max {max_tol:.2g})")
        left_out = {f.FAMILY: why for f in families if getattr(f, "TF32_PRODUCTS", False)}
        log.logger().info(f"{problem.short()}: {', '.join(left_out)} left out, {why}")
        return [f for f in families if f.FAMILY not in left_out], left_out

    def start_config(self, family: ModuleType, problem: ConvProblem) -> Config:
        """Where a family's search starts: ``default_for(problem, sms[, arch])`` when the family sizes its default
        to the problem (implicit_gemm_tc's split-K) or the GPU (winograd_gemm's GEMM), else its DEFAULT."""
        start = sized_start(family, problem, self.sms, getattr(self.compiler, "arch", None))
        if start is not None and self.spaces[family.FAMILY].is_valid(start):
            return start
        return family.DEFAULT

    def start_alternatives(self, problem: ConvProblem,
                           families: Sequence[ModuleType] | None = None) -> list[tuple[str, Config]]:
        """``(family, config)`` of each measured family's (``families``, default ``measured_families``)
        ``start_alternatives(problem, sms, arch)``: second start points, measured after the start points as seeds
        are."""
        arch = getattr(self.compiler, "arch", None)
        out = []
        for fam in (self.measured_families(problem) if families is None else families):
            rule = getattr(fam, "problem_rule", None)
            for c in family_alternatives(fam, problem, self.sms, arch):
                if self.spaces[fam.FAMILY].is_valid(c) and (rule is None or rule(c, problem) is None):
                    out.append((fam.FAMILY, c))
        return out

    def measured_families(self, problem: ConvProblem) -> list[ModuleType]:
        """The families whose start points a tuning of ``problem`` measures: ``families_for``, the first
        ``budget.evaluations`` of them when the evaluation budget is smaller than their number."""
        return self.families_for(problem)[: self.budget.evaluations]

    def prefetch_starts(self, problems: Sequence[ConvProblem], strategy_wait_s: float = 120.0) -> int:
        """Compile every family's start point for each of ``problems`` into the cubin cache in one parallel wave,
        before any of them is tuned (``tune_model``: a whole model's problems are known up front). One cubin
        serves every shape, so a model's problems share many start points, and each tuning's own start wave
        becomes loads (on the H200 at 7 s per problem, compiling took up to 6.7 s of an AlexNet problem's
        budget, the start wave alone up to 6 s). The wave's NVRTC times are what later tunings expect a
        family's compile wave to cost. The strategy's own imports (Ax: seconds) load meanwhile, waited for up
        to ``strategy_wait_s``. Returns how many distinct configurations it asked for."""
        prefetch = getattr(self.compiler, "prefetch", None)
        if prefetch is None:
            return 0
        items, seen = [], set()
        for problem in problems:
            by_name = {fam.FAMILY: fam for fam in self.measured_families(problem)}
            starts = [(fam, self.start_config(fam, problem)) for fam in by_name.values()]
            for fam, config in starts + [(by_name[n], c) for n, c in self.start_alternatives(problem)]:
                if (fam.FAMILY, config_key(config)) not in seen:
                    seen.add((fam.FAMILY, config_key(config)))
                    items.append((fam, config))
        if not items:
            return 0
        wait = strategies.preload(self.strategy)
        self._compile_wave(prefetch, items, _Deadline(self.clock, math.inf, math.inf, workers=self._workers(),
                                                      finalists=self.finalists,
                                                      waves=getattr(self.compiler, "wave_seconds", None)))
        if wait is not None:
            wait(strategy_wait_s)
        return len(items)

    def _workers(self) -> int:
        return max(1, int(getattr(self.compiler, "workers", 1) or 1))

    def _compile(self, family: ModuleType, configs: Sequence[Config], seconds: float) -> list:
        """The batch compiled and loaded, waiting for its compiles at most ``seconds`` where the compiler can stop
        waiting (``compile_within``; an unfinished one is None): the cost estimates behind ``_Deadline.fits`` are
        means, and a wave of a family's slowest configurations (F(5x5)'s transforms compile twice as long as
        F(2x2)'s) can take seconds more than the mean."""
        within = getattr(self.compiler, "compile_within", None)
        if within is None or not math.isfinite(seconds):
            return self.compiler.compile(family, configs)
        return within(family, configs, max(0.0, seconds))

    @staticmethod
    def _compile_wave(prefetch, items, deadline: "_Deadline") -> None:
        """``prefetch(items)`` (the compiler's parallel compile into the cubin cache), each family's NVRTC time in
        that wave recorded in ``deadline`` (and so in the compiler's record of its compile waves)."""
        for name, seconds in (prefetch(items) or {}).items():
            deadline.compiled([name], 1, seconds)

    def split_budget(self, defaults: dict[str, float | None], evaluations: int) -> dict[str, int]:
        """Evaluations per family after the defaults: by default speed, none for hopeless families."""
        if evaluations <= 0 or not defaults:
            return {f: 0 for f in defaults}
        ok = {f: t for f, t in defaults.items() if t is not None}
        if not ok:  # no default ran (e.g. all failed to compile here): search every family evenly
            ok = {f: 1.0 for f in defaults}
        best = min(ok.values())
        viable = {f: 1.0 / t for f, t in ok.items() if t <= self.cutoff_factor * best}
        total = sum(viable.values())
        shares = {f: int(evaluations * v / total) for f, v in viable.items()}
        # hand out what rounding left, fastest family first
        for f in sorted(viable, key=lambda f: ok[f]):
            if sum(shares.values()) >= evaluations:
                break
            shares[f] += 1
        return {f: shares.get(f, 0) for f in defaults}

    def _measure_batch(self, family: ModuleType, ws, fresh: Sequence[Config], built: Sequence, out: list[Outcome],
                       handles: dict, best: list[float], phases: dict, deadline: "_Deadline", end: float,
                       phase: Phase) -> int:
        """Check and time the compiled batch ``built`` (outcomes appended to ``out`` and told to the listeners;
        the kept candidates go into ``handles``) until ``end``; returns how many were evaluated. What is compiled
        but left unmeasured at ``end`` is unloaded."""
        clock = self.clock
        for i, (c, b) in enumerate(zip(fresh, built)):
            if clock() >= end:  # out of time inside the batch
                for rest in built[i:]:
                    if not isinstance(rest, Outcome):
                        self.compiler.unload(rest.handle)
                return i
            if isinstance(b, Outcome):
                self._tell(family.FAMILY, c, b, family.name(c), phase)
                out.append(b)
                continue
            t = clock()
            bad = self.checker.check(ws, b.handle)
            if bad is not None:
                self._tell(family.FAMILY, c, bad, family.name(c), phase)
            phases["check"] += clock() - t
            if bad is not None:
                self.compiler.unload(b.handle)
                out.append(bad)
                deadline.evaluated(family.FAMILY, clock() - t)
                continue
            t1 = clock()
            cutoff = self.cutoff_factor * best[0] if best[0] < float("inf") else None
            o = self.bench.measure(ws, b.handle, cutoff)
            timing = clock() - t1  # (before the listeners: the re-timing the estimate is for tells nobody)
            self._tell(family.FAMILY, c, o, family.name(c), phase)
            phases["measure"] += clock() - t1
            deadline.evaluated(family.FAMILY, clock() - t)
            if o.ok:
                deadline.timed(timing)
                handles[(family.FAMILY, config_key(c))] = b.handle
                best[0] = min(best[0], o.time_us)
            else:
                self.compiler.unload(b.handle)
            out.append(o)
        return len(out)

    def tune(self, problem: ConvProblem, seeds: Sequence[tuple[str, Config]] = ()) -> TuneResult:
        """Tune ``problem``. ``seeds`` are ``(family, config)`` pairs measured right after the families' start
        points (warm start: winners of neighbouring problems, ``tuning.warmstart``); a seed of a family this
        tuner does not search, or invalid in its space, is skipped. They count against the budget.

        ``budget.seconds`` is wall time for all of it, from this call to the returned plan: cuDNN's baseline,
        compiles, checks, timings, the strategy's own thinking and the finalists' re-timing (see ``_Deadline``).
        The caller's autograd, inference-mode and autocast state do not matter: the search runs in a thread of
        its own (``_Search``), and the GPU work on this thread under ``tuning_context``."""
        with tuning_context():
            self._live: dict[tuple, int] = {}  # loaded candidates of this run (what an error must unload)
            try:
                return self._tune(problem, seeds)
            except BaseException:
                for h in self._live.values():
                    with contextlib.suppress(Exception):
                        self.compiler.unload(h)
                raise
            finally:
                self._live = {}

    def _tune(self, problem: ConvProblem, seeds) -> TuneResult:
        clock = self.clock
        t_start = clock()
        deadline = _Deadline(clock, t_start + self.budget.seconds, self.budget.seconds, workers=self._workers(),
                             finalists=self.finalists, waves=getattr(self.compiler, "wave_seconds", None))
        # where the seconds go; they add up to ``seconds``: setup (float64 reference, cuDNN's baseline), compile,
        # check, measure (the search's timings), strategy (its own thinking), finalists (the re-timing)
        phases = {"setup": 0.0, "compile": 0.0, "check": 0.0, "measure": 0.0, "strategy": 0.0, "finalists": 0.0}
        ws = self.workspace(problem)
        # (as measured_families, with the families whose arithmetic cannot pass here out before the budget's cut)
        families, left_out = self._within_reach(self.families_for(problem), ws, problem)
        families = families[: self.budget.evaluations]
        handles: dict[tuple, int] = self._live
        trials: list[Trial] = []
        best = [float("inf")]

        aten = self.bench.measure(ws, ATEN)
        self._tell("aten", None, aten, "cuDNN", "baseline")
        # cuDNN's first call of a shape in benchmark mode tries every algorithm: not what a re-timing costs, so
        # it sets no cost; with the workspace's float64 reference it is the setup every tuning pays first.
        phases["setup"] = clock() - t_start
        trials.append(Trial("aten", None, aten))
        # The early cut-off is relative to the best *candidate*, not to cuDNN: on the H200 every candidate was
        # more than 4x slower than cuDNN at N=128, so a cuDNN-relative cut left the search no data at all.

        done: dict[tuple, Outcome] = {}
        prefetched: set[tuple] = set()  # (family, config key) compiled up front: loading them costs no compile
        batched: set[str] = set()  # families whose search has asked for a batch
        limit = [deadline.search_end()]  # the current family's hard end (the evaluator stops a batch there)

        def evaluator(family: ModuleType, phase: Phase):
            def evaluate(configs: Sequence[Config]) -> list[Outcome]:
                keys = [(family.FAMILY, config_key(c)) for c in configs]
                fresh = [c for c, k in zip(configs, keys) if k not in done]  # e.g. the default, proposed again
                fresh.sort(key=lambda c: (family.FAMILY, config_key(c)) not in prefetched)  # compiled ones first
                ready = sum((family.FAMILY, config_key(c)) in prefetched for c in fresh)
                end = limit[0]
                fit = deadline.fits(family.FAMILY, len(fresh), end, built=ready)
                if fit == 0 and phase == "search" and family.FAMILY not in batched and end < deadline.search_end():
                    # A family's first search batch may borrow from the later families' shares, one compile wave at
                    # most: where a share is shorter than the family's compile wave (a short budget, a cold cubin
                    # cache) every share would end with nothing and the search would never run.
                    end = deadline.search_end()
                    fit = min(deadline.workers, deadline.fits(family.FAMILY, len(fresh), end, built=ready))
                if phase == "search":
                    batched.add(family.FAMILY)
                cut = fit < len(fresh)
                fresh = fresh[:fit]
                t = clock()
                built = self._compile(family, fresh, end - t) if fresh else []
                phases["compile"] += clock() - t
                unfinished = sum(b is None for b in built)
                deadline.compiled([family.FAMILY], _compiles(built), clock() - t, unfinished=unfinished)
                if unfinished:  # the wave ran to the family's end: measure what it compiled, then stop
                    kept = [(c, b) for c, b in zip(fresh, built) if b is not None]
                    fresh, built, cut = [c for c, _ in kept], [b for _, b in kept], True
                out: list[Outcome] = []
                if phase == "start" and ready:
                    # a start point the prefetch wave compiled is measured once loaded, however long the load took
                    # (``one_start``'s window covers its check and timing, not a slow cache read or module load)
                    end = max(end, clock() + deadline.MIN_EVAL_S)
                try:
                    measured = self._measure_batch(family, ws, fresh, built, out, handles, best, phases, deadline,
                                                   end, phase)
                except BaseException:  # a check or timing that raised: what is loaded and not kept is unloaded
                    for rest in built[len(out):]:
                        if not isinstance(rest, Outcome):
                            with contextlib.suppress(Exception):
                                self.compiler.unload(rest.handle)
                    raise
                if measured < len(fresh):
                    fresh, cut = fresh[:measured], True
                for c, o in zip(fresh, out):
                    done[(family.FAMILY, config_key(c))] = o
                    trials.append(Trial(family.FAMILY, dict(c), o))
                if cut:
                    raise BudgetSpent(f"{family.FAMILY}: the time budget leaves no room for the rest of the batch")
                return [done[k] for k in keys]
            return evaluate

        starts = {fam.FAMILY: self.start_config(fam, problem) for fam in families}
        by_name = {f.FAMILY: f for f in families}
        seeds = [*self.start_alternatives(problem, families), *seeds]  # the families' second starts, then neighbours'
        seed_list = [(name, dict(config)) for name, config in seeds if name in by_name
                     and self.spaces[name].is_valid(config) and config_key(config) != config_key(starts[name])
                     and (getattr(by_name[name], "problem_rule", None) is None
                          or not by_name[name].problem_rule(config, problem))]
        # (the seeds the evaluation budget can measure: what the loop below measures at most)
        seed_cap = max(0, self.budget.evaluations - len(families) - 1)
        items = [(fam, starts[fam.FAMILY]) for fam in families] + [(by_name[n], c) for n, c in seed_list[:seed_cap]]
        prefetch = getattr(self.compiler, "prefetch", None)
        if prefetch is not None and items:
            # Every family's start point and the warm-start seeds are compiled up front in parallel (the cubins
            # land in the cache, so their compiles below are loads): one compile wave instead of one per family.
            # The seeds are winners of neighbouring problems, usually in the cache already: then this costs nothing,
            # and the budget knows they need no compile.
            # The strategy's own imports (Ax: seconds, once per process) load meanwhile, when a search will follow
            # (evaluations left after the start points and seeds): the main thread mostly waits for NVRTC here.
            wait = strategies.preload(self.strategy) if self.budget.evaluations > len(items) else None
            t = clock()
            self._compile_wave(prefetch, items, deadline)
            prefetched.update((fam.FAMILY, config_key(c)) for fam, c in items)
            phases["compile"] += clock() - t
            if wait is not None:
                # Nothing is timed while it loads (it would take the GIL from the timed launches), for at most half
                # the time left to the search, so that a tight budget still measures the start points (the rest
                # of the import then runs beside their timings, and the search waits for it).
                t = clock()
                wait(max(0.0, (deadline.search_end() - t) / 2))
                phases["strategy"] += clock() - t
        defaults: dict[str, float | None] = {}
        for fam in families:  # (an evaluation budget below their number: the first families only, measured_families)
            # (the reserve grows with the first timings); a prefetched start point needs no compile, and is measured
            # even when the wave ran to the end of the budget (``one_start``)
            prefetched_start = (fam.FAMILY, config_key(starts[fam.FAMILY])) in prefetched
            limit[0] = deadline.one_start(fam.FAMILY) if prefetched_start else deadline.search_end()
            try:
                o = evaluator(fam, "start")([starts[fam.FAMILY]])[0]
            except BudgetSpent:
                continue  # no time left for this family's start point (the next family's may be compiled already)
            defaults[fam.FAMILY] = o.time_us if o.ok else None
        families = [f for f in families if f.FAMILY in defaults]
        by_name = {f.FAMILY: f for f in families}
        known = dict(defaults)  # each family's best time so far: what its budget share follows
        seeded = 0
        for fam_name, config in seed_list:
            fam = by_name.get(fam_name)
            if fam is None or (fam_name, config_key(config)) in done:
                continue  # a family left without its start point, or a seed measured already
            if seeded >= seed_cap:
                break
            limit[0] = deadline.search_end()
            try:
                o = evaluator(fam, "seed")([dict(config)])[0]
            except BudgetSpent:
                break
            seeded += 1
            if o.ok and (known[fam_name] is None or o.time_us < known[fam_name]):
                known[fam_name] = o.time_us
        searched: dict[str, Space] = {}
        pruned: dict[str, tuple[int, int]] = {}
        for fam in families:
            searched[fam.FAMILY], cut = self.search_space(fam, problem)
            if cut is not None:
                pruned[fam.FAMILY] = cut
        left_evals = self.budget.evaluations - len(families) - seeded
        shares = self.split_budget(known, left_evals) if families else {}
        order = sorted((f for f in families if shares[f.FAMILY] > 0), key=lambda f: known[f.FAMILY] or 0.0)
        for i, fam in enumerate(order):
            now = clock()
            left_s = deadline.search_end() - now
            if left_s <= 0:
                break
            rest = sum(shares[f.FAMILY] for f in order[i:])
            share_s = max(1e-3, left_s * shares[fam.FAMILY] / rest)
            # A family's search may overrun its share only by what the next families give up: its hard end is
            # the share's end, except for the last family, which may use all that is left.
            limit[0] = deadline.search_end() if i == len(order) - 1 else min(deadline.search_end(), now + share_s)
            remaining = Budget(shares[fam.FAMILY], share_s)
            t, before = clock(), sum(v for k, v in phases.items() if k != "strategy")
            # what this family has measured so far (start point, warm-start seeds): the search's prior
            prior = [(tr.config, tr.outcome) for tr in trials if tr.family == fam.FAMILY]
            options = search_options(self.strategy, fam, problem, self.sms, self.strategy_options)
            search = _Search(self.strategy, searched[fam.FAMILY], evaluator(fam, "search"), remaining, self.seed, prior,
                             options, clock)
            with _single_threaded_torch():
                try:
                    search.run(limit, hard_end=deadline.search_end())
                except Exception as e:  # the search failing must not fail the user's forward: keep what it measured
                    log.logger().warning(f"{self.strategy} search of {fam.FAMILY} failed on {problem.short()} after "
                                         f"{len(trials) - 1} trials ({type(e).__name__}: {e}); choosing among them")
            if search.stalled:
                # A step still thinking when the family's time ends is the normal end of a short share; only one
                # that had run for STALL_WARN_S (several times a normal step) is a stall worth a warning.
                level = logging.WARNING if search.step_s >= STALL_WARN_S else logging.INFO
                log.logger().log(
                    level, f"{self.strategy} search of {fam.FAMILY} on {problem.short()}: a search step ran past its "
                    f"deadline ({share_s:.1f} s for this family; the step had run {search.step_s:.1f} s); abandoned it, "
                    f"keeping the {len(trials) - 1} trials measured")
            # the search's own overhead: its wall time minus the compile/check/measure it asked for
            phases["strategy"] += (clock() - t) - (sum(v for k, v in phases.items() if k != "strategy") - before)

        ok = sorted(((tr.outcome.time_us, (tr.family, config_key(tr.config))) for tr in trials
                     if tr.config is not None and tr.outcome.ok), key=lambda t: t[0])
        finalists = [k for _, k in ok[: self.finalists]]
        t = clock()
        fin_handles = [handles[k] for k in finalists] + [ATEN]
        # no finalist (every candidate failed): cuDNN is the plan, its first timing stands (re-timing it alone would
        # only spend time past the deadline)
        times = self.bench.remeasure(ws, fin_handles, rounds=deadline.finalist_rounds(len(fin_handles))) \
            if finalists else [math.nan]
        phases["finalists"] = clock() - t
        aten_us = times[-1]
        if aten_us != aten_us:
            if finalists:  # cuDNN's GPU time could not be isolated from the host: it keeps the plan
                log.logger().info(f"re-timing on {problem.short()}: the host could not queue cuDNN's calls ahead of "
                                  "the GPU; cuDNN keeps the plan")
            aten_us = aten.time_us if aten.ok else math.inf
            times = [math.nan] * (len(fin_handles) - 1) + [aten_us]
        win = min(range(len(fin_handles)), key=lambda i: times[i] if times[i] == times[i] else math.inf)
        if not times[win] * ATEN_MARGIN <= aten_us:  # within the margin of cuDNN (or unknown): cuDNN keeps the plan
            win = len(fin_handles) - 1
        for k, h in list(handles.items()):
            if h != fin_handles[win]:
                del handles[k]  # (what is still in it when an error ends the run is unloaded by tune)
                self.compiler.unload(h)
        evaluations = sum(1 for tr in trials if tr.config is not None and tr.outcome.status != "invalid")
        win_family = finalists[win][0] if fin_handles[win] != ATEN else self.family.FAMILY
        common = dict(problem=problem, aten_us=aten_us, default_us=defaults.get(win_family),
                      evaluations=evaluations, seconds=clock() - t_start, phases=phases,
                      trials=trials, defaults=defaults, pruned=pruned, left_out=left_out)
        if fin_handles[win] == ATEN:
            return TuneResult(family="aten", config=None, handle=ATEN, time_us=aten_us, **common)
        return TuneResult(family=win_family, config=dict(finalists[win][1]), handle=fin_handles[win],
                          time_us=times[win], **common)

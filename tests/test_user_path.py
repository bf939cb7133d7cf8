"""The path users take: the package as installed, tuning under no_grad/inference_mode, a time budget that is
a budget, a serving path that costs what nn.Conv2d costs, settings that cannot break a forward."""

from __future__ import annotations

import ast
import dataclasses
import logging
import math
import os
import sys
import warnings
import threading
import time
import tomllib
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import bagf_torch
from bagf_torch import cli, log, runtime, settings
from bagf_torch import nn as bnn
from bagf_torch.kernels.space import config_key
from bagf_torch.ops import ATEN
from bagf_torch.problem import ConvProblem, fingerprint
from bagf_torch.tuning import strategies
from bagf_torch.tuning.common import Budget, Outcome
from bagf_torch.tuning.replay import ReplayCompiler, replay_backend
from bagf_torch.tuning.tuner import Tuner

import fault_helpers as fh  # tests/ is on sys.path (pytest's default prepend import mode)

REPO = Path(__file__).resolve().parent.parent
PACKAGE = Path(bagf_torch.__file__).resolve().parent  # the copy under test: installed, or the checkout's
RECORDING = REPO / "benchmarks/data/implicit_gemm_tc_h200.json.gz"


# --------------------------------------------------------------------------------------------- packaging
def test_every_package_directory_is_a_package():
    """A directory of modules without __init__.py is left out of the wheel by setuptools' package finder: the
    installed package then fails with ModuleNotFoundError (bagf_torch.tuning was once missing that way)."""
    source = REPO / "bagf_torch"
    missing = [str(d.relative_to(REPO)) for d in sorted(source.rglob("*")) if d.is_dir()
               and d.name != "__pycache__" and d.name != "_csrc" and any(d.glob("*.py"))
               and not (d / "__init__.py").is_file()]
    assert not missing, f"add an __init__.py to {missing}, or pip install . leaves them out"


def test_declared_dependencies_cover_every_import():
    """Every third-party module the package imports is a declared dependency (module-level or not), or an
    optional extra imported where its absence is handled."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {d.split(">")[0].split("=")[0].split("[")[0].strip().lower() for d in meta["dependencies"]}
    extras = {d.split(">")[0].strip().lower() for deps in meta["optional-dependencies"].values() for d in deps}
    distribution = {"ax": "ax-platform"}
    seen: set[str] = set()
    for path in (REPO / "bagf_torch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            seen.update(n.split(".")[0] for n in names)
    third_party = {m for m in seen if m not in sys.stdlib_module_names and m != "bagf_torch"}
    undeclared = {m for m in third_party if distribution.get(m, m).lower() not in declared | extras}
    assert not undeclared, f"imported but not declared in pyproject.toml: {sorted(undeclared)}"
    assert {"torch", "ninja", "ax-platform", "numpy"} <= declared


def test_installed_copy_carries_the_kernel_sources():
    from bagf_torch.jit import extension

    src = extension.csrc_dir()
    assert (src / "bagf_ext.cpp").is_file() and (src / "kernels" / "winograd_gemm.cuh").is_file()
    if REPO not in PACKAGE.parents:  # an installed copy: the sources travel inside the package
        assert src == PACKAGE / "_csrc"


# ------------------------------------------------------------------ tuning under the caller's context
def _recorded(name="alexnet_conv3_n1"):
    from bagf_torch.kernels import implicit_gemm_tc as tc
    from bagf_torch.tuning.replay import load_recording

    rp = next(p for p in load_recording(RECORDING).problems if p.name == name)
    return tc, rp, ConvProblem.from_dict(rp.conv)


def _ax_tuner(budget=Budget(14)):
    tc, rp, problem = _recorded()
    backend = replay_backend(rp.evaluator(), 1e6)
    tuner = Tuner(backend, tc, strategy="ax", budget=budget, seed=3)
    return tuner, backend.compiler, problem


@pytest.mark.slow
def test_ax_tunes_the_same_under_no_grad_and_inference_mode(caplog):
    """BoTorch fits its GP by gradient: under the caller's no_grad or inference_mode every Ax search used to
    raise after its initial design ("element 0 of tensors does not require grad") and the tuner chose among
    the initial trials. Same seed, same recording: the same trials in every context, no warning."""
    runs = {}
    for name, ctx in (("grad", torch.enable_grad), ("no_grad", torch.no_grad),
                      ("inference_mode", torch.inference_mode)):
        tuner, comp, problem = _ax_tuner()
        with caplog.at_level(logging.WARNING, logger="bagf_torch"), ctx():
            r = tuner.tune(problem)
        runs[name] = [config_key(t.config) for t in r.trials if t.config is not None]
        assert r.evaluations == 14, (name, r.evaluations)  # Ax ran to its budget
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert runs["grad"] == runs["no_grad"] == runs["inference_mode"]


def test_strategies_run_directly_under_inference_mode():
    """strategies.run itself is context-free too (the benchmarks and replay tools call it directly)."""
    from bagf_torch.kernels.space import Space

    space = Space("demo", {"a": (1, 2, 4, 8), "b": (1, 2, 4)})
    seen_grad = []

    def evaluate(cs):
        seen_grad.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return [Outcome("ok", float(abs(c["a"] - 4) + c["b"])) for c in cs]

    with torch.inference_mode():
        trials = strategies.run("random", space, evaluate, Budget(5), seed=0)
    assert len(trials) == 5 and set(seen_grad) == {(True, False)}


# ------------------------------------------------------------------------------------- the time budget
class FakeClock:
    """Real time plus simulated GPU time: what a step costs on the GPU is ``advance``d, and a strategy's real
    thinking (Ax on this CPU) counts as it happens."""

    def __init__(self):
        self.offset = 0.0
        self._lock = threading.Lock()

    def __call__(self):
        return time.perf_counter() + self.offset

    def advance(self, seconds):
        with self._lock:
            self.offset += seconds


class SimClock(FakeClock):
    """Simulated time only: for a strategy that does not think (random search), so that how busy this CPU is (a
    parallel test run) cannot eat into a budget the test sizes to the simulated compile waves."""

    def __call__(self):
        return self.offset


class _SlowCompiler(ReplayCompiler):
    """Each call compiles in waves of ``workers`` candidates, ``wave_s`` of simulated time each."""

    def __init__(self, evaluator, clock, wave_s):
        super().__init__(evaluator)
        self.clock, self.wave_s = clock, wave_s

    def compile(self, family, configs):
        if configs:
            self.clock.advance(self.wave_s * math.ceil(len(configs) / self.workers))
        return super().compile(family, configs)


@pytest.mark.parametrize("strategy,seconds", [("random", 5.0), ("anneal", 6.0), ("ax", 5.0)])
def test_the_time_budget_holds_end_to_end(strategy, seconds):
    """Compiles of 1.2 s per wave and 0.06 s per timing on the fake clock: the whole tuning -- baseline,
    start point, search, finalists' re-timing -- ends within the budget plus one step, however many
    evaluations the budget would allow. (A 5 s budget used to take 8-9 s per problem.)"""
    if strategy == "ax":  # Ax's first import in a process takes seconds of real time, which this test does not time
        from ax import Client  # noqa: F401
    tc, rp, problem = _recorded()
    clock = FakeClock()
    ev = rp.evaluator()
    backend = replay_backend(ev, 1e6, clock=clock, measure_s=0.06, compiler=_SlowCompiler(ev, clock, wave_s=1.2))
    tuner = Tuner(backend, tc, strategy=strategy, budget=Budget(200, seconds), seed=0, clock=clock)
    t0 = clock()
    r = tuner.tune(problem)
    spent = clock() - t0
    assert spent <= seconds + 1.2 + 0.1, spent  # at most one compile wave over
    assert r.seconds <= seconds + 1.3
    assert 1 < r.evaluations < 200 and r.family == tc.FAMILY  # it searched, and stopped on time


class _CachingCompiler(ReplayCompiler):
    """Per-family NVRTC cost (``wave_s[family]`` per wave of ``workers`` compiles) and a cubin cache: what
    ``prefetch`` compiled loads for free, as the real compiler's start points do."""

    def __init__(self, evaluator, clock, wave_s):
        super().__init__(evaluator)
        self.clock, self.wave_s, self.cached, self.family_of = clock, wave_s, set(), {}

    def prefetch(self, items):
        misses = [(f, c) for f, c in items if (f.FAMILY, config_key(c)) not in self.cached]
        if misses:
            self.clock.advance(max(self.wave_s[f.FAMILY] for f, _ in misses) * math.ceil(len(misses) / self.workers))
        self.cached.update((f.FAMILY, config_key(c)) for f, c in misses)
        return {f.FAMILY: self.wave_s[f.FAMILY] for f, _ in misses}

    def compile(self, family, configs):
        misses = [c for c in configs if (family.FAMILY, config_key(c)) not in self.cached]
        if misses:
            self.clock.advance(self.wave_s[family.FAMILY] * math.ceil(len(misses) / self.workers))
        self.cached.update((family.FAMILY, config_key(c)) for c in misses)
        out = super().compile(family, configs)
        for o, c in zip(out, configs):
            o.compile_seconds = self.wave_s[family.FAMILY] if c in misses else 0.0
            self.family_of[o.handle] = family.FAMILY
        return out


def _families_tuner(comp, clock, rp, seconds, families, slower=1.3):
    """A random-search Tuner over ``families`` on the fake clock: implicit_gemm_tc's times from the recording, every
    other family's ``slower`` x the recorded optimum plus a few microseconds by configuration (so each is
    searched, none wins outright)."""
    from bagf_torch.kernels import implicit_gemm_tc as tc

    comp.evaluator = rp.evaluator()  # the problem's recording (one compiler may serve several problems)
    backend = replay_backend(comp.evaluator, 1e6, clock=clock, measure_s=0.02, compiler=comp)
    bench = backend.benchmarker
    recorded, best = bench._t, rp.evaluator().best()[1].time_us
    bench._t = lambda h: (recorded(h) if h == ATEN or comp.family_of[h] == tc.FAMILY
                          else Outcome("ok", time_us=slower * best + sum(comp.configs[h].values()) % 7))
    return Tuner(backend, list(families), strategy="random", budget=Budget(200, seconds), seed=0, clock=clock)


@pytest.mark.parametrize("seconds", [4.0, 5.0, 6.0, 8.0])
def test_the_time_budget_holds_with_families_that_compile_at_different_speeds(seconds):
    """Two families, one compiling 8x slower than the other (winograd_gemm's wgmma kernels against implicit_gemm's,
    as on the H200), their start points prefetched in one wave and then loaded from the cubin cache. Cache hits
    must not teach the tuner that compiling is free, nor the fast family's waves what the slow family's cost:
    the tuning ends within the budget plus one wave of the slow family (on the H200, AlexNet conv1 at N=128
    took 8.8 s of a 5 s budget)."""
    from bagf_torch.kernels import implicit_gemm

    tc, rp, problem = _recorded()
    clock = FakeClock()
    comp = _CachingCompiler(rp.evaluator(), clock, {tc.FAMILY: 2.0, implicit_gemm.FAMILY: 0.25})
    tuner = _families_tuner(comp, clock, rp, seconds, [implicit_gemm, tc])
    t0 = clock()
    r = tuner.tune(problem)
    spent = clock() - t0
    assert spent <= seconds + 0.1, (spent, r.phases)  # every cost is known after the prefetch wave
    assert abs(sum(r.phases.values()) - r.seconds) < 0.05 * r.seconds, r.phases  # phases account for the time
    assert {t.family for t in r.trials if t.config is not None} == {tc.FAMILY, implicit_gemm.FAMILY}


def test_the_strategys_imports_load_during_the_compile_wave_and_nothing_is_timed_meanwhile(monkeypatch):
    """The strategy's preload (Ax's import, 5.8 s on the H200's host) starts right before the start points' compile
    wave and is waited for right after it, before any start point is timed, for at most half the time left to
    the search; its wait counts as strategy time."""
    from bagf_torch.kernels import implicit_gemm

    events, waits = [], []
    base = strategies.STRATEGIES["random"]

    class WithPreload:
        OPTIONS = base.OPTIONS
        tune = staticmethod(base.tune)

        @staticmethod
        def preload():
            events.append("preload")

            def wait(timeout=None):
                events.append("wait")
                waits.append(timeout)
                clock.advance(0.5)  # the rest of the import, past the compile wave
                return True
            return wait

    monkeypatch.setitem(strategies.STRATEGIES, "random", WithPreload)
    tc, rp, problem = _recorded()
    clock = FakeClock()
    comp = _CachingCompiler(rp.evaluator(), clock, {tc.FAMILY: 2.0, implicit_gemm.FAMILY: 0.25})
    real_prefetch = comp.prefetch
    comp.prefetch = lambda items: (events.append("prefetch"), real_prefetch(items))[1]
    tuner = _families_tuner(comp, clock, rp, 8.0, [implicit_gemm, tc])
    measure = tuner.bench.measure
    tuner.bench.measure = lambda ws, h, cutoff_us=None: (events.append("aten" if h == ATEN else "time"),
                                                         measure(ws, h, cutoff_us))[1]
    r = tuner.tune(problem)
    assert events[:5] == ["aten", "preload", "prefetch", "wait", "time"], events[:6]
    assert events.count("preload") == 1 and 0 < waits[0] <= 8.0 / 2
    assert r.phases["strategy"] >= 0.5 and r.seconds <= 8.0 + 0.1


def test_a_budget_of_start_points_only_does_not_preload_the_strategy(monkeypatch):
    """No evaluation left for a search: nothing to import for it."""
    from bagf_torch.kernels import implicit_gemm

    called = []
    base = strategies.STRATEGIES["random"]
    fake = types.SimpleNamespace(OPTIONS=base.OPTIONS, tune=base.tune, preload=lambda: called.append(1))
    monkeypatch.setitem(strategies.STRATEGIES, "random", fake)
    tc, rp, problem = _recorded()
    clock = FakeClock()
    comp = _CachingCompiler(rp.evaluator(), clock, {tc.FAMILY: 2.0, implicit_gemm.FAMILY: 0.25})
    tuner = _families_tuner(comp, clock, rp, 8.0, [implicit_gemm, tc])
    tuner.budget = Budget(2, 8.0)  # the two start points
    tuner.tune(problem)
    assert not called


def test_ax_preload_imports_ax_in_a_thread_once():
    """In a fresh process: preload starts one daemon thread that imports Ax; its wait reports the end (also with an
    unbounded timeout, what a budget without seconds gives it); a second preload starts nothing new."""
    code = (
        "import sys, threading\n"
        "from bagf_torch.tuning import strategies\n"
        "assert 'ax.api.client' not in sys.modules\n"
        "wait = strategies.preload('ax')\n"
        "names = [t.name for t in threading.enumerate()]\n"
        "assert 'bagf-ax-import' in names, names\n"
        "assert wait(float('inf')) is True and wait(1e12) is True and 'ax.api.client' in sys.modules\n"
        "again = strategies.preload('ax')\n"
        "assert again is not None and again(0) is True\n"
        "assert [t.name for t in threading.enumerate()].count('bagf-ax-import') == 0\n"
        "assert strategies.preload('random') is None\n"
        "print('ok')\n")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_time_budget_holds_for_a_later_problem_whose_start_points_are_cached():
    """A process tuning a model's problems one after another: the later problems' start points come from the cubin
    cache (no compile to measure), so the first real compile wave of a slow family is known only from the earlier
    problems. The compiler's record of wave costs carries it over; without it the second problem ran a whole
    unforeseen wave past its budget."""
    from bagf_torch.kernels import implicit_gemm

    clock = FakeClock()
    tc, first, _ = _recorded()
    comp = _CachingCompiler(first.evaluator(), clock, {tc.FAMILY: 2.0, implicit_gemm.FAMILY: 0.25})
    comp.wave_seconds = {}
    spent = []
    for name in ("alexnet_conv3_n1", "alexnet_conv4_n1", "alexnet_conv5_n1"):
        _, rp, problem = _recorded(name)
        tuner = _families_tuner(comp, clock, rp, 5.0, [implicit_gemm, tc])
        t0 = clock()
        r = tuner.tune(problem)
        spent.append(clock() - t0)
        assert r.evaluations > 2, (name, r.evaluations)
    assert max(spent) <= 5.0 + 0.1, spent
    assert set(comp.wave_seconds) == {tc.FAMILY, implicit_gemm.FAMILY}


def test_a_prefetch_wave_teaches_only_the_families_it_compiled():
    """The slow family's start point is in the cubin cache, the fast family's is compiled in the prefetch wave:
    that wave says what the fast family costs, nothing about the slow one, whose recorded cost must stand (it
    was overwritten with the fast family's, and the slow family's next wave ran 4 s past an 8 s budget)."""
    from bagf_torch.kernels import implicit_gemm

    clock = FakeClock()
    tc, rp, problem = _recorded()
    comp = _CachingCompiler(rp.evaluator(), clock, {tc.FAMILY: 6.0, implicit_gemm.FAMILY: 0.3})
    comp.wave_seconds = {tc.FAMILY: 6.0}  # what earlier problems of this process measured
    tuner = _families_tuner(comp, clock, rp, 8.0, [implicit_gemm, tc])
    comp.cached.add((tc.FAMILY, config_key(tuner.start_config(tc, problem))))
    t0 = clock()
    tuner.tune(problem)
    assert clock() - t0 <= 8.0 + 0.1
    assert comp.wave_seconds[tc.FAMILY] >= 6.0 and comp.wave_seconds[implicit_gemm.FAMILY] == pytest.approx(0.3, 0.1)


def test_every_prefetched_start_point_is_measured_when_the_wave_ate_the_search_time():
    """A 6 s wave of a 7 s budget (winograd_gemm's wgmma start at N=128 on the H200): the families' start points are
    compiled, and each is measured, up to one round of re-timing before the end, not stopped at the search's
    end (five rounds' reserve), which left the second family unmeasured and kept the first family's plan."""
    from bagf_torch.kernels import implicit_gemm

    clock = FakeClock()
    tc, rp, problem = _recorded()
    comp = _CachingCompiler(rp.evaluator(), clock, {tc.FAMILY: 6.0, implicit_gemm.FAMILY: 0.3})
    comp.wave_seconds = {}
    tuner = _families_tuner(comp, clock, rp, 7.0, [implicit_gemm, tc])
    tuner.bench.measure_s = 0.05
    t0 = clock()
    r = tuner.tune(problem)
    assert clock() - t0 <= 7.0 + 0.1, r.phases
    assert set(r.defaults) == {tc.FAMILY, implicit_gemm.FAMILY} and all(r.defaults.values()), r.defaults
    assert r.family == tc.FAMILY  # the better family's start point, measured last, won


def test_a_models_start_points_compiled_up_front_leave_each_tuning_its_budget_for_the_search():
    """``prefetch_starts`` over a model's problems compiles each family's start point once (problems that share one
    share its cubin), records the wave's cost per family, and each tuning then loads its start points: no compile
    wave of its own, so more of its budget goes to the search than in a tuning that compiles them itself."""
    from bagf_torch.kernels import implicit_gemm

    tc, rp, problem = _recorded()
    twin = dataclasses.replace(problem, n=problem.n + 1)  # another batch: most start points are the same cubins

    def run(up_front):
        clock = FakeClock()
        comp = _CachingCompiler(rp.evaluator(), clock, {tc.FAMILY: 3.0, implicit_gemm.FAMILY: 1.0})
        comp.wave_seconds = {}
        asked = []
        real = comp.prefetch
        comp.prefetch = lambda items: (asked.append(len(items)), real(items))[1]
        tuner = _families_tuner(comp, clock, rp, 8.0, [implicit_gemm, tc])
        if up_front:
            n = tuner.prefetch_starts([problem, twin])
            starts = {(f.FAMILY, config_key(tuner.start_config(f, p))) for p in (problem, twin) for f in (implicit_gemm, tc)}
            assert n == len(starts) == asked[0] and comp.wave_seconds == {tc.FAMILY: 3.0, implicit_gemm.FAMILY: 1.0}
        t0 = clock()
        r = tuner.tune(problem)
        assert clock() - t0 <= 8.0 + 0.1
        return r

    cold, warm = run(False), run(True)
    assert warm.phases["compile"] < cold.phases["compile"] and warm.evaluations > cold.evaluations, (
        warm.phases, cold.phases, warm.evaluations, cold.evaluations)


def test_cached_warm_start_seeds_are_measured_and_leave_the_finalists_their_reserve():
    """Warm-start seeds are winners of neighbouring problems, so their cubins are cached: prefetched with the start
    points they cost no compile in the budget's eyes (charged a whole slow wave each, every seed was refused), and
    the start points and seeds stop where the search would, before the finalists' reserve (they could run to the
    very end of the budget, and the re-timing after them past it)."""
    clock = FakeClock()
    tc, rp, problem = _recorded()
    comp = _CachingCompiler(rp.evaluator(), clock, {tc.FAMILY: 6.0})
    comp.wave_seconds = {tc.FAMILY: 6.0}
    valid = tc.space().valid_configs()
    seeds = [(tc.FAMILY, c) for c in valid[:: max(1, len(valid) // 20)][:20]]
    comp.cached.update((tc.FAMILY, config_key(c)) for _, c in seeds)
    tuner = Tuner(replay_backend(comp.evaluator, 1e6, clock=clock, measure_s=0.3, compiler=comp), tc,
                  strategy="random", budget=Budget(200, 5.0), seed=0, clock=clock)
    comp.cached.add((tc.FAMILY, config_key(tuner.start_config(tc, problem))))
    t0 = clock()
    r = tuner.tune(problem, seeds=seeds)
    assert clock() - t0 <= 5.0 + 0.1
    assert sum(1 for t in r.trials if t.config is not None) >= 4  # the start point and seeds were measured
    assert r.phases["finalists"] >= 6 * 0.3  # one round of re-timing (five finalists and cuDNN) fitted in


@pytest.mark.parametrize("clock_kind", ["simulated", "real+simulated"])
def test_a_cold_process_with_a_short_budget_still_searches(caplog, clock_kind):
    """Three families, nothing in the cubin cache, an 8 s budget: the start points' wave takes half of it and every
    family's share of the rest is shorter than its compile wave. Each family's first batch may borrow one wave
    from the later families' shares, so the search runs (on the H200 the first GPU tuning of a process, under a
    10 s budget, had stopped at its 6 start points), within the budget, and a family left too little time to
    set up is not reported as a stalled search.

    The evaluation count is asserted on simulated time only: with real time counted (as a strategy's thinking is)
    a parallel test run's load once ate the share sized for one search batch. The stall report needs real time
    (the strategy thread's first request is awaited on the clock), so that variant asserts the report."""
    from bagf_torch.kernels import implicit_gemm, winograd_tc

    clock = SimClock() if clock_kind == "simulated" else FakeClock()
    tc, rp, problem = _recorded()
    comp = _CachingCompiler(rp.evaluator(), clock, {tc.FAMILY: 3.0, implicit_gemm.FAMILY: 2.0, winograd_tc.FAMILY: 4.0})
    comp.wave_seconds = {}
    tuner = _families_tuner(comp, clock, rp, 8.0, [implicit_gemm, tc, winograd_tc], slower=1.2)
    t0 = clock()
    log.logger()  # configured before caplog sets INFO
    with caplog.at_level(logging.INFO, logger="bagf_torch"):
        r = tuner.tune(problem)
    assert clock() - t0 <= 8.0 + 0.1
    if clock_kind == "simulated":
        assert r.evaluations >= 3 + 4, r.evaluations  # the start points and at least one batch of the search
    else:
        assert not [rec.getMessage() for rec in caplog.records if "abandoned" in rec.getMessage()]


def test_finalists_are_retimed_in_the_reserve_left_for_them():
    tc, rp, problem = _recorded()
    clock = FakeClock()
    ev = rp.evaluator()
    backend = replay_backend(ev, 1e6, clock=clock, measure_s=0.1, compiler=_SlowCompiler(ev, clock, wave_s=0.3))
    rounds = []
    bench = backend.benchmarker
    real = bench.remeasure
    bench.remeasure = lambda ws, handles, rounds_=5, **kw: (rounds.append(kw.get("rounds", rounds_))
                                                            or real(ws, handles, kw.get("rounds", rounds_)))
    tuner = Tuner(backend, tc, strategy="random", budget=Budget(200, 4.0), seed=0, clock=clock)
    t0 = clock()
    tuner.tune(problem)
    assert clock() - t0 <= 4.0 + 0.6  # one round of six re-timings is the most it can go over
    assert rounds and 1 <= rounds[0] <= 5


class _StallStrategy:
    """A strategy whose second step never comes back in time (Ax's generation once stalled for minutes)."""

    OPTIONS: dict = {}
    release = threading.Event()

    @staticmethod
    def tune(objective, seed):
        valid = objective.space.valid_configs()
        objective(valid[:2])
        _StallStrategy.release.wait(30)  # the stall
        objective(valid[2:4])  # what an abandoned search asks for is refused


@pytest.mark.parametrize("warn_s", [None, 0.3], ids=["share-end", "stall"])
def test_a_stalled_strategy_step_is_abandoned_within_the_budget(monkeypatch, caplog, warn_s):
    """A step still running at its family's deadline is abandoned; reported as a stall (a warning) only when it had
    run STALL_WARN_S, else as the end of the family's share (INFO): at short budgets that is every family's end."""
    from bagf_torch import log as bagf_log
    from bagf_torch.tuning import tuner as tuner_module

    monkeypatch.setitem(strategies.STRATEGIES, "stall", _StallStrategy)
    if warn_s is not None:
        monkeypatch.setattr(tuner_module, "STALL_WARN_S", warn_s)
    _StallStrategy.release.clear()
    tc, rp, problem = _recorded()
    tuner = Tuner(replay_backend(rp.evaluator(), 1e6), tc, strategy="stall", budget=Budget(50, 1.5), seed=0)
    t0 = time.perf_counter()
    bagf_log.logger()  # configured (BAGF_LOG's level) before caplog sets INFO, not inside the tuning
    with caplog.at_level(logging.INFO, logger="bagf_torch"):
        r = tuner.tune(problem)
    took = time.perf_counter() - t0
    _StallStrategy.release.set()  # let the abandoned thread finish: its next request is refused
    assert took < 3.0, took
    assert r.evaluations == 3  # the start point and the two the search measured before it stalled
    told = [rec for rec in caplog.records if "abandoned" in rec.getMessage()]
    assert len(told) == 1 and told[0].levelno == (logging.INFO if warn_s is None else logging.WARNING)
    time.sleep(0.2)
    assert r.evaluations == len([t for t in r.trials if t.config is not None])  # nothing ran after


# ------------------------------------------------------------------------------------- the serving path
class _CountingRuntime:
    def __init__(self, answer):
        self.answer = answer
        self.lookups = 0

    def lookup(self, problem, device):
        self.lookups += 1
        return self.answer


def _cuda_looking(monkeypatch, answer):
    rt = _CountingRuntime(answer)
    monkeypatch.setattr(bnn.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    monkeypatch.setattr(runtime, "get", lambda: rt)
    checks = []
    real_check = bnn.TunedConv2d._unsupported
    monkeypatch.setattr(bnn.TunedConv2d, "_unsupported", lambda self, x: checks.append(1) or real_check(self, x))
    return rt, checks


@pytest.mark.parametrize("answer", [(ATEN, True), (ATEN, False)], ids=["aten-plan", "miss-or-wait"])
def test_aten_answers_cost_one_lookup_not_one_per_call(monkeypatch, answer):
    """An "aten" plan (final) and ATen-for-now (BAGF_TUNE=0 with no plan, another process tuning it) go
    straight to nn.Conv2d's forward after the first call: the lookup was a SQLite read on every call (132 us
    per call against nn.Conv2d's 42 on the H200). ATen-for-now asks again after RECHECK_S, or at once when the
    runtime says a plan may have appeared."""
    rt, checks = _cuda_looking(monkeypatch, answer)
    conv = bagf_torch.TunedConv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 9, 9)
    want = F.conv2d(x, conv.weight, conv.bias, 1, 1)
    now = time.monotonic()
    monkeypatch.setattr(bnn.time, "monotonic", lambda: now)  # 50 calls on a loaded machine can outlast RECHECK_S
    with torch.no_grad():
        for _ in range(50):
            torch.testing.assert_close(conv(x), want)
    assert rt.lookups == 1 and len(checks) == 1
    monkeypatch.setattr(bnn.time, "monotonic", lambda: now + bnn.RECHECK_S + 0.01)
    conv(x)
    assert rt.lookups == (1 if answer[1] else 2)  # a final answer is never asked again
    runtime._bump()  # e.g. a background tuning stored its winner
    conv(x)
    assert rt.lookups == (1 if answer[1] else 3)


@pytest.mark.parametrize("answer", [(ATEN, True), (ATEN, False)], ids=["aten-plan", "miss-or-wait"])
def test_discovery_sees_layers_whose_calls_took_the_fast_path(monkeypatch, answer):
    """tune_model's recording pass must see every layer, also one whose earlier calls are answered by the fast
    path (an ATen answer there skips the lookup the pass intercepts); the layer's memos are restored after."""
    from bagf_torch import pretune

    rt, _ = _cuda_looking(monkeypatch, answer)
    model = bagf_torch.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 5, 3)))
    x = torch.randn(1, 3, 10, 10)
    with torch.no_grad():
        model(x)
        model(x)
    fast_before = [dict(m._bagf_plans) for m in model]
    found = pretune.discover(model, [x])
    assert len(found.problems) == 2
    assert [m._bagf_plans for m in model] == fast_before


def test_a_call_under_autocast_runs_the_plan_of_autocasts_dtype(monkeypatch, caplog):
    """Under torch.autocast nn.Conv2d casts input, weight and bias to autocast's dtype (bf16 here) and returns it; a
    TunedConv2d does the same casts and looks up the problem of that dtype (its own plan, the memory format kept),
    once; outside autocast the same shape is the float32 problem, another plan. (CPU autocast on CPU tensors made
    to look like CUDA ones: the rule is per device.)"""
    rt, checks = _cuda_looking(monkeypatch, (7, True))
    problems = []
    real_lookup = rt.lookup
    monkeypatch.setattr(rt, "lookup", lambda problem, device: problems.append(problem) or real_lookup(problem, device))
    kernel_calls = []
    monkeypatch.setattr(bnn, "_op", lambda: lambda x, w, b, s, p, d, h: kernel_calls.append(
        (h, x.dtype, w.dtype, b.dtype, x.is_contiguous())) or torch.zeros(1, dtype=x.dtype))
    monkeypatch.setattr(bnn, "_inference_call", lambda: None)
    conv = bagf_torch.TunedConv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="bagf_torch"):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = conv(x)
            assert y.dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            conv(x.contiguous(memory_format=torch.channels_last))
        conv(x)
    assert [(p.dtype, p.layout) for p in problems] == [("bfloat16", "nchw"), ("bfloat16", "nhwc"), ("float32", "nchw")]
    assert kernel_calls == [(7, torch.bfloat16, torch.bfloat16, torch.bfloat16, True)] * 3 + [
        (7, torch.bfloat16, torch.bfloat16, torch.bfloat16, False), (7, torch.float32, torch.float32, torch.float32, True)]
    assert not [r for r in caplog.records if "autocast" in r.getMessage()]  # nothing fell back


def test_a_call_under_autocast_that_atens_answers_returns_what_nn_conv2d_returns(monkeypatch):
    """With cuDNN as the plan (or no plan yet), the answer under autocast is nn.Conv2d's under autocast, bit for bit."""
    _cuda_looking(monkeypatch, (ATEN, True))
    conv = bagf_torch.TunedConv2d(3, 4, 3, padding=1)
    stock = torch.nn.Conv2d(3, 4, 3, padding=1)
    stock.load_state_dict(conv.state_dict())
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            y, want = conv(x), stock(x)
            assert y.dtype == want.dtype == torch.bfloat16 and torch.equal(y, want)


def test_autocast_leaves_float64_and_padding_modes_to_autocasts_own_casts(monkeypatch):
    """Autocast casts no float64 tensor, and nn.Conv2d pads (reflect, replicate, circular) before its conv, in the
    input's dtype: such a call under autocast returns exactly what nn.Conv2d returns, gradients included."""
    _cuda_looking(monkeypatch, (7, True))
    monkeypatch.setattr(bnn, "_op", lambda: pytest.fail("such a call never reaches the op"))
    monkeypatch.setattr(bnn, "_inference_call", lambda: pytest.fail("such a call never reaches the op"))
    for kwargs, dtype in [({}, torch.float64), ({"padding_mode": "reflect"}, torch.float32)]:
        torch.manual_seed(0)
        conv = bagf_torch.TunedConv2d(4, 6, 3, padding=1, **kwargs).to(dtype)
        stock = torch.nn.Conv2d(4, 6, 3, padding=1, **kwargs).to(dtype)
        stock.load_state_dict(conv.state_dict())
        x = torch.randn(2, 4, 8, 8, dtype=dtype, requires_grad=True)
        grads = []
        for layer in (conv, stock):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x)
            grads.append((y, torch.autograd.grad(y.float().square().sum(), x)[0]))
        (y, gx), (want, want_gx) = grads
        assert y.dtype == want.dtype and torch.equal(y, want) and torch.equal(gx, want_gx), kwargs


def _warm_kernel_layer(monkeypatch):
    """A TunedConv2d with a kernel plan for its (CPU, CUDA-looking) calls, warmed by one call; every later call
    that reaches the kernels is recorded (the op or the dispatcher-free entry)."""
    _cuda_looking(monkeypatch, (7, True))
    kernel = []

    def run(x, w, b, s, p, d, h):
        kernel.append(type(x).__name__)
        return F.conv2d(x, w, b, s, p, d)

    monkeypatch.setattr(bnn, "_op", lambda: run)
    monkeypatch.setattr(bnn, "_inference_call", lambda: run)
    torch.manual_seed(0)
    conv = bagf_torch.TunedConv2d(3, 4, 3, padding=1)
    stock = torch.nn.Conv2d(3, 4, 3, padding=1)
    stock.load_state_dict(conv.state_dict())
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        conv(x)
    assert kernel == ["Tensor"]
    kernel.clear()
    return conv, stock, x, kernel


def test_calls_the_kernels_have_no_rule_for_run_nn_conv2d(monkeypatch):
    """Our op is one CUDA kernel over plain tensors. A call under vmap, jvp or a forward-mode AD level, under a
    TorchDispatchMode (FlopCounterMode, FakeTensorMode), on a tensor subclass or while torch.jit.trace records, runs
    nn.Conv2d's forward on a layer that has a kernel plan for the shape: the right answer (tangents, flop counts,
    fake outputs), and no plan handle of this process in a saved trace."""
    import torch.autograd.forward_ad as fwAD
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    conv, stock, x, kernel = _warm_kernel_layer(monkeypatch)
    conv.requires_grad_(False)
    stock.requires_grad_(False)
    t = torch.randn_like(x)
    torch.testing.assert_close(torch.func.vmap(conv)(torch.stack([x, t])), torch.func.vmap(stock)(torch.stack([x, t])))
    (out, tangent), (want, want_tangent) = torch.func.jvp(conv, (x,), (t,)), torch.func.jvp(stock, (x,), (t,))
    assert torch.equal(out, want) and torch.equal(tangent, want_tangent)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(conv(fwAD.make_dual(x, t))).tangent
    assert torch.equal(got, want_tangent)
    with torch.no_grad():
        with FlopCounterMode(display=False) as counted:
            conv(x)
        with FlopCounterMode(display=False) as stock_counted:
            stock(x)
        assert counted.get_total_flops() == stock_counted.get_total_flops() > 0
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # (the layer's parameters are real, as for nn.Conv2d)
            fake = conv(mode.from_tensor(x))
        assert type(fake).__name__ == "FakeTensor" and fake.shape == (2, 4, 8, 8)

        class Wrapped(torch.Tensor):  # a wrapper subclass (as DTensor is): no storage of its own for a kernel
            @staticmethod
            def __new__(cls, t):
                return torch.Tensor._make_wrapper_subclass(cls, t.shape, dtype=t.dtype, strides=t.stride())

            def __init__(self, t):
                self.inner = t

            @classmethod
            def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
                unwrap = lambda a: a.inner if isinstance(a, Wrapped) else a  # noqa: E731
                out = func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})
                return Wrapped(out) if isinstance(out, torch.Tensor) else out

        wrapped = conv(Wrapped(x))
        assert type(wrapped) is Wrapped and torch.equal(wrapped.inner, stock(x))
        assert kernel == []
        traced = torch.jit.trace(conv, x, check_trace=False)  # (the check runs the layer eagerly too: the kernel)
        assert "bagf::" not in str(traced.graph) and torch.equal(traced(x), stock(x))
    assert kernel == []
    with torch.no_grad():
        conv(x)  # and a plain call after all of them takes the plan
    assert kernel == ["Tensor"]


def test_a_model_traces_scripts_and_fx_traces_as_nn_conv2d_does_and_stays_converted():
    """torch.jit.trace of a converted model that has never run passes its own check (each call answers as the first
    did); torch.jit.script compiles torch's conv for each layer and leaves the eager model converted;
    torch.fx.symbolic_trace records a conv2d call with the layer's parameters. (CPU: every call is ATen's.)"""
    torch.manual_seed(0)
    stock = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3))
    x = torch.randn(2, 3, 8, 8)
    want = stock(x)
    for make in (lambda m: torch.jit.trace(m, x), torch.jit.script, torch.fx.symbolic_trace):
        model = bagf_torch.convert(torch.nn.Sequential(*[torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                                          torch.nn.Conv2d(4, 4, 3)]))
        model.load_state_dict(stock.state_dict())
        made = make(model)
        assert torch.equal(made(x), want) and torch.equal(model(x), want)
        assert all(type(m) is bagf_torch.TunedConv2d for m in (model[0], model[2])), make
        model[0].weight.data.mul_(2)  # the parameters are shared, not copied
        assert not torch.equal(made(x), want)


def test_unsupported_input_is_checked_once_per_kind_of_call(monkeypatch):
    rt, checks = _cuda_looking(monkeypatch, (7, True))
    conv = bagf_torch.TunedConv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    conv.double()
    for _ in range(20):
        conv(x)
    assert len(checks) == 1 and rt.lookups == 0
    xl = torch.randn(2, 3, 9, 9, dtype=torch.float64).to(memory_format=torch.channels_last)
    conv(xl)
    assert len(checks) == 1  # float64 again: answered without a check
    conv.float()
    xf = xl.float().transpose(2, 3)  # float32, neither NCHW nor channels_last: a new kind, checked once
    conv(xf)
    conv(xf)
    assert len(checks) == 2 and rt.lookups == 0


def test_a_wrong_channel_count_is_not_tuned(monkeypatch):
    """nn.Conv2d's own error, before anything is tuned or stored."""
    rt, _ = _cuda_looking(monkeypatch, (7, True))
    conv = bagf_torch.TunedConv2d(3, 4, 3)
    with pytest.raises(RuntimeError, match="channels"):
        conv(torch.randn(1, 5, 9, 9))
    assert rt.lookups == 0


@pytest.mark.parametrize("kw,message", [({"stride": 0}, "stride"), ({"dilation": (1, 0)}, "dilation"),
                                        ({"padding": -1}, "padding")])
def test_a_stride_dilation_or_padding_conv2d_refuses_is_not_tuned(monkeypatch, caplog, kw, message):
    """nn.Conv2d's own error for a stride or dilation below 1 or a negative padding, every call, with nothing tuned
    or logged (a stride of 0 had raised ZeroDivisionError from the output-size check, the others were tuned)."""
    rt, _ = _cuda_looking(monkeypatch, (7, True))
    stock = torch.nn.Conv2d(3, 4, 3, **kw)
    conv = bagf_torch.TunedConv2d.from_conv(stock)
    x = torch.randn(1, 3, 9, 9)
    with pytest.raises(RuntimeError) as want:
        stock(x)
    assert message in str(want.value)
    with caplog.at_level(logging.INFO, logger="bagf_torch"):
        for _ in range(2):
            with pytest.raises(RuntimeError) as got:
                conv(x)
            assert str(got.value) == str(want.value)
    assert rt.lookups == 0 and not [r for r in caplog.records if r.name == "bagf_torch"]


def test_a_weight_without_output_channels_is_not_tuned(monkeypatch):
    """K = 0: nn.Conv2d's own answer (torch refuses it), nothing tuned (the winograd_gemm start divides by K)."""
    rt, _ = _cuda_looking(monkeypatch, (7, True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Initializing zero-element tensors is a no-op"
        stock = torch.nn.Conv2d(3, 0, 3)
    conv = bagf_torch.TunedConv2d.from_conv(stock)
    x = torch.randn(1, 3, 9, 9)
    with pytest.raises(RuntimeError) as want:
        stock(x)
    with pytest.raises(RuntimeError) as got:
        conv(x)
    assert str(got.value) == str(want.value) and rt.lookups == 0


def test_torch_jit_script_scripts_a_tuned_conv():
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    bagf_torch.convert(m)
    scripted = torch.jit.script(m)
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(scripted(x), m(x))
    assert type(m[0]) is bagf_torch.TunedConv2d  # scripting left the eager model as it was


# ------------------------------------------------------------------------------------------- settings
def test_a_bad_log_setting_does_not_break_a_forward(monkeypatch, caplog):
    monkeypatch.setenv("BAGF_LOG", "verbose")
    log.reset()
    conv = bagf_torch.TunedConv2d(3, 4, 3)
    out = conv(torch.randn(1, 3, 8, 8))  # CPU: the fallback logs its reason, through the logger
    assert out.shape == (1, 4, 6, 6)


def test_a_bad_setting_in_a_forward_runs_aten_with_one_line(monkeypatch, caplog):
    monkeypatch.setenv("BAGF_TUNE", "maybe")
    monkeypatch.setattr(bnn.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    runtime.install(fh.make_runtime())
    conv = bagf_torch.TunedConv2d(3, 4, 3)
    x = torch.randn(1, 3, 8, 8)
    with caplog.at_level(logging.WARNING, logger="bagf_torch"):
        torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias))
    assert any("BAGF_TUNE" in r.getMessage() for r in caplog.records)


def test_a_bad_print_tuning_setting_keeps_the_plan_it_was_read_after(monkeypatch, caplog):
    """BAGF_PRINT_TUNING is read once a plan is tuned, stored and loaded: a bad value is one warning and no printed
    line; it used to raise there, and the layer served ATen for a shape it had just tuned."""
    monkeypatch.setenv("BAGF_PRINT_TUNING", "2")
    log.reset()
    monkeypatch.setattr(bnn.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    handles = []
    monkeypatch.setattr(bnn, "_op", lambda: lambda x, w, b, s, p, d, h: handles.append(h) or F.conv2d(x, w, b, s, p, d))
    monkeypatch.setattr(bnn, "_inference_call", lambda: None)
    rt = runtime.install(fh.make_runtime())
    conv = bagf_torch.TunedConv2d(3, 4, 3)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="bagf_torch"):
        conv(x)
        conv(x)
    assert rt.stats["tuned"] == 1 and len(handles) == 2 and ATEN not in handles
    assert [r.getMessage() for r in caplog.records if "BAGF_PRINT_TUNING" in r.getMessage()] == [
        "BAGF_PRINT_TUNING='2' is not a boolean; use 1/0, true/false, yes/no or on/off; not printing tuning lines"]


def test_a_bad_log_setting_does_not_fail_the_extensions_build(monkeypatch, caplog):
    """The build asks the logger (which warns about a bad BAGF_LOG and logs at 'warning') whether to be verbose; it
    read the setting itself inside the build's try, so a typo in BAGF_LOG failed the build with a message about the
    CUDA toolkit, and every layer ran ATen."""
    monkeypatch.setenv("BAGF_LOG", "verbose")
    log.reset()
    built = []
    extension = _fake_build(monkeypatch, built)
    monkeypatch.setattr(extension.shutil, "which", lambda name, path=None: f"/usr/bin/{name}")
    with caplog.at_level(logging.WARNING, logger="bagf_torch"):
        assert extension.load() is not None
    assert len(built) == 1 and built[0]["verbose"] is False
    assert any("BAGF_LOG='verbose'" in r.getMessage() for r in caplog.records)


def _fake_build(monkeypatch, built):
    """extension.load() on this CPU machine: CUDA and ninja looked for and found, torch's build recorded in
    ``built`` (its keyword arguments) instead of run."""
    import types

    from torch.utils import cpp_extension

    from bagf_torch.jit import extension

    monkeypatch.setattr(extension, "_ext", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(extension, "_cuda_home", lambda: Path("/usr/local/cuda"))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw) or types.SimpleNamespace())
    monkeypatch.setattr(bagf_torch.ops, "register_fake", lambda: None)
    return extension


def test_the_extension_builds_apart_per_source_and_past_a_killed_builds_lock(monkeypatch, tmp_path, caplog):
    """The build folder is named by the extension's sources too (two installs of other sources never share one;
    ninja's time stamps alone would let an older build stand); a 'lock' that torch's build left behind when its
    process was killed is removed by the next build instead of stalling it forever."""
    import shutil

    built = []
    extension = _fake_build(monkeypatch, built)
    monkeypatch.setattr(extension.shutil, "which", lambda name, path=None: f"/usr/bin/{name}")
    monkeypatch.delenv("BAGF_BUILD_DIR", raising=False)
    monkeypatch.setenv("BAGF_CACHE_DIR", str(tmp_path / "cache"))
    first = extension.build_dir()
    src = tmp_path / "_csrc"
    shutil.copytree(extension.csrc_dir(), src)
    monkeypatch.setattr(extension, "csrc_dir", lambda: src)
    assert extension.build_dir() == first  # the same sources, installed elsewhere
    (src / "kernels" / "winograd.cuh").write_text("// a kernel template: NVRTC's, not the extension's\n")
    assert extension.build_dir() == first
    (src / "bagf_ext.cpp").write_text((src / "bagf_ext.cpp").read_text() + "\n// changed\n")
    out = extension.build_dir()
    assert out != first and out.parent == first.parent and "-src" in out.name
    out.mkdir(parents=True)
    (out / "lock").write_text("")  # torch's FileBaton of a build killed mid-way
    with caplog.at_level(logging.WARNING, logger="bagf_torch"):
        extension.load()
    assert len(built) == 1 and built[0]["build_directory"] == str(out) and not (out / "lock").exists()
    assert any("did not finish" in r.getMessage() for r in caplog.records)


def test_a_file_system_without_flock_builds_under_torchs_lock_alone(monkeypatch, tmp_path):
    """Lustre without -o flock or NFS without lockd refuse flock (ENOSYS, ENOLCK): the build's own lock is then left
    out, with one info line, instead of failing the build (every layer would run ATen)."""
    import errno

    from bagf_torch.jit import extension

    def refuse(*args):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(extension.fcntl, "flock", refuse)
    ran = []
    with extension._build_lock(tmp_path):
        ran.append(1)
    assert ran == [1]


def test_ninja_beside_the_interpreter_is_found_without_an_activated_venv(monkeypatch, tmp_path):
    """A venv's python run without activating the venv (cron, an IDE, a notebook kernel) has pip's ninja beside it,
    not on PATH: the build puts that folder on PATH instead of saying 'pip install ninja'."""
    built = []
    extension = _fake_build(monkeypatch, built)
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "ninja").write_text("#!/bin/sh\n")
    (venv_bin / "ninja").chmod(0o755)
    monkeypatch.setattr(extension.sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setitem(sys.modules, "ninja", None)  # (and no ninja package to ask)
    extension.load()
    assert len(built) == 1 and os.environ["PATH"].split(os.pathsep)[0] == str(venv_bin)
    monkeypatch.setattr(extension, "_ext", None)
    (venv_bin / "ninja").unlink()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(extension.BuildError, match="pip install ninja"):
        extension.load()


@pytest.mark.parametrize("name,value", [("BAGF_BUDGET", "ten"), ("BAGF_LOG", "verbose"),
                                        ("BAGF_CLAIM_LEASE", "inf"), ("BAGF_CACHE_DIR", "~nouser_bagf/x")])
def test_the_cli_reports_a_bad_setting_in_one_line(monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    log.reset()
    if name == "BAGF_CACHE_DIR":
        rc = cli.main(["cache", "list"])
    elif name == "BAGF_CLAIM_LEASE":
        monkeypatch.setattr(cli, "cache_command", lambda *a, **k: settings.claim_lease())
        rc = cli.main(["cache", "list"])
    else:
        monkeypatch.setattr(cli, "cache_command",
                            lambda *a, **k: settings.budget_evaluations() and log.logger() and settings.log_level())
        rc = cli.main(["cache", "list"])
    err = capsys.readouterr().err
    assert rc == 2 and name in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name,fn,default", [("BAGF_TUNE", settings.tune_enabled, True),
                                             ("BAGF_BACKGROUND", settings.background, False),
                                             ("BAGF_BUDGET", settings.budget_evaluations, settings.DEFAULT_BUDGET),
                                             ("BAGF_TIME_BUDGET", settings.budget_seconds,
                                              settings.DEFAULT_TIME_BUDGET),
                                             ("BAGF_STRATEGY", settings.strategy, "ax")])
def test_an_empty_setting_is_its_default(monkeypatch, name, fn, default):
    monkeypatch.setenv(name, "  ")
    assert fn() == default


@pytest.mark.parametrize("name,value,fn", [("BAGF_CLAIM_LEASE", "inf", settings.claim_lease),
                                           ("BAGF_CLAIM_LEASE", "1e23", settings.claim_lease),
                                           ("BAGF_CLAIM_WAIT", "nan", settings.claim_wait),
                                           ("BAGF_TIME_BUDGET", "-inf", settings.budget_seconds),
                                           ("BAGF_ISOLATE_TIMEOUT", "1e300", settings.isolate_timeout),
                                           ("BAGF_CACHE_DIR", "~nouser_bagf/x", settings.cache_dir)])
def test_absurd_settings_are_rejected_by_name(monkeypatch, name, value, fn):
    monkeypatch.setenv(name, value)
    with pytest.raises(settings.SettingError, match=name):
        fn()


# ------------------------------------------------------------------------ TF32 mode and claim waits
def test_plans_of_the_other_tf32_mode_are_explained_once(monkeypatch, caplog):
    """tune pre-tunes one TF32 mode; a model run with PyTorch's default (TF32 on) misses those plans. The user
    is told once why, and what to do."""
    rt = runtime.install(fh.make_runtime())
    off = fh.P
    rt.plan_handle(off, 0)  # tuned and stored with TF32 off
    monkeypatch.setenv("BAGF_TUNE", "0")
    rt.forget()
    on = ConvProblem(**{**off.__dict__, "tf32": True})
    with caplog.at_level(logging.WARNING, logger="bagf_torch"):
        assert rt.lookup(on, 0) == (ATEN, False)
        assert rt.lookup(on, 0) == (ATEN, False)
    said = [r.getMessage() for r in caplog.records if "TF32" in r.getMessage()]
    assert len(said) == 1 and "--tf32 on" in said[0] and "allow_tf32 = False" in said[0]
    assert rt.lookup(off, 0)[0] != ATEN  # the plan of its own mode is still served


def test_a_claim_held_by_a_stuck_tuner_is_waited_for_a_bounded_time(monkeypatch, caplog):
    rt = runtime.install(fh.make_runtime())
    key = fingerprint(fh.P, fh.ENV)
    cache = rt.cache()
    holder = "otherhost:1234:0"  # a live-looking owner on another host: only its lease can void it
    assert cache.claim(key, holder, 600.0) is None
    monkeypatch.setenv("BAGF_CLAIM_WAIT", "0.3")
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="bagf_torch"):
        assert rt.lookup(fh.P, 0) == (ATEN, False)
    assert 0.25 <= time.monotonic() - t0 < 2.0
    assert any("BAGF_CLAIM_WAIT" in r.getMessage() for r in caplog.records)
    t0 = time.monotonic()
    assert rt.lookup(fh.P, 0) == (ATEN, False)  # no second wait
    assert time.monotonic() - t0 < 0.2
    cache.release(key, holder)  # the holder ends without a plan: the next lookup tunes
    assert rt.lookup(fh.P, 0)[0] != ATEN and rt.stats["tuned"] == 1


def test_tune_takes_the_tf32_mode_of_the_process_unless_told():
    old = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True  # PyTorch's default
        assert cli.tf32_mode(None) is True and cli.tf32_mode("off") is False
        torch.backends.cudnn.allow_tf32 = False
        assert cli.tf32_mode(None) is False and cli.tf32_mode("on") is True
    finally:
        torch.backends.cudnn.allow_tf32 = old
    args = cli.build_parser().parse_args(["tune", "--tf32", "off"])
    assert args.tf32 == "off"
    assert cli.build_parser().parse_args(["tune"]).tf32 is None


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_gpu_first_call_in_an_inference_context_runs_the_search(monkeypatch, caplog, context):
    """A layer's first call under no_grad / inference_mode tunes with Ax to its budget, on time, correctly."""
    monkeypatch.setenv("BAGF_BUDGET", "14")
    monkeypatch.setenv("BAGF_TIME_BUDGET", "10")
    torch.backends.cudnn.allow_tf32 = False
    conv = bagf_torch.TunedConv2d(16, 24, 3, padding=1).cuda()
    x = torch.randn(2, 16, 21, 19, device="cuda")
    # Ax imported first: in a process that has not imported it, its import took 5.8 s of the 10 and the search
    # sometimes had no batch left after the six start points (first_call.py measures that cost, not this test)
    wait = strategies.preload("ax")
    assert wait is None or wait(60)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="bagf_torch"), getattr(torch, context)():
        y = conv(x)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    want = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    assert float((y.double() - want).norm() / want.norm()) < 1e-4
    r = runtime.get().results[-1]
    assert not [rec.getMessage() for rec in caplog.records if "failed" in rec.getMessage()]
    # the search went past the start points
    assert r.evaluations > len(r.defaults), (r.evaluations, r.defaults)
    assert r.seconds <= 10 * 1.1 + 1 and took <= 10 * 1.1 + 5, (r.seconds, took)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_autocast_calls_tune_autocasts_dtype_and_float32_plans_still_serve(monkeypatch, dtype):
    """A layer with a tuned float32 plan, called under torch.autocast: the output has autocast's dtype and cuDNN's
    accuracy in it (the layer tunes the problem of that dtype: input, weight and bias cast as nn.Conv2d casts them);
    the same layer outside autocast still runs its float32 plan."""
    from bagf_torch.tuning.measure import CUDNN_ERROR_FACTOR, REL_TOL, judge_output, output_error

    monkeypatch.setenv("BAGF_BUDGET", "6")
    monkeypatch.setenv("BAGF_TIME_BUDGET", "4")
    torch.backends.cudnn.allow_tf32 = False
    conv = bagf_torch.TunedConv2d(16, 24, 3, padding=1).cuda()
    stock = torch.nn.Conv2d(16, 24, 3, padding=1).cuda()
    stock.load_state_dict(conv.state_dict())
    x = torch.randn(2, 16, 21, 19, device="cuda")
    with torch.no_grad():
        conv(x)  # tuned here
        assert runtime.get().stats["tuned"] == 1
        with torch.autocast("cuda", dtype=dtype):
            y, want = conv(x), stock(x)
        assert y.dtype == want.dtype == dtype and runtime.get().stats["tuned"] == 2
        assert runtime.get().results[-1].problem.dtype == str(dtype).replace("torch.", "")
        ref = F.conv2d(x.to(dtype).double(), conv.weight.to(dtype).double(), conv.bias.to(dtype).double(), padding=1)
        norm, top = float(ref.norm()), float(ref.abs().max())
        theirs = output_error(want, ref, norm, top)
        why = judge_output(y, ref, norm, top, max(REL_TOL, CUDNN_ERROR_FACTOR * theirs[0]),
                           max(10 * REL_TOL, CUDNN_ERROR_FACTOR * theirs[1]))
        assert why is None, (why, theirs)
        z = conv(x)
    assert z.dtype == torch.float32 and runtime.get().stats["tuned"] == 2
    ref = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    assert float((z.double() - ref).norm() / ref.norm()) < 1e-4


@pytest.mark.cuda
def test_gpu_first_call_inside_a_graph_capture_is_captured_as_aten():
    conv = bagf_torch.TunedConv2d(8, 8, 3, padding=1).cuda()
    x = torch.randn(1, 8, 12, 12, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        y = conv(x)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, F.conv2d(x, conv.weight, conv.bias, padding=1), rtol=1e-3, atol=1e-3)
    assert runtime.get().stats["tuned"] == 0


def test_claim_liveness_by_pid_only_inside_one_pid_namespace(monkeypatch):
    """Containers on one host may share its hostname, each with its own PIDs: a claim of a pid in another
    namespace is not voided because that pid does not exist here (it is alive until its lease ends)."""
    from bagf_torch import cache as cache_mod

    me = cache_mod.owner_id()
    assert cache_mod._owner_alive(me)
    host = me.split(":")[0]
    dead = 2**22 + 12345  # above Linux's pid_max: no such process here
    assert not cache_mod._owner_alive(f"{host}:{dead}:00")  # this namespace: a dead pid is dead
    if "/" in host:  # Linux: the id carries the namespace
        other_ns = host.split("/")[0] + "/1"
        assert cache_mod._owner_alive(f"{other_ns}:{dead}:00")  # same hostname, another namespace
        assert cache_mod._owner_alive(f"{host.split('/')[0]}:{dead}:00")  # an id without one: the lease decides


def test_model_report_carries_each_problems_wall_time_and_phases():
    """Where a problem's seconds went (the tune table gave only the tuner's own clock, so an overrun could not
    be traced to a phase)."""
    import json as _json

    from bagf_torch.pretune import ModelReport, _layer_report, make_record

    plan = {"problem": fh.P.as_dict(), "env": dict(fh.ENV), "family": "aten", "config": None, "time_us": 10.0,
            "aten_us": 10.0, "default_us": None, "evaluations": 5, "tune_seconds": 4.9, "cubin_digests": []}
    rec = make_record("k", plan, wall_seconds=5.3, phases={"compile": 3.1, "measure": 1.0})
    row = _layer_report(fh.P, ["conv"], rec)
    assert row.wall_seconds == 5.3 and row.phases == {"compile": 3.1, "measure": 1.0}
    report = ModelReport(rows=[row], unsupported=[], seconds=5.4, world_size=1)
    back = ModelReport.from_dict(_json.loads(report.to_json()))
    assert back.rows[0].wall_seconds == 5.3 and back.rows[0].phases == row.phases
    old = _json.loads(report.to_json())
    for r in old["rows"]:
        del r["wall_seconds"], r["phases"]
    assert ModelReport.from_dict(old).rows[0].wall_seconds is None  # a report written before these fields


def test_a_tune_report_says_what_made_it(monkeypatch):
    """The tune command's JSON carries its run's meta (machine, versions, date, command line, settings, wall time), so
    a report compared with another says where each came from; the meta survives the JSON round trip, and a report
    written before it reads as having none."""
    import json as _json

    from bagf_torch.pretune import ModelReport

    monkeypatch.setattr(sys, "argv", ["bagf_torch", "tune", "--model", "alexnet", "--seconds", "7"])
    args = cli.build_parser().parse_args(["tune", "--model", "alexnet", "--batch", "1,32", "--seconds", "7"])
    meta = cli._run_meta(args, tf32=False, wall_s=12.5)
    assert meta["command"] == "python -m bagf_torch tune --model alexnet --seconds 7"
    assert meta["batch"] == [1, 32] and meta["seconds_per_problem"] == 7.0 and meta["tf32"] is False
    assert meta["wall_seconds"] == 12.5 and meta["torch"] == torch.__version__ and meta["date"]
    assert meta["env"] is None  # no device given (the tune command gives its own: the cache keys' environment)
    assert meta["evaluations_per_problem"] == settings.budget_evaluations() and meta["strategy"] == settings.strategy()
    report = ModelReport(rows=[], seconds=1.0, meta=meta)
    doc = _json.loads(report.to_json())
    assert doc["meta"] == _json.loads(_json.dumps(meta))
    assert ModelReport.from_dict(doc).meta == doc["meta"]
    del doc["meta"]
    assert ModelReport.from_dict(doc).meta == {}


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_tune_seconds_out_of_range_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--seconds", value])
    assert e.value.code == 2 and "--seconds" in capsys.readouterr().err


def test_the_tf32_mode_is_read_under_torchs_newer_precision_api(monkeypatch):
    """After torch.backends.cudnn.conv.fp32_precision is set, the legacy allow_tf32 flag cannot be read (torch
    raises); the forward and the problem key read the newer setting instead."""
    conv_settings = getattr(getattr(torch.backends, "cudnn", None), "conv", None)
    if conv_settings is None or not hasattr(conv_settings, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no cudnn.conv.fp32_precision")
    rt, _ = _cuda_looking(monkeypatch, (ATEN, False))
    conv = bagf_torch.TunedConv2d(3, 4, 3)
    x = torch.randn(1, 3, 8, 8)
    conv(x)
    old = conv_settings.fp32_precision
    try:
        conv_settings.fp32_precision = "ieee"
        torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias))
        assert ConvProblem.from_call(x, conv.weight, conv.bias, 1, 0, 1, 1).tf32 is False
        conv_settings.fp32_precision = "tf32"
        assert ConvProblem.from_call(x, conv.weight, conv.bias, 1, 0, 1, 1).tf32 is True
    finally:
        conv_settings.fp32_precision = old
        torch.backends.cudnn.allow_tf32 = True  # back to the legacy API's default state


@pytest.mark.parametrize("precision", [None, "ieee", "tf32"], ids=["legacy-api", "new-api-ieee", "new-api-tf32"])
def test_cudnn_conv_mode_sets_and_restores_under_either_precision_api(precision):
    """The tuner's timings, pre-tuning's discovery and the bench set benchmark and TF32 mode around their conv
    calls. torch.backends.cudnn.flags raises once a program has set cudnn.conv.fp32_precision itself (it reads
    the legacy allow_tf32); cudnn_conv_mode works under both APIs and restores every setting, benchmark_limit
    included."""
    from bagf_torch.problem import cudnn_conv_mode, cudnn_tf32

    bk = torch.backends.cudnn
    conv_settings = getattr(bk, "conv", None)
    if precision is not None and (conv_settings is None or not hasattr(conv_settings, "fp32_precision")):
        pytest.skip(f"torch {torch.__version__} has no cudnn.conv.fp32_precision")
    old = conv_settings.fp32_precision if conv_settings is not None and hasattr(conv_settings, "fp32_precision") \
        else None
    limit, benchmark = bk.benchmark_limit, bk.benchmark
    try:
        if precision is not None:
            conv_settings.fp32_precision = precision
        before = cudnn_tf32()
        for tf32 in (True, False):
            with cudnn_conv_mode(benchmark=not benchmark, tf32=tf32, deterministic=False):
                assert cudnn_tf32() is tf32 and bk.benchmark is (not benchmark)
                x = torch.randn(1, 2, 5, 5)
                torch.nn.functional.conv2d(x, torch.randn(3, 2, 3, 3))  # a conv runs inside
            assert cudnn_tf32() is before and bk.benchmark is benchmark and bk.benchmark_limit == limit
            if precision is not None:
                assert conv_settings.fp32_precision == precision
        with cudnn_conv_mode(benchmark=True):  # TF32 left alone
            assert cudnn_tf32() is before
    finally:
        if old is not None:
            conv_settings.fp32_precision = old
        torch.backends.cudnn.allow_tf32 = True  # back to the legacy API's default state
        bk.benchmark = benchmark


def test_pre_tuning_discovers_under_torchs_newer_precision_api():
    """discover() ran its forward under cudnn.flags, which raised once a program had set
    cudnn.conv.fp32_precision: tune_model failed before tuning anything."""
    from bagf_torch import pretune

    conv_settings = getattr(torch.backends.cudnn, "conv", None)
    if conv_settings is None or not hasattr(conv_settings, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no cudnn.conv.fp32_precision")

    class FakeCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    model = bagf_torch.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)))
    old = conv_settings.fp32_precision
    try:
        conv_settings.fp32_precision = "ieee"
        found = pretune.discover(model, torch.randn(2, 3, 8, 8).as_subclass(FakeCuda))
        assert len(found.problems) == 1 and found.problems[0].tf32 is False
        assert conv_settings.fp32_precision == "ieee"
    finally:
        conv_settings.fp32_precision = old
        torch.backends.cudnn.allow_tf32 = True


@pytest.mark.parametrize("answer", [(ATEN, True), (ATEN, False)], ids=["aten-plan", "miss-or-wait"])
def test_torch_compile_fullgraph_after_eager_calls(monkeypatch, answer):
    """torch.compile traces a forward that touches no memo, clock or log: fullgraph holds after eager calls."""
    _cuda_looking(monkeypatch, answer)
    conv = bagf_torch.TunedConv2d(3, 4, 3)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        conv(x)
        conv(x)
        torch._dynamo.reset()
        out = torch.compile(conv, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(out, F.conv2d(x, conv.weight, conv.bias))


def _recording_op(monkeypatch) -> list:
    """The op replaced by F.conv2d recording each call's plan handle (plain Python: dynamo traces into it); the
    list of handles."""
    ran = []

    def fake_op(x, w, b, stride, padding, dilation, handle):
        ran.append(handle)
        return F.conv2d(x, w, b, stride, padding, dilation)

    monkeypatch.setattr(bnn, "_op", lambda: fake_op)
    return ran


def test_torch_compile_takes_dynamic_batch_sizes_and_export_records_no_plan(monkeypatch):
    """A plan serves one static shape, and the compiled graph of that shape runs it; the table lookup no longer hashes
    the sizes, which specialised every size (a recompile per batch size up to the recompile limit, mark_dynamic and
    export's Dim refused): other batch sizes share one dynamic graph of torch's conv. torch.export records torch's
    conv, with static or dynamic shapes: a plan handle means nothing in the process that loads the program."""
    import torch._dynamo.testing

    # (not _cuda_looking: its check counter is a list the traced code appends to, which dynamo guards on)
    monkeypatch.setattr(bnn.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    ran = _recording_op(monkeypatch)
    conv = bagf_torch.TunedConv2d(3, 4, 3, padding=1)
    x2 = torch.randn(2, 3, 8, 8)
    conv._remember(x2, conv._kernel_entry(7, (1, 1)))  # the plan of batch 2
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend=counter, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x2), F.conv2d(x2, conv.weight, conv.bias, 1, 1))
        assert ran == [7]
        for n in range(3, 13):
            x = torch.randn(n, 3, 8, 8)
            torch.testing.assert_close(compiled(x), F.conv2d(x, conv.weight, conv.bias, 1, 1))
        assert counter.frame_count <= 2 and ran == [7]
        compiled(x2)  # the planned size after the others (an eval loop's short last batch): still its plan
    assert ran == [7, 7]  # (its graph is traced again here only because the recording list has grown)
    x = torch.randn(4, 3, 8, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(conv, backend="eager", fullgraph=True)(x)
    ran.clear()
    for strict in (False, True):
        for shapes in (None, {"input": {0: torch.export.Dim("batch")}}):
            program = torch.export.export(conv, (x2,), dynamic_shapes=shapes, strict=strict)
            torch.testing.assert_close(program.module()(x2), F.conv2d(x2, conv.weight, conv.bias, 1, 1))
    assert ran == []


def _shape_recording_op(monkeypatch) -> list:
    """Every layer taken for a CUDA one, and the op replaced by F.conv2d recording each call's input shape and plan
    handle; the list of (shape, handle)."""
    monkeypatch.setattr(bnn.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    ran = []

    def fake_op(x, w, b, stride, padding, dilation, handle):
        ran.append((tuple(x.shape), handle))
        return F.conv2d(x, w, b, stride, padding, dilation)

    monkeypatch.setattr(bnn, "_op", lambda: fake_op)
    return ran


def test_a_layer_that_only_runs_compiled_takes_the_plans_the_cache_holds(monkeypatch):
    """A server that only runs a torch.compile'd model (BAGF_TUNE=0, a pre-tuned cache) got torch's conv for every
    shape: the traced forward read the plan table, which only eager calls fill. It now takes the cache's plan for a
    static shape (loaded while tracing), torch's conv for a shape the cache has no plan for."""
    ran = _shape_recording_op(monkeypatch)
    rt = runtime.install(fh.make_runtime())
    torch.manual_seed(0)
    conv = bagf_torch.TunedConv2d(3, 4, 3, padding=1)
    x2, x5 = torch.randn(2, 3, 8, 8), torch.randn(5, 3, 8, 8)
    problem = ConvProblem.from_call(x2, conv.weight, conv.bias, conv.stride, (1, 1), conv.dilation, 1)
    handle = rt.plan_handle(problem, -1)  # pre-tuned (here: tuned by the fake runtime), then a fresh process
    rt.forget()
    monkeypatch.setenv("BAGF_TUNE", "0")
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="eager", fullgraph=True)
    with torch.no_grad():
        for x in (x2, x5):
            torch.testing.assert_close(compiled(x), F.conv2d(x, conv.weight, conv.bias, 1, 1))
    assert handle != ATEN and [shape for shape, _ in ran] == [(2, 3, 8, 8)] and conv._bagf_plans == {}
    loaded = rt.fake_compiler.loaded
    assert ran[0][1] != ATEN and loaded[ran[0][1]] == loaded[handle]  # the stored plan, loaded again here


def test_compiling_a_model_tunes_its_static_shapes_as_its_first_eager_call_would(monkeypatch):
    """``torch.compile(convert(model))(x)`` in a process that never called the model eagerly, with an empty cache,
    got torch's conv in every layer for good: the traced forward only read plans. It now takes each static shape's
    plan as an eager first call does (the cache's, else tuned while compiling; ``nn._plan_at_trace``), and the graph
    runs it, fullgraph. A dynamic size (torch's automatic dynamic, ``mark_dynamic`` with or without bounds) is
    planned by no one: torch's conv, no error; with BAGF_TUNE=0 nothing is tuned."""
    import torch._dynamo.testing

    ran = _shape_recording_op(monkeypatch)
    rt = runtime.install(fh.make_runtime())
    torch.manual_seed(0)
    model = bagf_torch.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                                   torch.nn.Conv2d(4, 6, 3)))
    x2 = torch.randn(2, 3, 8, 8)
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        out = compiled(x2)
        ref = F.conv2d(F.relu(F.conv2d(x2, model[0].weight, model[0].bias, 1, 1)), model[2].weight, model[2].bias)
        torch.testing.assert_close(out, ref)
    assert rt.stats["tuned"] == 2 and counter.frame_count == 1  # (no eager call: the compiled graph was the first)
    assert [shape for shape, _ in ran] == [(2, 3, 8, 8), (2, 4, 8, 8)] and ATEN not in [h for _, h in ran]
    loaded = rt.fake_compiler.loaded
    assert all(h in loaded for _, h in ran)  # the plans tuned while compiling, loaded in this process
    assert model[0]._bagf_plans == {}  # (the layer's eager table is untouched: a graph writes nothing)
    with torch.no_grad():  # another batch size: torch's automatic dynamic, one graph of torch's conv, nothing tuned
        x3 = torch.randn(3, 3, 8, 8)
        ref3 = F.conv2d(F.relu(F.conv2d(x3, model[0].weight, model[0].bias, 1, 1)), model[2].weight, model[2].bias)
        torch.testing.assert_close(compiled(x3), ref3)
    assert rt.stats["tuned"] == 2 and len(ran) == 2 and counter.frame_count == 2
    # compiled again (a new process would read the cache): the same plans, nothing tuned
    ran.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="eager", fullgraph=True)(x2), ref)
    assert rt.stats["tuned"] == 2 and len(ran) == 2 and ATEN not in [h for _, h in ran]
    # dynamic sizes: nothing planned, nothing tuned, no error
    for marks in ({}, {"min": 3, "max": 15}):  # (bounds that CPU conv's own guards keep)
        ran.clear()
        x = torch.randn(5, 3, 8, 8)
        torch._dynamo.mark_dynamic(x, 0, **marks)
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(model, backend="eager", fullgraph=True)(x)
        assert got.shape == (5, 6, 6, 6) and ran == [] and rt.stats["tuned"] == 2, marks
    # tuning off, nothing cached for this shape: torch's conv, nothing tuned
    monkeypatch.setenv("BAGF_TUNE", "0")
    ran.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="eager", fullgraph=True)(torch.randn(3, 3, 8, 8))
    assert ran == [] and rt.stats["tuned"] == 2
    torch._dynamo.reset()


def test_discovering_a_model_compiled_in_place_leaves_its_graph_to_the_tuned_plans(monkeypatch):
    """``model.compile()`` then ``tune_model``: the discovery pass answers every lookup with ATen; through the
    compiled forward those answers would become the graph's constants, kept after pre-tuning. The pass runs the
    model eagerly, so the first compiled call afterwards takes the plan pre-tuning stored."""
    import torch._dynamo.testing

    from bagf_torch import pretune

    monkeypatch.setattr(bnn.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    ran = _recording_op(monkeypatch)
    rt = runtime.install(fh.make_runtime())
    model = bagf_torch.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1)))
    x = torch.randn(2, 3, 8, 8)
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    model.compile(backend=counter, fullgraph=True)
    try:
        found = pretune.discover(model, x)
        assert len(found.problems) == 1 and ran == [] and counter.frame_count == 0
        handle = rt.plan_handle(found.problems[0], -1)  # what tune_model then does with it
        with torch.no_grad():
            torch.testing.assert_close(model(x), F.conv2d(x, model[0].weight, model[0].bias, 1, 1))
        assert handle != ATEN and ran == [handle] and counter.frame_count == 1  # compiled now, with the plan
    finally:
        torch._dynamo.reset()


def test_eager_calls_in_other_threads_while_one_compiles_take_the_eager_path(monkeypatch):
    """From torch 2.13 ``torch.compiler.is_compiling()`` is True in every thread while one thread compiles, which sent
    other threads' eager calls down the traced forward (no plan table, no frozen weight, and now a wait on the tuning
    the compile runs); the layer asks ``is_dynamo_compiling``, which only dynamo's trace answers True."""
    import threading

    _cuda_looking(monkeypatch, (ATEN, True))
    compiling, called = threading.Event(), threading.Event()

    @bnn._compile_constant
    def held_plan(*args):  # the compile's plan, held until the other thread's eager call is done
        compiling.set()
        assert called.wait(10)
        return ATEN

    monkeypatch.setattr(bnn, "_plan_at_trace", held_plan)
    compiled_layer, eager_layer = bagf_torch.TunedConv2d(3, 4, 3), bagf_torch.TunedConv2d(3, 5, 3)
    x = torch.randn(1, 3, 8, 8)
    seen = {}

    def eager_call():
        assert compiling.wait(10)
        seen["compiling"] = torch.compiler.is_compiling()
        with torch.no_grad():
            eager_layer(x)
        called.set()

    thread = threading.Thread(target=eager_call)
    thread.start()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(compiled_layer, fullgraph=True, backend="eager")(x)
    finally:
        called.set()
        thread.join()
        torch._dynamo.reset()
    assert compiling.is_set() and eager_layer._bagf_plans, seen  # the eager call recorded its plan
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):
        assert seen["compiling"]  # (the flag this test is about: every thread's while one compiles)


def test_torch_compile_traces_the_plan_of_the_tf32_mode_at_trace_time(monkeypatch):
    """The traced forward reads the layer's plan table with the TF32 flag as a constant of the trace: a layer with
    a kernel for one mode and torch's conv for the other traces the one of the mode the graph is compiled in."""
    _cuda_looking(monkeypatch, (ATEN, True))
    ran = _recording_op(monkeypatch)
    conv = bagf_torch.TunedConv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 8, 8)
    old = torch.backends.cudnn.allow_tf32
    try:
        for tf32 in (True, False):
            torch.backends.cudnn.allow_tf32 = tf32
            conv._remember(x, conv._kernel_entry(7, (1, 1)) if tf32 else ("aten",))
        with torch.no_grad():
            for tf32, want in ((True, [7]), (False, [])):
                torch.backends.cudnn.allow_tf32 = tf32
                torch._dynamo.reset()
                ran.clear()
                out = torch.compile(conv, fullgraph=True, backend="eager")(x)
                torch.testing.assert_close(out, F.conv2d(x, conv.weight, conv.bias, 1, 1))
                assert ran == want, tf32
    finally:
        torch.backends.cudnn.allow_tf32 = old
        torch._dynamo.reset()


def test_background_tuning_that_gave_up_on_a_claim_takes_the_plan_later(monkeypatch):
    monkeypatch.setenv("BAGF_BACKGROUND", "1")
    monkeypatch.setenv("BAGF_CLAIM_WAIT", "0.2")
    rt = runtime.install(fh.make_runtime())
    key = fingerprint(fh.P, fh.ENV)
    holder = "otherhost:1234:0"
    assert rt.cache().claim(key, holder, 600.0) is None
    assert rt.lookup(fh.P, 0) == (ATEN, False)
    assert rt.wait_background(timeout=10)
    assert rt.lookup(fh.P, 0) == (ATEN, False)  # not memoised as ATen for good
    assert rt.wait_background(timeout=10)
    rt.cache().release(key, holder)
    assert rt.lookup(fh.P, 0) == (ATEN, False)  # queued: tuned in the background now
    assert rt.wait_background(timeout=30)
    handle, final = rt.lookup(fh.P, 0)
    assert final and handle != ATEN and rt.stats["tuned"] == 1


def test_a_deadline_inside_a_batch_is_not_reported_as_a_stall(caplog):
    """The search told that the budget is spent ends normally; only a step that does not come back is a stall."""
    tc, rp, problem = _recorded()
    clock = FakeClock()
    ev = rp.evaluator()
    comp = _SlowCompiler(ev, clock, wave_s=0.05)
    tuner = Tuner(replay_backend(ev, 1e6, clock=clock, measure_s=0.25, compiler=comp),  # slow timings cut batches short
                  tc, strategy="random", budget=Budget(200, 3.0), seed=0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="bagf_torch"):
        tuner.tune(problem)
    assert not [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]


@pytest.mark.parametrize("fail_at", [1, 3], ids=["start-point", "in-search"])
def test_a_check_that_raises_leaves_nothing_loaded_but_the_winner(fail_at):
    """A check that raises (a sticky CUDA error, say) unloads what its batch loaded; raised at the start point
    the tuning fails with nothing left loaded, inside a search the search ends and the tuner chooses among what
    it measured, unloading all but the winner."""
    tc, rp, problem = _recorded()
    backend = replay_backend(rp.evaluator(), 1e6)
    comp = backend.compiler
    unloaded = []
    comp.unload = unloaded.append
    calls = []

    def check(ws, h):
        calls.append(h)
        if len(calls) == fail_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    backend.checker = types.SimpleNamespace(check=check)
    tuner = Tuner(backend, tc, strategy="random", budget=Budget(20), seed=0)
    if fail_at == 1:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            tuner.tune(problem)
        kept = set()
    else:
        kept = {tuner.tune(problem).handle}
    assert len(unloaded) == len(set(unloaded))  # none twice
    assert set(unloaded) == set(comp.configs) - kept


def test_importing_bagf_torch_does_not_import_dynamo():
    """``import bagf_torch`` leaves torch._dynamo (and sympy) unloaded: a program that never compiles does not pay
    their import (1.6 s on a 2-core CPU); the forward's compile-time constant is marked as the decorator marks it
    (test_torch_compile_traces_the_plan_of_the_tf32_mode_at_trace_time traces it)."""
    import subprocess

    code = "import sys, bagf_torch; print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"], out.stdout

"""The process-wide runtime: problem -> plan handle, through the in-memory memo, the disk cache and the tuner.

``plan_handle(problem, device)`` is what a TunedConv2d asks on the first call for a shape. It returns the op's
plan handle: a loaded kernel, or ``ATEN`` (-1) when torch's own conv is the plan, when tuning is disabled
(BAGF_TUNE=0) and nothing is cached, or when tuning could not run here (the reason is logged once).
A warm cache costs no tuning and no NVRTC compile: the winner's cubin is loaded from the cache.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from . import log, settings
from .kernels import FAMILIES, implicit_gemm
from .problem import ConvProblem, fingerprint
from .tuning.common import Budget
from .tuning.measure import ATEN


@dataclass
class _Device:
    index: int
    env: dict
    compiler: object


class Runtime:
    """Plans for this process. Thread-safe; one tuning at a time per problem."""

    def __init__(self):
        self._lock = threading.RLock()  # device() creates the cache under it
        self._tune_lock = threading.Lock()
        self._memo: dict[tuple[ConvProblem, int], int] = {}
        self._devices: dict[int, _Device] = {}
        self._cache = None
        self.stats: Counter = Counter()
        self.results: list = []  # TuneResults of this process, for reports

    # ------------------------------------------------------------------ lazily created pieces
    def cache(self):
        if self._cache is None:
            with self._lock:
                if self._cache is None:
                    from .cache import Cache

                    self._cache = Cache.for_dir(settings.cache_dir())
        return self._cache

    def device(self, index: int) -> _Device:
        dev = self._devices.get(index)
        if dev is None:
            with self._lock:
                dev = self._devices.get(index)
                if dev is None:
                    from .jit.compiler import KernelCompiler
                    from .jit.extension import environment

                    with torch.cuda.device(index):
                        compiler = KernelCompiler(self.cache(), index, settings.compile_workers())
                        dev = _Device(index, environment(index), compiler)
                    self._devices[index] = dev
        return dev

    def key(self, problem: ConvProblem, device: int) -> str:
        return fingerprint(problem, self.device(device).env)

    # ------------------------------------------------------------------ the lookup
    def plan_handle(self, problem: ConvProblem, device: int) -> int:
        memo = self._memo.get((problem, device))
        if memo is not None:
            return memo
        with self._tune_lock:  # one tuning at a time: candidates would disturb each other's timings
            memo = self._memo.get((problem, device))
            if memo is not None:
                return memo
            dev = self.device(device)
            key = fingerprint(problem, dev.env)
            row = self.cache().get_plan(key)
            if row is not None:
                handle = self._load(row, dev)
                self.stats["cache_hits"] += 1
            elif not settings.tune_enabled():
                log.once(f"untuned:{problem}", f"BAGF_TUNE=0 and no cached plan for {problem.short()}: "
                         "using torch's conv2d for it", logging.INFO)
                return ATEN  # not memoised: enabling tuning later in this process still tunes it
            else:
                handle = self._tune_and_store(problem, dev, key)
            self._memo[(problem, device)] = handle
            return handle

    def _load(self, row: dict, dev: _Device) -> int:
        if row["family"] == "aten":
            return ATEN
        family = FAMILIES.get(row["family"])
        if family is None:
            log.once(f"family:{row['family']}", f"cached plan names unknown kernel family {row['family']!r}; "
                     "using torch's conv2d")
            return ATEN
        built = dev.compiler.compile(family, [row["config"]])[0]
        if not hasattr(built, "handle"):
            log.once(f"load:{row['config']}", f"cached plan {family.name(row['config'])} failed to load "
                     f"({built.status}: {built.detail.splitlines()[0] if built.detail else ''}); using ATen")
            return ATEN
        return built.handle

    def tuner(self, dev: _Device, budget: Budget | None = None, strategy: str | None = None, seed: int | None = None):
        from .tuning.measure import CudaBenchmarker, CudaChecker, Workspace
        from .tuning.tuner import Tuner

        device = torch.device("cuda", dev.index)
        return Tuner(dev.compiler, CudaChecker(dev.compiler.ext), CudaBenchmarker(),
                     lambda p: Workspace(p, device), implicit_gemm,
                     strategy=strategy or settings.strategy(),
                     budget=budget or Budget(settings.budget_evaluations(), settings.budget_seconds()),
                     seed=settings.seed() if seed is None else seed,
                     space_limit=dev.compiler.limits["shared_memory_per_block_optin"])

    def _tune_and_store(self, problem: ConvProblem, dev: _Device, key: str, tuner=None, progress=None) -> int:
        with torch.cuda.device(dev.index):
            result = (tuner or self.tuner(dev)).tune(problem, progress=progress)
        self.stats["tuned"] += 1
        self.results.append(result)
        cache = self.cache()
        cache.add_trials(key, [t.as_row() for t in result.trials])
        written = cache.put_plan(key, problem=problem.as_dict(), env=dev.env, family=result.family,
                                 config=result.config, time_us=result.time_us, aten_us=result.aten_us,
                                 default_us=result.default_us, evaluations=result.evaluations,
                                 tune_seconds=result.seconds,
                                 cubin_digests=[] if result.config is None else
                                 [dev.compiler.digest(implicit_gemm, result.config)])
        handle = result.handle
        if not written:  # another process stored a winner first: everyone uses that one
            if handle != ATEN:
                dev.compiler.unload(handle)
            handle = self._load(cache.get_plan(key), dev)
        line = (f"tuned {problem.short()}: {result.family if result.config is None else implicit_gemm.name(result.config)} "
                f"{result.time_us:.1f} us vs cuDNN {result.aten_us:.1f} us ({result.speedup:.2f}x), "
                f"{result.evaluations} evaluations in {result.seconds:.1f} s")
        log.logger().info(line)
        if settings.print_tuning():
            print(f"[bagf_torch] {line}", file=sys.stderr)
        return handle

    def pretune(self, problem: ConvProblem, device: int, *, tuner=None, progress=None) -> tuple[str, dict, bool]:
        """Make sure ``problem`` has a stored plan on ``device``: tune it now (even with BAGF_TUNE=0: pre-tuning
        is an explicit request) unless the cache already holds one. ``tuner`` replaces the default one (a
        different budget or strategy); ``progress`` gets one call per trial. Returns ``(key, plan row,
        tuned_now)``. Used by ``bagf_torch.tune_model``; the handle is memoised like a forward's lookup."""
        with self._tune_lock:
            dev = self.device(device)
            key = fingerprint(problem, dev.env)
            row = self.cache().get_plan(key)
            if row is not None:
                return key, row, False
            handle = self._tune_and_store(problem, dev, key, tuner=tuner, progress=progress)
            self._memo[(problem, device)] = handle
            return key, self.cache().get_plan(key), True

    def forget(self) -> None:
        """Drop the in-memory memo (the disk cache stays); tests use it to simulate a new process."""
        with self._lock:
            self._memo.clear()


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def get() -> Runtime:
    global _RUNTIME
    if _RUNTIME is None:
        with _RUNTIME_LOCK:
            if _RUNTIME is None:
                _RUNTIME = Runtime()
    return _RUNTIME


def reset() -> None:
    """Forget the runtime (cache handle, devices, memo); the next use re-reads the settings."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is not None and _RUNTIME._cache is not None:
            _RUNTIME._cache.close()
        _RUNTIME = None

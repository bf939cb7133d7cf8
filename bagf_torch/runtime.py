"""The process-wide runtime: problem -> plan handle, through the in-memory memo, the disk cache and the tuner.

``plan_handle(problem, device)`` is what a TunedConv2d asks on the first call for a shape. It returns the op's
plan handle: a loaded kernel, or ``ATEN`` (-1) when torch's own conv is the plan, when tuning is disabled
(BAGF_TUNE=0) and nothing is cached, or when tuning could not run here (the reason is logged once).
A warm cache costs no tuning and no NVRTC compile: the winner's cubin is loaded from the cache.

Several processes, one cache (DDP ranks or torchrun workers on one node, serving replicas): before tuning a
problem a process claims its key in the cache (``Cache.claim``); the others **wait** for the claimant's
plan and then load it, so every process runs the same kernel and the GPU is never shared by two tuners
(their timings would disturb each other). The claimant keeps its claim alive with a heartbeat; when it dies
(``kill -9``) its claim is taken over at once on this host, after ``BAGF_CLAIM_LEASE`` seconds elsewhere,
and the next process tunes. With ``BAGF_BACKGROUND=1`` the waiting (and the tuning) happens in a background
thread while the caller runs ATen, so nobody stalls.

Trials are written to the cache as each one completes (not at the end), so a tuning run killed half-way
keeps what it measured; the next process re-tunes the problem from the start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, ContextManager, Sequence

import torch

from . import log, settings, shutdown
from .kernels import FAMILIES, families_for, family_name
from .ops import ATEN
from .problem import ConvProblem, fingerprint
from .tuning.common import Budget, TrialEvent, TrialListener
from .tuning.warmstart import neighbour_seeds


def _cuda_device(index: int) -> ContextManager:
    return torch.cuda.device(index)


@dataclass
class _Device:
    index: int
    env: dict
    compiler: object
    # Makes the device current on the calling thread (torch.cuda.device by default; a no-op for fakes).
    context: Callable[[int], ContextManager] = field(default=_cuda_device)


class _Journal:
    """Writes each trial to the cache the moment its outcome is final: a listener of the Tuner, which reports a
    compile failure, a check failure or a timing as the last word on a configuration (it memoises
    configurations, so none is reported twice). The finalists' interleaved re-timing is not a trial and is not
    journaled."""

    def __init__(self, cache, key: str):
        self.cache = cache
        self.key = key

    def __call__(self, event: TrialEvent) -> None:
        self.cache.add_trials(self.key, [event.as_row()])


_WAIT = object()
"""``Runtime._resolve``'s answer while another process tunes the problem: sleep, then ask again."""


class _ClaimWait:
    """One lookup's wait for another process's tuning of its problem: since when it waits, the next sleep, and
    whether the lookup ended up tuning the problem itself."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.poll = 0.01
        self.tuned = False


class _Heartbeat:
    """Keeps this process's claim on a key alive while it tunes (a daemon thread renewing the lease)."""

    def __init__(self, cache, key: str, owner: str, lease_s: float):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(cache, key, owner, lease_s), daemon=True,
                                        name="bagf-claim-heartbeat")

    def _run(self, cache, key, owner, lease_s):
        while not self._stop.wait(lease_s / 3):
            try:
                cache.heartbeat(key, owner, lease_s)
            except Exception:  # a cache that broke under us: the claim lapses, first writer still wins
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class Runtime:
    """Plans for this process. Thread-safe; one tuning at a time per process.

    Where a tuning's trials run is ``Runtime.backend`` (``tuning.backend``: this process, or an isolated worker
    with ``BAGF_ISOLATE=1``), read from the tuner's backend afterwards: a non-local winner is loaded from the cache.
    ``devices(index) -> _Device`` and ``make_tuner(runtime, device, listeners) -> tuner`` replace the CUDA
    device and the Tuner (a Tuner over a replay backend, say), which reports its trials to ``listeners``: CPU
    tests drive the whole lookup, claims and background tuning this way; by default they are ``Runtime.device``
    and ``Runtime.tuner``. What ``make_tuner`` returns has ``tune(problem, seeds=)`` and a ``backend`` whose
    ``local`` says where the winner's handle lives. Install one with ``runtime.install(Runtime(...))``.
    """

    def __init__(self, devices: Callable[[int], _Device] | None = None,
                 make_tuner: Callable[["Runtime", _Device, Sequence[TrialListener]], object] | None = None):
        from .cache import owner_id

        self._lock = threading.RLock()  # device() creates the cache under it
        self._tune_lock = threading.Lock()
        self._memo: dict[tuple[ConvProblem, int], int] = {}
        self._devices: dict[int, _Device] = {}
        self._device_factory = devices
        self._make_tuner = make_tuner
        self._cache = None
        self._owner = owner_id()
        self._pending: dict[tuple[ConvProblem, int], threading.Event] = {}
        # problems whose claim holder this process stopped waiting for (BAGF_CLAIM_WAIT): later lookups look
        # for the winner once and do not wait again
        self._gave_up: set[tuple[ConvProblem, int]] = set()
        self._mode_checked: set[tuple[ConvProblem, int]] = set()  # the other-TF32-mode look, once per problem
        self._queue: queue.Queue | None = None
        self._background: threading.Thread | None = None  # the background tuner reading _queue
        self._closing = threading.Event()  # set: the background tuner ends after its tuning, claim waits end
        self._pools: dict[int, object] = {}  # isolated worker pools, one per device
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
                    if self._device_factory is not None:
                        dev = self._device_factory(index)
                    else:
                        from .jit.compiler import KernelCompiler
                        from .jit.extension import environment

                        with torch.cuda.device(index):
                            compiler = KernelCompiler(self.cache(), index, settings.compile_workers())
                            dev = _Device(index, environment(index), compiler)
                    self._devices[index] = dev
        return dev

    def key(self, problem: ConvProblem, device: int) -> str:
        return fingerprint(problem, self.device(device).env)

    def cached_plans(self, like: ConvProblem, device: int) -> list[tuple[tuple[int, int, int], int]]:
        """((N, H, W), handle) of every kernel plan the cache holds on ``device`` for problems that are ``like`` but
        for N, H and W, loaded now: what a layer torch.compile traces with a dynamic size compares that size with,
        so that a planned size gets its own graph with its plan (``nn._cached_plans_at_trace``): under the tune lock,
        so a trace waits for a tuning another thread is running. Plans of another machine's env are not this device's;
        "aten" plans are left out (torch's conv needs no handle)."""
        with self._tune_lock:
            dev = self.device(device)
            out = []
            for row in self.cache().plans():
                problem = ConvProblem.from_dict(row["problem"])
                if row["family"] == "aten" or dataclasses.replace(problem, n=like.n, h=like.h, w=like.w) != like:
                    continue
                if fingerprint(problem, dev.env) != row["key"]:
                    continue  # (another GPU's, versions', or sources' plan)
                handle = self._memo.get((problem, device))
                if handle is None:
                    handle = self._memo[(problem, device)] = self._load(row, dev)
                if handle != ATEN:
                    out.append(((problem.n, problem.h, problem.w), handle))
            return out

    # ------------------------------------------------------------------ the lookup
    def plan_handle(self, problem: ConvProblem, device: int) -> int:
        """The plan for ``problem`` on ``device``, tuning it first if needed (see ``lookup``)."""
        return self.lookup(problem, device)[0]

    def lookup(self, problem: ConvProblem, device: int) -> tuple[int, bool]:
        """``(handle, final)``. ``final`` is False when ATen stands in for now (BAGF_TUNE=0 with nothing
        cached, or BAGF_BACKGROUND=1 while the problem is tuned in the background): ask again later."""
        memo = self._memo.get((problem, device))
        if memo is not None:
            return memo, True
        if _capturing():
            # Tuning synchronises the device and allocates, which a CUDA graph capture forbids; torch's own
            # graph recipe warms a model up before capturing it, and that warm-up call is the one that tunes.
            log.once(f"capture:{problem}", f"{problem.short()}: first call inside a CUDA graph capture; torch's "
                     "conv is captured for it (run the model once before capturing to tune it)")
            return ATEN, False
        if settings.background():
            return self._lookup_background(problem, device)
        handle = self._resolve_waiting(problem, device, _ClaimWait(), memo=True)
        if handle is None:
            return ATEN, False  # not memoised: enabling tuning later in this process still tunes it
        return handle, True

    def _resolve_waiting(self, problem: ConvProblem, device: int, wait: "_ClaimWait", *, memo: bool = False,
                         **options) -> int | None:
        """``_resolve`` under the tune lock (one tuning at a time: candidates would disturb each other's timings),
        and between its passes, while another process tunes the problem, a sleep with the lock let go: another
        thread's lookup of a problem already cached or tuned is not held up for BAGF_CLAIM_WAIT. With ``memo``, the
        handle is taken from this process's memo when another thread put it there meanwhile, and put there.
        ``options`` go to ``_resolve``."""
        slot = (problem, device)
        while True:
            with self._tune_lock:
                if memo and slot in self._memo:
                    return self._memo[slot]
                handle = self._resolve(problem, device, wait, **options)
                if handle is not _WAIT:
                    if memo and handle is not None:
                        self._memo[slot] = handle
                    return handle
            time.sleep(wait.poll)  # until the holder stores its plan, releases, dies or lets its lease lapse
            wait.poll = min(wait.poll * 1.5, 0.25)

    def _resolve(self, problem: ConvProblem, device: int, wait: "_ClaimWait", *, explicit: bool = False,
                  tuner_options: dict | None = None, listeners: Sequence[TrialListener] = ()) -> "int | None | object":
        """One pass: the cached plan, else tune it; _WAIT while another process tunes it (the caller sleeps with
        the tune lock let go, then asks again: ``_resolve_waiting``); None: BAGF_TUNE=0 and nothing cached, or the
        wait for the other process ran out (BAGF_CLAIM_WAIT). ``explicit`` (pre-tuning): tune even with
        BAGF_TUNE=0, and after a wait that ran out (``wait.tuned`` says it tuned). Called with the tune lock held."""
        dev = self.device(device)
        key = fingerprint(problem, dev.env)
        cache = self.cache()
        if cache.in_memory and _distributed_world() > 1:
            log.once("ddp-memory-cache", f"bagf_torch cache is in memory ({cache.fallback_reason or 'by request'}): "
                     "the ranks of this job cannot see each other's claims and plans, so each tunes on its own "
                     "and they may pick different kernels; give them a writable BAGF_CACHE_DIR on this node")
        slot = (problem, device)
        if not explicit and slot in self._memo:  # (another thread loaded it while this one waited, lock let go)
            return self._memo[slot]
        row = cache.get_plan(key)
        if row is not None:
            self.stats["cache_hits"] += 1
            self._gave_up.discard(slot)
            return self._load(row, dev)
        if slot not in self._mode_checked:
            self._mode_checked.add(slot)
            self._check_other_mode(problem, dev, cache)
        if not explicit and not settings.tune_enabled():
            log.once(f"untuned:{problem}", f"BAGF_TUNE=0 and no cached plan for {problem.short()}: "
                     "using torch's conv2d for it", logging.INFO)
            return None

        def tune() -> int:
            wait.tuned = True
            return self._tune_and_store(problem, dev, key, tuner_options=tuner_options, listeners=listeners)

        lease = settings.claim_lease()
        holder = cache.claim(key, self._owner, lease)
        if holder is None:
            try:
                # the holder may have stored its plan and released between our look and our claim
                row = cache.get_plan(key)
                if row is not None:
                    self.stats["cache_hits"] += 1
                    return self._load(row, dev)
                with _Heartbeat(cache, key, self._owner, lease):
                    return tune()
            finally:
                cache.release(key, self._owner)
        if slot in self._gave_up and not explicit:
            return None  # torch's conv again; the next lookup looks for the winner once more
        if wait.since is None:
            wait.since = time.monotonic()
            self.stats["waited"] += 1
            log.logger().info(f"{problem.short()} is being tuned by another process ({holder}); "
                              "waiting for its plan")
        elif time.monotonic() - wait.since >= settings.claim_wait():
            # A holder whose heartbeat runs while its tuning is stuck would keep us here for ever.
            self.stats["gave_up"] += 1
            if explicit:  # a pre-tuning asked for this plan: it tunes it after all
                log.logger().warning(f"{problem.short()}: waited {settings.claim_wait():g} s (BAGF_CLAIM_WAIT) for "
                                     f"{holder} to finish tuning it; tuning it here")
                return tune()
            self._gave_up.add(slot)
            log.once(f"claim-wait:{key}", f"{problem.short()}: waited {settings.claim_wait():g} s (BAGF_CLAIM_WAIT) "
                     f"for {holder} to finish tuning it; torch's conv serves it meanwhile, and its plan is used once "
                     "it is stored")
            return None
        if self._closing.is_set():
            return None  # (the runtime is closing or the interpreter ending: nothing waits for this plan)
        return _WAIT

    def _check_other_mode(self, problem: ConvProblem, dev: _Device, cache) -> None:
        """Say once why pre-tuned plans are not used when the cache holds this problem only in the other TF32
        mode: ``tune`` pre-tunes one mode (cudnn.allow_tf32, part of the key), and a model run with PyTorch's
        defaults (TF32 on) misses plans tuned with it off, and vice versa."""
        if problem.dtype != "float32":
            return
        other = dataclasses.replace(problem, tf32=not problem.tf32)
        try:
            found = cache.get_plan(fingerprint(other, dev.env)) is not None
        except Exception:  # a hint, never a reason to fail the lookup
            return
        if found:
            now, then = ("on", "off") if problem.tf32 else ("off", "on")
            log.once(f"tf32-mode:{now}", f"the cache holds plans tuned with cuDNN TF32 {then} (e.g. for "
                     f"{problem.short()}), but this process runs with torch.backends.cudnn.allow_tf32="
                     f"{problem.tf32}, and plans are per TF32 mode, so they are not used here; set "
                     f"torch.backends.cudnn.allow_tf32 = {not problem.tf32} before running the model, or pre-tune "
                     f"this mode: python -m bagf_torch tune --tf32 {now}")

    # ------------------------------------------------------------------ serve while tuning
    def _lookup_background(self, problem: ConvProblem, device: int) -> tuple[int, bool]:
        slot = (problem, device)
        with self._lock:
            if slot in self._pending:
                return ATEN, False
            memo = self._memo.get(slot)
            if memo is not None:
                return memo, True
            if not settings.tune_enabled():
                # The cache may hold it (a plan from another process): one quick look, no tuning.
                dev = self.device(device)
                row = self.cache().get_plan(fingerprint(problem, dev.env))
                if row is None:
                    log.once(f"untuned:{problem}", f"BAGF_TUNE=0 and no cached plan for {problem.short()}: "
                             "using torch's conv2d for it", logging.INFO)
                    return ATEN, False
                handle = self._load(row, dev)
                self.stats["cache_hits"] += 1
                self._memo[slot] = handle
                return handle, True
            self._pending[slot] = threading.Event()
            if self._queue is None:
                self._queue = queue.Queue()
                self._closing.clear()
                worker = threading.Thread(target=self._background_worker, args=(self._queue,), daemon=True,
                                          name="bagf-background-tuner")
                worker.start()
                self._background = worker
                # at the interpreter's exit (and in close): the tuning in progress finishes, no other starts
                shutdown.track(worker, partial(self._stop_background, self._queue))
            self._queue.put(slot)
        log.once(f"background:{problem}", f"{problem.short()}: looking up / tuning its plan in the background; "
                 "torch's conv2d serves it meanwhile", logging.INFO)
        return ATEN, False

    def _stop_background(self, jobs: queue.Queue) -> None:
        """Ask the background tuner reading ``jobs`` to end after the tuning it is in (a claim wait ends at once):
        ``_closing``, and None to wake it when idle."""
        self._closing.set()
        jobs.put(None)

    def _background_worker(self, jobs: queue.Queue) -> None:
        # A daemon thread, ended by _stop_background. The problems left queued then are let go (their waiters
        # released, nothing memoised): a later lookup asks again, another process tunes them (their claims lapse).
        while True:
            slot = jobs.get()
            if slot is None or self._closing.is_set():
                left = [] if slot is None else [slot]
                while True:
                    try:
                        left.append(jobs.get_nowait())
                    except queue.Empty:
                        break
                with self._lock:
                    for job in left:
                        if job is not None and job in self._pending:
                            self._pending.pop(job).set()
                return
            problem, device = slot
            try:
                handle = self._resolve_waiting(problem, device, _ClaimWait())
            except Exception as e:  # never retried in a loop: the problem runs on ATen in this process
                log.once(f"tune-error:{type(e).__name__}", f"bagf_torch could not tune {problem.short()} in the "
                         f"background ({type(e).__name__}: {e}); using torch's conv2d for it")
                handle = ATEN
            with self._lock:
                if handle is not None:  # None: no plan yet (another process is tuning it): ask again later
                    self._memo[slot] = handle
                self._pending.pop(slot).set()
            _bump()

    def wait_background(self, timeout: float | None = None) -> bool:
        """Wait until every background tuning started so far is done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                events = list(self._pending.values())
            if not events:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            events[0].wait(left)

    # ------------------------------------------------------------------ loading and tuning
    def _load(self, row: dict, dev: _Device) -> int:
        if row["family"] == "aten":
            return ATEN
        family = FAMILIES.get(row["family"])
        if family is None:
            log.once(f"family:{row['family']}", f"cached plan names unknown kernel family {row['family']!r}; "
                     "using torch's conv2d")
            return ATEN
        with dev.context(dev.index):
            built = dev.compiler.compile(family, [row["config"]])[0]
        if not hasattr(built, "handle"):
            log.once(f"load:{row['config']}", f"cached plan {family.name(row['config'])} failed to load "
                     f"({built.status}: {built.detail.splitlines()[0] if built.detail else ''}); using ATen")
            return ATEN
        return built.handle

    def backend(self, dev: _Device):
        """Where the trials of a tuning on ``dev`` run (``tuning.backend``), chosen here and nowhere else: in a
        child process with ``BAGF_ISOLATE=1`` (``tuning.isolated``; the Tuner and its listeners stay in this
        process, and the winner is loaded here from the cache), else in this process on ``dev.compiler``."""
        if settings.isolate():
            return self._pool(dev).backend()
        from .tuning.backend import cuda_backend

        return cuda_backend(dev.index, dev.compiler)

    def tuner(self, dev: _Device, budget: Budget | None = None, strategy: str | None = None, seed: int | None = None,
              listeners: Sequence[TrialListener] = (), backend=None):
        """The Tuner for ``dev``, its trials run by ``backend`` (default: ``self.backend(dev)``), reporting each to
        ``listeners``."""
        from .tuning.tuner import Tuner

        return Tuner(backend or self.backend(dev), families_for(torch.cuda.get_device_capability(dev.index)),
                     strategy=strategy or settings.strategy(),
                     budget=budget or Budget(settings.budget_evaluations(), settings.budget_seconds()),
                     seed=settings.seed() if seed is None else seed,
                     space_limit=dev.compiler.limits["shared_memory_per_block_optin"],
                     sms=dev.compiler.limits.get("multiprocessors"),
                     prune_factor=settings.prune_factor(), listeners=listeners)

    def _pool(self, dev: _Device):
        with self._lock:
            pool = self._pools.get(dev.index)
            if pool is None:
                from .tuning.isolated import WorkerPool

                pool = self._pools[dev.index] = WorkerPool(dev.index, timeout_s=settings.isolate_timeout())
            else:
                pool.timeout_s = settings.isolate_timeout()  # (read at each tuning, as every setting is)
            return pool

    def _tune_and_store(self, problem: ConvProblem, dev: _Device, key: str, tuner_options: dict | None = None,
                        listeners: Sequence[TrialListener] = ()) -> int:
        """Tune ``problem`` and store the winner. ``tuner_options`` (budget, strategy, seed) go to
        ``self.tuner``; ``listeners`` hear every trial, after the journal has written it to the cache."""
        cache = self.cache()
        listeners = [_Journal(cache, key), *listeners]
        with dev.context(dev.index), _tuning_stream(dev):
            if self._make_tuner is not None:
                tuner = self._make_tuner(self, dev, listeners)
            else:
                tuner = self.tuner(dev, listeners=listeners, **(tuner_options or {}))
            isolated = not tuner.backend.local  # the winner's handle is another process's
            seeds = neighbour_seeds(problem, cache.plans(), dev.env)  # warm start from stored neighbours
            result = tuner.tune(problem, seeds=seeds)
        self.stats["tuned"] += 1
        self.results.append(result)
        # (no cubin for torch's conv, nor for a library family's plan)
        digest = None if result.config is None else dev.compiler.digest(FAMILIES[result.family], result.config)
        written = cache.put_plan(key, problem=problem.as_dict(), env=dev.env, family=result.family,
                                 config=result.config, time_us=result.time_us, aten_us=result.aten_us,
                                 default_us=result.default_us, evaluations=result.evaluations,
                                 tune_seconds=result.seconds, cubin_digests=[] if digest is None else [digest])
        handle = result.handle
        if isolated:
            # The winner ran only in the child: free it there, load it here (its cubin is in the cache).
            if handle != ATEN:
                tuner.compiler.unload(handle)
            handle = ATEN
        if isolated or not written:  # (not written: another process stored a winner first; everyone uses it)
            if handle != ATEN:
                dev.compiler.unload(handle)
            handle = self._load(cache.get_plan(key), dev)
        line = (f"tuned {problem.short()}: {family_name(result.family, result.config)} "
                f"{result.time_us:.1f} us vs cuDNN {result.aten_us:.1f} us ({result.speedup:.2f}x), "
                f"{result.evaluations} evaluations in {result.seconds:.1f} s")
        log.logger().info(line)
        try:
            printing = settings.print_tuning()
        except settings.SettingError as e:  # the plan is stored and loaded: a bad print flag must not lose it
            log.once("print-tuning", f"{e}; not printing tuning lines")
            printing = False
        if printing:
            print(f"[bagf_torch] {line}", file=sys.stderr)
        return handle

    def pretune(self, problem: ConvProblem, device: int, *, tuner_options: dict | None = None,
                listeners: Sequence[TrialListener] = ()) -> tuple[str, dict, bool]:
        """Make sure ``problem`` has a stored plan on ``device``: tune it now (even with BAGF_TUNE=0: pre-tuning
        is an explicit request) unless the cache already holds one. ``tuner_options`` (budget, strategy,
        seed) adjust the tuner; ``listeners`` hear every trial. Returns ``(key, plan row, tuned_now)``. Used by
        ``bagf_torch.tune_model``; the handle is memoised like a forward's lookup, a cached plan's too (loaded now):
        a first call inside a CUDA graph capture, which cannot load or tune, then runs the plan."""
        with self._tune_lock:
            dev = self.device(device)
            key = fingerprint(problem, dev.env)
            row = self.cache().get_plan(key)
            if row is not None:
                if (problem, device) not in self._memo:  # (as a forward's lookup of a cached plan loads it)
                    self._memo[(problem, device)] = self._load(row, dev)
                return key, row, False
        # as a forward's lookup: under a claim, so that a forward (or another pre-tuning) of this problem in
        # another process waits for this plan instead of tuning it beside this tuning, and the reverse
        wait = _ClaimWait()
        handle = self._resolve_waiting(problem, device, wait, memo=False, explicit=True, tuner_options=tuner_options,
                                       listeners=listeners)
        row = self.cache().get_plan(key)
        if row is None:  # (the runtime closing while it waited)
            raise RuntimeError(f"{problem.short()}: no plan (bagf_torch's runtime closed while waiting for it)")
        with self._tune_lock:
            self._memo[(problem, device)] = handle
        _bump()  # layers serving this problem with ATen for now take the plan at their next call
        return key, row, wait.tuned

    def prefetch_starts(self, problems: Sequence[ConvProblem], device: int, *,
                        tuner_options: dict | None = None) -> int:
        """Compile the start points of those of ``problems`` the cache has no plan for on ``device``, in one
        parallel wave (``Tuner.prefetch_starts``), before ``pretune`` tunes them one by one. The compiles go to
        ``dev.compiler``, whose cubin cache an isolated tuning's worker reads too (BAGF_ISOLATE=1 starts no worker
        for this). Returns how many configurations it asked for."""
        from .tuning.backend import TrialBackend

        dev = self.device(device)
        todo = [p for p in problems if self.cache().get_plan(fingerprint(p, dev.env)) is None]
        if not todo:
            return 0
        if self._make_tuner is not None:
            tuner = self._make_tuner(self, dev, [])
        else:
            compile_only = TrialBackend(dev.compiler, None, None, lambda problem: None)
            tuner = self.tuner(dev, backend=compile_only, **(tuner_options or {}))
        return tuner.prefetch_starts(todo)

    def forget(self) -> None:
        """Drop the in-memory memo (the disk cache stays); tests use it to simulate a new process."""
        with self._lock:
            self._memo.clear()
            self._gave_up.clear()
        _bump()

    def close(self) -> None:
        """Stop isolated worker processes and the background tuner (after the tuning it is in), close the cache."""
        with self._lock:
            worker, jobs = self._background, self._queue
            self._background = self._queue = None  # (a later background lookup starts a worker of its own)
        if worker is not None:  # its tuning uses the cache: finished before the cache closes
            self._stop_background(jobs)
            worker.join(shutdown.EXIT_WAIT_S)
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
            if self._cache is not None:
                self._cache.close()


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where CUDA is not initialised)."""
    try:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


def _distributed_world() -> int:
    """World size of an initialised torch.distributed job, else 1."""
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except Exception:
        return 1


def _tuning_stream(dev: _Device) -> ContextManager:
    """Tune on a stream of its own when not on the main thread (BAGF_BACKGROUND): the legacy default stream
    would serialise with the user's work on every other stream."""
    if threading.current_thread() is threading.main_thread() or not isinstance(dev.index, int) \
            or not torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(dev.index))


GENERATION = 0
"""Bumped whenever a plan may have appeared that a layer serving ATen *for now* should take at once (a
background tuning finished, the memo was dropped, the runtime replaced): TunedConv2d's fast path compares it
instead of asking the runtime on every call."""


def _bump() -> None:
    global GENERATION
    GENERATION += 1


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def get() -> Runtime:
    global _RUNTIME
    if _RUNTIME is None:
        with _RUNTIME_LOCK:
            if _RUNTIME is None:
                _RUNTIME = Runtime()
    return _RUNTIME


def install(rt: Runtime) -> Runtime:
    """Make ``rt`` the process's runtime (replacing, and closing, the current one); returns it."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is not None and _RUNTIME is not rt:
            _RUNTIME.close()
        _RUNTIME = rt
    _bump()
    return rt


def reset() -> None:
    """Forget the runtime (cache handle, devices, memo, worker processes); the next use re-reads the settings."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is not None:
            _RUNTIME.close()
        _RUNTIME = None
    _bump()

"""Fakes for the fault-matrix tests (tests/test_faults.py) that also run inside spawned child processes, so
they live in an importable module: a compiler that loads nothing, a benchmarker that replays timings with
per-process noise and an optional delay, and a Runtime wired to them through its injection points."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import types

from bagf_torch import runtime
from bagf_torch.kernels import implicit_gemm as ig
from bagf_torch.ops import ATEN
from bagf_torch.problem import ConvProblem
from bagf_torch.tuning.backend import TrialBackend
from bagf_torch.tuning.common import Budget, Outcome
from bagf_torch.tuning.tuner import Tuner

P = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
ENV = {"gpu": "Fake GPU", "cc": "9.0", "driver": 1, "runtime": 1, "nvrtc": "13.0", "torch": "x",
       "bagf_torch": "0.1.0", "kernels": "k", "os": "posix"}


class FakeCompiler:
    """Compiles nothing: every config "loads" as a new handle. Thread-safe (background tuning)."""

    def __init__(self):
        self.loaded: dict[int, dict] = {}
        self.unloaded: set[int] = set()
        self.limits = {"shared_memory_per_block_optin": ig.SM90_SMEM_LIMIT}
        self._lock = threading.Lock()

    def compile(self, family, configs):
        out = []
        with self._lock:
            for c in configs:
                h = 1000 + len(self.loaded)
                self.loaded[h] = dict(c)
                out.append(types.SimpleNamespace(handle=h))
        return out

    def unload(self, handle):
        self.unloaded.add(handle)

    def digest(self, family, config):
        return "digest-" + family.name(config)


class ReplayBench:
    """Replayed timings: cuDNN at ``aten_us``; a kernel's time falls with BN and BK (so several configs beat
    cuDNN and are close to each other), times 1 +- ``noise`` drawn from this process's own RNG, so two
    processes that each tuned would likely pick different winners. ``delay_s`` per measurement."""

    def __init__(self, compiler, aten_us=100.0, noise=0.05, delay_s=0.0, seed=None):
        self.compiler = compiler
        self.aten_us = aten_us
        self.noise = noise
        self.delay_s = delay_s
        self.rng = random.Random(os.getpid() if seed is None else seed)
        self.measured = 0

    def _t(self, h):
        if h == ATEN:
            return self.aten_us
        c = self.compiler.loaded[h]
        return 400.0 / (c["BN"] * c["BK"]) ** 0.35 * (1 + self.noise * self.rng.uniform(-1, 1))

    def measure(self, ws, handle, cutoff_us=None):
        time.sleep(self.delay_s)
        self.measured += 1
        return Outcome("ok", time_us=self._t(handle))

    def remeasure(self, ws, handles, rounds=5):
        return [self._t(h) for h in handles]


def make_runtime(delay_s=0.0, budget=6, env=None, seed=None, aten_us=100.0):
    """A Runtime whose device 0 is fake and whose tuner replays timings (random search, ``budget``)."""
    comp = FakeCompiler()
    dev = runtime._Device(0, dict(env or ENV), comp, context=lambda index: contextlib.nullcontext())

    def make_tuner(rt, d, listeners):
        backend = TrialBackend(comp, types.SimpleNamespace(check=lambda ws, h: None),
                               ReplayBench(comp, aten_us=aten_us, delay_s=delay_s, seed=seed), lambda p: None)
        return Tuner(backend, ig, strategy="random", budget=Budget(budget), seed=0, listeners=listeners)

    rt = runtime.Runtime(devices=lambda index: dev, make_tuner=make_tuner)
    rt.fake_compiler = comp
    return rt


# ---- child processes (spawned; each imports this module) -------------------------------------------------


def _child_env(cache_dir: str, extra: dict | None = None) -> None:
    os.environ["BAGF_CACHE_DIR"] = cache_dir
    os.environ.update(extra or {})


def tune_one(cache_dir, delay_s, start, results, extra_env=None):
    """Tune P with one shared cache (after ``start`` releases every process at once); report what was used."""
    _child_env(cache_dir, extra_env)
    rt = runtime.install(make_runtime(delay_s=delay_s))
    start.wait()
    handle = rt.plan_handle(P, 0)
    config = None if handle == ATEN else rt.fake_compiler.loaded[handle]
    results.put({"pid": os.getpid(), "tuned": rt.stats["tuned"], "waited": rt.stats["waited"],
                 "hits": rt.stats["cache_hits"], "config": config})
    rt.close()


def tune_until_killed(cache_dir, delay_s, budget):
    """Tune P slowly with a large budget, writing each trial to the cache as it completes, until killed."""
    _child_env(cache_dir)
    rt = runtime.install(make_runtime(delay_s=delay_s, budget=budget))
    rt.plan_handle(P, 0)


def ddp_rank(rank, world, init_file, cache_dir, results):
    """One torchrun-like rank: gloo process group, look up P's plan, agree on it with the other ranks."""
    import torch.distributed as dist

    _child_env(cache_dir)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rt = runtime.install(make_runtime(delay_s=0.02))
        dist.barrier()  # every rank meets the new problem at the same moment
        handle = rt.plan_handle(P, 0)
        mine = {"rank": rank, "tuned": rt.stats["tuned"],
                "config": None if handle == ATEN else rt.fake_compiler.loaded[handle]}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            results.put(everyone)
        rt.close()
    finally:
        dist.destroy_process_group()


# ---- a CPU backend for the isolated worker (bagf_torch.tuning.isolated) ----------------------------------

CRASH_BM, POISON_BM, HANG_BM, WRONG_BN, SLOW_BK = 16, 32, 128, 256, 32
"""How a config misbehaves in the fake worker, by its tile: BM=16 aborts the process, BM=32 leaves the
"device" unusable (like an illegal address: the launch fails and so does everything after it), BM=128 hangs,
BN=256 computes wrong numbers, BK=32 is correct but takes a second to check. Anything else is a correct kernel."""


class _FakeWorkerBackend:
    def __init__(self, device):
        self.poisoned = None
        self.compiler = FakeCompiler()
        self.benchmarker = ReplayBench(self.compiler, noise=0.0)
        backend = self

        class Checker:
            def check(self, ws, handle):
                c = backend.compiler.loaded[handle]
                if c["BM"] == CRASH_BM:
                    os.abort()
                if c["BM"] == POISON_BM:
                    backend.poisoned = "CUDA error: an illegal memory access was encountered (simulated)"
                    return Outcome("launch", detail=backend.poisoned)
                if c["BM"] == HANG_BM:
                    time.sleep(3600)
                if c["BN"] == WRONG_BN:
                    return Outcome("wrong", detail="relative error 3.1e-01 > 1e-04 (simulated)")
                if c["BK"] == SLOW_BK:
                    time.sleep(1.0)
                return None

        self.checker = Checker()

    def workspace(self, problem):
        return problem

    def healthy(self):
        return self.poisoned


def cpu_backend(device):
    """The isolated worker's backend for CPU tests: see CRASH_BM and friends."""
    return _FakeWorkerBackend(device)


# ---- an isolated worker whose parent dies while it is busy (tests/test_isolated_orphan.py) ---------------

BUSY_FILE_ENV = "BAGF_TEST_BUSY_FILE"
"""Where the busy backends' never-ending check writes the worker's pid when it starts blocking."""


class _BusyChecker:
    """Checks pass, except BM=HANG_BM, which writes the worker's pid to $BAGF_TEST_BUSY_FILE and blocks the
    worker's main thread for an hour: in a C call that keeps the GIL (``hold_gil``: no Python thread of the
    worker can run, so only the kernel's parent-death signal can end it), or in one that releases it, as
    torch's stream wait on a spinning kernel does (the worker's own watchdog thread can run)."""

    def __init__(self, compiler, hold_gil):
        self.compiler = compiler
        self.hold_gil = hold_gil

    def check(self, ws, handle):
        if self.compiler.loaded[handle]["BM"] != HANG_BM:
            return None
        path = os.environ[BUSY_FILE_ENV]
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        if self.hold_gil:
            import ctypes

            ctypes.PyDLL(None).sleep(3600)  # PyDLL: the GIL is held during the call
        else:
            time.sleep(3600)
        return None


def _busy_backend(hold_gil):
    backend = _FakeWorkerBackend(0)
    backend.checker = _BusyChecker(backend.compiler, hold_gil)
    return backend


def busy_backend_holding_gil(device):
    """The worker blocks in C with the GIL held: only PR_SET_PDEATHSIG (Linux) ends it with its parent."""
    return _busy_backend(hold_gil=True)


def busy_backend_watchdog_only(device):
    """The worker's parent-death signal is cleared (as on a system without one) and its check blocks with the
    GIL released: only the worker's watchdog thread can end it with its parent."""
    import sys

    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
                                ctypes.c_ulong(0))
    return _busy_backend(hold_gil=False)


def orphan_parent(backend, start_from, status_path):
    """The parent process the orphan tests SIGKILL: start a worker with ``backend`` (from the main thread, or
    from a thread that ends before the worker is used: ``start_from`` "main" | "thread"), check a good
    candidate, write the pool's counters to ``status_path``, then check the BM=HANG_BM one (never returns)."""
    import json

    from bagf_torch.tuning.isolated import WorkerPool

    pool = WorkerPool(0, timeout_s=3600.0, backend=backend)
    configs = [dict(ig.DEFAULT), dict(ig.DEFAULT, BM=HANG_BM)]
    built = []
    if start_from == "thread":
        t = threading.Thread(target=lambda: built.extend(pool.compiler().compile(ig, configs)))
        t.start()
        t.join()
        time.sleep(0.5)  # a death signal armed against that thread would have landed by now
    else:
        built.extend(pool.compiler().compile(ig, configs))
    ws = pool.workspace(P)
    good = pool.checker().check(ws, built[0].handle)
    with open(status_path, "w") as f:
        json.dump({"good": None if good is None else good.status, "crashes": pool.crashes,
                   "restarts": pool.restarts, "worker": pool._proc.pid}, f)
    pool.checker().check(ws, built[1].handle)


def teardown_waiter(returned: str, want: str, seconds: float) -> str:
    """Python source for a child that is about to end with compiles still in NVRTC (tests/test_shutdown.py against a
    stand-in NVRTC, tests/test_gpu.py against the real one): an object of a module that is torn down at finalization
    (unlike ``__main__`` at times) whose destructor keeps the shutdown going until ``returned()[0]`` (an extension's
    ``nvrtc_returned``: compiles returned, and parked) reaches ``want``, ``seconds`` at most, then writes
    "teardown started" and "compiles returned: R of W, parked: P" to stderr (:func:`teardown_counts` reads them)."""
    return f"""
import os as _os, sys as _sys, time as _time, types as _types

class _SlowTeardown:
    def __del__(self, _sleep=_time.sleep, _write=_os.write, _returned={returned}, _clock=_time.monotonic,
                _want={want}):
        _write(2, b"teardown started\\n")
        end = _clock() + {seconds!r}
        while _returned()[0] < _want and _clock() < end:
            _sleep(0.05)
        done, parked = _returned()
        _write(2, b"compiles returned: %d of %d, parked: %d\\n" % (done, _want, parked))

_holder = _types.ModuleType("bagf_test_slow_teardown")
_holder.keep = _SlowTeardown()
_sys.modules[_holder.__name__] = _holder
del _holder
"""


def teardown_counts(stderr: str) -> tuple[int, int, int] | None:
    """(returned, wanted, parked) from a :func:`teardown_waiter` child's stderr; None when its teardown never ran."""
    import re

    m = re.search(r"compiles returned: (\d+) of (\d+), parked: (\d+)", stderr)
    return None if m is None or "teardown started" not in stderr else tuple(map(int, m.groups()))

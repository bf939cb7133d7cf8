"""Candidate isolation (``BAGF_ISOLATE=1``): compile, check and time candidates in a child process.

A kernel that writes out of bounds poisons the CUDA context of the process that launched it: every later CUDA
call there fails, so an in-process tuner that meets one takes the user's process down with it (PyTorch issues
95542 and 170130 on Inductor's autotuning). Here the candidates run in a spawned worker process that owns its
own CUDA context. When a candidate kills it (illegal address, abort, segfault), the candidate gets the typed
failure "crashed", the worker is restarted on the next request and tuning goes on; when a candidate does not
finish within the time limit (a hang, a spin loop), the worker is killed and the candidate gets "timeout".
The user's process only ever loads the winner, from the cubin the worker stored in the cache.

``WorkerPool(device)`` owns the worker; ``pool.backend()`` is the ``TrialBackend`` (``tuning.backend``) the Tuner
takes: its compiler, checker, benchmarker and workspace each speak to the worker, and ``local`` is False. Handles
the Tuner sees are the pool's own numbers; after a restart the worker re-loads the ones still in use from the
cubin cache before it needs them, so the finalists' re-measurement survives a crash of an unrelated candidate.

What runs in the worker is a backend with the ``TrialBackend`` parts and ``healthy()``, made by a factory named
``"module:function"`` (the one form that crosses a spawn); ``function(device)`` returns it. The default is ``tuning.backend.cuda_backend``, the real
NVRTC compiler, CudaChecker and CudaBenchmarker; tests run the protocol on a CPU with a fake backend.

The worker is a ``multiprocessing`` "spawn" child, so, as with any spawn start method, a user script run as
``python script.py`` must keep its work under ``if __name__ == "__main__":`` (the child imports the main
module to unpickle its arguments).

The worker dies with the process that started it, also while it is blocked on a spinning kernel (which would
otherwise hold the GPU for ever): on Linux the kernel SIGKILLs it (``PR_SET_PDEATHSIG``), and everywhere a
watchdog thread in it exits the process when the parent is gone (see ``_die_with_parent``).

Cost: the worker's start (spawn, import torch, CUDA context, extension load) takes a few seconds, once per
device and process (the pool is kept between problems); each candidate costs a pipe round trip (~0.1 ms).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Sequence

from ..ops import ATEN
from ..problem import ConvProblem
from .common import Outcome

logger = logging.getLogger("bagf_torch")

DEFAULT_BACKEND = "bagf_torch.tuning.backend:cuda_backend"
START_TIMEOUT_S = 300.0
"""Worker start: spawn, import torch, create the CUDA context, load the (already built) extension."""
ORPHAN_EXIT = 4
"""The worker's exit code when it ends itself because its parent is gone."""
WATCHDOG_POLL_S = 0.25
"""How often the worker's watchdog also compares getppid() with its parent (the pipe wakes it at once)."""
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class WorkerFailed(RuntimeError):
    """The worker could not start, or died twice on a request that no single candidate explains."""


@dataclass
class Proxy:
    """A candidate loaded in the worker; ``handle`` is the pool's number for it (what the Tuner holds)."""

    handle: int
    family: str
    config: dict
    registers: int = 0
    local_bytes: int = 0
    compile_seconds: float = 0.0  # NVRTC seconds in the worker (0: its cubin came from the cache)


@dataclass(frozen=True)
class RemoteWorkspace:
    """The Tuner's workspace for one problem; the tensors live in the worker (made there on first use)."""

    problem: ConvProblem


class WorkerPool:
    """One worker process for one device, restarted after a crash or a time-out.

    ``timeout_s`` bounds one check or one measurement of one candidate; compiling gets
    ``compile_timeout_s`` per batch. ``crashes``, ``timeouts`` and ``restarts`` count what happened.
    """

    def __init__(self, device: int, timeout_s: float = 20.0, backend: str = DEFAULT_BACKEND,
                 compile_timeout_s: float = 600.0, start_timeout_s: float = START_TIMEOUT_S):
        self.device = device
        self.timeout_s = timeout_s
        self.compile_timeout_s = compile_timeout_s
        self.start_timeout_s = start_timeout_s
        self.backend_spec = backend  # "module:function" of the TrialBackend factory the worker runs
        self.crashes = 0
        self.timeouts = 0
        self.restarts = 0
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process that holds a CUDA context
        self._proc = None
        self._conn = None
        self._proxies: dict[int, Proxy] = {}
        self._in_worker: set[int] = set()  # proxies loaded in the current worker
        self._next = 0
        self._starts = 0

    # ---- the worker's life ------------------------------------------------------------------------------
    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.device, self.backend_spec, os.getpid()),
                                 daemon=True, name=f"bagf-isolated-worker-{self.device}")
        _start_process(proc)
        child.close()
        self._proc, self._conn = proc, parent
        self._in_worker = set()
        if self._starts:
            self.restarts += 1
        self._starts += 1
        kind, detail = self._receive(self.start_timeout_s, "starting")
        if kind != "ready":
            self._stop()
            raise WorkerFailed(f"the isolated tuning worker for device {self.device} could not start: {detail}")

    def _stop(self) -> int | None:
        """Kill the worker (if alive) and return its exit code."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._in_worker = set()
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        return proc.exitcode

    def close(self) -> None:
        """Stop the worker (idempotent); a later request starts a new one."""
        if self._conn is not None:
            try:
                self._conn.send(("close", None))
            except (OSError, ValueError):
                pass
            if self._proc is not None:
                self._proc.join(5)
        self._stop()

    def _receive(self, timeout_s: float, what: str) -> tuple[str, Any]:
        """("ok", value) | ("outcome", Outcome) from the worker; ("crashed", detail) if it died,
        ("timeout", detail) if it did not answer in time (then it is killed)."""
        if self._conn.poll(timeout_s):
            try:
                return self._conn.recv()
            except (EOFError, OSError):
                pass
            code = self._stop()
            self.crashes += 1
            return "crashed", f"the isolated worker died while {what} ({_exit_text(code)})"
        if self._proc is not None and not self._proc.is_alive():
            code = self._stop()
            self.crashes += 1
            return "crashed", f"the isolated worker died while {what} ({_exit_text(code)})"
        self._stop()
        self.timeouts += 1
        return "timeout", f"no answer within {timeout_s:g} s while {what}; the worker was killed"

    def _request(self, op: str, args: tuple, timeout_s: float, what: str, uses: Sequence[int] = ()) -> tuple[str, Any]:
        if self._proc is None:
            self._start()
        missing = [h for h in uses if h != ATEN and h not in self._in_worker]
        if missing:  # after a restart: load the candidates this request needs, from the cubin cache
            kind, value = self._call("load", ([self._spec(h) for h in missing],), self.compile_timeout_s,
                                     "re-loading candidates after a restart")
            if kind != "ok":
                return kind, value
            for h, res in zip(missing, value):
                if isinstance(res, Outcome):
                    return "outcome", res
                self._in_worker.add(h)
        return self._call(op, args, timeout_s, what)

    def _call(self, op: str, args: tuple, timeout_s: float, what: str) -> tuple[str, Any]:
        try:
            self._conn.send((op, args))
            kind, value = self._receive(timeout_s, what)
        except (OSError, ValueError):
            code = self._stop()
            self.crashes += 1
            return "crashed", f"the isolated worker was gone before {what} ({_exit_text(code)})"
        except BaseException:
            # Interrupted while sending or waiting (Ctrl-C, a signal handler's exception): the worker's answer to
            # this request would still come, and the next request would read it as its own (a wrong kernel's check
            # answered with another's pass). The worker goes; the next request starts a fresh one.
            self._stop()
            raise
        if kind == "error":
            raise WorkerFailed(f"the isolated worker failed while {what}: {value}")
        if kind == "outcome" and value.status == "crashed":
            # The candidate left the worker's CUDA context unusable; the worker exits after this answer.
            self._stop()
            self.crashes += 1
        return kind, value

    def _spec(self, handle: int) -> tuple[int, str, dict]:
        p = self._proxies[handle]
        return handle, p.family, p.config

    def _failure(self, kind: str, value: Any, name: str) -> Outcome:
        if kind == "outcome":
            return value
        return Outcome("crashed" if kind == "crashed" else "timeout", detail=f"{name}: {value}")

    def _name(self, handle: int) -> str:
        if handle == ATEN:
            return "cuDNN"
        p = self._proxies.get(handle)
        if p is None:
            return f"handle {handle}"
        family = importlib.import_module(p.family)
        return family.name(p.config) if hasattr(family, "name") else f"{p.family} {p.config}"

    # ---- what the Tuner calls ---------------------------------------------------------------------------
    def compile(self, family, configs) -> list[Proxy | Outcome]:
        specs = []
        for c in configs:
            self._next += 1
            specs.append((self._next, family.__name__, dict(c)))
        kind, value = self._request("load", (specs,), self.compile_timeout_s, f"compiling {len(specs)} candidates")
        if kind != "ok":
            return [self._failure(kind, value, family.name(c)) for c in configs]
        out: list[Proxy | Outcome] = []
        for (h, fam, c), res in zip(specs, value):
            if isinstance(res, Outcome):
                out.append(res)
            else:
                self._proxies[h] = Proxy(h, fam, c, *res)
                self._in_worker.add(h)
                out.append(self._proxies[h])
        return out

    def unload(self, handle: int) -> None:
        self._proxies.pop(handle, None)
        if handle in self._in_worker:
            self._in_worker.discard(handle)
            self._request("unload", ([handle],), self.timeout_s, "unloading")

    def check(self, ws: RemoteWorkspace, handle: int) -> Outcome | None:
        kind, value = self._request("check", (ws.problem, handle), self.timeout_s,
                                    f"checking {self._name(handle)}", uses=(handle,))
        if kind == "ok":
            return None
        return self._failure(kind, value, self._name(handle))

    def measure(self, ws: RemoteWorkspace, handle: int, cutoff_us: float | None = None) -> Outcome:
        kind, value = self._request("measure", (ws.problem, handle, cutoff_us), self.timeout_s,
                                    f"timing {self._name(handle)}", uses=(handle,))
        if kind == "ok":
            return value
        return self._failure(kind, value, self._name(handle))

    def remeasure(self, ws: RemoteWorkspace, handles: Sequence[int], rounds: int = 5) -> list[float]:
        # Every finalist already passed its check and timing: a failure here is the machine's, not a
        # candidate's, so restart once and retry, then give up (the runtime falls back to ATen).
        limit = self.timeout_s * (len(handles) * rounds + 1)
        for _ in range(2):
            kind, value = self._request("remeasure", (ws.problem, list(handles), rounds), limit,
                                        "re-measuring the finalists", uses=handles)
            if kind == "ok":
                return value
        raise WorkerFailed(f"re-measuring the finalists failed twice: {value}")

    # ---- the Tuner's pieces -----------------------------------------------------------------------------
    def compiler(self):
        import torch

        part = _Part(self, ("compile", "unload"))
        if torch.cuda.is_available():  # the tuner's arch rules (the worker compiles for this device)
            major, minor = torch.cuda.get_device_capability(self.device)
            part.arch = f"sm_{major}{minor}"
        return part

    def checker(self):
        return _Part(self, ("check",))

    def benchmarker(self):
        return _Part(self, ("measure", "remeasure"))

    def workspace(self, problem: ConvProblem) -> RemoteWorkspace:
        return RemoteWorkspace(problem)

    def backend(self):
        """The Tuner's ``TrialBackend`` whose every part is a request to this pool's worker."""
        from .backend import TrialBackend

        return TrialBackend(self.compiler(), self.checker(), self.benchmarker(), self.workspace, local=False)


class _Part:
    """A view of the pool with only the methods one of the Tuner's pieces has."""

    def __init__(self, pool: WorkerPool, methods: tuple[str, ...]):
        for m in methods:
            setattr(self, m, getattr(pool, m))
        self.pool = pool


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _start_process(proc) -> None:
    """``proc.start()`` from a thread that lives as long as this process.

    The worker arms PR_SET_PDEATHSIG, and Linux sends that signal when the *thread* that forked the worker
    ends, not the process. Pools are used from whatever thread tunes: the main thread, a user's thread that
    ends after its first convolution while the runtime keeps the pool, the BAGF_BACKGROUND tuner thread (it
    lives as long as the process, but nothing here can tell it from one that does not), or a restart after a
    crash on any of these. Started from such a thread, the worker would be killed when that
    thread ended and the next candidate would be blamed for a "crash". So a worker is forked by the main
    thread when that is the caller (it ends only with the process), and otherwise by one launcher thread per
    process that never ends. (The watchdog alone would not need this, but it is a Python thread: it cannot
    run while the worker's main thread holds the GIL in a long C call, and only the kernel's signal can.)
    """
    if threading.current_thread() is threading.main_thread():
        proc.start()
    else:
        _Launcher.instance().run(proc.start)


class _Launcher:
    """A daemon thread that runs the calls given to it (worker starts) one at a time, for ever."""

    _lock = threading.Lock()
    _current: tuple[int, "_Launcher"] | None = None  # (pid, launcher): a forked child needs its own thread

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="bagf-isolated-launcher").start()

    @classmethod
    def instance(cls) -> "_Launcher":
        with cls._lock:
            if cls._current is None or cls._current[0] != os.getpid():
                cls._current = (os.getpid(), cls())
            return cls._current[1]

    def run(self, fn):
        done: Future = Future()
        self._jobs.put((fn, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                done.set_exception(e)


# ---- the worker process ---------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """Make this worker end when ``parent_pid`` (the process that started it) ends, even while busy.

    1. Linux: PR_SET_PDEATHSIG makes the kernel SIGKILL this process when its parent thread ends (the
       parent forks workers from a thread that lives as long as it: ``_start_process``). This works
       whatever the worker's main thread is doing, GIL held or not. The parent may have died before the
       prctl call, and then no signal will come, so getppid() is compared with ``parent_pid`` right after.
    2. Everywhere: a watchdog thread that calls os._exit once the parent is gone. It wakes when the parent's
       end of the pipe multiprocessing gave this child closes (the parent's death, on any platform), and
       also compares getppid() every WATCHDOG_POLL_S (re-parenting, should a fork of the parent hold that
       pipe open). os._exit, not an exception: the main thread may be blocked in a C call (a stream wait on
       a spinning kernel; torch releases the GIL there), and os._exit ends the process from any thread.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                          ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
                logger.debug("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        except (OSError, AttributeError) as e:  # no libc prctl: the watchdog alone
            logger.debug("prctl(PR_SET_PDEATHSIG) unavailable: %s", e)
    if os.getppid() != parent_pid:
        os._exit(ORPHAN_EXIT)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="bagf-parent-watchdog").start()


def _watch_parent(parent_pid: int) -> None:
    try:  # readable (EOF) once every copy of the parent's end is closed
        sentinel = multiprocessing.parent_process().sentinel
    except (AttributeError, ValueError):  # not started by multiprocessing: getppid() alone
        sentinel = None
    pause = threading.Event()
    while True:
        gone = False
        if sentinel is not None:
            try:
                gone = bool(multiprocessing.connection.wait([sentinel], timeout=WATCHDOG_POLL_S))
            except OSError:  # the descriptor is unusable: getppid() alone
                sentinel = None
        else:
            pause.wait(WATCHDOG_POLL_S)
        if gone or os.getppid() != parent_pid:
            os._exit(ORPHAN_EXIT)


def _resolve(spec: str):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _worker_main(conn, device: int, backend_spec: str, parent_pid: int) -> None:
    _die_with_parent(parent_pid)  # first: importing the backend (torch, CUDA) takes seconds
    try:
        backend = _resolve(backend_spec)(device)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises WorkerFailed
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    handles: dict[int, Any] = {}
    workspaces: dict[ConvProblem, Any] = {}

    def workspace(problem):
        if problem not in workspaces:
            workspaces.clear()  # one problem at a time: free the previous one's tensors
            workspaces[problem] = backend.workspace(problem)
        return workspaces[problem]

    def after_failure(outcome: Outcome) -> Outcome:
        """A failed launch may have left the context unusable: then say "crashed" (and exit after)."""
        broken = backend.healthy()
        if broken is None:
            return outcome
        return Outcome("crashed", detail=f"{outcome.detail}; the CUDA context was unusable afterwards ({broken})")

    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":
            return
        try:
            if op == "load":
                (specs,) = args
                by_family: dict[str, list] = {}
                for h, fam, config in specs:
                    by_family.setdefault(fam, []).append((h, config))
                results = {}
                for fam, items in by_family.items():
                    built = backend.compiler.compile(importlib.import_module(fam), [c for _, c in items])
                    for (h, _), b in zip(items, built):
                        if isinstance(b, Outcome):
                            results[h] = b
                        else:
                            handles[h] = b.handle
                            results[h] = (getattr(b, "registers", 0), getattr(b, "local_bytes", 0),
                                          getattr(b, "compile_seconds", 0.0))
                reply = ("ok", [results[h] for h, _, _ in specs])
            elif op == "unload":
                for h in args[0]:
                    if h in handles:
                        backend.compiler.unload(handles.pop(h))
                reply = ("ok", None)
            elif op == "check":
                problem, h = args
                bad = backend.checker.check(workspace(problem), handles[h])
                reply = ("ok", None) if bad is None else ("outcome", after_failure(bad))
            elif op == "measure":
                problem, h, cutoff = args
                o = backend.benchmarker.measure(workspace(problem), ATEN if h == ATEN else handles[h], cutoff)
                if not o.ok and o.status != "timeout":  # "timeout" here is the early cut-off: a clean result
                    o = after_failure(o)
                reply = ("outcome", o) if o.status == "crashed" else ("ok", o)
            elif op == "remeasure":
                problem, hs, rounds = args
                reply = ("ok", backend.benchmarker.remeasure(workspace(problem),
                                                             [ATEN if h == ATEN else handles[h] for h in hs], rounds))
            else:
                reply = ("error", f"unknown request {op!r}")
        except Exception as e:  # noqa: BLE001 - a bug or a broken device: the parent raises WorkerFailed
            broken = backend.healthy()
            if broken is not None:
                reply = ("outcome", Outcome("crashed", detail=f"{type(e).__name__}: {e} ({broken})"))
            else:
                reply = ("error", f"{type(e).__name__}: {e}")
        conn.send(reply)
        if reply[0] == "outcome" and reply[1].status == "crashed":
            os._exit(3)  # a poisoned context cannot be repaired: the parent starts a fresh worker

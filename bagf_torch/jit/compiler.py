"""NVRTC compilation of kernel template instantiations, with cubins cached on disk by content hash.

Describe, build, load: a ``KernelSpec`` names one instantiation (family, config, arch) and knows its name
expression and readable name; ``KernelCompiler.compile`` turns specs into loaded plans, compiling only the
cubins the cache does not hold (in parallel threads: the extension releases the GIL around NVRTC), and
loading each with ``cuModuleLoadData``. Failures come back as typed ``Outcome``s, never exceptions.

A compile that the caller stops waiting for (``compile_within``: the tuner's deadline) is not stopped: NVRTC
cannot be interrupted, so it finishes on its daemon thread and its cubin lands in the cache, where a later
request finds it; a request for a digest whose compile is still running waits for that compile instead of
starting a second one.

A library family (``LIBRARY``, e.g. cuBLASLt's plans) has nothing to compile: ``compile`` loads its configurations at
once with no cubin, ``digest`` is None for them (no cubin to name), ``build`` has nothing to do and ``prefetch``
leaves them out.

Which bytes get loaded (docs/cache.md): a cubin is looked up under its digest, which this compiler computes
from our kernel sources, the name expression, options, NVRTC version and architecture, and only this
compiler writes cubins under such a digest. Cubins imported with ``cache import --trust-cubins`` live under
``FOREIGN_DIGEST_PREFIX`` + digest and are read only when the cache holds no cubin of our own for that
digest; ``build`` (what import uses to rebuild winners) never reads them.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from types import ModuleType
from typing import Mapping, Sequence

from ..cache import FOREIGN_DIGEST_PREFIX
from ..kernels.space import Config
from ..outcome import Outcome
from . import extension


@dataclass(frozen=True)
class KernelSpec:
    """One template instantiation of one family for one GPU architecture."""

    family: ModuleType
    config: Mapping[str, int]
    arch: str  # e.g. "sm_90"

    @property
    def name(self) -> str:
        return self.family.name(self.config, self.arch.replace("_", ""))

    @property
    def name_expression(self) -> str:
        return self.family.name_expression(self.config)

    @property
    def target(self) -> str:
        """The NVRTC architecture: the GPU's, or the family's architecture-specific variant of it for this
        configuration (winograd_gemm's wgmma GEMM needs sm_90a)."""
        gpu_arch = getattr(self.family, "gpu_arch", None)
        return gpu_arch(self.config, self.arch) if gpu_arch else self.arch

    def options(self) -> list[str]:
        return [f"--gpu-architecture={self.target}", "-std=c++17", f"--include-path={extension.kernels_dir()}"]

    def source(self) -> str:
        return f'#include "{self.family.SOURCE}"\n'

    def digest(self, source_hash: str, nvrtc_version: str) -> str:
        """Content hash of the cubin: kernel sources, name expression, options, NVRTC version, arch. Not where the
        sources are (the include path): the same sources installed elsewhere, a per-job venv serving a shared
        cache, compile to the same cubin and find it."""
        options = [o for o in self.options() if not o.startswith("--include-path=")]
        blob = "\0".join([source_hash, self.source(), self.name_expression, *options, nvrtc_version, self.arch])
        return hashlib.sha256(blob.encode()).hexdigest()


def is_library(family: ModuleType) -> bool:
    """Whether ``family`` calls a library instead of compiling a kernel (its ``LIBRARY``, see kernels.family)."""
    return bool(getattr(family, "LIBRARY", ""))


@dataclass
class Loaded:
    """A compiled and loaded kernel: ``handle`` is what the bagf::conv2d op takes."""

    spec: KernelSpec
    handle: int
    compile_seconds: float  # 0 when the cubin came from the cache
    registers: int
    local_bytes: int


@dataclass
class CompileStats:
    nvrtc_compiles: int = 0
    cubin_cache_hits: int = 0
    loads: int = 0
    compile_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw):
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


STATS = CompileStats()
"""Process-wide counters: a warm process shows nvrtc_compiles == 0."""


class _CompilePool:
    """Up to ``workers`` daemon threads that run submitted calls in order, started as they are needed and ending
    after ``IDLE_S`` without work. Daemon threads, not a ThreadPoolExecutor's: a compile the tuner stopped waiting
    for may still be in NVRTC when the process ends, and an executor's threads are joined at exit (seconds added to
    a ``tune`` command's end for a cubin nobody will use; that cubin is then lost, as is one whose cache was closed
    first)."""

    IDLE_S = 30.0

    def __init__(self, workers: int):
        self.workers = max(1, workers)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = 0
        # Under the lock: jobs submitted and not yet counted as taken, threads waiting for a job. A thread that has
        # just taken a job is still counted in both until it takes the lock, so pending - idle never undercounts
        # the jobs no thread will run (counting the queue's own size did: a job submitted in that moment waited
        # behind a running one with a worker to spare).
        self._pending = 0
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        with self._lock:
            self._pending += 1
            self._jobs.put((future, fn, args))
            if self._pending > self._idle and self._threads < self.workers:
                self._threads += 1
                threading.Thread(target=self._run, name=f"bagf-nvrtc-{self._threads}", daemon=True).start()
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._pending == 0:  # (else a job came in as the wait ended: take it)
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(e)
            del job, future, fn, args  # (an idle thread keeps nothing alive)


class KernelCompiler:
    """Compiles and loads kernel variants for one CUDA device, using ``cache`` for cubins."""

    def __init__(self, cache, device: int, workers: int):
        import torch

        self.ext = extension.load()
        self.cache = cache
        self.device = device
        major, minor = torch.cuda.get_device_capability(device)
        self.arch = f"sm_{major}{minor}"
        self.workers = workers
        self.nvrtc_version = self.ext.versions()["nvrtc"]
        self.source_hash = extension.source_hash()
        self.limits = self.ext.device_limits(device)
        # NVRTC failures of this process by digest (they are not cached on disk): a start point that failed in
        # ``prefetch`` is not compiled a second time by ``compile``.
        self._failures: dict[str, Outcome] = {}
        # family -> seconds of one wave of parallel compiles, as the tuner has seen them in this process (its time
        # budget reads and updates this record, see tuning.tuner._Deadline)
        self.wave_seconds: dict[str, float] = {}
        self._start_pool()

    def _start_pool(self) -> None:
        self._pool = _CompilePool(self.workers)
        # digest -> the future of its cubin while a compile (or cache read) of it runs: asked for again meanwhile
        # (the tuner stopped waiting for it, then a search proposed it again), it is waited for, not compiled twice
        self._inflight: dict[str, Future] = {}
        self._inflight_lock = threading.Lock()

    def digest(self, family: ModuleType, config: Mapping[str, int]) -> str | None:
        """The cache digest of one configuration's cubin on this device; None for a library family (no cubin)."""
        if is_library(family):
            return None
        return KernelSpec(family, dict(config), self.arch).digest(self.source_hash, self.nvrtc_version)

    def _cubin(self, spec: KernelSpec, foreign: bool = True) -> tuple[bytes, str, float] | Outcome:
        """The cubin of ``spec``: ours from the cache, else (``foreign``) one imported with --trust-cubins
        for the same digest, else compiled now with NVRTC and stored under the digest."""
        digest = spec.digest(self.source_hash, self.nvrtc_version)
        ready = self._ready(digest, foreign)
        if ready is not None:
            return ready
        t0 = time.perf_counter()
        ok, cubin, lowered, log = self.ext.nvrtc_compile(spec.source(), spec.name_expression, spec.options())
        seconds = time.perf_counter() - t0
        STATS.add(nvrtc_compiles=1, compile_seconds=seconds)
        if not ok:
            failed = self._failures[digest] = Outcome(
                "compile", detail=f"{spec.name}: NVRTC failed ({spec.name_expression}):\n{log}")
            return failed
        self.cache.put_cubin(digest, spec.name, lowered, cubin)
        return cubin, lowered, seconds

    def cubin(self, spec: KernelSpec) -> tuple[bytes, str, float] | Outcome:
        """The cubin of ``spec`` (cubin, lowered names, compile seconds), from this cache or compiled now and stored:
        for a kernel that is not a plan's (the pooling epilogue), loaded by its own host code. Never an imported
        cubin."""
        return self._cubin(spec, foreign=False)

    def _load(self, spec: KernelSpec, cubin: bytes, lowered: str, seconds: float) -> Loaded | Outcome:
        geometry = spec.family.launch(spec.config).to_host(self.ext)
        # load_plan reports a kernel that cannot run here (threads, shared memory, bad cubin) in "error" rather
        # than raising; a RuntimeError is still caught (device initialisation failures raise).
        try:
            info = self.ext.load_plan(cubin, lowered, self.device, geometry)
        except RuntimeError as e:
            return Outcome("resources", detail=f"{spec.name}: {e}")
        if "error" in info:
            return Outcome("resources", detail=f"{spec.name}: {info['error']}")
        STATS.add(loads=1)
        return Loaded(spec, info["handle"], seconds, info["registers"], info["local_bytes"])

    def _submit(self, digest: str, spec: KernelSpec) -> tuple[Future, bool]:
        """The future of ``spec``'s cubin, and whether this call started it (False: joined a running one)."""
        with self._inflight_lock:
            running = self._inflight.get(digest)
            if running is not None:
                return running, False
            future = self._pool.submit(self._cubin, spec)
            self._inflight[digest] = future
        future.add_done_callback(lambda _f, d=digest: self._forget(d, _f))
        return future, True

    def _forget(self, digest: str, future: Future) -> None:
        with self._inflight_lock:
            if self._inflight.get(digest) is future:
                del self._inflight[digest]

    def _ready(self, digest: str, foreign: bool = True) -> tuple[bytes, str, float] | Outcome | None:
        """A failure this process remembers or a cached cubin for ``digest`` (ours, else with ``foreign`` one
        imported with --trust-cubins); None when it has to be compiled. ``_cubins`` reads it on the calling thread:
        a cache hit never waits behind compiles in the pool."""
        failed = self._failures.get(digest)
        if failed is not None:
            return failed
        hit = self.cache.get_cubin(digest)
        if hit is None and foreign:
            hit = self.cache.get_cubin(FOREIGN_DIGEST_PREFIX + digest)
        if hit is None:
            return None
        STATS.add(cubin_cache_hits=1)
        return hit[0], hit[1], 0.0

    def _cubins(self, specs: Sequence[KernelSpec], timeout: float | None = None) -> list:
        """``_cubin`` of every spec, the compiles in parallel on the pool's ``workers`` threads, each distinct digest
        once: configurations that differ only in a launch parameter (implicit_gemm_h16's SPLIT) share one kernel and
        one compile. The compile's seconds go to the first spec of its digest, the others get 0 as a cache hit does:
        the tuner counts a candidate with compile seconds as one compile (``tuner._compiles``), and counting one NVRTC
        run several times made its estimate of a compile's cost too low. ``timeout``: seconds to wait at most; a
        spec whose cubin is not ready by then is None: its compile goes on if it had started (see the module
        docstring), and is dropped if it was still queued."""
        by_digest: dict[str, KernelSpec] = {}
        digests = [spec.digest(self.source_hash, self.nvrtc_version) for spec in specs]
        for d, spec in zip(digests, specs):
            by_digest.setdefault(d, spec)
        got: dict[str, object] = {}
        futures: dict[str, tuple[Future, bool]] = {}
        for d, spec in by_digest.items():
            ready = self._ready(d)
            if ready is not None:
                got[d] = ready
            else:
                futures[d] = self._submit(d, spec)
        done, _ = wait_futures([f for f, _ in futures.values()], timeout=None if timeout is None else max(0.0, timeout))
        for d, (f, started) in futures.items():
            if f in done and not f.cancelled():
                got[d] = f.result()
            else:
                if started:
                    f.cancel()  # (only a compile still queued is cancelled; a running one finishes into the cache)
                got[d] = None
        out, seen = [], set()
        for d in digests:
            g = got[d]
            if d in seen and g is not None and not isinstance(g, Outcome):
                g = (g[0], g[1], 0.0)
            seen.add(d)
            out.append(g)
        return out

    def compile(self, family: ModuleType, configs: Sequence[Config]) -> list[Loaded | Outcome]:
        """Compile (or fetch from the cache) and load every config; failures are typed outcomes."""
        return self.compile_within(family, configs, None)

    def compile_within(self, family: ModuleType, configs: Sequence[Config],
                       seconds: float | None) -> list[Loaded | Outcome | None]:
        """``compile``, waiting at most ``seconds`` (None: until all are done) for the compiles: a config whose
        cubin is not ready by then is None and not loaded; its compile finishes in the background into the cache
        (the tuner's deadline: a compile wave that runs long ends the search instead of overrunning the budget)."""
        specs = [KernelSpec(family, dict(c), self.arch) for c in configs]
        if is_library(family):  # nothing to compile: the host resolves the library call per shape
            return [self._load(s, b"", "", 0.0) for s in specs]
        cubins = self._cubins(specs, seconds)
        # Module loading stays on this thread: it needs the device's context current, which torch made so.
        return [c if c is None or isinstance(c, Outcome) else self._load(s, *c) for s, c in zip(specs, cubins)]

    def prefetch(self, items: Sequence[tuple[ModuleType, Config]]) -> dict[str, float]:
        """Compile the cubins of several families' configurations into the cache in parallel, loading none:
        the tuner's start points, one per family, would otherwise compile one family at a time. Failures are
        left for ``compile`` to report. Returns, per family, the longest NVRTC compile of its configurations that
        succeeded now (families whose cubins came from the cache, or failed, are absent)."""
        specs = [KernelSpec(family, dict(c), self.arch) for family, c in items if not is_library(family)]
        got = self._cubins(specs)
        compiled: dict[str, float] = {}
        for spec, g in zip(specs, got):
            if not isinstance(g, Outcome) and g[2] > 0:
                compiled[spec.family.FAMILY] = max(compiled.get(spec.family.FAMILY, 0.0), g[2])
        return compiled

    def build(self, family: ModuleType, configs: Sequence[Config]) -> list[str | None]:
        """Compile every config with NVRTC from our own kernel sources into the cache, without loading it
        (``cache import`` rebuilds imported winners so; ``cache_io.KernelBuilder``): per config None when
        the cache now holds our cubin under ``digest(family, config)``, else the first lines of why not.
        An imported foreign cubin for the same digest is ignored: this is how a machine gets its own."""
        specs = [KernelSpec(family, dict(c), self.arch) for c in configs]
        if is_library(family):
            return [None] * len(specs)  # (no cubin: the plan loads as it is)

        def one(spec: KernelSpec) -> str | None:
            try:
                got = self._cubin(spec, foreign=False)
            except (TypeError, KeyError, ValueError) as e:  # a configuration the family cannot name
                return f"{type(e).__name__}: {e}"
            return got.detail if isinstance(got, Outcome) else None

        if len(specs) > 1 and self.workers > 1:
            with ThreadPoolExecutor(max_workers=min(self.workers, len(specs))) as pool:
                return list(pool.map(one, specs))
        return [one(s) for s in specs]

    def unload(self, handle: int) -> None:
        self.ext.unload_plan(handle)

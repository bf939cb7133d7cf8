"""The fault matrix: each test is one row, named ``test_row_<row>_...``; benchmarks/faults.py runs
them and prints the matrix. CPU rows drive the runtime with a replaying fake tuner (tests/fault_helpers.py);
GPU rows (marked cuda) use the real kernels, the NVRTC path and a deliberately faulty kernel.

Rows already covered elsewhere and only referenced by faults.py: damaged cache files and read-only / full
cache directories (tests/test_cache.py), compile and resource failures (tests/test_tuner.py, test_gpu.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

import bagf_torch
from bagf_torch import runtime
from bagf_torch.cache import Cache, default_cache_path
from bagf_torch.kernels import implicit_gemm as ig
from bagf_torch.ops import ATEN

import fault_helpers as fh


@pytest.fixture
def bagf_log(caplog):
    """Records of the "bagf_torch" logger at INFO and above."""
    caplog.set_level(logging.INFO, logger="bagf_torch")
    return lambda: [r for r in caplog.records if r.name == "bagf_torch"]


@pytest.fixture
def counts(record_property):
    """Records the matrix's counts for benchmarks/faults.py: faults injected, user processes crashed, wrong
    results cached, entries lost (as test properties; call before the asserts, so a failure still reports)."""
    def record(faults=0, crashed=0, wrong_cached=0, lost=0):
        for name, value in (("faults", faults), ("crashed", crashed), ("wrong_cached", wrong_cached),
                            ("lost", lost)):
            record_property(name, int(value))
    return record


# ---- cache made for another GPU / torch / bagf / kernel source -----------------------------------------


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA A100-SXM4-80GB"), ("cc", "8.0"), ("torch", "2.5.0"),
                                         ("bagf_torch", "0.0.9"), ("kernels", "edited"), ("driver", 2)])
def test_row_stale_env_is_retuned_and_import_says_why(field, value, tmp_path, counts):
    old_env = dict(fh.ENV)
    old = runtime.install(fh.make_runtime(env=old_env))
    old.plan_handle(fh.P, 0)
    old_key = old.key(fh.P, 0)
    export = tmp_path / "export.json"
    assert old.cache().export(export) == 1
    old.close()

    new_env = dict(fh.ENV, **{field: value})
    rt = runtime.install(fh.make_runtime(env=new_env))
    handle = rt.plan_handle(fh.P, 0)
    counts(faults=1, wrong_cached=rt.stats["cache_hits"])
    assert rt.stats["cache_hits"] == 0 and rt.stats["tuned"] == 1  # not used: re-tuned
    assert handle in rt.fake_compiler.loaded
    assert rt.key(fh.P, 0) != old_key
    assert {p["key"] for p in rt.cache().plans()} == {old_key, rt.key(fh.P, 0)}  # the old one is not touched

    with Cache(None) as fresh:
        imported, skipped = fresh.import_(export, new_env)
    assert imported == 0 and len(skipped) == 1
    assert field in skipped[0] and repr(value) in skipped[0], skipped


# ---- kill -9 in the middle of tuning ---------------------------------------------------------------------


def test_row_kill_9_mid_tuning_then_restart(cache_dir, bagf_log, counts):
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=fh.tune_until_killed, args=(str(cache_dir), 0.02, 500), daemon=True)
    child.start()
    rt_probe = fh.make_runtime()
    key = rt_probe.key(fh.P, 0)
    path = default_cache_path(cache_dir)
    deadline = time.monotonic() + 60
    seen = 0
    while seen < 15 and time.monotonic() < deadline and child.is_alive():
        time.sleep(0.05)
        if path.exists():
            with Cache(path) as c:
                seen = len(c.trials(key))
                claimed = c.claimed_by(key)
    assert seen >= 15, "the child did not get going"
    assert claimed is not None and f":{child.pid}:" in claimed  # it held the claim while tuning
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL

    os.environ["BAGF_CACHE_DIR"] = str(cache_dir)  # restored by the autouse fixture's monkeypatch
    rt = runtime.install(fh.make_runtime())
    cache = rt.cache()
    assert not cache.in_memory
    kept = cache.trials(key)
    counts(faults=1, lost=max(0, seen - len(kept)))
    assert len(kept) >= seen  # completed trials survive the kill
    assert cache.get_plan(key) is None and cache.claimed_by(key) is None  # the dead tuner's claim is void
    t0 = time.monotonic()
    handle = rt.plan_handle(fh.P, 0)
    assert time.monotonic() - t0 < 10  # no waiting for the dead process's lease
    assert rt.stats["tuned"] == 1 and rt.stats["waited"] == 0 and handle in rt.fake_compiler.loaded
    assert cache.get_plan(key)["config"] == rt.fake_compiler.loaded[handle]
    assert len(cache.trials(key)) > len(kept)
    assert not [r for r in bagf_log() if r.levelno >= logging.WARNING], [r.getMessage() for r in bagf_log()]


def test_plan_stored_between_look_and_claim_is_loaded_not_tuned_again(cache_dir):
    """The race behind a once-seen ``tuned == 2`` in the 8-process row (CI, 2 cores): a process looks, finds no
    plan, and by the time it claims the key the tuner has stored its plan and released its claim. The claimant
    must load that plan, not tune the problem a second time (ranks could then run different kernels)."""
    os.environ["BAGF_CACHE_DIR"] = str(cache_dir)  # restored by the autouse fixture's monkeypatch
    first = runtime.install(fh.make_runtime())
    stored = first.fake_compiler.loaded[first.plan_handle(fh.P, 0)]
    assert first.stats["tuned"] == 1
    late = runtime.install(fh.make_runtime())
    cache = late.cache()
    real_get_plan, looks = cache.get_plan, []

    def get_plan(key):  # the first look happens before the plan lands; every later one sees it
        looks.append(key)
        return None if len(looks) == 1 else real_get_plan(key)

    cache.get_plan = get_plan
    handle = late.plan_handle(fh.P, 0)
    # two looks at the key (before and after the claim); the runtime's one look at the other TF32 mode's key
    # (to say why pre-tuned plans would not be used) is not one of them
    assert late.stats["tuned"] == 0 and late.stats["cache_hits"] == 1 and looks.count(looks[0]) == 2
    assert late.fake_compiler.loaded[handle] == stored
    assert cache.claimed_by(looks[0]) is None  # the claim taken for the look is given back


# ---- 8 processes, one cache, one problem -----------------------------------------------------------------


def test_row_8_processes_tune_one_problem(cache_dir, counts):
    workers = 8
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(workers)
    results = ctx.Queue()
    children = [ctx.Process(target=fh.tune_one, args=(str(cache_dir), 0.05, start, results), daemon=True)
                for _ in range(workers)]
    for child in children:
        child.start()
    got = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
    counts(faults=workers - 1, crashed=sum(child.exitcode != 0 for child in children))
    for child in children:
        assert child.exitcode == 0  # no process fails
    assert sum(r["tuned"] for r in got) == 1  # one tuned, the others waited for it
    assert sum(r["waited"] for r in got) == workers - 1
    configs = {tuple(sorted(r["config"].items())) for r in got}
    assert len(configs) == 1  # everyone runs the same kernel
    with Cache(default_cache_path(cache_dir)) as cache:
        assert not cache.in_memory
        plans = cache.plans()
        assert len(plans) == 1 and plans[0]["config"] == got[0]["config"]
        assert cache.claimed_by(plans[0]["key"]) is None  # released


def test_row_claim_of_a_live_process_is_respected_and_expires(cache_dir):
    with Cache.for_dir(cache_dir) as a, Cache.for_dir(cache_dir) as b:
        assert a.claim("k", "host-elsewhere:1:aa", lease_s=0.3) is None
        assert b.claim("k", "host-elsewhere:2:bb", lease_s=0.3) == "host-elsewhere:1:aa"
        assert a.heartbeat("k", "host-elsewhere:1:aa", lease_s=0.3)
        time.sleep(0.35)  # no heartbeat: the lease runs out and the claim can be taken over
        assert b.claimed_by("k") is None
        assert b.claim("k", "host-elsewhere:2:bb", lease_s=30) is None
        assert not a.heartbeat("k", "host-elsewhere:1:aa", lease_s=0.3)  # the first owner is told
        b.release("k", "host-elsewhere:2:bb")
        assert a.claimed_by("k") is None


# ---- DDP / torchrun ranks on one node --------------------------------------------------------------------


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
@pytest.mark.parametrize("world", [3])
def test_row_ddp_ranks_agree_on_one_plan(cache_dir, tmp_path, world, counts):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_file = tmp_path / "dist_init"
    ranks = [ctx.Process(target=fh.ddp_rank, args=(r, world, str(init_file), str(cache_dir), results),
                         daemon=True) for r in range(world)]
    for p in ranks:
        p.start()
    everyone = results.get(timeout=120)
    for p in ranks:
        p.join(timeout=60)
    counts(faults=world - 1, crashed=sum(p.exitcode != 0 for p in ranks))
    for p in ranks:
        assert p.exitcode == 0
    assert sum(r["tuned"] for r in everyone) == 1
    assert len({tuple(sorted(r["config"].items())) for r in everyone}) == 1


# ---- unsupported inputs ----------------------------------------------------------------------------------

_CASES = {
    "cpu": {},
    # float16 and bfloat16 are tuned in NCHW and channels_last; in other strides they are not
    "float16_strided": {"dtype": torch.float16, "input": lambda x: x.transpose(2, 3).contiguous().transpose(2, 3)},
    "bfloat16_strided": {"dtype": torch.bfloat16, "input": lambda x: x.transpose(2, 3).contiguous().transpose(2, 3)},
    "float64": {"dtype": torch.float64},
    "non_contiguous": {"input": lambda x: x.transpose(2, 3).contiguous().transpose(2, 3)},
    "channels_last_float64": {"dtype": torch.float64,
                              "input": lambda x: x.contiguous(memory_format=torch.channels_last)},
    "reflect": {"conv": {"padding_mode": "reflect"}},
    "circular": {"conv": {"padding_mode": "circular"}},
    "groups": {"conv": {"groups": 2}},
    "same_even": {"conv": {"kernel_size": 4, "padding": "same"}},
    "empty_batch": {"input": lambda x: x[:0]},
    "unbatched": {"input": lambda x: x[0]},
}
_REASONS = {"cpu": "not a CUDA tensor", "float16_strided": "non-contiguous", "bfloat16_strided": "non-contiguous",
            "float64": "dtype torch.float64", "non_contiguous": "non-contiguous", "channels_last_float64": "dtype torch.float64",
            "reflect": "padding_mode='reflect'", "circular": "padding_mode='circular'", "groups": "groups > 1",
            "same_even": "'same' padding", "empty_batch": "empty batch", "unbatched": "unbatched"}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_row_unsupported_input_falls_back_with_one_line(case, monkeypatch, bagf_log, counts):
    """The module's fallback on a CPU: the tensor checks are device-agnostic, so with the device check
    passed (as for a CUDA tensor) each reason is reached; the runtime must never be asked."""
    spec = _CASES[case]
    if case != "cpu":
        monkeypatch.setattr(bagf_torch.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    monkeypatch.setattr(runtime.Runtime, "lookup", lambda *a: pytest.fail("an unsupported input reached the runtime"))
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 6, **dict({"kernel_size": 3, "padding": 1}, **spec.get("conv", {})))
    x = torch.randn(2, 4, 10, 12)
    if "dtype" in spec:
        conv, x = conv.to(spec["dtype"]), x.to(spec["dtype"])
    x = spec.get("input", lambda t: t)(x)
    tuned = bagf_torch.TunedConv2d.from_conv(conv)
    counts(faults=1)
    for _ in range(3):
        torch.testing.assert_close(tuned(x), conv(x))
    lines = [r.getMessage() for r in bagf_log()]
    assert len(lines) == 1 and _REASONS[case] in lines[0], lines


def test_row_unsupported_huge_tensors_fall_back(monkeypatch, bagf_log):
    """Input, weight or output beyond 32-bit indexing: ATen, never our kernels (meta tensors: no memory)."""
    monkeypatch.setattr(bagf_torch.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    monkeypatch.setattr(runtime.Runtime, "lookup", lambda *a: pytest.fail("a huge input reached the runtime"))
    cases = [((2**17 + 1, 16, 32, 32), (8, 16, 3, 3), "input with more than 2^31"),
             ((4, 3, 512, 512), (2**13, 3, 5, 5), "output with more than 2^31")]
    for xs, ws, reason in cases:
        conv = torch.nn.Conv2d(ws[1], ws[0], ws[2:], padding=1, device="meta")
        tuned = bagf_torch.TunedConv2d.from_conv(conv)
        x = torch.empty(xs, device="meta")
        assert tuned(x).shape == conv(x).shape
        assert any(reason in r.getMessage() for r in bagf_log()), [r.getMessage() for r in bagf_log()]
    conv = bagf_torch.TunedConv2d(3, 4, 7, device="meta")
    with pytest.raises(RuntimeError, match="size"):  # kernel larger than the input: ATen's own error
        conv(torch.empty(1, 3, 4, 4, device="meta"))


# ---- dynamic shapes --------------------------------------------------------------------------------------


def test_row_dynamic_shapes_tune_each_problem_once():
    rt = runtime.install(fh.make_runtime(budget=4))
    problems = [fh.P.__class__(**dict(fh.P.as_dict(), n=n, stride=(1, 1), padding=(2, 2), dilation=(1, 1)))
                for n in (1, 2, 3, 5, 8)]
    for _ in range(3):
        for p in problems:
            rt.plan_handle(p, 0)
    assert rt.stats["tuned"] == len(problems) and rt.stats["cache_hits"] == 0
    per_problem = [len(rt.cache().trials(rt.key(p, 0))) for p in problems]
    assert all(n <= 4 + 1 for n in per_problem), per_problem  # within budget (+ cuDNN's own trial)


def test_row_tune_disabled_never_stalls_serving(monkeypatch):
    monkeypatch.setenv("BAGF_TUNE", "0")
    rt = runtime.install(fh.make_runtime(delay_s=5.0))  # a tuning would take 30 s
    t0 = time.monotonic()
    for n in range(1, 30):
        assert rt.lookup(fh.P.__class__(**dict(fh.P.as_dict(), n=n, stride=(1, 1), padding=(2, 2),
                                               dilation=(1, 1))), 0) == (ATEN, False)
    assert time.monotonic() - t0 < 2 and rt.stats["tuned"] == 0


# ---- serve while tuning ----------------------------------------------------------------------------------


class _RecordingOp:
    """Stands in for torch.ops.bagf.conv2d on a CPU: computes with F.conv2d, records the plan handle used."""

    def __init__(self):
        self.handles: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, x, w, b, stride, padding, dilation, handle):
        with self._lock:
            self.handles.append(handle)
        return torch.nn.functional.conv2d(x, w, b, stride, padding, dilation)

    @property
    def default(self):  # torch.ops.bagf.conv2d.default, the overload TunedConv2d calls
        return self


def test_row_serve_while_tuning(monkeypatch):
    monkeypatch.setenv("BAGF_BACKGROUND", "1")
    monkeypatch.setattr(bagf_torch.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    op = _RecordingOp()
    monkeypatch.setattr(torch.ops, "bagf", type("FakeNamespace", (), {"conv2d": op})())
    rt = runtime.install(fh.make_runtime(delay_s=0.1, budget=6))  # about 0.7 s of tuning
    conv = torch.nn.Conv2d(64, 192, 5, padding=2)
    tuned = bagf_torch.TunedConv2d.from_conv(conv)
    x = torch.randn(1, 64, 27, 27)
    want = conv(x)

    errors, outputs = [], []

    def serve():
        try:
            for _ in range(10):
                outputs.append(tuned(x))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t0 = time.monotonic()
    first = tuned(x)
    assert time.monotonic() - t0 < 0.5  # returned at ATen speed, not after the tuning
    torch.testing.assert_close(first, want)
    assert op.handles == []  # served by ATen
    threads = [threading.Thread(target=serve) for _ in range(4)]  # callers from several threads meanwhile
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert rt.wait_background(timeout=30)
    assert rt.stats["tuned"] == 1  # one tuning however many threads asked
    torch.testing.assert_close(tuned(x), want)
    winner = op.handles[-1]
    assert winner in rt.fake_compiler.loaded and winner not in rt.fake_compiler.unloaded
    plans = rt.cache().plans()
    assert len(plans) == 1 and plans[0]["config"] == rt.fake_compiler.loaded[winner]
    for out in outputs:
        torch.testing.assert_close(out, want)


def test_row_background_failure_falls_back_to_aten_once(monkeypatch, bagf_log):
    monkeypatch.setenv("BAGF_BACKGROUND", "1")
    rt = fh.make_runtime()

    def broken(rt_, dev, listeners):
        raise RuntimeError("toolchain broke")

    rt._make_tuner = broken
    runtime.install(rt)
    assert rt.lookup(fh.P, 0) == (ATEN, False)
    assert rt.wait_background(timeout=10)
    assert rt.lookup(fh.P, 0) == (ATEN, True)  # final: not retried on every call
    lines = [r.getMessage() for r in bagf_log() if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "toolchain broke" in lines[0]
    assert rt.cache().claimed_by(rt.key(fh.P, 0)) is None  # the failed tuner let go of its claim


def test_row_wrong_results_are_never_cached(counts):
    """A checker that rejects every kernel: the plan is ATen, no rejected config is ever the plan."""
    from bagf_torch.tuning.common import Outcome

    rt = fh.make_runtime()
    inner = rt._make_tuner

    def make(rt_, dev, listeners):
        tuner = inner(rt_, dev, listeners)
        tuner.checker = type("C", (), {"check": lambda self, ws, h: Outcome("wrong", detail="relative error 1")})()
        return tuner

    rt._make_tuner = make
    runtime.install(rt)
    handle = rt.plan_handle(fh.P, 0)
    key = rt.key(fh.P, 0)
    counts(faults=len(rt.fake_compiler.loaded), wrong_cached=int(rt.cache().get_plan(key)["family"] != "aten"))
    assert handle == ATEN
    assert rt.cache().get_plan(key)["family"] == "aten"
    statuses = [t["status"] for t in rt.cache().trials(key)]
    assert statuses.count("wrong") >= 1 and statuses.count("ok") == 1  # only cuDNN's measurement was ok


# ---- candidate isolation (the protocol, on a CPU with a fake worker backend) ----------------------------


def test_row_isolated_worker_survives_crash_poison_hang_and_wrong(counts):
    from bagf_torch.tuning.isolated import RemoteWorkspace, WorkerPool

    pool = WorkerPool(0, timeout_s=2.0, backend="fault_helpers:cpu_backend")
    try:
        good = dict(ig.DEFAULT)
        configs = {"good": good, "crash": dict(good, BM=fh.CRASH_BM, TM=1), "poison": dict(good, BM=fh.POISON_BM),
                   "hang": dict(good, BM=fh.HANG_BM), "wrong": dict(good, BN=fh.WRONG_BN), "good2": dict(good, BK=16)}
        built = dict(zip(configs, pool.compiler().compile(ig, list(configs.values()))))
        assert all(hasattr(b, "handle") for b in built.values())
        ws = pool.workspace(fh.P)
        assert isinstance(ws, RemoteWorkspace)
        check = pool.checker().check
        got = {name: check(ws, b.handle) for name, b in built.items()}
        counts(faults=4)
        assert got["good"] is None and got["good2"] is None
        assert got["crash"].status == "crashed" and "SIGABRT" in got["crash"].detail
        assert got["poison"].status == "crashed" and "illegal memory access" in got["poison"].detail
        assert got["hang"].status == "timeout" and "killed" in got["hang"].detail
        assert got["wrong"].status == "wrong"
        assert (pool.crashes, pool.timeouts, pool.restarts) == (2, 1, 3)
        # The survivors still work after the restarts (the worker re-loads them before use).
        bench = pool.benchmarker()
        assert bench.measure(ws, built["good"].handle).ok
        times = bench.remeasure(ws, [built["good"].handle, built["good2"].handle, ATEN])
        assert len(times) == 3 and times[-1] == 100.0
    finally:
        pool.close()
    assert pool._proc is None


def test_an_interrupted_isolated_request_does_not_answer_the_next_one():
    """Ctrl-C (here a signal handler's KeyboardInterrupt) while the parent waits for the worker: the interrupt
    reaches the caller, and the next requests get their own answers. The worker's late answer to the interrupted
    request used to stay in the pipe, and every later request read the one before it: a wrong kernel's check
    answered with a pass."""
    import signal

    from bagf_torch.tuning.isolated import WorkerPool

    def interrupt(*_):
        raise KeyboardInterrupt

    pool = WorkerPool(0, timeout_s=5.0, backend="fault_helpers:cpu_backend")
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        good = dict(ig.DEFAULT)
        slow, wrong = dict(good, BK=fh.SLOW_BK), dict(good, BN=fh.WRONG_BN)
        built = pool.compiler().compile(ig, [good, slow, wrong])
        ws = pool.workspace(fh.P)
        check = pool.checker().check
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            check(ws, built[1].handle)
        time.sleep(1.2)  # the slow check's answer would be in the pipe by now
        assert check(ws, built[2].handle).status == "wrong"
        assert check(ws, built[0].handle) is None and check(ws, built[1].handle) is None
        assert pool.benchmarker().measure(ws, built[0].handle).ok
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        pool.close()


def test_the_isolated_pool_is_a_trial_backend_the_tuner_runs_on():
    """``WorkerPool.backend()`` is what the runtime hands the Tuner with BAGF_ISOLATE=1: a whole tuning runs through
    it in the worker, and the backend says its handles are not this process's."""
    from bagf_torch.tuning.common import Budget
    from bagf_torch.tuning.isolated import WorkerPool
    from bagf_torch.tuning.tuner import Tuner

    pool = WorkerPool(0, timeout_s=10.0, backend="fault_helpers:cpu_backend")
    try:
        backend = pool.backend()
        assert backend.local is False and pool.backend_spec == "fault_helpers:cpu_backend"
        result = Tuner(backend, ig, strategy="random", budget=Budget(6), seed=0).tune(fh.P)
        assert result.evaluations >= 3 and result.family == ig.FAMILY  # (random search also met the planted faults)
        assert result.config["BM"] not in (fh.CRASH_BM, fh.POISON_BM, fh.HANG_BM) and result.config["BN"] != fh.WRONG_BN
    finally:
        pool.close()


# ---- GPU rows: the real NVRTC path, the real worker, a deliberately faulty kernel ------------------------

_GPU_PROBLEM = dict(n=2, c=8, h=12, w=10, k=20, r=3, s=3, padding=(1, 1))


def _gpu_problem():
    from bagf_torch.problem import ConvProblem

    return ConvProblem(**_GPU_PROBLEM)


def _parent_context_is_usable():
    import torch.nn.functional as F

    x = torch.randn(2, 8, 12, 10, device="cuda")
    w = torch.randn(20, 8, 3, 3, device="cuda")
    out = F.conv2d(x, w, padding=1)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), F.conv2d(x.cpu(), w.cpu(), padding=1), rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_row_gpu_compile_and_resource_failures_are_typed(cache_dir, counts):
    """Through the real NVRTC path in this process (compiling cannot hurt the context): a compile error is
    "compile" with the compiler's log; 4096 threads per block is refused at load or launch, typed."""
    import faulty_family as ff
    from bagf_torch.jit.compiler import KernelCompiler
    from bagf_torch.tuning.measure import CudaChecker, Workspace

    compiler = KernelCompiler(Cache.for_dir(cache_dir), 0, workers=2)
    bad_source, too_big = compiler.compile(ff, [ff.config(9), dict(ff.config(ff.CORRECT), BM=64, BN=64)])
    counts(faults=2)
    assert bad_source.status == "compile" and "MODE must be 0..3" in bad_source.detail
    if hasattr(too_big, "handle"):  # loaded: the launch must fail, typed, and leave the context usable
        out = CudaChecker(compiler.ext).check(Workspace(_gpu_problem(), torch.device("cuda", 0)), too_big.handle)
        assert out is not None and out.status == "launch", out
    else:
        assert too_big.status == "resources", too_big
    _parent_context_is_usable()


@pytest.mark.cuda
def test_row_gpu_faulty_kernels_isolated(cache_dir, monkeypatch, counts):
    """Out-of-bounds writer -> "crashed", wrong numbers -> "wrong", spin loop -> "timeout", all in the worker;
    this process's CUDA context stays usable, and the correct kernel still checks and times after restarts."""
    import faulty_family as ff
    from bagf_torch.tuning.isolated import WorkerPool

    monkeypatch.setenv("BAGF_CACHE_DIR", str(cache_dir))
    _parent_context_is_usable()  # the parent has a context of its own before and after
    pool = WorkerPool(0, timeout_s=10.0)
    try:
        modes = [ff.CORRECT, ff.OUT_OF_BOUNDS, ff.WRONG, ff.HANG]
        built = pool.compiler().compile(ff, [ff.config(m) for m in modes])
        assert all(hasattr(b, "handle") for b in built), [getattr(b, "detail", "")[:500] for b in built]
        ws = pool.workspace(_gpu_problem())
        got = [pool.checker().check(ws, b.handle) for b in built]
        counts(faults=3)
        assert got[0] is None
        assert got[1].status == "crashed" and "illegal" in got[1].detail.lower(), got[1]
        assert got[2].status == "wrong", got[2]
        assert got[3].status == "timeout", got[3]
        assert pool.crashes == 1 and pool.timeouts == 1
        assert pool.benchmarker().measure(ws, built[0].handle).ok
        _parent_context_is_usable()
    finally:
        pool.close()
    _parent_context_is_usable()


@pytest.mark.cuda
def test_row_gpu_import_of_a_plan_that_computes_wrongly_here(cache_dir, tmp_path, monkeypatch, counts):
    """An export naming a kernel that gives wrong numbers (the faulty family's MODE 2, rebuilt from its source
    by the real compiler) is skipped by ``cache import``'s float64 check (``cache_io.local_checker``); the
    right plan of the same file is stored and runs right."""
    import json

    import faulty_family as ff
    from bagf_torch import cache_io
    from bagf_torch.cache import EXPORT_FORMAT, SCHEMA_VERSION
    from bagf_torch.jit.extension import environment
    from bagf_torch.kernels import FAMILIES
    from bagf_torch.problem import ConvProblem, fingerprint

    monkeypatch.setitem(FAMILIES, ff.FAMILY, ff)
    env = environment(torch.cuda.current_device())
    right, wrong = _gpu_problem(), ConvProblem(**dict(_GPU_PROBLEM, n=3))
    entries = [{"key": fingerprint(p, env), "problem": p.as_dict(), "env": env, "family": ff.FAMILY,
                "config": ff.config(mode), "time_us": 3.0, "aten_us": 5.0, "default_us": 4.0, "evaluations": 5,
                "tune_seconds": 1.0, "cubin_digests": [], "created": 1.7e9}
               for p, mode in ((right, ff.CORRECT), (wrong, ff.WRONG))]
    path = tmp_path / "export.json"
    path.write_text(json.dumps({"format": EXPORT_FORMAT, "schema": SCHEMA_VERSION, "plans": entries, "cubins": []}))
    with Cache.for_dir(cache_dir) as cache:
        compiler = cache_io.local_compiler(cache)
        imported, skipped = cache.import_(path, env, compiler=compiler, checker=cache_io.local_checker(compiler))
        counts(faults=1, wrong_cached=int(cache.get_plan(fingerprint(wrong, env)) is not None))
        assert imported == 1 and len(skipped) == 1, skipped
        assert "failed its check here against float64 (wrong: relative error" in skipped[0], skipped
        assert cache.get_plan(fingerprint(right, env))["config"] == ff.config(ff.CORRECT)
    _parent_context_is_usable()


@pytest.mark.cuda
def test_row_gpu_tuner_goes_on_past_faulty_candidates(cache_dir, monkeypatch, counts):
    """The Tuner, unchanged, over the faulty family with isolation: every fault is a recorded typed failure
    (journaled to the cache as it happens), the winner is the correct kernel or cuDNN, never a wrong one."""
    import faulty_family as ff
    from bagf_torch.tuning.common import Budget
    from bagf_torch.tuning.isolated import WorkerPool
    from bagf_torch.tuning.tuner import Tuner

    monkeypatch.setenv("BAGF_CACHE_DIR", str(cache_dir))
    pool = WorkerPool(0, timeout_s=10.0)
    try:
        with Cache.for_dir(cache_dir) as cache:
            tuner = Tuner(pool.backend(), ff,
                          strategy="exhaustive", budget=Budget(5),  # default + 4
                          listeners=[runtime._Journal(cache, "faulty-key")])
            result = tuner.tune(_gpu_problem())
            statuses = {t["config"]["MODE"]: t["status"] for t in cache.trials("faulty-key") if t["config"]}
    finally:
        pool.close()
    counts(faults=3, wrong_cached=int(result.config is not None and result.config["MODE"] != ff.CORRECT))
    assert statuses == {ff.CORRECT: "ok", ff.OUT_OF_BOUNDS: "crashed", ff.WRONG: "wrong", ff.HANG: "timeout"}
    assert result.config is None or result.config["MODE"] == ff.CORRECT
    _parent_context_is_usable()


@pytest.mark.cuda
def test_row_gpu_isolated_runtime_loads_only_the_winner(monkeypatch):
    """BAGF_ISOLATE=1 end to end: this process compiles nothing and loads at most the winner (from the cubin
    the worker stored), and the tuned layer is correct."""
    import torch.nn.functional as F

    from bagf_torch.jit import compiler as jc

    monkeypatch.setenv("BAGF_ISOLATE", "1")
    monkeypatch.setenv("BAGF_BUDGET", "4")
    # (the evaluations end the search, not the clock: a worker's start and cold NVRTC compiles can take the default
    # 6 s before a candidate comes back, and then only cuDNN's trial is recorded)
    monkeypatch.setenv("BAGF_TIME_BUDGET", "120")
    monkeypatch.setenv("BAGF_STRATEGY", "random")
    conv = torch.nn.Conv2d(8, 20, 3, padding=1).cuda()
    tuned = bagf_torch.TunedConv2d.from_conv(conv)
    x = torch.randn(2, 8, 12, 10, device="cuda")
    rt = runtime.get()
    rt.device(0)  # build/load the extension first: its own loads are not the tuning's
    before = (jc.STATS.nvrtc_compiles, jc.STATS.loads)
    with torch.no_grad():
        got = tuned(x)
    torch.testing.assert_close(got, F.conv2d(x, conv.weight, conv.bias, padding=1), rtol=1e-4, atol=1e-4)
    assert rt.stats["tuned"] == 1
    plan = rt.cache().plans()[0]
    assert jc.STATS.nvrtc_compiles == before[0]  # everything was compiled in the worker
    assert jc.STATS.loads - before[1] == (0 if plan["family"] == "aten" else 1)
    assert len(rt.cache().trials(plan["key"])) >= 2


@pytest.mark.cuda
def test_row_gpu_huge_batch_falls_back_correctly(bagf_log):
    """More than 2^31 input elements on the device (8.6 GB): ATen, the right answer, one log line."""
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs a GPU with 40 GiB")
    conv = torch.nn.Conv2d(1, 1, 1).cuda()
    tuned = bagf_torch.TunedConv2d.from_conv(conv)
    x = torch.randn(2049, 1, 1024, 1024, device="cuda")
    assert x.numel() > 2**31
    with torch.no_grad():
        got = tuned(x)
        assert torch.equal(got[-1], conv(x[-1:])[0])
    del got, x
    torch.cuda.empty_cache()
    assert [r.getMessage() for r in bagf_log() if "2^31" in r.getMessage()]

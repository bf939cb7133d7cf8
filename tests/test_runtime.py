"""The runtime's lookup (memo -> disk cache -> tuning) on a CPU, with the device side faked."""

from __future__ import annotations

import contextlib
import logging
import types

import pytest

from bagf_torch import runtime
from bagf_torch.kernels import implicit_gemm as ig
from bagf_torch.ops import ATEN
from bagf_torch.problem import ConvProblem
from bagf_torch.tuning.backend import TrialBackend
from bagf_torch.tuning.common import Budget, Outcome
from bagf_torch.tuning.tuner import Tuner
from fault_helpers import FakeCompiler  # tests/ is on sys.path (pytest's default prepend import mode)

P = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
ENV = {"gpu": "Fake GPU", "cc": "9.0", "driver": 1, "runtime": 1, "nvrtc": "13.0", "torch": "x",
       "bagf_torch": "0.1.0", "kernels": "k", "os": "posix"}


class FakeBench:
    """cuDNN at 100 us; our kernels get faster with larger BN (so some config beats cuDNN)."""

    def __init__(self, compiler, aten_us=100.0):
        self.compiler = compiler
        self.aten_us = aten_us

    def _t(self, h):
        return self.aten_us if h == ATEN else 400.0 / self.compiler.loaded[h]["BN"] ** 0.5

    def measure(self, ws, handle, cutoff_us=None):
        return Outcome("ok", time_us=self._t(handle))

    def remeasure(self, ws, handles, rounds=5):
        return [self._t(h) for h in handles]


@pytest.fixture
def fake_device(monkeypatch):
    comp = FakeCompiler()
    dev = runtime._Device(0, ENV, comp)
    monkeypatch.setattr(runtime.Runtime, "device", lambda self, index: dev)

    def tuner(self, d, budget=None, strategy=None, seed=None, listeners=(), backend=None):
        backend = backend or TrialBackend(comp, types.SimpleNamespace(check=lambda ws, h: None), FakeBench(comp),
                                          lambda p: None)
        return Tuner(backend, ig, strategy="random", budget=Budget(6), seed=0, listeners=listeners)

    monkeypatch.setattr(runtime.Runtime, "tuner", tuner)
    monkeypatch.setattr(runtime.torch.cuda, "device", lambda index: contextlib.nullcontext())
    return comp


def test_a_winner_tuned_by_a_backend_of_another_process_is_loaded_here_from_the_cache(monkeypatch, fake_device):
    """A backend whose handles are not this process's (``local`` False: the isolated worker's) has its winner freed
    there and loaded here from the stored plan; the runtime asks the tuner's backend, not a setting or a test hook."""
    child = FakeCompiler()
    backend = TrialBackend(child, types.SimpleNamespace(check=lambda ws, h: None), FakeBench(child), lambda p: None,
                           local=False)
    monkeypatch.setattr(runtime.Runtime, "backend", lambda self, dev: backend)
    monkeypatch.setattr(runtime.Runtime, "tuner", lambda self, d, listeners=(), **kw: Tuner(
        self.backend(d), ig, strategy="random", budget=Budget(6), seed=0, listeners=listeners))
    rt = runtime.get()
    h = rt.plan_handle(P, 0)
    row = rt.cache().get_plan(rt.key(P, 0))
    assert row["family"] == "implicit_gemm" and h in fake_device.loaded and fake_device.loaded[h] == row["config"]
    winner = next(k for k, c in child.loaded.items() if c == row["config"])
    assert winner in child.unloaded and not fake_device.unloaded  # freed in the child; nothing here loaded twice


def test_first_lookup_tunes_and_stores_then_memo_then_disk(fake_device):
    rt = runtime.get()
    h = rt.plan_handle(P, 0)
    assert h in fake_device.loaded and rt.stats["tuned"] == 1
    assert rt.plan_handle(P, 0) == h and rt.stats["tuned"] == 1  # memo
    row = rt.cache().get_plan(rt.key(P, 0))
    assert row["family"] == "implicit_gemm" and row["config"] == fake_device.loaded[h]
    assert len(rt.cache().trials(rt.key(P, 0))) >= 6  # every trial kept, cuDNN's included
    runtime.reset()  # a new process over the same cache
    rt2 = runtime.get()
    h2 = rt2.plan_handle(P, 0)
    assert rt2.stats["tuned"] == 0 and rt2.stats["cache_hits"] == 1
    assert fake_device.loaded[h2] == row["config"]


def _with_listener(monkeypatch, listener):
    """The fixture's tuner, with ``listener`` after the runtime's own listeners."""
    inner = runtime.Runtime.tuner
    monkeypatch.setattr(runtime.Runtime, "tuner",
                        lambda self, d, listeners=(), **kw: inner(self, d, listeners=[*listeners, listener], **kw))


def test_the_journal_writes_every_trial_to_the_cache_as_it_completes(fake_device, monkeypatch):
    rt = runtime.get()
    stored_before = []  # trials in the cache when each event reached a listener placed after the journal
    _with_listener(monkeypatch, lambda event: stored_before.append(len(rt.cache().trials(rt.key(P, 0)))))
    rt.plan_handle(P, 0)
    result = rt.results[-1]
    rows = rt.cache().trials(rt.key(P, 0))
    assert [(r["family"], r["config"], r["status"], r["time_us"]) for r in rows] == \
        [(t.family, t.config, t.outcome.status, t.outcome.time_us) for t in result.trials]
    assert rows[0]["family"] == "aten" and len(rows) >= 6
    assert stored_before == list(range(1, len(rows) + 1))


def test_a_cache_that_cannot_store_trials_does_not_stop_the_tuning(fake_device, monkeypatch, caplog):
    rt = runtime.get()

    def full(key, trials):
        raise OSError("disk full")

    monkeypatch.setattr(rt.cache(), "add_trials", full)
    with caplog.at_level(logging.WARNING, logger="bagf_torch"):
        h = rt.plan_handle(P, 0)
    assert h in fake_device.loaded and rt.cache().get_plan(rt.key(P, 0))["family"] == "implicit_gemm"
    lines = [r.getMessage() for r in caplog.records if r.name == "bagf_torch"]
    assert len(lines) == 1 and "_Journal" in lines[0] and "disk full" in lines[0]


def test_pretune_feeds_the_progress_bar_from_the_tuners_trials(fake_device):
    from bagf_torch import pretune

    calls = []
    progress = types.SimpleNamespace(cudnn=lambda t: calls.append(("cudnn", t)),
                                     trial=lambda status, t: calls.append((status, t)))
    rt = runtime.get()
    key, row, tuned_now = rt.pretune(P, 0, listeners=[pretune._ProgressListener(progress)])
    trials = rt.results[-1].trials
    assert tuned_now and calls[0] == ("cudnn", 100.0)
    assert calls[1:] == [(t.outcome.status, t.outcome.time_us) for t in trials[1:]]


def test_pretunings_up_front_wave_covers_the_problems_the_cache_lacks(fake_device):
    """``RuntimeTuneStep.prepare`` (what tune_model calls before the first problem) hands the device's compiler one
    prefetch of every family's start point for the problems not in the cache, deduplicated (one cubin serves
    every shape); once a problem has its plan it is left out."""
    import dataclasses

    from bagf_torch import pretune

    asked = []
    fake_device.prefetch = lambda items: (asked.append([(f.FAMILY, dict(c)) for f, c in items]), {})[1]
    step = pretune.RuntimeTuneStep(budget=6, seconds=5.0)
    other = dataclasses.replace(P, n=2)
    assert step.prepare([(P, 0), (other, 0)]) == 1 and asked == [[("implicit_gemm", dict(ig.DEFAULT))]]
    runtime.get().pretune(P, 0)
    asked.clear()
    assert step.prepare([(P, 0)]) == 0 and asked == []
    assert step.prepare([(P, 0), (other, 0)]) == 1 and len(asked) == 1


def test_tune_disabled_serves_aten_without_tuning(fake_device, monkeypatch, caplog):
    monkeypatch.setenv("BAGF_TUNE", "0")
    monkeypatch.setenv("BAGF_LOG", "info")  # the untuned-problem line is INFO: serving with BAGF_TUNE=0 is normal
    rt = runtime.get()
    with caplog.at_level(logging.INFO, logger="bagf_torch"):
        assert rt.plan_handle(P, 0) == ATEN
        assert rt.plan_handle(P, 0) == ATEN
    assert rt.stats["tuned"] == 0 and not fake_device.loaded
    assert len([r for r in caplog.records if "BAGF_TUNE=0" in r.getMessage()]) == 1
    monkeypatch.setenv("BAGF_TUNE", "1")  # turning tuning on later in the process tunes it
    assert rt.plan_handle(P, 0) != ATEN and rt.stats["tuned"] == 1


def test_other_process_winner_is_used(fake_device, monkeypatch):
    rt = runtime.get()
    key = rt.key(P, 0)
    winner = dict(ig.DEFAULT, BN=16)
    real_put = rt.cache().put_plan

    def racing_put(k, **kw):  # another process stores its winner just before we do
        real_put(k, **dict(kw, config=winner, time_us=1.0))
        return real_put(k, **kw)

    monkeypatch.setattr(rt.cache(), "put_plan", racing_put)
    h = rt.plan_handle(P, 0)
    assert fake_device.loaded[h] == winner
    assert rt.cache().get_plan(key)["config"] == winner


def test_aten_plan_when_cudnn_wins(fake_device, monkeypatch):
    monkeypatch.setattr(FakeBench, "_t", lambda self, h: 1.0 if h == ATEN else 50.0)
    rt = runtime.get()
    assert rt.plan_handle(P, 0) == ATEN
    assert rt.cache().get_plan(rt.key(P, 0))["family"] == "aten"
    assert set(fake_device.loaded) == fake_device.unloaded  # no kernel kept for an ATen plan


def test_a_wait_for_another_process_does_not_hold_up_other_threads_lookups(fake_device, monkeypatch):
    """While one thread waits for another process to finish tuning its problem (a live claim), another thread's
    first call of a problem already in the cache gets its plan at once: the wait used to sleep with the process's
    tune lock held, for up to BAGF_CLAIM_WAIT (60 s by default)."""
    import dataclasses
    import threading
    import time

    monkeypatch.setenv("BAGF_CLAIM_WAIT", "3")
    rt = runtime.get()
    other = dataclasses.replace(P, k=96)
    rt.plan_handle(other, 0)  # its plan is in the cache (as after a pre-tuning)
    rt.forget()
    rt.cache().claim(rt.key(P, 0), "otherhost:123:abcd", 30.0)  # another process is tuning P
    waiter = threading.Thread(target=rt.lookup, args=(P, 0))
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    handle, final = rt.lookup(other, 0)
    took = time.monotonic() - t0
    waiter.join()
    assert final and handle != ATEN and took < 1.0, took
    assert rt.stats["waited"] == 1 and rt.stats["gave_up"] == 1


def test_pretuning_takes_and_respects_the_claims_forwards_take(fake_device, monkeypatch):
    """A pre-tuning tunes under a claim (a forward in another process waits for its plan instead of tuning beside
    it), waits for another process's claim and takes that process's plan, and tunes the problem itself once
    BAGF_CLAIM_WAIT has run out (it was asked for the plan)."""
    import threading
    import time

    monkeypatch.setenv("BAGF_CLAIM_WAIT", "1")
    rt = runtime.get()
    key = rt.key(P, 0)
    seen = []

    rt.pretune(P, 0, listeners=[lambda event: seen.append(rt.cache().claim(key, "otherhost:1:x", 30.0))])
    assert seen and all(holder is not None for holder in seen)  # each trial ran with the claim held
    rt.cache().clear()
    rt.forget()

    rt.cache().claim(key, "otherhost:123:abcd", 30.0)  # another process is tuning P, and stores its plan
    stored = threading.Timer(0.3, lambda: (rt.cache().put_plan(
        key, problem=P.as_dict(), env=ENV, family="aten", config=None, time_us=50.0, aten_us=50.0, default_us=None,
        evaluations=3, tune_seconds=1.0), rt.cache().release(key, "otherhost:123:abcd")))
    stored.start()
    _, row, tuned_now = rt.pretune(P, 0)
    stored.join()
    assert not tuned_now and row["family"] == "aten" and rt.stats["waited"] == 1
    rt.cache().clear()
    rt.forget()

    rt.cache().claim(key, "otherhost:123:abcd", 30.0)  # one that never finishes
    t0 = time.monotonic()
    _, row, tuned_now = rt.pretune(P, 0)
    assert tuned_now and row["family"] == "implicit_gemm" and 1.0 <= time.monotonic() - t0 < 10


def test_pretuning_a_cached_problem_loads_its_plan_so_a_first_call_in_a_capture_runs_it(fake_device, monkeypatch):
    """tune_model on a cache that already holds the plan (a second run, a serving process): pretune loads it and
    memoises the handle, once, as a forward's lookup would; a first call inside a CUDA graph capture, whose lookup
    may neither load nor tune, then gets the plan instead of torch's conv."""
    rt = runtime.get()
    _, row, tuned_now = rt.pretune(P, 0)
    assert tuned_now and row["family"] == "implicit_gemm"
    rt.forget()  # (a new process: the cache on disk, nothing loaded)
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    assert rt.lookup(P, 0) == (runtime.ATEN, False)  # (not loaded: a capture cannot load it)
    loads = len(fake_device.loaded)
    _, again, tuned_now = rt.pretune(P, 0)
    assert not tuned_now and again["config"] == row["config"] and len(fake_device.loaded) == loads + 1
    handle, final = rt.lookup(P, 0)
    assert final and fake_device.loaded[handle] == row["config"]
    rt.pretune(P, 0)
    assert len(fake_device.loaded) == loads + 1  # (loaded once)


def test_the_isolated_timeout_is_read_at_each_tuning(fake_device, monkeypatch):
    """BAGF_ISOLATE_TIMEOUT, as every setting, applies from the next tuning on (it was fixed when the device's worker
    pool was made), and a bad value is the settings' error, not ignored."""
    from bagf_torch import settings

    monkeypatch.setenv("BAGF_ISOLATE", "1")
    monkeypatch.setenv("BAGF_ISOLATE_TIMEOUT", "20")
    rt = runtime.get()
    dev = rt.device(0)
    assert rt._pool(dev).timeout_s == 20.0
    monkeypatch.setenv("BAGF_ISOLATE_TIMEOUT", "300")
    assert rt._pool(dev).timeout_s == 300.0
    monkeypatch.setenv("BAGF_ISOLATE_TIMEOUT", "abc")
    with pytest.raises(settings.SettingError, match="BAGF_ISOLATE_TIMEOUT"):
        rt._pool(dev)
    rt.close()


def test_a_plan_another_thread_loaded_meanwhile_is_not_loaded_again(fake_device):
    """Between the passes of a wait the tune lock is let go; a pass that finds the problem's plan already loaded by
    another thread of this process takes that handle instead of loading the plan a second time (whose first handle
    would then never be unloaded)."""
    rt = runtime.get()
    handle = rt.plan_handle(P, 0)
    loads = len(fake_device.loaded)
    assert rt._resolve(P, 0, runtime._ClaimWait()) == handle and len(fake_device.loaded) == loads
    key, row, tuned_now = rt.pretune(P, 0)
    assert row is not None and not tuned_now and len(fake_device.loaded) == loads

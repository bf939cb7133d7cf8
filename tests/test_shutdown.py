"""The interpreter's exit with bagf_torch's daemon threads still running (CPU: meaningful in CI).

A daemon thread inside torch when the interpreter finalizes is ended by CPython (before 3.14) with pthread_exit,
whose unwinding through pybind11's noexcept ``gil_scoped_release`` destructor aborts the whole process. The threads
bagf_torch starts for such work are finished first (``bagf_torch.shutdown``); ``python -m bagf_torch`` ends by
``os._exit`` (``cli.run``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import fault_helpers as fh  # tests/ is on sys.path (pytest's default prepend import mode)
from bagf_torch import runtime, shutdown
from bagf_torch.ops import ATEN

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__import__("bagf_torch").__file__)))

# A child whose daemon thread is inside torch's autograd and matmul bindings (which give the GIL away with pybind11's
# RAII guard) for about 1.5 s after the main thread has ended the program.
_CHILD = textwrap.dedent(f"""
    import sys, threading, time
    sys.path.insert(0, {_PACKAGE_ROOT!r})
    import torch
    from bagf_torch import shutdown

    def work():
        a = torch.randn(96, 96, requires_grad=True)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            (a @ a @ a).sum().backward()

    t = threading.Thread(target=work, daemon=True, name="torch-worker")
    t.start()
    if sys.argv[1] == "track":
        shutdown.track(t)
    time.sleep(0.2)
    print("main ends", flush=True)
    sys.exit(3)
""")


def _child(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, BAGF_LOG="info")
    return subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, env=env, timeout=120)


def test_a_tracked_thread_inside_torch_is_finished_before_the_interpreter_ends():
    res = _child("track")
    assert "terminate called" not in res.stderr, res.stderr[-2000:]
    assert res.returncode == 3, (res.returncode, res.stderr[-2000:])
    # the exit waited for it: it was still running when the program ended
    assert "for torch-worker to end" in res.stderr, res.stderr[-2000:]


def test_an_untracked_thread_inside_torch_aborts_the_exit_where_python_ends_daemon_threads():
    """What the tracking prevents, on this Python: the same child without it (3.14 and later block such a thread
    instead of ending it, so the exit is clean there)."""
    res = _child("untracked")
    if sys.version_info >= (3, 14):
        assert res.returncode == 3, res.stderr[-2000:]
    else:
        assert res.returncode != 3 and "terminate called" in res.stderr, (res.returncode, res.stderr[-2000:])


def test_wait_for_tracked_stops_the_background_tuner_after_its_tuning(monkeypatch):
    """At exit the background tuner finishes the tuning in progress (all its evaluations, stored) and starts no
    other; the problem it did not start is let go: its waiters are released, a later lookup asks again."""
    monkeypatch.setattr(shutdown, "_tracked", [])  # (this process's other tests' threads are not this test's)
    monkeypatch.setenv("BAGF_BACKGROUND", "1")
    rt = runtime.install(fh.make_runtime(delay_s=0.05, budget=6))  # about 0.4 s per tuning
    other = dataclasses.replace(fh.P, k=96)
    before = set(threading.enumerate())
    assert rt.lookup(fh.P, 0) == (ATEN, False)
    assert rt.lookup(other, 0) == (ATEN, False)  # queued behind the first
    time.sleep(0.1)  # the first tuning under way
    workers = [t for t in set(threading.enumerate()) - before if t.name == "bagf-background-tuner"]
    assert len(workers) == 1
    assert shutdown.wait_for_tracked(timeout=30) == []
    assert not workers[0].is_alive()
    assert rt.stats["tuned"] == 1  # the first finished, the second never started
    assert len(rt.results) == 1 and len(rt.results[0].trials) >= 6 + 1  # the whole budget (and cuDNN's baseline)
    assert rt.wait_background(timeout=1)  # nothing left pending
    runtime.reset()


def test_closing_a_runtime_ends_its_background_tuner(monkeypatch):
    """A runtime replaced or reset leaves no idle background thread behind."""
    monkeypatch.setattr(shutdown, "_tracked", [])
    monkeypatch.setenv("BAGF_BACKGROUND", "1")
    rt = runtime.install(fh.make_runtime(budget=4))
    before = set(threading.enumerate())
    assert rt.lookup(fh.P, 0) == (ATEN, False)
    assert rt.wait_background(timeout=30)
    workers = [t for t in set(threading.enumerate()) - before if t.name == "bagf-background-tuner"]
    assert len(workers) == 1 and workers[0].is_alive()  # idle, waiting for the next problem
    runtime.reset()
    workers[0].join(10)
    assert not workers[0].is_alive()


def test_wait_for_tracked_is_bounded_and_names_what_it_left(caplog, monkeypatch):
    monkeypatch.setattr(shutdown, "_tracked", [])
    caplog.set_level(logging.INFO, logger="bagf_torch")
    release = threading.Event()
    t = threading.Thread(target=release.wait, daemon=True, name="stuck-thread")
    t.start()
    shutdown.track(t)
    t0 = time.monotonic()
    left = shutdown.wait_for_tracked(timeout=0.3)
    assert left == [t] and time.monotonic() - t0 < 2.0
    assert any("stuck-thread still running" in r.getMessage() for r in caplog.records)
    release.set()
    t.join(5)
    assert shutdown.wait_for_tracked(timeout=1) == []


def test_the_command_line_ends_with_its_own_status_and_complete_output(tmp_path):
    """``python -m bagf_torch`` ends by os._exit: its output is flushed first and its status is the command's."""
    env = dict(os.environ, BAGF_CACHE_DIR=str(tmp_path / "cache"))
    listed = subprocess.run([sys.executable, "-m", "bagf_torch", "cache", "list"], capture_output=True, text=True,
                            env=env, timeout=120, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert listed.stdout.startswith("0 plans in "), listed.stdout
    closed = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "bagf_torch", "cache", "list"],
                            stderr=subprocess.PIPE, text=True, env=env, timeout=120, cwd=tmp_path)  # stdout closed
    assert closed.returncode == 0, closed.stderr[-2000:]


def _build_stub_nvrtc_module(tmp_path) -> str:
    """csrc/nvrtc_compile.h (the installed copy's) built as a Python module against the stand-in NVRTC of
    tests/stub_nvrtc; returns the directory that holds it. Skips without a C++ compiler."""
    import shutil
    import sysconfig

    from torch.utils import cpp_extension

    from bagf_torch.jit import extension

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler (c++ or g++) on PATH")
    if not sys.platform.startswith("linux"):
        pytest.skip("builds a Python module with Linux's linker flags")
    if not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("this Python has no C headers (Python.h): a module cannot be built")
    stub = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub_nvrtc")
    module = tmp_path / "module.cpp"
    module.write_text('#include "nvrtc_compile.h"\n'
                      "PYBIND11_MODULE(bagf_nvrtc_stub, m) {\n"
                      '  m.def("nvrtc_compile", &bagf_host::nvrtc_compile);\n'
                      '  m.def("nvrtc_returned", &bagf_host::nvrtc_returned);\n'
                      "}\n")
    out = tmp_path / ("bagf_nvrtc_stub" + sysconfig.get_config_var("EXT_SUFFIX"))
    includes = [f"-I{p}" for p in (str(extension.csrc_dir()), stub, sysconfig.get_paths()["include"],
                                   *cpp_extension.include_paths())]
    built = subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", *includes, str(module),
                            os.path.join(stub, "nvrtc_stub.cpp"), "-o", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    return str(tmp_path)


def test_nvrtc_compiles_that_end_during_shutdown_do_not_abort_the_process(tmp_path):
    """The extension's NVRTC entry point (csrc/nvrtc_compile.h) on daemon threads that return while the interpreter
    finalizes: they must not take the GIL back through an RAII guard (which aborted the process). Built here against a
    stand-in NVRTC whose compiles take 1.5 s; the child's shutdown is kept going (an object of a module that is torn
    down sleeps in its destructor) until every compile has returned."""
    where = _build_stub_nvrtc_module(tmp_path)
    child = textwrap.dedent(f"""
        import functools, sys, threading, time
        sys.path.insert(0, {where!r})
        import bagf_nvrtc_stub as ext
        for _ in range(4):
            threading.Thread(target=functools.partial(ext.nvrtc_compile, "src", "k1;k2", ["-x"]), daemon=True).start()
        time.sleep(0.2)
        print("returned before exit", ext.nvrtc_returned()[0], flush=True)
    """) + fh.teardown_waiter("ext.nvrtc_returned", "4", 20) + "\nsys.exit(3)\n"
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert "terminate called" not in res.stderr, res.stderr[-2000:]
    assert res.returncode == 3, (res.returncode, res.stderr[-2000:])
    assert "returned before exit 0" in res.stdout, res.stdout
    # every compile returned while the interpreter was finalizing, and parked there
    assert fh.teardown_counts(res.stderr) == (4, 4, 4), res.stderr

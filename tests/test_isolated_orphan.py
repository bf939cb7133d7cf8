"""The isolated worker (bagf_torch.tuning.isolated) dies with its parent, even while it is busy.

A worker left behind by a killed parent would keep running (re-parented to init) and, blocked on a spinning
candidate kernel, hold the GPU until someone kills it by hand. Each test starts a real worker through
WorkerPool, from a harness process (tests/fault_helpers.py: orphan_parent) that makes the worker block in a
never-ending check, SIGKILLs the harness and waits for the worker to be gone. CPU only: the backends are fakes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bagf_torch.tuning import isolated

TESTS = os.path.dirname(os.path.abspath(__file__))
START_S = 120.0  # harness start + worker spawn, each importing torch, on a loaded 2-core CI machine
GONE_S = 5.0

posix_only = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL of the parent is a POSIX test")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by whoever adopted it) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def _kill_parent_while_busy(tmp_path, backend: str, start_from: str = "main") -> dict:
    """Run orphan_parent, wait until its worker is blocked, SIGKILL the harness; return its status and
    whether the worker was gone within GONE_S."""
    busy, status = tmp_path / "busy", tmp_path / "status.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env["BAGF_TEST_BUSY_FILE"] = str(busy)
    harness = subprocess.Popen(
        [sys.executable, "-c", "import sys, fault_helpers; fault_helpers.orphan_parent(*sys.argv[1:])",
         backend, start_from, str(status)], env=env, cwd=TESTS)
    worker = None
    try:
        ready = _wait_for(lambda: busy.exists() or harness.poll() is not None, START_S)
        assert ready and harness.poll() is None, f"the harness exited ({harness.returncode}) before its worker was busy"
        worker = int(busy.read_text())
        result = json.loads(status.read_text())
        assert result["worker"] == worker
        harness.send_signal(signal.SIGKILL)
        harness.wait(10)
        result["gone"] = _wait_for(lambda: not _alive(worker), GONE_S)
        return result
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(10)
        if worker is not None and _alive(worker):  # an orphan this test made: do not leave it behind
            os.kill(worker, signal.SIGKILL)


@linux_only
def test_busy_worker_holding_the_gil_dies_with_its_parent(tmp_path):
    """Blocked in C with the GIL held, no Python code of the worker runs: the kernel's death signal ends it."""
    result = _kill_parent_while_busy(tmp_path, "fault_helpers:busy_backend_holding_gil")
    assert result["good"] is None and result["crashes"] == 0
    assert result["gone"], "the worker outlived its SIGKILLed parent"


@posix_only
def test_watchdog_alone_ends_a_busy_orphan(tmp_path):
    """Without the death signal (cleared by the backend, as where there is none), the watchdog thread ends
    the worker while its main thread waits in a call that releases the GIL (a stream wait on a spinning
    kernel)."""
    result = _kill_parent_while_busy(tmp_path, "fault_helpers:busy_backend_watchdog_only")
    assert result["good"] is None and result["crashes"] == 0
    assert result["gone"], "the worker's watchdog did not end it after its parent died"


@linux_only
def test_worker_started_by_a_short_lived_thread_outlives_the_thread_not_the_process(tmp_path):
    """PR_SET_PDEATHSIG fires when the *thread* that forked the worker ends. A pool may be first used from a
    thread that then ends (a user's thread; the background tuner): the worker must go on serving the
    process after that thread is gone, and still die with the process."""
    result = _kill_parent_while_busy(tmp_path, "fault_helpers:busy_backend_holding_gil", start_from="thread")
    assert result["good"] is None, "the worker died with the thread that started it"
    assert (result["crashes"], result["restarts"]) == (0, 0)
    assert result["gone"], "the worker outlived its SIGKILLed parent"


def test_worker_exits_at_once_if_its_parent_died_before_it_armed_the_signal():
    """The parent can die between the worker's start and its prctl call; then no signal will ever come, so
    the worker compares getppid() with the parent it was started by and exits."""
    code = ("import os, sys; from bagf_torch.tuning import isolated; "
            "isolated._die_with_parent(os.getpid()); print('survived'); sys.exit(0)")  # never its own parent
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == isolated.ORPHAN_EXIT, done.stderr
    assert "survived" not in done.stdout

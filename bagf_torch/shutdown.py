"""bagf_torch's daemon threads that run torch or extension code are finished before the interpreter shuts down.

CPython before 3.14 ends a daemon thread that takes the GIL back during finalization with ``pthread_exit`` (3.14
blocks it instead). A thread inside a C++ call that gave the GIL away with an RAII guard (pybind11's
``gil_scoped_release``, which torch's bindings of most ops use) is then unwound through that guard's noexcept
destructor, and ``std::terminate`` aborts the whole process: SIGABRT at the end of a script whose work was done.
bagf_torch runs such code on daemon threads that may outlive their use: a search step the tuner stopped waiting for
at its deadline (Ax fitting its model: it ends by itself once the step returns), a background tuning
(``BAGF_BACKGROUND=1``: the tuning in progress finishes and is stored, no other starts, a wait for another process's
claim ends at once), Ax's import started ahead of the first tuning. They are registered here (:func:`track`), and an
atexit handler, which runs before finalization begins, asks each to stop where it can and waits for them, at most
``EXIT_WAIT_S`` in all; a thread still running then (a tuning with a longer budget) is left to the interpreter. The
NVRTC compiles of ``jit.compiler``'s pool need no wait: the extension gives the GIL back by hand and parks a compile
that returns during finalization (csrc/nvrtc_compile.h).

``python -m bagf_torch`` and the ``bagf-torch`` command end by ``os._exit`` (``cli.run``): no finalization, nothing
of this runs.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Callable

from . import log

EXIT_WAIT_S = 30.0
"""The longest the interpreter's exit waits for the tracked threads, in all: a search step takes 0.4 s on average
(an Ax step on the H200's host), a background tuning up to its time budget (6 s by default)."""

QUIET_WAIT_S = 1.0
"""How long the exit waits before it says so (a warning naming the threads)."""

_lock = threading.Lock()
_tracked: list[tuple[threading.Thread, Callable[[], None] | None]] = []


def track(thread: threading.Thread, stop: Callable[[], None] | None = None) -> None:
    """Finish ``thread`` before the interpreter shuts down: at exit ``stop()`` (a request to end soon, e.g. no next
    job) is called, then the thread is waited for. Threads that have ended are dropped as others are tracked."""
    with _lock:
        _tracked[:] = [(t, s) for t, s in _tracked if t.is_alive()]
        _tracked.append((thread, stop))


def wait_for_tracked(timeout: float = EXIT_WAIT_S) -> list[threading.Thread]:
    """Ask every tracked thread to stop and wait for them, ``timeout`` seconds in all; returns those still running."""
    with _lock:
        tracked = [(t, s) for t, s in _tracked if t.is_alive()]
    for _, stop in tracked:
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - a failed request still leaves the wait below
                pass
    start = time.monotonic()
    deadline = start + timeout
    for thread, _ in tracked:
        thread.join(max(0.0, min(deadline, start + QUIET_WAIT_S) - time.monotonic()))
    running = [t for t, _ in tracked if t.is_alive()]
    if running and timeout > QUIET_WAIT_S:
        log.logger().warning(f"waiting up to {timeout:g} s for {', '.join(t.name for t in running)} to end before "
                             "the interpreter shuts down (a thread inside torch then would abort the process)")
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
        running = [t for t in running if t.is_alive()]
    if running:
        log.logger().warning(f"{', '.join(t.name for t in running)} still running {timeout:g} s after the program's "
                             "end; the interpreter shuts down anyway")
    return running


atexit.register(wait_for_tracked)

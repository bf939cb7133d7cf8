"""The on-disk cache: round trips, concurrency between processes and threads, crashes, damaged files,
unwritable directories, export/import. CPU only; each test gets its own directory (``cache_dir``)."""

from __future__ import annotations

import base64
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bagf_torch import cache as cache_mod
from bagf_torch.cache import CACHE_FILENAME, SCHEMA_VERSION, Cache, default_cache_path

ENV = {"gpu": "NVIDIA H200", "cc": "9.0", "cuda": "13.0", "torch": "2.11", "bagf": "0.1", "src": "abc"}
# A problem as ConvProblem.as_dict() writes it, and implicit_gemm's default configuration: every row is checked
# against the cache schema (cache_schema), so the fixtures are real ones.
PROBLEM = {"n": 1, "c": 3, "h": 224, "w": 224, "k": 64, "r": 11, "s": 11, "stride": [4, 4], "padding": [2, 2],
           "dilation": [1, 1], "groups": 1, "bias": True, "dtype": "float32", "layout": "nchw", "tf32": False}
IG = {"BM": 64, "BN": 64, "BK": 8, "TM": 4, "TN": 4, "DB": 1, "VEC": 4}


def plan_kwargs(**overrides):
    kwargs = dict(problem=PROBLEM, env=ENV, family="implicit_gemm", config=dict(IG),
                  time_us=12.5, aten_us=20.0, default_us=30.0, evaluations=40, tune_seconds=3.5)
    kwargs.update(overrides)
    return kwargs


def trial(i, status="ok"):
    return {"family": "implicit_gemm", "config": {"bm": 64, "i": i}, "status": status,
            "time_us": 10.0 + i if status == "ok" else None, "detail": "" if status == "ok" else "ptxas: too many"}


# ---- round trips -----------------------------------------------------------------------------------


def test_round_trip_survives_reopening(cache_dir, warnings_log):
    path = default_cache_path(cache_dir)
    with Cache(path) as cache:
        assert not cache.in_memory and cache.path == path
        assert cache.put_plan("k1", **plan_kwargs(cubin_digests=["d1"]))
        assert cache.put_plan("k2", **plan_kwargs(family="aten", config=None, default_us=None))
        cache.add_trials("k1", [trial(0), trial(1, "resources")])
        cache.add_trials("k1", [trial(2)])
        cache.put_cubin("d1", "implicit_gemm_bm64", "_ZN4bagf3igemm", b"\x7fELF\x00\x01")

    with Cache(path) as cache:
        plan = cache.get_plan("k1")
        assert plan["problem"] == PROBLEM and plan["env"] == ENV
        assert plan["family"] == "implicit_gemm" and plan["config"] == IG
        assert (plan["time_us"], plan["aten_us"], plan["default_us"]) == (12.5, 20.0, 30.0)
        assert (plan["evaluations"], plan["tune_seconds"], plan["cubin_digests"]) == (40, 3.5, ["d1"])
        aten = cache.get_plan("k2")
        assert aten["family"] == "aten" and aten["config"] is None and aten["default_us"] is None
        assert cache.get_plan("nope") is None
        assert [p["key"] for p in cache.plans()] == ["k1", "k2"]

        stored = cache.trials("k1")
        assert [t["config"]["i"] for t in stored] == [0, 1, 2]
        assert stored[1]["status"] == "resources" and stored[1]["time_us"] is None
        assert stored[1]["detail"] == "ptxas: too many"
        assert all(isinstance(t["created"], float) for t in stored)
        assert cache.trials("k2") == []

        assert cache.get_cubin("d1") == (b"\x7fELF\x00\x01", "_ZN4bagf3igemm")
        cache.put_cubin("d1", "implicit_gemm_bm64", "_ZN4bagf3igemm", b"\x7fELF\x00\x01")  # idempotent
        assert cache.get_cubin("missing") is None
    assert warnings_log == []


def test_json_is_canonical_so_equal_dicts_match(cache_dir):
    with Cache.for_dir(cache_dir) as cache:
        cache.put_plan("k", **plan_kwargs(config=dict(reversed(IG.items()))))
        raw = sqlite3.connect(cache_dir / CACHE_FILENAME).execute("SELECT config FROM plans").fetchone()[0]
        assert raw == '{"BK":8,"BM":64,"BN":64,"DB":1,"TM":4,"TN":4,"VEC":4}'


def test_in_memory_cache_touches_no_file(cache_dir):
    with Cache(None) as cache:
        assert cache.in_memory and cache.path is None and cache.fallback_reason is None
        assert cache.put_plan("k", **plan_kwargs())
        cache.add_trials("k", [trial(0)])
        assert cache.get_plan("k")["config"]["BM"] == 64 and len(cache.trials("k")) == 1
    assert list(cache_dir.iterdir()) == []


def test_clear_and_close(cache_dir):
    cache = Cache.for_dir(cache_dir)
    cache.put_plan("k", **plan_kwargs())
    cache.add_trials("k", [trial(0)])
    cache.put_cubin("d", "n", "ln", b"x")
    for i in range(40):  # (4 MB of cubins)
        cache.put_cubin(f"big{i}", "n", "ln", os.urandom(100_000))
    full = cache.path.stat().st_size
    cache.clear()
    assert cache.plans() == [] and cache.trials("k") == [] and cache.get_cubin("d") is None
    assert cache.path.stat().st_size < full / 10  # the file gave the space back
    cache.close()
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.get_plan("k")


def test_bad_arguments_are_refused_with_the_reason(cache_dir):
    with Cache(None) as cache:
        with pytest.raises(ValueError, match="only family 'aten'"):
            cache.put_plan("k", **plan_kwargs(config=None))
        with pytest.raises(ValueError, match="time_us: must be finite"):
            cache.put_plan("k", **plan_kwargs(time_us=float("nan")))
        with pytest.raises(ValueError, match="config.BM: 7 is not one of implicit_gemm's"):
            cache.put_plan("k", **plan_kwargs(config=dict(IG, BM=7)))
        with pytest.raises(ValueError, match="problem.stride: must be in"):
            cache.put_plan("k", **plan_kwargs(problem=dict(PROBLEM, stride=[0, 0])))
        with pytest.raises(ValueError, match="lacks 'status'"):
            cache.add_trials("k", [{"family": "x", "config": None}])
        with pytest.raises(TypeError, match="cannot store"):
            cache.put_plan("k", **plan_kwargs(config={"f": object()}))
        assert cache.plans() == [] and cache.trials("k") == []


# ---- one winner per key ----------------------------------------------------------------------------


def test_put_plan_first_writer_wins(cache_dir):
    path = default_cache_path(cache_dir)
    with Cache(path) as first, Cache(path) as second:
        assert first.put_plan("k", **plan_kwargs(evaluations=1))
        assert not second.put_plan("k", **plan_kwargs(evaluations=2, time_us=1.0))
        assert not first.put_plan("k", **plan_kwargs(family="aten", config=None))
        assert second.get_plan("k")["evaluations"] == 1
        assert len(first.plans()) == 1


def test_threads_share_one_cache(cache_dir):
    cache = Cache.for_dir(cache_dir)
    wins = []
    errors = []

    def work(t):
        try:
            for k in range(10):
                cache.add_trials(f"k{k}", [trial(t * 100 + i) for i in range(5)])
                if cache.put_plan(f"k{k}", **plan_kwargs(evaluations=t)):
                    wins.append(k)
                assert cache.get_plan(f"k{k}") is not None
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sorted(wins) == list(range(10))
    assert all(len(cache.trials(f"k{k}")) == 8 * 5 for k in range(10))
    cache.close()


# ---- several processes -----------------------------------------------------------------------------
#
# Children are started with multiprocessing's spawn context, running code that imports only
# bagf_torch/cache.py (stdlib only, which this also checks): importing the package pulls in torch, 2.5 s per
# process, and 8 children doing that at once on a 2-core runner turned a 1 s test into 19 s.

_CHILD_PRELUDE = f"""
import sys, types
if "bagf_torch" not in sys.modules:  # the bare package, without its __init__ (which imports torch)
    package = types.ModuleType("bagf_torch")
    package.__path__ = [{str(Path(cache_mod.__file__).parent)!r}]
    sys.modules["bagf_torch"] = package
from bagf_torch.cache import Cache
assert "torch" not in sys.modules
ENV = {ENV!r}
PROBLEM = {PROBLEM!r}
def trial(i):
    return {{"family": "implicit_gemm", "config": {{"i": i}}, "status": "ok", "time_us": 1.0, "detail": ""}}
def plan_kwargs(who):  # family "aten": checking a family's configuration would import the kernels (torch)
    return dict(problem=PROBLEM, env=ENV, family="aten", config=None, time_us=12.5, aten_us=20.0,
                default_us=30.0, evaluations=who, tune_seconds=3.5)
"""


def _spawn(ctx, code: str, **names):
    """A spawned process running ``code`` (after the prelude) with ``names`` as globals."""
    return ctx.Process(target=exec, args=(_CHILD_PRELUDE + code, dict(names)), daemon=True)


KEYS = 6
TRIALS_PER_KEY = 15

# For each key: record trials one at a time (many small transactions, to interleave with the other
# writers), store a shared cubin, then try to store a plan. Reports the keys this worker won.
_WRITER = f"""
start.wait()
won = []
with Cache(path) as cache:
    assert not cache.in_memory, cache.fallback_reason
    for k in range({KEYS}):
        for i in range({TRIALS_PER_KEY}):
            cache.add_trials(f"k{{k}}", [trial(worker * 1000 + i)])
        cache.put_cubin(f"shared{{k}}", "n", "ln", b"same for everyone")
        if cache.put_plan(f"k{{k}}", **plan_kwargs(worker)):
            won.append(f"k{{k}}")
        assert cache.get_plan(f"k{{k}}") is not None
results.put((worker, won))
"""


@pytest.mark.parametrize("workers", [2, 8])
def test_processes_write_concurrently(cache_dir, workers, warnings_log):
    path = str(default_cache_path(cache_dir))
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(workers)  # all open and write at the same moment, not one after another
    results = ctx.Queue()
    children = [_spawn(ctx, _WRITER, path=path, worker=w, start=start, results=results) for w in range(workers)]
    for child in children:
        child.start()
    won = dict(results.get(timeout=120) for _ in children)
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0

    winners = sorted(key for keys in won.values() for key in keys)
    assert winners == [f"k{k}" for k in range(KEYS)]  # exactly one winner per key
    with Cache(path) as cache:
        assert len(cache.plans()) == KEYS
        for k in range(KEYS):
            stored = cache.trials(f"k{k}")
            assert len(stored) == workers * TRIALS_PER_KEY  # no lost trials
            assert sorted(t["config"]["i"] for t in stored) == sorted(
                w * 1000 + i for w in range(workers) for i in range(TRIALS_PER_KEY))
            winner = next(w for w, keys in won.items() if f"k{k}" in keys)
            assert cache.get_plan(f"k{k}")["evaluations"] == winner
            assert cache.get_cubin(f"shared{k}") == (b"same for everyone", "ln")
    assert warnings_log == []


_WRITE_UNTIL_KILLED = """
import os
with Cache(path) as cache:
    i = 0
    while True:
        cache.add_trials("k", [trial(i), trial(i + 1)])
        cache.put_plan(f"k{i}", **plan_kwargs(i))
        cache.put_cubin(f"d{i}", "n", "ln", os.urandom(4096))
        i += 2
        committed.value = i  # after the transactions returned: these rows are on disk
"""


def test_kill_9_mid_write_keeps_committed_rows(cache_dir, warnings_log):
    path = str(default_cache_path(cache_dir))
    ctx = multiprocessing.get_context("spawn")
    committed = ctx.Value("i", 0)
    child = _spawn(ctx, _WRITE_UNTIL_KILLED, path=path, committed=committed)
    child.start()
    deadline = time.monotonic() + 60
    while committed.value < 200 and time.monotonic() < deadline and child.is_alive():
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL
    done = committed.value
    assert done >= 200, "the writer did not get going"

    with Cache(path) as cache:
        assert not cache.in_memory
        assert len(cache.trials("k")) >= done
        assert len(cache.plans()) >= done // 2
        assert cache.get_cubin(f"d{done - 2}") is not None
        assert cache.put_plan("after", **plan_kwargs())  # and it still takes writes
    assert warnings_log == []


_FORKER = """
import os
c = Cache(path)
c.get_plan("parent")
pid = os.fork()
if pid == 0:
    ok = c.get_plan("parent") is not None and c.put_plan("child", **plan_kwargs(0))
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert c.get_plan("child") is not None
c.put_plan("parent2", **plan_kwargs(0))
c.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_forked_child_uses_its_own_connection(cache_dir):
    # Forking happens in a spawned process, not in pytest itself (forking a process with threads is unsafe).
    with Cache.for_dir(cache_dir) as cache:
        cache.put_plan("parent", **plan_kwargs())
        ctx = multiprocessing.get_context("spawn")
        child = _spawn(ctx, _FORKER, path=str(cache.path))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert {p["key"] for p in cache.plans()} == {"parent", "child", "parent2"}


# ---- the WAL at rest --------------------------------------------------------------------------------
#
# SQLite cannot tell which database a -wal file belongs to: a cache file copied over one whose -wal still
# holds committed frames reads as the old file's pages laid over the new one. So no write leaves
# committed frames in the WAL once it has returned (Cache._write checkpoints), and copying a cache at rest
# over another is safe.


def _wal_size(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


_WRITE_THEN_HANG = """
import time
cache = Cache(path)  # never closed: killed below, so its -wal and -shm stay where they are
for i in range(20):
    cache.put_plan(f"x{i}", **plan_kwargs(i))
    cache.add_trials(f"x{i}", [trial(i)])
written.set()
time.sleep(600)
"""


@pytest.mark.parametrize("writer", ["open", "killed"])
def test_a_cache_copied_over_a_writers_file_reads_as_the_copy(cache_dir, warnings_log, writer):
    path = default_cache_path(cache_dir)
    live = None
    if writer == "open":  # X's writer is still running, its connection open
        live = Cache(path)
        for i in range(20):
            live.put_plan(f"x{i}", **plan_kwargs(evaluations=i))
            live.add_trials(f"x{i}", [trial(i)])
    else:  # X's writer was killed with -9 after its writes returned
        ctx = multiprocessing.get_context("spawn")
        written = ctx.Event()
        child = _spawn(ctx, _WRITE_THEN_HANG, path=str(path), written=written)
        child.start()
        assert written.wait(60), "the writer did not get going"
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    try:
        with Cache(cache_dir / "y" / CACHE_FILENAME) as other:  # Y: another valid cache with its own plans
            other.put_plan("y0", **plan_kwargs(evaluations=100))
            other.put_plan("y1", **plan_kwargs(evaluations=101))
        shutil.copyfile(cache_dir / "y" / CACHE_FILENAME, path)
        assert path.with_name(path.name + "-wal").exists()  # X's -wal is left in place

        with Cache(path) as fresh:
            assert not fresh.in_memory
            assert {p["key"]: p["evaluations"] for p in fresh.plans()} == {"y0": 100, "y1": 101}
            assert fresh.trials("x0") == []
    finally:
        if live is not None:
            live.close()
    assert warnings_log == []


def test_the_wal_is_empty_at_rest_after_every_kind_of_write(cache_dir, tmp_path):
    path = default_cache_path(cache_dir)
    with Cache(cache_dir / "source.sqlite") as source:
        source.put_plan(_key(), **plan_kwargs(family="aten", config=None))
        source.export(tmp_path / "export.json")
    with Cache(path) as cache:
        assert _wal_size(path) == 0  # creating the tables is a write too
        writes = [
            lambda: cache.put_plan("k", **plan_kwargs()),
            lambda: cache.add_trials("k", [trial(0), trial(1)]),
            lambda: cache.put_cubin("d", "n", "ln", os.urandom(100_000)),
            lambda: cache.claim("k", "me", 60.0),
            lambda: cache.heartbeat("k", "me", 60.0),
            lambda: cache.release("k", "me"),
            lambda: cache.import_(tmp_path / "export.json", env=ENV),
            lambda: cache.clear(),
        ]
        for write in writes:
            write()
            assert _wal_size(path) == 0
        assert cache.plans() == []


def test_a_checkpoint_blocked_by_a_reader_neither_waits_nor_loses_the_write(cache_dir, warnings_log):
    path = default_cache_path(cache_dir)
    with Cache(path) as cache:
        cache.put_plan("before", **plan_kwargs())
        # Another program's connection: its commit stays in the WAL (it does not checkpoint), and a read
        # transaction begun after it reads that frame, so a checkpoint cannot reset the WAL under it.
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("INSERT INTO claims (key, owner, expires) VALUES ('x', 'someone', 0)")
        reader = sqlite3.connect(path, isolation_level=None)
        reader.execute("BEGIN")
        assert reader.execute("SELECT COUNT(*) FROM claims").fetchone() == (1,)
        start = time.monotonic()
        assert cache.put_plan("during", **plan_kwargs())  # no exception...
        assert time.monotonic() - start < 5  # ...and no wait of BUSY_TIMEOUT_MS for the reader
        assert _wal_size(path) > 0  # the frames stay until a checkpoint can finish
        reader.execute("COMMIT")
        cache.add_trials("during", [trial(0)])  # the next write's checkpoint catches up
        assert _wal_size(path) == 0
        reader.close()
        other.close()
    with Cache(path) as reopened:
        assert {p["key"] for p in reopened.plans()} == {"before", "during"}
        assert len(reopened.trials("during")) == 1
    assert warnings_log == []


class _CheckpointFails:
    """A connection whose checkpoints fail with ``error`` (say an I/O error writing the database file);
    everything else goes to the real connection."""

    def __init__(self, conn, error):
        self.conn = conn
        self.error = error

    def execute(self, sql, *args):
        if "wal_checkpoint" in sql:
            raise self.error
        return self.conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_a_failed_checkpoint_keeps_the_committed_write_in_the_file(cache_dir, warnings_log):
    path = default_cache_path(cache_dir)
    with Cache(path) as cache:
        real = cache._conn
        cache._conn = _CheckpointFails(real, sqlite3.OperationalError("disk I/O error"))
        assert cache.put_plan("k", **plan_kwargs())  # stored once, in the file: not redone in memory
        cache.add_trials("k", [trial(0)])
        assert not cache.in_memory and len(cache.trials("k")) == 1
        cache._conn = real
    assert len(warnings_log) == 1 and "disk I/O error" in warnings_log[0].getMessage()
    with Cache(path) as reopened:
        assert reopened.get_plan("k") is not None and len(reopened.trials("k")) == 1


# ---- damaged files ---------------------------------------------------------------------------------


def _make_full_cache(path: Path) -> None:
    with Cache(path) as cache:
        for i in range(50):
            cache.put_cubin(f"d{i}", "n", "ln", os.urandom(8192))
            cache.put_plan(f"k{i}", **plan_kwargs())


def _truncate(path: Path) -> None:
    _make_full_cache(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _scribble_middle(path: Path) -> None:
    """Damage inside the file (a page of cubin data overwritten): the header and the tables still read, so
    only the whole-file check on open (PRAGMA quick_check) notices, before a lookup hits the damage."""
    _make_full_cache(path)
    pages = path.stat().st_size // 4096
    with open(path, "r+b") as f:
        f.seek(pages // 2 * 4096)
        f.write(bytes(range(256)) * 16)  # an overflow page now points to page 66051, past the end


def _garbage(path: Path) -> None:
    path.write_bytes(b"this is not a database, it is a text file someone wrote here\n" * 100)


def _garbage_header(path: Path) -> None:
    _make_full_cache(path)
    with open(path, "r+b") as f:
        f.write(os.urandom(100))


@pytest.mark.parametrize("damage", [_truncate, _scribble_middle, _garbage, _garbage_header])
def test_damaged_file_is_moved_aside_with_one_warning(cache_dir, warnings_log, damage):
    path = default_cache_path(cache_dir)
    damage(path)
    with Cache(path) as cache:
        assert not cache.in_memory
        assert cache.plans() == []
        assert cache.put_plan("k", **plan_kwargs())
    aside = list(cache_dir.glob(f"{CACHE_FILENAME}.corrupt-*"))
    assert len(aside) == 1
    assert len(warnings_log) == 1
    message = warnings_log[0].getMessage()
    assert str(path) in message and str(aside[0]) in message
    with Cache(path) as cache:  # the fresh file is sound
        assert cache.get_plan("k") is not None
    assert len(warnings_log) == 1


class _FailingConnection:
    """Stands in for a connection whose file went bad after opening (SQLite caches pages, so damaging the
    file under an open cache does not reliably reach it); everything else about the cache is real."""

    def __init__(self, error):
        self.error = error

    def execute(self, *args):
        raise self.error

    def backup(self, target):
        raise self.error

    def close(self):
        pass


@pytest.mark.parametrize("error", [sqlite3.DatabaseError("database disk image is malformed"),
                                   sqlite3.OperationalError("disk I/O error")])
def test_read_failure_after_opening_falls_back_to_memory(cache_dir, warnings_log, error):
    path = default_cache_path(cache_dir)
    with Cache(path) as cache:
        cache.put_plan("k", **plan_kwargs())
        real = cache._conn
        cache._conn = _FailingConnection(error)
        try:
            assert cache.get_plan("k") is None  # no exception: reported absent, tuning goes on
            assert cache.in_memory and str(error) in cache.fallback_reason
            assert cache.put_plan("k", **plan_kwargs()) and cache.get_plan("k") is not None
        finally:
            real.close()
    assert len(warnings_log) == 1 and str(path) in warnings_log[0].getMessage()


def test_damaged_cubin_is_dropped_and_can_be_stored_again(cache_dir, warnings_log):
    path = default_cache_path(cache_dir)
    with Cache(path) as cache:
        cache.put_cubin("d", "n", "ln", b"\x7fELF good")
        with sqlite3.connect(path) as raw:  # silent damage inside a page: SQLite itself cannot tell
            raw.execute("UPDATE cubins SET cubin = ? WHERE digest = 'd'", (b"\x7fELF gooe",))
        assert cache.get_cubin("d") is None
        assert len(warnings_log) == 1 and "sha256" in warnings_log[0].getMessage()
        cache.put_cubin("d", "n", "ln", b"\x7fELF good")  # the compiler's next result is kept
        assert cache.get_cubin("d") == (b"\x7fELF good", "ln")


def test_damaged_plan_is_dropped_and_can_be_stored_again(cache_dir, warnings_log):
    path = default_cache_path(cache_dir)
    with Cache(path) as cache:
        cache.put_plan("k", **plan_kwargs())
        cache.put_plan("other", **plan_kwargs())
        with sqlite3.connect(path) as raw:
            raw.execute("UPDATE plans SET config = '{\"bm\": 6' WHERE key = 'k'")
        assert [p["key"] for p in cache.plans()] == ["other"]
        assert cache.get_plan("k") is None
        assert len(warnings_log) == 1 and "plan k is damaged" in warnings_log[0].getMessage()
        assert cache.put_plan("k", **plan_kwargs())


def test_schema_version_mismatch_is_moved_aside(cache_dir, warnings_log):
    path = default_cache_path(cache_dir)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE plans (key TEXT PRIMARY KEY, whatever TEXT)")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with Cache(path) as cache:
        assert not cache.in_memory and cache.plans() == []
        assert cache.put_plan("k", **plan_kwargs())
    assert len(list(cache_dir.glob(f"{CACHE_FILENAME}.schema-v{SCHEMA_VERSION + 1}-*"))) == 1
    assert len(warnings_log) == 1 and f"schema version {SCHEMA_VERSION + 1}" in warnings_log[0].getMessage()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_someone_elses_sqlite_file_is_moved_aside(cache_dir, warnings_log):
    path = default_cache_path(cache_dir)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (t TEXT)")
    conn.commit()
    conn.close()
    with Cache(path) as cache:
        assert not cache.in_memory
    assert len(warnings_log) == 1 and "not a bagf_torch cache" in warnings_log[0].getMessage()
    assert len(list(cache_dir.glob(f"{CACHE_FILENAME}.schema-v0-*"))) == 1


# ---- unwritable places and failed writes -----------------------------------------------------------


def test_directories_are_created_on_open_not_on_import(cache_dir):
    # Importing in a fresh interpreter whose home, cache home and working directory are an empty folder:
    # nothing may appear there. Opening then creates the missing parents.
    home = cache_dir / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / "xdg"))
    subprocess.run([sys.executable, "-c", _CHILD_PRELUDE], env=env, cwd=home, check=True, timeout=60)
    assert list(home.iterdir()) == []

    target = cache_dir / "a" / "b"
    with Cache.for_dir(target) as cache:
        assert not cache.in_memory and (target / CACHE_FILENAME).is_file()


def test_directory_that_cannot_be_created_falls_back_to_memory(cache_dir, warnings_log):
    blocker = cache_dir / "a_file"
    blocker.write_text("not a directory")
    with Cache.for_dir(blocker / "sub") as cache:
        assert cache.in_memory and "a_file" in cache.fallback_reason
        assert cache.path == blocker / "sub" / CACHE_FILENAME
        assert cache.put_plan("k", **plan_kwargs())  # tuning goes on
        cache.add_trials("k", [trial(0)])
        assert cache.get_plan("k") is not None and len(cache.trials("k")) == 1
    assert len(warnings_log) == 1 and "in-memory" in warnings_log[0].getMessage()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root ignores directory permissions, so a read-only directory cannot be made")
def test_read_only_directory_falls_back_to_memory(cache_dir, warnings_log):
    ro = cache_dir / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with Cache.for_dir(ro) as cache:
            assert cache.in_memory
            assert cache.put_plan("k", **plan_kwargs())
    finally:
        ro.chmod(0o755)
    assert len(warnings_log) == 1 and str(ro) in warnings_log[0].getMessage()
    assert list(ro.iterdir()) == []


def test_read_only_directory_keeps_a_warm_cache_readable(cache_dir, warnings_log, monkeypatch):
    path = default_cache_path(cache_dir)
    with Cache(path) as cache:
        cache.put_plan("warm", **plan_kwargs())
        cache.put_cubin("d", "n", "ln", b"cubin")

    # What a read-only directory does first, whoever we run as: creating the lock file fails.
    def refuse(p):
        raise PermissionError(13, "Permission denied", str(p) + ".lock")

    monkeypatch.setattr(cache_mod, "_open_lock", refuse)
    with Cache(path) as cache:
        assert cache.in_memory and "Permission denied" in cache.fallback_reason
        assert cache.get_plan("warm") is not None and cache.get_cubin("d") == (b"cubin", "ln")
        assert cache.put_plan("new", **plan_kwargs())
    assert len(warnings_log) == 1 and "copy of its contents" in warnings_log[0].getMessage()
    monkeypatch.undo()
    with Cache(path) as cache:
        assert cache.get_plan("new") is None  # the file was not written


def test_failed_write_falls_back_to_memory_and_keeps_going(cache_dir, warnings_log):
    path = default_cache_path(cache_dir)
    cache = Cache(path)
    cache.put_plan("before", **plan_kwargs())
    # Disk full, as SQLite reports it: cap the file at its current size.
    pages = cache._conn.execute("PRAGMA page_count").fetchone()[0]
    cache._conn.execute(f"PRAGMA max_page_count = {pages}")
    cache.put_cubin("big", "n", "ln", os.urandom(1 << 20))  # does not fit: SQLITE_FULL
    assert cache.in_memory and "full" in cache.fallback_reason
    assert cache.get_cubin("big") is not None  # the failed write was redone in memory
    assert cache.get_plan("before") is not None  # what the file held was carried over
    assert cache.put_plan("after", **plan_kwargs())
    cache.add_trials("after", [trial(0)])
    assert len(warnings_log) == 1 and str(path) in warnings_log[0].getMessage()
    cache.close()
    with Cache(path) as reopened:  # the file is intact, holding what was committed before the failure
        assert reopened.get_plan("before") is not None and reopened.get_cubin("big") is None


# ---- export / import -------------------------------------------------------------------------------


def _key(problem=PROBLEM, env=ENV):
    """The key the runtime stores a plan under (import recomputes it and refuses any other)."""
    from bagf_torch.problem import ConvProblem, fingerprint

    return fingerprint(ConvProblem.from_dict(problem), env)


def test_export_import_round_trip_with_skips_explained(cache_dir, tmp_path):
    a100 = dict(ENV, gpu="NVIDIA A100", cc="8.0")
    other = dict(PROBLEM, n=8)
    here, here_aten, already, elsewhere = _key(), _key(dict(PROBLEM, n=2)), _key(other), _key(env=a100)
    with Cache(cache_dir / "a.sqlite") as source:
        source.put_cubin("d1", "implicit_gemm_bm64", "_Z1", b"\x00\x01\xff" * 100)
        source.put_cubin("unused", "x", "_Zx", b"not exported")
        source.put_plan(here, **plan_kwargs(cubin_digests=["d1"]))
        source.put_plan(here_aten, **plan_kwargs(problem=dict(PROBLEM, n=2), family="aten", config=None))
        source.put_plan(elsewhere, **plan_kwargs(env=a100))
        source.put_plan(already, **plan_kwargs(problem=other, evaluations=1))
        source.add_trials(here, [trial(0)])
        assert source.export(tmp_path / "export.json") == 4

    document = json.loads((tmp_path / "export.json").read_text())
    assert [c["digest"] for c in document["cubins"]] == ["d1"]

    with Cache(cache_dir / "b.sqlite") as target:
        target.put_plan(already, **plan_kwargs(problem=other, evaluations=2))
        imported, skipped = target.import_(tmp_path / "export.json", env=dict(ENV))
        assert imported == 2
        with Cache(cache_dir / "a.sqlite") as source:  # the plan is the exported one, field for field...
            want = source.get_plan(here)
        got = target.get_plan(here)
        # ...except the cubin digests, which are recomputed here (this ENV names no kernel sources: none)
        assert got["cubin_digests"] == [] and dict(got, cubin_digests=["d1"]) == want
        assert target.trials(here) == []  # trials stay on the machine that tuned
        assert target.get_plan(here_aten)["family"] == "aten"
        assert target.get_cubin("d1") is None and target.get_cubin("unused") is None  # no foreign bytes stored
        assert target.get_plan(elsewhere) is None
        assert target.get_plan(already)["evaluations"] == 2
        assert sorted(skipped) == sorted([
            f"{elsewhere[:16]} (implicit_gemm): cc '8.0' != '9.0'; gpu 'NVIDIA A100' != 'NVIDIA H200'",
            f"{already[:16]} (implicit_gemm): this cache already has a plan for it (kept)",
        ])
        again = target.import_(tmp_path / "export.json", env=ENV)
        assert again[0] == 0 and len(again[1]) == 4


def test_import_refuses_what_is_not_an_export(cache_dir, tmp_path):
    with Cache(None) as cache:
        (tmp_path / "x.json").write_text("{not json")
        with pytest.raises(ValueError, match="cannot import"):
            cache.import_(tmp_path / "x.json", env=ENV)
        (tmp_path / "y.json").write_text('{"plans": []}')
        with pytest.raises(ValueError, match="not a bagf_torch cache export"):
            cache.import_(tmp_path / "y.json", env=ENV)
        for bad in ('"plans": {"a": 1}', '"plans": "abc"', '"cubins": 7'):
            (tmp_path / "z.json").write_text(f'{{"format": "bagf_torch.cache", "schema": {SCHEMA_VERSION}, {bad}}}')
            with pytest.raises(ValueError, match="must be a list"):
                cache.import_(tmp_path / "z.json", env=ENV)
        (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
        with pytest.raises(ValueError, match="nested too deeply"):
            cache.import_(tmp_path / "deep.json", env=ENV)


def test_import_explains_malformed_entries(cache_dir, tmp_path):
    with Cache(None) as source:
        source.put_plan(_key(), **plan_kwargs())
        source.export(tmp_path / "e.json")
    document = json.loads((tmp_path / "e.json").read_text())
    good = document["plans"][0]
    document["plans"] += [
        {"key": "broken", "family": "implicit_gemm"},                                   # fields missing
        dict(good, evaluations=1e30),                                                   # out of range
        dict(good, created=float("nan")),                                               # NaN timestamp
        dict(good, problem=dict(PROBLEM, stride=[0, 0])),                               # stride 0
        dict(good, config=dict(IG, BM="64")),                                           # text knob
        dict(good, key="f" * 64),                                                       # key of nothing
        good,                                                                           # the same key again
        [1, 2, 3],                                                                      # not an object
    ]
    (tmp_path / "e.json").write_text(json.dumps(document))
    with Cache(None) as target:
        imported, skipped = target.import_(tmp_path / "e.json", env=ENV)
        assert target.get_plan(_key()) is not None  # the good entry got through all the bad ones
    assert imported == 1 and len(skipped) == 8, skipped
    assert skipped[0].startswith("broken (implicit_gemm): malformed entry (problem: is missing)")
    assert "evaluations: must be in" in skipped[1]
    assert "created: must be a finite timestamp" in skipped[2]
    assert "problem.stride: must be in" in skipped[3]
    assert "config.BM: must be an integer" in skipped[4]
    assert "key does not match its problem and env" in skipped[5]
    assert "duplicate of entry 0" in skipped[6]
    assert skipped[7].startswith("entry 8: malformed entry (plan: must be an object")

"""The on-disk store of tuning results: winners (plans), every trial (failures included), and cubins.

One SQLite file (stdlib ``sqlite3``) shared by every process and thread of a machine. Why SQLite: its
transactions make a write either fully there or absent after a crash (``kill -9``, power loss), and its
locking lets several tuners write at once without a lock file of our own around each write.

How it stays safe:

- WAL journal (readers never block the writer) and ``busy_timeout`` (a writer waits for another instead
  of failing with "database is locked"). Every write is one ``BEGIN IMMEDIATE`` transaction: it takes the
  write lock up front, so two processes can never both read, then both try to upgrade, and deadlock.
- Each write is followed by a ``wal_checkpoint(TRUNCATE)``, which copies the WAL into the file and cuts the
  ``-wal`` to 0 bytes (unless another connection holds it up past ``cache_file.CHECKPOINT_WAIT_MS``: then the next
  write's checkpoint catches up). SQLite
  cannot tell which database a ``-wal`` belongs to: a cache file copied over one whose ``-wal`` still holds
  commits reads as the old file's pages laid over the copy (the old file's plans, not the copy's, in
  test_a_cache_copied_over_a_writers_file_reads_as_the_copy). A cache at rest is its file alone.
- One connection per ``Cache`` object, opened with ``check_same_thread=False`` and guarded by a lock, so
  threads may share a ``Cache``; an in-memory cache could not be shared otherwise (each connection to
  ``:memory:`` is a different database). A ``Cache`` used in a forked child opens its own connection
  (SQLite connections must not cross ``fork``).
- ``put_plan`` is ``INSERT OR IGNORE``: the first tuner to finish wins, every later one is told (returns
  False) and every process then loads the same plan.
- ``claim``/``heartbeat``/``release``: a per-key lease that tells other processes "I am tuning this one";
  the runtime makes them wait for the claimant's plan. A claim of a dead process of this host (``kill -9``)
  is void at once; one of another host lapses when its lease runs out.
- Opening is serialised between processes by an ``flock`` on ``<file>.lock`` (POSIX; no lock elsewhere),
  so that two processes that both find a damaged file do not each move the other's fresh file aside.
- On open, ``PRAGMA quick_check`` detects a truncated, garbage or damaged file; it is moved aside to
  ``<name>.corrupt-<timestamp>`` and a fresh cache is created. A file of another schema version
  (``PRAGMA user_version``), or another program's SQLite file, is moved aside to
  ``<name>.schema-v<N>-<timestamp>`` the same way, and so is a file of our version number whose tables
  are not ours (``<name>.not-bagf-<timestamp>``). Each cubin carries a sha256 checked on every read.
- Every row read is checked against one schema (``cache_schema``: types, ranges, the family's knobs); a
  row that fails is skipped with one log line naming its key and the field, and the next ``put_plan`` for
  its key replaces it. Damage SQLite cannot see, or a row another program wrote, costs a re-compile or a
  re-tune, never a crash or a garbage kernel on the GPU.
- Export and import (``cache_io``) treat an export file as input from another party: docs/cache.md is the
  trust model.
- A directory that cannot be created or written, a file that cannot be opened, or a write that fails later
  (disk full, read-only file system) makes the cache fall back to memory for the rest of the process:
  what the file held is copied in when it can still be read, and tuning goes on; results are simply not
  persisted.

Every such event is reported once, as a warning on the ``logging`` logger ``"bagf_torch"`` (not
``warnings.warn``: these are operational events about a file, not misuse of the API, and ``warnings``
would hide a repeat from the same line). Nothing happens at import: directories are created when a cache
is opened.

>>> cache = Cache(None)                       # in memory; Cache.for_dir(d) for the real one
>>> from bagf_torch.problem import ConvProblem
>>> problem = ConvProblem(n=1, c=3, h=32, w=32, k=8, r=3, s=3).as_dict()
>>> cache.put_plan("k", problem=problem, env={"gpu": "X"}, family="aten", config=None, time_us=10.0,
...                aten_us=10.0, default_us=None, evaluations=3, tune_seconds=0.5)
True
>>> cache.get_plan("k")["family"]
'aten'
>>> cache.close()
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from .cache_schema import PLAN_FIELDS, PlanRecord, SchemaError, check_cubin_row, check_trial_row

from .cache_file import (  # noqa: F401  (_create_schema: tests build a file of their own through cache._create_schema)
    _CLAIMS, SCHEMA_VERSION, _checkpoint, _connect, _create_schema, _Damaged, _is_corruption, _memory_connection,
    _move_aside, _open_file, _open_lock, _read_only_copy, _transaction)

__all__ = ["Cache", "CacheUnavailable", "CACHE_FILENAME", "SCHEMA_VERSION", "EXPORT_FORMAT", "FOREIGN_DIGEST_PREFIX",
           "default_cache_path", "owner_id"]

logger = logging.getLogger("bagf_torch")

CACHE_FILENAME = "bagf_cache.sqlite"
EXPORT_FORMAT = "bagf_torch.cache"
FOREIGN_DIGEST_PREFIX = "foreign:"
"""Cubins imported with ``--trust-cubins`` are stored under this prefix + our digest. Our compiler writes
only bare sha256 hex digests (``put_cubin`` refuses this prefix), so a foreign binary can never occupy the
name of a kernel we compile; the compiler reads the prefixed name only when it has no cubin of its own."""

SHARED_CUBIN_PREFIX = "pool_epilogue_"
"""The name prefix of cubins that no plan names and every process may load (``epilogue.FusedSequential``'s kernels, one
cubin per kernel-source version and GPU architecture): ``prune`` keeps the newest of each name."""


class CacheUnavailable(RuntimeError):
    """An operation whose whole point is the file (``clear``, ``import_``) could not change it: the cache is
    in memory (``fallback_reason`` says why). Nothing pretends to have succeeded."""


_T = TypeVar("_T")
_ABANDONED: list[sqlite3.Connection] = []  # connections inherited through fork (see Cache._locked)



_PLAN_COLUMNS = PLAN_FIELDS
_DAY_S = 86400.0


def default_cache_path(cache_dir: str | os.PathLike) -> Path:
    """The cache file inside ``cache_dir`` (the directory itself comes from ``bagf_torch.settings``).

    >>> default_cache_path("/tmp/bagf").name
    'bagf_cache.sqlite'
    """
    return Path(cache_dir).expanduser() / CACHE_FILENAME


def _dumps(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces), so equal dicts are equal text. Numpy scalars and other
    objects with ``.item()`` are stored as the Python number they hold."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_json_default)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot store {type(obj).__name__} {obj!r} in the cache: use numbers, strings, "
                    f"lists and dicts")


def _normalise(value: Any) -> Any:
    """What ``value`` reads back as after a trip through the cache (tuples become lists, and so on)."""
    return json.loads(_dumps(value))


























class Cache:
    """Tuning results on disk: plans (one winner per key), trials (every evaluated config) and cubins.

    ``path`` is the file asked for (None: in memory by request). ``in_memory`` is True when results live
    only in this process: by request, or because the file could not be used (``fallback_reason`` says
    why; one warning was logged). Safe to share between threads; any number of processes may open the
    same file. Use as a context manager or call ``close()``.

    >>> import tempfile
    >>> with Cache.for_dir(tempfile.mkdtemp()) as cache:
    ...     cache.put_cubin("ab12", "k_bm64", "_Z4k_bm64v", b"\\x7fELF")
    ...     cache.get_cubin("ab12")
    (b'\\x7fELF', '_Z4k_bm64v')
    """

    def __init__(self, path: str | os.PathLike | None):
        self.path: Path | None = None if path is None else Path(path).expanduser()
        self.fallback_reason: str | None = None
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._closed = False
        self._reported: set[str] = set()  # keys of rows already reported as failing the schema
        self._checkpoint_failed = False  # a failed checkpoint was reported (once per Cache)
        self._conn: sqlite3.Connection | None = self._open()

    @classmethod
    def for_dir(cls, directory: str | os.PathLike) -> "Cache":
        """The cache at ``<directory>/bagf_cache.sqlite`` (directory created when needed)."""
        return cls(default_cache_path(directory))

    @property
    def in_memory(self) -> bool:
        return self.path is None or self.fallback_reason is not None

    def __repr__(self) -> str:
        where = "memory" if self.path is None else str(self.path)
        if self.fallback_reason is not None:
            where += " (in memory: " + self.fallback_reason + ")"
        return f"Cache({where})"

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- opening and falling back -------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            return _memory_connection()
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _open_lock(path):
                try:
                    return _open_file(path)
                except _Damaged as damaged:
                    aside = _move_aside(path, damaged.tag)
                    logger.warning("bagf_torch cache %s is unusable (%s); moved it to %s and started a "
                                   "fresh cache (every problem will be tuned again)",
                                   path, damaged.reason, aside)
                    return _open_file(path)
        except (sqlite3.Error, OSError, _Damaged) as e:
            return self._fall_back(f"cannot use {path}: {_describe(e)}",
                                   copy_from=None, read_only_copy=True)

    def _fall_back(self, reason: str, copy_from: sqlite3.Connection | None,
                   read_only_copy: bool = False) -> sqlite3.Connection:
        """Switch to an in-memory cache holding what the file held when that can still be read (from the
        live connection ``copy_from``, or, at open, from the file read-only). Logs once."""
        memory = None
        if copy_from is not None:
            try:
                memory = _connect(":memory:")
                copy_from.backup(memory)
                memory.execute(_CLAIMS)
            except sqlite3.Error:
                memory = None
        elif read_only_copy and self.path is not None:
            memory = _read_only_copy(self.path)
        kept = memory is not None
        if memory is None:
            memory = _memory_connection()
        self.fallback_reason = reason
        logger.warning("bagf_torch cache: %s; using an in-memory cache%s for the rest of this process "
                       "(tuning goes on, new results will not be saved)", reason,
                       " holding a copy of its contents" if kept else "")
        return memory

    def _connection(self) -> sqlite3.Connection:
        """The connection for this process (opened here after a fork); called with the lock held."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._pid != os.getpid():
            # Forked child: the parent's connection and lock (possibly held by a parent thread at the fork)
            # are not ours. The connection is kept referenced, never closed: closing it could drop POSIX
            # locks SQLite tracks per inode for our new one (SQLite: do not carry a connection across fork).
            # An in-memory cache has no file locks; the child simply keeps its copy.
            self._lock = threading.RLock()
            self._pid = os.getpid()
            if not self.in_memory and self._conn is not None:
                _ABANDONED.append(self._conn)
                self._conn = None
        with self._lock:
            yield

    def _read(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        return self._with_fallback("reading", fn)

    def _write(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn`` in one write transaction; on failure of the file, fall back to memory and redo it.
        Then empty the WAL (``_checkpoint``), so the file alone holds the commit."""
        with self._locked():
            result = self._with_fallback("writing", lambda conn: _transaction(conn, fn))
            if not self.in_memory:
                # Outside _with_fallback: the commit is in the file already, and redoing fn in memory after
                # a failed checkpoint would store it twice (put_plan would then tell its winner it lost).
                try:
                    _checkpoint(self._conn)
                except sqlite3.Error as e:
                    if not self._checkpoint_failed:
                        self._checkpoint_failed = True
                        logger.warning("bagf_torch cache %s: could not copy its WAL into the file (%s); the "
                                       "commits are safe in %s-wal, but do not copy another cache file over "
                                       "this one while that -wal is not empty", self.path, _describe(e),
                                       self.path)
            return result

    def _with_fallback(self, verb: str, call: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``call`` on the file's connection; if the file fails, move to memory (copying what is still
        readable unless the file is corrupt) and run it there."""
        with self._locked():
            conn = self._connection()
            try:
                return call(conn)
            except sqlite3.DatabaseError as e:
                if self.in_memory:
                    raise
                self._conn = self._fall_back(f"{verb} {self.path} failed: {_describe(e)}",
                                             copy_from=None if _is_corruption(e) else conn)
                conn.close()
                return call(self._conn)

    # ---- plans --------------------------------------------------------------------------------

    def get_plan(self, key: str) -> dict | None:
        """The stored winner for ``key``, or None (also when its row fails the schema: see ``_decode_plan``).
        Keys are as in ``put_plan``; JSON fields come back as dicts (``config`` None for family "aten")."""
        row = self._read(lambda c: c.execute(f"SELECT {', '.join(_PLAN_COLUMNS)} FROM plans WHERE key = ?",
                                             (key,)).fetchone())
        return None if row is None else self._decode_plan(row)

    def put_plan(self, key: str, *, problem: dict, env: dict, family: str, config: dict | None,
                 time_us: float, aten_us: float | None, default_us: float | None, evaluations: int,
                 tune_seconds: float, cubin_digests: Sequence[str] = ()) -> bool:
        """Store the winner for ``key`` unless one is already there; True if this call stored it.

        Several processes may tune the same problem at once: the first to call this wins, the others get
        False and should use ``get_plan(key)`` so that every process runs the same kernel. Family "aten"
        with ``config`` None means "use torch's own conv". ``cubin_digests`` names the cubins the plan
        launches, so ``export`` can carry them to another machine. The plan is checked against the same
        schema reads use (``cache_schema.PlanRecord``; ValueError says which field fails), so nothing is
        written that would be skipped when read back. A row already there that fails the schema does not
        count as a winner: it is replaced (else its key could never be stored again).
        """
        record = _plan_record(key, problem=problem, env=env, family=family, config=config, time_us=time_us,
                              aten_us=aten_us, default_us=default_us, evaluations=evaluations,
                              tune_seconds=tune_seconds, cubin_digests=cubin_digests, created=time.time())
        row = record.row()

        def put(c: sqlite3.Connection) -> bool:
            if _insert_plan(c, row):
                return True
            existing = c.execute(f"SELECT {', '.join(_PLAN_COLUMNS)} FROM plans WHERE key = ?", (key,)).fetchone()
            try:
                PlanRecord.from_row(existing)
                return False
            except SchemaError:
                c.execute(f"INSERT OR REPLACE INTO plans ({', '.join(_PLAN_COLUMNS)}) "
                          f"VALUES ({', '.join('?' * len(_PLAN_COLUMNS))})", row)
                return True

        return self._write(put)

    def plans(self) -> list[dict]:
        """Every plan that passes the schema, oldest first (for listing, reports, warm starts, export)."""
        rows = self._read(lambda c: c.execute(
            f"SELECT {', '.join(_PLAN_COLUMNS)} FROM plans ORDER BY created, key").fetchall())
        return [plan for plan in map(self._decode_plan, rows) if plan is not None]

    def _decode_plan(self, row: Sequence) -> dict | None:
        """The plan in ``row``, or None when it fails the schema (damaged JSON, wrong types, a knob outside
        its family's space, a stride of 0...). It is skipped, not deleted: it may be another program's
        business, and ``put_plan`` replaces it when its key is tuned again. One warning per key and Cache,
        naming the field (``plans()`` runs for every new problem's warm start)."""
        try:
            return PlanRecord.from_row(row).as_dict()
        except SchemaError as e:
            key = str(row[0])[:64] if row else "?"
            if key not in self._reported:
                self._reported.add(key)
                logger.warning("bagf_torch cache %s: plan %s is damaged or malformed (%s); skipped, it will be "
                               "tuned again", self.path or "in memory", key, e)
            return None

    # ---- trials -------------------------------------------------------------------------------

    def add_trials(self, key: str, trials: list[dict]) -> None:
        """Append trials for ``key`` in one transaction, each stamped with the time it was stored.

        Each is ``{"family", "config" (dict | None), "status", "time_us" (float | None), "detail" (str)}``;
        ``detail`` may be left out.
        """
        now = time.time()
        rows = [_trial_row(key, i, t, now) for i, t in enumerate(trials)]
        if rows:
            self._write(lambda c: c.executemany(
                "INSERT INTO trials (key, family, config, status, time_us, detail, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)", rows))

    def trials(self, key: str) -> list[dict]:
        """Every trial stored for ``key`` that passes the schema, in the order stored."""
        rows = self._read(lambda c: c.execute(
            "SELECT family, config, status, time_us, detail, created FROM trials WHERE key = ? ORDER BY id",
            (key,)).fetchall())
        out = []
        for row in rows:
            try:
                out.append(check_trial_row(row))
            except SchemaError:
                continue  # a damaged trial is only history: leave it out, no need to repair
        return out

    # ---- cubins -------------------------------------------------------------------------------

    def get_cubin(self, digest: str) -> tuple[bytes, str] | None:
        """``(cubin, lowered_name)`` stored under ``digest``, or None.

        The bytes are checked against the sha256 stored with them: a damaged cubin handed to
        ``cuModuleLoadData`` could run garbage on the GPU, so one that fails the check (or whose row has the
        wrong types) is dropped (with a warning) and reported absent, and the caller compiles it again.
        """
        row = self._cubin_row(digest)
        return None if row is None else (row[2], row[1])

    def _cubin_row(self, digest: str) -> tuple[str, str, bytes] | None:
        """``(name, lowered_name, cubin)`` under ``digest`` when it passes its checks, else None."""
        row = self._read(lambda c: c.execute("SELECT name, cubin, lowered_name, sha256 FROM cubins "
                                             "WHERE digest = ?", (digest,)).fetchone())
        if row is None:
            return None
        try:
            cubin, lowered_name, sha = check_cubin_row(row[1], row[2], row[3])
            if hashlib.sha256(cubin).hexdigest() != sha:
                raise SchemaError("sha256", "mismatch")
            if not isinstance(row[0], str):
                raise SchemaError("name", "must be text")
        except SchemaError as e:
            self._write(lambda c: c.execute("DELETE FROM cubins WHERE digest = ?", (digest,)))
            logger.warning("bagf_torch cache %s: cubin %s is damaged (%s); dropped it, it will be compiled "
                           "again", self.path or "in memory", digest, "sha256 mismatch"
                           if e.field == "sha256" else e)
            return None
        return row[0], lowered_name, cubin

    def put_cubin(self, digest: str, name: str, lowered_name: str, cubin: bytes) -> None:
        """Store a compiled kernel under its content ``digest``; storing the same digest again is a no-op
        (same digest, same content). Digests starting with ``FOREIGN_DIGEST_PREFIX`` are refused: that
        namespace is only written by ``import_(..., trust_cubins=True)``."""
        if not isinstance(cubin, (bytes, bytearray, memoryview)):
            raise TypeError(f"cubin must be bytes, got {type(cubin).__name__}")
        if not isinstance(digest, str) or not digest or digest.startswith(FOREIGN_DIGEST_PREFIX):
            raise ValueError(f"cubin digest {digest!r} is not a digest our compiler makes (names starting "
                             f"with {FOREIGN_DIGEST_PREFIX!r} are reserved for imported cubins)")
        if not isinstance(name, str):
            raise TypeError(f"cubin name must be a string, got {type(name).__name__}")
        check_cubin_row(bytes(cubin), lowered_name, "0" * 64)
        row = (digest, name, lowered_name, bytes(cubin))
        self._write(lambda c: _insert_cubins(c, [row]))

    # ---- who is tuning what -------------------------------------------------------------------

    def claim(self, key: str, owner: str, lease_s: float) -> str | None:
        """Claim the right to tune ``key`` for ``lease_s`` seconds; None if the claim is now ``owner``'s,
        else the id of the live process holding it.

        Several processes (DDP ranks, serving workers) meeting a new problem at once: one claims it and
        tunes, the others wait for its plan (``get_plan``) instead of tuning the same problem on the same
        GPU, which would waste the time and disturb each other's measurements. A claim is kept alive with
        ``heartbeat`` and dropped with ``release``; one whose lease ran out, or whose owner is a process
        of this host that no longer exists (``kill -9``), is taken over. ``owner`` is ``owner_id()``.
        """
        now = time.time()

        def take(c: sqlite3.Connection) -> str | None:
            row = c.execute("SELECT owner, expires FROM claims WHERE key = ?", (key,)).fetchone()
            if row is not None and row[0] != owner and row[1] > now and _owner_alive(row[0]):
                return row[0]
            c.execute("INSERT OR REPLACE INTO claims (key, owner, expires) VALUES (?, ?, ?)",
                      (key, owner, now + lease_s))
            return None

        return self._write(take)

    def claimed_by(self, key: str) -> str | None:
        """The live owner of a claim on ``key``, or None (no claim, expired, or its process is gone)."""
        row = self._read(lambda c: c.execute("SELECT owner, expires FROM claims WHERE key = ?",
                                             (key,)).fetchone())
        if row is None or row[1] <= time.time() or not _owner_alive(row[0]):
            return None
        return row[0]

    def heartbeat(self, key: str, owner: str, lease_s: float) -> bool:
        """Extend ``owner``'s claim on ``key`` by ``lease_s`` from now; False if it is no longer theirs."""
        expires = time.time() + lease_s
        return self._write(lambda c: c.execute("UPDATE claims SET expires = ? WHERE key = ? AND owner = ?",
                                               (expires, key, owner)).rowcount == 1)

    def release(self, key: str, owner: str) -> None:
        """Drop ``owner``'s claim on ``key`` (no-op if it is not theirs)."""
        self._write(lambda c: c.execute("DELETE FROM claims WHERE key = ? AND owner = ?", (key, owner)))

    # ---- moving results between machines ------------------------------------------------------

    def export(self, path: str | os.PathLike) -> int:
        """Write every plan that passes the schema and the cubins they name to a JSON file (cubins base64);
        returns the number of plans. The file is written whole or not at all (a unique temp file, then a
        rename; a symlink is written through, a special file written directly): ``cache_io.export_cache``."""
        from .cache_io import export_cache

        return export_cache(self, path)

    def import_(self, path: "str | os.PathLike | Any", env: dict, *, compiler: Any = None, checker: Any = None,
                trust_cubins: bool = False) -> tuple[int, list[str]]:
        """Import the plans of an ``export`` file that were tuned on a machine like this one.

        The file is input from another machine, maybe another party (docs/cache.md): every entry is checked
        against the row schema and the family's space, its key is recomputed from its problem and env (a
        mismatch is refused) and its cubin digest from its family and configuration with our sources. A
        plan is imported only if its ``env`` equals ``env`` (this machine's: GPU, versions, kernel source
        hash...), since a plan tuned elsewhere may be slow or invalid here. Plans already in this cache are
        kept.

        Cubins: by default none of the file's bytes are stored; ``compiler`` (``cache_io.local_compiler``
        on a GPU machine) rebuilds each winner here with NVRTC from our own kernel sources, and a plan
        whose kernel does not build is skipped. Without a compiler the plans are stored alone and the
        runtime compiles each kernel on first use. ``trust_cubins=True`` takes the file's cubins as they
        are, stored under ``FOREIGN_DIGEST_PREFIX`` + our digest (never under a name our compiler
        writes); plans whose cubin the file lacks are rebuilt as by default.

        Numbers: ``checker`` (``cache_io.local_checker(compiler)``, which ``cache import`` passes) runs each
        plan's kernel once on its problem against float64, the check every tuned candidate passes, and a plan
        that fails it is skipped. Without a checker plans are stored unchecked: for callers that check elsewhere.

        Returns ``(imported, skipped)``, ``skipped`` holding one line per plan left out saying why, e.g.
        ``"3f2a9c01d4e5b6a7 (implicit_gemm): gpu 'NVIDIA A100' != 'NVIDIA H200'"``. ValueError when the
        file is not an export at all; CacheUnavailable when the file cannot be written (nothing imported).
        """
        from .cache_io import import_into

        return import_into(self, path, env, compiler=compiler, checker=checker, trust_cubins=trust_cubins)

    # ---- housekeeping -------------------------------------------------------------------------

    def clear(self) -> int:
        """Delete every plan, trial and cubin (the file stays, empty, and gives its space back: VACUUM); returns
        how many plans it held. CacheUnavailable when the file could not be changed (read-only, disk full...): a
        cleared copy in memory would report success with the file untouched."""
        def wipe(c: sqlite3.Connection) -> int:
            n = c.execute("SELECT COUNT(*) FROM plans").fetchone()[0]
            for table in ("plans", "trials", "cubins"):
                c.execute(f"DELETE FROM {table}")
            return n

        n = self._write_to_file("clear", wipe)
        self._give_space_back("cleared")
        return n

    def prune(self, env: dict | None = None, *, other_versions: bool = False, other_gpus: bool = False,
              keep_days: float = 30.0) -> dict:
        """Delete what is not used, and give the space back. An upgrade of torch, bagf_torch, CUDA or the driver
        leaves every plan, trial and cubin of the old versions behind, and ``open`` reads every page of the file
        (``quick_check``) in each process that tunes.

        - with ``other_versions``, plans tuned on this GPU (``env``: ``jit.extension.environment``) under another
          env (versions, kernel sources), and with ``other_gpus`` those of other GPUs: both are kept by default,
          since the default cache directory is shared by every environment of a user (a virtualenv on another
          torch) and may be shared by several machines. A plan whose env cannot be read is kept, as ``plans``
          skips it;
        - trials of a key with no plan left, older than a day (a tuning in progress journals its trials before it
          stores its plan);
        - cubins no remaining plan names, compiled more than ``keep_days`` days ago (younger ones are the start
          points and candidates later tunings load instead of compiling), except the newest of each kernel every
          process loads beside its plans (names starting with ``SHARED_CUBIN_PREFIX``: the pooling epilogue).

        Run it when nothing tunes: VACUUM holds the file's write lock while it copies the file.

        Returns {"plans": n, "trials": n, "cubins": n, "bytes_before": n, "bytes_after": n} (sizes of the file
        and its -wal; 0 in memory). CacheUnavailable when the file could not be changed."""
        if (other_versions or other_gpus) and (not isinstance(env, dict) or "gpu" not in env):
            raise ValueError("prune of other versions' or GPUs' plans needs this machine's env "
                             "(jit.extension.environment), with its 'gpu'")
        now = time.time()
        before = self._file_bytes()

        def drop(c: sqlite3.Connection) -> dict:
            stale = []
            rows = c.execute("SELECT key, env FROM plans").fetchall() if other_versions or other_gpus else []
            for key, text in rows:
                try:
                    theirs = json.loads(text)
                except (TypeError, ValueError):
                    theirs = None
                if not isinstance(theirs, dict) or not _env_difference(theirs, env):
                    continue
                if other_gpus if theirs.get("gpu") != env["gpu"] else other_versions:
                    stale.append(key)
            c.executemany("DELETE FROM plans WHERE key = ?", [(k,) for k in stale])
            trials = c.execute("DELETE FROM trials WHERE created < ? AND NOT EXISTS "
                               "(SELECT 1 FROM plans WHERE plans.key = trials.key)", (now - _DAY_S,)).rowcount
            named: set[str] = set()
            for (text,) in c.execute("SELECT cubin_digests FROM plans"):
                try:
                    digests = json.loads(text)
                except (TypeError, ValueError):
                    continue
                if isinstance(digests, list):
                    named.update(d for d in digests if isinstance(d, str))
            # the newest cubin of each kernel no plan names but every process loads (the pooling epilogue's, one
            # per GPU architecture): a serving process would compile it again
            named.update(d for d, in c.execute(
                "SELECT digest FROM cubins AS a WHERE substr(name, 1, ?) = ? AND created = "
                "(SELECT MAX(created) FROM cubins AS b WHERE b.name = a.name)",
                (len(SHARED_CUBIN_PREFIX), SHARED_CUBIN_PREFIX)))
            cutoff = now - keep_days * _DAY_S
            old = [d for d, in c.execute("SELECT digest FROM cubins WHERE created < ?", (cutoff,))
                   if not isinstance(d, str) or d.removeprefix(FOREIGN_DIGEST_PREFIX) not in named]
            c.executemany("DELETE FROM cubins WHERE digest = ?", [(d,) for d in old])
            return {"plans": len(stale), "trials": trials, "cubins": len(old)}

        counts = self._write_to_file("prune", drop)
        if any(counts.values()):
            self._give_space_back("pruned")
        return dict(counts, bytes_before=before, bytes_after=self._file_bytes())

    def _file_bytes(self) -> int:
        """The size of the cache file and its -wal (0 in memory)."""
        if self.in_memory or self.path is None:
            return 0
        return sum(p.stat().st_size for p in (self.path, self.path.with_name(self.path.name + "-wal")) if p.exists())

    def _give_space_back(self, done: str) -> None:
        """VACUUM after a delete: SQLite keeps freed pages for reuse, so without it a cleared 400 MB cache stays
        400 MB. (In WAL mode the smaller file is in the WAL until the checkpoint.)"""
        with self._locked():
            if not self.in_memory:
                try:
                    self._connection().execute("VACUUM")
                    if not _checkpoint(self._connection()):
                        logger.info("bagf_torch cache %s: %s; another process is reading it, so the smaller file "
                                    "stays in its -wal until the next write", self.path, done)
                except sqlite3.Error as e:  # the rows are gone either way; the space comes back when it can
                    logger.info("bagf_torch cache %s: %s, but could not give its space back (%s)", self.path, done,
                                _describe(e))

    def _write_to_file(self, what: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """``_write`` for operations that only mean something on the file: CacheUnavailable, instead of a
        silent success in memory, when the cache already is or falls back to memory during the write (an
        in-memory cache by request, ``Cache(None)``, is written as usual)."""
        with self._locked():
            if self.path is not None and self.in_memory:
                raise CacheUnavailable(f"cannot {what} {self.path}: {self.fallback_reason}; the file was not "
                                       f"changed (fix the directory's permissions or free space, then retry)")
            result = self._write(fn)
            if self.path is not None and self.in_memory:
                raise CacheUnavailable(f"cannot {what} {self.path}: {self.fallback_reason}; the file was not "
                                       f"changed (fix the directory's permissions or free space, then retry)")
            return result

    def close(self) -> None:
        """Close the connection (idempotent). The cache cannot be used afterwards."""
        with self._locked():
            if not self._closed:
                self._closed = True
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None






def _insert_cubins(conn: sqlite3.Connection, rows: Sequence[tuple]) -> None:
    """Rows of (digest, name, lowered_name, cubin bytes); an existing digest is kept."""
    now = time.time()
    conn.executemany("INSERT OR IGNORE INTO cubins (digest, name, lowered_name, cubin, sha256, created) "
                     "VALUES (?, ?, ?, ?, ?, ?)",
                     [(d, n, ln, b, hashlib.sha256(b).hexdigest(), now) for d, n, ln, b in rows])


def _insert_plan(conn: sqlite3.Connection, row: tuple) -> bool:
    cursor = conn.execute(f"INSERT OR IGNORE INTO plans ({', '.join(_PLAN_COLUMNS)}) "
                          f"VALUES ({', '.join('?' * len(_PLAN_COLUMNS))})", row)
    return cursor.rowcount == 1


def _number(name: str, value: Any, *, optional: bool = False, infinite: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "item"):
        raise TypeError(f"{name} must be a number{' or None' if optional else ''}, got {value!r}")
    value = float(value)
    if math.isnan(value) or value < 0 or (math.isinf(value) and not infinite):
        raise ValueError(f"{name} must be {'' if infinite else 'finite and '}>= 0, got {value!r}")
    return value


def _plan_record(key: str, **fields: Any) -> PlanRecord:
    """``put_plan``'s arguments as a checked record. They are first put through the JSON the row will hold
    (numpy scalars become Python numbers, tuples lists; an object JSON cannot hold is a TypeError), so the
    check sees exactly what a later read will."""
    return PlanRecord.from_mapping({"key": key, **_normalise(fields)})


def _trial_row(key: str, index: int, trial: dict, now: float) -> tuple:
    if not isinstance(trial, dict):
        raise TypeError(f"trial {index} for {key[:16]} is a {type(trial).__name__}, not a dict")
    missing = [f for f in ("family", "status") if f not in trial]
    if missing:
        raise ValueError(f"trial {index} for {key[:16]} lacks {', '.join(map(repr, missing))}: each trial "
                         f"needs family, config, status, time_us and detail")
    config = trial.get("config")
    return (key, str(trial["family"]), None if config is None else _dumps(config), str(trial["status"]),
            _number(f"trial {index} time_us", trial.get("time_us"), optional=True, infinite=True),
            str(trial.get("detail") or ""), now)


def _pid_namespace() -> str:
    """This process's PID namespace (Linux: the inode of /proc/self/ns/pid), '' where there is none to read.
    Containers on one host can share its hostname while each has its own PIDs: a pid is only meaningful
    inside its namespace."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # 'pid:[4026531836]'
    except OSError:
        return ""
    return "".join(ch for ch in link if ch.isdigit())


def _host_id() -> str:
    ns = _pid_namespace()
    return f"{socket.gethostname()}/{ns}" if ns else socket.gethostname()


def owner_id() -> str:
    """This process's claim owner id, ``host[/pid namespace]:pid:random``: the random part tells a process from
    a later one that reuses its pid."""
    return f"{_host_id()}:{os.getpid()}:{os.urandom(4).hex()}"


def _owner_alive(owner: str) -> bool:
    """False only when ``owner`` names a process of this host and PID namespace that does not exist any more;
    an owner elsewhere (another host on a shared file system, another container with this hostname, an id
    without a namespace) is alive until its lease runs out. Two containers sharing a hostname once voided
    each other's live claims by pid, and two tuners shared one GPU."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != _host_id() or not pid_text.isdigit():
        return True
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _env_difference(theirs: dict, ours: dict) -> str:
    """'' if equal, else every differing field as "name 'theirs' != 'ours'" (theirs = the file's)."""
    if not isinstance(theirs, dict):
        return f"env is {theirs!r}, not a dict"
    missing = object()
    parts = []
    for name in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(name, missing), ours.get(name, missing)
        if a != b:
            parts.append(f"{name} {'<absent>' if a is missing else repr(a)} != "
                         f"{'<absent>' if b is missing else repr(b)}")
    return "; ".join(parts)


def _describe(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror + (f" ({err.filename})" if err.filename else "")
    if isinstance(err, (sqlite3.Error, _Damaged)):
        return str(err)
    return f"{type(err).__name__}: {err}"

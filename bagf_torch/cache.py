"""The on-disk store of tuning results: winners (plans), every trial (failures included), and cubins.

One SQLite file (stdlib ``sqlite3``) shared by every process and thread of a machine. Why SQLite: its
transactions make a write either fully there or absent after a crash (``kill -9``, power loss), and its
locking lets several tuners write at once without a lock file of our own around each write.

How it stays safe:

- WAL journal (readers never block the writer) and ``busy_timeout`` (a writer waits for another instead
  of failing with "database is locked"). Every write is one ``BEGIN IMMEDIATE`` transaction: it takes the
  write lock up front, so two processes can never both read, then both try to upgrade, and deadlock.
- Each write is followed by a ``wal_checkpoint(TRUNCATE)``, which copies the WAL into the file and cuts the
  ``-wal`` to 0 bytes (unless another connection holds it up past ``CHECKPOINT_WAIT_MS``: then the next
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

try:  # POSIX only; elsewhere opening is not serialised between processes (see _open_lock)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["Cache", "CacheUnavailable", "CACHE_FILENAME", "SCHEMA_VERSION", "EXPORT_FORMAT", "FOREIGN_DIGEST_PREFIX",
           "default_cache_path", "owner_id"]

logger = logging.getLogger("bagf_torch")

CACHE_FILENAME = "bagf_cache.sqlite"
SCHEMA_VERSION = 1
"""Bump on any change to the tables below; a file of another version is moved aside, never migrated
(a tuning cache is cheap to rebuild and a half-understood one is worse than none)."""
EXPORT_FORMAT = "bagf_torch.cache"
FOREIGN_DIGEST_PREFIX = "foreign:"
"""Cubins imported with ``--trust-cubins`` are stored under this prefix + our digest. Our compiler writes
only bare sha256 hex digests (``put_cubin`` refuses this prefix), so a foreign binary can never occupy the
name of a kernel we compile; the compiler reads the prefixed name only when it has no cubin of its own."""


class CacheUnavailable(RuntimeError):
    """An operation whose whole point is the file (``clear``, ``import_``) could not change it: the cache is
    in memory (``fallback_reason`` says why). Nothing pretends to have succeeded."""

BUSY_TIMEOUT_MS = 30_000
"""How long a writer waits for another process's transaction. Writes here last milliseconds (a plan row, a
batch of trials, one cubin), so 30 s of waiting means a stuck process, not contention."""
CHECKPOINT_WAIT_MS = 50
"""How long the checkpoint after a write waits for another connection's writer lock or for readers of the
WAL's frames; then it gives up, and a later write's checkpoint empties the WAL. Short, because it holds the
writer lock while it waits, so behind another program's long read transaction every write of every process
would pay it; long enough for our own statements, which take well under a millisecond (a trial row 0.05
ms, a 100 KB cubin 0.3 ms). 8 processes writing 102 rows each at once left the WAL empty after the last
write in each of 31 runs with 50 ms (and with 0 ms), in 0.45-0.75 s against 0.12-0.16 s without
checkpoints (2-core VM)."""

_T = TypeVar("_T")
_ABANDONED: list[sqlite3.Connection] = []  # connections inherited through fork (see Cache._locked)

_SCHEMA = """
CREATE TABLE plans (
    key           TEXT PRIMARY KEY,
    problem       TEXT NOT NULL,
    env           TEXT NOT NULL,
    family        TEXT NOT NULL,
    config        TEXT,
    time_us       REAL NOT NULL,
    aten_us       REAL,
    default_us    REAL,
    evaluations   INTEGER NOT NULL,
    tune_seconds  REAL NOT NULL,
    cubin_digests TEXT NOT NULL,
    created       REAL NOT NULL
);
CREATE TABLE trials (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    key      TEXT NOT NULL,
    family   TEXT NOT NULL,
    config   TEXT,
    status   TEXT NOT NULL,
    time_us  REAL,
    detail   TEXT NOT NULL,
    created  REAL NOT NULL
);
CREATE INDEX trials_by_key ON trials (key, id);
CREATE TABLE cubins (
    digest        TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    lowered_name  TEXT NOT NULL,
    cubin         BLOB NOT NULL,
    sha256        TEXT NOT NULL,
    created       REAL NOT NULL
);
"""

# Who is tuning which key right now (see Cache.claim). Not results, so not part of the schema version: it is
# created on open when missing, and a bagf_torch that does not know it leaves it alone. Rows are transient.
_CLAIMS = """
CREATE TABLE IF NOT EXISTS claims (
    key      TEXT PRIMARY KEY,
    owner    TEXT NOT NULL,
    expires  REAL NOT NULL
)
"""

_PLAN_COLUMNS = PLAN_FIELDS


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


def _is_corruption(err: BaseException) -> bool:
    """True for "this file is damaged or not a database", False for "cannot use it now" (locked,
    read-only, I/O error, disk full), which is not a reason to throw its contents away."""
    code = getattr(err, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
    text = str(err).lower()
    return "malformed" in text or "not a database" in text


def _timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _move_aside(path: Path, tag: str) -> Path:
    """Rename ``path`` (and its -wal/-shm files, which belong to it and must never be applied to a new
    file) to ``<name>.<tag>-<timestamp>``, adding a counter if that name is taken."""
    base = f"{path.name}.{tag}-{_timestamp()}"
    target = path.with_name(base)
    n = 1
    while target.exists():
        target = path.with_name(f"{base}-{n}")
        n += 1
    os.replace(path, target)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, target.with_name(target.name + suffix))
    return target


@contextlib.contextmanager
def _open_lock(path: Path) -> Iterator[None]:
    """Serialise opening (check, move aside, create) between processes, so that two processes that both
    find a damaged file do not each move the other's fresh file aside. Writes do not take it: SQLite's own
    locking and busy_timeout cover them (8 processes x 102 one-row commits to one file, each followed by
    its checkpoint: 0.45-0.75 s), and a blocking flock would wait forever behind a process stopped in a
    debugger, where busy_timeout gives up and falls back to memory; this one polls with the same deadline.
    POSIX only: elsewhere opening is not serialised. The lock file stays (deleting it would let two
    processes lock two different files).
    """
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"another process has held {path}.lock for "
                                           f"{BUSY_TIMEOUT_MS // 1000} s") from None
                    time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # releases the flock


def _connect(target: str, *, uri: bool = False) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN/COMMIT ourselves (the sqlite3 module's implicit transactions
    # would start a deferred one, which can deadlock on upgrade between processes).
    conn = sqlite3.connect(target, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                           check_same_thread=False, uri=uri)
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    return conn


def _create_schema(conn: sqlite3.Connection) -> None:
    def create(c: sqlite3.Connection) -> None:
        # Another process may have created it between our check and our write lock.
        if c.execute("PRAGMA user_version").fetchone()[0] == 0:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    c.execute(statement)
            c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # _transaction, not a bare ROLLBACK: on a full disk SQLite has already rolled back, and "cannot rollback -
    # no transaction is active" would replace the real reason ("database or disk is full") in the warning.
    _transaction(conn, create)


_TABLE_COLUMNS = {
    "plans": _PLAN_COLUMNS,
    "trials": ("id", "key", "family", "config", "status", "time_us", "detail", "created"),
    "cubins": ("digest", "name", "lowered_name", "cubin", "sha256", "created"),
}


def _foreign_tables(conn: sqlite3.Connection) -> str | None:
    """None when the file has our tables with our columns, else what is wrong: a file may carry our
    user_version and still be someone else's (or a half-made one), and every query would then fail with
    "no such table" in every process."""
    for table, columns in _TABLE_COLUMNS.items():
        found = tuple(row[1] for row in conn.execute(f"PRAGMA table_info({table})"))
        if found != columns:
            return f"table {table} {'is missing' if not found else f'has columns {list(found)}'}"
    return None


def _memory_connection() -> sqlite3.Connection:
    conn = _connect(":memory:")
    _create_schema(conn)
    conn.execute(_CLAIMS)
    return conn


class _Damaged(Exception):
    """The file is corrupt (``tag`` "corrupt") or of another schema version (``tag`` "schema-vN")."""

    def __init__(self, tag: str, reason: str):
        super().__init__(reason)
        self.tag = tag
        self.reason = reason


def _open_file(path: Path) -> sqlite3.Connection:
    """Open (creating if needed) a valid cache file at ``path``; raise _Damaged if it is not one, and
    sqlite3.Error/OSError if it cannot be used at all."""
    conn = _connect(str(path))
    try:
        try:
            check = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
        except sqlite3.DatabaseError as e:
            if _is_corruption(e):
                raise _Damaged("corrupt", str(e)) from e
            raise
        if check != ["ok"]:
            raise _Damaged("corrupt", "; ".join(check[:3]))
        # quick_check reads every page: 0.17 s for a 200 MB file (2000 cubins of 100 KB) on the dev box,
        # a few ms for a usual cache; it finds damage inside pages that the first queries would not touch.
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise sqlite3.OperationalError(f"could not switch to WAL journal (got {mode!r})")
        # NORMAL in WAL mode: no fsync per commit (3.3 ms each here, which a tuner writing every trial
        # would pay), still never corrupt; a crash of the process loses nothing, a power cut may lose the
        # last commits, which for a tuning cache only means tuning those problems again.
        conn.execute("PRAGMA synchronous = NORMAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if version == 0 and not tables:
            _create_schema(conn)
        elif version != SCHEMA_VERSION:
            what = "not a bagf_torch cache" if version == 0 else f"schema version {version}"
            raise _Damaged(f"schema-v{version}", f"{what}, this bagf_torch uses version {SCHEMA_VERSION}")
        else:
            wrong = _foreign_tables(conn)
            if wrong is not None:
                raise _Damaged("not-bagf", f"schema version {version} but not a bagf_torch cache ({wrong})")
        conn.execute(_CLAIMS)
        # Creating the tables (or the claims table of an older file) is a commit like any other: empty the
        # WAL of it too. A -wal that already held commits was left by a process that died during a write or
        # belongs to one writing now; SQLite has already applied it to what we read, and this only moves
        # those commits into the file.
        with contextlib.suppress(sqlite3.Error):
            _checkpoint(conn)
        return conn
    except BaseException:
        conn.close()
        raise


def _read_only_copy(path: Path) -> sqlite3.Connection | None:
    """An in-memory copy of a cache file we may read but not write (a warm cache baked into a read-only
    image), or None. ``immutable=1`` because a WAL file cannot be opened read-only without its -shm file,
    which a read-only directory may lack; nobody can be writing it there anyway. But ``immutable=1`` also
    ignores the WAL, and a warm cache whose last commits are still in its ``-wal`` (never checkpointed)
    would come back empty or stale: then the file and its WAL are copied to a temporary directory and
    that copy is opened normally, so SQLite applies the WAL to it."""
    if not path.is_file():
        return None
    source = None
    scratch = None
    try:
        wal = path.with_name(path.name + "-wal")
        if wal.is_file() and wal.stat().st_size > 0:
            import shutil
            import tempfile

            scratch = tempfile.TemporaryDirectory(prefix="bagf_cache_ro_")
            copy = Path(scratch.name) / path.name
            shutil.copyfile(path, copy)
            shutil.copyfile(wal, copy.with_name(copy.name + "-wal"))
            source = _connect(str(copy))
        else:
            source = _connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
        if source.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION or _foreign_tables(source):
            return None
        if source.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            return None
        memory = _connect(":memory:")
        source.backup(memory)
        memory.execute(_CLAIMS)
        return memory
    except (sqlite3.Error, OSError, ValueError):
        return None
    finally:
        if source is not None:
            source.close()
        if scratch is not None:
            scratch.cleanup()


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

    def import_(self, path: "str | os.PathLike | Any", env: dict, *, compiler: Any = None,
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

        Returns ``(imported, skipped)``, ``skipped`` holding one line per plan left out saying why, e.g.
        ``"3f2a9c01d4e5b6a7 (implicit_gemm): gpu 'NVIDIA A100' != 'NVIDIA H200'"``. ValueError when the
        file is not an export at all; CacheUnavailable when the file cannot be written (nothing imported).
        """
        from .cache_io import import_into

        return import_into(self, path, env, compiler=compiler, trust_cubins=trust_cubins)

    # ---- housekeeping -------------------------------------------------------------------------

    def clear(self) -> int:
        """Delete every plan, trial and cubin (the file stays, empty); returns how many plans it held.
        CacheUnavailable when the file could not be changed (read-only, disk full...): a cleared copy in
        memory would report success with the file untouched."""
        def wipe(c: sqlite3.Connection) -> int:
            n = c.execute("SELECT COUNT(*) FROM plans").fetchone()[0]
            for table in ("plans", "trials", "cubins"):
                c.execute(f"DELETE FROM {table}")
            return n

        return self._write_to_file("clear", wipe)

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


def _transaction(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], _T]) -> _T:
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = fn(conn)
        conn.execute("COMMIT")
        return result
    except BaseException:
        with contextlib.suppress(sqlite3.Error):  # a failed COMMIT may already have rolled back
            conn.execute("ROLLBACK")
        raise


def _checkpoint(conn: sqlite3.Connection) -> bool:
    """Copy every commit in the WAL into the database file and cut the ``-wal`` to 0 bytes; True when it
    did, False when another connection stood in the way for ``CHECKPOINT_WAIT_MS`` (a writer, a reader
    of the WAL's frames, an open statement of this one). Then SQLite copies what it can without waiting
    (as PASSIVE would) and leaves the rest in the WAL, where every connection still reads it: nothing is
    lost, and the next write's checkpoint catches up. Raises sqlite3.Error for anything else (an I/O
    error, a full disk).

    TRUNCATE, not PASSIVE or journal_size_limit: after those the -wal keeps its old frames until the next
    write starts a new one, and SQLite reads them into a file copied over this one. The cost, per write of
    one trial row: 0.03-0.05 ms without, 0.4-0.65 ms with (medians of 300, ext4 on a 2-core VM, idle and
    busy), spent in the 3 fdatasyncs and 2 ftruncates strace shows per checkpoint; where an fsync takes
    3 ms it is about 10 ms. The runtime writes one trial per evaluation, and an evaluation takes about
    0.3 s (80 in 25 s), so a checkpoint per write costs 0.2% of a tuning here, about 3% on such a disk;
    cheap enough not to leave commits in the WAL for the length of a tuning."""
    conn.execute(f"PRAGMA busy_timeout = {CHECKPOINT_WAIT_MS}")
    try:
        return conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    except sqlite3.OperationalError as e:
        # An open statement of this connection: "database table is locked" (SQLITE_LOCKED), not a busy row.
        if getattr(e, "sqlite_errorcode", 0) & 0xFF in (5, 6) or "locked" in str(e):
            return False
        raise
    finally:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")


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

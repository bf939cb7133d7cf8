"""The cache's SQLite file: connecting, the schema, the checks and recovery on open, transactions, checkpoints.

``cache.Cache`` is the store built on it (plans, trials, cubins, claims); this module is what makes the file safe
to share and to lose (see ``cache``'s docstring for the guarantees, ``docs/cache.md`` for the trust model): the
``flock`` that serialises opening, ``PRAGMA quick_check`` and the schema version on open, moving a damaged or
foreign file aside, a read-only copy of what can still be read, ``BEGIN IMMEDIATE`` transactions and the
``wal_checkpoint(TRUNCATE)`` after every write.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from .cache_schema import PLAN_FIELDS

try:  # POSIX only; elsewhere opening is not serialised between processes (see _open_lock)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

_T = TypeVar("_T")

SCHEMA_VERSION = 1
"""Bump on any change to the tables below; a file of another version is moved aside, never migrated
(a tuning cache is cheap to rebuild and a half-understood one is worse than none)."""


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
    "plans": PLAN_FIELDS,
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



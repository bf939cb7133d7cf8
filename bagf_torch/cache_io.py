"""``cache export`` and ``cache import``: moving pre-tuned plans between machines without trusting the file.

An export file comes from another machine, maybe another party, so import treats it as input (docs/cache.md
is the trust model in full):

- Every entry is checked against the one row schema (``cache_schema.PlanRecord``, with the family's
  validity rules) and skipped, with one line saying which field, when it fails; the file as a whole is
  refused (``ValueError``) only when it is not an export at all. This needs no GPU, so ``cache import
  --check`` (``read_export``) works on any machine.
- Nothing the file says about identity is believed: the plan key is recomputed from the entry's problem
  and env (``problem.fingerprint``), and the cubin digests from its family, configuration and env with our
  own kernel sources (``jit.compiler``); a mismatching key is refused, the digests are replaced.
- Each plan runs once here on its problem against float64 before it is stored (``local_checker``: the check every
  tuned candidate passes); one that computes wrongly, or whose check cannot run, is skipped.
- By default no byte of the file's cubins is stored: the winners are rebuilt here with NVRTC from our own
  kernel sources (``compiler.build``), and a plan whose kernel does not build is skipped. With
  ``trust_cubins`` the file's cubins are taken as they are, but stored under ``FOREIGN_DIGEST_PREFIX`` +
  digest, a name our compiler never writes: an imported binary can sit beside a kernel we compile, never
  take its place.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from .cache import (EXPORT_FORMAT, FOREIGN_DIGEST_PREFIX, SCHEMA_VERSION, CacheUnavailable, _env_difference,
                    _insert_cubins, _normalise)
from .cache_schema import PlanRecord, SchemaError, check_cubin_row, encodable, entry_label

__all__ = ["EXPORT_FORMAT", "ExportFile", "ForeignCubin", "KernelBuilder", "PlanChecker", "export_cache",
           "import_into", "local_checker", "local_compiler", "read_export"]

logger = logging.getLogger("bagf_torch")

MAX_CUBIN_BYTES = 64 << 20
"""A cubin larger than this is refused: our largest kernels are a few hundred KB."""


class KernelBuilder(Protocol):
    """What import needs to rebuild winners here: ``jit.compiler.KernelCompiler`` on a GPU machine (see
    ``local_compiler``), a fake one in CPU tests. ``build`` compiles each configuration with NVRTC from our
    own sources and stores the cubin in the cache under ``digest(family, config)``; it returns, per
    configuration, None on success or a line saying why it failed."""

    def digest(self, family: Any, config: dict) -> str: ...

    def build(self, family: Any, configs: Sequence[dict]) -> list[str | None]: ...


class PlanChecker(Protocol):
    """What import needs to check a plan before storing it: ``local_checker`` on a GPU machine (the check every
    tuned candidate passes), a fake one in CPU tests. ``check`` runs the plan's kernel on its problem and returns
    None when the answer is right, else a line saying how it is wrong."""

    def check(self, record: PlanRecord) -> str | None: ...


@dataclass(frozen=True)
class ForeignCubin:
    """A cubin entry of an export file that decoded and matched its own sha256 (damage, not provenance)."""

    digest: str
    name: str
    lowered_name: str
    cubin: bytes


@dataclass
class ExportFile:
    """An export file after the checks that need no GPU: ``plans`` holds (position, record) for each entry
    that passed, ``problems`` one line per entry left out and why, ``cubins`` the usable cubin entries by
    the digest the file gives them (only ``trust_cubins`` imports read them)."""

    source: str
    plans: list[tuple[int, PlanRecord]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    cubins: dict[str, ForeignCubin] = field(default_factory=dict)
    cubin_problems: list[str] = field(default_factory=list)


def _cubin_digest_from_env(family: Any, config: dict, env: dict) -> str | None:
    """The digest our compiler gives ``config``'s cubin on a machine with ``env`` (None when ``env`` lacks
    what it takes): the same ``KernelSpec.digest`` the compiler uses, so a plan names the cubin the runtime
    will look up."""
    from .jit.compiler import KernelSpec, is_library
    from .jit.extension import source_hash

    if is_library(family):  # a library call: no cubin to name
        return None
    cc, nvrtc = env.get("cc"), env.get("nvrtc")
    if not isinstance(cc, str) or not re.fullmatch(r"\d+\.\d+", cc) or not isinstance(nvrtc, str):
        return None
    if env.get("kernels") != source_hash():  # not our sources: we could not build it, so name nothing
        return None
    arch = "sm_" + cc.replace(".", "")
    return KernelSpec(family, dict(config), arch).digest(env["kernels"], nvrtc)


def read_export(path: str | os.PathLike) -> ExportFile:
    """Read and check an export file; ValueError (one line: what is wrong, what to do) when it is not a
    bagf_torch export at all. Per-entry problems do not raise: they are in ``problems``."""
    from .kernels import FAMILIES, family_refuses
    from .problem import ConvProblem, fingerprint

    source = Path(path).expanduser()
    try:
        document = json.loads(source.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"cannot import {source}: its JSON is nested too deeply to be a bagf_torch export") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"cannot import {source}: {e}") from e
    if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
        raise ValueError(f"cannot import {source}: not a bagf_torch cache export "
                         f"(expected \"format\": {EXPORT_FORMAT!r})")
    if document.get("schema") != SCHEMA_VERSION:
        schema = document.get("schema")
        shown = schema if isinstance(schema, int) else repr(str(schema)[:20])
        raise ValueError(f"cannot import {source}: export of schema version {shown}, "
                         f"this bagf_torch reads version {SCHEMA_VERSION}; export it again with this version")
    for name in ("plans", "cubins"):
        if not isinstance(document.get(name, []), list):
            raise ValueError(f"cannot import {source}: \"{name}\" must be a list, got "
                             f"{type(document[name]).__name__}; the file is damaged, export it again")
    out = ExportFile(str(source))
    now = time.time()
    seen: dict[str, int] = {}
    for n, entry in enumerate(document.get("plans", [])):
        label = entry_label(entry, n)
        if isinstance(entry, dict) and "created" not in entry:
            entry = dict(entry, created=now)
        try:
            record = PlanRecord.from_mapping(entry, rules=True)
        except SchemaError as e:
            out.problems.append(f"{label}: malformed entry ({e})")
            continue
        if record.family != "aten" and record.family not in FAMILIES:
            out.problems.append(f"{label}: family {record.family!r} is not one of this bagf_torch's "
                                f"({', '.join(FAMILIES)})")
            continue
        problem = ConvProblem.from_dict(record.problem)
        why = family_refuses(record.family, record.config, problem)
        if why is not None:
            out.problems.append(f"{label}: {record.family} does not compute this problem ({why}); refused")
            continue
        expected = fingerprint(problem, record.env)
        if record.key != expected:
            out.problems.append(f"{label}: key does not match its problem and env (recomputed {expected[:16]}); "
                                f"refused, a plan is only stored under the key of what it was tuned for")
            continue
        if record.key in seen:
            out.problems.append(f"{label}: duplicate of entry {seen[record.key]} (same key); the first is used")
            continue
        seen[record.key] = n
        out.plans.append((n, record))
    for n, entry in enumerate(document.get("cubins", [])):
        try:
            cubin = _foreign_cubin(entry)
        except (SchemaError, ValueError, TypeError) as e:
            label = entry.get("digest") if isinstance(entry, dict) and isinstance(entry.get("digest"), str) else n
            out.cubin_problems.append(f"cubin {str(label)[:16]}: {e}")
            continue
        out.cubins.setdefault(cubin.digest, cubin)
    return out


def _foreign_cubin(entry: Any) -> ForeignCubin:
    if not isinstance(entry, dict):
        raise SchemaError("cubin entry", f"must be an object, got {type(entry).__name__}")
    digest, name, encoded = entry.get("digest"), entry.get("name"), entry.get("cubin")
    if not isinstance(digest, str) or not 0 < len(digest) <= 128:
        raise SchemaError("digest", "must be a short string")
    if not isinstance(name, str) or len(name) > 256:
        raise SchemaError("name", "must be a string of at most 256 characters")
    encodable("name", name)
    if not isinstance(encoded, str) or len(encoded) > MAX_CUBIN_BYTES * 4 // 3 + 4:
        raise SchemaError("cubin", f"must be base64 text of at most {MAX_CUBIN_BYTES >> 20} MiB")
    try:
        blob = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise SchemaError("cubin", "is not valid base64") from None
    blob, lowered, sha = check_cubin_row(blob, entry.get("lowered_name"), entry.get("sha256"))
    if hashlib.sha256(blob).hexdigest() != sha:
        raise SchemaError("sha256", "does not match the cubin's bytes (damaged in the file)")
    return ForeignCubin(digest, name, lowered, blob)


def local_compiler(cache) -> KernelBuilder:
    """The builder ``cache import`` uses on a GPU machine: our NVRTC compiler for the current device, storing
    into ``cache``. (Tests replace this function with a fake builder.)"""
    import torch

    from . import settings
    from .jit.compiler import KernelCompiler

    return KernelCompiler(cache, torch.cuda.current_device(), settings.compile_workers())


class _CudaPlanChecker:
    """``local_checker``: loads the plan's kernel with the import's compiler (ours, or a trusted foreign cubin
    already stored), runs it once on fresh random data into a NaN-poisoned output and compares it with float64
    (the checker and workspace of the tuner's own backend, ``tuning.backend.cuda_backend``: its bounds for the
    problem's dtype and TF32 mode), then unloads it."""

    def __init__(self, compiler) -> None:
        import torch

        from .tuning.backend import cuda_backend

        self.compiler = compiler
        self.backend = cuda_backend(torch.cuda.current_device(), compiler)

    def check(self, record: PlanRecord) -> str | None:
        from .kernels import FAMILIES
        from .problem import ConvProblem

        built = self.compiler.compile(FAMILIES[record.family], [record.config])[0]
        if not hasattr(built, "handle"):
            detail = built.detail.splitlines()[0] if built.detail else ""
            return f"its kernel did not load ({built.status}: {detail})"
        try:
            outcome = self.backend.checker.check(self.backend.workspace(ConvProblem.from_dict(record.problem)),
                                                 built.handle)
        finally:
            self.compiler.unload(built.handle)
        return None if outcome is None else f"{outcome.status}: {outcome.detail}"


def local_checker(compiler) -> PlanChecker:
    """The check ``cache import`` runs on a GPU machine before storing each plan, with ``compiler``
    (``local_compiler``'s). (Tests replace it with a fake.)"""
    return _CudaPlanChecker(compiler)


def import_into(cache, source: "str | os.PathLike | ExportFile", env: dict, *, compiler: KernelBuilder | None = None,
                checker: PlanChecker | None = None, trust_cubins: bool = False) -> tuple[int, list[str]]:
    """Import an export file's plans for this machine (``env``) into ``cache``; see ``Cache.import_``."""
    from .jit.compiler import is_library
    from .kernels import FAMILIES

    if cache.path is not None and cache.in_memory:
        raise CacheUnavailable(f"cannot import into {cache.path}: {cache.fallback_reason}; nothing was imported "
                               f"(fix the cache directory, or pass --cache DIR)")
    document = source if isinstance(source, ExportFile) else read_export(source)
    skipped = list(document.problems)
    here = _normalise(env)
    todo: list[tuple[PlanRecord, list[tuple]]] = []  # (record to store, foreign cubin rows to store with it)
    to_build: dict[str, list[PlanRecord]] = {}
    for _, record in document.plans:
        label = f"{record.key[:16]} ({record.family})"
        why = _env_difference(record.env, here)
        if why:
            skipped.append(f"{label}: {why}")
            continue
        if cache.get_plan(record.key) is not None:
            skipped.append(f"{label}: this cache already has a plan for it (kept)")
            continue
        family = None if record.family == "aten" else FAMILIES[record.family]
        if family is None or is_library(family):  # torch's conv, or a library call: no cubin to carry or build
            todo.append((_replace(record, cubin_digests=()), []))
            continue
        file_digest = record.cubin_digests[0] if record.cubin_digests else None
        try:
            digest = compiler.digest(family, record.config) if compiler is not None else \
                _cubin_digest_from_env(family, record.config, record.env)
        except Exception as e:  # (one entry's failure is one skip line, never the whole import's)
            skipped.append(f"{label}: its kernel's digest could not be computed ({type(e).__name__}: "
                           f"{str(e)[:120]}); it will be tuned here instead")
            continue
        record = _replace(record, cubin_digests=() if digest is None else (digest,))
        foreign = document.cubins.get(file_digest) if trust_cubins and file_digest else None
        if foreign is not None and digest is not None:
            todo.append((record, [(FOREIGN_DIGEST_PREFIX + digest, foreign.name, foreign.lowered_name,
                                   foreign.cubin)]))
        elif compiler is not None:
            to_build.setdefault(record.family, []).append(record)
        else:
            # No compiler (a CPU machine, or a caller that only wants the plans): the runtime compiles the
            # kernel from our sources the first time the plan is used.
            todo.append((record, []))
    for family_name, records in to_build.items():
        results = compiler.build(FAMILIES[family_name], [r.config for r in records])
        for record, failure in zip(records, results):
            label = f"{record.key[:16]} ({record.family})"
            if failure is None and cache.get_cubin(record.cubin_digests[0]) is None:
                failure = "the compiled cubin is not in the cache"
            if failure is not None:
                skipped.append(f"{label}: its kernel did not build here from our sources "
                               f"({str(failure).splitlines()[0][:200] if failure else 'no reason given'}); "
                               f"it will be tuned here instead")
                continue
            todo.append((record, []))

    if checker is not None and todo:
        todo = _checked(cache, todo, checker, skipped)

    def store(conn) -> list[bool]:
        written = []
        for record, cubins in todo:
            if cubins:
                _insert_cubins(conn, cubins)
            written.append(conn.execute(
                f"INSERT OR IGNORE INTO plans VALUES ({', '.join('?' * len(record.row()))})",
                record.row()).rowcount == 1)
        return written

    written = cache._write_to_file("import into", store) if todo else []
    for (record, _), ok in zip(todo, written):
        if not ok:
            skipped.append(f"{record.key[:16]} ({record.family}): this cache already has a plan for it (kept)")
    return sum(written), skipped


def _checked(cache, todo: list[tuple[PlanRecord, list[tuple]]], checker: PlanChecker,
             skipped: list[str]) -> list[tuple[PlanRecord, list[tuple]]]:
    """The entries of ``todo`` whose plan gives the right answer here (``checker``), the others' lines added to
    ``skipped``. A file's trusted cubins are stored first, since the check runs the plan as the runtime would
    (a cubin our compiler built is in the cache already); those of a plan that fails are deleted again, unless a
    plan that passed uses them or the cache held them before this import (a plan imported earlier may need them)."""
    foreign = [row for _, cubins in todo for row in cubins]
    added: set[str] = set()
    if foreign:
        def insert(conn) -> set[str]:  # (row by row: a list of digests bound at once can pass SQLite's limit)
            held = {row[0] for row in foreign
                    if conn.execute("SELECT 1 FROM cubins WHERE digest = ?", (row[0],)).fetchone() is not None}
            _insert_cubins(conn, foreign)
            return {row[0] for row in foreign} - held

        added = cache._write_to_file("import into", insert)
    passed, dropped = [], []
    for record, cubins in todo:
        if record.family == "aten":  # torch's own conv: nothing of ours runs
            passed.append((record, cubins))
            continue
        try:
            why = checker.check(record)
        except Exception as e:  # noqa: BLE001 - one plan's failure to check is one skip line, never the import's
            why = f"the check could not run ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
        if why is None:
            passed.append((record, cubins))
            continue
        skipped.append(f"{record.key[:16]} ({record.family}): failed its check here against float64 "
                       f"({why.splitlines()[0][:200]}); it will be tuned here instead")
        dropped.extend(row[0] for row in cubins)
    dropped = sorted((set(dropped) & added) - {row[0] for _, cubins in passed for row in cubins})
    if dropped:
        def delete(conn) -> None:
            conn.executemany("DELETE FROM cubins WHERE digest = ?", [(d,) for d in dropped])

        cache._write_to_file("import into", delete)
    return passed


def _replace(record: PlanRecord, **changes) -> PlanRecord:
    from dataclasses import replace

    return replace(record, **changes)


def export_cache(cache, path: str | os.PathLike) -> int:
    """Write every valid plan of ``cache`` and the cubins it names to ``path``; see ``Cache.export``."""
    plans = cache.plans()  # validated: a row that fails the schema is skipped there, with its log line
    cubins = []
    for digest in sorted({d for plan in plans for d in plan["cubin_digests"]}):
        row = cache._cubin_row(digest) or cache._cubin_row(FOREIGN_DIGEST_PREFIX + digest)
        if row is not None:  # a damaged or missing one is left out; the importer rebuilds it anyway
            name, lowered, blob = row
            cubins.append({"digest": digest, "name": name, "lowered_name": lowered,
                           "sha256": hashlib.sha256(blob).hexdigest(),
                           "cubin": base64.b64encode(blob).decode("ascii")})
    document = {"format": EXPORT_FORMAT, "schema": SCHEMA_VERSION, "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "plans": plans, "cubins": cubins}
    _write_whole(Path(path).expanduser(), json.dumps(document, sort_keys=True, indent=1))
    return len(plans)


def _write_whole(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` whole or not at all: a unique temp file beside it (mkstemp: two threads
    or processes exporting to one path never share one), then a rename. A symlink is followed (the file it
    points to is replaced, the link stays); a FIFO, device or other special file is written directly, since
    renaming over it would replace the special file with a regular one."""
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", str(target))
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        # mkstemp makes it 0600; keep the permissions of the file it replaces, else the usual 0644
        os.chmod(tmp, stat.S_IMODE(mode) if mode is not None else 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

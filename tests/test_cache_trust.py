"""A cache you can trust: an imported file runs no foreign code, and no row can break tuning.

Security: import recomputes keys and digests, refuses configurations outside the family's space, stores no
byte of the file's cubins unless --trust-cubins (and then only under the foreign: namespace), and rebuilds the
winners with the compiler seam production uses (``cache_io.local_compiler``; a fake builder here, NVRTC in the
``cuda`` test). Robustness: rows of the right JSON but the wrong shape are skipped with one log line, and the
file-level failures (foreign tables, a read-only cache, a WAL the read-only copy would skip, a full disk) say
what happened instead of succeeding in memory. CPU tests except the one marked ``cuda``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import threading

import pytest

from bagf_torch import cache as cache_mod
from bagf_torch import cache_io, cli
from bagf_torch.cache import FOREIGN_DIGEST_PREFIX, SCHEMA_VERSION, Cache, CacheUnavailable, default_cache_path
from bagf_torch.jit import extension
from bagf_torch.kernels import implicit_gemm as ig
from bagf_torch.kernels.space import template_expression
from bagf_torch.problem import ConvProblem, fingerprint
from bagf_torch.tuning.warmstart import neighbour_seeds

# An env naming our own kernel sources: digests computed from it are the ones our compiler uses on such a GPU.
ENV = {"gpu": "NVIDIA H200", "cc": "9.0", "driver": 13000, "runtime": 13000, "nvrtc": "13.0", "torch": "2.11.0",
       "bagf_torch": "0.1.0", "kernels": extension.source_hash(), "os": "posix"}
P1 = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
P2 = ConvProblem(n=1, c=192, h=13, w=13, k=384, r=3, s=3, padding=(1, 1))
P1_N2 = ConvProblem(n=2, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))  # P1's neighbour for warm starts
EVIL = b"\x7fELF attacker's kernel"


def real_digest(config=ig.DEFAULT, env=ENV):
    """The digest our compiler gives ``config`` of implicit_gemm on a machine with ``env``."""
    from bagf_torch.jit.compiler import KernelSpec

    return KernelSpec(ig, dict(config), "sm_" + env["cc"].replace(".", "")).digest(env["kernels"], env["nvrtc"])


def plan(problem=P1, config=ig.DEFAULT, family="implicit_gemm", **fields):
    entry = {"key": fingerprint(problem, ENV), "problem": problem.as_dict(), "env": dict(ENV), "family": family,
             "config": config, "time_us": 30.0, "aten_us": 45.0, "default_us": 40.0, "evaluations": 20,
             "tune_seconds": 8.0, "cubin_digests": [], "created": 1.7e9}
    entry.update(fields)
    return entry


def export_file(tmp_path, plans, cubins=(), name="x.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"format": "bagf_torch.cache", "schema": SCHEMA_VERSION, "plans": list(plans),
                                "cubins": list(cubins)}))
    return path


def cubin_entry(digest, blob=EVIL):
    import base64
    import hashlib

    return {"digest": digest, "name": "implicit_gemm_x", "lowered_name": "_Zevil", "sha256": hashlib.sha256(blob).hexdigest(),
            "cubin": base64.b64encode(blob).decode()}


class FakeBuilder:
    """The compiler seam (``cache_io.KernelBuilder``): stores its own bytes under the real digest, as NVRTC
    would; ``fail`` names configurations whose build fails."""

    def __init__(self, cache, fail=()):
        self.cache, self.fail, self.built = cache, set(fail), []

    def digest(self, family, config):
        return real_digest(config)

    def build(self, family, configs):
        out = []
        for config in configs:
            self.built.append(dict(config))
            if family.name(config) in self.fail:
                out.append(f"{family.name(config)}: NVRTC failed (error: too many resources)")
                continue
            self.cache.put_cubin(self.digest(family, config), family.name(config), "_Zours", b"built here")
            out.append(None)
        return out


def all_cubin_bytes(path):
    with sqlite3.connect(path) as raw:
        return {d: bytes(b) for d, b in raw.execute("SELECT digest, cubin FROM cubins")}


# ---- security: what an imported file may not do ---------------------------------------------------------


@pytest.mark.parametrize("with_builder", [False, True])
def test_a_foreign_cubin_under_a_real_digest_never_reaches_the_cache(cache_dir, tmp_path, with_builder):
    # The attack: a plan naming the digest of implicit_gemm's default configuration (which every tuning
    # compiles as a start point), with the attacker's bytes under that digest. First writer wins, so the
    # old import planted them and the next tuning loaded and ran them.
    digest = real_digest()
    path = export_file(tmp_path, [plan(cubin_digests=[digest])], [cubin_entry(digest)])
    with Cache.for_dir(cache_dir) as cache:
        builder = FakeBuilder(cache) if with_builder else None
        imported, skipped = cache.import_(path, ENV, compiler=builder)
        assert (imported, skipped) == (1, [])
        stored = cache.get_plan(fingerprint(P1, ENV))
        assert stored["cubin_digests"] == [digest]  # recomputed, here equal to ours
        if with_builder:
            assert builder.built == [ig.DEFAULT] and cache.get_cubin(digest) == (b"built here", "_Zours")
        else:  # no compiler: the plan alone; the runtime compiles the kernel from our sources on first use
            assert cache.get_cubin(digest) is None
    assert EVIL not in all_cubin_bytes(default_cache_path(cache_dir)).values()


def test_trusted_cubins_live_in_their_own_namespace(cache_dir, tmp_path):
    digest = real_digest()
    path = export_file(tmp_path, [plan(cubin_digests=["their-name"])], [cubin_entry("their-name")])
    with Cache.for_dir(cache_dir) as cache:
        assert cache.import_(path, ENV, compiler=FakeBuilder(cache), trust_cubins=True) == (1, [])
        assert cache.get_cubin(digest) is None  # never under a name our compiler writes or builds
        assert cache.get_cubin(FOREIGN_DIGEST_PREFIX + digest) == (EVIL, "_Zevil")
        assert cache.get_plan(fingerprint(P1, ENV))["cubin_digests"] == [digest]
        with pytest.raises(ValueError, match="reserved for imported cubins"):
            cache.put_cubin(FOREIGN_DIGEST_PREFIX + "x", "n", "_Z", b"x")
        # our own compile of the same configuration is stored beside it, and is what the compiler prefers
        cache.put_cubin(digest, "n", "_Zours", b"ours")
        assert cache.get_cubin(digest) == (b"ours", "_Zours")


def test_trust_mode_rebuilds_what_the_file_lacks(cache_dir, tmp_path):
    path = export_file(tmp_path, [plan(cubin_digests=["missing"])])
    with Cache.for_dir(cache_dir) as cache:
        builder = FakeBuilder(cache)
        assert cache.import_(path, ENV, compiler=builder, trust_cubins=True) == (1, [])
        assert builder.built == [ig.DEFAULT] and cache.get_cubin(real_digest()) == (b"built here", "_Zours")


def test_configurations_outside_the_space_are_refused(cache_dir, tmp_path):
    bad = [dict(ig.DEFAULT, BM=7), dict(ig.DEFAULT, BM="64, 64>(); evil<1"), dict(ig.DEFAULT, BM=64.0),
           dict(ig.DEFAULT, BM=True), dict(ig.DEFAULT, EXTRA=1), {k: v for k, v in ig.DEFAULT.items() if k != "BM"},
           dict(ig.DEFAULT, TM=8, BM=16, TN=8, BN=16)]  # 4 threads per block: values in range, rule fails
    path = export_file(tmp_path, [plan(P1 if i % 2 else P2, config=c, evaluations=i) for i, c in enumerate(bad)])
    with Cache(None) as cache:
        imported, skipped = cache.import_(path, ENV)
        assert imported == 0 and cache.plans() == []
    assert len(skipped) == len(bad)
    assert "config.BM: 7 is not one of implicit_gemm's" in skipped[0]
    assert all("config" in line for line in skipped), skipped
    assert "outside implicit_gemm's space" in skipped[-1]


def test_a_key_that_is_not_its_problems_is_refused(cache_dir, tmp_path):
    # A plan for P1 stored under P2's key would make every P2 call launch P1's winner.
    path = export_file(tmp_path, [plan(P1, key=fingerprint(P2, ENV))])
    with Cache(None) as cache:
        imported, skipped = cache.import_(path, ENV)
        assert imported == 0 and cache.get_plan(fingerprint(P2, ENV)) is None
    assert "key does not match its problem and env" in skipped[0]


def test_a_plan_for_a_problem_its_family_does_not_compute_is_refused(cache_dir, tmp_path):
    """A TF32 plan (one TF32 product per multiply) filed under a strict-fp32 problem would hand a strict caller
    TF32's error; a Winograd plan under a 5x5 problem, a direct kernel under another filter geometry: refused by
    the family's own rules (``applies``, ``problem_rule``), as the tuner would never have produced them. The
    same TF32 plan under its TF32 problem is imported."""
    import dataclasses

    from bagf_torch.kernels import direct, implicit_gemm_tf32 as t32, winograd

    p1_tf32 = dataclasses.replace(P1, tf32=True)
    other_geometry = next(dict(direct.DEFAULT, G=g) for g in direct.GEOMETRIES
                          if g and direct.problem_rule(dict(direct.DEFAULT, G=g), P1) is not None)
    bad = [plan(P1, config=t32.DEFAULT, family=t32.FAMILY), plan(P1, config=winograd.DEFAULT, family=winograd.FAMILY),
           plan(P1, config=other_geometry, family=direct.FAMILY)]
    good = plan(p1_tf32, config=t32.DEFAULT, family=t32.FAMILY)
    with Cache(None) as cache:
        imported, skipped = cache.import_(export_file(tmp_path, bad + [good]), ENV)
        assert imported == 1 and [p["family"] for p in cache.plans()] == [t32.FAMILY]
        assert cache.plans()[0]["problem"]["tf32"] is True
    assert len(skipped) == 3 and all("does not compute this problem" in line for line in skipped), skipped
    assert "TF32 mode only" in skipped[0] and "compiled for" in skipped[2]


def test_a_plan_whose_kernel_does_not_build_here_is_skipped(cache_dir, tmp_path):
    other = dict(ig.DEFAULT, BK=16)
    path = export_file(tmp_path, [plan(P1), plan(P2, config=other)])
    with Cache(None) as cache:
        builder = FakeBuilder(cache, fail={ig.name(other)})
        imported, skipped = cache.import_(path, ENV, compiler=builder)
        assert imported == 1 and cache.get_plan(fingerprint(P2, ENV)) is None
    assert len(skipped) == 1 and "its kernel did not build here" in skipped[0] and "too many resources" in skipped[0]


class FakeChecker:
    """The float64 check seam (``cache_io.PlanChecker``): ``wrong`` names configurations (family names) whose
    answer is wrong here, ``raising`` those whose check raises; ``cubins`` records, per check, the cubin the
    runtime would load (ours, else a trusted foreign one), which must be in the cache by then."""

    def __init__(self, cache, wrong=(), raising=()):
        self.cache, self.wrong, self.raising, self.cubins = cache, set(wrong), set(raising), []

    def check(self, record):
        name = ig.name(record.config)
        digest = record.cubin_digests[0]
        self.cubins.append(self.cache.get_cubin(digest) or self.cache.get_cubin(FOREIGN_DIGEST_PREFIX + digest))
        if name in self.raising:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return "wrong: relative error 3.1e-01 (max 2.0e+00) > 1e-05 (max 0.0001)" if name in self.wrong else None


@pytest.mark.parametrize("trust", [False, True])
def test_a_plan_that_fails_its_check_here_never_reaches_the_cache(cache_dir, tmp_path, trust):
    # A configuration of our space can still compute a problem wrongly (a kernel bug the space's rules miss,
    # or, with --trust-cubins, a binary that is not what its name says): each imported plan runs once against
    # float64 before it is stored, as every tuned candidate does; a failing or crashing check skips that plan.
    wrong, crashing = dict(ig.DEFAULT, BK=16), dict(ig.DEFAULT, BM=32)
    p3 = ConvProblem(n=3, c=8, h=12, w=10, k=20, r=3, s=3, padding=(1, 1))
    entries = [plan(P1, cubin_digests=["d0"]), plan(P2, config=wrong, cubin_digests=["d1"]),
               plan(p3, config=crashing, cubin_digests=["d2"]), plan(P1_N2, family="aten", config=None)]
    cubins = [cubin_entry("d0", b"\x7fELF right"), cubin_entry("d1", b"\x7fELF wrong"),
              cubin_entry("d2", b"\x7fELF crash")]
    path = export_file(tmp_path, entries, cubins)
    with Cache.for_dir(cache_dir) as cache:
        checker = FakeChecker(cache, wrong={ig.name(wrong)}, raising={ig.name(crashing)})
        imported, skipped = cache.import_(path, ENV, compiler=FakeBuilder(cache), checker=checker,
                                          trust_cubins=trust)
        assert imported == 2 and len(skipped) == 2, skipped
        assert cache.get_plan(fingerprint(P1, ENV)) is not None and cache.get_plan(fingerprint(P1_N2, ENV))
        assert cache.get_plan(fingerprint(P2, ENV)) is None and cache.get_plan(fingerprint(p3, ENV)) is None
        assert "failed its check here against float64 (wrong: relative error 3.1e-01" in skipped[0]
        assert "the check could not run (RuntimeError: CUDA error: an illegal memory access" in skipped[1]
        assert all("it will be tuned here instead" in line for line in skipped)
        assert len(checker.cubins) == 3 and None not in checker.cubins  # every check ran with its kernel there
        if trust:  # the file's cubins were what ran; the failing plans' ones are gone again
            assert [c[0] for c in checker.cubins] == [b"\x7fELF right", b"\x7fELF wrong", b"\x7fELF crash"]
            assert cache.get_cubin(FOREIGN_DIGEST_PREFIX + real_digest()) == (b"\x7fELF right", "_Zevil")
            assert cache.get_cubin(FOREIGN_DIGEST_PREFIX + real_digest(wrong)) is None
            assert cache.get_cubin(FOREIGN_DIGEST_PREFIX + real_digest(crashing)) is None
        else:
            assert {c[0] for c in checker.cubins} == {b"built here"}


class ByProblem:
    """A float64 check that fails the plans of the problems in ``wrong`` (whatever their configuration)."""

    def __init__(self, wrong):
        self.wrong, self.checked = set(wrong), []

    def check(self, record):
        self.checked.append(record.family)
        return "wrong: relative error 3.1e-01" if ConvProblem.from_dict(record.problem) in self.wrong else None


def test_a_failed_check_keeps_the_trusted_cubins_other_plans_use(cache_dir, tmp_path):
    # One configuration serves many problems, so one foreign cubin can back several plans: a plan that fails its
    # check takes its cubin away only if this import stored it and no plan that passed uses it. A library plan
    # (cuBLASLt: no cubin) goes through the same check.
    from bagf_torch.kernels import cublaslt_1x1 as lt

    one = ConvProblem(n=2, c=64, h=14, w=14, k=32, r=1, s=1)
    foreign = FOREIGN_DIGEST_PREFIX + real_digest()
    first = export_file(tmp_path, [plan(P1, cubin_digests=["d0"])], [cubin_entry("d0", b"\x7fELF first")], "a.json")
    second = export_file(tmp_path, [plan(P2, cubin_digests=["d1"]), plan(P1_N2, cubin_digests=["d1"]),
                                    plan(one, config=lt.default_for(one), family=lt.FAMILY)],
                         [cubin_entry("d1", b"\x7fELF second")], "b.json")
    with Cache.for_dir(cache_dir) as cache:
        assert cache.import_(first, ENV, compiler=FakeBuilder(cache), checker=ByProblem(()),
                             trust_cubins=True) == (1, [])
        checker = ByProblem({P2, P1_N2, one})
        imported, skipped = cache.import_(second, ENV, compiler=FakeBuilder(cache), checker=checker,
                                          trust_cubins=True)
        assert imported == 0 and len(skipped) == 3 and checker.checked == ["implicit_gemm"] * 2 + [lt.FAMILY]
        assert cache.get_plan(fingerprint(P1, ENV))
        assert cache.get_cubin(foreign) == (b"\x7fELF first", "_Zevil")  # held before: the first plan's
    with Cache.for_dir(tmp_path / "fresh") as cache:  # within one import: a plan that passed keeps it
        imported, skipped = cache.import_(second, ENV, compiler=FakeBuilder(cache), checker=ByProblem({P2}),
                                          trust_cubins=True)
        assert imported == 2 and cache.get_cubin(foreign) == (b"\x7fELF second", "_Zevil")
    with Cache.for_dir(tmp_path / "alone") as cache:  # its only plan failed: the cubin this import stored is gone
        path = export_file(tmp_path, [plan(P2, cubin_digests=["d1"])], [cubin_entry("d1", b"\x7fELF second")])
        assert cache.import_(path, ENV, compiler=FakeBuilder(cache), checker=ByProblem({P2}),
                             trust_cubins=True)[0] == 0
        assert cache.get_cubin(foreign) is None


def test_the_name_expression_takes_integers_only():
    assert ig.name_expression(ig.DEFAULT) == "bagf::implicit_gemm_conv2d<64, 64, 8, 4, 4, 1, 4>"
    for value in ("64>(); int x<1", 64.0, True, None):
        with pytest.raises(TypeError, match="must be an integer"):
            template_expression("bagf::k", ("A",), {"A": value})


def test_cache_check_runs_without_a_gpu_and_import_reports_before_needing_one(tmp_path, monkeypatch, capsys):
    path = export_file(tmp_path, [plan(), plan(P2, config=dict(ig.DEFAULT, BM=7))])
    assert cli.main(["cache", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "1 plans pass the checks, 1 would be skipped" in out and "config.BM: 7 is not one of" in out

    def no_gpu():
        raise cli.UsageError("cache import needs this machine's CUDA GPU to check entries against it")

    monkeypatch.setattr(cli, "this_machine_env", no_gpu)
    assert cli.main(["cache", "import", str(path), "--cache", str(tmp_path / "p")]) == 2
    captured = capsys.readouterr()
    assert "config.BM: 7 is not one of" in captured.out and "needs this machine's CUDA GPU" in captured.err
    assert not (tmp_path / "p").exists()
    (tmp_path / "bad.json").write_text('{"format": "bagf_torch.cache", "schema": 1, "plans": 5}')
    assert cli.main(["cache", "import", str(tmp_path / "bad.json")]) == 2  # the file's fault, not the GPU's
    assert "\"plans\" must be a list" in capsys.readouterr().err


# ---- robustness: rows of the right JSON and the wrong shape --------------------------------------------


BAD_COLUMNS = {
    "time_us": "'fast'",
    "evaluations": "3.5",
    "config": "'{\"BM\": 64}'",
    "cubin_digests": "'null'",
    "env": "'[1, 2]'",
    "problem": "'" + json.dumps(dict(P1.as_dict(), stride=[0, 0])) + "'",
}


def test_rows_of_the_wrong_shape_are_skipped_with_one_line_each(cache_dir, tmp_path, warnings_log, capsys,
                                                                 monkeypatch):
    path = default_cache_path(cache_dir)
    with Cache(path) as cache:
        cache.put_plan("good", **{k: v for k, v in plan(P1_N2).items() if k not in ("key", "created")})
        for column in BAD_COLUMNS:
            cache.put_plan(column, **{k: v for k, v in plan().items() if k not in ("key", "created")})
    with sqlite3.connect(path) as raw:
        for column, value in BAD_COLUMNS.items():
            raw.execute(f"UPDATE plans SET {column} = {value} WHERE key = ?", (column,))
    with Cache(path) as cache:
        assert [p["key"] for p in cache.plans()] == ["good"]
        assert all(cache.get_plan(column) is None for column in BAD_COLUMNS)
        lines = [r.getMessage() for r in warnings_log]
        assert len(lines) == len(BAD_COLUMNS)  # one per key, however often it is read
        for column in BAD_COLUMNS:
            assert any(f"plan {column} is damaged or malformed ({column}" in line for line in lines), (column, lines)
        # every consumer goes on: warm start, export, list, report
        assert neighbour_seeds(P1, cache.plans(), ENV) == [("implicit_gemm", ig.DEFAULT)]
        assert cache.export(tmp_path / "e.json") == 1
        # the next put_plan for a bad row's key replaces it
        assert cache.put_plan("time_us", **{k: v for k, v in plan().items() if k not in ("key", "created")})
        assert cache.get_plan("time_us")["time_us"] == 30.0
    monkeypatch.setenv("BAGF_CACHE_DIR", str(cache_dir))
    assert cli.main(["cache", "list"]) == 0 and "2 plans" in capsys.readouterr().out
    assert cli.main(["report", "--peak-tflops", "60", "--bandwidth-gbs", "4000"]) == 0


def test_warm_start_survives_plans_that_did_not_come_through_the_cache():
    good = plan(P1_N2)
    rows = [dict(good, problem=dict(P1_N2.as_dict(), stride=[0, 0])), dict(good, env=[1, 2]), dict(good, config={"BM": 7}),
            dict(good, problem="nope"), "not a dict", dict(good, family=None), good]
    assert neighbour_seeds(P1, rows, ENV) == [("implicit_gemm", ig.DEFAULT)]


def test_a_file_of_our_version_with_other_tables_is_moved_aside(cache_dir, warnings_log):
    path = default_cache_path(cache_dir)
    with sqlite3.connect(path) as raw:
        raw.execute("CREATE TABLE notes (t TEXT)")
        raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    with Cache(path) as cache:
        assert not cache.in_memory and cache.plans() == []
        assert cache.put_plan("k", **{k: v for k, v in plan().items() if k not in ("key", "created")})
    assert len(list(cache_dir.glob("*.not-bagf-*"))) == 1
    assert len(warnings_log) == 1 and "table plans is missing" in warnings_log[0].getMessage()


def test_read_only_copy_includes_what_is_still_in_the_wal(cache_dir, warnings_log, monkeypatch):
    path = default_cache_path(cache_dir)
    # keep the commit in the WAL, as a process killed between its commit and the checkpoint would
    monkeypatch.setattr(cache_mod, "_checkpoint", lambda conn: False)
    writer = Cache(path)
    writer._conn.execute("PRAGMA wal_autocheckpoint = 0")
    writer.put_plan("warm", **{k: v for k, v in plan().items() if k not in ("key", "created")})
    snapshot = cache_dir / "ro"
    snapshot.mkdir()
    for suffix in ("", "-wal"):  # the image a read-only deployment would get: file and WAL, no -shm
        shutil.copyfile(str(path) + suffix, snapshot / (path.name + suffix))
    writer.close()
    assert (snapshot / (path.name + "-wal")).stat().st_size > 0  # the plan is only in the WAL

    def refuse(p):
        raise PermissionError(13, "Permission denied", str(p) + ".lock")

    monkeypatch.setattr(cache_mod, "_open_lock", refuse)
    with Cache(snapshot / path.name) as cache:
        assert cache.in_memory and cache.get_plan("warm") is not None


def test_clear_and_import_say_when_the_file_cannot_be_changed(cache_dir, tmp_path, monkeypatch, capsys):
    path = default_cache_path(cache_dir)
    with Cache(path) as cache:
        cache.put_plan("k", **{k: v for k, v in plan().items() if k not in ("key", "created")})

    def refuse(p):
        raise PermissionError(13, "Permission denied", str(p) + ".lock")

    monkeypatch.setattr(cache_mod, "_open_lock", refuse)
    with Cache(path) as cache:
        with pytest.raises(CacheUnavailable, match="cannot clear"):
            cache.clear()
        with pytest.raises(CacheUnavailable, match="cannot import into"):
            cache.import_(export_file(tmp_path, [plan()]), ENV)
    monkeypatch.setenv("BAGF_CACHE_DIR", str(cache_dir))
    assert cli.main(["cache", "clear"]) == 2 and "cannot clear" in capsys.readouterr().err
    monkeypatch.undo()
    with Cache(path) as cache:
        assert cache.get_plan("k") is not None  # untouched, and nobody said otherwise


def test_import_into_a_cache_that_falls_back_mid_import_reports_failure(cache_dir, tmp_path):
    path = default_cache_path(cache_dir)
    cache = Cache(path)
    pages = cache._conn.execute("PRAGMA page_count").fetchone()[0]
    cache._conn.execute(f"PRAGMA max_page_count = {pages}")  # disk full at the first write
    big = [plan(ConvProblem(n=n, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2)), tune_seconds=float(n))
           for n in range(1, 200)]
    with pytest.raises(CacheUnavailable, match="the file was not changed"):
        cache.import_(export_file(tmp_path, big), ENV)
    cache.close()
    with Cache(path) as reopened:
        assert reopened.plans() == []


def test_disk_full_while_creating_the_schema_reports_the_real_reason():
    conn = cache_mod._connect(":memory:")
    conn.execute("PRAGMA max_page_count = 1")
    with pytest.raises(sqlite3.Error) as e:
        cache_mod._create_schema(conn)
    assert "full" in str(e.value) and "cannot rollback" not in str(e.value)


def test_export_from_threads_to_one_path_and_through_a_symlink(cache_dir, tmp_path):
    with Cache.for_dir(cache_dir) as cache:
        cache.put_plan(fingerprint(P1, ENV), **{k: v for k, v in plan().items() if k not in ("key", "created")})
        errors = []

        def export():
            try:
                for _ in range(20):
                    cache.export(tmp_path / "same.json")
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=export) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len(json.loads((tmp_path / "same.json").read_text())["plans"]) == 1
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

        real = tmp_path / "real.json"
        real.write_text("old")
        link = tmp_path / "link.json"
        link.symlink_to(real)
        cache.export(link)
        assert link.is_symlink() and json.loads(real.read_text())["plans"][0]["family"] == "implicit_gemm"
        if hasattr(os, "mkfifo"):  # a special file is written, not replaced by a regular one
            fifo = tmp_path / "fifo"
            os.mkfifo(fifo)
            chunks = []
            reader = threading.Thread(target=lambda: chunks.append(open(fifo).read()))
            reader.start()
            cache.export(fifo)
            reader.join(timeout=10)
            assert fifo.is_fifo() and json.loads(chunks[0])["plans"]


# ---- GPU: the real rebuild ---------------------------------------------------------------------------


@pytest.mark.cuda
def test_gpu_import_rebuilds_with_nvrtc_and_never_loads_the_files_bytes(cache_dir, tmp_path):
    import torch

    from bagf_torch import runtime
    from bagf_torch.jit.compiler import STATS
    from bagf_torch.jit.extension import environment

    env = environment(torch.cuda.current_device())
    problem = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
    entry = dict(plan(problem), env=env, key=fingerprint(problem, env))
    with Cache.for_dir(cache_dir) as cache:
        compiler = cache_io.local_compiler(cache)
        digest = compiler.digest(ig, ig.DEFAULT)
        path = export_file(tmp_path, [dict(entry, cubin_digests=[digest])], [cubin_entry(digest)])
        before = STATS.nvrtc_compiles
        assert cache.import_(path, env, compiler=compiler, checker=cache_io.local_checker(compiler)) == (1, [])
        assert STATS.nvrtc_compiles == before + 1  # rebuilt here from our sources (and checked with that build)
        cubin, _ = cache.get_cubin(digest)
        assert cubin != EVIL and cubin[:4] == b"\x7fELF"
        built = compiler.compile(ig, [ig.DEFAULT])[0]  # what the runtime does with the plan: loads ours
        assert hasattr(built, "handle"), built
        compiler.unload(built.handle)
    runtime.reset()


def test_a_plan_recorded_before_its_familys_newer_knobs_imports_with_their_legacy_values(cache_dir, tmp_path):
    """An entry that lacks knobs its family gained later (as a hand-made or older file may) is stored with them at
    the values such configurations ran (``complete_config``): its kernel compiles and launches, where the bare
    configuration made the import's digest raise (every entry lost) or left the problem on cuDNN for good."""
    from bagf_torch.kernels import FAMILIES, family_refuses

    h16 = FAMILIES["implicit_gemm_h16"]
    problem = ConvProblem(n=8, c=64, h=28, w=28, k=64, r=3, s=3, padding=(1, 1), dtype="float16", layout="nhwc")
    full = next(c for c in h16.space().valid_configs()
                if c["SPLIT"] == 1 and c["ST"] == 2 and family_refuses(h16.FAMILY, c, problem) is None)
    bare = {k: v for k, v in full.items() if k not in h16.LEGACY}
    path = export_file(tmp_path, [plan(problem, config=bare, family=h16.FAMILY), plan(P2)])
    with Cache.for_dir(cache_dir) as cache:
        assert cache.import_(path, ENV) == (2, [])
        stored = cache.get_plan(fingerprint(problem, ENV))["config"]
        assert stored == full
        h16.launch(stored)  # what loading the plan does with it

    class Raising(FakeBuilder):
        def digest(self, family, config):
            if family.FAMILY == "implicit_gemm":
                raise KeyError("GE")
            return "built-" + family.name(config)

    path = export_file(tmp_path, [plan(P1), plan(problem, config=bare, family=h16.FAMILY)], name="y.json")
    with Cache(None) as cache:
        imported, skipped = cache.import_(path, ENV, compiler=Raising(cache))
        assert imported == 1 and len(skipped) == 1 and "digest could not be computed (KeyError" in skipped[0], skipped


def test_text_a_lone_surrogate_spoils_is_refused_and_reported_printably(cache_dir, tmp_path, capsys):
    """JSON can carry "\\ud800", which no UTF-8 file, database or terminal takes: an entry key, a field or a cubin
    name holding one is a skipped entry with a printable label, never a UnicodeEncodeError out of import or check."""
    path = export_file(tmp_path, [plan(key="\ud800bad"), plan(P2, family="\udcff")],
                       [dict(cubin_entry("d0"), name="\ud800")])
    assert cli.main(["cache", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "\\ud800bad" in out and "0 plans pass the checks, 2 would be skipped" in out
    path = export_file(tmp_path, [plan(cubin_digests=["d0"])], [dict(cubin_entry("d0"), name="\ud800")], name="y.json")
    with Cache.for_dir(cache_dir) as cache:
        assert cache.import_(path, ENV, compiler=FakeBuilder(cache), trust_cubins=True) == (1, [])
        assert cache.get_cubin(FOREIGN_DIGEST_PREFIX + real_digest()) is None  # the file's cubin was refused
        assert cache.get_cubin(real_digest()) == (b"built here", "_Zours")  # and rebuilt from our sources


def test_the_launch_code_is_in_every_key_beside_the_kernel_sources(tmp_path, monkeypatch):
    """A plan was checked and timed under the host code that launches it (the extension's C++, the families'
    launch geometry and rules), which the kernel hash does not cover and bagf_torch's version did not follow: its
    hash is a field of the env (so of every key) that moves with any such file, and not with the kernels' (cubin
    digests stay valid)."""
    checkout = extension.host_hash()
    src = tmp_path / "_csrc"  # (as an installed package names the folder)
    shutil.copytree(extension.csrc_dir(), src)
    monkeypatch.setattr(extension, "csrc_dir", lambda: src)
    host, kernels = extension.host_hash(), extension.source_hash()
    assert host == checkout  # the same sources hash the same wherever they are installed
    (src / "cublaslt_plan.h").write_text((src / "cublaslt_plan.h").read_text() + "\n// changed\n")
    assert extension.host_hash() != host and extension.source_hash() == kernels
    (src / "cublaslt_plan.h").write_text((src / "cublaslt_plan.h").read_text().replace("\n// changed\n", ""))
    assert extension.host_hash() == host
    env = dict(ENV, host=host)
    assert fingerprint(P1, env) != fingerprint(P1, dict(env, host=extension.host_hash()[::-1]))
    import types

    import torch

    # this machine's env (a CPU here: the extension's versions and the device's properties stood in for)
    monkeypatch.setattr(extension, "load", lambda: types.SimpleNamespace(
        versions=lambda: {"driver": 13000, "runtime": 13000, "nvrtc": "13.0"}))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0))
    here = extension.environment(0)
    assert here["host"] == host and here["kernels"] == kernels


def test_a_cubin_digest_does_not_depend_on_where_the_sources_are_installed(tmp_path, monkeypatch):
    """NVRTC reads the kernels from the install's folder (its include path), but the same sources compile to the
    same cubin anywhere: a venv per job sharing one cache finds the cubins another install compiled (the include
    path was in the digest, and every winner was compiled again on first use)."""
    from bagf_torch.jit.compiler import KernelSpec

    spec = KernelSpec(ig, dict(ig.DEFAULT), "sm_90")
    here, options = spec.digest("src", "13.0"), spec.options()
    elsewhere = tmp_path / "venv" / "_csrc" / "kernels"
    monkeypatch.setattr(extension, "kernels_dir", lambda: elsewhere)
    assert spec.options() != options and f"--include-path={elsewhere}" in spec.options()
    assert spec.digest("src", "13.0") == here
    assert spec.digest("other", "13.0") != here
    assert KernelSpec(ig, dict(ig.DEFAULT), "sm_80").digest("src", "13.0") != here

"""CPU tests of the command line: arguments, one-line errors with exit status 2, cache export/import
validation with a synthetic cache, and the report's table and roofline plot with given ceilings."""

from __future__ import annotations

import json
import subprocess
import textwrap
import sys

import pytest
import torch

from bagf_torch import cache_io, cli
from bagf_torch.cache import Cache
from bagf_torch.kernels import implicit_gemm as ig
from bagf_torch.problem import ConvProblem, fingerprint

ENV = {"gpu": "NVIDIA H200", "cc": "9.0", "driver": 13000, "runtime": 13000, "nvrtc": "13.0", "torch": "2.11.0",
       "bagf_torch": "0.1.0", "kernels": "abc", "os": "posix"}
CPU_ONLY = torch.version.cuda is None or not torch.cuda.is_available()


def _one_line_error(capsys, argv, *needles):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def _returns_2_with_one_line(capsys, argv, *needles):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_parse_batches():
    assert cli.parse_batches("1,32,128") == [1, 32, 128]
    assert cli.parse_batches(" 8 ,8, 1") == [8, 1]
    for bad, needle in [("", "empty"), ("1,,2", "'' is not a whole number"), ("a", "'a' is not"),
                        ("0", "at least 1"), ("-3", "at least 1"), ("1.5", "not a whole number")]:
        with pytest.raises(ValueError, match=needle):
            cli.parse_batches(bad)


def test_arguments_parse():
    args = cli.build_parser().parse_args(["tune", "--model", "alexnet", "--batch", "1,32", "--budget", "12",
                                          "--cache", "/tmp/x", "--strategy", "random", "--no-progress"])
    assert (args.cmd, args.model, args.batch, args.budget, args.cache, args.strategy, args.progress) == \
        ("tune", "alexnet", [1, 32], 12, "/tmp/x", "random", False)
    args = cli.build_parser().parse_args(["bench"])
    assert args.batch == [1, 32, 128] and args.model == "alexnet" and args.runs == 200 and args.children is None
    assert cli.build_parser().parse_args(["bench", "--children", "5"]).children == 5
    args = cli.build_parser().parse_args(["report", "--plot", "r.png", "--peak-tflops", "60", "--bandwidth-gbs", "4000"])
    assert (args.plot, args.peak_tflops, args.bandwidth_gbs) == ("r.png", 60.0, 4000.0)


def test_usage_errors_are_one_line_exit_2(capsys):
    _one_line_error(capsys, ["tune", "--batch", "1,x"], "'x' is not a whole number", "--help")
    _one_line_error(capsys, ["bench", "--batch", "0"], "at least 1")
    _one_line_error(capsys, ["tune", "--budget", "0"], "--budget must be at least 1")
    _one_line_error(capsys, ["frobnicate"], "invalid choice")
    _one_line_error(capsys, ["cache", "export"], "needs a FILE")
    _one_line_error(capsys, ["cache", "import", "/no/such/file.json"], "no such file")
    _one_line_error(capsys, ["bench", "--runs", "0"], "--runs must be at least 1")
    for bad in ("0", "-2"):
        _one_line_error(capsys, ["bench", "--children", bad], f"--children must be at least 1, got {bad}")
    for bad in ("2.5", "x"):
        _one_line_error(capsys, ["bench", "--children", bad], "invalid int value")
    _one_line_error(capsys, ["tune", "--seed", "-1"], "--seed must be at least 0")
    for value in ("0", "-5", "nan", "inf"):
        _one_line_error(capsys, ["report", "--peak-tflops", value, "--bandwidth-gbs", "4000"],
                        "must be a number above 0")


def test_result_files_that_cannot_be_written_are_refused_before_the_work(capsys, tmp_path):
    """--json and --plot paths are checked when the command starts: they were opened only after the whole tuning
    or benchmark, which then ended in a traceback (bench's results lost)."""
    (tmp_path / "sub").mkdir()
    for argv, needle in [(["tune", "--json", str(tmp_path / "no" / "r.json")], "does not exist"),
                         (["bench", "--json", str(tmp_path / "no" / "r.json")], "does not exist"),
                         (["tune", "--json", str(tmp_path / "sub")], "is a folder"),
                         (["report", "--plot", str(tmp_path / "p.txt")], "must end in .png"),
                         (["report", "--plot", str(tmp_path / "no" / "p.png")], "does not exist")]:
        _one_line_error(capsys, argv, needle)


def test_a_reader_of_stdout_that_goes_away_ends_the_command_quietly(tmp_path):
    """``cache list | head -1``: the command's prints meet a closed pipe; it ends with status 1 and no traceback (one
    came out of the middle of the listing)."""
    from bagf_torch.problem import ConvProblem as Problem

    cache_dir = tmp_path / "cache"
    with Cache.for_dir(cache_dir) as cache:
        for n in range(1, 400):
            p = Problem(n=n, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
            cache.put_plan(fingerprint(p, ENV), problem=p.as_dict(), env=ENV, family="aten", config=None,
                           time_us=20.0, aten_us=20.0, default_us=None, evaluations=1, tune_seconds=1.0)
    proc = subprocess.Popen([sys.executable, "-m", "bagf_torch", "cache", "list", "--cache", str(cache_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()  # (head has read its line and gone)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1 and "Traceback" not in err, err


def test_unknown_model_and_missing_torchvision(capsys):
    _returns_2_with_one_line(capsys, ["tune", "--model", "vgg"], "unknown model 'vgg'", "torchvision:resnet18")
    _returns_2_with_one_line(capsys, ["bench", "--model", "nope"], "unknown model 'nope'")
    try:
        import torchvision  # noqa: F401
    except ImportError:
        _returns_2_with_one_line(capsys, ["tune", "--model", "torchvision:resnet18"], "pip install torchvision")
    else:
        _returns_2_with_one_line(capsys, ["tune", "--model", "torchvision:nope"], "no classification model")


@pytest.mark.skipif(not CPU_ONLY, reason="a GPU is visible: the commands would run")
def test_gpu_commands_without_gpu_say_so(capsys, tmp_path):
    _returns_2_with_one_line(capsys, ["tune", "--model", "alexnet", "--batch", "1"], "tune needs a CUDA GPU")
    _returns_2_with_one_line(capsys, ["bench", "--batch", "1"], "bench needs a CUDA GPU")
    _returns_2_with_one_line(capsys, ["report", "--plot", str(tmp_path / "r.png")], "--peak-tflops")
    assert not (tmp_path / "r.png").exists()


def test_gpu_problem_names_missing_toolkit(monkeypatch):
    """On a GPU machine without the CUDA toolkit the build error's first line is the message."""
    from bagf_torch.jit import extension

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_toolkit():
        raise extension.BuildError("the CUDA toolkit was not found (no CUDA_HOME, no nvcc on PATH). Install it.\n"
                                   "more detail")

    monkeypatch.setattr(extension, "load", no_toolkit)
    why = cli.gpu_problem("tune")
    assert why == "tune: the CUDA toolkit was not found (no CUDA_HOME, no nvcc on PATH). Install it."


def test_error_in_a_real_process_is_one_line_exit_2():
    res = subprocess.run([sys.executable, "-m", "bagf_torch", "tune", "--model", "lenet"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and "unknown model 'lenet'" in res.stderr


# ---- cache export / import --------------------------------------------------------------------------

P1 = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
P2 = ConvProblem(n=32, c=192, h=13, w=13, k=384, r=3, s=3, padding=(1, 1))


def _synthetic_cache(directory, env=ENV):
    cubin = b"\x7fELF fake cubin"
    with Cache.for_dir(directory) as cache:
        cache.put_cubin("d1", ig.name(ig.DEFAULT), "_Z1k", cubin)
        cache.put_plan(fingerprint(P1, env), problem=P1.as_dict(), env=env, family="implicit_gemm",
                       config=ig.DEFAULT, time_us=30.0, aten_us=45.0, default_us=40.0, evaluations=20,
                       tune_seconds=8.0, cubin_digests=["d1"])
        cache.put_plan(fingerprint(P2, env), problem=P2.as_dict(), env=env, family="aten", config=None,
                       time_us=200.0, aten_us=200.0, default_us=480.0, evaluations=20, tune_seconds=7.0)


class _FakeBuilder:
    """Stands in for the NVRTC compiler that ``cache import`` rebuilds winners with (cache_io.local_compiler):
    it stores its own bytes under its own digest, as the real one stores what NVRTC made."""

    def __init__(self, cache):
        self.cache, self.built = cache, []

    def digest(self, family, config):
        return "ours-" + family.name(config)

    def build(self, family, configs):
        for config in configs:
            self.built.append(family.name(config))
            self.cache.put_cubin(self.digest(family, config), family.name(config), "_Zours", b"built here")
        return [None] * len(configs)


class _FakeChecker:
    """Stands in for the float64 check ``cache import`` runs on each plan (cache_io.local_checker): ``wrong``
    names the plans (by family name) whose answer it calls wrong."""

    def __init__(self, wrong=()):
        self.wrong, self.checked = set(wrong), []

    def check(self, record):
        self.checked.append(record.family)
        return "wrong: relative error 3.1e-01 (max 2.0e+00) > 1e-05 (max 0.0001)" \
            if record.family in self.wrong else None


def test_export_then_import_on_a_fresh_machine_like_this_one(tmp_path, monkeypatch, capsys):
    _synthetic_cache(tmp_path / "tuner")
    monkeypatch.setenv("BAGF_CACHE_DIR", str(tmp_path / "tuner"))
    assert cli.main(["cache", "export", str(tmp_path / "x.json")]) == 0
    assert "exported 2 plans" in capsys.readouterr().out
    monkeypatch.setattr(cli, "this_machine_env", lambda: dict(ENV))
    builders, checkers = [], []
    monkeypatch.setattr(cache_io, "local_compiler", lambda cache: builders.append(_FakeBuilder(cache)) or builders[-1])
    monkeypatch.setattr(cache_io, "local_checker", lambda compiler: checkers.append(_FakeChecker()) or checkers[-1])
    assert cli.main(["cache", "import", str(tmp_path / "x.json"), "--cache", str(tmp_path / "prod")]) == 0
    out = capsys.readouterr().out
    assert "imported 2 plans" in out and "skipped 0" in out and "rebuilt here from our own sources" in out
    assert builders[0].built == [ig.name(ig.DEFAULT)]
    assert checkers[0].checked == ["implicit_gemm"]  # our kernel's plan ran its check; torch's conv needs none
    with Cache.for_dir(tmp_path / "prod") as prod:
        plan = prod.get_plan(fingerprint(P1, ENV))
        assert plan["config"] == ig.DEFAULT and plan["cubin_digests"] == ["ours-" + ig.name(ig.DEFAULT)]
        assert prod.get_cubin(plan["cubin_digests"][0]) == (b"built here", "_Zours")
        assert prod.get_cubin("d1") is None  # the file's bytes were not stored
        assert prod.get_plan(fingerprint(P2, ENV))["family"] == "aten"
    # importing again keeps what is there and says so
    assert cli.main(["cache", "import", str(tmp_path / "x.json"), "--cache", str(tmp_path / "prod")]) == 0
    out = capsys.readouterr().out
    assert "imported 0 plans" in out and out.count("already has a plan for it (kept)") == 2


def test_prune_deletes_what_is_not_used_and_gives_the_space_back(tmp_path, monkeypatch, capsys):
    # An upgrade (here torch 2.10 -> 2.11) leaves the old version's plans, trials and cubins behind for good, and
    # every tuning process reads the whole file when it opens it. By default prune keeps every plan (the cache
    # directory is shared by a user's environments); asked, it drops other versions' and other GPUs' plans.
    import sqlite3
    import time

    from bagf_torch.cache import FOREIGN_DIGEST_PREFIX, SHARED_CUBIN_PREFIX, default_cache_path

    old_env, a100 = dict(ENV, torch="2.10.0"), dict(ENV, gpu="NVIDIA A100", cc="8.0")
    day, now = 86400.0, time.time()
    directory = tmp_path / "cache"
    p3 = ConvProblem(n=4, c=8, h=12, w=10, k=20, r=3, s=3, padding=(1, 1))
    keys = {name: fingerprint(p, env) for name, p, env in (("here", P1, ENV), ("old", P2, old_env), ("a100", p3, a100))}
    with Cache.for_dir(directory) as cache:
        for (name, key), problem, env in zip(keys.items(), (P1, P2, p3), (ENV, old_env, a100)):
            cache.put_cubin(name, ig.name(ig.DEFAULT), "_Zk", b"\x7fELF" + bytes(200_000))
            cache.put_plan(key, problem=problem.as_dict(), env=env, family="implicit_gemm", config=ig.DEFAULT,
                           time_us=30.0, aten_us=45.0, default_us=40.0, evaluations=20, tune_seconds=8.0,
                           cubin_digests=[name])
            cache.add_trials(key, [{"family": "implicit_gemm", "config": ig.DEFAULT, "status": "ok",
                                    "time_us": 30.0, "detail": ""}])
        for key in ("abandoned", "tuning-now"):  # trials of keys with no plan: an old run's, a running one's
            cache.add_trials(key, [{"family": "implicit_gemm", "config": ig.DEFAULT, "status": "ok",
                                    "time_us": 1.0, "detail": ""}])
        cache.put_cubin("unused-old", "x", "_Zx", b"\x7fELF" + bytes(300_000))
        cache.put_cubin("unused-new", "x", "_Zx", b"\x7fELF new")
        for d in ("epilogue-older", "epilogue-newest"):  # no plan names the pooling kernels: the newest stays
            cache.put_cubin(d, SHARED_CUBIN_PREFIX + "sm90", "_Ze", b"\x7fELF " + d.encode())
    with sqlite3.connect(default_cache_path(directory)) as raw:
        raw.execute("INSERT INTO cubins SELECT ?, name, lowered_name, cubin, sha256, created FROM cubins "
                    "WHERE digest = 'here'", (FOREIGN_DIGEST_PREFIX + "here",))  # (a trusted copy of a kept one)
        raw.execute("UPDATE cubins SET created = ? WHERE digest != 'unused-new'", (now - 40 * day,))
        raw.execute("UPDATE trials SET created = ? WHERE key != 'tuning-now'", (now - 2 * day,))
        raw.execute("UPDATE cubins SET created = ? WHERE digest = 'epilogue-older'", (now - 50 * day,))

    def prune(*flags):
        assert cli.main(["cache", "prune", "--cache", str(directory), *flags]) == 0
        out = capsys.readouterr().out
        before, after = (float(x) for x in out.rsplit("; ", 1)[-1].replace(" MB", "").split(" -> "))
        with Cache.for_dir(directory) as cache:
            plans = {p["key"] for p in cache.plans()}
            trials = {k for k in ("abandoned", "tuning-now", *keys.values()) if cache.trials(k)}
            cubins = {d for d in ("here", FOREIGN_DIGEST_PREFIX + "here", "old", "a100", "unused-old", "unused-new",
                                  "epilogue-older", "epilogue-newest") if cache.get_cubin(d) is not None}
        return out, before - after, plans, trials, cubins

    def no_gpu(what="cache import"):
        raise cli.UsageError(f"{what} needs this machine's CUDA GPU")

    monkeypatch.setattr(cli, "this_machine_env", no_gpu)  # the default prune needs no GPU
    out, freed, plans, trials, cubins = prune()
    assert "0 plans of other environments (none asked for), 1 trials of keys without a plan, 2 cubins" in out, out
    assert plans == set(keys.values()) and trials == {"tuning-now", *keys.values()}
    assert cubins == {"here", FOREIGN_DIGEST_PREFIX + "here", "old", "a100", "unused-new", "epilogue-newest"}
    assert freed > 0.25
    monkeypatch.setattr(cli, "this_machine_env", lambda what="": dict(ENV))
    out, freed, plans, trials, cubins = prune("--other-versions")
    assert "1 plans of other versions on this GPU, 1 trials" in out, out  # the old plan, then its trial and cubin
    assert plans == {keys["here"], keys["a100"]} and keys["old"] not in trials and "old" not in cubins
    assert freed > 0.15  # (its 200 KB cubin given back: VACUUM)
    out, freed, plans, trials, cubins = prune("--other-gpus", "--days", "0")
    assert "1 plans of other GPUs" in out and plans == {keys["here"]}
    assert cubins == {"here", FOREIGN_DIGEST_PREFIX + "here", "epilogue-newest"}  # --days 0: all no plan names
    with pytest.raises(SystemExit):
        cli.main(["cache", "prune", "--cache", str(directory), "--days", "-1"])


def test_import_says_what_it_skipped_and_why(tmp_path, monkeypatch, capsys):
    _synthetic_cache(tmp_path / "a100", env=dict(ENV, gpu="NVIDIA A100", cc="8.0"))
    _synthetic_cache(tmp_path / "torch29", env=dict(ENV, torch="2.9.0"))
    _synthetic_cache(tmp_path / "h200")
    with Cache.for_dir(tmp_path / "a100") as a, Cache.for_dir(tmp_path / "h200") as h, \
            Cache.for_dir(tmp_path / "torch29") as t:
        a.export(tmp_path / "a.json")
        h.export(tmp_path / "h.json")
        t.export(tmp_path / "t.json")
    doc = json.loads((tmp_path / "h.json").read_text())
    other = json.loads((tmp_path / "a.json").read_text())
    older = json.loads((tmp_path / "t.json").read_text())
    doc["plans"][0]["key"] = "c" * 64                              # a key that is not its problem's
    doc["plans"].append(older["plans"][1])                         # another torch version
    doc["plans"].append(other["plans"][0])                         # another GPU
    doc["plans"].append({"key": "e" * 64, "family": "implicit_gemm"})  # malformed
    (tmp_path / "mixed.json").write_text(json.dumps(doc))
    monkeypatch.setattr(cli, "this_machine_env", lambda: dict(ENV))
    monkeypatch.setattr(cache_io, "local_compiler", _FakeBuilder)
    monkeypatch.setattr(cache_io, "local_checker", lambda compiler: _FakeChecker())
    monkeypatch.setenv("BAGF_CACHE_DIR", str(tmp_path / "prod"))
    assert cli.main(["cache", "import", str(tmp_path / "mixed.json")]) == 0
    out = capsys.readouterr().out
    assert "imported 1 plans" in out and "skipped 4" in out
    assert "torch '2.9.0' != '2.11.0'" in out
    assert "gpu 'NVIDIA A100' != 'NVIDIA H200'" in out and "cc '8.0' != '9.0'" in out
    assert "malformed entry" in out and "key does not match its problem and env" in out
    # nothing importable: the hint says how to get plans for this machine
    assert cli.main(["cache", "import", str(tmp_path / "a.json"), "--cache", str(tmp_path / "prod2")]) == 0
    out = capsys.readouterr().out
    assert "imported 0 plans" in out and "run python -m bagf_torch tune here" in out


def test_import_of_a_file_that_is_not_an_export_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "this_machine_env", lambda: dict(ENV))
    (tmp_path / "junk.json").write_text('{"hello": 1}')
    _returns_2_with_one_line(capsys, ["cache", "import", str(tmp_path / "junk.json")], "not a bagf_torch cache export")
    (tmp_path / "old.json").write_text('{"format": "bagf_torch.cache", "schema": 0}')
    _returns_2_with_one_line(capsys, ["cache", "import", str(tmp_path / "old.json")], "schema version 0")


@pytest.mark.skipif(not CPU_ONLY, reason="a GPU is visible: import would validate against it")
def test_import_without_gpu_refuses_and_leaves_cache_alone(tmp_path, capsys):
    _synthetic_cache(tmp_path / "tuner")
    with Cache.for_dir(tmp_path / "tuner") as c:
        c.export(tmp_path / "x.json")
    _returns_2_with_one_line(capsys, ["cache", "import", str(tmp_path / "x.json"), "--cache", str(tmp_path / "p")],
                             "needs this machine's CUDA GPU")
    assert not (tmp_path / "p").exists()


# ---- report -----------------------------------------------------------------------------------------

def test_report_table_and_plot_with_given_ceilings(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    _synthetic_cache(tmp_path / "c")
    png = tmp_path / "roofline.png"
    assert cli.main(["report", "--cache", str(tmp_path / "c"), "--plot", str(png), "--peak-tflops", "60",
                     "--bandwidth-gbs", "4000"]) == 0
    out = capsys.readouterr().out
    assert "2 plans" in out and P1.short() in out and "1.50x" in out and "aten (cuDNN)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    _returns_2_with_one_line(capsys, ["report", "--plot", str(png), "--peak-tflops", "60"], "give both")
    _returns_2_with_one_line(capsys, ["report", "--cache", str(tmp_path / "empty"), "--plot", str(png),
                                      "--peak-tflops", "60", "--bandwidth-gbs", "4000"], "no plans")


def test_roofline_points_and_ceilings():
    from bagf_torch import report

    c = report.Ceilings(flops=60e12, bandwidth=4e12)
    assert c.ridge == 15.0 and c.attainable(1.0) == 4e12 and c.attainable(100.0) == 60e12
    p = ConvProblem(n=1, c=1, h=3, w=3, k=1, r=3, s=3, bias=False)  # one output: 9 MACs
    assert report.compulsory_bytes(p) == 4 * (9 + 9 + 1)
    plan = {"problem": p.as_dict(), "family": "aten", "config": None, "time_us": 2.0, "aten_us": 2.0}
    (pt,) = report.points_from_plans([plan])
    assert pt.intensity == 18 / 76 and pt.plan_flops == 18 / 2e-6 and pt.plan == "aten (cuDNN)"
    # a TF32-mode plan stands against the TF32 roof only, a bf16 one against bf16's
    tf32 = dict(plan, problem=dict(p.as_dict(), tf32=True))
    bf16 = dict(plan, problem=dict(p.as_dict(), dtype="bfloat16"))
    assert len(report.points_from_plans([plan, tf32, bf16])) == 1
    assert len(report.points_from_plans([plan, tf32, bf16], "tf32")) == 1
    assert len(report.points_from_plans([plan, tf32, bf16], "bfloat16")) == 1
    # what an imported file may hold: a dtype with no roof, a denormal time (its FLOP/s is not a number to plot)
    f64 = dict(plan, problem=dict(p.as_dict(), dtype="float64"))
    tiny = dict(plan, time_us=5e-324, aten_us=5e-324)
    assert report.points_from_plans([f64, tiny]) == []
    report.plans_table([f64, tiny])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process's age comes from Linux's /proc")
def test_the_tune_reports_process_start_is_its_age():
    """``startup_s`` in a tune report's meta: seconds from the process's start (interpreter, imports) to the
    command's clock, read from /proc."""
    code = "import time; time.sleep(0.5); from bagf_torch import cli; print(cli._process_age_s())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    age = float(out.stdout.strip())
    assert 0.45 <= age < 60, age


def test_matmul_tf32_sets_and_restores_through_the_api_the_process_uses():
    """``report.matmul_tf32`` (the ceilings' TF32 switch) works under the legacy flag and, in a process that has set
    ``torch.backends.cuda.matmul.fp32_precision`` (where reading the legacy flag raises), under the new one;
    either way it restores what was there. (A torch without the newer API, before 2.9: the legacy half only.)"""
    code = textwrap.dedent("""
        import torch
        from bagf_torch.report import matmul_tf32
        mm = torch.backends.cuda.matmul
        mm.allow_tf32 = False
        with matmul_tf32(True):
            assert mm.allow_tf32
        assert not mm.allow_tf32
        try:
            mm.fp32_precision = "tf32"
        except AttributeError:  # (torch before 2.9: "Unknown attribute fp32_precision")
            raise SystemExit(print("ok (legacy API only)"))
        try:
            mm.allow_tf32
            raise SystemExit("the legacy flag could be read after the new API set TF32: nothing tested below")
        except RuntimeError:
            pass
        with matmul_tf32(False):
            assert mm.fp32_precision == "ieee"
        assert mm.fp32_precision == "tf32"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]

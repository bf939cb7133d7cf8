"""CPU tests of benchmarks/bench_overhead.py and benchmarks/first_call.py through their --dry-run modes: argument
parsing, the case lists, the per-kind / per-context environments, the cached aten plan, the log capture, the pass
rules and the result files (FAKE numbers, marked). What needs CUDA (timing, tuning, graphs) is not run here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    """The benchmark script ``benchmarks/<name>.py`` (``name`` may be ``probes/<probe>``), loaded as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_script_{name.replace('/', '_')}", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def overhead():
    return _script("bench_overhead")


@pytest.fixture(scope="module")
def first_call():
    return _script("first_call")


def _load(path: Path) -> dict:
    assert path.is_file(), f"{path.name} not written; the folder holds {sorted(p.name for p in path.parent.iterdir())}"
    return json.loads(path.read_text())


# ---- bench_overhead.py -----------------------------------------------------------------------------------

def test_overhead_parsers_and_pass_rule(overhead):
    a, b = overhead.parse_layers("64:64:56,128:128:28:3:1:1")
    assert (a.c, a.k, a.hw, a.kernel, a.stride, a.pad) == (64, 64, 56, 3, 1, 1)
    assert b.name == "3x3 128->128 @28x28"
    assert overhead.parse_layers("3:64:224:11:4:2")[0].name == "11x11 3->64 @224x224 s4 p2"
    for bad in ("64:64", "64:x:56", "0:4:4", ""):
        with pytest.raises(Exception):
            overhead.parse_layers(bad)
    assert overhead.parse_kinds("kernel,unsupported") == ["kernel", "unsupported:fp64", "unsupported:strided"]
    assert overhead.parse_kinds("miss,fp64,miss") == ["miss", "unsupported:fp64"]
    with pytest.raises(Exception):
        overhead.parse_kinds("fast")
    assert overhead.parse_batches("1,8,32,128") == [1, 8, 32, 128]
    judge = overhead.judge
    assert judge(100.0, 102.0, 1.02, 2.0)["pass"]          # within 2%
    assert judge(10.0, 12.0, 1.02, 2.0)["pass"]            # within 2 us
    assert not judge(100.0, 103.0, 1.02, 2.0)["pass"]      # 3% and 3 us slower
    assert not judge(10.0, 12.5, 1.02, 2.0)["pass"]
    assert judge(10.0, 5.0, 1.02, 2.0)["ratio"] == 0.5
    assert overhead.seconds_suffix(None, 25.0) == "" and overhead.seconds_suffix(25, 25.0) == ""
    assert overhead.seconds_suffix(5, 25.0) == "_5s" and overhead.seconds_suffix(2.5, 25.0) == "_2.5s"


def test_overhead_interleaving_rotates_the_order(overhead):
    seen = []
    medians = overhead.interleaved(lambda fn: fn(), [lambda: seen.append("a") or 1.0, lambda: seen.append("b") or 3.0],
                                   reps=4)
    assert medians == [1.0, 3.0]
    assert seen == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert overhead.eager_loop_us(lambda: None, calls=5, sync=lambda: None) >= 0.0


def test_overhead_dry_run_every_kind(overhead, tmp_path):
    before = os.environ.get("BAGF_CACHE_DIR")
    rc = overhead.main(["--dry-run", "--out", str(tmp_path), "--batch", "1,8", "--layers", "8:8:8,4:8:6"])
    assert rc == 0
    assert os.environ.get("BAGF_CACHE_DIR") == before  # the script's per-kind settings do not leak
    doc = _load(tmp_path / "bench_overhead_cpu_dryrun.json")
    assert doc["meta"]["dry_run"] is True and "FAKE" in doc["meta"]["note"]
    assert doc["meta"]["command"].endswith("benchmarks/bench_overhead.py --dry-run --out "
                                           f"{tmp_path} --batch 1,8 --layers 8:8:8,4:8:6")
    for field in ("date", "commit", "gpu", "torch", "cuda", "cudnn"):
        assert field in doc["meta"]
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 5 and all(r["fake"] for r in rows)
    assert [r["kind"] for r in rows[::4]] == list(overhead.KINDS)
    layers = ("3x3 8->8 @8x8", "3x3 4->8 @6x6")
    assert {(r["layer"], r["n"]) for r in rows} == {(la, n) for la in layers for n in (1, 8)}
    for r in rows:
        assert set(r["eager"]) >= {"stock_us", "tuned_us", "ratio", "pass"} and r["graph"]["pass"]
        assert r["max_rel_diff"] < 1e-5  # same weights, the same (ATen) path on a CPU
    assert all(r["aten_plan_stored"] for r in rows if r["kind"] == "aten")  # the real put_plan took the fields
    assert all("nn.Conv2d forward (input is not a CUDA tensor)" in r["plan"] for r in rows
               if r["kind"].startswith("unsupported"))
    assert any("not a CUDA tensor" in rec["message"] for r in rows for rec in r["log"])  # the capture handler
    assert doc["summary"] == dict(doc["summary"], rows=20, failed=0, **{"pass": True})
    md = (tmp_path / "bench_overhead_cpu_dryrun.md").read_text()
    assert md.startswith("# DRY RUN, FAKE NUMBERS") and "every time below is FAKE" in md
    assert md.count("| 3x3 8->8 @8x8 |") == 10 and "20 of 20 rows pass." in md


def test_overhead_dry_run_in_bf16_channels_last(overhead, tmp_path):
    """--dtype/--channels-last build the kernel, aten and miss kinds' modules and inputs in that dtype and format
    (the unsupported kinds keep their own), say so in the header, and write files of their own."""
    import torch

    rc = overhead.main(["--dry-run", "--out", str(tmp_path), "--batch", "1", "--layers", "8:8:8",
                        "--kinds", "kernel,unsupported:strided", "--dtype", "bfloat16", "--channels-last"])
    assert rc == 0
    assert not (tmp_path / "bench_overhead_cpu_dryrun.json").exists()
    doc = _load(tmp_path / "bench_overhead_cpu_bf16_nhwc_dryrun.json")
    assert doc["meta"]["dtype"] == "bfloat16" and doc["meta"]["channels_last"] is True
    stock, tuned = overhead.make_pair(overhead.parse_layers("8:8:8")[0], "kernel", torch.device("cpu"), 0,
                                      "bfloat16", True)
    assert stock.weight.dtype is torch.bfloat16 and tuned.weight.dtype is torch.bfloat16
    assert stock.weight.is_contiguous(memory_format=torch.channels_last)
    x = overhead.make_input(overhead.parse_layers("8:8:8")[0], 2, 8, "kernel", torch.device("cpu"), 0, "bfloat16",
                            True)
    assert x.dtype is torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
    strided = overhead.make_input(overhead.parse_layers("8:8:8")[0], 2, 8, "unsupported:strided",
                                  torch.device("cpu"), 0, "bfloat16", True)
    assert strided.dtype is torch.float32  # the unsupported kinds set their own dtype and strides
    md = (tmp_path / "bench_overhead_cpu_bf16_nhwc_dryrun.md").read_text()
    assert "bfloat16, channels_last (the kernel, aten and miss kinds)" in md


def test_overhead_dry_run_failure_exits_nonzero_and_still_writes(overhead, tmp_path):
    rc = overhead.main(["--dry-run", "--dry-run-fail", "--out", str(tmp_path), "--batch", "1", "--layers", "4:4:4",
                        "--kinds", "kernel,miss", "--tag", "t"])
    assert rc == 1
    doc = _load(tmp_path / "bench_overhead_t_dryrun.json")
    assert doc["summary"]["failed"] == 1 and not doc["summary"]["pass"]
    assert not doc["rows"][0]["eager"]["pass"] and doc["rows"][1]["eager"]["pass"]
    assert "| NO |" in (tmp_path / "bench_overhead_t_dryrun.md").read_text()


def test_overhead_refuses_to_run_without_a_gpu(overhead, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert overhead.main(["--out", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ---- first_call.py ---------------------------------------------------------------------------------------

def test_first_call_search_failure_detection_matches_the_tuner():
    """The row's check looks for the tuner's warning; keep it tied to the message the tuner writes."""
    import inspect

    from bagf_torch.tuning import tuner

    source = inspect.getsource(tuner)
    assert "search of" in source and "failed on" in source
    fc = _script("first_call")
    msg = "ax search of winograd_gemm failed on N1 C192 13x13 after 12 trials (ValueError: x); choosing among them"
    assert fc.search_failures([{"level": "WARNING", "message": msg}, {"level": "INFO", "message": "tuned N1"}]) == [msg]
    assert fc.search_failures(["compile failed", msg]) == [msg]


def test_first_call_dry_run_cases_and_contexts(first_call, tmp_path):
    rc = first_call.main(["--dry-run", "--out", str(tmp_path), "--batch", "1,4", "--layers", "8:16:8",
                          "--seconds", "3"])
    assert rc == 0
    doc = _load(tmp_path / "first_call_cpu_3s_dryrun.json")  # --seconds off the default: in the name
    assert doc["meta"]["dry_run"] and doc["summary"]["complete"] and doc["summary"]["pass"]
    rows = doc["rows"]
    assert [(r["n"], r["context"]) for r in rows] == [(n, c) for n in (1, 4) for c in ("grad", "no_grad",
                                                                                        "inference_mode")]
    for r in rows:
        assert r["fake"] and r["budget_s"] == 3.0 and r["allowed_s"] == pytest.approx(3.0 * 1.1 + 1.0)
        assert r["within_budget"] and r["search_failed"] == []
        # each context ran in a fresh runtime and log state: the fallback is logged (and captured) every time
        assert any("not a CUDA tensor" in rec["message"] for rec in r["log"])
        assert r["reference_context"] == "grad" and r["vs_reference"] == 1.0 and r["quality_pass"]
        assert set(r["phases"]) == {"setup", "compile", "check", "measure", "strategy", "finalists"}
    md = (tmp_path / "first_call_cpu_3s_dryrun.md").read_text()
    assert md.startswith("# DRY RUN, FAKE NUMBERS") and "6 of 6 rows pass." in md


def test_first_call_dry_run_failures(first_call, tmp_path):
    rc = first_call.main(["--dry-run", "--dry-run-fail", "--out", str(tmp_path), "--batch", "2",
                          "--layers", "4:4:4", "--contexts", "no_grad,grad"])
    assert rc == 1
    rows = _load(tmp_path / "first_call_cpu_dryrun.json")["rows"]  # --seconds not given: no suffix
    no_grad, grad = rows
    assert not no_grad["within_budget"] and grad["within_budget"]  # the first context's wall: over budget + overshoot
    # the reference is grad even when it is not first; the fake plan of the last context is 20% slower
    assert no_grad["reference_context"] == "grad" and no_grad["vs_reference"] == pytest.approx(1 / 1.2)
    assert not no_grad["quality_pass"] and grad["quality_pass"]


def test_first_call_alexnet_dry_run(first_call, tmp_path):
    rc = first_call.main(["--dry-run", "--alexnet", "--seconds", "5", "--out", str(tmp_path)])
    assert rc == 0
    stem = tmp_path / "first_call_alexnet_cpu_5s_dryrun"
    doc = _load(stem.with_suffix(".json"))
    s = doc["summary"]
    assert s["problems"] == 15 and s["tuned"] == 15 and s["source"] == "tune JSON" and s["pass"]
    assert "--seconds 5" in doc["meta"]["tune_command"] and "--no-progress" in doc["meta"]["tune_command"]
    rows = doc["rows"]
    assert all(r["fake"] and r["budget_s"] == 5.0 and r["within_budget"] for r in rows)
    assert [r["gap_includes_startup"] for r in rows].count(True) == 1
    assert all(r["wall_gap_s"] is not None for r in rows)
    assert rows[0]["layers"] == ["features.0"] and rows[0]["short"].startswith("N1 C3 224x224")
    assert stem.with_suffix(".log").is_file() and "DRY RUN" in stem.with_suffix(".md").read_text()
    speeds = [first_call.speedup(r) for r in rows]
    assert all(x is not None and x > 0 for x in speeds)
    assert s["geomean_speedup"] == pytest.approx(math.exp(sum(map(math.log, speeds)) / len(speeds)))
    assert first_call.speedup({"time_us": None, "aten_us": 3.0}) is None


def test_first_call_times_any_model_through_the_tune_command(first_call, tmp_path):
    """--model runs the tune command on another model (here in a dry run: the fake tune writes AlexNet's shapes) and
    names the files after it and its batches; --alexnet is --model alexnet at N = 1, 32, 128."""
    assert first_call.model_slug("alexnet", [1, 32, 128]) == "alexnet"
    assert first_call.model_slug("alexnet", [8]) == "alexnet_n8"
    assert first_call.model_slug("torchvision:resnet50", [1, 32]) == "resnet50_n1_32"
    assert first_call.build_parser().parse_args(["--alexnet"]).model == "alexnet"
    rc = first_call.main(["--dry-run", "--model", "torchvision:resnet18", "--model-batch", "32", "--seconds", "5",
                          "--even", "--out", str(tmp_path)])
    assert rc == 0
    stem = tmp_path / "first_call_resnet18_n32_cpu_5s_even_dryrun"
    doc = _load(stem.with_suffix(".json"))
    assert "--model torchvision:resnet18 --batch 32 " in doc["meta"]["tune_command"]
    assert doc["meta"]["tune_command"].endswith(" --seconds 5 --even")
    md = stem.with_suffix(".md").read_text()
    stem.with_suffix(".md").unlink()
    assert first_call.main(["--from-json", str(stem.with_suffix(".json"))]) == 0  # the Markdown again, no GPU
    assert stem.with_suffix(".md").read_text() == md
    assert doc["summary"]["problems"] == 5 and all(r["problem"]["n"] == 32 for r in doc["rows"])
    assert "resnet18 pre-tuning at N = 32" in stem.with_suffix(".md").read_text()
    # the model in bfloat16 channels_last: the tune command is told so
    rc = first_call.main(["--dry-run", "--alexnet", "--dtype", "bfloat16", "--channels-last", "--tag", "bf16",
                          "--out", str(tmp_path)])
    assert rc == 0
    (bf16,) = tmp_path.glob("first_call_alexnet_bf16*.json")
    assert " --dtype bfloat16 --channels-last" in _load(bf16)["meta"]["tune_command"]


def test_first_call_alexnet_rows_from_the_cache_alone(first_call):
    """A tune command cut short leaves no JSON: the rows come from the plans it stored."""
    from bagf_torch.problem import ConvProblem

    p1 = ConvProblem(n=1, c=3, h=8, w=8, k=4, r=3, s=3, padding=(1, 1))
    p2 = ConvProblem(n=2, c=3, h=8, w=8, k=4, r=3, s=3, padding=(1, 1))
    plans = [{"problem": p2.as_dict(), "family": "aten", "config": None, "evaluations": 9, "tune_seconds": 7.5,
              "time_us": 5.0, "aten_us": 5.0, "created": 130.0},
             {"problem": p1.as_dict(), "family": "aten", "config": None, "evaluations": 8, "tune_seconds": 4.0,
              "time_us": 4.0, "aten_us": 4.0, "created": 110.0}]
    args = first_call.build_parser().parse_args(["--dry-run"])
    rows = first_call.model_rows(None, plans, started=100.0, budget=5.0, args=args)
    assert [r["short"].split()[0] for r in rows] == ["N1", "N2"]  # in the order they were written
    assert [r["wall_gap_s"] for r in rows] == [10.0, 20.0] and rows[0]["gap_includes_startup"]
    assert rows[0]["within_budget"] and not rows[1]["within_budget"]  # 7.5 s > 5 * 1.1 + 1
    assert rows[1]["gap_within"] is False and rows[0]["gap_within"] is None
    assert all(r["from"] == "cache (no tune JSON)" for r in rows)


def test_first_call_judges_each_problem_by_the_seconds_the_tune_command_gave_it(first_call):
    """A problem with a small share of the forward gets fewer seconds (pretune.allot_seconds): its row is judged
    against those, from the tune JSON's budget_seconds, not the per-problem budget."""
    from bagf_torch.problem import ConvProblem

    rows = []
    for n, given, took in ((1, 7.0, 7.5), (2, 2.0, 2.5), (3, 2.0, 4.0)):
        p = ConvProblem(n=n, c=3, h=8, w=8, k=4, r=3, s=3, padding=(1, 1))
        rows.append({"problem": p.as_dict(), "layers": ["a"], "plan": "aten (cuDNN)", "evaluations": 5,
                     "tune_seconds": took, "time_us": 4.0, "aten_us": 4.0, "cached": False, "wall_seconds": took,
                     "phases": {}, "budget_seconds": given})
    args = first_call.build_parser().parse_args(["--dry-run"])
    got = first_call.model_rows({"rows": rows}, [], started=0.0, budget=7.0, args=args)
    assert [r["budget_s"] for r in got] == [7.0, 2.0, 2.0]
    assert [r["allowed_s"] for r in got] == pytest.approx([8.7, 3.2, 3.2])
    assert [r["within_budget"] for r in got] == [True, True, False]


def test_first_call_asks_the_tune_command_for_strict_fp32(first_call):
    words = first_call.tf32_off_args()
    assert words in ([], ["--tf32", "off"])
    from bagf_torch import cli

    assert cli.build_parser().parse_args(["tune", "--model", "alexnet", *words]).cmd == "tune"


# ---- the GPU code paths, with the GPU simulated -----------------------------------------------------------
# The non-dry code (plan lookups, the cached aten plan under the runtime's key, the runtime's results, the log
# capture, the quality session) driven on a CPU: a runtime whose device is fake and whose tuner returns a fixed
# winner, TunedConv2d's device check passed, and CUDA's synchronize / graphs / event timing stood in for.

def _fake_runtime(family: str = "aten", warn_in_inference_mode: bool = False):
    import contextlib
    import types

    from bagf_torch import log, runtime
    from bagf_torch.kernels import implicit_gemm
    from bagf_torch.ops import ATEN
    from bagf_torch.tuning.backend import TrialBackend
    from bagf_torch.tuning.tuner import TuneResult

    config = None if family == "aten" else dict(implicit_gemm.DEFAULT)
    compiler = types.SimpleNamespace(digest=lambda fam, cfg: "fake-digest")
    dev = runtime._Device(0, {"gpu": "Fake GPU", "cc": "9.0", "driver": 1, "nvrtc": "13.0"}, compiler,
                          context=lambda index: contextlib.nullcontext())

    class FakeTuner:
        backend = TrialBackend(compiler, None, None, lambda p: None)  # local: its handles are this process's

        def tune(self, problem, progress=None, seeds=()):
            import torch

            if warn_in_inference_mode and torch.is_inference_mode_enabled():
                log.logger().warning(f"ax search of {family} failed on {problem.short()} after 3 trials "
                                     "(RuntimeError: element 0 of tensors does not require grad); choosing among them")
            # handle ATEN whatever the family: the module then runs nn.Conv2d's forward, which a CPU can
            return TuneResult(problem=problem, family=family, config=config, handle=ATEN, time_us=8.0, aten_us=9.0,
                              default_us=None, evaluations=3, seconds=0.01,
                              phases={"compile": 0.0, "check": 0.0, "measure": 0.01, "strategy": 0.0})

    return runtime.Runtime(devices=lambda index: dev, make_tuner=lambda rt, d, listeners: FakeTuner())


@pytest.fixture
def simulated_gpu(monkeypatch):
    import torch

    from bagf_torch import bench, runtime
    from bagf_torch.nn import TunedConv2d

    state = {"family": "aten", "warn": False, "timed": 0}
    monkeypatch.setattr(runtime, "reset", lambda: runtime.install(_fake_runtime(state["family"], state["warn"])))
    monkeypatch.setattr(TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def graphed(forward, x):
        out = forward(x)
        return (lambda: forward(x)), out

    def time_forward(fn, runs=200, warmup=20):
        fn()
        state["timed"] += 1
        return bench.Timing(5.0, 5.0, 5.0, runs)

    monkeypatch.setattr(bench, "graphed", graphed)
    monkeypatch.setattr(bench, "time_forward", time_forward)
    runtime.reset()
    return state


@pytest.mark.parametrize("family", ["aten", "implicit_gemm"])
def test_overhead_gpu_path_simulated(overhead, simulated_gpu, monkeypatch, tmp_path, family):
    import torch

    simulated_gpu["family"] = family
    monkeypatch.setattr(overhead, "compute_device", lambda dry_run: torch.device("cpu"))
    monkeypatch.setattr(overhead, "eager_loop_us", lambda fn, calls, sync=None: (fn(), 20.0)[1])
    rc = overhead.main(["--out", str(tmp_path), "--batch", "2", "--layers", "4:8:6", "--watchdog", "0",
                        "--reps", "3", "--tag", "sim"])
    doc = _load(tmp_path / "bench_overhead_sim.json")
    assert doc["meta"]["gpu"] == "Fake GPU" and doc["meta"]["env"]["gpu"] == "Fake GPU" and not doc["meta"]["dry_run"]
    rows = {r["kind"]: r for r in doc["rows"]}
    assert list(rows) == list(overhead.KINDS)
    for r in rows.values():
        assert "error" not in r and r["eager"]["pass"] and r["graph"]["pass"], r
        assert r["max_rel_diff"] < 1e-5 and not r["eager"].get("error") and not r["graph"].get("error")
    kernel = rows["kernel"]
    assert kernel["runtime_stats"]["tuned"] == 1 and kernel["tuned_now"] and kernel["evaluations"] == 3
    if family == "aten":
        assert kernel["plan"] == "aten: tuning picked cuDNN"
    else:
        from bagf_torch.kernels import implicit_gemm

        assert kernel["plan"] == implicit_gemm.name(implicit_gemm.DEFAULT)
    aten = rows["aten"]
    assert aten["aten_plan_stored"] and aten["plan"] == "aten (cached plan)" and aten["ok"]
    assert aten["runtime_stats"].get("cache_hits") == 1 and not aten["runtime_stats"].get("tuned")
    assert rows["miss"]["ok"] and rows["miss"]["plan"].startswith("none: BAGF_TUNE=0")
    assert "dtype torch.float64" in rows["unsupported:fp64"]["plan"]
    assert "non-contiguous input" in rows["unsupported:strided"]["plan"]
    assert rows["unsupported:fp64"]["ok"] and rows["unsupported:strided"]["ok"]
    assert rc == 0 and simulated_gpu["timed"] > 0


def test_first_call_gpu_path_simulated(first_call, simulated_gpu, monkeypatch, tmp_path):
    import torch

    simulated_gpu["warn"] = True  # the fake tuner's search "fails" in inference mode, as Ax's GP fit once did
    monkeypatch.setattr(first_call.common, "compute_device", lambda dry_run: torch.device("cpu"))
    rc = first_call.main(["--out", str(tmp_path), "--batch", "1,2", "--layers", "4:8:6", "--seconds", "5",
                          "--no-prewarm", "--watchdog", "0", "--reps", "3"])
    assert rc == 1
    doc = _load(tmp_path / "first_call_fakegpu_5s.json")  # (the GPU's tag: "Fake GPU")
    assert doc["summary"]["complete"] and doc["summary"]["failed"] == 2
    for r in doc["rows"]:
        assert r["budget_s"] == 5.0 and r["within_budget"] and r["runtime_stats"]["tuned"] == 1
        assert r["plan"] == "aten (cuDNN)" and r["tuner_seconds"] == 0.01 and r["phases"]["measure"] == 0.01
        assert r["cudnn_us"] == 5.0 and r["plan_us"] == 5.0 and r["quality_pass"] and r["reference_context"] == "grad"
        failed = r["context"] == "inference_mode"
        assert bool(r["search_failed"]) == failed and first_call.row_pass(r) == (not failed)
        assert any(rec["level"] == "WARNING" and "search of" in rec["message"] for rec in r["log"]) == failed


# ---- as scripts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["bench_overhead.py", "--batch", "1", "--layers", "4:4:4", "--kinds", "aten,strided"],
    ["first_call.py", "--batch", "1", "--layers", "4:4:4", "--contexts", "inference_mode"],
])
def test_scripts_run_from_the_command_line(tmp_path, argv):
    r = subprocess.run([sys.executable, str(BENCHMARKS / argv[0]), "--dry-run", "--out", str(tmp_path), *argv[1:]],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert len(list(tmp_path.glob("*_dryrun.json"))) == 1 and len(list(tmp_path.glob("*_dryrun.md"))) == 1


def test_device_check_knows_the_new_stages():
    script = BENCHMARKS.parent / "scripts" / "device_check.sh"
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    case = next(line for line in text.splitlines() if line.strip().startswith('case "$a" in'))
    stages = case.split(" in ", 1)[1].split(")", 1)[0].split("|")
    assert {"overhead", "firstcall", "compare", "budgets", "eagerhost", "polyphase"} <= set(stages)
    assert "benchmarks/bench_overhead.py --out \"$OUT\"" in text and "benchmarks/first_call.py --out \"$OUT\"" in text
    assert "benchmarks/budgets.py" in text
    assert "benchmarks/probes/eager_host.py \\\n    --served" in text
    assert "benchmarks/probes/polyphase_tma.py --out \"$OUT\" --dtype $dt" in text


def test_compare_versions_plans_and_verdict(tmp_path):
    cv = _script("compare_versions")
    doc = {"rows": [{"plan": "winograd_gemm_f4_tb128_vl0_ml0_ge6_so1_sm90", "layers": ["features.6"],
                     "problem": {"n": 32}},
                    {"plan": "aten (cuDNN)", "layers": ["features.3"], "problem": {"n": 32}},
                    {"plan": "implicit_gemm_tc_x", "layers": ["features.0"], "problem": {"n": 1}}]}
    (tmp_path / "fc.json").write_text(json.dumps(doc))
    assert cv.plans_from(tmp_path / "fc.json") == ["winograd_gemm_f4_tb128_vl0_ml0_ge6_so1_sm90@conv3:32",
                                                   "implicit_gemm_tc_x@conv1:1"]

    def row(plan, graph, eager=10.0):
        return {"plan": plan, "layer": "conv3", "n": 32, "ours_graph_us": graph, "ours_eager_us": eager,
                "ours_issue_us": 5.0, "cudnn_graph_us": 50.0}

    same = cv.compare({"old": [[row("a", 10.0), row("b", 20.0)], [row("a", 10.2), row("b", 20.0)]],
                       "new": [[row("a", 10.1), row("b", 19.9)], [row("a", 10.1), row("b", 20.1)]]}, 0.03)
    assert same["summary"]["pass"] and same["summary"]["plans"] == 2
    assert same["summary"]["geomean_new_over_old_graph"] == pytest.approx(1.0, abs=0.01)
    slower = cv.compare({"old": [[row("a", 10.0), row("b", 20.0)]], "new": [[row("a", 11.0), row("b", 22.0)]]}, 0.03)
    assert not slower["summary"]["pass"] and slower["summary"]["geomean_new_over_old_graph"] == pytest.approx(1.1)
    meta = {"gpu": "G", "date": "d", "versions": "v", "old": "o", "new": "n", "command": "c", "rounds": 1}
    stem = cv.write(tmp_path, "t", meta, slower)
    verdict = "Pass (GPU-time geomean within 3% of 1, every plan measured by both): NO"
    assert verdict in stem.with_suffix(".md").read_text()
    lost = cv.compare({"old": [[row("a", 10.0), row("b", 20.0)]], "new": [[row("a", 10.0)]]}, 0.03)
    assert not lost["summary"]["pass"] and lost["summary"]["measured_by_one_version_only"] == ["b@conv3:32"]


def test_budgets_pairs_problems_and_summarises_the_plan_speed_kept(tmp_path, capsys):
    """benchmarks/budgets.py: the rows of two tune reports are paired by problem (either report shape), and the
    summary's fractions are slow us / fast us; without a GPU it says so and exits 2."""
    import torch

    from bagf_torch.problem import ConvProblem

    budgets = _script("budgets")
    p1 = ConvProblem(n=1, c=3, h=8, w=8, k=4, r=3, s=3).as_dict()
    p2 = ConvProblem(n=32, c=3, h=8, w=8, k=4, r=3, s=3).as_dict()
    p2_older = {k: v for k, v in p2.items() if k not in ("layout", "tf32")}  # a report of a version without them
    fast = {"meta": {"wall_seconds": 9.5, "command": "python -m bagf_torch tune"},  # the tune command's own JSON
            "rows": [{"problem": p1, "family": "aten", "wall_seconds": 6.0},
                     {"problem": p2, "family": "winograd_gemm", "plan": "wg_a", "config": {}, "tune_seconds": 7.0}]}
    slow = {"meta": {"commit": "abc1234def", "date": "d", "tune_command": "tune"}, "summary": {"command_wall_s": 50.0},
            "tune_report": {"seconds": 49.0, "rows": [{"problem": p2_older, "family": "winograd_gemm", "plan": "wg_b"},
                                                      {"problem": {**p2, "n": 128}, "family": "aten"}]}}
    (tmp_path / "fast.json").write_text(json.dumps(fast))
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    fs, fr = budgets.tune_rows(tmp_path / "fast.json")
    ss, sr = budgets.tune_rows(tmp_path / "slow.json")
    assert ss["command_wall_s"] == 50.0 and fs["command_wall_s"] == 9.5
    pairs = budgets.pair_rows(fr, sr)
    assert [(f["plan"], s["plan"]) for f, s in pairs] == [("wg_a", "wg_b")]  # only the problem both planned
    assert budgets._plan_name(fr[0]) == "cuDNN" and budgets._seconds(fr[1]) == 7.0
    assert budgets._seconds({"wall_seconds": 0.0, "tune_seconds": 3.0}) == 0.0
    rows = [{"fraction": 100.0 / 105.0, "cudnn_us": 200.0, "fast_us": 105.0, "slow_us": 100.0, "fast_s": 7.0,
             "slow_s": 25.0, "short": "a", "fast_plan": "x", "slow_plan": "y", "problem": {"n": 32},
             "layers": ["l1", "l2", "l3"]},
            {"fraction": 1.0, "cudnn_us": 50.0, "fast_us": 50.0, "slow_us": 50.0, "fast_s": 6.0, "slow_s": 24.0,
             "short": "b", "fast_plan": "cuDNN", "slow_plan": "cuDNN", "problem": {"n": 32}, "layers": []}]
    s = budgets.summarise(rows, 0.97)
    assert s["kept"] == 1 and math.isclose(s["min_fraction"], 100 / 105) and s["fast_max_s"] == 7.0
    # the model's own speedup weighs each problem by its layers: 3 x 200 + 50 us of cuDNN
    assert s["forward"] == {"32": {"cudnn_us": 650.0, "fast_us": 365.0, "slow_us": 350.0}}
    assert math.isclose(s["slow_geomean_speedup"], math.sqrt(2.0)) and s["slow_tune_s"] == 49.0
    meta = {"gpu": "G", "date": "d", "torch": "t", "cuda": "c", "cudnn": 1, "python": "3", "commit": "x",
            "command": "cmd", "fast": "f", "slow": "s", "fast_source": "tune report",
            "slow_source": budgets._source(ss), "rounds": 3, "slow_command_wall_s": 50.0}
    text = budgets.markdown(meta, rows, s)
    assert "1 of 2 at >= 0.97" in text and "| a | x | y | 7.0 | 25.0 | 200.0 | 105.0 | 100.0 | 0.952 |" in text
    assert "Slow command's whole wall time: 50.0 s." in text and "commit abc1234" in text
    assert "fast 365.0 us (1.78x), slow 350.0 us (1.86x): the fast budget keeps 0.959" in text
    (tmp_path / "b.json").write_text(json.dumps({"meta": meta, "summary": {"keep": 0.97}, "rows": rows}))
    assert budgets.main(["--from-json", str(tmp_path / "b.json")]) == 0  # the Markdown again, no GPU
    assert (tmp_path / "b.md").read_text() == text
    assert json.loads((tmp_path / "b.json").read_text())["summary"]["forward"] == s["forward"]
    if not torch.cuda.is_available():
        assert budgets.main(["--fast", str(tmp_path / "fast.json"), "--slow", str(tmp_path / "slow.json"),
                             "--out", str(tmp_path)]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out


def test_first_call_says_where_the_time_outside_the_tuner_went(first_call):
    """The tune command's phases (its meta) and tune_model's setup, in the order they ran; what the JSON lacks is
    left out."""
    summary = {"command_phases": {"startup_s": 4.3, "check_s": 1.2, "gpu_init_s": 0.8, "build_s": 0.04,
                                  "inputs_s": None, "wall_seconds": 60.5},
               "setup": {"discover_s": 0.5, "stock_s": 0.9, "prefetch_wait_s": 4.9, "before_tuning_s": 6.4}}
    words = first_call._outside_words(summary)
    assert words == ("outside the tuner: process start and imports 4.3 s, the model's name checked 1.2 s, the extension and the GPU's "
                     "context 0.8 s, building the model 0.0 s, discovery 0.5 s, torch's conv timed per problem 0.9 s, "
                     "waiting for the start points' compiles (and the strategy's imports) after that 4.9 s; ")
    assert first_call._outside_words({"command_phases": None, "setup": None}) == ""


def test_record_space_spreads_work_over_gpus_and_merges_the_childrens_rows_once(tmp_path):
    """record_space.py --gpus: the (problem, family) items are split longest first onto the least loaded GPU, and
    the children's partial files merge into one recording holding every row once, however often the merge runs."""
    rec = _script("record_space")
    items = [("a", "f", 100), ("b", "f", 60), ("c", "f", 50), ("d", "f", 40), ("e", "g", 10)]
    shares = rec.assign(items, 2)
    loads = [sum(n for p, f, n in items if (p, f) in share) for share in shares]
    assert sorted(loads) == [120, 140] and sorted(x for s in shares for x in s) == sorted((p, f) for p, f, _ in items)
    assert rec.assign(items, 8)[5:] == [[], [], []]  # more GPUs than items: the rest idle
    conv = {"n": 1}
    children = []
    for i, rows in enumerate([[(1, 2.0), (2, 3.0)], [(3, 1.5)]]):
        child = rec.Partial(tmp_path / f"x.gpu{i}.json.gz.partial.jsonl")
        child.add({"kind": "meta", "meta": {"gpu": i}})
        child.add({"kind": "cudnn", "problem": f"p{i}", "conv": conv, "cudnn": {"median_us": 9.0}})
        for c, t in rows:
            child.add({"kind": "row", "problem": f"p{i}", "conv": conv, "family": "f",
                       "row": {"config": [c], "status": "ok", "median_us": t}})
        child.add({"kind": "status", "problem": f"p{i}", "conv": conv, "family": "f", "complete": True,
                   "seconds": 1.0})
        children.append(child.path)
    main = rec.Partial(tmp_path / "x.json.gz.partial.jsonl")
    main.add({"kind": "meta", "meta": {"gpus": 2}})
    assert rec.merge_partials(main, children + [tmp_path / "absent.partial.jsonl"]) == 7
    assert rec.merge_partials(main, children) == 0  # nothing twice
    doc = rec.Partial(main.path).document({"f": {"knobs": ["X"], "default": [1], "raw_size": 3, "valid": 3}})
    by = {p["name"]: p for p in doc}
    assert sorted(by) == ["p0", "p1"] and by["p0"]["cudnn"] == {"median_us": 9.0}
    assert [r["config"] for r in by["p0"]["families"]["f"]["records"]] == [[1], [2]]
    assert by["p1"]["families"]["f"]["complete"] and by["p1"]["families"]["f"]["seconds"] == 1.0


def test_family_sweep_selects_knobs_and_renders_its_json(tmp_path):
    """benchmarks/probes/family_sweep.py: --where narrows the space by knob values; --from-json rewrites the table
    (speed ratio and TFLOP/s from the recorded times) on a CPU."""
    sweep = _script("probes/family_sweep")
    assert sweep.parse_where("SPLIT=1,2;WG=2") == {"SPLIT": {1, 2}, "WG": {2}}
    configs = [{"SPLIT": s, "WG": w} for s in (1, 2, 4) for w in (1, 2)]
    assert sweep.selected(configs, sweep.parse_where("SPLIT=1,2;WG=2")) == [{"SPLIT": 1, "WG": 2}, {"SPLIT": 2, "WG": 2}]
    meta = {"family": "f", "gpu": "FAKE", "date": "d", "torch": "t", "cuda": "c", "cudnn": 1, "commit": "x",
            "command": "cmd", "dtype": "bfloat16", "layout": "nhwc", "tf32": False, "where": None,
            "where_large": "SPLIT=1", "top": 2, "rounds": 3}
    rows = [{"layer": "conv3", "n": 128, "configs": 54, "checked": 54, "cudnn_us": 75.0, "best_us": 60.0,
             "best_plan": "p", "gflop": 30.0, "best": [{"plan": "p", "us": 60.0, "screen_us": 61.0}]},
            {"layer": "conv4", "n": 1, "configs": 3, "checked": 0, "cudnn_us": 12.0, "best_us": None,
             "best_plan": None, "gflop": 0.3, "best": []}]
    path = tmp_path / "family_sweep_f_fake.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    assert sweep.main(["--from-json", str(path)]) == 0
    md = path.with_suffix(".md").read_text()
    assert "| conv3 | 128 | 54 (54) | 75.0 | 60.0 | 1.25x | 500 | `p` |" in md
    assert "| conv4 | 1 | 3 (0) | 12.0 | - | - | - | - |" in md


def test_record_space_times_short_calls_by_gpu_time_as_the_tuner_does():
    """record_space.gpu_timing: a call event-timed under HOST_PACED_US is timed by queued GPU time (median, p20, p80
    of the rounds; reps = rounds x calls) and marked so in its row; a longer one, or one the host could not queue,
    keeps the event timing (None)."""
    from bagf_torch.tuning.measure import HOST_PACED_US, QUEUED_ROUNDS, CudaBenchmarker, Timing

    rec = _script("record_space")

    class Bench(CudaBenchmarker):  # the tuner's queued_times over faked rounds
        def __init__(self, times):
            super().__init__()
            self.times, self.asked = times, []

        def _queued_rounds(self, fns, rounds):
            self.asked.append(rounds)
            return [list(self.times)], [40]

    b = Bench([5.0, 4.0, 6.0])
    t = rec.gpu_timing(b, lambda: None, HOST_PACED_US - 1)
    assert b.asked == [QUEUED_ROUNDS] and (t.median_us, t.p20_us, t.p80_us, t.reps) == (5.0, 4.0, 6.0, 120)
    assert rec.timing_row(t, True) == {"median_us": 5.0, "p20_us": 4.0, "p80_us": 6.0, "reps": 120, "timing": "queued"}
    assert "timing" not in rec.timing_row(Timing(80.0, 79.0, 81.0, 50), False)
    long = Bench([5.0])
    assert rec.gpu_timing(long, lambda: None, HOST_PACED_US) is None and long.asked == []
    assert rec.gpu_timing(Bench([]), lambda: None, 10.0) is None


def test_bench_layers_markdown_renders_every_committed_run(tmp_path):
    """bench_layers' report is a function of its JSON (``markdown``, also ``--from-json``): every committed
    ``bench_layers_*.json`` that records its commit (the runs since the report's present columns: every dtype and
    mode, rows written before the roofline followed the layers' precision among them) renders on the CPU, with the
    per-layer table and the summary line of the committed Markdown, line for line. (The report is written only on
    the GPU machine, where a formatting error would lose a run.)"""
    bl = _script("bench_layers")
    runs = [p for p in sorted((BENCHMARKS / "results").glob("bench_layers_*.json"))
            if "commit" in json.loads(p.read_text())["meta"]]  # (runs since the report's present columns)
    assert len(runs) >= 5
    checked = 0
    for path in runs:
        doc = json.loads(path.read_text())
        lines = bl.markdown(doc)
        assert lines[0].startswith("# AlexNet conv layers") and any(line.startswith("Geomean") for line in lines)
        committed = (path.with_suffix(".md")).read_text().splitlines()
        table = [line for line in lines if line.startswith(f"| {doc['rows'][0]['layer']} |")][:len(doc["rows"])]
        geomean = [line for line in lines if line.startswith("Geomean")]
        if all(line in committed for line in table + geomean):
            checked += 1
    assert checked >= 3, checked  # (older runs' Markdown came from older wording of the other sections)
    src = tmp_path / "bench_layers_x.json"
    src.write_text((BENCHMARKS / "results" / "bench_layers_h200_tf32.json").read_text())
    assert bl.main(["--from-json", str(src)]) == 0
    assert src.with_suffix(".md").read_text().splitlines() == bl.markdown(json.loads(src.read_text()))


def test_module_times_records_each_leaf_call_with_its_own_input_in_call_order():
    """benchmarks/probes/module_times.py times each leaf-module call alone on the input a real forward gives it: the
    recorded inputs are those tensors' values and memory formats (channels_last kept), in call order, copies that
    the forward's later in-place work does not change; a module called twice gives two entries, each with its own
    input; calls with two tensors or with keyword arguments are listed apart, not timed alone."""
    import torch
    from torch import nn

    probe = _script("probes/module_times")

    class Pair(nn.Module):
        def forward(self, a, b=None):
            return a if b is None else a + b

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.act = nn.ReLU(inplace=True)
            self.pair = Pair()
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 5))

        def forward(self, x):
            y = self.conv(x)
            y = self.act(y)  # in place: the conv's output changes after the conv has run
            y = self.pair(y, y)  # two tensors
            y = self.pair(y, b=y)  # a keyword argument
            z = self.act(y - 1)  # the same module again, on another input
            return self.head(z)

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    seen, other = probe.leaf_calls(net, x)
    assert [name for name, _, _ in seen] == ["conv", "act", "act", "head.0", "head.1"]
    assert other == ["pair", "pair"]
    assert [mod for _, mod, _ in seen] == [net.conv, net.act, net.act, net.head[0], net.head[1]]
    _, _, conv_in = seen[0]
    assert torch.equal(conv_in, x) and conv_in.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        pre_relu = net.conv(x)
        second = 4 * torch.relu(pre_relu) - 1
    _, _, act_in = seen[1]
    assert torch.equal(act_in, pre_relu) and (act_in < 0).any()  # taken before the in-place ReLU ran
    assert torch.allclose(seen[2][2], second) and not torch.equal(seen[2][2], act_in)
    assert seen[4][2].shape == (2, 64)


def test_module_times_names_each_call_by_its_own_problem():
    """A layer called at two input shapes has two rows in tune_model's report; module_times gives each call the plan
    of its own problem, "aten" to a TunedConv2d call no row covers, and nothing to other modules."""
    import torch
    from types import SimpleNamespace

    from bagf_torch.nn import TunedConv2d
    from bagf_torch.problem import ConvProblem

    probe = _script("probes/module_times")
    conv = TunedConv2d(3, 4, 3, padding=1)
    small, large = torch.randn(1, 3, 8, 8), torch.randn(1, 3, 16, 16)

    def row(x, plan, layers=("conv",)):
        problem = ConvProblem.from_call(x, conv.weight, conv.bias, conv.stride, (1, 1), conv.dilation, 1)
        return SimpleNamespace(problem=problem, layers=list(layers), plan=plan)

    report = SimpleNamespace(rows=[row(small, "plan_small"), row(large, "plan_large"), row(large, "other", ["x"])])
    assert probe.plan_of(report, "conv", conv, small) == "plan_small"
    assert probe.plan_of(report, "conv", conv, large) == "plan_large"
    assert probe.plan_of(report, "conv", conv, torch.randn(1, 3, 9, 9)) == "aten"
    assert probe.plan_of(report, "relu", torch.nn.ReLU(), small) == ""


def test_device_check_packs_its_results_into_one_file_and_stops_at_its_deadline(tmp_path):
    """A device call returns at most 8 files and ends at 600 s: device_check.sh packs everything under $OUT into
    out.tgz whenever it ends, and at DEADLINE its watchdog stops the running stage (and the script) early enough
    for the packing to run. The script's own preamble, run here with a stage that would outlast the deadline."""
    import subprocess
    import tarfile
    import time

    script = (BENCHMARKS.parent / "scripts" / "device_check.sh").read_text()
    preamble = script[script.index("set -uo pipefail"):script.index("watchdog=$!") + len("watchdog=$!")]
    body = (preamble + '\necho a > "$OUT/a.json"; echo b > "$OUT/b.md"\n'
            'timeout 60 sleep 30 > "$OUT/stage.log" 2>&1\necho never > "$OUT/after.txt"\n')
    (tmp_path / "t.sh").write_text(body)
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(tmp_path / "t.sh")], env={**os.environ, "OUT": str(out), "DEADLINE": "2"},
                         capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 15 and res.returncode == 124, (res.returncode, res.stdout, res.stderr)
    assert sorted(p.name for p in out.iterdir()) == ["out.tgz"]
    with tarfile.open(out / "out.tgz") as tar:
        assert sorted(tar.getnames()) == ["a.json", "b.md", "stage.log"]
    # an ordinary end packs too, and ends with its own status: the script's end stops the watchdog's sleep first, and
    # a watchdog that went on from there to its TERM before it was killed itself stopped the script at 124 with
    # "stopped at the deadline" (seen on a loaded machine; the pause below makes that order certain)
    (tmp_path / "u.sh").write_text(preamble + '\necho a > "$OUT/a.json"\nsleep 0.5; pkill -TERM -P "$watchdog"; '
                                   'sleep 1; kill "$watchdog"\nexit 0\n')
    out2 = tmp_path / "out2"
    res = subprocess.run(["bash", str(tmp_path / "u.sh")], env={**os.environ, "OUT": str(out2), "DEADLINE": "30"},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and sorted(p.name for p in out2.iterdir()) == ["out.tgz"]
    # a packing that outlasts a second after the deadline is not stopped by the watchdog's later TERMs to the
    # script's children (it was: a truncated archive and the loose files came back)
    (tmp_path / "v.sh").write_text('tar() { sleep 3; command tar "$@"; }\n' + body)
    out3 = tmp_path / "out3"
    res = subprocess.run(["bash", str(tmp_path / "v.sh")], env={**os.environ, "OUT": str(out3), "DEADLINE": "2"},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 124 and sorted(p.name for p in out3.iterdir()) == ["out.tgz"], (res.stdout, res.stderr)
    with tarfile.open(out3 / "out.tgz") as tar:
        assert sorted(tar.getnames()) == ["a.json", "b.md", "stage.log"]


def test_bench_layers_marks_a_plan_over_its_checks_bound():
    """The layer benchmark measures each plan's error on its own fresh data beside the bound the check sets there; a
    plan over it (the tuning passed its check on other data) is marked in the table, not only recorded."""
    bl = _script("bench_layers")
    doc = json.loads((BENCHMARKS / "results" / "bench_layers_h200_tf32.json").read_text())
    row = doc["rows"][0]
    plain = [line for line in bl.markdown(doc) if line.startswith(f"| {row['layer']} | {row['n']} | `")]
    assert plain and not any("**over**" in line for line in plain)  # (an older file: no over_bound recorded)
    row["error"]["over_bound"] = True
    marked = [line for line in bl.markdown(doc) if line.startswith(f"| {row['layer']} | {row['n']} | `")]
    assert any(line.endswith("**over** |") for line in marked)


def test_plan_kernels_times_an_nchw_plan_beside_its_channels_last_twin():
    """benchmarks/probes/plan_kernels.py: the same configuration on the NCHW problem and its channels_last twin (only
    NHWC differs), each through the family's space and problem rule; ours and ATen's kernels named short; without a
    GPU it says so and exits 2."""
    probe = _script("probes/plan_kernels")
    bl = _script("bench_layers")
    layer = next(lay for lay in bl.EXTRA if lay[0] == "r3x3_256")
    (p0, c0, why0), (p1, c1, why1) = probe.configs(layer, 32, "bfloat16", {"WN": 128, "MI": 2, "WG": 2, "STAGES": 4,
                                                                                 "SK": 2})
    assert (p0.layout, p1.layout) == ("nchw", "nhwc") and why0 is None and why1 is None
    assert {k: v for k, v in c0.items() if k != "NHWC"} == {k: v for k, v in c1.items() if k != "NHWC"}
    assert (c0["NHWC"], c1["NHWC"], c0["SK"], c0["DT"]) == (0, 1, 2, 1)
    (_, bad, why), _ = probe.configs(layer, 32, "float16", {"SK": 2, "SPLIT": 4})
    assert why and "SPLIT" in why  # (persistent blocks take no split-K: the space says so, nothing is compiled)
    assert probe.short("void bagf::nchw_to_nhwc<1>(__nv_bfloat16 const*, ...)") == "nchw_to_nhwc"
    assert probe.short("void bagf::implicit_gemm_tma_h16_conv2d<1, 128, 2, 2, 4, 0, 2>(...)") == (
        "implicit_gemm_tma_h16_conv2d")
    import torch

    if not torch.cuda.is_available():
        assert probe.main(["--layers", "r1x1_1024", "--batch", "1"]) == 2


def test_plan_kernels_writes_its_rows_and_the_refused_ones(tmp_path):
    """plan_kernels.py's files: every row in the JSON, a measured row's kernels and references in the table, a refused
    configuration's reason in its row."""
    probe = _script("probes/plan_kernels")
    meta = {"gpu": "Fake GPU", "torch": "2", "cuda": "13", "cudnn": 9, "date": "today", "commit": "abc",
            "dtype": "bfloat16", "command": "python benchmarks/probes/plan_kernels.py"}
    rows = [{"layer": "r3x3_256", "n": 32, "layout": "nchw", "plan": "p_nchw", "input_mb": 51.4,
             "graph_us": {"plan": 264.3, "cudnn": 345.1, "aten_to_channels_last": 177.0, "clone": 39.1},
             "kernels_us": {"implicit_gemm_tma_h16_conv2d": 186.6, "nchw_to_nhwc": 72.8}, "clone_kernel_us": 35.0},
            {"layer": "r3x3_256", "n": 32, "layout": "nhwc", "plan": "p_nhwc", "error": "needs 280064 bytes"}]
    lines = probe.write(tmp_path, "sim", meta, rows)
    assert json.loads((tmp_path / "plan_kernels_sim.json").read_text())["rows"] == rows
    assert (tmp_path / "plan_kernels_sim.md").read_text().splitlines() == lines
    assert any("| 264.3 | 345.1 | implicit_gemm_tma_h16_conv2d 186.6; nchw_to_nhwc 72.8 | 51.4 | 177.0 | 39.1 | 35.0 |"
               in x for x in lines)
    # two kernels of one short name (two of ATen's elementwise launches): their times added, not the last kept
    assert probe.by_short_name({"void at::native::elementwise_kernel<128, 4>(A)": 3.0,
                                "void at::native::elementwise_kernel<128, 4>(B)": 0.5,
                                "void bagf::nchw_to_nhwc<1>(x)": 7.9}) == {
        "void at::native::elementwise_kernel": 3.5, "nchw_to_nhwc": 7.9}
    assert any("`p_nhwc` | needs 280064 bytes" in x for x in lines) and "bfloat16" in lines[2]


def test_bench_alexnet_refuses_fewer_than_one_fresh_process_before_any_work(capsys):
    """bench_alexnet.py --children: 3 by default; below 1 a one-line usage error (exit 2) before the GPU is asked
    for, as ``bench --children`` has it."""
    import pytest

    script = _script("bench_alexnet")
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit) as e:
            script.main(["--children", bad])
        assert e.value.code == 2
        assert f"--children must be at least 1, got {bad}" in capsys.readouterr().err
    assert script.bench.CHILDREN == 3


def test_eager_host_reports_a_process_and_sets_served_children_beside_it(monkeypatch):
    """eager_host.py --served: a process's report (whole-forward host time, ATen's ReLU and pooling ops per forward,
    its threads, cProfile's costliest functions in us per forward, the bagf_torch it imported), JSON as a child prints
    it; and the Markdown that sets the fresh processes beside this one and names what makes a served child's numbers
    not the tuned model's."""
    import torch

    probe = _script("probes/eager_host")
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)  # (no GPU: nothing to keep busy)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ticks = iter(range(10**6))  # the thread's CPU clock: 3 us from one reading to the next
    monkeypatch.setattr(probe.time, "thread_time", lambda: next(ticks) * 3e-6)
    timed = []  # (time_forward times by CUDA events: here the calls it was given, run once each)
    monkeypatch.setattr(probe, "time_forward", lambda fn, runs: timed.append(fn()) or types.SimpleNamespace(
        as_dict=lambda: {"median_us": 7.5}))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Conv2d(4, 4, 1), torch.nn.ReLU(inplace=True))
    rep = probe.process_report(model, torch.randn(1, 3, 12, 12), runs=3)
    assert rep["epilogue_ops"] == {"aten::relu": 1, "aten::relu_": 1, "aten::max_pool2d": 1}
    assert rep["no_hooks_us"] > 0 and "MainThread" in rep["threads"] and rep["layer_kinds"] == {}
    assert rep["eager_us"] == 7.5 and len(timed) == 1 and timed[0].shape == (1, 4, 5, 5)
    assert rep["cpu_us"] == pytest.approx(3.0) and rep["cpus"] >= 1 and rep["load"] >= 0
    assert rep["package"].endswith("__init__.py") and rep["profiled_us"] > 0
    head, *rows = rep["profile"].splitlines()
    assert head.split() == ["calls/fwd", "own", "us/fwd", "cum", "us/fwd", "function"] and 0 < len(rows) <= 25
    conv = [r for r in rows if "torch.conv2d" in r]
    assert conv and float(conv[0].split()[0]) == 2  # two convs per forward: calls per forward, not in all
    assert sum(float(r.split()[1]) for r in rows) <= rep["profiled_us"] + 0.1 * len(rows)  # (the table's rounding)
    assert json.loads(json.dumps(rep)) == rep  # (what a child prints)

    kinds = {"features.0|(1, 3, 224, 224)|bfloat16|nhwc|tf32=False": "kernel"}
    own = dict(rep, layer_kinds=kinds)
    served = dict(rep, plans_loaded=1, tuned=0, stderr="TunedConv2d: a log line\n", layer_kinds=kinds)
    children = [("stock child 1", dict(rep, stderr="")), ("served child 1", served),
                ("stock child 2", dict(rep, stderr="")), ("served child 2", served)]
    lines, problems = probe.served_section(own, children)
    table = [x for x in lines if x.startswith("| ")]
    assert len(table) == 6  # the header, this process, four children
    assert table[3] == (f"| served child 1 | {rep['no_hooks_us']:.1f} | 3.0 | 7.5 | max_pool2d 1, relu 1, relu_ 1 | "
                        f"{rep['profiled_us']:.1f} | {', '.join(rep['threads'])} | {rep['load']:.2f} | 1 / 0 |")
    assert problems == [] and not any("Not the numbers they claim to be" in x for x in lines)
    assert sum(x.startswith("cProfile, ") for x in lines) == 3  # this process and the first child of each kind
    assert "TunedConv2d: a log line" in lines
    children[0] = ("stock child 1", dict(rep, stderr="", exit_code=-6))
    children[1] = ("served child 1", dict(served, package="/elsewhere/bagf_torch/__init__.py"))
    children[2] = ("stock child 2", {"error": "exit 1, no report", "stderr": "Traceback: it broke"})
    children[3] = ("served child 2", dict(served, plans_loaded=0, layer_kinds={next(iter(kinds)): "later"}))
    lines, problems = probe.served_section(own, children)
    assert "| stock child 2 | failed: exit 1, no report | | | | | | | |" in lines and "Traceback: it broke" in lines
    (said,) = [x for x in lines if x.startswith("**Not the numbers they claim to be:**")]
    assert all(p in said for p in problems) and len(problems) == 5
    problems = said
    assert "stock child 1 exited with -6 after its report" in problems
    assert "served child 1 imported /elsewhere/bagf_torch/__init__.py" in problems
    assert "stock child 2 failed (exit 1, no report)" in problems
    assert "served child 2: features.0|(1, 3, 224, 224)|bfloat16|nhwc|tf32=False ran later (kernel here)" in problems
    assert "served child 2 loaded 0 plans and tuned 0 problems" in problems


def test_eager_host_runs_its_children_with_this_package_and_keeps_what_they_said(monkeypatch, tmp_path):
    """eager_host.py --served: each fresh process runs this file through a stub that puts this process's bagf_torch
    folder first on its path (a checkout in the working directory would shadow an installed copy), with cuDNN's TF32
    as this process has it and BAGF_TUNE=0 where it serves; a child that hangs or dies keeps its stderr, one that
    reports and then fails keeps its report with its exit code."""
    import subprocess as sp

    probe = _script("probes/eager_host")
    args = probe.argparse.Namespace(model="alexnet", batch=1, dtype="bfloat16", runs=7, channels_last=True)
    seen = []

    def run(cmd, capture_output, text, timeout, env):
        seen.append((cmd, env, timeout))
        return seen_reply[0](cmd)

    monkeypatch.setattr(probe.subprocess, "run", run)
    seen_reply = [lambda cmd: sp.CompletedProcess(cmd, 0, probe.MARK + json.dumps({"no_hooks_us": 1.0}) + "\n", "log")]
    assert probe.in_fresh_process("served", args, True, 45) == {"no_hooks_us": 1.0, "stderr": "log"}
    cmd, env, timeout = seen[-1]
    assert cmd[:2] == [sys.executable, "-c"] and timeout == 45 and env["BAGF_TUNE"] == "0"
    assert cmd[3:] == ["--child", "served", "--model", "alexnet", "--batch", "1", "--dtype", "bfloat16", "--runs",
                       "7", "--tf32", "1", "--channels-last"]
    probe.in_fresh_process("stock", args, False, 45)
    assert "--tf32" in seen[-1][0] and seen[-1][0][seen[-1][0].index("--tf32") + 1] == "0"
    assert seen[-1][1].get("BAGF_TUNE") == os.environ.get("BAGF_TUNE")  # (stock: the environment as it is)

    seen_reply[0] = lambda cmd: sp.CompletedProcess(cmd, -6, probe.MARK + json.dumps({"no_hooks_us": 2.0}), "abort")
    assert probe.in_fresh_process("stock", args, False, 45) == {"no_hooks_us": 2.0, "stderr": "abort", "exit_code": -6}
    seen_reply[0] = lambda cmd: sp.CompletedProcess(cmd, 1, "", "Traceback ...")
    assert probe.in_fresh_process("stock", args, False, 45) == {"error": "exit 1, no report", "stderr": "Traceback ..."}

    def hang(cmd):
        raise sp.TimeoutExpired(cmd, 45, output=b"", stderr=b"still compiling")

    seen_reply[0] = hang
    assert probe.in_fresh_process("stock", args, False, 45) == {"error": "no report within 45 s",
                                                                  "stderr": "still compiling"}

    # the stub itself, for real: this file as __main__ with its arguments, the package folder first on the path
    monkeypatch.undo()
    import bagf_torch

    here = str(Path(bagf_torch.__file__).resolve().parents[1])
    stub = probe.CHILD_STUB.format(here=here, script=str(BENCHMARKS / "probes" / "eager_host.py"))
    r = sp.run([sys.executable, "-c", stub, "--help"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and "--served" in r.stdout and "--child-timeout" in r.stdout, r.stderr
    r = sp.run([sys.executable, "-c", stub.replace("runpy.run_path", "print(sys.path[0]); (lambda *a, **k: 0)")],
               capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.stdout.strip() == here, r.stderr


@pytest.mark.parametrize("shape,kernel,stride,padding", [
    ((2, 3, 224, 224), (11, 11), 4, (2, 2)),  # AlexNet's conv1
    ((1, 5, 23, 21), (11, 10), 4, (2, 1)),  # odd sizes and channels, a non-square filter, uneven padding
    ((3, 2, 17, 19), (5, 6), 2, (0, 3)),
])
def test_polyphase_probes_rearrangement_is_the_strided_conv(shape, kernel, stride, padding):
    """benchmarks/probes/polyphase_tma.py times a strided conv as a 3x3 stride-1 conv over its rearranged input and
    filter: the two must give the original conv's output (float64, channels_last input as the probe feeds it)."""
    import torch
    import torch.nn.functional as F

    probe = _script("probes/polyphase_tma")
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, dtype=torch.float64, generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(7, shape[1], *kernel, dtype=torch.float64, generator=g)
    b = torch.randn(7, dtype=torch.float64, generator=g)
    ref = F.conv2d(x, w, b, stride=stride, padding=padding)
    p, q = ref.shape[2:]
    xr = probe.rearrange(x, stride, padding, p, q)
    assert xr.shape == (shape[0], stride * stride * shape[1], p + 2, q + 2)
    assert xr.is_contiguous(memory_format=torch.channels_last)  # as the 16-bit TMA plans read it
    wr = probe.rearrange_weight(w, stride)
    assert wr.shape == (7, stride * stride * shape[1], 3, 3)
    torch.testing.assert_close(F.conv2d(xr, wr, b), ref, rtol=1e-12, atol=1e-12)


def test_polyphase_probes_triton_rearrangement_matches_atens(monkeypatch):
    """The probe's one-kernel rearrangement (Triton, run by its CPU interpreter here) writes ATen's rearranged copy
    bit for bit, in 16-bit channels_last, odd sizes and uneven padding included."""
    pytest.importorskip("triton")
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    probe = _script("probes/polyphase_tma")
    gather = probe.triton_rearrange()
    # (the last: one channel, and a negative padding, a crop)
    for shape, s, pad, (p, q) in [((2, 3, 23, 21), 4, (2, 1), (5, 4)), ((1, 5, 17, 19), 2, (0, 3), (7, 10)),
                                  ((1, 1, 9, 8), 2, (-1, 0), (2, 2))]:
        x = torch.randn(*shape).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
        want = probe.rearrange(x, s, pad, p, q)
        got = gather(x, s, pad, p, q)
        assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got, want)


def test_polyphase_probes_table_has_a_cell_per_column_with_and_without_triton():
    probe = _script("probes/polyphase_tma")
    row = {"n": 32, "outer_plan": "winograd_gemm_f5", "inner_plan": "implicit_gemm_tma_h16_wn64", "polyphase_err": 1e-3,
           "cudnn_err": 2e-3, "plan_err": 1.5e-3, "polyphase_err_max": 3e-3, "cudnn_err_max": 4e-3,
           "plan_err_max": 3.5e-3}
    row.update({k: 10.0 for k in ("cudnn_us", "plan_us", "rearrange_us", "copy_us", "inner_us", "inner_cudnn_us",
                                  "polyphase_us", "polyphase_vs_cudnn", "copy_plus_inner_vs_cudnn", "plan_vs_cudnn",
                                  "inner_vs_cudnn")})
    plain = probe.table([row])
    with_triton = probe.table([dict(row, rearrange_triton_us=3.0, polyphase_triton_us=13.0,
                                    polyphase_triton_vs_cudnn=0.77)])
    for lines, columns in ((plain, 15), (with_triton, 18)):
        head, rule, cells = lines
        assert head.count("|") - 1 == rule.count("|") - 1 == cells.count("|") - 1 == columns
    assert "polyphase triton vs cuDNN" in with_triton[0] and "0.77x" in with_triton[2]
    assert "triton" not in plain[0]
    assert "1.00e-03 (max 3.00e-03) / 2.00e-03 (max 4.00e-03) / 1.50e-03 (max 3.50e-03)" in plain[2]

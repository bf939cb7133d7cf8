"""CPU tests of the end-to-end benchmark's bookkeeping and of the cuDNN-mode rule of the discovery pass."""

from __future__ import annotations

import torch
from torch import nn

from bagf_torch import bench
from bagf_torch.nn import TunedConv2d
from bagf_torch.pretune import discover


def _row(us):
    return {"median_us": us, "p25_us": us, "p75_us": us, "runs": 10}


def test_table_and_speedups_accept_child_rows_without_max_rel_diff():
    # stock / stock_graph come from the child process: times only, no max_rel_diff
    row = {"stock": _row(500.0), "stock_graph": _row(440.0), "stock_benchmark": dict(_row(480.0), max_rel_diff=0.0),
           "bagf": dict(_row(400.0), max_rel_diff=1e-6), "stock_benchmark_graph": dict(_row(420.0), max_rel_diff=0.0),
           "bagf_graph": dict(_row(200.0), max_rel_diff=2e-6)}
    s = bench.speedups(row)
    assert s["bagf_vs_stock"] == 500.0 / 400.0
    assert s["bagf_vs_stock_benchmark"] == 480.0 / 400.0
    assert s["bagf_graph_vs_stock_graph"] == 440.0 / 200.0
    assert s["bagf_graph_vs_stock_benchmark_graph"] == 420.0 / 200.0
    lines = bench.table({1: row})
    assert lines[0].startswith("| N | stock us | stock_benchmark us | bagf us | stock_graph us | stock_benchmark_graph us")
    head, cells = ([c.strip() for c in line.strip("|").split("|")] for line in (lines[0], lines[2]))
    assert len(head) == len(cells) == lines[1].count("|") - 1
    by = dict(zip(head, cells))
    # the like-for-like ratios (cuDNN in benchmark mode, this process) first, PyTorch's defaults beside them
    assert head.index("bagf vs stock_benchmark") < head.index("bagf vs stock (default)")
    assert by["bagf vs stock_benchmark"] == "1.20x" and by["bagf graph vs stock_benchmark graph"] == "2.10x"
    assert by["bagf vs stock (default)"] == "1.25x" and by["bagf graph vs stock graph (default)"] == "2.20x"
    assert by["max rel diff"] == "2.0e-06"


def test_discovery_pass_runs_convs_in_cudnn_benchmark_mode():
    """torch caches the first cuDNN algorithm it picks per shape; the discovery pass must not fix a heuristic
    (benchmark-off) pick that the tuner would then compare against."""
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch.backends.cudnn.benchmark)
            return x

    model = nn.Sequential(Probe(), TunedConv2d(3, 4, 3, padding=1))
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        found = discover(model, [torch.randn(1, 3, 8, 8)])
        assert seen == [True]
        assert torch.backends.cudnn.benchmark is False  # restored
        assert found.calls == 1  # the TunedConv2d was reached (on a CPU it is recorded as unsupported)
    finally:
        torch.backends.cudnn.benchmark = before


def test_tf32_mode_reaches_both_sides_and_the_stock_child(monkeypatch):
    """``bench --tf32 on`` times both models with cuDNN's TF32 on (matmuls strict, PyTorch's default), the stock
    model's fresh child process included; the flags are restored afterwards."""
    import json
    import subprocess
    import types

    cudnn, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    with bench.fp32(benchmark=True, tf32=True):
        assert torch.backends.cudnn.allow_tf32 is True and torch.backends.cuda.matmul.allow_tf32 is False
    with bench.fp32(benchmark=True):
        assert torch.backends.cudnn.allow_tf32 is False
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (cudnn, matmul)

    seen = []

    def run(cmd, **kw):
        seen.append(cmd)
        return types.SimpleNamespace(returncode=0, stdout=json.dumps({"stock": _row(1.0)}) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    assert bench.in_child("stock", "alexnet", (1, 3, 224, 224), 5, False, tf32=True) == {"stock": _row(1.0)}
    assert bench.in_child("stock", "alexnet", (1, 3, 224, 224), 5, True)
    assert seen[0][seen[0].index("--child") + 1:] == ["stock", "alexnet", "1,3,224,224", "5", "0", "1", "float32",
                                                       "contiguous", "0"]
    assert seen[1][seen[1].index("--child") + 1:][4:6] == ["1", "0"]


def test_served_child_runs_with_tuning_off_in_the_models_dtype_and_format(monkeypatch):
    """The served variant is a fresh process that only loads plans (BAGF_TUNE=0), in the parent's dtype and memory
    format; the stock child keeps the parent's environment; an unknown kind is refused before anything runs."""
    import json
    import subprocess
    import types

    import pytest

    seen = []

    def run(cmd, env=None, **kw):
        seen.append((cmd, env))
        return types.SimpleNamespace(returncode=0, stdout=json.dumps({"bagf_served": _row(2.0)}) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("BAGF_TUNE", "1")
    assert bench.in_child("bagf", "alexnet", (32, 3, 224, 224), 5, True, False, "bfloat16", "channels_last") == {
        "bagf_served": _row(2.0)}
    cmd, env = seen[0]
    assert cmd[cmd.index("--child") + 1:] == ["bagf", "alexnet", "32,3,224,224", "5", "1", "0", "bfloat16",
                                             "channels_last", "0"]
    assert env["BAGF_TUNE"] == "0"
    bench.in_child("stock", "alexnet", (1, 3, 224, 224), 5, False)
    assert seen[1][1]["BAGF_TUNE"] == "1"
    with pytest.raises(ValueError, match="child kind"):
        bench.in_child("tuned", "alexnet", (1, 3, 224, 224), 5, False)
    assert len(seen) == 2


def test_fresh_processes_alternate_by_kind_and_each_variant_shows_its_median_child(monkeypatch):
    """``time_in_children``: ``children`` fresh processes of each kind, stock and served alternating (the order
    reversed every other turn), every served one checked against the tuned model's layers; each variant is its median
    child's entry (its quartiles with it), with every child's median in the order they ran and the chosen one's place;
    a served child that ran other plans stops the run, the third as well as the first."""
    import pytest

    kinds = {"features.0|(1, 3, 224, 224)|float32|nchw|tf32=False": "kernel"}
    stock_us, served_us = iter([500.0, 300.0, 400.0]), iter([250.0, 600.0, 350.0])
    beside_us = iter([375.0, 720.0, 350.0])
    seen = []

    def in_child(kind, model, shape, runs, graphs, tf32, dtype, fmt, frozen=False):
        seen.append((kind, model, shape, runs, graphs, tf32, dtype, fmt, frozen))
        if kind == "stock":
            us = next(stock_us)
            return {"stock": dict(_row(us), p25_us=us - 1), "stock_graph": _row(us / 10)}
        us = next(served_us)
        beside = next(beside_us)  # the stock copy timed in the served child's own process
        return {"bagf_served": dict(_row(us), layer_kinds=kinds, tuned=0), "bagf_served_graph": _row(us / 10),
                "stock_in_served": _row(beside), "stock_in_served_graph": _row(beside / 5)}

    monkeypatch.setattr(bench, "in_child", in_child)
    x = torch.randn(1, 3, 224, 224)
    got = bench.time_in_children(("stock", "bagf"), "alexnet", x, 7, True, False, None, True, 3, kinds)
    assert [s[0] for s in seen] == ["stock", "bagf", "bagf", "stock", "stock", "bagf"]
    assert seen[0][1:] == ("alexnet", (1, 3, 224, 224), 7, True, False, "float32", "contiguous", True)
    assert got["stock"] == dict(_row(400.0), p25_us=399.0, children_us=[500.0, 300.0, 400.0], child=2)
    assert got["bagf_served"]["median_us"] == 350.0 and got["bagf_served"]["children_us"] == [250.0, 600.0, 350.0]
    assert got["stock_graph"]["median_us"] == 40.0 and got["bagf_served_graph"]["median_us"] == 35.0
    # each served child's stock copy over its served model, child by child (not the median children's ratio,
    # 350 / 350), in the order they ran, and their median
    assert got["bagf_served"]["same_process_ratios"] == [1.5, 1.2, 1.0]
    assert got["bagf_served"]["same_process_ratio"] == 1.2
    assert got["bagf_served_graph"]["same_process_ratios"] == [3.0, 2.4, 2.0]
    assert got["stock_in_served"]["children_us"] == [375.0, 720.0, 350.0]
    s = bench.speedups(dict(got, stock_benchmark=_row(450.0), bagf=_row(300.0)))
    assert s["bagf_served_vs_stock_same_process"] == 1.2 and s["bagf_served_graph_vs_stock_graph_same_process"] == 2.4
    assert s["bagf_served_vs_stock"] == 400.0 / 350.0
    # an even count: the lower middle child, whole
    assert bench.median_child([_row(9.0), _row(3.0), _row(5.0), _row(7.0)]) == dict(
        _row(5.0), children_us=[9.0, 3.0, 5.0, 7.0], child=2)
    lines = bench.children_lines({1: got, 32: {"stock": dict(_row(1.0), children_us=[1.0])}})
    assert lines == ["- N = 1: stock 500.0 / 300.0 / 400.0; bagf_served 250.0 / 600.0 / 350.0; stock_graph 50.0 / "
                     "30.0 / 40.0; bagf_served_graph 25.0 / 60.0 / 35.0; stock_in_served over bagf_served in each "
                     "served process 1.50x / 1.20x / 1.00x; stock_in_served_graph over bagf_served_graph in each "
                     "served process 3.00x / 2.40x / 2.00x"]
    table = bench.table({1: dict(got, stock_benchmark=_row(450.0), bagf=_row(300.0))})
    head, cells = ([c.strip() for c in line.strip("|").split("|")] for line in (table[0], table[2]))
    assert len(head) == len(cells) == table[1].count("|") - 1
    by = dict(zip(head, cells))
    assert by["served vs stock"] == "1.14x" and by["served vs stock, same process"] == "1.20x"
    assert by["served graph vs stock graph, same process"] == "2.40x"
    assert "stock_in_served us" not in head  # (its times are in the JSON; the table and the lines give the ratios)
    # the third served child ran torch's conv where the tuned model runs our kernel
    served_kinds = iter([kinds, kinds, {next(iter(kinds)): "later"}])
    monkeypatch.setattr(bench, "in_child", lambda kind, *a, **k: {"bagf_served": dict(
        _row(2.0), layer_kinds=next(served_kinds), tuned=0)} if kind == "bagf" else {"stock": _row(1.0)})
    with pytest.raises(RuntimeError, match="features.0.*kernel here, later served"):
        bench.time_in_children(("stock", "bagf"), "alexnet", x, 7, True, False, None, False, 3, kinds)
    with pytest.raises(ValueError, match="at least one"):
        bench.time_in_children(("stock",), "alexnet", x, 7, True, False, None, False, 0, kinds)


def test_child_args_carry_the_inputs_shape_dtype_and_format():
    x = torch.randn(2, 3, 5, 5)
    assert bench.child_args(x) == ((2, 3, 5, 5), "float32", "contiguous")
    assert bench.child_args(x.to(torch.float16).contiguous(memory_format=torch.channels_last)) == (
        (2, 3, 5, 5), "float16", "channels_last")
    one = torch.randn(2, 1, 5, 5, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    assert bench.child_args(one)[1:] == ("bfloat16", "contiguous")  # both formats at once: the strides cannot tell
    assert bench.child_args(one, channels_last=True)[2] == "channels_last"  # the caller can
    assert bench.child_args(x, channels_last=False)[2] == "contiguous"


def test_the_childs_command_line_reaches_the_child_as_written(monkeypatch):
    """What ``in_child`` writes, ``main`` reads back into the same arguments; the child's program puts this process's
    package folder where ``python -c`` puts the working directory."""
    import json
    import os
    import subprocess
    import types

    got = []
    monkeypatch.setattr(bench, "_child", lambda *a: got.append(a) or {"bagf_served": _row(1.0)})

    def run(cmd, env=None, **kw):
        assert cmd[1] == "-c"
        here = os.path.dirname(os.path.dirname(os.path.abspath(bench.__file__)))
        assert f"sys.path[0] = {here!r}" in cmd[2]
        assert bench.main(cmd[3:]) == 0
        return types.SimpleNamespace(returncode=0, stdout=json.dumps({"bagf_served": _row(1.0)}) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    bench.in_child("bagf", "torchvision:resnet18", (8, 3, 224, 224), 7, True, True, "float16", "channels_last")
    bench.in_child("bagf", "alexnet", (1, 3, 224, 224), 3, False, False, frozen=True)
    assert got == [("bagf", "torchvision:resnet18", "8,3,224,224", 7, True, True, "float16", "channels_last", False),
                   ("bagf", "alexnet", "1,3,224,224", 3, False, False, "float32", "contiguous", True)]
    assert bench.main(["--child", "tuned", "alexnet", "1,3,8,8", "1", "0", "0", "float32", "contiguous", "0"]) == 2
    assert bench.main(["--child", "bagf", "alexnet", "1,3,8,8", "1", "0", "0", "float32", "contiguous"]) == 2


def test_the_child_program_imports_this_package_from_any_working_directory(tmp_path):
    """The real child command from a folder holding a decoy ``bagf_torch``: it runs this process's package (the
    decoy would fail the import), which answers a bad command line with its usage and exit 2."""
    import os
    import subprocess
    import sys

    (tmp_path / "bagf_torch").mkdir()
    (tmp_path / "bagf_torch" / "__init__.py").write_text("raise ImportError('the decoy was imported')\n")
    here = os.path.dirname(os.path.dirname(os.path.abspath(bench.__file__)))
    r = subprocess.run([sys.executable, "-c", bench.CHILD_STUB.format(here=repr(here)), "--child", "nope"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "usage: python -m bagf_torch.bench --child" in r.stderr, r.stderr[-2000:]


def test_a_served_child_that_ran_other_kinds_or_tuned_stops_the_run():
    import pytest

    here = {"features.0|(1, 3, 8, 8)|float32|nchw|tf32=True": "kernel",
            "features.0|(2, 3, 8, 8)|float32|nchw|tf32=True": "kernel",  # another batch size: the child need not run it
            "features.3|(1, 4, 8, 8)|float32|nchw|tf32=True": "aten"}
    one, three = "features.0|(1, 3, 8, 8)|float32|nchw|tf32=True", "features.3|(1, 4, 8, 8)|float32|nchw|tf32=True"
    served = {"bagf_served": {"layer_kinds": {one: "kernel", three: "aten"}, "tuned": 0}, "bagf_served_graph": {}}
    bench._check_served(here, served)
    served["bagf_served"]["layer_kinds"][three] = "later"  # torch's conv on both sides: the same call
    bench._check_served(here, served)
    served["bagf_served"]["layer_kinds"][one] = "later"  # no plan in the child's cache: torch's conv, not ours
    with pytest.raises(RuntimeError, match=r"features.0\|\(1, 3, 8, 8\).*: kernel here, later served"):
        bench._check_served(here, served)
    with pytest.raises(RuntimeError, match="tuned 1 problem"):
        bench._check_served(here, {"bagf_served": {"layer_kinds": {one: "kernel"}, "tuned": 1}})
    with pytest.raises(RuntimeError, match="missing here, kernel served"):
        bench._check_served(here, {"bagf_served": {"layer_kinds": {"features.6|(1, 4, 8, 8)|float32|nchw|tf32=True":
                                                                   "kernel"}, "tuned": 0}})
    with pytest.raises(RuntimeError, match="no TunedConv2d call"):
        bench._check_served(here, {"bagf_served": {"layer_kinds": {}, "tuned": 0}})


def test_layer_kinds_name_what_each_call_of_each_layer_ran(monkeypatch):
    """One entry per layer and kind of call: a layer called at two shapes, one planned (our kernel) and one not yet
    (torch's conv meanwhile), reports both; a layer never called reports nothing."""
    from bagf_torch import nn as bnn
    from bagf_torch import runtime
    from bagf_torch.ops import ATEN

    class FakeRuntime:
        def lookup(self, problem, device):
            return (7, True) if problem.h == 8 else (ATEN, False)  # ATen for now: asked again later

    monkeypatch.setattr(bnn.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    monkeypatch.setattr(runtime, "get", lambda: FakeRuntime())
    monkeypatch.setattr(bnn, "_op", lambda: lambda x, w, b, s, p, d, h: torch.nn.functional.conv2d(x, w, b, s, p, d))
    model = nn.Sequential(TunedConv2d(3, 4, 3, padding=1), nn.ReLU(), TunedConv2d(4, 4, 1))
    assert bench.layer_kinds(model) == {}
    with torch.no_grad():
        model[0](torch.randn(1, 3, 8, 8))
        model[0](torch.randn(1, 3, 16, 16))
        model[0](torch.randn(1, 3, 8, 8))  # the fast path: the table's entry again
    tf32 = torch.backends.cudnn.allow_tf32
    kinds = bench.layer_kinds(model)
    assert kinds == {f"0|(1, 3, 8, 8)|float32|nchw|tf32={tf32}": "kernel",
                     f"0|(1, 3, 16, 16)|float32|nchw|tf32={tf32}": "later"}, kinds


def test_no_served_variant_without_a_cache_file(monkeypatch, tmp_path):
    from bagf_torch import runtime
    from bagf_torch.cache import Cache

    monkeypatch.setenv("BAGF_CACHE_DIR", str(tmp_path))
    rt = runtime.Runtime()
    monkeypatch.setattr(runtime, "get", lambda: rt)
    assert bench._cache_shared()
    monkeypatch.setattr(rt, "cache", lambda: Cache(None))
    assert not bench._cache_shared()


def test_table_shows_the_served_speedups_where_a_served_child_ran():
    row = {"stock": _row(500.0), "stock_graph": _row(440.0), "stock_benchmark": dict(_row(480.0), max_rel_diff=0.0),
           "bagf": dict(_row(400.0), max_rel_diff=1e-6), "bagf_served": _row(250.0),
           "bagf_served_graph": _row(220.0)}
    s = bench.speedups(row)
    assert s["bagf_served_vs_stock"] == 2.0 and s["bagf_served_graph_vs_stock_graph"] == 2.0
    lines = bench.table({1: row})
    head, cells = ([c.strip() for c in line.strip("|").split("|")] for line in (lines[0], lines[2]))
    assert len(head) == len(cells) == lines[1].count("|") - 1
    by = dict(zip(head, cells))
    assert by["served vs stock"] == "2.00x" and by["served graph vs stock graph"] == "2.00x"
    assert by["bagf_served us"] == "250.0" and by["bagf vs stock (default)"] == "1.25x"


def test_result_names_keep_each_precision_mode_apart():
    modes = [(dt, cl, tf) for dt in ("float32", "float16", "bfloat16") for cl in (False, True) for tf in (False, True)
             if not (tf and dt != "float32")]
    tags = [bench.mode_tag(*m) for m in modes]
    assert len(set(tags)) == len(modes), dict(zip(modes, tags))  # (a run in one mode never overwrites another's)
    assert bench.mode_tag() == ""  # (strict fp32 NCHW keeps the plain names: bench_layers_h200.json)
    assert bench.mode_tag("bfloat16", True) == "_bf16_nhwc" and bench.mode_tag("float32", False, True) == "_tf32"


def test_variants_are_timed_in_turns_each_inside_its_own_flags(monkeypatch):
    """``time_interleaved`` goes round the variants (a drift during the run reaches each alike), the order rotating
    from turn to turn, every turn inside the variant's context (its cuDNN flags), each variant timed ``runs`` times in
    all."""
    import contextlib

    order, inside = [], []
    current = []

    @contextlib.contextmanager
    def flags(name):
        current.append(name)
        yield
        current.pop()

    def sample(fn, n):
        fn()
        order.append((current[-1], n))
        return [{"a": 1.0, "b": 2.0}[current[-1]]] * n

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench, "time_samples", sample)
    variants = {v: ((lambda v=v: inside.append((v, tuple(current)))), (lambda v=v: flags(v))) for v in "ab"}
    got = bench.time_interleaved(variants, runs=25, warmup=3, rounds=10)
    # (turns, not one variant's runs and then the other's; neither always first)
    assert [name for name, _ in order] == ["a", "b", "b", "a"] * 5
    assert sum(n for name, n in order if name == "a") == 25 == sum(n for name, n in order if name == "b")
    assert all(ctx == (v,) for v, ctx in inside)  # (every call, warm-up too, inside its own variant's flags)
    assert got["a"].median_us == 1.0 and got["b"].median_us == 2.0 and got["a"].runs == 25
    order.clear()
    assert bench.time_interleaved(variants, runs=3, warmup=0)["b"].runs == 3
    # (fewer runs than rounds: one run per turn)
    assert order == [("a", 1), ("b", 1), ("b", 1), ("a", 1), ("a", 1), ("b", 1)]
    order.clear()
    monkeypatch.setattr(bench, "time_samples", lambda fn, n: order.append((current[-1], n)) or [1.0] * n)
    three = {v: ((lambda: None), (lambda v=v: flags(v))) for v in "xyz"}
    bench.time_interleaved(three, runs=3, warmup=0)
    assert "".join(name for name, _ in order) == "xyzyzxzxy"  # (each variant first in one turn)

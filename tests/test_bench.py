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
    assert "2.0e-06" in lines[-1] and "1.25x" in lines[-1]


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
                                                       "contiguous"]
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
                                             "channels_last"]
    assert env["BAGF_TUNE"] == "0"
    bench.in_child("stock", "alexnet", (1, 3, 224, 224), 5, False)
    assert seen[1][1]["BAGF_TUNE"] == "1"
    with pytest.raises(ValueError, match="child kind"):
        bench.in_child("tuned", "alexnet", (1, 3, 224, 224), 5, False)
    assert len(seen) == 2


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
    """What ``in_child`` writes, ``main`` (``python -m bagf_torch.bench``) reads back into the same arguments, and
    the child imports this process's package whatever the working directory."""
    import json
    import os
    import subprocess
    import types

    got = []
    monkeypatch.setattr(bench, "_child", lambda *a: got.append(a) or {"bagf_served": _row(1.0)})

    def run(cmd, env=None, **kw):
        assert cmd[1:3] == ["-m", "bagf_torch.bench"]
        here = os.path.dirname(os.path.dirname(os.path.abspath(bench.__file__)))
        assert env["PYTHONPATH"].split(os.pathsep)[0] == here
        assert bench.main(cmd[3:]) == 0
        return types.SimpleNamespace(returncode=0, stdout=json.dumps({"bagf_served": _row(1.0)}) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    bench.in_child("bagf", "torchvision:resnet18", (8, 3, 224, 224), 7, True, True, "float16", "channels_last")
    assert got == [("bagf", "torchvision:resnet18", "8,3,224,224", 7, True, True, "float16", "channels_last")]
    assert bench.main(["--child", "tuned", "alexnet", "1,3,8,8", "1", "0", "0", "float32", "contiguous"]) == 2


def test_a_served_child_that_ran_other_kinds_or_tuned_stops_the_run():
    import pytest

    here = {"features.0": "kernel", "features.3": "aten"}
    served = {"bagf_served": {"layer_kinds": dict(here), "tuned": 0}, "bagf_served_graph": {}}
    bench._check_served(here, served)
    served["bagf_served"]["layer_kinds"]["features.0"] = "later"  # no plan in the child's cache: torch's conv
    with pytest.raises(RuntimeError, match="features.0: kernel here, later served"):
        bench._check_served(here, served)
    with pytest.raises(RuntimeError, match="tuned 1 problem"):
        bench._check_served(here, {"bagf_served": {"layer_kinds": dict(here), "tuned": 1}})
    with pytest.raises(RuntimeError, match="features.3: aten here, missing served"):
        bench._check_served(here, {"bagf_served": {"layer_kinds": {"features.0": "kernel"}, "tuned": 0}})


def test_layer_kinds_name_what_each_tuned_layer_ran():
    model = nn.Sequential(TunedConv2d(3, 4, 3, padding=1), nn.ReLU(), TunedConv2d(4, 4, 1))
    assert bench.layer_kinds(model) == {"0": "none", "2": "none"}
    with torch.no_grad():
        model[0](torch.randn(1, 3, 8, 8))  # on a CPU: torch's conv (a call the kernels do not take)
    assert bench.layer_kinds(model) == {"0": "aten", "2": "none"}


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
    assert by["bagf_served us"] == "250.0" and by["bagf vs stock"] == "1.25x"

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
    assert bench.stock_in_child("alexnet", (1, 3, 224, 224), 5, False, tf32=True) == {"stock": _row(1.0)}
    assert bench.stock_in_child("alexnet", (1, 3, 224, 224), 5, True)
    assert seen[0][-2:] == ["0", "1"] and seen[1][-2:] == ["1", "0"]
    assert seen[0][seen[0].index("--stock-child") + 1:] == ["alexnet", "1,3,224,224", "5", "0", "1"]

"""Where a call's time goes at small batch: the GPU's time for the call (CUDA-graph replay, no host in the
loop), the per-call time the layer benchmark reports (CUDA events around each eager call: the host's issue
cost shows wherever it exceeds the GPU's), and the host's issue cost alone (eager calls issued while a sleep
kernel keeps the GPU busy), for cuDNN (F.conv2d, benchmark mode, TF32 off) and for given plans.

    python benchmarks/host_floor.py --plans implicit_gemm_tc_bm64_bn32_bk32_wm2_wn4_st3_s4_sm90@conv1:1 ...

A plan is ``<family name>@<layer>:<N>`` (the names bench_layers.py prints; layers as in bench_layers.py).
Writes JSON + Markdown (``--out``, ``--tag``). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layers import ALEXNET, EXTRA, problem  # noqa: E402

from bagf_torch import runtime  # noqa: E402
from bagf_torch.bench import gpu_tag  # noqa: E402
from bagf_torch.kernels import FAMILIES, formats  # noqa: E402
from bagf_torch.ops import ATEN  # noqa: E402
from bagf_torch.tuning.measure import CudaBenchmarker, CudaChecker, Workspace  # noqa: E402

GRAPH_CALLS = 20
HOST_CALLS = 200
SLEEP_CYCLES = 2e8


def parse_plan(spec: str):
    """``<family name>@<layer>:<N>`` -> (family module, config, ConvProblem). A configuration that names its dtype
    or memory format (the DT and NHWC knobs) gets a problem in them; a family that computes one memory format only in
    that dtype (``kernels.formats``, e.g. implicit_gemm_wgmma_h16: channels_last) gets that one."""
    name, where = spec.split("@")
    layer, n = where.split(":")
    layers = {lay[0]: lay for lay in ALEXNET + EXTRA}
    fam, c = config_of(name)
    p = problem(layers[layer], int(n))
    if "DT" in c and hasattr(fam, "DTYPES"):
        p = dataclasses.replace(p, dtype=next(k for k, v in fam.DTYPES.items() if v == c["DT"]))
    if "NHWC" in c and hasattr(fam, "LAYOUTS"):
        p = dataclasses.replace(p, layout=next(k for k, v in fam.LAYOUTS.items() if v == c["NHWC"]))
    layouts = [layout for dtype, layout in formats(fam) if dtype == p.dtype]
    if len(layouts) == 1:
        p = dataclasses.replace(p, layout=layouts[0])
    return fam, c, p


def config_of(plan_name: str):
    """(family module, config) whose ``name()`` is ``plan_name``."""
    for fam in FAMILIES.values():
        if plan_name.startswith(fam.FAMILY + "_"):
            for c in fam.space().valid_configs():
                if fam.name(c) == plan_name:
                    return fam, c
    raise SystemExit(f"no configuration is named {plan_name}")


def capture_graph(fn, calls: int = GRAPH_CALLS) -> torch.cuda.CUDAGraph:
    """``fn`` called 3 times on a side stream (warm-up, allocations), then ``calls`` calls captured in one CUDA
    graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def graph_us(fn, bench: CudaBenchmarker) -> float:
    """Per-call GPU time: GRAPH_CALLS calls captured in one CUDA graph, the replay timed with CUDA events."""
    return bench.timing(capture_graph(fn).replay).median_us / GRAPH_CALLS


def interleaved_graph_us(calls: dict, bench: CudaBenchmarker, rounds: int) -> dict[str, float]:
    """``graph_us`` of each of ``calls`` (name -> callable), median over ``rounds`` rounds in alternating order,
    without grad; each is called once first (cuDNN's benchmark-mode pick before any capture)."""
    samples: dict[str, list[float]] = {k: [] for k in calls}
    with torch.no_grad():
        for fn in calls.values():
            fn()
        for i in range(rounds):
            for who in (list(calls) if i % 2 == 0 else list(reversed(calls))):
                samples[who].append(graph_us(calls[who], bench))
    return {k: statistics.median(v) for k, v in samples.items()}


def issue_us(fn) -> float:
    """Host microseconds per call while the GPU is busy (nothing waits for a kernel)."""
    out = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(SLEEP_CYCLES))
        t0 = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        out.append((time.perf_counter() - t0) / HOST_CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", nargs="+", required=True, help="<family name>@<layer>:<N>")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", help="file name tag: host_floor_<tag> (default: the GPU's, h200 or h100)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_floor: no CUDA GPU here")
        return 2
    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = runtime.get().device(0)
    bench = CudaBenchmarker()
    checker = CudaChecker(dev.compiler.ext)
    rows = []
    for spec in args.plans:
        plan_name, layer, n = spec.replace(":", "@").split("@")
        fam, cfg, p = parse_plan(spec)
        built = dev.compiler.compile(fam, [cfg])[0]
        ws = Workspace(p, torch.device("cuda", 0))
        bad = checker.check(ws, built.handle)
        assert bad is None, (plan_name, bad)
        row = {"layer": layer, "n": int(n), "plan": plan_name, "format": f"{p.dtype} {p.layout}"}
        with torch.no_grad():
            for who, h in (("cudnn", ATEN), ("ours", built.handle)):
                fn = bench._call(ws, h)
                with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=False):
                    fn()
                    row[f"{who}_eager_us"] = bench.timing(fn).median_us
                    row[f"{who}_graph_us"] = graph_us(fn, bench)
                    row[f"{who}_issue_us"] = issue_us(fn)
        row["empty_issue_us"] = issue_us(lambda: torch.empty(ws.out.shape, device="cuda"))
        dev.compiler.unload(built.handle)
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "graph_calls": GRAPH_CALLS, "host_calls": HOST_CALLS}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"host_floor_{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Per-call time at small batch: GPU (graph replay) vs eager vs host issue ({meta['gpu']})", "",
             f"{meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; each layer in its "
             "plan's dtype and memory format (format; cuDNN in the same), TF32 off, cuDNN benchmark mode. eager = the "
             "layer benchmark's per-call CUDA-event median; graph = per call of "
             f"{GRAPH_CALLS} calls captured in one CUDA graph (the GPU's time); issue = host us per call while "
             "the GPU is busy. ours = conv2d_inference (TunedConv2d's inference path).", "",
             "| layer | N | format | plan | cuDNN eager | cuDNN graph | cuDNN issue | ours eager | ours graph "
             "| ours issue | torch.empty issue |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['n']} | {r['format']} | `{r['plan']}` | {r['cudnn_eager_us']:.1f} "
                     f"| {r['cudnn_graph_us']:.1f} | {r['cudnn_issue_us']:.1f} | {r['ours_eager_us']:.1f} "
                     f"| {r['ours_graph_us']:.1f} | {r['ours_issue_us']:.1f} | {r['empty_issue_us']:.1f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

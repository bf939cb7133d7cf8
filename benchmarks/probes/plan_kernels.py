"""Where an NCHW 16-bit plan's GPU time goes (needs a GPU): each kernel of one call of an ``implicit_gemm_tma_h16``
configuration on an NCHW problem and on its channels_last twin (the same configuration, NHWC = 1), beside the
copies that bound what the NCHW plan adds.

An NCHW plan runs three kernels per call where its channels_last twin runs one: ATen's copy of the weight to KRSC
(unless frozen), the plan's own copy of the input to channels_last (``nchw_to_nhwc``), then the GEMM, whose epilogue
writes NCHW. This probe times, per layer and batch:

- each plan's whole call in a CUDA graph (GPU us of one replay, median of ``--replays``, rounds interleaved with
  cuDNN's call in the same dtype and format, benchmark mode);
- each kernel of the call from torch.profiler's CUDA activity (mean us per call over ``--profiled`` calls);
- references for the input copy: ATen's ``contiguous(channels_last)`` and a plain ``clone`` of the same bytes (the
  copy bandwidth the transposition could reach), each in a CUDA graph.

    python benchmarks/probes/plan_kernels.py --layers r3x3_256,r1x1_1024 --batch 32 --dtype bfloat16 \\
        --set "WN=128,MI=2,WG=2,STAGES=4,SK=2,SPLIT=1" --out benchmarks/results

The configuration: the family's ``default_for`` of the NCHW problem with ``--set``'s knobs over it (NHWC and DT
follow the problem). Writes ``plan_kernels_<tag>.{json,md}`` under ``--out`` (default tag: GPU, dtype, batches,
e.g. ``h200_bf16_nchw_n32``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_layers import ALEXNET, EXTRA, problem  # noqa: E402
from bench_overhead import command_line, git_commit, interleaved_graph_us  # noqa: E402

from bagf_torch.bench import gpu_tag, graphed, mode_tag  # noqa: E402


def graph_us(fns: dict, replays: int, rounds: int) -> dict[str, float]:
    """GPU us of one replay of each callable's CUDA graph (bench_overhead's ``interleaved_graph_us``: the median over
    ``rounds`` interleaved rounds of the median of ``replays`` replays)."""
    graphs = [graphed(lambda _x, fn=fn: fn(), None)[0] for fn in fns.values()]
    return dict(zip(fns, interleaved_graph_us(graphs, replays, rounds)))


def kernel_us(fn, calls: int) -> dict[str, float]:
    """Mean GPU us per call of each CUDA kernel ``fn`` launches, by kernel name (torch.profiler)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.device_time_total / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def by_short_name(kernels: dict[str, float]) -> dict[str, float]:
    """``kernels`` under their :func:`short` names, the times of kernels that share one added together."""
    out: dict[str, float] = {}
    for name, us in kernels.items():
        out[short(name)] = out.get(short(name), 0.0) + us
    return out


def short(name: str) -> str:
    """A kernel's name without its template arguments' noise (ours) or ATen's namespaces."""
    for ours in ("nchw_to_nhwc", "implicit_gemm_tma_h16_conv2d"):
        if ours in name:
            return ours
    return name.split("(")[0].split("<")[0][-60:]


def configs(layer, n: int, dtype: str, knobs: dict) -> list[tuple]:
    """(problem, configuration, why not: None or the space's or problem rule's reason) for the NCHW problem and its
    channels_last twin: the family's start for the NCHW problem with ``knobs`` over it, NHWC set per format."""
    from bagf_torch.kernels import implicit_gemm_tma_h16 as fam

    start = dict(fam.default_for(problem(layer, n, dtype=dtype, layout="nchw")), **knobs)
    out = []
    for layout in ("nchw", "nhwc"):
        p = problem(layer, n, dtype=dtype, layout=layout)
        config = dict(start, NHWC=int(layout == "nhwc"))
        out.append((p, config, fam.space().invalid_reason(config) or fam.problem_rule(config, p)))
    return out


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def write(out: Path, tag: str, meta: dict, rows: list[dict]) -> list[str]:
    """``plan_kernels_<tag>.{json,md}`` under ``out``; returns the Markdown's lines."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"plan_kernels_{tag}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Where an NCHW plan's time goes: implicit_gemm_tma_h16 NCHW vs its channels_last twin ({meta['gpu']})",
             "", f"{meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; {meta['dtype']}; "
             f"commit `{meta['commit']}`; `{meta['command']}`.", "",
             "Graph columns: GPU us of one replay of each call's CUDA graph (median of rounds interleaved with cuDNN's "
             "call in the same format). Kernel columns: torch.profiler's mean GPU us per call of each kernel the plan "
             "launches (the weight's KRSC copy is ATen's; `nchw_to_nhwc` the plan's input copy). The last two "
             "columns time the same input's ATen copy to channels_last and a plain clone of its bytes in CUDA graphs "
             "(with a graph's launch floor, a few us), and the clone's kernel alone by the profiler, as the plan's "
             "kernels are.", "",
             "| layer | N | format | plan | plan graph us | cuDNN graph us | kernels (us per call) | input MB | "
             "ATen to channels_last graph us | clone graph us | clone kernel us |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layer']} | {r['n']} | {r['layout']} | `{r['plan']}` | {r['error'][:80]} | | | | | | |")
            continue
        g = r["graph_us"]
        ks = "; ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items())
        lines.append(f"| {r['layer']} | {r['n']} | {r['layout']} | `{r['plan']}` | {g['plan']:.1f} | {g['cudnn']:.1f} "
                     f"| {ks} | {r['input_mb']:.1f} | {_us(g.get('aten_to_channels_last'))} | {_us(g.get('clone'))} | "
                     f"{_us(r.get('clone_kernel_us'))} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="r3x3_256,r3x3_128,r1x1_1024")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    ap.add_argument("--set", default="", help="knobs over the family's start point, e.g. WN=128,MI=2,WG=2,SK=2")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profiled", type=int, default=20, help="calls under torch.profiler")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("plan_kernels: no CUDA GPU here; nothing to measure")
        return 2
    if args.tag is None:  # (the GPU, the dtype and the batches: one run per configuration family of batch sizes)
        args.tag = gpu_tag() + mode_tag(args.dtype, False) + "_n" + args.batch.replace(",", "_")
    from bagf_torch.cache import Cache
    from bagf_torch.jit.compiler import KernelCompiler
    from bagf_torch.kernels import implicit_gemm_tma_h16 as fam
    from bagf_torch.tuning.measure import Workspace, output_error

    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda", 0)
    knobs = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in filter(None, args.set.split(","))}
    rows = []
    with tempfile.TemporaryDirectory() as d, torch.no_grad():
        compiler = KernelCompiler(Cache.for_dir(d), 0, workers=4)
        ext = compiler.ext
        for layer in [lay for lay in ALEXNET + EXTRA if lay[0] in args.layers.split(",")]:
            for n in (int(b) for b in args.batch.split(",")):
                for p, config, why in configs(layer, n, args.dtype, knobs):
                    layout = p.layout
                    row = {"layer": layer[0], "n": n, "layout": layout, "plan": fam.name(config), "config": config}
                    rows.append(row)
                    if why:
                        row["error"] = why
                        print(f"{layer[0]} N={n} {layout}: {why}")
                        continue
                    built = compiler.compile(fam, [config])[0]
                    if not hasattr(built, "handle"):
                        row["error"] = built.detail[:500]
                        continue
                    ws = Workspace(p, dev, seed=n)  # (the same data for the NCHW plan and its twin)
                    s, pad, dil = ws.args

                    def plan(ws=ws, s=s, pad=pad, dil=dil, handle=built.handle):
                        return ext.conv2d_inference(ws.x, ws.w, ws.b, s, pad, dil, handle, out=ws.out)

                    def cudnn(ws=ws, p=p):
                        return torch.nn.functional.conv2d(ws.x, ws.w, ws.b, p.stride, p.padding, p.dilation)

                    ws.out.fill_(float("nan"))
                    plan()
                    torch.cuda.synchronize()
                    row["error_vs_float64"] = output_error(ws.out, ws.ref, ws.ref_norm, ws.ref_max)[0]
                    fns = {"plan": plan, "cudnn": cudnn}
                    if layout == "nchw":
                        fns["aten_to_channels_last"] = lambda ws=ws: ws.x.contiguous(memory_format=torch.channels_last)
                        fns["clone"] = lambda ws=ws: ws.x.clone()
                    row["graph_us"] = graph_us(fns, args.replays, args.rounds)
                    row["kernels_us"] = by_short_name(kernel_us(plan, args.profiled))
                    if layout == "nchw":  # (the clone's kernel alone: like for like with the plan's copy kernel)
                        row["clone_kernel_us"] = sum(kernel_us(fns["clone"], args.profiled).values())
                    row["input_mb"] = ws.x.numel() * ws.x.element_size() / 1e6
                    print(f"{layer[0]} N={n} {layout}: error {row['error_vs_float64']:.2e} {row['graph_us']} "
                          f"{row['kernels_us']}", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "commit": git_commit(), "dtype": args.dtype,
            "command": command_line("probes/plan_kernels.py", sys.argv[1:] if argv is None else argv)}
    print("\n".join(write(Path(args.out), args.tag, meta, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

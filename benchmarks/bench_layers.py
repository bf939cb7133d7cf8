"""AlexNet's five conv layers (224x224 input): cuDNN vs our default configuration vs our tuned configuration.

fp32 with TF32 off (``--tf32``: on, PyTorch's default, where cuDNN runs TF32 products and the tuner may too,
within twice cuDNN's own error), or ``--dtype float16|bfloat16`` in NCHW or ``--channels-last`` (cuDNN in the same
dtype and memory format; the tuner's check allows twice cuDNN's error), cuDNN in benchmark mode. Each layer is
tuned first-call style (the strategy and budget given), then cuDNN, the default configuration and the winner are re-timed interleaved in this same run
(median of rounds of median-of-many CUDA-event timings). Also measures the per-call host overhead of
TunedConv2d and of the bare op against F.conv2d at N=1 (--overhead). "default" is the implicit_gemm
family's hand-picked configuration (the untuned baseline), "TC default" the tensor-core family's; in float16 and
bfloat16 both are implicit_gemm_h16's start point for the layer. Writes JSON
and a Markdown table.

    python benchmarks/bench_layers.py --batch 1,32,128 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder, for bench_overhead's helpers

from bagf_torch.bench import gpu_tag, mode_tag  # noqa: E402
import bagf_torch  # noqa: E402
from bagf_torch import runtime, settings  # noqa: E402
from bagf_torch.kernels import family_name, implicit_gemm as ig, implicit_gemm_h16 as h16, implicit_gemm_tc as tc  # noqa: E402
from bagf_torch.problem import ConvProblem, cudnn_conv_mode  # noqa: E402
from bagf_torch.report import PRECISIONS, layer_analysis, measure_ceilings, precision_of  # noqa: E402
from bagf_torch.tuning.backend import cuda_backend  # noqa: E402
from bagf_torch.tuning import strategies  # noqa: E402
from bagf_torch.tuning.common import Budget  # noqa: E402
from bagf_torch.kernels import FAMILIES, complete_config  # noqa: E402
from bagf_torch.ops import ATEN  # noqa: E402
from bagf_torch.tuning.measure import CudaBenchmarker, Workspace, output_error  # noqa: E402
from bagf_torch.tuning.replay import load_recording, newest_complete  # noqa: E402
from bagf_torch.tuning.warmstart import neighbour_seeds  # noqa: E402
from bench_overhead import command_line, git_commit  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"

# torchvision's AlexNet features: (name, C, H=W, K, kernel, stride, padding)
ALEXNET = [
    ("conv1", 3, 224, 64, 11, 4, 2),
    ("conv2", 64, 27, 192, 5, 1, 2),
    ("conv3", 192, 13, 384, 3, 1, 1),
    ("conv4", 384, 13, 256, 3, 1, 1),
    ("conv5", 256, 13, 256, 3, 1, 1),
]
# non-AlexNet layers (ResNet-style) to show the tuning generalises
EXTRA = [
    ("r3x3_256", 256, 56, 256, 3, 1, 1),
    ("r3x3_128", 128, 28, 128, 3, 1, 1),
    ("r1x1_1024", 1024, 14, 256, 1, 1, 0),
    # the stride-2 convs and downsamples of torchvision's ResNet-18; two of ResNet-50's 1x1 convs
    ("r3x3s2_64", 64, 56, 128, 3, 2, 1),
    ("r3x3s2_128", 128, 28, 256, 3, 2, 1),
    ("r3x3s2_256", 256, 14, 512, 3, 2, 1),
    ("r1x1s2_64", 64, 56, 128, 1, 2, 0),
    ("r1x1s2_128", 128, 28, 256, 1, 2, 0),
    ("r1x1s2_256", 256, 14, 512, 1, 2, 0),
    ("r1x1_1024to512", 1024, 14, 512, 1, 1, 0),
    ("r1x1_256to1024", 256, 14, 1024, 1, 1, 0),
    # ResNet-18's first conv and its other 3x3 stride-1 convs (64 channels on 56x56 maps, 256 on 14x14, 512 on 7x7)
    ("r7x7s2_3", 3, 224, 64, 7, 2, 3),
    ("r3x3_64_56", 64, 56, 64, 3, 1, 1),
    ("r3x3_256_14", 256, 14, 256, 3, 1, 1),
    ("r3x3_512_7", 512, 7, 512, 3, 1, 1),
]


def problem(layer, n: int, tf32: bool = False, dtype: str = "float32", layout: str = "nchw") -> ConvProblem:
    _, c, hw, k, ks, st, pd = layer
    return ConvProblem(n=n, c=c, h=hw, w=hw, k=k, r=ks, s=ks, stride=(st, st), padding=(pd, pd),
                       tf32=tf32 and dtype == "float32", dtype=dtype, layout=layout)


def recorded_optima(paths) -> dict:
    """{ConvProblem: (family, config, recorded median us)}: the best configuration of every COMPLETE recorded
    (problem, family), fastest family first; partial recordings say nothing about the optimum. A (problem, family)
    recorded in several files counts from its newest complete recording (``newest_complete``), as in the replays:
    an older recording's optimum (e.g. one noisy sample under an older timing rule) does not outlive it."""
    recordings = {Path(p): load_recording(p) for p in paths if "synthetic" not in str(p).lower()}
    newest = newest_complete(list(recordings), recordings)
    best: dict = {}
    for path, rec in recordings.items():
        for rp in rec.problems:
            if newest.get(rp.key) != path:
                continue  # (partial, or superseded by a newer complete recording)
            if rp.family not in FAMILIES or not any(r["status"] == "ok" for r in rp.rows):
                continue
            config, outcome = rp.evaluator().best()
            prob = ConvProblem.from_dict(rp.conv)
            cand = (rp.family, complete_config(rp.family, config), outcome.time_us)
            if prob not in best or cand[2] < best[prob][2]:
                best[prob] = cand
    return best


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def graph_times(ws, handle: int, bench: CudaBenchmarker, rounds: int) -> dict[str, float]:
    """GPU microseconds per call in a CUDA graph of cuDNN's conv (in the process's cuDNN mode) and of the tuned plan
    (``handle``; cuDNN's own time when it is ATEN), median over interleaved rounds."""
    from host_floor import interleaved_graph_us

    calls = {"cudnn": bench._call(ws, ATEN)}
    if handle != ATEN:
        calls["tuned"] = bench._call(ws, handle)
    us = interleaved_graph_us(calls, bench, rounds)
    us.setdefault("tuned", us["cudnn"])
    return us


def host_overhead(handle: int, n_calls: int = 3000) -> dict:
    """Host cost per call at N=1: wall microseconds per call in a tight loop on a layer so small (16->16
    channels, 3x3, 8x8 pixels) that the GPU finishes each launch before the CPU issues the next, so the loop
    is host-bound, unless the kernel itself is slower than the host; and the host's issue cost alone ("(host
    issue)": the same calls made while the GPU is kept busy by a sleep kernel, so that none waits). F.conv2d vs
    TunedConv2d.forward vs the bare op vs the op's kernel without the dispatcher (``conv2d_inference``, what
    TunedConv2d calls when no gradient is needed), ours running the tensor-core family's default kernel
    (``handle``, already loaded)."""
    conv = torch.nn.Conv2d(16, 16, 3, padding=1).cuda()
    tuned = bagf_torch.TunedConv2d.from_conv(conv)
    x = torch.randn(1, 16, 8, 8, device="cuda")
    tuned._remember(x, tuned._kernel_entry(handle, (1, 1)))
    with torch.no_grad():
        op = torch.ops.bagf.conv2d.default
        torch.testing.assert_close(tuned(x), conv(x), rtol=1e-4, atol=1e-4)
        calls = {
            "F.conv2d": lambda: F.conv2d(x, conv.weight, conv.bias, 1, 1),
            "TunedConv2d": lambda: tuned(x),
            "bagf::conv2d op": lambda: op(x, conv.weight, conv.bias, [1, 1], [1, 1], [1, 1], handle),
        }
        from bagf_torch.jit import extension

        ext = extension.loaded()
        if hasattr(ext, "conv2d_inference"):  # the op's kernel without the dispatcher (TunedConv2d's inference path)
            calls["conv2d_inference"] = lambda: ext.conv2d_inference(x, conv.weight, conv.bias, [1, 1], [1, 1], [1, 1],
                                                                     handle)
        out = {"plan": tc.name(tc.DEFAULT)}
        for name, fn in calls.items():
            samples, issue = [], []
            for _ in range(5):
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n_calls):
                    fn()
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - t0) / n_calls * 1e6)
                # host cost alone: the same calls issued while the GPU sleeps, so none waits for a kernel
                # (the wall loop above is GPU-bound when the kernel is slower than the host)
                torch.cuda._sleep(int(HOST_SLEEP_CYCLES))
                t0 = time.perf_counter()
                for _ in range(HOST_CALLS):
                    fn()
                issue.append((time.perf_counter() - t0) / HOST_CALLS * 1e6)
                torch.cuda.synchronize()
            out[name] = statistics.median(samples)
            out[f"{name} (host issue)"] = statistics.median(issue)
    return out


HOST_CALLS = 200  # well inside the launch queue (a call enqueues at most a memset and a kernel)
HOST_SLEEP_CYCLES = 2e8  # ~100 ms at the H200's clock: longer than 200 host calls take


def markdown(doc: dict) -> list[str]:
    """The Markdown report of a run's JSON (``{"meta", "summary", "rows"}``, as ``main`` writes it); also what
    ``--from-json`` prints (on the CPU). Rows of a run before the roofline followed the layers' precision (16-bit
    rows without an analysis, ceilings as ``fp32_tflops``) render too."""
    meta, summary, rows = dict(doc["meta"]), doc["summary"], doc["rows"]
    for key, value in (("dtype", "float32"), ("channels_last", False), ("tf32", False), ("commit", "?"),
                       ("command", "?"), ("env", {})):
        meta.setdefault(key, value)  # (older runs did not record them: fp32 NCHW, TF32 off)
    fp32 = meta["dtype"] == "float32"
    overhead = summary.get("host_overhead_us_n1")
    with_opt = [r for r in rows if r.get("fraction_of_optimum") is not None]
    ceil = meta["ceilings"]
    peak, precision = ceil.get("peak_tflops", ceil.get("fp32_tflops")), ceil.get("precision", "fp32")
    mode = (f"fp32, TF32 {'on' if meta['tf32'] else 'off'}" if fp32 else
            f"{meta['dtype']}, {'channels_last' if meta['channels_last'] else 'NCHW'}")
    lines = [f"# AlexNet conv layers: cuDNN vs default vs tuned ({meta['gpu']})", "",
             f"{meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, "
             f"NVRTC {meta['env'].get('nvrtc', '?')}, driver {meta['env'].get('driver', '?')}; {mode}, "
             "cudnn.benchmark=True; "
             f"strategy {meta['strategy']}, budget {meta['budget']} evaluations / {meta['seconds']:.0f} s per layer"
             + (f" (its imports loaded before the first layer, {meta['strategy_import_seconds']:.1f} s, as `tune` "
                "loads them up front)" if meta.get("strategy_import_seconds") is not None else "")
             + (f"; the layers' {meta['prefetched_starts']} start points compiled in one wave before the first layer "
                f"({meta['prefetch_seconds']:.1f} s), as `tune` does" if meta.get("prefetched_starts") else "") + ". "
             "Times are medians (us) of interleaved re-timing in one run.", "",
             f"Commit `{meta['commit']}`; command: `{meta['command']}`.", "",
             "Graph columns: GPU time per call in a CUDA graph (cuDNN and the tuned plan, interleaved rounds, "
             "median); the other columns are eager calls."
             + (" The tuned plans are timed as layers with frozen weights run them (`freeze_weights`: a KRSC copy of "
                "the weight for plans that read it so, no conversion per call); the tuning that chose them, and the "
                "evaluations, best-candidate and family-default times in the JSON, timed them unfrozen."
                if meta.get("frozen_weights") else ""),
             "",
             "| layer | N | cuDNN graph us | tuned graph us | vs cuDNN (graph) | cuDNN us | default us | TC default us "
             "| tuned us | vs cuDNN | vs default | TFLOP/s | plan | evals | tune s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['n']} | {r['cudnn_graph_us']:.1f} | {r['tuned_graph_us']:.1f} | "
                     f"{r['speedup_vs_cudnn_graph']:.2f}x | {r['cudnn_us']:.1f} | {r['default_us']:.1f} | "
                     f"{_us(r['tc_default_us'])} | {r['tuned_us']:.1f} | "
                     f"{r['speedup_vs_cudnn']:.2f}x | {r['speedup_vs_default']:.2f}x | {r['tuned_tflops']:.1f} | "
                     f"`{r['plan']}` | {r['evaluations']} | {r['tune_seconds']:.1f} |")
    lines += ["", f"Geomean speedup vs cuDNN in CUDA graphs: {summary['geomean_speedup_vs_cudnn_graph']:.2f}x "
              f"(lowest {summary['min_speedup_vs_cudnn_graph']:.2f}x); eager: "
              f"{summary['geomean_speedup_vs_cudnn']:.2f}x; "
              f"vs our default configuration: {summary['geomean_speedup_vs_default']:.2f}x."]
    lines += ["", "Error against float64 on fresh data (error norm / reference norm, and largest error / largest "
              "reference magnitude), the plan's beside cuDNN's in the same mode, and the bound the tuner's check "
              "sets on this data" + (" (in TF32 mode: twice cuDNN's error, never below fp32's 1e-4 / 1e-3; "
              "the tuning set its own on its own data)" if meta['tf32'] else " (fp32: 1e-4 / 1e-3)" if fp32 else
              " (twice cuDNN's error in the same dtype and format, never below fp32's 1e-4 / 1e-3; the tuning set "
              "its own on its own data)") + ".", "",
              "| layer | N | plan | plan error | cuDNN error | plan / cuDNN | check bound |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["error"]
        over = " **over**" if e.get("over_bound") else ""  # (older files carry no over_bound)
        lines.append(f"| {r['layer']} | {r['n']} | `{r['plan']}` | {e['plan'][0]:.2e} (max {e['plan'][1]:.2e}) | "
                     f"{e['cudnn'][0]:.2e} (max {e['cudnn'][1]:.2e}) | {e['plan'][0] / max(e['cudnn'][0], 1e-30):.2f} | "
                     f"{e['check_bound'][0]:.1e} / {e['check_bound'][1]:.1e}{over} |")
    lines += ["", f"Roofline and I/O bound (ceilings measured in this run: "
              f"{peak:.1f} TFLOP/s from a torch.mm in {PRECISIONS[precision]}, the precision these layers "
              f"compute in, copy {ceil['copy_gbs']:.0f} GB/s). FLOP/s are direct-convolution FLOPs over time, so "
              "cuDNN's Winograd/FFT and ours can exceed the roof. Traffic (fp32 layers only: the models count 4-byte "
              "words) is the iobound model of our best "
              "configuration (the winner, or our fastest candidate when cuDNN won) over the direct-convolution "
              "lower bound with that configuration's fast memory; for a Winograd configuration also over the "
              "Winograd bound of its F(m x m, 3 x 3) (iobound.winograd_lower_bound: fused=True for the fused "
              "families, fused=False for winograd_gemm, which stores its transformed operands; at stride s "
              "> 1 the bound of its polyphase form over C s^2 channels).", "",
              "| layer | N | roofline TFLOP/s | cuDNN % of roof | ours % of roof | our config | traffic / bound "
              "| traffic / Winograd bound |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("analysis_cudnn") is None:  # (a 16-bit row of a run before the roof followed the layers' precision)
            continue
        a, o = r["analysis_cudnn"], r.get("analysis_ours") or {}
        lines.append(f"| {r['layer']} | {r['n']} | {a['roofline_tflops']:.1f} | {100 * a['fraction_of_roofline']:.0f}% | "
                     + (f"{100 * o['fraction_of_roofline']:.0f}% | `{o['config_name']}` | "
                        + (f"{o['traffic_over_bound']:.2f} | " if "traffic_over_bound" in o else "- | ")
                        + (f"{o['traffic_over_winograd_bound']:.2f} |" if "traffic_over_winograd_bound" in o
                           else "- |") if o else "- | - | - | - |"))
    if with_opt:
        lines += ["", "First-call tuning against the recorded optimum: the best configuration of the "
                  "complete recording (benchmarks/data) is re-timed in the same interleaved rounds; fraction = "
                  "min(optimum kernel, cuDNN) / tuned (the tuner may keep cuDNN). Tune s is the whole first "
                  "call: setup (float64 reference, cuDNN's baseline), compile, check, measure, strategy, finalists (the "
                  "re-timing).", "",
                  "| layer | N | tuned us | recorded optimum | optimum us (this run) | fraction | tune s | seeds | phases s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in with_opt:
            ph = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
            lines.append(f"| {r['layer']} | {r['n']} | {r['tuned_us']:.1f} | `{r['recorded_optimum']}` | "
                         f"{r['recorded_optimum_us']:.1f} | {r['fraction_of_optimum']:.3f} | {r['tune_seconds']:.1f} | "
                         f"{r['seeds']} | {ph} |")
    if overhead:
        lines += ["", "Host overhead per call at N=1 (16->16 3x3 on 8x8: wall us per call in a tight loop, and "
                  "'(host issue)': us per call issued while a sleep kernel keeps the GPU busy, the host's cost "
                  f"alone; ours run `{overhead['plan']}`): " + ", ".join(
                      f"{k} {v:.1f}" for k, v in overhead.items() if k != "plan")]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,32,128", help="comma-separated batch sizes")
    ap.add_argument("--layers", default="conv1,conv2,conv3,conv4,conv5",
                    help="comma-separated; also " + ",".join(e[0] for e in EXTRA))
    ap.add_argument("--overhead", action="store_true", help="measure the host overhead per call at the end")
    ap.add_argument("--budget", type=int, default=settings.DEFAULT_BUDGET,
                    help="evaluations per layer (default: the library's, BAGF_BUDGET's default)")
    ap.add_argument("--seconds", type=float, default=settings.DEFAULT_TIME_BUDGET,
                    help="tuning seconds per layer (default: the library's, BAGF_TIME_BUDGET's default)")
    ap.add_argument("--strategy", default="ax")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved re-timing rounds for the final table")
    ap.add_argument("--out", default="benchmarks/results", help="directory for JSON and Markdown")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--cold", action="store_true",
                    help="no warm start: by default each layer gets the neighbour seeds the runtime would take from "
                         "a cache holding the winners of the layers tuned before it in this run")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="compile no start points up front: by default every layer's start points are compiled in "
                         "one parallel wave before the first layer is tuned, as `tune` does for a model")
    ap.add_argument("--data", nargs="*", help="recordings whose optima are re-timed as the reference "
                                              "(default: benchmarks/data/*.json.gz)")
    ap.add_argument("--tf32", action="store_true",
                    help="TF32 mode (torch.backends.cudnn.allow_tf32 = True, PyTorch's default): cuDNN and the tuner "
                         "in that mode; the table adds each plan's error against float64 beside cuDNN's")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="the layers' dtype (cuDNN in the same dtype; --tf32 only for float32)")
    ap.add_argument("--channels-last", action="store_true", help="channels_last (NHWC) inputs, weights and outputs")
    ap.add_argument("--frozen", action="store_true",
                    help="time the final table as layers with frozen weights run (bagf_torch.freeze_weights: a plan "
                         "that reads the weight KRSC gets a kept KRSC copy); the tuning itself is unchanged")
    ap.add_argument("--from-json", default=None, help="rewrite the Markdown of a run's JSON beside it (CPU) and exit")
    ap.add_argument("--watchdog", type=float, default=120.0,
                    help="dump every thread's stack to stderr each this many seconds (0: off)")
    args = ap.parse_args(argv)
    if args.tag is None:  # (the GPU this runs on, and the mode: dtype, format, TF32)
        args.tag = gpu_tag() + mode_tag(args.dtype, args.channels_last, args.tf32)
    if args.from_json:
        src = Path(args.from_json)
        src.with_suffix(".md").write_text("\n".join(markdown(json.loads(src.read_text()))) + "\n")
        return 0
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    if not torch.cuda.is_available():
        print("bench_layers: no CUDA GPU here; nothing to measure (the model would run through ATen).")
        return 2
    batches = [int(b) for b in args.batch.split(",")]
    layers = [lay for lay in ALEXNET + EXTRA if lay[0] in args.layers.split(",")]
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = False

    rt = runtime.get()
    dev = rt.device(0)
    device = torch.device("cuda", 0)
    bench = CudaBenchmarker()
    layout = "nhwc" if args.channels_last else "nchw"
    fp32 = args.dtype == "float32"
    if fp32 and args.channels_last:
        print("bench_layers: float32 channels_last is not measured here yet (the default columns are NCHW kernels).")
        return 2
    default_handle = dev.compiler.compile(ig, [ig.DEFAULT])[0].handle if fp32 else None
    tc_default_handle = dev.compiler.compile(tc, [tc.DEFAULT])[0].handle if fp32 or args.overhead else None
    # the peak of the precision the layers compute in (cuBLAS in that dtype and TF32 mode) and copy bandwidth, this
    # run, this GPU
    ceilings = measure_ceilings(0, precision=precision_of(args.dtype, args.tf32))
    print(f"ceilings: {ceilings.precision} {ceilings.flops / 1e12:.1f} TFLOP/s, copy {ceilings.bandwidth / 1e9:.0f} GB/s",
          flush=True)
    optima = recorded_optima(args.data if args.data is not None else sorted(DATA.glob("*.json.gz")))
    stored = []  # cache-like rows of this run's winners, for the warm start
    rows = []

    def write(overhead):
        gm = lambda xs: float(torch.tensor(xs).log().mean().exp())  # noqa: E731
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(0), "env": dev.env, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
            "strategy": args.strategy, "budget": args.budget, "seconds": args.seconds, "seed": args.seed,
            "strategy_import_seconds": strategy_import_seconds, "warm_start": not args.cold,
            "prefetched_starts": prefetched, "prefetch_seconds": prefetch_seconds,
            "tf32": args.tf32, "cudnn_benchmark": True, "dtype": args.dtype, "channels_last": args.channels_last,
            "frozen_weights": args.frozen,
            "commit": git_commit(), "command": command_line("bench_layers.py", sys.argv[1:] if argv is None else argv),
            "ceilings": {"precision": ceilings.precision, "peak_tflops": ceilings.flops / 1e12,
                         "copy_gbs": ceilings.bandwidth / 1e9, "how": ceilings.how},
        }
        with_opt = [r for r in rows if r.get("fraction_of_optimum") is not None]
        summary = {
            "geomean_speedup_vs_cudnn": gm([r["speedup_vs_cudnn"] for r in rows]),
            "geomean_speedup_vs_cudnn_graph": gm([r["speedup_vs_cudnn_graph"] for r in rows]),
            "min_speedup_vs_cudnn_graph": min((r["speedup_vs_cudnn_graph"] for r in rows), default=None),
            "layers_with_recorded_optimum": len(with_opt),
            "min_fraction_of_optimum": min((r["fraction_of_optimum"] for r in with_opt), default=None),
            "max_tune_seconds": max((r["tune_seconds"] for r in rows), default=None),
            "geomean_speedup_vs_default": gm([r["speedup_vs_default"] for r in rows]),
            "host_overhead_us_n1": overhead,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"bench_layers_{args.tag}"
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
        lines = markdown({"meta": meta, "summary": summary, "rows": rows})
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        return lines

    # The strategy's imports (Ax: seconds on this host) before the first layer, as `tune` and tune_model load them up
    # front beside their first compiles: otherwise the first layer alone spends most of its seconds on them.
    t0 = time.perf_counter()
    wait = strategies.preload(args.strategy)
    strategy_import_seconds = None  # (nothing to load: a strategy without imports, or Ax imported already)
    if wait is not None:
        wait()
        strategy_import_seconds = time.perf_counter() - t0
    # Every layer's start points compiled in one parallel wave before the first layer, as `tune` does for a model
    # (Runtime.prefetch_starts, a compile-only tuner): otherwise the first layers' budgets go to compiling the start
    # points all share.
    prefetched = prefetch_seconds = None
    if not args.no_prefetch:
        t0 = time.perf_counter()
        prefetched = rt.prefetch_starts([problem(layer, n, args.tf32, args.dtype, layout) for n in batches
                                         for layer in layers], dev.index,
                                        tuner_options={"budget": Budget(args.budget, args.seconds),
                                                       "strategy": args.strategy})
        prefetch_seconds = time.perf_counter() - t0

    for n in batches:
        for layer in layers:
            p = problem(layer, n, args.tf32, args.dtype, layout)
            # In this process whatever BAGF_ISOLATE says: the winner's handle is timed and unloaded here below.
            tuner = rt.tuner(dev, budget=Budget(args.budget, args.seconds), strategy=args.strategy, seed=args.seed,
                             listeners=[lambda e: print(f"  [{time.perf_counter() - t0:6.1f} s] {e.line()}", flush=True)],
                             backend=cuda_backend(dev.index, dev.compiler))
            seeds = [] if args.cold else neighbour_seeds(p, stored, dev.env)
            t0 = time.perf_counter()  # (read by the listener above, which runs only inside tune)
            result = tuner.tune(p, seeds=seeds)
            wall = time.perf_counter() - t0
            stored.append({"problem": p.as_dict(), "env": dev.env, "family": result.family, "config": result.config})
            ws = Workspace(p, device, frozen=args.frozen)  # fresh data for the final comparison
            start_handle = None
            if not fp32:  # the 16-bit family's start point for this layer is the untuned reference
                start_handle = dev.compiler.compile(h16, [h16.default_for(p, torch.cuda.get_device_properties(0)
                                                                          .multi_processor_count)])[0].handle
            handles = ([ATEN, default_handle, tc_default_handle] if fp32 else [ATEN, start_handle]) + (
                [result.handle] if result.handle != ATEN else [])
            opt = optima.get(p)
            opt_handle = None
            if opt is not None:
                built = dev.compiler.compile(FAMILIES[opt[0]], [opt[1]])[0]
                opt_handle = getattr(built, "handle", None)
                if opt_handle is not None:
                    handles.append(opt_handle)
            with cudnn_conv_mode(enabled=True, benchmark=True, deterministic=False, tf32=p.tf32):  # eager calls
                times = bench.interleaved([bench._call(ws, h) for h in handles], args.rounds)
            if fp32:
                cudnn_us, default_us, tc_default_us = times[0], times[1], times[2]
            else:
                cudnn_us, default_us, tc_default_us = times[0], times[1], None
                dev.compiler.unload(start_handle)
            tuned_us = times[3 if fp32 else 2] if result.handle != ATEN else cudnn_us
            graph = graph_times(ws, result.handle, bench, args.rounds)
            row = {
                "layer": layer[0], "n": n, "problem": p.as_dict(), "gflop": p.flops / 1e9,
                "cudnn_us": cudnn_us, "default_us": default_us, "tc_default_us": tc_default_us, "tuned_us": tuned_us,
                "plan": family_name(result.family, result.config),
                "tuned_kernel_us": result.time_us if result.config is not None else None,
                "speedup_vs_cudnn": cudnn_us / tuned_us, "speedup_vs_default": default_us / tuned_us,
                "cudnn_graph_us": graph["cudnn"], "tuned_graph_us": graph["tuned"],
                "speedup_vs_cudnn_graph": graph["cudnn"] / graph["tuned"],
                "tuned_tflops": p.flops / tuned_us / 1e6, "cudnn_tflops": p.flops / cudnn_us / 1e6,
                "evaluations": result.evaluations, "tune_seconds": wall, "seeds": len(seeds),
                "phases": {k: round(v, 3) for k, v in result.phases.items()},
                "failures": sorted({t.outcome.status for t in result.trials if not t.outcome.ok}),
            }
            if opt_handle is not None:
                opt_us = times[-1]
                row["recorded_optimum"] = family_name(opt[0], opt[1])
                row["recorded_optimum_us"] = opt_us
                row["recorded_optimum_us_in_recording"] = opt[2]
                row["fraction_of_optimum"] = min(opt_us, cudnn_us) / tuned_us
                dev.compiler.unload(opt_handle)
            # error against float64 on the comparison's fresh data: the plan's and cuDNN's in this mode (a TF32-mode
            # workspace measured cuDNN's already, for its check's bound)
            cudnn_err = ws.cudnn_error
            if cudnn_err is None:
                with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False,
                                                allow_tf32=args.tf32):
                    cudnn_err = output_error(ws.aten_call()(), ws.ref, ws.ref_norm, ws.ref_max)
            plan_err = (cudnn_err if result.handle == ATEN
                        else output_error(ws.op_call(result.handle)(), ws.ref, ws.ref_norm, ws.ref_max))
            row["error"] = {"cudnn": cudnn_err, "plan": plan_err, "check_bound": [ws.rel_tol, ws.max_tol],
                            # on this run's fresh data (the tuning passed its own): a plan over it, or with a
                            # non-finite error, is reported
                            "over_bound": not (plan_err[0] <= ws.rel_tol and plan_err[1] <= ws.max_tol)}
            if row["error"]["over_bound"]:
                print(f"WARNING {layer} N={n}: the plan's error {plan_err[0]:.2e} (max {plan_err[1]:.2e}) is over the "
                      f"check's bound {ws.rel_tol:.1e} / {ws.max_tol:.1e} on this run's data", flush=True)
            row["family_defaults_us"] = result.defaults
            row["families_left_out"] = result.left_out  # (out of reach of the check here: Tuner._within_reach)
            row["analysis_cudnn"] = layer_analysis(p, cudnn_us, ceilings)
            ours = [t for t in result.trials if t.config is not None and t.outcome.ok]
            if ours:  # our fastest kernel even when cuDNN won (first measurement, not re-timed)
                fastest = min(ours, key=lambda t: t.outcome.time_us)
                row["best_candidate"] = family_name(fastest.family, fastest.config)
                row["best_candidate_us"] = fastest.outcome.time_us
                fam, cfg, us = ((result.family, result.config, tuned_us) if result.config is not None
                                else (fastest.family, fastest.config, fastest.outcome.time_us))
                # (the traffic models count fp32 words: 16-bit layers get the roofline only)
                row["analysis_ours"] = dict(layer_analysis(p, us, ceilings, *((fam, cfg) if fp32 else (None, None))),
                                            config_name=family_name(fam, cfg))
            rows.append(row)
            print(f"{layer[0]} N={n:<4} cuDNN {cudnn_us:9.1f} us  default {default_us:9.1f}  tuned {tuned_us:9.1f}"
                  f"  x{row['speedup_vs_cudnn']:.2f} vs cuDNN (graph x{row['speedup_vs_cudnn_graph']:.2f})  x{row['speedup_vs_default']:.2f} vs default"
                  f"  {row['plan']}  {result.evaluations} evals {wall:.1f} s {row['phases']}"
                  + (f"  {row['fraction_of_optimum']:.3f} of the recorded optimum" if "fraction_of_optimum" in row else ""),
                  flush=True)
            if result.handle != ATEN:
                dev.compiler.unload(result.handle)
            write(None)  # results so far survive a run cut short

    overhead = host_overhead(tc_default_handle) if args.overhead else None
    print("\n".join(write(overhead)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

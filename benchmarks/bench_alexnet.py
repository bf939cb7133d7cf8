"""AlexNet inference end to end: stock PyTorch against bagf_torch, fp32, TF32 off (``--tf32``: on, as by default), or
``--dtype float16|bfloat16`` with ``--channels-last`` or not (both models and the input in that dtype and format).

Variants per batch size (see bagf_torch/bench.py for how each is timed): stock eager, stock eager with
cudnn.benchmark, bagf eager, bagf served (a fresh process loading the plans with BAGF_TUNE=0), stock, bagf and served
bagf in a CUDA graph, and torch.compile(mode="max-autotune") of the stock model as the peer a user would try instead
(its compile time is reported; DESIGN measured 66 s at N=1 and 406 s at N=128, so --no-compile skips it). The bagf
model is pre-tuned first (tune_model; problems in the cache are not tuned again, so run `python -m bagf_torch tune
--model alexnet --batch 1,32,128` before to keep tuning out of this run; with ``--dtype``, ``tune --dtype ...
[--channels-last]``). The benchmark-off stock variants and the served bagf ones (BAGF_TUNE=0, plans from the cache: a
serving process) are timed in fresh child processes. Writes JSON and a Markdown table with the GPU, versions and
date.

    python benchmarks/bench_alexnet.py --batch 1,32,128 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path


import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder, for bench_overhead's helpers
import bagf_torch  # noqa: E402
from bench_overhead import command_line, git_commit  # noqa: E402
from bagf_torch import bench, cli, runtime  # noqa: E402
from bagf_torch.jit.compiler import STATS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=cli.parse_batches, default=[1, 32, 128], help="comma-separated batch sizes")
    ap.add_argument("--runs", type=int, default=200, help="timed runs per variant")
    ap.add_argument("--budget", type=int, default=None, help="evaluations per problem for what is not cached yet")
    ap.add_argument("--seconds", type=float, default=None,
                    help="tuning seconds per problem for what is not cached yet (default: BAGF_TIME_BUDGET's)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile(mode='max-autotune')")
    ap.add_argument("--compile-batch", type=cli.parse_batches, default=None,
                    help="batch sizes to run torch.compile(mode='max-autotune') at (default: all)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--tf32", action="store_true",
                    help="cuDNN's TF32 on for both models, PyTorch's default (the plans are tuned in that mode)")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="the models' and the input's dtype (float32 by default)")
    ap.add_argument("--channels-last", action="store_true", help="models and input in channels_last")
    ap.add_argument("--children", type=int, default=bench.CHILDREN, metavar="N",
                    help="fresh processes of each kind, stock and served, alternating; each variant timed in them "
                         f"shows its median process (default {bench.CHILDREN})")
    ap.add_argument("--frozen", action="store_true",
                    help="bagf_torch.freeze_weights on the tuned model: layers keep their plans' weight layouts")
    args = ap.parse_args(argv)
    if args.children < 1:
        ap.error(f"--children must be at least 1, got {args.children}")
    if args.tag is None:  # (the GPU this runs on, and the mode: dtype, format, TF32)
        args.tag = bench.gpu_tag() + bench.mode_tag(args.dtype, args.channels_last, args.tf32)
    why = cli.gpu_problem("bench_alexnet")
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    stock, tuned = bench.stock_and_tuned(lambda: bagf_torch.models.alexnet(tuned=False))
    dtype = getattr(torch, args.dtype)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    stock, tuned = (m.to(dtype).to(memory_format=fmt) for m in (stock, tuned))
    xs = [torch.randn(n, 3, 224, 224, device="cuda").to(dtype).contiguous(memory_format=fmt) for n in args.batch]
    t0 = time.perf_counter()
    report = bagf_torch.tune_model(tuned, xs, budget=args.budget, seconds=args.seconds, progress=None)
    tune_seconds = time.perf_counter() - t0
    print(report, flush=True)
    if args.frozen:
        bagf_torch.freeze_weights(tuned)
    tuned_before, compiles_before = runtime.get().stats["tuned"], STATS.nvrtc_compiles

    results: dict[int, dict] = {}
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
        "bagf_torch": bagf_torch.__version__, "package": str(Path(bagf_torch.__file__).resolve().parent),
        "env": runtime.get().device(0).env, "tf32": args.tf32,
        "dtype": args.dtype, "channels_last": args.channels_last, "frozen_weights": args.frozen,
        "runs": args.runs, "children": args.children, "pretune_seconds": tune_seconds,
        "problems_tuned_in_this_run": report.tuned,
        "commit": git_commit(), "command": command_line("bench_alexnet.py", sys.argv[1:] if argv is None else argv),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_alexnet_{args.tag}"

    mode = (f"fp32, TF32 {'on' if args.tf32 else 'off'}" if args.dtype == "float32" else args.dtype) + (
        ", channels_last" if args.channels_last else "") + (", bagf's weights frozen (freeze_weights)" if args.frozen
                                                             else "")

    def write():
        meta["tuned_during_timing"] = runtime.get().stats["tuned"] - tuned_before
        meta["nvrtc_compiles_during_timing"] = STATS.nvrtc_compiles - compiles_before
        doc = {"meta": meta, "plans": report.as_dict(),
               "results": {str(n): r for n, r in results.items()},
               "speedups": {str(n): bench.speedups(r) for n, r in results.items()}}
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
        lines = [f"# AlexNet inference: stock PyTorch vs bagf_torch ({meta['gpu']})", "",
                 f"{meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, Python "
                 f"{meta['python']}, bagf_torch {meta['bagf_torch']} (`{meta['package']}`); {mode}. Median GPU "
                 f"time (us) of one forward from an idle stream over {args.runs} runs. `stock` and `stock_graph` "
                 "are PyTorch's defaults (cudnn.benchmark off) timed in fresh child processes; `bagf_served` and "
                 "`bagf_served_graph` are the tuned model as a serving process runs it: fresh children with "
                 "BAGF_TUNE=0 and PyTorch's default flags, plans from the cache"
                 + (" (its weights frozen too)" if args.frozen else "") + "; every other variant runs in "
                 "benchmark mode in this process, `stock_benchmark` first (torch keeps the first cuDNN algorithm "
                 "it picks per shape, see bagf_torch/bench.py), and this process's variants are timed interleaved: "
                 f"{bench.ROUNDS} turns round them, {args.runs} runs each in all. The children time their own "
                 f"variants, interleaved the same way: {args.children} of each kind"
                 + (", stock and served alternating (the order reversed every other turn), and each of their "
                    "variants shows its median process (a host-bound forward's time spreads widely from process to "
                    "process; every process's median is listed below the table)" if args.children > 1 else "")
                 + ". Each served child also times a stock copy of the model beside the served one (PyTorch's "
                 "defaults, interleaved in that process): `served vs stock, same process` is the median over the "
                 "served children of that copy's time over the served model's, a ratio the process's host speed "
                 "cancels from. `bagf` runs its ATen-planned layers in benchmark "
                 "mode, so compare it with `stock_benchmark` too. Speedups: first over `stock_benchmark` (cuDNN in "
                 "benchmark mode in this process: the like-for-like comparison), then over PyTorch's defaults "
                 "(`stock`, benchmark off: what a user who changes nothing runs).", "",
                 f"Commit `{meta['commit']}`; command: `{meta['command']}`.", "", *bench.table(results), ""]
        each = bench.children_lines(results)
        if each:
            lines += ["Each fresh process's median us, in the order they ran, and each served process's ratio of its "
                      "stock copy to the served model:", "", *each, ""]
        for n, r in sorted(results.items()):
            if "compile_max_autotune" in r:
                lines.append(f"torch.compile(mode='max-autotune') at N={n}: compile {r['compile_max_autotune']['compile_seconds']:.0f} s")
        lines += ["", "Per-problem plans (from tune_model):", "", "```", str(report), "```"]
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        return lines

    for x in xs:
        n = x.shape[0]
        results[n] = bench.run_variants(stock, tuned, x, runs=args.runs, graphs=True,
                                        stock_model="alexnet", tf32=args.tf32,
                                        channels_last=args.channels_last, frozen=args.frozen,
                                        children=args.children,
                                        compile_max_autotune=not args.no_compile and (
                                            args.compile_batch is None or n in args.compile_batch))
        s = bench.speedups(results[n])
        print(f"N={n}: " + ", ".join(f"{k} {v['median_us']:.1f} us" for k, v in results[n].items())
              + f"; bagf {s['bagf_vs_stock']:.2f}x, bagf graph {s['bagf_graph_vs_stock']:.2f}x vs stock eager; bagf "
              f"{s['bagf_vs_stock_benchmark']:.2f}x vs stock_benchmark; served "
              f"{s.get('bagf_served_vs_stock', float('nan')):.2f}x, "
              f"{s.get('bagf_served_vs_stock_same_process', float('nan')):.2f}x in the same process",
              flush=True)
        write()  # results so far survive a run cut short
    print("\n".join(write()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

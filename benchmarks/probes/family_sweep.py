"""A family's whole space on layers, against cuDNN (needs a GPU): every valid configuration of ``--family`` that
the tuner would run on each problem (its ``applies`` and ``problem_rule``; ``--where`` narrows it, e.g.
``SPLIT=1,2``) is compiled, checked against float64 like every tuner candidate, screened by one GPU time from a
CUDA graph beside cuDNN's (``CudaBenchmarker.remeasure``, in chunks), and the best ``--top`` re-timed with cuDNN
interleaved over ``--rounds`` rounds. What it shows is the family's best plan per problem, search aside.

    python benchmarks/probes/family_sweep.py --family implicit_gemm_wgmma_h16 --dtype bfloat16 --channels-last \\
        --layers conv2,conv3,conv4,conv5 --batch 1,32,128 --tag h200_bf16_nhwc

cuDNN runs in benchmark mode in the same dtype, memory format and TF32 mode (``--tf32``). Writes
``family_sweep_<family>_<tag>.{json,md}`` under ``--out``; ``--from-json FILE`` rewrites a sweep's Markdown on a
CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_layers import ALEXNET, EXTRA, problem  # noqa: E402
from bench_overhead import command_line, git_commit  # noqa: E402

from bagf_torch.bench import gpu_tag  # noqa: E402
from bagf_torch import runtime  # noqa: E402
from bagf_torch.kernels import FAMILIES, family_refuses  # noqa: E402
from bagf_torch.ops import ATEN  # noqa: E402
from bagf_torch.tuning.measure import CudaBenchmarker, CudaChecker, Workspace  # noqa: E402


def parse_where(text: str | None) -> dict[str, set[int]]:
    """``"SPLIT=1,2;WG=2"`` -> {"SPLIT": {1, 2}, "WG": {2}}.

    >>> parse_where("SPLIT=1,2;WG=2") == {"SPLIT": {1, 2}, "WG": {2}}
    True
    """
    out: dict[str, set[int]] = {}
    for part in filter(None, (text or "").split(";")):
        knob, values = part.split("=")
        out[knob.strip()] = {int(v) for v in values.split(",")}
    return out


def selected(configs, where: dict[str, set[int]]):
    return [c for c in configs if all(c.get(k) in vs for k, vs in where.items())]


def markdown(meta: dict, rows: list[dict]) -> str:
    """The Markdown table of a sweep's JSON (``meta``, ``rows``)."""
    mode = (f"{meta['dtype']} {'channels_last' if meta['layout'] == 'nhwc' else 'NCHW'}"
            + (", TF32 mode" if meta["tf32"] else ""))
    top = meta.get("top", max((len(r["best"]) for r in rows), default=0))
    lines = [f"# {meta['family']}: the whole space against cuDNN ({meta['gpu']}, {meta['date']})", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; {mode}; commit {meta['commit']}; "
             f"`{meta['command']}`. Every configuration the tuner would run on the problem (narrowed by "
             f"`{meta['where']}` / `{meta['where_large']}` at N > 1) checked against float64, screened by one "
             f"CUDA-graph timing, the best {top} re-timed with cuDNN (benchmark mode) interleaved, median of "
             f"{meta['rounds']} rounds. TFLOP/s: direct-convolution FLOPs over the best time.", "",
             "| layer | N | configs (checked) | cuDNN us | best us | best / cuDNN speed | TFLOP/s | best plan |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["best_us"]
        lines.append(f"| {r['layer']} | {r['n']} | {r['configs']} ({r['checked']}) | {r['cudnn_us']:.1f} | "
                     + (f"{b:.1f} | {r['cudnn_us'] / b:.2f}x | {r['gflop'] / b * 1e3:.0f} | `{r['best_plan']}` |"
                        if b else "- | - | - | - |"))
    return "\n".join(lines) + "\n"


def save(args, fam, rows: list[dict], t_start: float, argv) -> None:
    """Write the sweep so far (JSON and Markdown): after every problem, so a run stopped by its time limit keeps what
    it measured."""
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "commit": git_commit(),
            "command": command_line("probes/family_sweep.py", sys.argv[1:] if argv is None else argv),
            "family": fam.FAMILY, "dtype": args.dtype, "layout": "nhwc" if args.channels_last else "nchw",
            "tf32": args.tf32, "where": args.where, "where_large": args.where_large, "top": args.top,
            "rounds": args.rounds, "seconds": round(time.perf_counter() - t_start, 1)}
    stem = Path(args.out) / f"family_sweep_{fam.FAMILY}_{args.tag}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(markdown(meta, rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), help="the family to sweep (needed unless --from-json)")
    ap.add_argument("--layers", default="conv2,conv3,conv4,conv5")
    ap.add_argument("--batch", default="1,32,128")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--tf32", action="store_true", help="TF32 mode (cuDNN with allow_tf32, the problem's key)")
    ap.add_argument("--where", default=None, help="knob=values;... for every batch, e.g. 'STAGES=4,5'")
    ap.add_argument("--where-large", default=None, help="knob=values;... added for N > 1, e.g. 'SPLIT=1,2'")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--keep-screen", action="store_true",
                    help="keep the screening time of every configuration that built and passed the check in the JSON "
                         "(rows' 'screen': plan -> us), for studies of the space on a CPU afterwards (start points)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=24, help="configurations per screening capture")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--from-json", default=None, help="rewrite the Markdown of a sweep's JSON (CPU) and exit")
    args = ap.parse_args(argv)
    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        Path(args.from_json).with_suffix(".md").write_text(markdown(data["meta"], data["rows"]))
        return 0
    if not args.family:
        ap.error("--family is needed")
    if not torch.cuda.is_available():
        print("family_sweep: no CUDA GPU here")
        return 2
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    fam = FAMILIES[args.family]
    layout = "nhwc" if args.channels_last else "nchw"
    layers = {lay[0]: lay for lay in ALEXNET + EXTRA}
    dev = runtime.get().device(0)
    checker, bench = CudaChecker(dev.compiler.ext), CudaBenchmarker()
    space = fam.space().valid_configs()
    rows, t_start = [], time.perf_counter()
    built: dict[str, object] = {}
    for n in [int(b) for b in args.batch.split(",")]:
        where = parse_where(args.where)
        if n > 1:
            where.update(parse_where(args.where_large))
        for name in args.layers.split(","):
            p = problem(layers[name], n, tf32=args.tf32, dtype=args.dtype, layout=layout)
            configs = [c for c in selected(space, where) if family_refuses(fam.FAMILY, c, p) is None]
            if not configs:
                print(f"{name} N={n}: {fam.FAMILY} has no configuration for {p.short()}", flush=True)
                continue
            fresh = [c for c in configs if fam.name(c) not in built]
            t0 = time.perf_counter()
            for c, b in zip(fresh, dev.compiler.compile(fam, fresh)):
                built[fam.name(c)] = b
            compile_s = time.perf_counter() - t0
            ws = Workspace(p, torch.device("cuda", 0))
            ok, failed = [], []
            for c in configs:
                b = built[fam.name(c)]
                if not hasattr(b, "handle"):
                    failed.append((fam.name(c), b.status))
                    continue
                bad = checker.check(ws, b.handle)
                if bad is not None:
                    failed.append((fam.name(c), bad.detail[:200]))
                else:
                    ok.append(c)
            screen: dict[str, float] = {}
            for i in range(0, len(ok), args.chunk):
                part = ok[i:i + args.chunk]
                times = bench.remeasure(ws, [built[fam.name(c)].handle for c in part], rounds=1)
                screen.update({fam.name(c): t for c, t in zip(part, times)})
            ranked = sorted((t, k) for k, t in screen.items() if not math.isnan(t))
            top = [k for _, k in ranked[:args.top]]
            times = bench.remeasure(ws, [ATEN] + [built[k].handle for k in top], rounds=args.rounds)
            row = {"layer": name, "n": n, "problem": p.short(), "configs": len(configs), "checked": len(ok),
                   "failed": failed[:20], "n_failed": len(failed), "compile_s": round(compile_s, 2),
                   "cudnn_us": times[0], "best": [{"plan": k, "us": t, "screen_us": screen[k]}
                                                  for k, t in zip(top, times[1:])],
                   "gflop": p.flops / 1e9}
            if args.keep_screen:
                row["screen"] = {k: round(t, 3) for k, t in screen.items()}
            best = min((b for b in row["best"] if not math.isnan(b["us"])), key=lambda b: b["us"], default=None)
            row["best_us"] = best["us"] if best else None
            row["best_plan"] = best["plan"] if best else None
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("best", "failed", "screen")}), flush=True)
            for b in row["best"]:
                print(f"    {b['plan']}: {b['us']:.1f} us (screen {b['screen_us']:.1f})", flush=True)
            if failed:
                print(f"    {len(failed)} failed, e.g. {failed[:3]}", flush=True)
            save(args, fam, rows, t_start, argv)
    save(args, fam, rows, t_start, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

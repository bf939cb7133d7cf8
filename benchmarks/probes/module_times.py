"""GPU time of each module of one forward in CUDA graphs, stock against bagf_torch (needs a GPU): where a model's
GPU time goes, and so how far converting its convolutions can take the whole forward.

Each leaf module (a module without children: a conv, a ReLU, a pool, a Linear) is captured alone in its own CUDA
graph on the input it gets in a real forward (recorded by a forward pre-hook), and its graph replays are timed with
CUDA events (``bagf_torch.bench.time_forward``: GPU time of one replay from an idle stream, median of ``--replays``);
stock's and bagf's module of the same name alternate, round by round, and each row is the median of ``--rounds``
such medians. The whole forward is captured and timed the same way; "outside the modules" is the whole forward's
time less the sum of its modules' (work a forward does between modules, such as AlexNet's ``torch.flatten`` of a
channels_last tensor, and the gaps between kernels that separate graphs do not have).

Both models in ``--dtype`` and (``--channels-last``) that format; fp32 runs with cuDNN's TF32 as ``--tf32`` says
(matmuls strict fp32, PyTorch's default); cuDNN in benchmark mode. The bagf model is pre-tuned first
(``tune_model``, at ``--seconds`` per problem; problems in the cache are not tuned again). Writes
``module_times_<tag>_<model>_n<N>_<mode>.{json,md}`` under ``--out``.

    python benchmarks/probes/module_times.py --dtype bfloat16 --channels-last --batch 1 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_overhead import command_line, git_commit  # noqa: E402

from bagf_torch import models  # noqa: E402
from bagf_torch.bench import graphed, time_forward  # noqa: E402
from bagf_torch.nn import TunedConv2d, convert  # noqa: E402
from bagf_torch.pretune import tune_model  # noqa: E402


def leaf_inputs(model: torch.nn.Module, x: torch.Tensor) -> list[tuple[str, torch.nn.Module, torch.Tensor]]:
    """(name, module, the input it gets) of each leaf module that one forward calls with one tensor, in call order;
    the inputs are copies (same strides) kept apart from the forward's later work."""
    seen: list[tuple[str, torch.nn.Module, torch.Tensor]] = []
    leaves = [(name, mod) for name, mod in model.named_modules() if next(mod.children(), None) is None]

    def record(name):
        def hook(mod, args):
            if len(args) == 1 and isinstance(args[0], torch.Tensor):
                seen.append((name, mod, args[0].detach().clone(memory_format=torch.preserve_format)))
        return hook

    hooks = [mod.register_forward_pre_hook(record(name)) for name, mod in leaves]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def graph_replay(call, x: torch.Tensor):
    """``call(x)`` captured in a CUDA graph, without grad: the replay."""
    with torch.no_grad():
        replay, _ = graphed(call, x)
    return replay


def interleaved_us(replays: dict[str, object], rounds: int, runs: int) -> dict[str, float]:
    """{label: median over ``rounds`` of the median GPU us of ``runs`` replays}, the labels alternating within each
    round (the order reversed every other round)."""
    samples: dict[str, list[float]] = {k: [] for k in replays}
    order = list(replays)
    for r in range(rounds):
        for label in (order if r % 2 == 0 else order[::-1]):
            samples[label].append(time_forward(replays[label], runs=runs, warmup=5).median_us)
    return {k: statistics.median(v) for k, v in samples.items()}


def kind(mod: torch.nn.Module) -> str:
    return type(mod).__name__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="alexnet", help="a name bagf_torch.models.build knows (default alexnet)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--tf32", action="store_true", help="fp32 with cuDNN's TF32 on (PyTorch's default)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=None, help="tuning seconds per problem (the library's)")
    ap.add_argument("--out", default=None, help="directory for the JSON and Markdown (default: print only)")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("module_times needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    stock = models.build(args.model, tuned=False).to(dtype).cuda().eval().to(memory_format=fmt)
    tuned = convert(copy.deepcopy(stock)).eval()
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=dtype).to(memory_format=fmt)
    report = tune_model(tuned, [x], seconds=args.seconds, progress=False)
    print(report)
    plans = {layer: row.plan for row in report.rows for layer in row.layers}

    stock_leaves = leaf_inputs(stock, x)
    tuned_leaves = {name: (mod, inp) for name, mod, inp in leaf_inputs(tuned, x)}
    rows = []
    for name, smod, sinp in stock_leaves:
        tmod, tinp = tuned_leaves.get(name, (None, None))
        replays = {"stock": graph_replay(smod, sinp)}
        if tmod is not None:
            replays["bagf"] = graph_replay(tmod, tinp)
        us = interleaved_us(replays, args.rounds, args.replays)
        rows.append({"module": name, "kind": kind(smod), "shape": list(sinp.shape),
                     "plan": plans.get(name, "aten" if isinstance(tmod, TunedConv2d) else ""),
                     "stock_us": us["stock"], "bagf_us": us.get("bagf")})
        print(f"{name:16s} {kind(smod):18s} stock {us['stock']:8.1f} us  bagf {us.get('bagf', float('nan')):8.1f} us",
              flush=True)
    whole = interleaved_us({"stock": graph_replay(stock, x), "bagf": graph_replay(tuned, x)}, args.rounds,
                           args.replays)
    # What two events around a replay measure with nothing between them: every module's time carries it once, the
    # whole forward once, so the sums below take it off each module.
    floor = statistics.median(time_forward(lambda: None, runs=args.replays, warmup=5).median_us
                              for _ in range(args.rounds))

    totals = {}
    for side in ("stock", "bagf"):
        parts = [max(r[f"{side}_us"] - floor, 0.0) for r in rows if r[f"{side}_us"] is not None]
        convs = [max(r[f"{side}_us"] - floor, 0.0) for r in rows
                 if r["kind"] == "Conv2d" and r[f"{side}_us"] is not None]
        totals[side] = {"whole_us": whole[side] - floor, "modules_us": sum(parts), "convs_us": sum(convs),
                        "outside_us": whole[side] - floor - sum(parts)}
    s, b = totals["stock"], totals["bagf"]
    # With every conv at zero GPU time and everything else as stock's: the most converting the convs can give.
    ceiling = s["whole_us"] / max(s["whole_us"] - s["convs_us"], 1e-9)
    mode = (f"fp32, TF32 {'on' if args.tf32 else 'off'}" if args.dtype == "float32" else args.dtype) + (
        ", channels_last" if args.channels_last else "")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "commit": git_commit(),
            "command": command_line("probes/module_times.py", sys.argv[1:] if argv is None else argv),
            "model": args.model, "batch": args.batch, "dtype": args.dtype, "channels_last": args.channels_last,
            "tf32": args.tf32, "rounds": args.rounds, "replays": args.replays, "event_floor_us": floor}
    lines = [f"# GPU time per module in CUDA graphs: stock vs bagf_torch ({meta['gpu']})", "",
             f"{meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; {args.model} at "
             f"N = {args.batch}, {mode}, cudnn.benchmark=True; commit `{meta['commit']}`; `{meta['command']}`.", "",
             "Each leaf module captured alone in a CUDA graph on the input it gets in a forward; GPU us of one replay, "
             f"median of {args.replays} replays, median of {args.rounds} interleaved rounds. The whole forward is "
             f"one graph of the model timed the same way. Two events with nothing between them measure {floor:.1f} us: "
             "the sums and the whole forward below have it taken off once per graph (the rows carry it).", "",
             "| module | kind | input | bagf plan | stock us | bagf us |", "|---|---|---|---|---|---|"]
    for r in rows:
        bagf_us = "-" if r["bagf_us"] is None else f"{r['bagf_us']:.1f}"
        lines.append(f"| {r['module']} | {r['kind']} | {'x'.join(map(str, r['shape']))} | {r['plan']} | "
                     f"{r['stock_us']:.1f} | {bagf_us} |")
    lines += [f"| **convs** | | | | **{s['convs_us']:.1f}** | **{b['convs_us']:.1f}** |",
              f"| **all modules** | | | | **{s['modules_us']:.1f}** | **{b['modules_us']:.1f}** |",
              f"| outside the modules (whole less modules) | | | | {s['outside_us']:.1f} | {b['outside_us']:.1f} |",
              f"| **whole forward** | | | | **{s['whole_us']:.1f}** | **{b['whole_us']:.1f}** |", "",
              f"Whole forward: bagf {s['whole_us'] / b['whole_us']:.2f}x stock. The convs are "
              f"{100 * s['convs_us'] / s['whole_us']:.0f}% of stock's forward: with every conv at zero GPU time and "
              f"the rest as stock's, the forward would be at most {ceiling:.2f}x stock."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        tag = (f"{args.tag}_{args.model}_n{args.batch}_{args.dtype}{'_tf32' if args.tf32 else ''}"
               f"{'_nhwc' if args.channels_last else ''}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"meta": meta, "rows": rows, "totals": totals, "conv_free_ceiling": ceiling, "report": str(report)}
        (out / f"module_times_{tag}.json").write_text(json.dumps(doc, indent=1))
        (out / f"module_times_{tag}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

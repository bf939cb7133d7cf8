"""GPU time of each module of one forward in CUDA graphs, stock against bagf_torch (needs a GPU): where a model's
GPU time goes, and so how far converting its convolutions can take the whole forward.

Each call of a leaf module (a module without children: a conv, a ReLU, a pool, a Linear) with one tensor argument is
captured alone in its own CUDA graph on the input it gets in a real forward (recorded by a forward pre-hook; a module
called twice gives two rows), and its graph replays are timed with CUDA events (GPU time of one replay from an idle
stream, median of ``--replays``); stock's and bagf's call alternate with an empty graph's replay (the floor every
row carries), and each row is the median of ``--rounds`` such medians. The whole forward is captured and timed the
same way; "outside the modules" is the whole forward's time less the sum of its calls' (work a forward does
outside leaf modules, such as AlexNet's ``torch.flatten`` of a channels_last tensor; the leaf calls not timed alone,
listed; and the gaps between kernels that separate graphs do not have).

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
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import command_line, git_commit, interleaved_graph_us  # noqa: E402
from eager_host import forward_with_hooks, leaves  # noqa: E402

from bagf_torch import models  # noqa: E402
from bagf_torch import epilogue  # noqa: E402
from bagf_torch.bench import gpu_tag, graphed  # noqa: E402
from bagf_torch.nn import TunedConv2d, _numeric_padding, convert  # noqa: E402
from bagf_torch.pretune import tune_model  # noqa: E402
from bagf_torch.problem import ConvProblem  # noqa: E402


def leaf_calls(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[tuple[str, torch.nn.Module, torch.Tensor]],
                                                                   list[str]]:
    """The leaf-module calls of one forward, in call order: (name, module, its input) of each call with one tensor
    argument and no keyword arguments (the input a copy with the same strides, kept apart from the forward's later
    work; a module called twice gives two entries), and the names of the leaf calls made otherwise (not timed
    alone: their work lands in "outside the modules")."""
    timed: list[tuple[str, torch.nn.Module, torch.Tensor]] = []
    other: list[str] = []

    def record(name):
        def hook(mod, args, kwargs):
            if len(args) == 1 and isinstance(args[0], torch.Tensor) and not kwargs:
                timed.append((name, mod, args[0].detach().clone(memory_format=torch.preserve_format)))
            else:
                other.append(name)
        return hook

    forward_with_hooks(model, x, [mod.register_forward_pre_hook(record(name), with_kwargs=True)
                                  for name, mod in leaves(model)])
    return timed, other


def plan_of(report, name: str, mod: torch.nn.Module, x: torch.Tensor) -> str:
    """The plan ``tune_model``'s ``report`` names for the call of layer ``name`` (module ``mod``) on ``x``: its row
    for this call's problem (a layer called at two shapes has two rows), "aten" for a TunedConv2d call no row has
    (one the kernels do not take), "" for other modules."""
    if not isinstance(mod, TunedConv2d):
        return ""
    padding = _numeric_padding(mod)
    if padding is None:
        return "aten"
    problem = ConvProblem.from_call(x, mod.weight, mod.bias, mod.stride, padding, mod.dilation, mod.groups)
    return next((row.plan for row in report.rows if row.problem == problem and name in row.layers), "aten")


def graph_replay(call, x: torch.Tensor | None):
    """``call(x)`` captured in a CUDA graph, without grad: the replay (a module that launches nothing, such as an
    eval-mode Dropout or a view, gives an empty graph: what the event floor measures)."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns about an empty graph)
        replay, _ = graphed(call, x)
    return replay


def fused_calls(model: torch.nn.Module) -> dict[str, tuple]:
    """What a FusedSequential's forward runs in place of the ReLU -> MaxPool2d pairs it fuses (``convert``'s pooling
    epilogue), by module name: (a call on the module's input, the row's kind). The pool's row times the one kernel,
    ReLU included (on the ReLU's output, the same work); the ReLU's row is an empty graph. Timed alone (or with hooks
    on, as ``leaf_calls`` has them) each module runs ATen's op, as a FusedSequential's modules do called one by one."""
    out = {}
    for prefix, mod in model.named_modules():
        if not isinstance(mod, epilogue.FusedSequential):
            continue
        names = list(mod._modules)
        for i, (j, relu) in epilogue.pairs(list(mod._modules.values())).items():
            pool = mod._modules[names[j]]
            if relu:
                out[".".join(filter(None, (prefix, names[i + 1])))] = (lambda t: t, "ReLU (fused into the pool)")
            out[".".join(filter(None, (prefix, names[j])))] = (
                lambda t, pool=pool, relu=relu: epilogue.relu_max_pool2d(t, pool, relu),
                "MaxPool2d (the fused ReLU + pool kernel)")
    return out


def kind(mod: torch.nn.Module) -> str:
    return type(mod).__name__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="alexnet", help="a name bagf_torch.models.build knows (default alexnet)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--tf32", action="store_true", help="fp32 with cuDNN's TF32 on (PyTorch's default)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row (median of their medians)")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=None, help="tuning seconds per problem (the library's)")
    ap.add_argument("--out", default=None, help="directory for the JSON and Markdown (default: print only)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on)
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
    size = models.input_size(args.model)
    x = torch.randn(args.batch, 3, size, size, device="cuda", dtype=dtype).to(memory_format=fmt)
    report = tune_model(tuned, [x], seconds=args.seconds, progress=False)
    print(report)

    stock_calls, stock_other = leaf_calls(stock, x)
    tuned_calls, tuned_other = leaf_calls(tuned, x)
    names = [n for n, _, _ in stock_calls]
    if names != [n for n, _, _ in tuned_calls]:
        raise SystemExit(f"the two models call different modules: {names} against {[n for n, _, _ in tuned_calls]}")
    # Two events around an empty graph's replay: what every row carries besides its module's work (the launch of a
    # graph from an idle stream); the sums below take it off each row, and the whole forward's once.
    empty = graph_replay(lambda t: t, x)
    fused = fused_calls(tuned)  # (tune_model loaded the pooling kernel: epilogue.prepare)
    rows = []
    seen: dict[str, int] = {}
    for (name, smod, sinp), (_, tmod, tinp) in zip(stock_calls, tuned_calls):
        seen[name] = seen.get(name, 0) + 1
        label = name if names.count(name) == 1 else f"{name}#{seen[name]}"
        call, k = fused.get(name, (tmod, None))
        stock_us, bagf_us, floor_us = interleaved_graph_us(
            [graph_replay(smod, sinp), graph_replay(call, tinp), empty], args.replays, args.rounds)
        if k is None:
            k = kind(smod) if kind(smod) == kind(tmod) else f"{kind(smod)} -> {kind(tmod)}"
        rows.append({"module": label, "kind": k, "shape": list(sinp.shape),
                     "plan": plan_of(report, name, tmod, tinp),
                     "stock_us": stock_us, "bagf_us": bagf_us, "floor_us": floor_us})
        print(f"{label:16s} {k:18s} stock {stock_us:8.1f} us  bagf {bagf_us:8.1f} us  (floor {floor_us:.1f})",
              flush=True)
    whole_stock, whole_bagf, floor = interleaved_graph_us([graph_replay(stock, x), graph_replay(tuned, x), empty],
                                                          args.replays, args.rounds)
    whole = {"stock": whole_stock, "bagf": whole_bagf}

    totals = {}
    for side in ("stock", "bagf"):
        parts = [max(r[f"{side}_us"] - r["floor_us"], 0.0) for r in rows]
        convs = [max(r[f"{side}_us"] - r["floor_us"], 0.0) for r in rows if r["kind"].startswith("Conv2d")]
        totals[side] = {"whole_us": whole[side] - floor, "modules_us": sum(parts), "convs_us": sum(convs),
                        "outside_us": whole[side] - floor - sum(parts)}
    s, b = totals["stock"], totals["bagf"]
    # With every conv at zero GPU time and everything else as stock's: the most converting the convs can give. (Each
    # row also carries its kernels' start-up, which a whole forward overlaps: the sums can exceed the whole, and then
    # there is no ceiling to state.)
    ceiling = s["whole_us"] / (s["whole_us"] - s["convs_us"]) if s["convs_us"] < s["whole_us"] else None
    mode = (f"fp32, TF32 {'on' if args.tf32 else 'off'}" if args.dtype == "float32" else args.dtype) + (
        ", channels_last" if args.channels_last else "")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "commit": git_commit(),
            "command": command_line("probes/module_times.py", sys.argv[1:] if argv is None else argv),
            "model": args.model, "batch": args.batch, "dtype": args.dtype, "channels_last": args.channels_last,
            "tf32": args.tf32, "rounds": args.rounds, "replays": args.replays, "floor_us": floor,
            "not_timed_alone": {"stock": stock_other, "bagf": tuned_other}}
    lines = [f"# GPU time per module in CUDA graphs: stock vs bagf_torch ({meta['gpu']})", "",
             f"{meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; {args.model} at "
             f"N = {args.batch}, {mode}, cudnn.benchmark=True; commit `{meta['commit']}`; `{meta['command']}`.", "",
             "Each leaf-module call captured alone in a CUDA graph on the input it gets in a forward; GPU us of one "
             f"replay, median of {args.replays} replays, median of {args.rounds} rounds interleaved with its twin and "
             "an empty graph (`floor`: the launch of a graph from an idle stream, which every row carries). The whole "
             "forward is one graph of the model timed the same way. The sums below take each row's floor off it, and "
             f"the whole forward's ({floor:.1f} us) off it once.", "",
             "| module | kind | input | bagf plan | stock us | bagf us | floor us |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['module']} | {r['kind']} | {'x'.join(map(str, r['shape']))} | {r['plan']} | "
                     f"{r['stock_us']:.1f} | {r['bagf_us']:.1f} | {r['floor_us']:.1f} |")
    lines += [f"| **convs** | | | | **{s['convs_us']:.1f}** | **{b['convs_us']:.1f}** |",
              f"| **all modules** | | | | **{s['modules_us']:.1f}** | **{b['modules_us']:.1f}** |",
              f"| outside the modules (whole less modules) | | | | {s['outside_us']:.1f} | {b['outside_us']:.1f} |",
              f"| **whole forward** | | | | **{s['whole_us']:.1f}** | **{b['whole_us']:.1f}** |", "",
              f"Whole forward: bagf {s['whole_us'] / b['whole_us']:.2f}x stock. The convs are "
              f"{100 * s['convs_us'] / s['whole_us']:.0f}% of stock's forward"
              + (f": with every conv at zero GPU time and the rest as stock's, the forward would be at most "
                 f"{ceiling:.2f}x stock." if ceiling is not None else
                 " (their graphs' sum reaches the whole forward's time: each alone pays start-up latency that the "
                 "whole forward overlaps, so no ceiling follows)."),
              "", "Each row also carries its kernels' start-up latency, which consecutive kernels of the whole forward "
              "overlap: the sums can overcount, and \"outside the modules\" can come out negative."]
    if stock_other or tuned_other:
        lines += ["", "Leaf calls not timed alone (not one tensor argument; their work is in \"outside\"): stock "
                  f"{', '.join(stock_other) or 'none'}; bagf {', '.join(tuned_other) or 'none'}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        model = args.model.split(":")[-1]  # (torchvision:resnet50 -> resnet50: no ':' in a file name)
        tag = (f"{args.tag}_{model}_n{args.batch}_{args.dtype}{'_tf32' if args.tf32 else ''}"
               f"{'_nhwc' if args.channels_last else ''}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"meta": meta, "rows": rows, "totals": totals, "conv_free_ceiling": ceiling, "report": str(report)}
        (out / f"module_times_{tag}.json").write_text(json.dumps(doc, indent=1))
        (out / f"module_times_{tag}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

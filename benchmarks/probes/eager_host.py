"""Host cost per module of one eager forward, stock against bagf_torch (needs a GPU): where an eager forward at
small batch spends the host's time, module by module.

Each forward is issued while a sleep kernel keeps the GPU busy, so no call waits for the GPU and the time between a
module's forward pre-hook and its forward hook is what the host spends issuing it (Python, dispatch, allocation,
launches, and the hooks' own microseconds: the numbers rank modules against their stock twins). Median over ``--runs``
forwards; stock in cuDNN's benchmark mode, both models in ``--dtype`` and
(``--channels-last``) that format, AlexNet by default. The bagf model is pre-tuned first (``tune_model``; a cache
that holds the plans keeps tuning out of the run: pre-tune in an earlier run, since compiles left running by the
tuning slow the first pass). Then each conv alone: on either model's input, and beside the call its module makes
underneath (``F.conv2d``; ``bagf_ext.conv2d_inference`` with the plan), which splits a module's cost into its Python
and its op.

    python benchmarks/probes/eager_host.py --dtype bfloat16 --channels-last --batch 1 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_overhead import command_line, git_commit  # noqa: E402

from bagf_torch.bench import gpu_tag  # noqa: E402
from bagf_torch import models  # noqa: E402
from bagf_torch.jit import extension  # noqa: E402
from bagf_torch.nn import TunedConv2d, convert  # noqa: E402
from bagf_torch.pretune import tune_model  # noqa: E402


def leaves(model: torch.nn.Module):
    """(name, module) of each leaf module: the ones whose forward hooks time or describe one layer."""
    return [(name, mod) for name, mod in model.named_modules() if next(mod.children(), None) is None]


def busy_host_us(call, runs: int, after_warmup=None) -> list[float]:
    """Host us of each of ``runs`` calls of ``call()`` (without grad), each issued while a sleep kernel keeps the GPU
    busy, after 5 untimed calls (and ``after_warmup()``, if given)."""
    times = []
    with torch.no_grad():
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        if after_warmup is not None:
            after_warmup()
        for _ in range(runs):
            torch.cuda._sleep(int(2e7))  # ~10 ms of GPU work: the call is issued while the GPU is busy
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
    return times


def host_times(model: torch.nn.Module, x: torch.Tensor, runs: int) -> tuple[dict[str, float], float]:
    """{module name: median host us} over the leaf modules, and the median host us of the whole forward."""
    starts: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    hooks = []
    for name, mod in leaves(model):
        hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: starts.__setitem__(n, time.perf_counter())))
        hooks.append(mod.register_forward_hook(
            lambda m, a, o, n=name: samples.setdefault(n, []).append((time.perf_counter() - starts[n]) * 1e6)))
    try:
        whole = busy_host_us(lambda: model(x), runs, after_warmup=samples.clear)  # (the hooks' warm-up samples out)
    finally:
        for h in hooks:
            h.remove()
    return {n: statistics.median(v) for n, v in samples.items()}, statistics.median(whole)


def call_host_us(mod: torch.nn.Module, inp: torch.Tensor, runs: int) -> float:
    """Median host us of ``mod(inp)`` alone, issued while a sleep kernel keeps the GPU busy."""
    return statistics.median(busy_host_us(lambda: mod(inp), runs))


def cross_inputs(stock: torch.nn.Module, tuned: torch.nn.Module, x: torch.Tensor, runs: int) -> dict[str, dict]:
    """Whether a layer's extra host cost follows the layer or its input: each conv of the models' ``features``
    (a Sequential) called alone, stock's and bagf's module each on the input stock's and bagf's earlier layers
    produced (same values to rounding, each producer's own tensor: its pointer, strides and allocation); and, on
    bagf's input, the call each module's forward makes underneath -- stock's ``F.conv2d`` (ATen's dispatch, cuDNN's
    launch), bagf's ``bagf_ext.conv2d_inference`` with the layer's plan (the op's launch without the dispatcher)
    where that plan is our kernel: the module's call minus the op's is its Python.
    {module name: {"stock on stock": us, "stock on bagf": us, "bagf on stock": us, "bagf on bagf": us,
    "F.conv2d on bagf": us[, "conv2d_inference on bagf": us]}}; empty for a model without ``features``."""
    if not isinstance(getattr(stock, "features", None), torch.nn.Sequential):
        return {}
    ext = extension.loaded()
    out: dict[str, dict] = {}
    with torch.no_grad():
        a, b = x, x
        for i, (ms, mt) in enumerate(zip(stock.features, tuned.features)):
            if isinstance(ms, torch.nn.Conv2d):
                row = out[f"features.{i}"] = {
                    "stock on stock": call_host_us(ms, a, runs), "stock on bagf": call_host_us(ms, b, runs),
                    "bagf on stock": call_host_us(mt, a, runs), "bagf on bagf": call_host_us(mt, b, runs),
                    "F.conv2d on bagf": statistics.median(busy_host_us(
                        lambda: torch.nn.functional.conv2d(b, ms.weight, ms.bias, ms.stride, ms.padding,
                                                           ms.dilation, ms.groups), runs))}
                hit = mt._plan_entry(b) if type(mt) is TunedConv2d else None
                if ext is not None and hit is not None and hit[0] == "kernel":
                    row["conv2d_inference on bagf"] = statistics.median(busy_host_us(
                        lambda: ext.conv2d_inference(b, mt.weight, mt.bias, hit[2], hit[3], hit[4], hit[1]), runs))
            a, b = ms(a), mt(b)
    return out


def layout(t) -> str:
    """A tensor's memory format in a word: the same layout fed to the next module can cost it a conversion."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    return "contiguous" if t.is_contiguous() else f"strides {tuple(t.stride())}"


def forward_with_hooks(model: torch.nn.Module, x: torch.Tensor, hooks) -> None:
    """One forward of ``model`` on ``x`` without grad, then the ``hooks`` (their removable handles) removed, also
    after an error."""
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()


def output_layouts(model: torch.nn.Module, x: torch.Tensor) -> dict[str, str]:
    """{leaf module name: its output's memory format} in one forward."""
    seen: dict[str, str] = {}
    forward_with_hooks(model, x, [mod.register_forward_hook(lambda m, a, o, n=name: seen.__setitem__(n, layout(o)))
                                  for name, mod in leaves(model)])
    return seen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="alexnet")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=None, help="tuning seconds per problem (the library's)")
    ap.add_argument("--profile", action="store_true",
                    help="add torch.profiler's host-time table of ten forwards of each model (ops and CUDA API calls)")
    ap.add_argument("--out", default=None, help="directory for eager_host_<tag>.{json,md} (default: print only)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on)
    dtype = getattr(torch, args.dtype)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.manual_seed(0)
    stock = models.build(args.model, tuned=False).to(dtype).cuda().eval().to(memory_format=fmt)
    tuned = convert(copy.deepcopy(stock)).eval()
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=dtype).to(memory_format=fmt)
    report = tune_model(tuned, [x], seconds=args.seconds, progress=False)
    print(report)
    torch.backends.cudnn.benchmark = True
    plans = {layer: row.plan for row in report.rows for layer in row.layers}  # module name -> its plan
    rows, totals = {}, {}
    formats = {"stock": output_layouts(stock, x), "bagf": output_layouts(tuned, x)}
    # the whole forward without hooks (a hooked conv does not fuse its ReLU and pool): stock, bagf as converted, and
    # bagf with convert(fuse=False), which isolates what the pooling epilogue saves; three turns, interleaved
    unfused = convert(copy.deepcopy(stock), fuse=False).eval()
    tune_model(unfused, [x], seconds=args.seconds, progress=False)  # (the same cache: nothing tuned again)
    bare: dict[str, list[float]] = {}
    for _ in range(3):
        for label, model in (("stock", stock), ("bagf", tuned), ("bagf unfused", unfused)):
            bare.setdefault(label, []).extend(busy_host_us(lambda m=model: m(x), args.runs))
    bare_median = {label: statistics.median(v) for label, v in bare.items()}
    for label, model in (("stock", stock), ("bagf", tuned), ("stock again", stock), ("bagf again", tuned)):
        per, whole = host_times(model, x, args.runs)
        totals[label] = whole
        for name, us in per.items():
            rows.setdefault(name, {})[label] = us
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
            "command": command_line("probes/eager_host.py", sys.argv[1:] if argv is None else argv),
            "model": args.model, "batch": args.batch, "dtype": args.dtype,
            "channels_last": args.channels_last, "runs": args.runs}
    lines = [f"# Host cost per module of one eager forward: stock vs bagf_torch ({meta['gpu']})", "",
             f"{meta['date']}; torch {meta['torch']}; {args.model} at N = {args.batch}, {args.dtype}"
             f"{' channels_last' if args.channels_last else ''}; commit `{meta['commit']}`; `{meta['command']}`.", "",
             "Host us between each leaf module's forward pre-hook and forward hook, issued while a sleep kernel keeps "
             "the GPU busy (no call waits for the GPU), median of the runs; each model timed twice, interleaved.", "",
             "| module | bagf plan | " + " | ".join(f"{k} us" for k in totals) + " | stock output | bagf output |",
             "|---|---|" + "---|" * (len(totals) + 2)]
    for name, vals in rows.items():
        lines.append(f"| {name} | {plans.get(name, '')} | "
                     + " | ".join(f"{vals.get(k, float('nan')):.1f}" for k in totals)
                     + f" | {formats['stock'].get(name, '')} | {formats['bagf'].get(name, '')} |")
    lines.append("| **whole forward** | | " + " | ".join(f"**{v:.1f}**" for v in totals.values()) + " | | |")
    lines += ["", "The whole forward without hooks (host us, median of three interleaved turns of the runs, GPU kept "
              "busy); `bagf unfused` is `convert(fuse=False)`: its ReLU and pooling run as ATen's modules:", "",
              "| " + " | ".join(bare_median) + " |", "|" + "---|" * len(bare_median),
              "| " + " | ".join(f"{v:.1f}" for v in bare_median.values()) + " |"]
    crossed = cross_inputs(stock, tuned, x, args.runs)
    if crossed:
        kinds = list(dict.fromkeys(k for v in crossed.values() for k in v))
        lines += ["", "Each conv called alone (host us, median of the runs, GPU kept busy): stock's and bagf's module, "
                  "each on the input stock's and bagf's earlier layers produced; then, on bagf's input, the call each "
                  "module's forward makes underneath: stock's `F.conv2d`, bagf's `bagf_ext.conv2d_inference` with the "
                  "layer's plan where the plan is our kernel (empty: cuDNN's plan):", "",
                  "| module | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        lines += [f"| {name} | " + " | ".join(f"{v[k]:.1f}" if k in v else "" for k in kinds) + " |"
                  for name, v in crossed.items()]
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for label, model in (("stock", stock), ("bagf", tuned)):
            torch.cuda.synchronize()
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                               record_shapes=True) as prof:
                torch.cuda._sleep(int(2e8))  # the GPU busy through the ten forwards: no call waits for it
                for _ in range(10):
                    model(x)
            torch.cuda.synchronize()
            lines += ["", f"torch.profiler, {label}, ten forwards, by self CPU time, per op and input shapes:", "",
                      "```", prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total",
                                                                                 row_limit=30), "```"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        tag = f"{args.tag}_{args.model}_n{args.batch}_{args.dtype}{'_nhwc' if args.channels_last else ''}"
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"meta": meta, "plans": plans, "rows": rows, "totals": totals, "no_hooks": bare_median,
               "output_layouts": formats, "cross_inputs": crossed}
        (out / f"eager_host_{tag}.json").write_text(json.dumps(doc, indent=1))
        (out / f"eager_host_{tag}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

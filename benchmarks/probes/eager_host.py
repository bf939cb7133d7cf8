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

``--served`` adds fresh processes, as a serving user runs them: stock with PyTorch's defaults (cudnn.benchmark off),
and bagf with BAGF_TUNE=0, its plans from the cache this run tuned into; two of each, alternating. Each reports the
whole forward's host time without hooks and its thread's CPU time in it, its eager forward from an idle GPU as the
end-to-end benchmark times it, the ReLU and pooling ops ATen ran per forward (none where bagf's epilogues
took them), its threads, and cProfile's costliest functions over the forwards, which this process reports for its
own bagf model beside them: where a serving process's forward spends host time that the tuning process's does not.
Exit 1 where a fresh process failed, or its numbers are not what they claim to be (a served call that ran something
else than here, no plan loaded, a tuning, another bagf_torch): the files say which.

    python benchmarks/probes/eager_host.py --dtype bfloat16 --channels-last --batch 1 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import datetime
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_overhead import command_line, git_commit  # noqa: E402

import bagf_torch  # noqa: E402
from bagf_torch.bench import _cache_shared, fp32, gpu_tag, layer_kinds, time_forward  # noqa: E402
from bagf_torch import models  # noqa: E402
from bagf_torch.jit import extension  # noqa: E402
from bagf_torch.nn import TunedConv2d, convert  # noqa: E402
from bagf_torch.pretune import tune_model  # noqa: E402
from bagf_torch.problem import cudnn_tf32  # noqa: E402


def leaves(model: torch.nn.Module):
    """(name, module) of each leaf module: the ones whose forward hooks time or describe one layer."""
    return [(name, mod) for name, mod in model.named_modules() if next(mod.children(), None) is None]


def busy_host_us(call, runs: int, after_warmup=None, cpu: list[float] | None = None) -> list[float]:
    """Host us of each of ``runs`` calls of ``call()`` (without grad), each issued while a sleep kernel keeps the GPU
    busy, after 5 untimed calls (and ``after_warmup()``, if given); with ``cpu``, the CPU us the calling thread spent in
    each call are appended to it (less than the host us where the thread waited: descheduled, or blocked in the
    driver)."""
    times = []
    with torch.no_grad():
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        if after_warmup is not None:
            after_warmup()
        for _ in range(runs):
            torch.cuda._sleep(int(2e7))  # ~10 ms of GPU work: the call is issued while the GPU is busy
            c0 = time.thread_time()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            c1 = time.thread_time()
            times.append((t1 - t0) * 1e6)
            if cpu is not None:
                cpu.append((c1 - c0) * 1e6)
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


EPILOGUE_OPS = ("aten::relu", "aten::relu_", "aten::max_pool2d")
"""ATen's ops for what bagf's pooling and ReLU epilogues do in a conv's or the pooling kernel's launch (the ops
max_pool2d calls underneath, max_pool2d_with_indices on CUDA, not counted again)."""

MARK = "eager_host child: "
"""The line of a child's stdout that carries its report (JSON)."""


def profile_top(call, forwards: int = 30, top: int = 25) -> tuple[str, float]:
    """cProfile's ``top`` functions by own time over ``forwards`` calls of ``call()`` (without grad), each issued while
    a sleep kernel keeps the GPU busy and profiled alone (a queue of launches behind one long sleep would fill and make
    a launch wait): calls, own and cumulative us per call of ``call``, and the function; and the profiled us per call
    in all (cProfile's own cost included: compare it with the unprofiled forward's)."""
    prof = cProfile.Profile()
    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        for _ in range(forwards):
            torch.cuda._sleep(int(2e7))  # ~10 ms of GPU work, as in busy_host_us
            prof.enable()
            call()
            prof.disable()
            torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"{'calls/fwd':>9} {'own us/fwd':>10} {'cum us/fwd':>10}  function"]
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = name if file == "~" else f"{'/'.join(Path(file).parts[-2:])}:{line}({name})"
        lines.append(f"{calls / forwards:>9g} {own / forwards * 1e6:>10.1f} {cum / forwards * 1e6:>10.1f}  {where}")
    return "\n".join(lines), sum(s[2] for s in stats.values()) / forwards * 1e6


def epilogue_ops(call, forwards: int = 5) -> dict[str, float]:
    """ATen's ReLU and pooling ops (``EPILOGUE_OPS``) per call of ``call()``, by torch.profiler: none for a pair that
    bagf's epilogue ran."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        call()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(forwards):
                call()
    torch.cuda.synchronize()
    return {e.key: e.count / forwards for e in prof.key_averages() if e.key in EPILOGUE_OPS}


def process_report(model: torch.nn.Module, x: torch.Tensor, runs: int) -> dict:
    """What one process's eager forward of ``model`` on ``x`` costs the host, and what might make it cost more: the
    whole forward without hooks (median host us, and the CPU us its thread spent in it), the eager forward from an
    idle GPU as the end-to-end benchmark times it (``time_forward``: median us, the call and the wait for its
    kernels), ATen's ReLU and pooling ops per forward, the threads alive, the interpreter's switch interval, the CPUs
    it may run on and the machine's 1-minute load, what each TunedConv2d ran (``layer_kinds``), cProfile's costliest
    functions (and its profiled us per forward) and the bagf_torch it imported."""
    cpu: list[float] = []
    whole = busy_host_us(lambda: model(x), runs, cpu=cpu)
    with torch.no_grad():
        eager = time_forward(lambda: model(x), runs=runs).as_dict()["median_us"]
    profile, profiled_us = profile_top(lambda: model(x))
    return {"no_hooks_us": statistics.median(whole), "cpu_us": statistics.median(cpu), "eager_us": eager,
            "cpus": len(os.sched_getaffinity(0)), "load": os.getloadavg()[0],
            "epilogue_ops": epilogue_ops(lambda: model(x)),
            "threads": sorted(t.name for t in threading.enumerate()), "switch_interval_s": sys.getswitchinterval(),
            "layer_kinds": layer_kinds(model), "profile": profile, "profiled_us": profiled_us,
            "package": str(Path(bagf_torch.__file__).resolve())}


def child_main(kind: str, args) -> int:
    """A fresh process's report (``process_report``) on stdout after ``MARK``: "stock" the stock model with PyTorch's
    defaults (cudnn.benchmark off), "served" the converted one as a serving process runs it (the caller sets
    BAGF_TUNE=0: plans from the cache, nothing tuned), built as ``bagf_torch.bench``'s served child builds it; cuDNN's
    TF32 as the parent had it (``--tf32``: a float32 plan's key holds the mode)."""
    from bagf_torch import runtime

    dtype = getattr(torch, args.dtype)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.manual_seed(0)
    model = models.build(args.model, tuned=kind == "served").cuda().eval().to(dtype).to(memory_format=fmt)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=dtype).to(memory_format=fmt)
    with fp32(benchmark=False, tf32=bool(args.tf32)):
        report = process_report(model, x, args.runs)
    stats = runtime.get().stats if kind == "served" else {}
    report.update(plans_loaded=stats.get("cache_hits", 0), tuned=stats.get("tuned", 0))
    print(MARK + json.dumps(report), flush=True)
    return 0


CHILD_STUB = ("import runpy, sys; sys.path[0] = {here!r}; sys.argv[0] = {script!r}; "
              "runpy.run_path({script!r}, run_name='__main__')")
"""A child's program: this process's bagf_torch folder in place of the working directory at the head of sys.path (a
source checkout there would shadow an installed copy; PYTHONPATH would put site-packages before the standard
library), then this file as ``__main__`` with the arguments after it."""


def in_fresh_process(kind: str, args, tf32: bool, timeout: float) -> dict:
    """``child_main``'s report from a fresh process running this file (BAGF_TUNE=0 for "served"; this process's
    bagf_torch first on its path, as ``bagf_torch.bench``'s children have it; cuDNN's TF32 as ``tf32``), with the end
    of its stderr (bagf_torch's log lines: a fallback's reason). ``{"error": ..., "stderr": ...}`` where it gave no
    report (failed, or still running after ``timeout`` s); a report followed by a failing exit is kept, with
    ``exit_code``."""
    here = str(Path(bagf_torch.__file__).resolve().parents[1])
    cmd = [sys.executable, "-c", CHILD_STUB.format(here=here, script=str(Path(__file__).resolve())),
           "--child", kind, "--model", args.model, "--batch", str(args.batch), "--dtype", args.dtype,
           "--runs", str(args.runs), "--tf32", str(int(tf32))] + (["--channels-last"] if args.channels_last else [])
    env = dict(os.environ, **({"BAGF_TUNE": "0"} if kind == "served" else {}))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"error": f"no report within {timeout:g} s", "stderr": err[-2000:]}
    reports = [line[len(MARK):] for line in r.stdout.splitlines() if line.startswith(MARK)]
    if not reports:
        return {"error": f"exit {r.returncode}, no report", "stderr": r.stderr[-2000:]}
    report = dict(json.loads(reports[-1]), stderr=r.stderr[-2000:])
    if r.returncode:
        report["exit_code"] = r.returncode
    return report


def served_section(own: dict, children: list[tuple[str, dict]]) -> tuple[list[str], list[str]]:
    """The Markdown of ``--served`` (this process's bagf model beside the fresh processes, stock and served) and what
    makes the children's numbers not what they claim to be: a served call that ran something else than here, no plan
    loaded, a problem tuned, another bagf_torch imported, a child that failed or exited with an error."""
    def ops(report):
        return ", ".join(f"{k.split('::')[1]} {v:g}" for k, v in sorted(report["epilogue_ops"].items())) or "none"

    lines = ["", "Fresh processes (`--served`): stock with PyTorch's defaults, bagf served (BAGF_TUNE=0, plans from "
             "this run's cache), alternating; the whole forward without hooks (host us, median of the runs, GPU kept "
             "busy) and the CPU us its thread spent in it (less where it waited), the eager forward as the "
             "end-to-end benchmark times it (us from an idle GPU to its kernels' end, median), ATen's ReLU and "
             "pooling ops per forward, cProfile's profiled us per forward (its own cost "
             "included), the threads alive, the machine's 1-minute load:", "",
             "| process | whole forward host us | its CPU us | eager forward us | ATen ReLU / pool ops per forward "
             "| profiled us | threads | load | plans loaded / tuned |", "|---|---|---|---|---|---|---|---|---|",
             f"| this process, bagf (tuned here) | {own['no_hooks_us']:.1f} | {own['cpu_us']:.1f} | "
             f"{own['eager_us']:.1f} | {ops(own)} | {own['profiled_us']:.1f} | {', '.join(own['threads'])} | "
             f"{own['load']:.2f} | |"]
    problems = []
    for label, rep in children:
        if "error" in rep:
            lines.append(f"| {label} | failed: {rep['error']} | | | | | | | |")
            problems.append(f"{label} failed ({rep['error']})")
            continue
        served = label.startswith("served")
        lines.append(f"| {label} | {rep['no_hooks_us']:.1f} | {rep['cpu_us']:.1f} | {rep['eager_us']:.1f} | "
                     f"{ops(rep)} | {rep['profiled_us']:.1f} | {', '.join(rep['threads'])} | {rep['load']:.2f} | "
                     + (f"{rep['plans_loaded']} / {rep['tuned']}" if served else "") + " |")
        if rep.get("exit_code"):
            problems.append(f"{label} exited with {rep['exit_code']} after its report")
        if rep["package"] != own["package"]:
            problems.append(f"{label} imported {rep['package']}, this process {own['package']}")
        if served:
            mine, theirs = own["layer_kinds"], rep["layer_kinds"]
            differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            problems += [f"{label}: {k} ran {theirs.get(k, 'nothing')} ({mine.get(k, 'nothing')} here)" for k in differ]
            if not rep["plans_loaded"] or rep["tuned"]:
                problems.append(f"{label} loaded {rep['plans_loaded']} plans and tuned {rep['tuned']} problems")
    if problems:
        lines += ["", "**Not the numbers they claim to be:** " + "; ".join(problems) + "."]
    shown = [("this process, bagf", own)] + [(label, rep) for label, rep in children
                                             if label.endswith(" 1") and "error" not in rep]
    for label, rep in shown:
        lines += ["", f"cProfile, {label}: the 25 costliest functions by own time over 30 forwards:", "", "```",
                  rep["profile"], "```"]
    for label, rep in children:  # (the first of each kind's, and a failed child's)
        if (label.endswith(" 1") or "error" in rep) and rep.get("stderr", "").strip():
            lines += ["", f"{label}'s stderr (its end):", "", "```", rep["stderr"].rstrip(), "```"]
    return lines, problems


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
    ap.add_argument("--served", action="store_true",
                    help="add fresh processes: stock with PyTorch's defaults and bagf served with BAGF_TUNE=0, "
                         "two of each")
    ap.add_argument("--child", choices=["stock", "served"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tf32", type=int, choices=[0, 1], default=0, help=argparse.SUPPRESS)  # (a child's cuDNN TF32)
    ap.add_argument("--child-timeout", type=float, default=120.0,
                    help="--served: seconds a fresh process may take to report (120)")
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child, args)
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
    doc = {"meta": meta, "plans": plans, "rows": rows, "totals": totals, "no_hooks": bare_median,
           "output_layouts": formats, "cross_inputs": crossed, "served": None}
    failed = False
    if args.served and not _cache_shared():
        lines += ["", "No fresh processes (`--served`): the cache is in memory, which a child cannot see (set "
                  "BAGF_CACHE_DIR to a writable folder)."]
        failed = True
    elif args.served:
        save(args, lines, doc)  # (what this process measured, should a child hang the call past its limit)
        own = process_report(tuned, x, args.runs)
        tf32 = cudnn_tf32()  # (this process's mode, PyTorch's default unless changed: the plans' keys hold it)
        children = [(f"{kind} child {turn}", in_fresh_process(kind, args, tf32, args.child_timeout))
                    for turn in (1, 2) for kind in ("stock", "served")]
        section, problems = served_section(own, children)
        lines += section
        doc["served"] = {"this_process": own, "children": dict(children), "tf32": tf32}
        failed = bool(problems)
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
    print("\n".join(lines) + "\n")
    save(args, lines, doc)
    return 1 if failed else 0


def save(args, lines: list[str], doc: dict) -> None:
    """eager_host_<tag>.{json,md} in ``--out`` (nothing without it)."""
    if args.out:
        tag = f"{args.tag}_{args.model}_n{args.batch}_{args.dtype}{'_nhwc' if args.channels_last else ''}"
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"eager_host_{tag}.json").write_text(json.dumps(doc, indent=1))
        (out / f"eager_host_{tag}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

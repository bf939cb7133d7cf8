"""The command line: ``python -m bagf_torch`` (installed as ``bagf-torch`` too).

* ``tune --model alexnet --batch 1,32,128 [--budget N] [--cache DIR]``: pre-tune every conv problem of the
  model at those batch sizes, with a progress bar, then print the per-layer table. Under
  ``torchrun --nproc-per-node=K -m bagf_torch tune ...`` the problems are split across K GPUs and rank 0
  writes every winner into its cache.
* ``bench --model alexnet --batch 1,32,128``: end-to-end inference, stock PyTorch vs bagf_torch, eager and
  CUDA graphs (tunes first what the cache lacks).
* ``report [--plot roofline.png]``: the per-layer table of the cache, and the roofline plot against this
  GPU's measured ceilings.
* ``cache list | export FILE | import FILE | check FILE | prune | clear``: the tuning cache. Export and import are how a
  pre-tuned cache moves to production machines; import keeps only the entries made for this machine's GPU
  and versions and says why it skipped the others.
* ``demo [--batch N]``: tune and run AlexNet's conv layers at one batch size (no GPU: runs the fallback).

``--model`` is ``alexnet`` or ``torchvision:<name>`` (any torchvision classification model, when torchvision
is installed). Errors are one line saying what to do, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (argparse prints the usage block first) and exits with 2."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def parse_batches(text: str) -> list[int]:
    """``"1,32,128"`` -> [1, 32, 128]; duplicates dropped, order kept. ValueError says what is wrong.

    >>> parse_batches("1, 32,128,32")
    [1, 32, 128]
    """
    parts = [t.strip() for t in str(text).split(",")]
    if not any(parts):
        raise ValueError("empty; give batch sizes like 1,32,128")
    out: list[int] = []
    for t in parts:
        try:
            n = int(t)
        except ValueError:
            raise ValueError(f"{text!r}: {t!r} is not a whole number; give batch sizes like 1,32,128") from None
        if n < 1:
            raise ValueError(f"{text!r}: batch size {n} must be at least 1")
        if n not in out:
            out.append(n)
    return out


def _batch_type(text: str) -> list[int]:
    try:
        return parse_batches(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def gpu_problem(what: str) -> str | None:
    """None if this process can run bagf_torch's kernels, else one line saying why and what to do (no CUDA
    build of torch, no visible GPU, no CUDA toolkit / nvcc / NVRTC, a failing extension build)."""
    import torch

    if torch.version.cuda is None:
        return (f"{what} needs a CUDA GPU, and this torch ({torch.__version__}) is a CPU-only build; install a "
                "CUDA build of torch on the GPU machine and run it there")
    if not torch.cuda.is_available():
        return (f"{what} needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); check the "
                "driver and CUDA_VISIBLE_DEVICES")
    from .jit.extension import BuildError, load

    try:
        load()
    except BuildError as e:
        return f"{what}: {str(e).splitlines()[0]}"
    return None


def _require_gpu(what: str) -> None:
    why = gpu_problem(what)
    if why is not None:
        raise UsageError(why)


def _build_model(name: str, tuned: bool):
    from .models import ModelError, build

    try:
        return build(name, tuned=tuned)
    except ModelError as e:
        raise UsageError(str(e)) from None


def _check_format(args) -> None:
    """An error (exit 2) for a dtype and memory format no kernel family computes: every layer would run ATen."""
    from .kernels import supported_formats

    want = (DTYPES[args.dtype], "nhwc" if args.channels_last else "nchw")
    if want not in supported_formats():
        tuned = ", ".join(f"{d} {'channels_last' if l == 'nhwc' else 'NCHW'}" for d, l in sorted(supported_formats()))
        raise SystemExit(f"python -m bagf_torch tune: {want[0]} {'channels_last' if args.channels_last else 'NCHW'} is "
                         f"not tuned (the kernels compute {tuned}); drop --channels-last or pick another --dtype")


def _check_model(name: str) -> None:
    from .models import ModelError, check

    try:
        check(name)
    except ModelError as e:
        raise UsageError(str(e)) from None


def _inputs(name: str, batches: list[int], device, dtype=None, channels_last: bool = False):
    """One random input per batch size, on ``device``, in ``dtype`` (default float32) and, with ``channels_last``,
    that memory format: as the model will be called."""
    import torch

    from .models import input_size

    size = input_size(name)
    g = torch.Generator().manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return [torch.randn(n, 3, size, size, generator=g).to(device, dtype or torch.float32).contiguous(memory_format=fmt)
            for n in batches]


DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
"""``--dtype`` spellings -> torch dtype names."""


def tf32_mode(flag: str | None) -> bool:
    """``--tf32 on|off``, or this process's cuDNN TF32 flag when not given (PyTorch's default is on)."""
    from .problem import cudnn_tf32

    return cudnn_tf32() if flag is None else flag == "on"


def _format_words(dtype, channels_last: bool, tf32: bool, flag: str | None) -> str:
    """The dtype and memory format a tune command tunes, with the TF32 mode for float32."""
    import torch

    fmt = ", channels_last" if channels_last else ""
    if dtype is torch.float32:
        return f"fp32{fmt}, {_tf32_words(tf32, flag)}"
    return f"{'fp16' if dtype is torch.float16 else 'bf16'}{fmt}"


def _tf32_words(tf32: bool, flag: str | None) -> str:
    """Which TF32 mode, and why: plans tuned in one mode are not used by callers in the other."""
    if flag is not None:
        return f"TF32 {flag}, as asked"
    return (f"TF32 {'on' if tf32 else 'off'}, this process's torch.backends.cudnn.allow_tf32; plans serve callers with "
            f"the same flag, --tf32 {'off' if tf32 else 'on'} tunes for the others")


# ---- tune ----------------------------------------------------------------------------------------------

def _process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): the interpreter's start and the imports
    before a command's own clock starts."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _run_meta(args, tf32: bool, wall_s: float, device: int | None = None, **phases: float | None) -> dict:
    """What a tune report's JSON says of the run that made it: the machine and versions (``env``: the environment
    every plan's cache key holds, of ``device``), the date, the command line, the settings it tuned with, the
    command's wall time (from its start, Python's and torch's import excluded, to the report) and ``phases``
    (``startup_s``: the process's start and imports before that; then ``check_s``: the model's name checked,
    ``gpu_init_s``: the host extension's load and the GPU's context, ``build_s``: building the model and moving
    it to the GPU, ``inputs_s``: the example inputs and the first line printed)."""
    import datetime
    import platform

    import torch

    from . import runtime, settings

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "env": None if device is None else runtime.get().device(device).env,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "python": platform.python_version(), "command": " ".join(["python -m bagf_torch", *sys.argv[1:]]),
            "model": args.model, "batch": list(args.batch), "tf32": tf32,
            "seconds_per_problem": args.seconds if args.seconds is not None else settings.budget_seconds(),
            "evaluations_per_problem": args.budget if args.budget is not None else settings.budget_evaluations(),
            "strategy": args.strategy or settings.strategy(), "wall_seconds": wall_s,
            "dtype": DTYPES[getattr(args, "dtype", "float32")],
            "channels_last": bool(getattr(args, "channels_last", False)),
            "even": bool(getattr(args, "even", False)), **phases}


def tune_command(args) -> int:
    import torch

    from . import distributed
    from .pretune import tune_model

    t0 = time.perf_counter()
    startup_s = _process_age_s()
    _check_model(args.model)  # an unknown model is reported before anything else
    _check_format(args)
    check_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    started, local_rank = distributed.init_from_env()
    try:
        _require_gpu("tune")  # loads the host extension
        # The search strategy's imports (Ax's: about 5 s) start now, beside the GPU's start, the model's build and
        # discovery; the tuner waits for them before it times anything.
        from . import settings
        from .tuning import strategies

        strategies.preload(args.strategy or settings.strategy())
        torch.cuda.set_device(local_rank)
        torch.cuda.init()
        gpu_init_s = time.perf_counter() - t1
        tf32 = tf32_mode(args.tf32)
        torch.backends.cudnn.allow_tf32 = tf32  # part of every problem key: tune the mode you will run
        t1 = time.perf_counter()
        # built on the CPU, as the user builds it (a model whose layer widths come from float arithmetic, as
        # torchvision's RegNets', must get the same shapes), then moved
        dtype = getattr(torch, DTYPES[args.dtype])
        model = _build_model(args.model, tuned=True).to(dtype).cuda().eval()
        if args.channels_last:
            model = model.to(memory_format=torch.channels_last)
        build_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        xs = _inputs(args.model, args.batch, torch.device("cuda", local_rank), dtype, args.channels_last)
        ctx = distributed.Context.current()
        if ctx.rank == 0:
            print(f"pre-tuning {args.model} at N={','.join(map(str, args.batch))} on "
                  f"{torch.cuda.get_device_name()}{f' and {ctx.world_size - 1} more ranks' if ctx.world_size > 1 else ''}"
                  f" ({_format_words(dtype, args.channels_last, tf32, args.tf32)}); cache {_cache_path()}", flush=True)
        inputs_s = time.perf_counter() - t1
        report = tune_model(model, xs, budget=args.budget, seconds=args.seconds, strategy=args.strategy,
                            seed=args.seed, progress=None if args.progress else False, even=args.even)
        if ctx.rank == 0:
            if args.json:  # (before the table: a reader of stdout that has gone, | head, must not lose it)
                report.meta = _run_meta(args, tf32, time.perf_counter() - t0, device=local_rank,
                                        startup_s=startup_s, check_s=check_s, gpu_init_s=gpu_init_s,
                                        build_s=build_s, inputs_s=inputs_s)
                report.save(args.json)
            print(report)
            if args.json:
                print(f"report written to {args.json}")
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


# ---- bench ---------------------------------------------------------------------------------------------

def bench_command(args) -> int:
    import torch

    from . import bench
    from .pretune import tune_model

    _build_model(args.model, tuned=False)
    _check_format(args)
    _require_gpu("bench")
    # Both models are timed in one precision (bench.fp32): strict fp32, or cuDNN's TF32 with --tf32 on; the plans
    # it tunes and uses are that mode's.
    tf32 = args.tf32 == "on"
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    stock, tuned = bench.stock_and_tuned(lambda: _build_model(args.model, tuned=False))
    dtype = getattr(torch, DTYPES[args.dtype])
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    stock, tuned = (m.to(dtype).to(memory_format=fmt) for m in (stock, tuned))
    xs = _inputs(args.model, args.batch, torch.device("cuda"), dtype, args.channels_last)
    mode = ((f"{'fp32 with cuDNN TF32 on' if tf32 else 'strict fp32 (TF32 off)'}" if dtype is torch.float32
             else DTYPES[args.dtype]) + (", channels_last" if args.channels_last else ""))
    print(f"{args.model} inference on {torch.cuda.get_device_name()}, {mode}; plans from "
          f"{_cache_path()} (tuning what is missing first)", flush=True)
    report = tune_model(tuned, xs, budget=args.budget, progress=None)
    if report.tuned:
        print(report)
    results = {}
    children = bench.CHILDREN if args.children is None else args.children
    for x in xs:
        n = x.shape[0]
        print(f"N={n}: timing this process's variants, then {children} fresh process(es) of each kind "
              "(--children)", flush=True)
        results[n] = bench.run_variants(stock, tuned, x, runs=args.runs, graphs=not args.no_graphs,
                                        stock_model=args.model, tf32=tf32,
                                        channels_last=args.channels_last, children=children)
        s = bench.speedups(results[n])
        print(f"N={n}: stock {results[n]['stock']['median_us']:.1f} us, bagf {results[n]['bagf']['median_us']:.1f} us"
              f" ({s['bagf_vs_stock']:.2f}x)" + ("" if args.no_graphs else
              f"; CUDA graph: stock {results[n]['stock_graph']['median_us']:.1f} us, bagf "
              f"{results[n]['bagf_graph']['median_us']:.1f} us ({s['bagf_graph_vs_stock_graph']:.2f}x)"), flush=True)
    print()
    print("\n".join(bench.table(results)))
    each = bench.children_lines(results)
    if each:
        print("\nEach fresh process's median us, in the order they ran (the table shows the median process), and each "
              "served process's ratio of its stock copy to the served model:")
        print("\n".join(each))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "gpu": torch.cuda.get_device_name(), "tf32": tf32,
                       "dtype": DTYPES[args.dtype], "channels_last": args.channels_last, "results": results,
                       "speedups": {n: bench.speedups(r) for n, r in results.items()}}, f, indent=1)
        print(f"results written to {args.json}")
    return 0


# ---- report --------------------------------------------------------------------------------------------

def report_command(args) -> int:
    from . import report
    from .cache import Cache

    ceilings = None
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("report --plot needs matplotlib: pip install matplotlib (or 'bagf_torch[plot]')")
        given = (args.peak_tflops, args.bandwidth_gbs)
        if any(v is not None for v in given):
            if None in given:
                raise UsageError("give both --peak-tflops and --bandwidth-gbs, or neither (then they are measured)")
            ceilings = report.Ceilings(args.peak_tflops * 1e12, args.bandwidth_gbs * 1e9, device="",
                                       how=f"given: {args.peak_tflops} TFLOP/s, {args.bandwidth_gbs} GB/s")
        else:
            import torch

            if not torch.cuda.is_available():
                raise UsageError("report --plot measures this GPU's ceilings and no CUDA GPU is visible; run it "
                                 "on the GPU, or give --peak-tflops and --bandwidth-gbs")
    with Cache.for_dir(_cache_dir()) as cache:
        plans = cache.plans()
    if args.gpu:
        plans = [p for p in plans if str(p["env"].get("gpu")) == args.gpu]
    print(f"{len(plans)} plans in {_cache_path()}")
    print(report.plans_table(plans))
    if args.plot:
        if not plans:
            raise UsageError(f"no plans in {_cache_path()} to plot; run python -m bagf_torch tune --model alexnet "
                             "--batch 1,32,128 first")
        if ceilings is None:
            ceilings = report.measure_ceilings()
            print(f"ceilings on {ceilings.device}: fp32 {ceilings.flops / 1e12:.1f} TFLOP/s (torch.mm, TF32 off), "
                  f"copy {ceilings.bandwidth / 1e9:.0f} GB/s")
        report.plot_roofline(report.points_from_plans(plans), ceilings, args.plot)
        others = sum(1 for p in plans if isinstance(p.get("problem"), dict)
                     and (p["problem"].get("dtype", "float32") != "float32" or p["problem"].get("tf32", False)))
        print(f"roofline written to {args.plot}" + (f" ({others} TF32-mode or float16/bfloat16 plans are in the table, "
                                                       "not in the plot: its ceilings are strict fp32's)" if others else ""))
    return 0


# ---- cache ---------------------------------------------------------------------------------------------

def cache_command(action: str, path: str | None, trust_cubins: bool = False, other_versions: bool = False,
                  other_gpus: bool = False, keep_days: float = 30.0) -> int:
    """``cache list | export FILE | import FILE [--trust-cubins] | check FILE | prune | clear``.

    ``prune`` deletes what is not used (``Cache.prune``: trials of keys with no plan, cubins no plan names that
    are older than ``--days``; with ``--other-versions`` the plans of other versions on this GPU, with
    ``--other-gpus`` those of other GPUs) and prints what it freed.

    ``check`` reads an export file and says what import would refuse (structure, types, the families'
    spaces, recomputed keys), on any machine: it needs no GPU; exit status 1 when some entry would be
    skipped. ``import`` runs the same checks first and reports them before it needs this machine's GPU
    (to compare each plan's env, and to rebuild the winners' kernels from our own sources, the default;
    ``--trust-cubins`` takes the file's cubins instead, see docs/cache.md), then runs each plan once against
    float64 there and stores only those that pass.
    """
    from .cache import Cache, CacheUnavailable
    from .cache_io import local_checker, local_compiler, read_export
    from .kernels import FAMILIES, complete_config
    from .problem import ConvProblem

    document = None
    if action in ("import", "check"):
        if not path:
            raise UsageError(f"cache {action} needs a FILE (an export written by python -m bagf_torch cache export)")
        try:
            document = read_export(path)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if action == "check":
        print(f"{path}: {len(document.plans)} plans pass the checks, {len(document.problems)} would be skipped")
        for line in document.problems:
            print(f"  would skip {line}")
        for line in document.cubin_problems:
            print(f"  unusable cubin entry (only --trust-cubins reads the file's cubins): {line}")
        print("  (import also compares each plan's env with the machine's, which needs its GPU)")
        return 1 if document.problems else 0
    early: list[str] = []
    if action == "import":
        # What the file itself gets wrong is reported before anything needs a GPU, so a CPU machine can
        # tell a damaged file from a missing GPU.
        early, document.problems = document.problems, []
        for line in early:
            print(f"  skipped {line}")
        env = this_machine_env()  # before opening anything: a refused import leaves the cache untouched
    elif action == "prune" and (other_versions or other_gpus):
        env = this_machine_env("cache prune --other-versions / --other-gpus")
    cache = Cache.for_dir(_cache_dir())
    try:
        if action == "list":
            plans = cache.plans()
            print(f"{len(plans)} plans in {cache.path}")
            print(f"{'key':<16} {'gpu':<20} {'problem':<44} {'plan':<48} {'us':>9} {'cuDNN us':>9} {'evals':>5}")
            for p in sorted(plans, key=lambda p: p["created"]):
                fam = FAMILIES.get(p["family"])
                plan = "aten (cuDNN)" if p["config"] is None or fam is None else \
                    fam.name(complete_config(p["family"], p["config"]))
                problem = ConvProblem.from_dict(p["problem"]).short()  # plans() checked every row
                print(f"{p['key'][:16]:<16} {str(p['env'].get('gpu', '?'))[:20]:<20} {problem:<44} {plan:<48} "
                      f"{p['time_us']:9.1f} {p['aten_us'] or float('nan'):9.1f} {p['evaluations']:5d}")
        elif action == "export":
            try:
                n = cache.export(path)
            except OSError as e:
                raise UsageError(f"cannot write {path}: {e.strerror or e}; choose a writable path") from None
            print(f"exported {n} plans from {cache.path} to {path}")
        elif action == "import":
            compiler = checker = None
            if document.plans:
                try:
                    compiler = local_compiler(cache)
                except Exception as e:  # noqa: BLE001 - any failure to set up NVRTC here is one line
                    raise UsageError(f"cannot rebuild the plans' kernels here ({str(e).splitlines()[0][:200]}); "
                                     f"fix the CUDA setup, or import with --trust-cubins to take the file's "
                                     f"cubins as they are") from None
                checker = local_checker(compiler)
            try:
                n, skipped = cache.import_(document, env, compiler=compiler, checker=checker,
                                           trust_cubins=trust_cubins)
            except (ValueError, CacheUnavailable) as e:
                raise UsageError(str(e)) from None
            print(f"imported {n} plans from {path} into {cache.path}; skipped {len(early) + len(skipped)}"
                  + (" (kernels taken from the file: --trust-cubins)" if trust_cubins else
                     " (kernels rebuilt here from our own sources)" if n else ""))
            for line in skipped:
                print(f"  skipped {line}")
            if (early or skipped) and not n:
                print("  (a plan is only valid on the GPU, driver, CUDA, torch and bagf_torch versions it was tuned "
                      "with; pre-tune on a machine like this one, or run python -m bagf_torch tune here)")
        elif action == "prune":
            try:
                got = cache.prune(env if other_versions or other_gpus else None, other_versions=other_versions,
                                  other_gpus=other_gpus, keep_days=keep_days)
            except CacheUnavailable as e:
                raise UsageError(str(e)) from None
            asked = (("versions on this GPU", other_versions), ("GPUs", other_gpus))
            which = " and ".join(w for w, on in asked if on)
            print(f"pruned {cache.path}: {got['plans']} plans of other {which or 'environments (none asked for)'}, "
                  f"{got['trials']} trials of keys "
                  f"without a plan, {got['cubins']} cubins no plan names older than {keep_days:g} days; "
                  f"{got['bytes_before'] / 1e6:.1f} MB -> {got['bytes_after'] / 1e6:.1f} MB")
        elif action == "clear":
            try:
                n = cache.clear()
            except CacheUnavailable as e:
                raise UsageError(str(e)) from None
            print(f"cleared {cache.path} ({n} plans)")
    finally:
        cache.close()
    return 0


def this_machine_env(what: str = "cache import") -> dict:
    """The environment import validates against (GPU, versions, kernel hash); UsageError when it cannot be
    known here."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"{what} needs this machine's CUDA GPU to check entries against it "
                         "(torch.cuda.is_available() is False); run it on the machine that will use the cache")
    from .jit.extension import BuildError, environment

    try:
        return environment(torch.cuda.current_device())
    except BuildError as e:
        raise UsageError(str(e).splitlines()[0]) from None


# ---- demo ----------------------------------------------------------------------------------------------

def demo(batch: int, budget: int | None) -> int:
    import torch

    import bagf_torch
    from bagf_torch import runtime
    from bagf_torch.kernels import family_name

    if budget is not None:
        os.environ["BAGF_BUDGET"] = str(budget)
    model = bagf_torch.convert(bagf_torch.models.alexnet(tuned=False).features).eval()
    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"No CUDA GPU here ({why}): nothing to tune. Running AlexNet's conv layers through the ATen "
              "fallback instead.")
        x = torch.randn(batch, 3, 224, 224)
        t0 = time.perf_counter()
        with torch.no_grad():
            y = model(x)
        print(f"CPU forward of N={batch}: output {tuple(y.shape)} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        return 0
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False  # our kernels are strict fp32: compare like with like
    model = model.cuda()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    print(f"Tuning AlexNet's 5 conv layers at N={batch} on {torch.cuda.get_device_name()} "
          "(first call tunes; later calls and processes reuse the cache)...", flush=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(x)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    rt = runtime.get()
    print(f"\n{'layer':<32} {'cuDNN us':>9} {'tuned us':>9} {'speedup':>8} {'trials':>7} {'tune s':>7}  plan")
    for r in rt.results:
        plan = "aten (cuDNN)" if r.config is None else family_name(r.family, r.config)
        print(f"{r.problem.short():<32} {r.aten_us:9.1f} {r.time_us:9.1f} {r.speedup:7.2f}x "
              f"{r.evaluations:7d} {r.seconds:7.1f}  {plan}")
    if not rt.results:
        print(f"(all {rt.stats['cache_hits']} layers came from the cache in {_cache_dir()}: no tuning)")
    print(f"\nfirst forward (tuning included): {first:.1f} s")
    return 0


# ---- the parser ----------------------------------------------------------------------------------------

def _cache_dir():
    from . import settings

    return settings.cache_dir()


def _cache_path():
    from .cache import default_cache_path

    return default_cache_path(_cache_dir())


def settings_dir() -> str:
    return str(_cache_dir())


def build_parser() -> argparse.ArgumentParser:
    from . import settings

    ap = _Parser(prog="python -m bagf_torch", description="bagf_torch: auto-tuned CUDA convolutions")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", metavar="DIR", help="cache directory (default: BAGF_CACHE_DIR or ~/.cache/bagf_torch)")
    models = argparse.ArgumentParser(add_help=False)
    models.add_argument("--model", default="alexnet", help="alexnet, or torchvision:<name> (default alexnet)")
    models.add_argument("--batch", type=_batch_type, default=[1, 32, 128], metavar="LIST",
                        help="comma-separated batch sizes (default 1,32,128)")
    models.add_argument("--budget", type=int, default=None, help="evaluations per problem (default BAGF_BUDGET)")
    models.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="the dtype the model runs in (default float32); float16 and bfloat16 are tuned in NCHW and "
                        "channels_last; dtype and memory format are part of every plan's key")
    models.add_argument("--channels-last", action="store_true",
                   help="channels_last (NHWC) inputs and weights, as model.to(memory_format=torch.channels_last) "
                        "runs (float16 and bfloat16)")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    t = sub.add_parser("tune", parents=[common, models], help="pre-tune a model's conv layers, print the table")
    t.add_argument("--seconds", type=float, default=None,
                   help="tuning seconds per problem (default BAGF_TIME_BUDGET); a problem with less than an even share "
                        "of its forward's stock conv time gets less in proportion, at least 2 s (see --even)")
    t.add_argument("--even", action="store_true",
                   help="give every problem the full --seconds, whatever its share of the forward's conv time")
    t.add_argument("--strategy", choices=list(settings.STRATEGY_NAMES), default=None)
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--tf32", choices=["on", "off"], default=None,
                   help="the cuDNN TF32 mode to tune for; it is part of every plan's key, so tune the mode the model "
                        "will run in (default: this process's torch.backends.cudnn.allow_tf32, PyTorch's default on)")
    t.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    t.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    b = sub.add_parser("bench", parents=[common, models], help="end-to-end inference: stock vs bagf_torch")
    b.add_argument("--runs", type=int, default=200, help="timed runs per variant (median reported)")
    b.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph variants")
    b.add_argument("--children", type=int, default=None, metavar="N",
                   help="fresh processes of each kind, stock and served, alternating; each variant timed in them "
                        "shows its median process (default 3)")
    b.add_argument("--tf32", choices=["on", "off"], default="off",
                   help="cuDNN's TF32 for both models (on: PyTorch's default; the plans are TF32-mode plans, tuned "
                        "first where missing) or strict fp32 (off, the default)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")

    r = sub.add_parser("report", parents=[common], help="per-layer table from the cache, roofline plot")
    r.add_argument("--plot", metavar="PNG", help="write the roofline plot here (needs matplotlib)")
    r.add_argument("--gpu", help="only plans tuned on this GPU name")
    r.add_argument("--peak-tflops", type=float, default=None, help="fp32 ceiling instead of measuring it")
    r.add_argument("--bandwidth-gbs", type=float, default=None, help="memory ceiling instead of measuring it")

    c = sub.add_parser("cache", parents=[common], help="list, export, import, prune or clear the tuning cache")
    c.add_argument("action", choices=["list", "export", "import", "check", "prune", "clear"],
                   help="check FILE: what import would refuse, without a GPU; prune: delete what is not used (old "
                        "trials of keys with no plan, old cubins no plan names; plans of other versions or GPUs "
                        "when asked)")
    c.add_argument("file", nargs="?", help="JSON file for export / import / check")
    c.add_argument("--trust-cubins", action="store_true",
                   help="import: take the file's cubins as they are instead of rebuilding the kernels here "
                        "(only for files from a party you trust; see docs/cache.md)")
    c.add_argument("--other-versions", action="store_true",
                   help="prune: also the plans tuned on this GPU under other versions (torch, bagf_torch, CUDA, "
                        "driver); kept by default: the cache directory is shared by every environment of a user")
    c.add_argument("--other-gpus", action="store_true",
                   help="prune: also the plans of other GPUs (kept by default: a cache directory may be shared)")
    c.add_argument("--days", type=float, default=30.0,
                   help="prune: keep cubins no plan names that were compiled within this many days (default 30)")

    d = sub.add_parser("demo", parents=[common], help="tune and run AlexNet's conv layers at one batch size")
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--budget", type=int, default=None, help="evaluations per layer (default BAGF_BUDGET)")
    ap.subcommands = {"tune": t, "bench": b, "report": r, "cache": c, "demo": d}
    return ap


def main(argv=None) -> int:
    from .settings import DAY_S, SettingError

    ap = build_parser()
    args = ap.parse_args(argv)
    sub = ap.subcommands[args.cmd]  # for errors found after parsing
    if args.cache:
        os.environ["BAGF_CACHE_DIR"] = args.cache
    if getattr(args, "budget", None) is not None and args.budget < 1:
        sub.error(f"--budget must be at least 1, got {args.budget}")
    if getattr(args, "seconds", None) is not None and not 0 < args.seconds <= DAY_S:
        sub.error(f"--seconds must be a number of seconds above 0 and at most a day, got {args.seconds}")
    if args.cmd == "cache":
        if args.action in ("export", "import") and not args.file:
            sub.error(f"cache {args.action} needs a FILE")
        if args.action == "import" and not os.path.isfile(args.file):
            sub.error(f"no such file: {args.file}")
        if not (math.isfinite(args.days) and args.days >= 0):
            sub.error(f"--days must be a number of at least 0, got {args.days}")
    if args.cmd == "bench" and args.runs < 1:
        sub.error(f"--runs must be at least 1, got {args.runs}")
    if args.cmd == "bench" and args.children is not None and args.children < 1:
        sub.error(f"--children must be at least 1, got {args.children}")
    if getattr(args, "seed", None) is not None and args.seed < 0:
        sub.error(f"--seed must be at least 0 (as BAGF_SEED), got {args.seed}")
    for flag in ("peak_tflops", "bandwidth_gbs"):
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            sub.error(f"--{flag.replace('_', '-')} must be a number above 0, got {value}")
    # where the results go, checked before the work that makes them (a tuning, a benchmark, a measured ceiling)
    for flag, suffixes in (("json", None), ("plot", (".png", ".pdf", ".svg", ".eps", ".jpg", ".jpeg"))):
        path = getattr(args, flag, None)
        if path:
            why = _output_refused(path, suffixes)
            if why:
                sub.error(f"--{flag} {path}: {why}")
    if args.cmd == "demo" and args.batch < 1:
        sub.error(f"--batch must be >= 1, got {args.batch}")
    try:
        if args.cmd == "tune":
            return tune_command(args)
        if args.cmd == "bench":
            return bench_command(args)
        if args.cmd == "report":
            return report_command(args)
        if args.cmd == "cache":
            return cache_command(args.action, args.file, trust_cubins=args.trust_cubins,
                                 other_versions=args.other_versions, other_gpus=args.other_gpus, keep_days=args.days)
        return demo(args.batch, args.budget)
    except (UsageError, SettingError) as e:  # a bad BAGF_* value is the user's to fix, like a bad argument
        print(f"bagf_torch: {e}", file=sys.stderr)
        return EXIT_USAGE


def _output_refused(path: str, suffixes: tuple[str, ...] | None) -> str | None:
    """Why a result file cannot be written at ``path`` (its folder missing or not writable, a folder in its
    place, a suffix not among ``suffixes``), or None."""
    target = Path(path).expanduser()
    if suffixes is not None and target.suffix.lower() not in suffixes:
        return f"the file name must end in {', '.join(suffixes)}"
    if target.is_dir():
        return "is a folder; give a file name"
    if target.exists():  # (written in place: a file, or a device such as /dev/stdout)
        return None if os.access(target, os.W_OK) else "cannot be written (permissions)"
    folder = target.parent
    if not folder.is_dir():
        return f"the folder {folder} does not exist"
    return None if os.access(folder, os.W_OK) else "cannot be written (permissions)"


def run(argv=None) -> None:
    """``main`` as a program (``python -m bagf_torch``, the ``bagf-torch`` command): its status, by ``os._exit`` once
    the runtime is closed (isolated workers stopped, the cache closed), the log handlers and output streams flushed.

    Python's own shutdown would then only tear down modules and CUDA's context: it took 1.4-2.2 s after a tuning on
    the H200's host (``tune`` on ResNet-18: the command's last 1.37 s, 0.15 s this way; benchmarks/results/README.md),
    and a daemon thread still inside torch then could abort the process (``shutdown``). No atexit handler runs, so
    nothing a command does may rely on one. Under a tracer, a profiler or coverage (which write their results at exit)
    and when ``main`` raises, the process ends the usual way."""
    try:
        code = main(argv)
    except BrokenPipeError:  # the reader of stdout has gone (| head): nothing more can reach it, and no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 1  # (what Python's own handling of EPIPE returns)
    if sys.gettrace() is not None or sys.getprofile() is not None or "coverage" in sys.modules:
        sys.exit(code)
    status = 0 if code is None else code if isinstance(code, int) else 1
    try:
        from . import runtime

        runtime.reset()
    except BaseException:  # noqa: BLE001 - reported, and the status says so
        import traceback

        traceback.print_exc()
        status = status or 1
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # (started with the stream closed)
            continue
        try:
            stream.flush()
        except BrokenPipeError:  # the reader has gone: nothing more can reach it
            pass
        except (OSError, ValueError):
            status = status or 120  # what Python's own shutdown returns when a flush fails
    try:  # C's stdio buffers too (a library's own prints to stdout)
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):
        pass
    os._exit(status)


if __name__ == "__main__":
    run()

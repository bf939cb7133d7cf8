"""End-to-end inference timing of a whole model: stock PyTorch against bagf_torch, eager and CUDA graphs.

Shared by ``python -m bagf_torch bench`` and ``benchmarks/bench_alexnet.py``. Both models run in one dtype and
memory format (the caller's). In fp32, convs and matmuls are strict (TF32 off, both sides), or with ``tf32``
cuDNN's TF32 is on for convs as PyTorch's default has it (matmuls stay strict, also PyTorch's default), and the
tuned model's plans are the ones tuned in that mode (one precision on both sides either way). One forward is timed
as the GPU sees it: CUDA events recorded before and after the call on an idle stream (a synchronize between runs), so
the launch gaps of eager mode are in the time (at N=1 they are most of it) and the synchronize is not. Median and
quartiles of many runs, after warm-up.

Variants (each a function from the input to the output):

* ``stock``            the model with nn.Conv2d, default settings (cudnn.benchmark off), timed in fresh CHILD
                       processes (below)
* ``stock_benchmark``  the same with cudnn.benchmark on
* ``bagf``             the same weights with TunedConv2d, pre-tuned plans; layers whose plan is ATen run
                       cuDNN in benchmark mode, the mode the tuner compared them in
* ``bagf_served``      TunedConv2d as a serving process runs it: fresh CHILD processes with BAGF_TUNE=0 and
                       PyTorch's default flags, its plans loaded from the cache (the tuner and Ax never imported);
                       layers whose plan is ATen run cuDNN with benchmark off there, as a default user's do. Each
                       call must run what it runs in ``bagf`` (our kernel or torch's conv), else the run stops with
                       the calls that differ (a plan missing from the cache would time torch's conv unnoticed)
* ``stock_in_served``  the stock model with PyTorch's defaults inside each served CHILD, interleaved with
                       ``bagf_served`` (below)
* ``stock_graph`` / ``bagf_graph`` / ``bagf_served_graph`` / ``stock_in_served_graph``  the stock / bagf / served /
                       served child's stock forward captured once in a CUDA graph and replayed
* ``compile_max_autotune``  ``torch.compile(stock, mode="max-autotune")`` (benchmarks/bench_alexnet.py only;
                       its compile time is reported)

Why a child process for the benchmark-off variants: torch keeps one cuDNN algorithm per conv shape per process,
and the first call picks it. A heuristic pick (benchmark off) is cached and reused by later benchmark-mode
calls, so timing ``stock`` first made ``stock_benchmark`` -- and bagf's ATen-planned layers -- run the
heuristic algorithm too (AlexNet N=128 on the H200: conv3 1024 us instead of 415-450 us, conv4 1362 instead
of 490; benchmarks/results/cudnn_contexts_h200.json). So this process runs only benchmark-mode variants,
``stock_benchmark`` first, and ``stock`` / ``stock_graph`` come from ``python -m bagf_torch.bench --child stock``
(a fresh process whose first conv calls are benchmark-off, as a default PyTorch user's are).

Why a child for ``bagf_served`` as well: eager calls at small batch are bound by the host, and their time depends on
the process (which modules it has loaded, what its allocator and garbage collector hold, what ran before): in one
TF32 AlexNet run at N=1 stock took 618 us in its fresh child and 558 us in benchmark mode in the tuning process,
bagf 362 us in the tuning process and 549 us served. ``stock`` (a fresh process) against ``bagf_served`` (a fresh
process) is the comparison a user who pre-tunes and then serves sees.

Why a stock copy inside each served child (``stock_in_served``, ``stock_in_served_graph``): on the device machines
the host's speed moves from process to process by up to 2x, for a process's whole life (``CHILDREN``), so two
fresh processes' eager times compare two hosts as much as two forwards. The served child times a stock copy of the
model with PyTorch's defaults interleaved with the served one, and the ratio of the two in that one process (its
``same_process_ratio``, the median over the served children) is free of the host's speed. (Not of everything a
process holds: the copy runs beside bagf_torch's modules and the served model, as the paragraph above says such
things move an eager time.)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import log
from .problem import cudnn_conv_mode, memory_layout


def gpu_tag(device: int = 0) -> str:
    """The GPU part of a result file's name: "gh200", "h200", "h100" (any H100), else the device's name in lower-case letters and
    digits; "cpu" where no CUDA device is visible. (A fixed default named an H100's results after the H200.)"""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for tag in ("gh200", "h200", "h100"):  # (a GH200's GPU is its own: not named after the H200)
        if tag in name:
            return tag
    return "".join(c for c in name.replace("nvidia", "") if c.isalnum()) or "gpu"


def mode_tag(dtype: str = "float32", channels_last: bool = False, tf32: bool = False) -> str:
    """The precision part of a result file's name: "" for strict fp32 NCHW, else "_tf32", "_bf16_nhwc", "_fp16_nchw"
    ..., so that a run in one mode does not overwrite another mode's results on the same GPU."""
    short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[dtype]
    if dtype == "float32":
        return ("_tf32" if tf32 else "") + ("_nhwc" if channels_last else "")
    return f"_{short}_{'nhwc' if channels_last else 'nchw'}"


@contextlib.contextmanager
def fp32(benchmark: bool, tf32: bool = False):
    """fp32 convs with cuDNN's TF32 as ``tf32`` says and strict fp32 matmuls, cudnn.benchmark as given; restores
    the previous flags."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with cudnn_conv_mode(enabled=True, benchmark=benchmark, deterministic=False, tf32=tf32):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


@dataclass
class Timing:
    median_us: float
    p25_us: float
    p75_us: float
    runs: int

    def as_dict(self) -> dict:
        return {"median_us": self.median_us, "p25_us": self.p25_us, "p75_us": self.p75_us, "runs": self.runs}


def time_samples(fn: Callable[[], object], runs: int) -> list[float]:
    """GPU microseconds of each of ``runs`` calls of ``fn``, each from an idle stream (no warm-up)."""
    stream = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return times


def summary(times: list[float]) -> Timing:
    """Median and quartiles of ``times``."""
    q = statistics.quantiles(times, n=4) if len(times) >= 4 else [min(times), 0, max(times)]
    return Timing(statistics.median(times), q[0], q[2], len(times))


def time_forward(fn: Callable[[], object], runs: int = 200, warmup: int = 20) -> Timing:
    """GPU time of one call of ``fn`` from an idle stream: median and quartiles over ``runs``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return summary(time_samples(fn, runs))


ROUNDS = 10
"""Rounds of ``time_interleaved``: each variant's runs are spread over this many turns."""

CHILDREN = 3
"""Fresh processes of each kind (stock, served) that ``run_variants`` times by default. A host-bound eager forward's
time spreads widely from process to process: on the device machines (virtual ones) identical fresh processes' eager
AlexNet at N = 1 differed by up to 2.1x, running the same functions, every one of them slower in the slow process
(the repository's benchmarks/results/README.md). An odd count has a middle process."""


def time_interleaved(variants: dict[str, tuple[Callable[[], object], Callable[[], object]]], runs: int,
                     warmup: int = 20, rounds: int = ROUNDS) -> dict[str, Timing]:
    """GPU time of one call of each variant, interleaved: {name: (fn, context)}, each timed ``runs`` times in all, in
    ``rounds`` turns that go round the variants (each turn inside ``context()``, e.g. its cuDNN flags, after two
    untimed calls), so that a clock or thermal drift during the run reaches every variant alike; the order rotates
    from turn to turn, so that no variant always follows the same one (its caches, its clocks). Median and quartiles
    of each variant's pooled times. ``warmup`` untimed calls of each first."""
    for fn, context in variants.values():
        with context():
            for _ in range(warmup):
                fn()
    torch.cuda.synchronize()
    rounds = max(1, min(rounds, runs))
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        share = runs // rounds + (r < runs % rounds)
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, context = variants[name]
            with context():
                fn()
                fn()
                times[name] += time_samples(fn, share)
    return {name: summary(t) for name, t in times.items()}


def graphed(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """``forward(x)`` captured in a CUDA graph: returns (replay, static output). Warm-up runs on a side
    stream first, as torch.cuda.graphs requires (lazy initialisation, cuDNN's algorithm search)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(x)
    return graph.replay, out


def stock_and_tuned(build: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(stock, bagf) copies of one model with the same weights, on the GPU, in eval mode."""
    from .nn import convert

    torch.manual_seed(seed)
    stock = build().cuda().eval()
    tuned = convert(copy.deepcopy(stock)).eval()
    return stock, tuned


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: how far one variant's logits are from the stock ones."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_variants(stock: nn.Module, tuned: nn.Module, x: torch.Tensor, runs: int, graphs: bool = True,
                 compile_max_autotune: bool = False, stock_model: str | None = None, tf32: bool = False,
                 channels_last: bool | None = None, frozen: bool = False, children: int = CHILDREN) -> dict:
    """Time every variant on input ``x`` (this process's variants interleaved, ``time_interleaved``: ``runs`` each,
    in turns); returns {variant: {median_us, ..., max_rel_diff}} and, with
    ``compile_max_autotune``, its ``compile_seconds``. The tuned model must be pre-tuned for ``x``'s shape
    (otherwise its first warm-up call tunes).

    ``stock_model`` (a model name ``models.build`` takes, e.g. "alexnet"): the benchmark-off variants (``stock``,
    ``stock_graph``) and the served ones (``bagf_served``, ``bagf_served_graph``) are timed in child processes
    (see the module docstring), in ``x``'s dtype and in channels_last as ``channels_last`` says (None: as ``x``'s
    strides say); no served variant when the cache is in memory (a child cannot see its plans). A child times its
    own variants interleaved, apart from this process's turns: ratios between this process's variants and a child's
    are not interleaved, and a served child's ratio to its stock copy is (``same_process_ratio``);
    ``children`` fresh processes of each kind, alternating, and each of their variants is its median child's
    (``time_in_children``). None:
    ``stock`` and ``stock_graph`` run here, first called AFTER every benchmark-mode variant, so they do not poison the
    others' cuDNN choice -- but they then inherit benchmark mode's algorithms and are not what a default PyTorch
    process runs -- and there is no served variant. ``tf32``: every variant with cuDNN's TF32 on (``fp32``); the
    tuned model's plans must be TF32-mode plans. ``frozen``: the served model's weights are frozen too
    (``freeze_weights``), as the tuned model's are."""
    out: dict = {}
    with torch.no_grad():
        with fp32(benchmark=True, tf32=tf32):
            ref = stock(x)
        variants: list[tuple[str, bool, Callable[[], Callable[[], torch.Tensor]]]] = [
            ("stock_benchmark", True, lambda: lambda: stock(x)),
            ("bagf", True, lambda: lambda: tuned(x)),
        ]
        if graphs:
            variants += [("stock_benchmark_graph", True, lambda: _graph_call(stock, x, out, "stock_benchmark_graph")),
                         ("bagf_graph", True, lambda: _graph_call(tuned, x, out, "bagf_graph"))]
        if compile_max_autotune:
            variants.append(("compile_max_autotune", True, lambda: _compiled_call(stock, x, out)))
        if stock_model is None:
            variants.append(("stock", False, lambda: lambda: stock(x)))
            if graphs:
                variants.append(("stock_graph", False, lambda: _graph_call(stock, x, out, "stock_graph")))
        timed: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
        for name, benchmark, make in variants:
            with fp32(benchmark=benchmark, tf32=tf32):
                fn = make()
                # compared before timing: a CUDA-graph replay (ours, or torch.compile's max-autotune
                # cudagraphs) overwrites its output on the next run
                out.setdefault(name, {})["max_rel_diff"] = max_rel_diff(fn(), ref)
                torch.cuda.synchronize()
            timed[name] = (fn, functools.partial(fp32, benchmark=benchmark, tf32=tf32))
        # every variant built (graphs captured, cuDNN's benchmark-mode picks made in the order above): timed in turns
        for name, timing in time_interleaved(timed, runs).items():
            out[name].update(timing.as_dict(), timed="interleaved")
    if stock_model is not None:
        shared = _cache_shared()
        if not shared:
            log.once("bench-served-memory", "bench: the cache is in memory, which a child process cannot see: no "
                     "served variant (set BAGF_CACHE_DIR to a writable folder)")
        kinds = ("stock", "bagf") if shared else ("stock",)
        for name, entry in time_in_children(kinds, stock_model, x, runs, graphs, tf32, channels_last, frozen,
                                            children, layer_kinds(tuned)).items():
            out.setdefault(name, {}).update(entry)
    order = list(VARIANT_ORDER)
    return {k: out[k] for k in sorted(out, key=lambda k: order.index(k) if k in order else len(order))}


def time_in_children(kinds: tuple[str, ...], model: str, x: torch.Tensor, runs: int, graphs: bool, tf32: bool,
                     channels_last: bool | None, frozen: bool, children: int, tuned_kinds: dict[str, str]) -> dict:
    """``children`` fresh processes of each of ``kinds`` (``in_child``), alternating kind by kind, the order reversed
    every other turn (stock, served, served, stock...: a drift in the machine's speed reaches both kinds alike), on
    ``x``'s shape, dtype and format (``child_args``); each served child checked against ``tuned_kinds``
    (``_check_served``: it must run what the tuned model runs here). {variant: its median child's entry
    (``median_child``)}; a served variant's entry also has ``same_process_ratios``, each served child's stock copy
    over its served model (``PAIRED``: both timed interleaved in that one process, so its host speed cancels), in the
    order they ran, and ``same_process_ratio``, their median."""
    if children < 1:
        raise ValueError(f"children={children}: at least one fresh process of each kind")
    shape, dtype, fmt = child_args(x, channels_last)
    seen: dict[str, list[dict]] = {}
    ratios: dict[str, list[float]] = {}
    for turn in range(children):
        for kind in (kinds if turn % 2 == 0 else kinds[::-1]):
            child = in_child(kind, model, shape, runs, graphs, tf32, dtype, fmt, frozen=frozen)
            if kind == "bagf":
                _check_served(tuned_kinds, child)
                for name, beside in PAIRED.items():
                    if name in child and beside in child:
                        ratios.setdefault(name, []).append(child[beside]["median_us"] / child[name]["median_us"])
            for name, entry in child.items():
                seen.setdefault(name, []).append(entry)
    out = {name: median_child(entries) for name, entries in seen.items()}
    for name, rs in ratios.items():
        out[name].update(same_process_ratios=rs, same_process_ratio=statistics.median(rs))
    return out


def median_child(entries: list[dict]) -> dict:
    """Of one variant's entries from several fresh processes, the one whose ``median_us`` is their median (the lower
    middle one for an even count: a child's quartiles belong to its median), with ``children_us``, every child's
    ``median_us`` in the order they ran, and ``child``, the chosen one's place in that order (a variant's eager and
    graph entries may come from different children)."""
    ranked = sorted(range(len(entries)), key=lambda i: entries[i]["median_us"])
    chosen = ranked[(len(entries) - 1) // 2]
    return dict(entries[chosen], children_us=[e["median_us"] for e in entries], child=chosen)


def children_lines(results: dict[int, dict]) -> list[str]:
    """Markdown lines: each batch size's fresh-process variants, every child's median us in the order they ran (the
    table shows the median child's), and each served child's same-process ratios."""
    lines = []
    for n, row in sorted(results.items()):
        parts = [f"{v} " + " / ".join(f"{us:.1f}" for us in row[v]["children_us"]) for v in VARIANT_ORDER
                 if len(row.get(v, {}).get("children_us", ())) > 1]
        parts += [f"{PAIRED[v]} over {v} in each served process " + " / ".join(
                  f"{r:.2f}x" for r in row[v]["same_process_ratios"]) for v in PAIRED
                  if len(row.get(v, {}).get("same_process_ratios", ())) > 1]
        if parts:
            lines.append(f"- N = {n}: " + "; ".join(parts))
    return lines


def child_args(x: torch.Tensor, channels_last: bool | None = None) -> tuple[tuple, str, str]:
    """(shape, dtype name, memory format name) of the children's input, as ``x``'s; channels_last as
    ``channels_last`` says, or as ``x``'s strides say when None (a 1-channel or 1x1 input is both formats: say it)."""
    if channels_last is None:
        channels_last = x.dim() == 4 and memory_layout(x) == "nhwc"
    return tuple(x.shape), str(x.dtype).split(".")[-1], "channels_last" if channels_last else "contiguous"


def _cache_shared() -> bool:
    """Whether a child process sees this process's plans: the runtime's cache is a file, not memory."""
    from . import runtime

    return not runtime.get().cache().in_memory


def layer_kinds(model: nn.Module) -> dict[str, str]:
    """What each TunedConv2d of ``model`` runs for each kind of call it has seen: "kernel" (our plan), "aten" (cuDNN
    won the tuning), "unsupported" (a call the kernels do not take) or "later" (no plan yet: torch's conv meanwhile);
    keyed "name|shape|dtype|format|tf32=..." (a layer called at several shapes has one entry per shape)."""
    from .nn import TunedConv2d

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, TunedConv2d):
            for (shape, _device, tf32, dtype, contiguous), entry in (m.__dict__.get("_bagf_plans") or {}).items():
                fmt = "nchw" if contiguous else "nhwc"
                out[f"{name}|{tuple(shape)}|{str(dtype).split('.')[-1]}|{fmt}|tf32={tf32}"] = entry[0]
    return out


def _check_served(tuned: dict[str, str], child: dict) -> None:
    """Each call the served child made must run what the same call runs here -- our kernel, or torch's conv (ATen
    planned, unsupported, no plan yet: all torch's) -- and the child must not have tuned."""
    entry = child.get("bagf_served", {})
    served = entry.get("layer_kinds", {})
    ours = lambda kind: kind == "kernel"  # noqa: E731
    differ = {k: (tuned.get(k, "missing"), v) for k, v in served.items() if k not in tuned or ours(tuned[k]) != ours(v)}
    if differ or entry.get("tuned") or not served:
        raise RuntimeError(
            "the served child (BAGF_TUNE=0, plans from the cache) did not run the tuned model's plans: "
            + (", ".join(f"{k}: {a} here, {b} served" for k, (a, b) in sorted(differ.items())) if served
               else "it reported no TunedConv2d call")
            + (f"; it tuned {entry['tuned']} problem(s)" if entry.get("tuned") else "")
            + ". Is the cache (BAGF_CACHE_DIR) the one this process tuned into, and the TF32 mode the same?")


def in_child(kind: str, model: str, shape: tuple, runs: int, graphs: bool, tf32: bool = False,
             dtype: str = "float32", memory_format: str = "contiguous", frozen: bool = False) -> dict:
    """``kind`` "stock": ``stock`` (and ``stock_graph``) timed in a fresh process with cudnn.benchmark off;
    "bagf": ``bagf_served`` (and ``bagf_served_graph``) in a fresh process with BAGF_TUNE=0, its plans from the
    cache, its weights frozen with ``frozen``, interleaved with a stock copy of the model (``stock_in_served``,
    ``stock_in_served_graph``: ``PAIRED``). Both with cuDNN's TF32 as ``tf32``, the model and input in ``dtype`` and
    ``memory_format``. The child runs this process's bagf_torch (``main`` through ``CHILD_STUB``), whatever its working
    directory holds."""
    if kind not in CHILD_KINDS:
        raise ValueError(f"child kind {kind!r}: one of {', '.join(CHILD_KINDS)}")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-c", CHILD_STUB.format(here=repr(here)), "--child", kind, model,
           ",".join(map(str, shape)), str(runs), "1" if graphs else "0", "1" if tf32 else "0", dtype, memory_format,
           "1" if frozen else "0"]
    env = dict(os.environ)
    if kind == "bagf":
        env["BAGF_TUNE"] = "0"  # a serving process: plans from the cache, a miss runs torch's conv
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"the {kind}-timing child failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# The child's program: this process's package folder in place of the working directory at the head of sys.path
# (``python -c`` puts the working directory there, ahead of everything: a source checkout there would shadow an
# installed copy), then ``main``.
CHILD_STUB = ("import sys; sys.path[0] = {here}; from bagf_torch.bench import main; "
              "sys.exit(main(sys.argv[1:]))")
CHILD_KINDS = ("stock", "bagf")


def _child(kind: str, model: str, shape: str, runs: int, graphs: bool, tf32: bool, dtype: str,
           memory_format: str, frozen: bool = False) -> dict:
    from .models import build  # the parent built this model by name already, so the name is known to build

    fmt = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}[memory_format]
    dt = getattr(torch, dtype)

    def make(tuned: bool) -> nn.Module:
        torch.manual_seed(0)  # the same weights in every child and copy
        return build(model, tuned=tuned).cuda().eval().to(dt).to(memory_format=fmt)

    net = make(kind == "bagf")
    if frozen and kind == "bagf":
        from .nn import freeze_weights

        freeze_weights(net)
    x = torch.randn(*(int(v) for v in shape.split(",")), device="cuda").to(dt).contiguous(memory_format=fmt)
    # A served child also times a stock copy of the model, interleaved with the served one (PAIRED): the two share
    # this process's host speed, which moves from process to process by up to 2x on the device machines (CHILDREN).
    nets = {"stock" if kind == "stock" else "bagf_served": net}
    if kind == "bagf":
        nets[PAIRED["bagf_served"]] = make(False)
    out: dict = {}
    process = f"child, cudnn.benchmark off, TF32 {'on' if tf32 else 'off'}" + (
        ", BAGF_TUNE=0 (plans from the cache)" if kind == "bagf" else "")
    context = functools.partial(fp32, benchmark=False, tf32=tf32)
    timed: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    with torch.no_grad(), context():
        for name, m in nets.items():
            for variant, make_call in [(name, lambda m=m: lambda: m(x))] + (
                    [(name + "_graph", lambda m=m, name=name: _graph_call(m, x, out, name + "_graph"))]
                    if graphs else []):
                fn = make_call()
                fn()
                torch.cuda.synchronize()
                timed[variant] = (fn, context)
                frozen_here = frozen and name == "bagf_served"  # (the stock copy's weights are not frozen)
                out.setdefault(variant, {})["process"] = process + (", weights frozen" if frozen_here else "")
        if kind == "bagf":
            # the served logits against the stock copy's in this process, as the parent compares its variants
            out["bagf_served"]["max_rel_diff"] = max_rel_diff(net(x), nets[PAIRED["bagf_served"]](x))
        for variant, timing in time_interleaved(timed, runs).items():
            out[variant].update(timing.as_dict(), timed="interleaved" if len(timed) > 1 else "alone")
    if kind == "bagf":
        from . import runtime

        stats = runtime.get().stats
        kinds = layer_kinds(net)
        for variant in out:
            if variant.startswith("bagf_served"):
                # what served the convs: each layer's kind, plans loaded from the cache, none tuned here, the tuner's
                # imports absent
                out[variant].update(layer_kinds=kinds, plans_loaded=stats["cache_hits"], tuned=stats["tuned"],
                                    ax_imported=any(m == "ax" or m.startswith("ax.") for m in sys.modules))
    return out


PAIRED = {"bagf_served": "stock_in_served", "bagf_served_graph": "stock_in_served_graph"}
"""A served child's variants and the stock copy timed beside each in the same process (``_child``)."""


def _graph_call(model: nn.Module, x: torch.Tensor, out: dict, name: str) -> Callable[[], torch.Tensor]:
    t0 = time.perf_counter()
    replay, static = graphed(model, x)
    out.setdefault(name, {})["capture_seconds"] = time.perf_counter() - t0

    def call():
        replay()
        return static

    return call


def _compiled_call(model: nn.Module, x: torch.Tensor, out: dict) -> Callable[[], torch.Tensor]:
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="max-autotune")
    t0 = time.perf_counter()
    compiled(x)
    torch.cuda.synchronize()
    out.setdefault("compile_max_autotune", {})["compile_seconds"] = time.perf_counter() - t0
    return lambda: compiled(x)


def speedups(row: dict) -> dict:
    """Stock-eager time over each variant's time (>1: faster than stock PyTorch), plus bagf over the
    best stock eager (benchmark mode included) and bagf graph over stock graph, and the served variants'
    ``same_process_ratio`` where their children timed a stock copy (``SAME_PROCESS``' keys)."""
    base = row["stock"]["median_us"]
    out = {f"{k}_vs_stock": base / v["median_us"] for k, v in row.items() if k != "stock"}
    out["bagf_vs_stock_benchmark"] = row["stock_benchmark"]["median_us"] / row["bagf"]["median_us"]
    if "bagf_graph" in row and "stock_graph" in row:
        out["bagf_graph_vs_stock_graph"] = row["stock_graph"]["median_us"] / row["bagf_graph"]["median_us"]
    if "bagf_served" in row:
        out["bagf_served_vs_stock"] = base / row["bagf_served"]["median_us"]
    if "bagf_served_graph" in row and "stock_graph" in row:
        out["bagf_served_graph_vs_stock_graph"] = (row["stock_graph"]["median_us"]
                                                   / row["bagf_served_graph"]["median_us"])
    if "bagf_graph" in row and "stock_benchmark_graph" in row:
        out["bagf_graph_vs_stock_benchmark_graph"] = (row["stock_benchmark_graph"]["median_us"]
                                                      / row["bagf_graph"]["median_us"])
    for name, key in SAME_PROCESS.items():
        if "same_process_ratio" in row.get(name, {}):
            out[key] = row[name]["same_process_ratio"]
    return out


SAME_PROCESS = {"bagf_served": "bagf_served_vs_stock_same_process",
                "bagf_served_graph": "bagf_served_graph_vs_stock_graph_same_process"}
"""``speedups``' keys for the served variants' ``same_process_ratio`` (``time_in_children``)."""


VARIANT_ORDER = ("stock", "stock_benchmark", "bagf", "bagf_served", "stock_graph", "stock_benchmark_graph",
                 "bagf_graph", "bagf_served_graph", "compile_max_autotune")


def table(results: dict[int, dict]) -> list[str]:
    """Markdown lines: one row per batch size, median us per variant, then the speedups: first against stock in cuDNN's
    benchmark mode timed in this process (the like-for-like comparison every claim uses: the tuner measures cuDNN
    that way), then against PyTorch's defaults (benchmark off, a fresh child: what a user who changes nothing runs),
    and the served ones where a served child ran (its own defaults against stock's; then, where its children timed a
    stock copy beside it, the median of those same-process ratios). ``max rel diff``: the largest over the variants
    of their logits' difference from stock's (a served child's against its stock copy's)."""
    present = [v for v in VARIANT_ORDER if any(v in r for r in results.values())]
    served = "bagf_served" in present
    paired = any("same_process_ratio" in r.get("bagf_served", {}) for r in results.values())
    lines = ["| N | " + " | ".join(f"{v} us" for v in present) + " | bagf vs stock_benchmark | "
             "bagf graph vs stock_benchmark graph | bagf vs stock (default) | bagf graph vs stock graph (default) | "
             + ("served vs stock | served graph vs stock graph | " if served else "")
             + ("served vs stock, same process | served graph vs stock graph, same process | " if paired else "")
             + "max rel diff |",
             "|---" * (len(present) + 6 + 2 * served + 2 * paired) + "|"]
    nan = float("nan")
    for n, row in sorted(results.items()):
        s = speedups(row)
        cells = [f"{row[v]['median_us']:.1f}" if v in row else "-" for v in present]
        diff = max((row[v]["max_rel_diff"] for v in present if "max_rel_diff" in row.get(v, {})), default=nan)
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {s['bagf_vs_stock_benchmark']:.2f}x | "
                     f"{s.get('bagf_graph_vs_stock_benchmark_graph', nan):.2f}x | {s['bagf_vs_stock']:.2f}x | "
                     f"{s.get('bagf_graph_vs_stock_graph', nan):.2f}x | "
                     + (f"{s.get('bagf_served_vs_stock', nan):.2f}x | "
                        f"{s.get('bagf_served_graph_vs_stock_graph', nan):.2f}x | " if served else "")
                     + "".join(f"{s.get(key, nan):.2f}x | " for key in SAME_PROCESS.values() if paired)
                     + f"{diff:.1e} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bagf_torch.bench --child KIND MODEL N,C,H,W RUNS GRAPHS(0|1) TF32(0|1) DTYPE FORMAT FROZEN(0|1)``:
    one child's timings as a JSON line on stdout (``in_child`` writes this command line)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 10 and argv[0] == "--child" and argv[1] in CHILD_KINDS:
        kind, model, shape, runs, graphs, tf32, dtype, fmt, frozen = argv[1:]
        print(json.dumps(_child(kind, model, shape, int(runs), graphs == "1", tf32 == "1", dtype, fmt,
                                frozen == "1")))
        return 0
    print("usage: python -m bagf_torch.bench --child stock|bagf MODEL N,C,H,W RUNS GRAPHS(0|1) TF32(0|1) "
          "float32|float16|bfloat16 contiguous|channels_last FROZEN(0|1)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Never slower than stock, for every plan kind: TunedConv2d against the stock nn.Conv2d (same weights), same run.

Inference (torch.no_grad()), fp32 with TF32 off (``--tf32`` to allow it; ``--dtype bfloat16`` / ``float16`` and
``--channels-last`` for the 16-bit and channels_last plans), ``torch.backends.cudnn.benchmark = True``.
For each plan kind, each layer and each batch size, one row:

* ``kernel``: the shape is tuned on its first call (BAGF_TIME_BUDGET=``--seconds``, default 4 s; a small budget) and
  its plan is served; the row names the plan, or says "tuning picked cuDNN" when the winner is torch's conv.
* ``aten``: a cached plan whose winner is torch's conv (``Cache.put_plan`` under the runtime's key for the problem:
  family "aten", config None, as a tuning that picked cuDNN leaves it), served with BAGF_TUNE=0.
* ``miss``: BAGF_TUNE=0 and no cached plan: TunedConv2d asks the runtime, finds nothing and runs torch's conv.
* ``unsupported:fp64``: float64 input and weights (no family computes them); ``unsupported:strided``: fp32,
  an input neither NCHW nor channels_last (a transposed view). TunedConv2d hands both to nn.Conv2d's forward.

Two timings per row, stock and tuned interleaved repetition by repetition (the order alternates):

* eager: wall time per call of a loop of ``--calls`` calls closed by one synchronize; median of ``--reps`` loops.
* graph: each module's forward captured in its own CUDA graph (``bagf_torch.bench.graphed``: warm-up on a side
  stream), replays timed with CUDA events (``bagf_torch.bench.time_forward``: median of ``--replays``); median of
  ``--reps`` such medians.

Both modules are warmed up before timing (the first calls tune, or pick cuDNN's algorithm). Pass rule per row and
mode: tuned <= stock * 1.02 or tuned - stock <= 2 us (``--ratio``, ``--slack-us``). Every kind runs in its own
BAGF_CACHE_DIR under one fresh temporary directory, with ``bagf_torch.runtime.reset()`` and ``bagf_torch.log.reset()``
between kinds (settings are read at call time). ``--cache DIR`` keeps the ``kernel`` kind's plans in DIR (tuned once,
reused by later runs); ``aten`` and ``miss`` always need a cache without the shape's kernel plan, so they stay fresh.

Writes ``<out>/bench_overhead_<tag>.json`` and ``.md`` (GPU, torch / CUDA / cuDNN versions, date, git commit, the
exact command) after every row, and exits 1 if any row fails (the files are written first). ``--dry-run`` runs on a
CPU: the case list, the environments per kind, the cached aten plan (under a stand-in key), the modules' forwards
at a tiny size and the result files, with FAKE timings marked as such in every row and in the files' names.

    python benchmarks/bench_overhead.py --batch 1,8,32,128 --layers 64:64:56,128:128:28
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import faulthandler
import json
import math
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent

from bagf_torch import bench, log, runtime  # noqa: E402
from bagf_torch.nn import TunedConv2d  # noqa: E402
from bagf_torch.problem import ConvProblem  # noqa: E402

KINDS = ("kernel", "aten", "miss", "unsupported:fp64", "unsupported:strided")
KIND_ALIASES = {"unsupported": ("unsupported:fp64", "unsupported:strided"), "fp64": ("unsupported:fp64",),
                "strided": ("unsupported:strided",)}
DEFAULT_LAYERS = "64:64:56,128:128:28"
DRY_N, DRY_HW = 2, 8  # the dry run's forwards run at N <= 2 on 8x8 maps (CPU)


# ---- cases ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    c: int
    k: int
    hw: int
    kernel: int = 3
    stride: int = 1
    padding: int | None = None

    @property
    def pad(self) -> int:
        return self.kernel // 2 if self.padding is None else self.padding

    @property
    def name(self) -> str:
        extra = (f" s{self.stride}" if self.stride != 1 else "") + (f" p{self.pad}" if self.pad != self.kernel // 2
                                                                   else "")
        return f"{self.kernel}x{self.kernel} {self.c}->{self.k} @{self.hw}x{self.hw}{extra}"

    def conv(self) -> nn.Conv2d:
        return nn.Conv2d(self.c, self.k, self.kernel, stride=self.stride, padding=self.pad)


def parse_layers(text: str) -> list[Layer]:
    """``C:K:HW[:kernel[:stride[:padding]]]`` items, comma-separated (kernel 3, stride 1, padding kernel//2)."""
    layers = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split(":")
        if not 3 <= len(parts) <= 6:
            raise argparse.ArgumentTypeError(f"layer {item!r}: expected C:K:HW[:kernel[:stride[:padding]]]")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"layer {item!r}: fields must be integers") from None
        if min(nums[:3]) <= 0 or (len(nums) > 3 and nums[3] <= 0) or (len(nums) > 4 and nums[4] <= 0) \
                or (len(nums) > 5 and nums[5] < 0):
            raise argparse.ArgumentTypeError(f"layer {item!r}: sizes must be positive (padding >= 0)")
        layers.append(Layer(*nums))
    if not layers:
        raise argparse.ArgumentTypeError("no layers given")
    return layers


def parse_batches(text: str) -> list[int]:
    try:
        out = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes {text!r}: expected a comma-separated list of integers") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"batch sizes {text!r}: expected positive integers")
    return out


def parse_kinds(text: str) -> list[str]:
    out: list[str] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        for kind in KIND_ALIASES.get(item, (item,)):
            if kind not in KINDS:
                raise argparse.ArgumentTypeError(f"kind {item!r}: one of {', '.join(KINDS)}, or unsupported, fp64, "
                                                 "strided")
            if kind not in out:
                out.append(kind)
    if not out:
        raise argparse.ArgumentTypeError("no plan kinds given")
    return out


def seconds_suffix(seconds: float | None, default: float) -> str:
    """File-name suffix for a time budget: '' for the default (or none given), else e.g. '_5s'."""
    return "" if seconds is None or float(seconds) == float(default) else f"_{float(seconds):g}s"


# ---- run metadata and the environment --------------------------------------------------------------------

def git_commit(repo: Path = REPO) -> str:
    """For this checkout: GIT_COMMIT when set (the device machine's copy of the working tree carries the .git of
    the session's start, whose HEAD is not what runs), else HEAD; for another ``repo``, its HEAD. '+dirty' when
    tracked files differ. A folder that is not the top of a checkout (an unpacked ``git archive``, even inside
    this one) has no commit of its own."""
    if repo == REPO and os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=10)
        top, _, commit = head.stdout.strip().partition("\n")
        if head.returncode == 0 and Path(top).resolve() == Path(repo).resolve():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                   capture_output=True, text=True, timeout=10)
            return commit + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (no git checkout here; set GIT_COMMIT)"


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def command_line(script: str, argv: Sequence[str]) -> str:
    """The exact command, with the BAGF_* and CUDA_VISIBLE_DEVICES variables it ran under."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith("BAGF_") or k in ("CUDA_VISIBLE_DEVICES", "GIT_COMMIT")]
    return " ".join(env + ["python", f"benchmarks/{script}"] + [shlex.quote(a) for a in argv])


def run_meta(command: str, dry_run: bool) -> dict:
    """GPU, versions, date, commit and command of a run (the GPU's environment fingerprint opens a cache: call it
    with BAGF_CACHE_DIR pointing at a scratch directory)."""
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "command": command, "dry_run": dry_run,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "host": platform.node(),
    }
    if dry_run:
        meta["gpu"] = "none (dry run on the CPU: FAKE NUMBERS)"
        meta["note"] = "DRY RUN: every time in this file is FAKE (made up, not measured)"
    else:
        meta["gpu"] = torch.cuda.get_device_name(0)
        env = runtime.get().device(0).env
        meta["env"] = env
        meta["driver"], meta["nvrtc"] = env.get("driver"), env.get("nvrtc")
    return meta


def write_probe_json(out: Path, script: str, argv: Sequence[str] | None, doc: dict) -> Path:
    """``doc`` under ``out`` as ``<script's name>.json``, after a ``meta`` of ``run_meta`` (``benchmarks/<script>`` run
    with ``argv``, ``sys.argv[1:]`` when None; its GPU's fingerprint read through a scratch cache unless
    BAGF_CACHE_DIR names one). For probes whose children must import torch first: call it after they have run."""
    os.environ.setdefault("BAGF_CACHE_DIR", tempfile.mkdtemp())
    meta = run_meta(command_line(script, sys.argv[1:] if argv is None else list(argv)), dry_run=False)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (Path(script).stem + ".json")
    path.write_text(to_json({"meta": meta, **doc}))
    return path


def to_json(doc: dict) -> str:
    """JSON of a results document; numpy scalars as numbers, anything else unexpected as its text."""
    return json.dumps(doc, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o)) + "\n"


def arm_watchdog(seconds: float) -> None:
    """Dump every thread's stack to stderr if the current step (re-armed per row) takes over ``seconds``."""
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, repeat=True)


def version_line(meta: dict) -> str:
    return (f"{meta['date']}; GPU {meta['gpu']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}"
            + (f", NVRTC {meta['nvrtc']}, driver {meta['driver']}" if meta.get("nvrtc") else "")
            + f", Python {meta['python']}; commit `{meta['commit']}`.")


@contextlib.contextmanager
def bagf_env(**values):
    """Set (str) or unset (None) BAGF_* variables with a fresh runtime and log state; restores both after."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        runtime.reset()
        log.reset()
        yield
    finally:
        runtime.reset()
        log.reset()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def keep_environ():
    """Restore os.environ as it was (the scripts set BAGF_* per kind; tests call main() in-process)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def pin_build_dir() -> None:
    """Keep the host extension's build where it is: its default lives under BAGF_CACHE_DIR, which these scripts
    point at fresh directories (a rebuild per directory would cost minutes)."""
    if not os.environ.get("BAGF_BUILD_DIR"):
        from bagf_torch.jit import extension

        os.environ["BAGF_BUILD_DIR"] = str(extension.build_dir())


class LogCapture(logging.Handler):
    """Every record of the ``bagf_torch`` logger while attached (as level and message)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({"level": record.levelname, "message": record.getMessage()})

    @contextlib.contextmanager
    def attached(self):
        logger = logging.getLogger("bagf_torch")
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)


def console_logging() -> None:
    """The bagf_torch logger's warnings stay visible on stderr next to a capture handler (the library adds its own
    stderr handler only when the logger has none)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format="[%(name)s] %(levelname)s %(message)s")


# ---- timing (bagf_torch.bench's helpers; only the eager loop is new) ---------------------------------------

def compute_device(dry_run: bool) -> torch.device:
    """Where the modules run: the first visible GPU; the CPU in a dry run."""
    return torch.device("cpu") if dry_run else torch.device("cuda", 0)


def _sync() -> None:
    torch.cuda.synchronize()


def eager_loop_us(fn: Callable[[], object], calls: int, sync: Callable[[], None] = _sync) -> float:
    """Wall microseconds per call of ``calls`` back-to-back calls closed by one synchronize (from an idle GPU)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def interleaved(measure: Callable[[Callable[[], object]], float], fns: Sequence[Callable[[], object]],
                reps: int) -> list[float]:
    """Median over ``reps`` repetitions of ``measure(fn)`` for each fn, measured in turn within each repetition
    (the order rotates each repetition, so no fn is always first)."""
    samples: list[list[float]] = [[] for _ in fns]
    for rep in range(reps):
        for j in range(len(fns)):
            i = (j + rep) % len(fns)
            samples[i].append(measure(fns[i]))
    return [statistics.median(s) for s in samples]


def interleaved_eager_us(fns: Sequence[Callable[[], object]], calls: int, reps: int,
                         sync: Callable[[], None] = _sync) -> list[float]:
    return interleaved(lambda fn: eager_loop_us(fn, calls, sync), fns, reps)


def interleaved_graph_us(replays: Sequence[Callable[[], object]], replays_per_rep: int, reps: int) -> list[float]:
    """GPU microseconds per replay of each captured graph: per repetition ``bench.time_forward``'s median of
    ``replays_per_rep`` CUDA-event-timed replays, interleaved; the median over repetitions."""
    return interleaved(lambda fn: bench.time_forward(fn, runs=replays_per_rep, warmup=1).median_us, replays, reps)


def judge(stock_us: float, tuned_us: float, ratio: float, slack_us: float) -> dict:
    return {"stock_us": stock_us, "tuned_us": tuned_us, "ratio": tuned_us / stock_us if stock_us > 0 else float("inf"),
            "diff_us": tuned_us - stock_us,
            "pass": bool(tuned_us <= stock_us * ratio or tuned_us - stock_us <= slack_us)}


# ---- the plan kinds -------------------------------------------------------------------------------------

def kind_env(kind: str, args, root: Path) -> dict:
    """The BAGF_* settings of a kind (None: unset). Each kind gets its own cache directory."""
    own = kind == "kernel" and args.cache
    cache = str(Path(args.cache).expanduser()) if own else str(root / kind.replace(":", "_"))
    env = {"BAGF_CACHE_DIR": cache, "BAGF_BACKGROUND": "0"}
    if kind == "kernel":
        env.update(BAGF_TUNE="1", BAGF_TIME_BUDGET=f"{args.seconds:g}")
        if args.budget is not None:
            env["BAGF_BUDGET"] = str(args.budget)
    elif kind in ("aten", "miss"):
        env["BAGF_TUNE"] = "0"
    else:  # unsupported: tuning left on, so a dtype or layout that did reach the tuner would show in the plan
        env["BAGF_TUNE"] = "1"
    return env


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_pair(layer: Layer, kind: str, device: torch.device, seed: int, dtype: str = "float32",
              channels_last: bool = False) -> tuple[nn.Module, nn.Module]:
    """(stock nn.Conv2d, TunedConv2d) with the same weights, eval mode, in the kind's dtype and memory format (the
    run's ``dtype`` and ``channels_last`` for every kind but the unsupported ones, which set their own)."""
    torch.manual_seed(seed)
    stock = layer.conv().to(device).eval()
    if not kind.startswith("unsupported:"):
        stock = stock.to(DTYPES[dtype])
        if channels_last:
            stock = stock.to(memory_format=torch.channels_last)
    if kind == "unsupported:fp64":
        stock = stock.to(torch.float64)
    elif kind == "unsupported:strided":
        pass  # the module as it is; the input is a transposed view
    tuned = TunedConv2d.from_conv(copy.deepcopy(stock)).eval()
    return stock, tuned


def make_input(layer: Layer, n: int, hw: int, kind: str, device: torch.device, seed: int, dtype: str = "float32",
               channels_last: bool = False) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.randn(n, layer.c, hw, hw, generator=g).to(device)
    if not kind.startswith("unsupported:"):
        x = x.to(DTYPES[dtype])
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
    if kind == "unsupported:fp64":
        x = x.to(torch.float64)
    elif kind == "unsupported:strided":
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    return x


def problem_of(tuned: TunedConv2d, x: torch.Tensor) -> ConvProblem:
    """The problem a TunedConv2d's forward asks the runtime for (numeric padding; the caller's TF32 mode)."""
    pad = tuned.padding
    return ConvProblem.from_call(x, tuned.weight, tuned.bias, tuned.stride, (int(pad[0]), int(pad[1])),
                                 tuned.dilation, 1)


def store_aten_plan(cache, key: str, problem: ConvProblem, env: dict, cudnn_us: float) -> bool:
    """The plan a tuning that picked cuDNN leaves (runtime._tune_and_store's fields): family "aten", no config,
    the plan's and cuDNN's time equal, no cubins. True if stored (False: the cache already held a plan)."""
    return cache.put_plan(key, problem=problem.as_dict(), env=env, family="aten", config=None, time_us=cudnn_us,
                          aten_us=cudnn_us, default_us=None, evaluations=0, tune_seconds=0.0, cubin_digests=[])


def plan_name(row: dict | None) -> str:
    from bagf_torch.kernels import family_name

    if row is None:
        return "none"
    return "aten (cuDNN)" if row["family"] == "aten" else family_name(row["family"], row["config"])


def unsupported_reason(tuned: TunedConv2d, x: torch.Tensor) -> str:
    probe = getattr(tuned, "_unsupported", None)  # TunedConv2d's own check (read only)
    reason = probe(x) if callable(probe) else None
    return reason or "unknown reason"


def describe_plan(kind: str, tuned: TunedConv2d, x: torch.Tensor, stats_before: dict) -> dict:
    """What the tuned module runs for this row, from the runtime and the cache (after its first call)."""
    rt = runtime.get()
    stats = {k: v - stats_before.get(k, 0) for k, v in rt.stats.items()}
    if kind.startswith("unsupported"):
        return {"plan": f"nn.Conv2d forward ({unsupported_reason(tuned, x)})", "runtime_stats": stats,
                "ok": not stats.get("tuned") and not stats.get("cache_hits")}
    key = rt.key(problem_of(tuned, x), x.get_device())
    row = rt.cache().get_plan(key)
    out = {"key": key, "runtime_stats": stats}
    if kind == "kernel":
        if row is None:
            out.update(plan="none: no plan stored (tuning failed? see the log records)", ok=False)
        elif row["family"] == "aten":
            out.update(plan="aten: tuning picked cuDNN", ok=True)
        else:
            out.update(plan=plan_name(row), ok=True)
        if row is not None:
            out.update(plan_us_at_tuning=row["time_us"], cudnn_us_at_tuning=row["aten_us"],
                       tune_seconds=row["tune_seconds"], evaluations=row["evaluations"],
                       tuned_now=bool(stats.get("tuned")))
    elif kind == "aten":
        hit = bool(stats.get("cache_hits"))
        out.update(plan="aten (cached plan)" if hit else "aten plan NOT served (key mismatch?)",
                   ok=hit and row is not None and row["family"] == "aten")
    else:  # miss
        out.update(plan="none: BAGF_TUNE=0 and no cached plan -> torch's conv",
                   ok=row is None and not stats.get("tuned"))
    return out


def measure_row(layer: Layer, n: int, kind: str, args, device: torch.device) -> dict:
    """One row on the GPU: modules, first calls, check, eager and graph timings (stock first, tuned second)."""
    row: dict = {"layer": layer.name, "n": n, "kind": kind}
    stock, tuned = make_pair(layer, kind, device, args.seed, args.dtype, args.channels_last)
    x = make_input(layer, n, layer.hw, kind, device, args.seed, args.dtype, args.channels_last)
    rt = runtime.get()
    if kind == "aten":
        problem = problem_of(tuned, x)
        cudnn_us = bench.time_forward(lambda: stock(x), runs=20, warmup=3).median_us
        row["aten_plan_stored"] = store_aten_plan(rt.cache(), rt.key(problem, x.get_device()), problem,
                                                  rt.device(x.get_device()).env, cudnn_us)
    before = dict(rt.stats)
    t0 = time.perf_counter()
    y_tuned = tuned(x)  # the first call: tunes (kernel), looks up (aten, miss) or falls back (unsupported)
    torch.cuda.synchronize()
    row["first_call_s"] = time.perf_counter() - t0
    y_stock = stock(x)
    row["max_rel_diff"] = bench.max_rel_diff(y_tuned, y_stock)
    row.update(describe_plan(kind, tuned, x, before))
    for _ in range(args.warmup):
        stock(x)
        tuned(x)
    torch.cuda.synchronize()
    fns = [lambda: stock(x), lambda: tuned(x)]
    try:
        s, t = interleaved_eager_us(fns, args.calls, args.reps)
        row["eager"] = judge(s, t, args.ratio, args.slack_us)
    except Exception as e:  # one mode failing must not lose the other, nor the rows after it
        row["eager"] = {"error": f"{type(e).__name__}: {e}", "pass": False}
    try:
        replay_s, _ = bench.graphed(stock, x)
        replay_t, _ = bench.graphed(tuned, x)
        s, t = interleaved_graph_us([replay_s, replay_t], args.replays, args.reps)
        row["graph"] = judge(s, t, args.ratio, args.slack_us)
        del replay_s, replay_t
    except Exception as e:
        row["graph"] = {"error": f"{type(e).__name__}: {e}", "pass": False}
    return row


def fake_row(layer: Layer, n: int, kind: str, args, index: int) -> dict:
    """The dry run's row: the modules really run (CPU, tiny), the case list and plan bookkeeping are real, the
    times are FAKE: stock 100 + 5 N us, tuned 1% faster (``--dry-run-fail``: the first row 10% slower)."""
    row: dict = {"layer": layer.name, "n": n, "kind": kind, "fake": True}
    device = torch.device("cpu")
    stock, tuned = make_pair(layer, kind, device, args.seed, args.dtype, args.channels_last)
    x = make_input(layer, min(n, DRY_N), min(layer.hw, DRY_HW), kind, device, args.seed, args.dtype,
                   args.channels_last)
    rt = runtime.get()
    problem = problem_of(tuned, x)
    if kind == "aten":  # the real put_plan, under a stand-in key and environment (no GPU to fingerprint)
        from bagf_torch.problem import fingerprint

        env = {"dry_run": True}
        row["aten_plan_stored"] = store_aten_plan(rt.cache(), fingerprint(problem, env), problem, env, 1.0)
    with torch.no_grad():
        row["max_rel_diff"] = bench.max_rel_diff(tuned(x).float(), stock(x).float())
        # the interleaving code itself runs, on tiny CPU calls; what it measures is thrown away
        interleaved_eager_us([lambda: stock(x), lambda: tuned(x)], calls=2, reps=2, sync=lambda: None)
    row["plan"] = (f"nn.Conv2d forward ({unsupported_reason(tuned, x)})" if kind.startswith("unsupported")
                   else f"dry run: {problem.short()} not looked up")
    stock_us = 100.0 + 5.0 * n
    tuned_us = stock_us * (1.10 if (args.dry_run_fail and index == 0) else 0.99)
    row["eager"] = judge(stock_us, tuned_us, args.ratio, args.slack_us)
    row["graph"] = judge(stock_us * 0.8, tuned_us * 0.8, args.ratio, args.slack_us)
    row["first_call_s"] = 0.0
    return row


# ---- results ---------------------------------------------------------------------------------------------

MODES = ("eager", "graph")


def row_pass(row: dict) -> bool:
    return all(row.get(m, {}).get("pass", False) for m in MODES) and row.get("ok", True) and "error" not in row


def _cell(mode: dict, field: str, fmt: str) -> str:
    return format(mode[field], fmt) if field in mode else "-"


def table_lines(rows: list[dict]) -> list[str]:
    lines = ["| layer | N | kind | plan | eager stock us | eager tuned us | eager ratio | eager | graph stock us | "
             "graph tuned us | graph ratio | graph | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for m in MODES:
            d = r.get(m, {})
            verdict = "error" if "error" in d else ("ok" if d.get("pass") else "FAIL")
            cells += [_cell(d, "stock_us", ".1f"), _cell(d, "tuned_us", ".1f"), _cell(d, "ratio", ".3f"), verdict]
        plan = r.get("plan", r.get("error", "?")).replace("|", "/")
        lines.append(f"| {r['layer']} | {r['n']} | {r['kind']} | {plan} | " + " | ".join(cells)
                     + f" | {'yes' if row_pass(r) else 'NO'} |")
    return lines


def write_results(out: Path, stem: str, meta: dict, rows: list[dict], args) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    failed = [r for r in rows if not row_pass(r)]
    summary = {"rows": len(rows), "failed": len(failed), "pass": not failed,
               "rule": f"tuned <= stock * {args.ratio} or tuned - stock <= {args.slack_us} us, eager and graph"}
    (out / f"{stem}.json").write_text(to_json({"meta": meta, "summary": summary, "rows": rows}))
    fake = meta.get("dry_run")
    lines = [f"# {'DRY RUN, FAKE NUMBERS: ' if fake else ''}TunedConv2d vs stock nn.Conv2d, every plan kind "
             f"({meta['gpu']})", ""]
    if fake:
        lines += ["**DRY RUN: every time below is FAKE (made up on a CPU, not measured).**", ""]
    lines += [version_line(meta), "", f"Command: `{meta['command']}`", "",
              f"Inference (torch.no_grad()), "
              + (f"{args.dtype}" if args.dtype != "float32" else ('TF32 allowed' if args.tf32 else 'fp32, TF32 off'))
              + (", channels_last" if args.channels_last else "") + " (the kernel, aten and miss kinds), "
              f"cudnn.benchmark=True, same weights. The kernel kind is tuned on its first call with "
              f"BAGF_TIME_BUDGET={args.seconds:g}. Eager: wall us per call, loops of {args.calls} calls closed by one "
              f"synchronize, median of {args.reps}; graph: GPU us per CUDA-graph replay (CUDA events, median of "
              f"{args.replays}), median of {args.reps}; stock and tuned interleaved. Pass: {summary['rule']}.", ""]
    lines += table_lines(rows)
    lines += ["", f"{len(rows) - len(failed)} of {len(rows)} rows pass." if rows else "No rows."]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return lines


# ---- main ------------------------------------------------------------------------------------------------

def result_tag(tag: str | None, dry_run: bool) -> str:
    """The GPU part of a result file's name: ``tag`` when given, else the GPU's (``bench.gpu_tag``: an H100's results
    are not named after the H200), "cpu" for a dry run (its numbers are no GPU's)."""
    if tag is not None:
        return tag
    return "cpu" if dry_run else bench.gpu_tag()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=parse_batches, default=parse_batches("1,8,32,128"), help="batch sizes (1,8,32,128)")
    ap.add_argument("--layers", type=parse_layers, default=parse_layers(DEFAULT_LAYERS),
                    help=f"C:K:HW[:kernel[:stride[:padding]]], comma-separated ({DEFAULT_LAYERS})")
    ap.add_argument("--kinds", type=parse_kinds, default=list(KINDS),
                    help="plan kinds: kernel, aten, miss, unsupported (= unsupported:fp64,unsupported:strided)")
    ap.add_argument("--seconds", type=float, default=4.0, help="BAGF_TIME_BUDGET for the kernel kind's tuning (4)")
    ap.add_argument("--budget", type=int, default=None, help="BAGF_BUDGET (evaluations) for it (the library's)")
    ap.add_argument("--cache", metavar="DIR", help="the kernel kind's cache directory (default: a fresh temporary one)")
    ap.add_argument("--calls", type=int, default=50, help="calls per eager loop (50)")
    ap.add_argument("--replays", type=int, default=20, help="CUDA-event-timed graph replays per repetition (20)")
    ap.add_argument("--reps", type=int, default=31, help="interleaved repetitions per mode; the median is kept (31)")
    ap.add_argument("--warmup", type=int, default=10, help="calls of each module after the first, before timing")
    ap.add_argument("--ratio", type=float, default=1.02, help="pass: tuned <= stock * RATIO ... (1.02)")
    ap.add_argument("--slack-us", type=float, default=2.0, help="... or tuned - stock <= SLACK us (2)")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 (default off: strict fp32)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="the modules' and inputs' dtype for the kernel, aten and miss kinds (float32)")
    ap.add_argument("--channels-last", action="store_true", help="channels_last modules and inputs for those kinds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="directory for the JSON and Markdown (benchmarks/results; dry run: a temporary one)")
    ap.add_argument("--tag", help="file name tag: bench_overhead_<tag>.json (default: the GPU's, h200 or h100; a "
                    "dry run's: cpu); a 16-bit or channels_last run adds _bf16 / _fp16 and _nhwc")
    ap.add_argument("--watchdog", type=float, default=180.0,
                    help="dump all stacks to stderr when one row takes over this many s (0: off)")
    ap.add_argument("--dry-run", action="store_true", help="CPU only: real bookkeeping, FAKE times (see the docstring)")
    ap.add_argument("--dry-run-fail", action="store_true", help=argparse.SUPPRESS)  # tests: the failure exit
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_line("bench_overhead.py", argv)  # before this script sets any variable
    args = build_parser().parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_overhead: no CUDA GPU here; use --dry-run to check the script on a CPU", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="bagf_dryrun_")) if args.dry_run
                                           else REPO / "benchmarks" / "results")
    # a 16-bit or channels_last run gets its own files (bench_overhead_h200_bf16_nhwc), beside the fp32 ones
    fmt = {"bfloat16": "_bf16", "float16": "_fp16"}.get(args.dtype, "") + ("_nhwc" if args.channels_last else "")
    stem = f"bench_overhead_{result_tag(args.tag, args.dry_run)}{fmt}" + ("_dryrun" if args.dry_run else "")
    console_logging()
    flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    rows: list[dict] = []
    capture = LogCapture()
    try:
        with keep_environ(), tempfile.TemporaryDirectory(prefix="bagf_overhead_") as tmp, capture.attached():
            pin_build_dir()
            with bagf_env(BAGF_CACHE_DIR=str(Path(tmp) / "meta")):  # the env fingerprint opens a cache: not the user's
                meta = run_meta(command, args.dry_run)
            meta.update(kinds=args.kinds, seconds=args.seconds, budget=args.budget, tf32=bool(args.tf32),
                        dtype=args.dtype, channels_last=bool(args.channels_last),
                        cudnn_benchmark=True, kernel_cache=args.cache or "fresh temporary directory")
            device = compute_device(args.dry_run)
            for kind in args.kinds:
                env = kind_env(kind, args, Path(tmp))
                with bagf_env(**env):
                    print(f"== {kind}: {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
                    for layer in args.layers:
                        for n in args.batch:
                            first = len(capture.records)
                            if not args.dry_run:
                                arm_watchdog(args.watchdog)
                            try:
                                with torch.no_grad():
                                    row = (fake_row(layer, n, kind, args, len(rows)) if args.dry_run
                                           else measure_row(layer, n, kind, args, device))
                            except Exception as e:
                                traceback.print_exc()
                                row = {"layer": layer.name, "n": n, "kind": kind, "error": f"{type(e).__name__}: {e}"}
                            row["log"] = capture.records[first:]
                            rows.append(row)
                            print(table_lines([row])[-1], flush=True)
                            write_results(out, stem, meta, rows, args)  # what ran so far survives a run cut short
                            if not args.dry_run:
                                torch.cuda.empty_cache()
            lines = write_results(out, stem, meta, rows, args)
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags
        if args.watchdog > 0 and not args.dry_run:
            faulthandler.cancel_dump_traceback_later()
    print("\n".join(lines))
    print(f"results: {out / (stem + '.json')} and .md")
    return 0 if all(row_pass(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

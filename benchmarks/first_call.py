"""First-call tuning as users meet it: the whole first forward of a TunedConv2d, per grad context, against the budget.

For each case (a layer at a batch size; default AlexNet's conv3, Conv2d(192, 384, 3, padding=1) on 13x13, at N = 1,
32, 128) and each grad context (``grad`` = torch.enable_grad(), ``no_grad``, ``inference_mode``), in a fresh
BAGF_CACHE_DIR and a fresh runtime (``bagf_torch.runtime.reset()``), with BAGF_TUNE=1 and BAGF_BACKGROUND=0:

* the wall time of the WHOLE first call (synchronized before and after; it includes the tuning), against the time
  budget in force (``bagf_torch.settings.budget_seconds()``; ``--seconds S`` sets BAGF_TIME_BUDGET=S) plus the
  allowed overshoot (default 10% + 1 s: ``--overshoot-frac``, ``--overshoot-s``; the time budget ends the search,
  the batch in flight and the finalists' re-timing follow it);
* the plan chosen (``bagf_torch.runtime.get().results[-1]``: family, config, time_us, aten_us, evaluations, seconds,
  phases);
* every record the ``bagf_torch`` logger emitted during the call (a handler on it), and whether one of them is the
  tuner's "<strategy> search of <family> failed ..." warning (a failed search fails the row);
* the plan's quality: at the end of the run, per case, the plans of every context and the stock nn.Conv2d (same
  weights, cuDNN in benchmark mode) are re-timed in one interleaved session of CUDA-graph replays (median), so the
  contexts' plans are compared in the same run: each context's plan time over the ``grad`` context's (the first
  context given when ``grad`` is not) must be within 5% or 2 us (``--quality-frac``, ``--quality-us``).

Process-wide one-time costs (loading the host extension, importing Ax, CUDA and cuDNN initialisation) are paid
before the first timed call and reported apart (``--no-prewarm``: the first row pays Ax's import and cuDNN's start,
as a user's first call in a fresh process does; the extension is loaded for the run's metadata either way).
cuDNN's benchmark-mode algorithm search for a shape is paid by the first context of each case only (torch keeps its
pick for the process). fp32 with TF32 off, as the project measures.

``--model NAME`` (``--alexnet`` is ``--model alexnet``): times ``python -m bagf_torch tune --model NAME --batch
1,32,128 --json FILE [--seconds S] --no-progress`` (``--model-batch``; NAME as the tune command takes it, e.g.
``torchvision:resnet18``) as a subprocess with a fresh cache and tabulates each problem's tuning seconds against the
budget.
The JSON (pretune.ModelReport) holds per problem ``tune_seconds`` = TuneResult.seconds, the tuner's own clock (from
the start of Tuner.tune through the finalists' re-timing; the claim, warm-start lookup and cache writes around it
are not in it), not the per-problem wall time. So the table also gives the wall time between consecutive plan
writes in the fresh cache (``created`` of each plan; the first one includes the process start, imports, the
extension load and the model's discovery pass), and the whole command's wall time.

Writes ``<out>/first_call_<tag>[_<S>s].json`` and ``.md`` (``first_call_<model>_<tag>[_<S>s]`` with --model, e.g.
``first_call_alexnet_h200_25s`` or ``first_call_resnet18_n32_h200_25s_even``, plus its ``.log`` with the command's
output); the ``_<S>s`` suffix only when ``--seconds`` differs from the library's default, ``_even`` with ``--even``. Exit 1 if a row fails (files written first). ``--dry-run`` exercises everything but the GPU on a CPU,
with FAKE numbers marked in every row and in the file names.

    python benchmarks/first_call.py                      # conv3 at N=1,32,128 x grad, no_grad, inference_mode
    python benchmarks/first_call.py --alexnet --seconds 7
    python benchmarks/first_call.py --model torchvision:resnet18 --model-batch 32 --seconds 7
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_overhead as common  # noqa: E402
from bench_overhead import (  # noqa: E402
    REPO, LogCapture, Layer, arm_watchdog, bagf_env, command_line, console_logging, keep_environ, parse_batches,
    parse_layers, pin_build_dir, run_meta, seconds_suffix, to_json, version_line)

from bagf_torch import bench, runtime, settings  # noqa: E402
from bagf_torch.nn import TunedConv2d  # noqa: E402

CONTEXTS = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
DEFAULT_LAYERS = "192:384:13"  # AlexNet's conv3
ALEXNET_PROBLEMS = 5  # conv layers per batch size
OTHER_MODEL_PROBLEMS = 25  # the default timeout's guess for another model (ResNet-50 has 23 distinct convs per batch)


def parse_contexts(text: str) -> list[str]:
    out = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in out if c not in CONTEXTS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"contexts {text!r}: a comma-separated list of {', '.join(CONTEXTS)}")
    return list(dict.fromkeys(out))


def search_failures(records: list[dict]) -> list[str]:
    """The tuner's "<strategy> search of <family> failed on ..." warnings among log records or lines."""
    msgs = [r["message"] if isinstance(r, dict) else r for r in records]
    return [m for m in msgs if " search of " in m and " failed " in m]


def allowed_seconds(budget: float, args) -> float:
    return budget * (1.0 + args.overshoot_frac) + args.overshoot_s


# ---- the cases ------------------------------------------------------------------------------------------

def prewarm(device: torch.device) -> dict:
    """Pay the process's one-time costs before the first timed call: the host extension, Ax's import, CUDA and
    cuDNN (a tiny conv in benchmark mode)."""
    out: dict = {}
    t0 = time.perf_counter()
    from bagf_torch.jit import extension

    extension.load()
    out["extension_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        import ax  # noqa: F401
        from ax import Client  # noqa: F401  (what the default strategy imports)
    except Exception as e:  # the row's tuning will say what is wrong; this is only a warm-up
        out["ax_error"] = f"{type(e).__name__}: {e}"
    out["ax_import_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    conv = torch.nn.Conv2d(8, 8, 3, padding=1).to(device)
    with torch.no_grad():
        conv(torch.randn(1, 8, 8, 8, device=device))
    torch.cuda.synchronize()
    out["cuda_cudnn_s"] = time.perf_counter() - t2
    out["total_s"] = time.perf_counter() - t0
    return out


def result_fields(result) -> dict:
    """The TuneResult of the call (runtime.get().results[-1]) as plain data."""
    from bagf_torch.kernels import family_name

    return {"plan": "aten (cuDNN)" if result.family == "aten" else family_name(result.family, result.config),
            "family": result.family, "config": result.config, "time_us": result.time_us, "aten_us": result.aten_us,
            "default_us": getattr(result, "default_us", None), "evaluations": result.evaluations,
            "tuner_seconds": result.seconds, "phases": {k: round(float(v), 3) for k, v in result.phases.items()}}


def first_call_row(layer: Layer, n: int, ctx: str, stock: torch.nn.Module, args, root: Path, capture: LogCapture,
                   device: torch.device) -> tuple[dict, TunedConv2d, torch.Tensor]:
    """One (case, context): a fresh cache and runtime, the whole first call timed. Returns the row, the module
    (kept for the quality session) and its input."""
    dry = args.dry_run
    hw = min(layer.hw, common.DRY_HW) if dry else layer.hw
    env = {"BAGF_CACHE_DIR": str(root / f"{layer.c}_{layer.k}_{layer.hw}_n{n}_{ctx}"), "BAGF_TUNE": "1",
           "BAGF_BACKGROUND": "0"}
    if args.seconds is not None:
        env["BAGF_TIME_BUDGET"] = f"{args.seconds:g}"
    if args.budget is not None:
        env["BAGF_BUDGET"] = str(args.budget)
    row: dict = {"layer": layer.name, "n": n, "context": ctx}
    with bagf_env(**env):
        budget = settings.budget_seconds()
        row.update(budget_s=budget, allowed_s=allowed_seconds(budget, args), evaluations_budget=
                   settings.budget_evaluations())
        tuned = TunedConv2d.from_conv(copy.deepcopy(stock))
        g = torch.Generator(device="cpu").manual_seed(args.seed + n)
        x = torch.randn(min(n, common.DRY_N) if dry else n, layer.c, hw, hw, generator=g).to(device)
        first = len(capture.records)
        sync = (lambda: None) if dry else torch.cuda.synchronize
        sync()
        t0 = time.perf_counter()
        with CONTEXTS[ctx]():
            y = tuned(x)
        sync()
        row["wall_s"] = time.perf_counter() - t0
        rt = runtime.get()
        row["runtime_stats"] = dict(rt.stats)
        row["log"] = capture.records[first:]
        row["search_failed"] = search_failures(row["log"])
        with torch.no_grad():
            row["max_rel_diff"] = bench.max_rel_diff(y.detach(), stock(x))
        if rt.results:
            row.update(result_fields(rt.results[-1]))
        else:
            row["plan"] = "none: nothing was tuned (see the log records)"
    if dry:  # FAKE: the CPU forward above fell back to ATen; the numbers below are made up
        fake_wall = row["budget_s"] * (1.5 if (args.dry_run_fail and ctx == args.contexts[0]) else 0.9)
        row.update(fake=True, wall_s=fake_wall, plan="dry run: not tuned (CPU)", family="aten", config=None,
                   time_us=100.0, aten_us=120.0, evaluations=0, tuner_seconds=fake_wall,
                   phases={"setup": 0.0, "compile": 0.0, "check": 0.0, "measure": 0.0, "strategy": 0.0,
                           "finalists": 0.0})
    row["within_budget"] = bool(row["wall_s"] <= row["allowed_s"])
    return row, tuned, x


def quality_session(entries: list[tuple[dict, TunedConv2d, torch.Tensor]], stock: torch.nn.Module, args) -> None:
    """Re-time one case's plans (one per context) against the stock conv in one interleaved session of CUDA-graph
    replays; fills each row's plan_us, cudnn_us and the comparison with the reference context."""
    rows = [e[0] for e in entries]
    if args.dry_run:  # FAKE times, the comparison code is real
        times = [120.0] + [100.0 * (1.2 if (args.dry_run_fail and i == len(rows) - 1 and i > 0) else 1.0)
                           for i in range(len(rows))]
    else:
        x = entries[0][2]
        with torch.no_grad(), bagf_env(BAGF_CACHE_DIR=str(Path(args._root) / "quality"), BAGF_TUNE="0"):
            # (a module that has to ask the runtime again finds nothing here and runs ATen; none should)
            replays = [bench.graphed(stock, x)[0]] + [bench.graphed(m, x)[0] for _, m, _ in entries]
            times = common.interleaved_graph_us(replays, args.replays, args.reps)
            del replays
    ref_ctx = "grad" if "grad" in [r["context"] for r in rows] else rows[0]["context"]
    ref_us = times[1 + [r["context"] for r in rows].index(ref_ctx)]
    for i, r in enumerate(rows):
        plan_us = times[1 + i]
        r.update(cudnn_us=times[0], plan_us=plan_us, vs_cudnn=times[0] / plan_us, reference_context=ref_ctx,
                 vs_reference=plan_us / ref_us,
                 quality_pass=bool(abs(plan_us - ref_us) <= max(args.quality_frac * ref_us, args.quality_us)))


def row_pass(r: dict) -> bool:
    return (r.get("within_budget", False) and not r.get("search_failed") and "error" not in r
            and r.get("family") is not None and r.get("quality_pass", True))


def case_table(rows: list[dict]) -> list[str]:
    lines = ["| layer | N | context | budget s | wall s | allowed s | within | plan | evals | tuner s | phases s | "
             "search failed | plan us | cuDNN us | vs cuDNN | vs ref | quality | pass |",
             "|---" * 18 + "|"]
    for r in rows:
        ph = ", ".join(f"{k} {v:.1f}" for k, v in (r.get("phases") or {}).items())
        q = "-" if "quality_pass" not in r else ("ok" if r["quality_pass"] else "FAIL")
        f = lambda key, fmt: format(r[key], fmt) if r.get(key) is not None else "-"  # noqa: E731
        lines.append(f"| {r['layer']} | {r['n']} | {r['context']} | {f('budget_s', '.1f')} | {f('wall_s', '.1f')} | "
                     f"{f('allowed_s', '.1f')} | {'yes' if r.get('within_budget') else 'NO'} | "
                     f"{str(r.get('plan', r.get('error', '?'))).replace('|', '/')} | {f('evaluations', 'd')} | "
                     f"{f('tuner_seconds', '.1f')} | {ph or '-'} | {len(r.get('search_failed') or [])} | "
                     f"{f('plan_us', '.1f')} | {f('cudnn_us', '.1f')} | {f('vs_cudnn', '.2f')} | "
                     f"{f('vs_reference', '.3f')} | {q} | {'yes' if row_pass(r) else 'NO'} |")
    return lines


def write_cases(out: Path, stem: str, meta: dict, rows: list[dict], args, final: bool) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    failed = [r for r in rows if not row_pass(r)]
    summary = {"rows": len(rows), "failed": len(failed), "pass": not failed and final, "complete": final,
               "rule": f"wall <= budget * {1 + args.overshoot_frac:g} + {args.overshoot_s:g} s; no 'search ... failed' "
                       f"warning; plan time within {100 * args.quality_frac:g}% or {args.quality_us:g} us of the "
                       "reference context's (grad)"}
    (out / f"{stem}.json").write_text(to_json({"meta": meta, "summary": summary, "rows": rows}))
    fake = meta.get("dry_run")
    pre = meta.get("prewarm")
    lines = [f"# {'DRY RUN, FAKE NUMBERS: ' if fake else ''}First-call tuning per grad context ({meta['gpu']})", ""]
    if fake:
        lines += ["**DRY RUN: every time below is FAKE (made up on a CPU, not measured).**", ""]
    lines += [version_line(meta), "", f"Command: `{meta['command']}`", "",
              "Wall s: the whole first forward of a TunedConv2d (synchronized), tuning included, each (case, context) "
              "in a fresh cache and runtime, BAGF_TUNE=1. Plan: runtime.get().results[-1]; tuner s: its own clock; "
              "phases: setup / compile / check / measure / strategy / finalists seconds. Plan us and cuDNN us: re-timed at the end of "
              f"the run, one interleaved session of CUDA-graph replays per case (median of {args.reps} medians of "
              f"{args.replays}); vs ref: plan us over the reference context's. fp32, TF32 off, cudnn.benchmark=True. "
              + (f"Process warm-up before the first call (not in any row): {pre['total_s']:.1f} s "
                 f"(extension {pre['extension_s']:.1f}, Ax import {pre['ax_import_s']:.1f}, CUDA/cuDNN "
                 f"{pre['cuda_cudnn_s']:.1f})." if pre else "No warm-up: the first row pays the process's one-time "
                                                            "costs." if not fake else ""),
              "", f"Pass: {summary['rule']}.", ""]
    lines += case_table(rows)
    if not final:
        lines += ["", "(run in progress or cut short: the quality session has not run yet)"]
    lines += ["", f"{len(rows) - len(failed)} of {len(rows)} rows pass."]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return lines


def run_cases(args, meta: dict, out: Path, stem: str, root: Path, capture: LogCapture) -> int:
    rows: list[dict] = []
    device = common.compute_device(args.dry_run)
    if not args.dry_run and args.prewarm:
        meta["prewarm"] = prewarm(device)
        print(f"process warm-up: {meta['prewarm']}", flush=True)
    cases = []
    for layer in args.layers:
        for n in args.batch:
            torch.manual_seed(args.seed)
            stock = layer.conv().to(device).eval()
            entries = []
            for ctx in args.contexts:
                print(f"== {layer.name} N={n} {ctx}", flush=True)
                if not args.dry_run:
                    arm_watchdog(args.watchdog)
                try:
                    entry = first_call_row(layer, n, ctx, stock, args, root, capture, device)
                except Exception as e:
                    traceback.print_exc()
                    entry = ({"layer": layer.name, "n": n, "context": ctx, "error": f"{type(e).__name__}: {e}"},
                             None, None)
                rows.append(entry[0])
                if entry[1] is not None:
                    entries.append(entry)
                print(case_table([entry[0]])[-1], flush=True)
                write_cases(out, stem, meta, rows, args, final=False)
            cases.append((stock, entries))
    for stock, entries in cases:
        if not entries:
            continue
        if not args.dry_run:
            arm_watchdog(args.watchdog)
        try:
            quality_session(entries, stock, args)
        except Exception as e:
            traceback.print_exc()
            for r, _, _ in entries:
                r.update(quality_pass=False, quality_error=f"{type(e).__name__}: {e}")
    lines = write_cases(out, stem, meta, rows, args, final=True)
    print("\n".join(lines))
    return 0 if rows and all(row_pass(r) for r in rows) else 1


# ---- --model: the tune command ---------------------------------------------------------------------------


def model_slug(model: str, batches: list[int]) -> str:
    """The model's part of the file names: ``alexnet`` for AlexNet at the default batches, else the name without its
    ``torchvision:`` prefix and the batches (``resnet18_n32``)."""
    name = model.split(":")[-1].replace(".", "_")
    return name if model == "alexnet" and batches == [1, 32, 128] else f"{name}_n{'_'.join(map(str, batches))}"

def _canon(problem: dict) -> str:
    return json.dumps(problem, sort_keys=True)


def model_rows(report: dict | None, plans: list[dict], started: float, budget: float, args) -> list[dict]:
    """Per problem: the tune command's JSON row (or, without it, the cache's plan), its tuning seconds and the wall
    time since the plan written before it (the first: since the command started)."""
    from bagf_torch.problem import ConvProblem

    gaps, prev = {}, started
    for i, p in enumerate(sorted(plans, key=lambda p: p["created"])):
        gaps[_canon(p["problem"])] = (p["created"] - prev, i == 0)
        prev = p["created"]
    if report is not None:
        source = [{"problem": r["problem"], "short": r.get("short") or ConvProblem.from_dict(r["problem"]).short(),
                   "layers": r.get("layers", []), "plan": r.get("plan"), "evaluations": r.get("evaluations"),
                   "tune_seconds": r.get("tune_seconds"), "time_us": r.get("time_us"), "aten_us": r.get("aten_us"),
                   "cached": r.get("cached", False), "wall_seconds": r.get("wall_seconds"),
                   "phases": dict(r.get("phases") or {}), "from": "tune JSON",
                   "given_s": r.get("budget_seconds")} for r in report.get("rows", [])]
    else:
        source = [{"problem": p["problem"], "short": ConvProblem.from_dict(p["problem"]).short(), "layers": [],
                   "plan": common.plan_name(p), "evaluations": p["evaluations"], "tune_seconds": p["tune_seconds"],
                   "time_us": p["time_us"], "aten_us": p["aten_us"], "cached": False, "wall_seconds": None,
                   "phases": {}, "from": "cache (no tune JSON)", "given_s": None}
                  for p in sorted(plans, key=lambda p: p["created"])]
    rows = []
    for r in source:
        gap, first = gaps.get(_canon(r["problem"]), (None, False))
        # the problem's whole step (cache look, claim, tuning, storing, loading the winner) where the JSON has it,
        # else the tuner's own clock
        spent = r["wall_seconds"] if r["wall_seconds"] is not None else r["tune_seconds"]
        # the seconds the tune command gave this problem (its share of the forward, pretune.allot_seconds)
        given = r.pop("given_s", None) or budget
        allowed = allowed_seconds(given, args)
        r.update(budget_s=given, allowed_s=allowed, wall_gap_s=gap, gap_includes_startup=first,
                 within_budget=bool(r["cached"] or (spent is not None and spent <= allowed)),
                 gap_within=None if gap is None or first else bool(gap <= allowed))
        rows.append(r)
    return rows


def _fake_tune(json_path: Path, cache_dir: Path, batches: list[int]) -> None:
    """The dry run's stand-in for the tune command: a ModelReport JSON and plans in the fresh cache, through the
    library's own classes, so the parsing above meets the real field names."""
    from bagf_torch.cache import Cache
    from bagf_torch.pretune import LayerReport, ModelReport
    from bagf_torch.problem import ConvProblem

    geo = [("0", 3, 224, 64, 11, 4, 2), ("3", 64, 27, 192, 5, 1, 2), ("6", 192, 13, 384, 3, 1, 1),
           ("8", 384, 13, 256, 3, 1, 1), ("10", 256, 13, 256, 3, 1, 1)]  # AlexNet's features
    rows = []
    with Cache.for_dir(cache_dir) as cache:
        for n in batches:
            for name, c, hw, k, ks, st, pd in geo:
                p = ConvProblem(n=n, c=c, h=hw, w=hw, k=k, r=ks, s=ks, stride=(st, st), padding=(pd, pd))
                cache.put_plan(f"fake-{n}-{name}", problem=p.as_dict(), env={"dry_run": True}, family="aten",
                               config=None, time_us=10.0, aten_us=10.0, default_us=None, evaluations=3,
                               tune_seconds=0.5)
                rows.append(LayerReport(problem=p, layers=[f"features.{name}"], plan="aten (cuDNN)", family="aten",
                                        config=None, time_us=10.0, aten_us=10.0, evaluations=3, tune_seconds=0.5,
                                        cached=False, wall_seconds=0.6,
                                        phases={"setup": 0.1, "compile": 0.2, "measure": 0.1, "finalists": 0.1}))
    ModelReport(rows=rows, seconds=0.5 * len(rows)).save(json_path)


def tf32_off_args() -> list[str]:
    """The tune command's words for strict fp32, the mode every other number here is in: ``--tf32 off`` where the
    option takes on|off (without it the command follows torch's default, TF32 on); none where ``--tf32`` is a flag
    (off unless given)."""
    try:
        from bagf_torch import cli

        parser = cli.build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        action = next(a for a in sub.choices["tune"]._actions if "--tf32" in a.option_strings)
        return ["--tf32", "off"] if action.choices and "off" in action.choices else []
    except Exception:  # an unexpected parser: leave the command as the brief gives it
        return []


def run_model(args, meta: dict, out: Path, stem: str, root: Path) -> int:
    from bagf_torch.cache import Cache

    budget = args.seconds if args.seconds is not None else settings.budget_seconds()
    cache_dir, json_path = root / "model_cache", root / "tune_model.json"
    cmd = [sys.executable, "-m", "bagf_torch", "tune", "--model", args.model, "--batch",
           ",".join(map(str, args.model_batch)), "--json", str(json_path), "--no-progress", "--cache", str(cache_dir),
           *tf32_off_args()]
    if args.seconds is not None:
        cmd += ["--seconds", f"{args.seconds:g}"]
    if args.budget is not None:
        cmd += ["--budget", str(args.budget)]
    if args.even:
        cmd += ["--even"]
    if args.dtype != "float32":
        cmd += ["--dtype", args.dtype]
    if args.channels_last:
        cmd += ["--channels-last"]
    env = dict(os.environ, BAGF_CACHE_DIR=str(cache_dir))
    per_batch = ALEXNET_PROBLEMS if args.model == "alexnet" else OTHER_MODEL_PROBLEMS
    timeout = args.model_timeout or (len(args.model_batch) * per_batch * (allowed_seconds(budget, args) + 8) + 120)
    started, t0 = time.time(), time.perf_counter()
    rc, timed_out, stdout, stderr = 0, False, "", ""
    if args.dry_run:
        _fake_tune(json_path, cache_dir, args.model_batch)
        stdout = "dry run: the tune command was not run\n"
    else:
        print(f"running: {' '.join(cmd)} (timeout {timeout:.0f} s)", flush=True)
        faulthandler.cancel_dump_traceback_later()  # this process only waits; the command has its own output
        try:
            r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            rc, stdout, stderr = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            timed_out, rc = True, None
            stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    wall = (0.5 * 5 * len(args.model_batch) + 3.0) if args.dry_run else time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.log").write_text(f"$ {' '.join(cmd)}\n# rc {rc}, timed out {timed_out}, {wall:.1f} s\n"
                                     f"--- stdout\n{stdout}\n--- stderr\n{stderr}\n")
    report = json.loads(json_path.read_text()) if json_path.is_file() else None
    plans = []
    if cache_dir.is_dir():
        with Cache.for_dir(cache_dir) as cache:
            plans = cache.plans()
    rows = model_rows(report, plans, started, budget, args)
    failures = search_failures(stderr.splitlines() + stdout.splitlines())
    tuned = [r for r in rows if not r["cached"]]
    sum_tune = sum(r["tune_seconds"] or 0.0 for r in tuned)
    whole_allowed = sum(r["allowed_s"] for r in tuned) + args.startup_allowance
    summary = {"command_wall_s": wall, "returncode": rc, "timed_out": timed_out, "problems": len(rows),
               "tuned": len(tuned), "sum_tune_seconds": sum_tune, "outside_tuning_s": wall - sum_tune,
               "max_tune_seconds": max((r["tune_seconds"] or 0.0 for r in tuned), default=None),
               "report_seconds": None if report is None else report.get("seconds"),
               "prefetch": None if report is None else report.get("prefetch"),
               "setup": None if report is None else report.get("setup"),
               "command_phases": None if report is None else {
                   k: (report.get("meta") or {}).get(k)
                   for k in ("startup_s", "check_s", "gpu_init_s", "build_s", "inputs_s", "wall_seconds")},
               "whole_allowed_s": whole_allowed, "whole_within": bool(wall <= whole_allowed),
               "search_failed": failures, "source": "tune JSON" if report is not None else "cache (no tune JSON)"}
    summary["pass"] = bool(rc == 0 and rows and all(r["within_budget"] for r in rows) and not failures)
    speeds = [x for x in (speedup(r) for r in rows) if x is not None]
    geo = common.geomean(speeds) if speeds else None
    summary["geomean_speedup"] = geo
    # the model's own speedup: every conv of one forward, cuDNN against the plans (the tune command's sums)
    summary["conv_time_by_batch"] = (report or {}).get("conv_time_by_batch") or {}
    if args.dry_run:
        for r in rows:
            r["fake"] = True
    meta.update(budget_s=budget, allowed_s=allowed_seconds(budget, args), tune_command=" ".join(cmd),
                startup_allowance=args.startup_allowance)
    (out / f"{stem}.json").write_text(to_json({"meta": meta, "summary": summary, "rows": rows, "tune_report": report}))
    lines = model_markdown(meta, summary, rows, args)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if summary["pass"] else 1


def model_markdown(meta: dict, summary: dict, rows: list[dict], args) -> list[str]:
    """The --model result's Markdown, from what its JSON holds (``--from-json`` writes it again)."""
    cmd = meta["tune_command"].split(" ")
    budget = meta["budget_s"]
    wall, rc, timed_out = summary["command_wall_s"], summary["returncode"], summary["timed_out"]
    tuned = [r for r in rows if not r["cached"]]
    sum_tune, whole_allowed, failures = summary["sum_tune_seconds"], summary["whole_allowed_s"], summary["search_failed"]
    speeds = [x for x in (speedup(r) for r in rows) if x is not None]
    geo = summary["geomean_speedup"]
    fake = meta.get("dry_run")
    title = "AlexNet" if args.model == "alexnet" else args.model.split(":")[-1]
    lines = [f"# {'DRY RUN, FAKE NUMBERS: ' if fake else ''}{title} pre-tuning at N = "
             f"{', '.join(map(str, args.model_batch))} through the tune command, per-problem time against the budget "
             f"({meta['gpu']})", ""]
    if fake:
        lines += ["**DRY RUN: every time below is FAKE (made up on a CPU, not measured).**", ""]
    lines += [version_line(meta), "", f"Command: `{meta['command']}`", "", f"Tune command: `{' '.join(cmd)}`", "",
              f"Budget {budget:g} s per problem, allowed {allowed_seconds(budget, args):.1f} s (budget x "
              f"{1 + args.overshoot_frac:g} + {args.overshoot_s:g} s). Tune s is the JSON's `tune_seconds` "
              "(TuneResult.seconds: the tuner's own clock, Tuner.tune through the finalists' re-timing); wall s is "
              "the JSON's `wall_seconds`, the problem's whole step (cache look, claim, tuning, storing, loading the "
              "winner), which 'within' judges where the JSON has it; phases s are the tuner's (setup: float64 "
              "reference and cuDNN's baseline; finalists: the re-timing); wall gap s is the time between this "
              "plan's write to the fresh cache and the one before (the first includes the process start, the "
              "extension load and discovery). plan us and cuDNN us are the tuner's own medians (the winner's re-timing and "
              "cuDNN's baseline in benchmark mode, same process); x cuDNN is their ratio.", "",
              "Given s: the seconds the tune command gave the problem (its share of the forward's stock conv time, "
              "`--seconds` in full for an even share or more; `--even`: all in full); allowed per problem is given "
              f"x {1 + args.overshoot_frac:g} + {args.overshoot_s:g} s.", "",
              "| problem | layers | plan | evals | given s | tune s | wall s | within | phases s | wall gap s | "
              "gap within | plan us | cuDNN us | x cuDNN |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = "-" if r["wall_gap_s"] is None else f"{r['wall_gap_s']:.1f}" + (" (incl. start)" if
                                                                              r["gap_includes_startup"] else "")
        gw = "-" if r["gap_within"] is None else ("yes" if r["gap_within"] else "NO")
        ts = "cached" if r["cached"] else ("-" if r["tune_seconds"] is None else f"{r['tune_seconds']:.1f}")
        ws = "-" if r["wall_seconds"] is None else f"{r['wall_seconds']:.1f}"
        ph = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items()) or "-"
        speed = speedup(r)
        lines.append(f"| {r['short']} | {','.join(r['layers']) or '-'} | {str(r['plan']).replace('|', '/')} | "
                     f"{r['evaluations']} | {r['budget_s']:.1f} | {ts} | {ws} | {'yes' if r['within_budget'] else 'NO'} | "
                     f"{ph} | {gap} | "
                     f"{gw} | {_us(r.get('time_us'))} | {_us(r.get('aten_us'))} | "
                     f"{'-' if speed is None else f'{speed:.2f}'} |")
    lines += ["", f"Whole command: {wall:.1f} s wall (rc {rc}{', TIMED OUT' if timed_out else ''}) for {len(tuned)} "
              f"tuned problems; tuning {sum_tune:.1f} s of it, {wall - sum_tune:.1f} s outside the tuner"
              + (f" (of which {summary['prefetch']['seconds']:.1f} s compiling {summary['prefetch']['configs']} start "
                 "points up front)" if (summary.get("prefetch") or {}).get("configs") else "") + "; "
              + _outside_words(summary) + "within "
              f"the problems' allowed seconds + {args.startup_allowance:g} s = "
              f"{whole_allowed:.1f} s: {'yes' if summary['whole_within'] else 'NO'}. 'search ... failed' warnings: "
              f"{len(failures)}. Source of the rows: {summary['source']}. Geomean x cuDNN over {len(speeds)} problems: "
              f"{'-' if geo is None else f'{geo:.3f}'}.",
              *[f"All convs of one forward at N={n}: cuDNN {t['cudnn_us']:.1f} us, planned {t['planned_us']:.1f} us "
                f"({t['cudnn_us'] / t['planned_us']:.2f}x), by the tuner's timings."
                for n, t in summary["conv_time_by_batch"].items() if t.get("planned_us")],
              "", f"Pass (rc 0, every problem within, no failed search): {'yes' if summary['pass'] else 'NO'}."]
    return lines


def rewrite_markdown(path: Path) -> int:
    """``--from-json``: a --model result's Markdown from its JSON, with the settings the run had."""
    doc = json.loads(path.read_text())
    meta = doc["meta"]
    words = meta["tune_command"].split(" ")
    args = build_parser().parse_args([
        "--model", words[words.index("--model") + 1], "--model-batch", words[words.index("--batch") + 1],
        "--overshoot-frac", str(meta.get("overshoot_frac", 0.10)), "--overshoot-s", str(meta.get("overshoot_s", 1.0)),
        "--startup-allowance", str(meta.get("startup_allowance", 60.0))])
    lines = model_markdown(meta, doc["summary"], doc["rows"], args)
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def speedup(row: dict) -> float | None:
    """cuDNN's time over the plan's (the tuner's own medians in the tune JSON), or None where either is missing."""
    t, a = row.get("time_us"), row.get("aten_us")
    return a / t if t and a else None


def _outside_words(summary: dict) -> str:
    """Where the time outside the tuner went, as far as the tune command's JSON says: the interpreter's start and
    imports before the command's clock, building the model, and tune_model's steps before the first problem."""
    cp = summary.get("command_phases") or {}
    setup = summary.get("setup") or {}
    parts = []
    for key, words in (("startup_s", "process start and imports"), ("check_s", "the model's name checked"),
                       ("gpu_init_s", "the extension and the GPU's context"), ("build_s", "building the model"),
                       ("inputs_s", "the example inputs")):
        if cp.get(key) is not None:
            parts.append(f"{words} {cp[key]:.1f} s")
    for key, words in (("discover_s", "discovery"), ("stock_s", "torch's conv timed per problem"),
                       ("prefetch_wait_s", "waiting for the start points' compiles (and the strategy's imports) after that")):
        if setup.get(key) is not None:
            parts.append(f"{words} {setup[key]:.1f} s")
    return f"outside the tuner: {', '.join(parts)}; " if parts else ""


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


# ---- main ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=parse_layers, default=parse_layers(DEFAULT_LAYERS),
                    help=f"C:K:HW[:kernel[:stride[:padding]]], comma-separated ({DEFAULT_LAYERS}: AlexNet's conv3)")
    ap.add_argument("--batch", type=parse_batches, default=parse_batches("1,32,128"), help="batch sizes (1,32,128)")
    ap.add_argument("--contexts", type=parse_contexts, default=list(CONTEXTS),
                    help="grad contexts: grad, no_grad, inference_mode (all three)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="time budget per problem: sets BAGF_TIME_BUDGET (default: the one in force, "
                         f"library default {settings.DEFAULT_TIME_BUDGET:g})")
    ap.add_argument("--budget", type=int, default=None, help="evaluations per problem: sets BAGF_BUDGET")
    ap.add_argument("--overshoot-frac", type=float, default=0.10, help="allowed: budget * (1 + FRAC) + S (0.10)")
    ap.add_argument("--overshoot-s", type=float, default=1.0, help="... + S seconds (1.0)")
    ap.add_argument("--quality-frac", type=float, default=0.05, help="plan time within FRAC of the grad plan's (0.05)")
    ap.add_argument("--quality-us", type=float, default=2.0, help="... or within US microseconds (2)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays per repetition, quality session (20)")
    ap.add_argument("--reps", type=int, default=21, help="interleaved repetitions, quality session (21)")
    ap.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                    help="no process warm-up: the first row pays Ax's import and cuDNN's initialisation (the host "
                         "extension is loaded before any row either way, for the run's metadata)")
    ap.add_argument("--model", default=None,
                    help="time `python -m bagf_torch tune --model MODEL` instead (alexnet, torchvision:<name>)")
    ap.add_argument("--alexnet", dest="model", action="store_const", const="alexnet", help="--model alexnet")
    ap.add_argument("--model-batch", "--alexnet-batch", dest="model_batch", type=parse_batches,
                    default=parse_batches("1,32,128"), help="--model: batch sizes (1,32,128)")
    ap.add_argument("--model-timeout", "--alexnet-timeout", dest="model_timeout", type=float, default=0.0,
                    help="--model: seconds before the command is killed (0: problems x (allowed + 8) + 120, with "
                         f"{ALEXNET_PROBLEMS} problems per batch for AlexNet, {OTHER_MODEL_PROBLEMS} for another model)")
    ap.add_argument("--even", action="store_true",
                    help="--model: the tune command's --even (every problem the full --seconds, not by its share)")
    ap.add_argument("--startup-allowance", type=float, default=60.0,
                    help="--model: the whole command may take tuned problems x allowed + this (60 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="--model: the tune command's --dtype (the model and inputs in it)")
    ap.add_argument("--channels-last", action="store_true", help="--model: the tune command's --channels-last")
    ap.add_argument("--out", help="directory for the results (benchmarks/results; dry run: a temporary one)")
    ap.add_argument("--tag", help="file name tag (default: the GPU's, h200 or h100; a dry run's: cpu)")
    ap.add_argument("--watchdog", type=float, default=180.0,
                    help="dump all stacks to stderr when one first call or quality session takes over this many s "
                         "(0: off)")
    ap.add_argument("--dry-run", action="store_true", help="CPU only: real bookkeeping, FAKE times")
    ap.add_argument("--from-json", type=Path, metavar="JSON",
                    help="--model results: write the Markdown of this earlier result again, beside it (no GPU)")
    ap.add_argument("--dry-run-fail", action="store_true", help=argparse.SUPPRESS)  # tests: the failure exit
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_line("first_call.py", argv)
    args = build_parser().parse_args(argv)
    if args.from_json:
        return rewrite_markdown(args.from_json)
    if not args.dry_run and not torch.cuda.is_available():
        print("first_call: no CUDA GPU here; use --dry-run to check the script on a CPU", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="bagf_dryrun_")) if args.dry_run
                                           else REPO / "benchmarks" / "results")
    stem = (f"first_call{'_' + model_slug(args.model, args.model_batch) if args.model else ''}"
            + f"_{common.result_tag(args.tag, args.dry_run)}"
            + seconds_suffix(args.seconds, settings.DEFAULT_TIME_BUDGET) + ("_even" if args.model and args.even else "")
            + ("_dryrun" if args.dry_run else ""))
    console_logging()
    flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    capture = LogCapture()
    try:
        with keep_environ(), tempfile.TemporaryDirectory(prefix="bagf_first_call_") as tmp, capture.attached():
            pin_build_dir()
            args._root = tmp
            with bagf_env(BAGF_CACHE_DIR=str(Path(tmp) / "meta")):
                meta = run_meta(command, args.dry_run)
            meta.update(seconds_arg=args.seconds, budget_arg=args.budget, overshoot_frac=args.overshoot_frac,
                        overshoot_s=args.overshoot_s, tf32=False, cudnn_benchmark=True)
            if args.model:
                rc = run_model(args, meta, out, stem, Path(tmp))
            else:
                meta.update(contexts=args.contexts, layers=[la.name for la in args.layers], batch=args.batch)
                rc = run_cases(args, meta, out, stem, Path(tmp), capture)
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags
        if args.watchdog > 0 and not args.dry_run:
            faulthandler.cancel_dump_traceback_later()
    print(f"results: {out / (stem + '.json')} and .md")
    return rc


if __name__ == "__main__":
    sys.exit(main())

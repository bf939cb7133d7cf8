"""Bound-guided pruning (bagf_torch.iobound.prune) evaluated on a recorded space: how much of the space each
factor cuts, and what the best recorded time among the kept configurations loses against the recording's
true optimum (the bar: keep the optimum or lose < 2%).

Runs on a CPU from a recording (benchmarks/data/README.md); the times are the recording's medians, nothing is
measured here. A problem whose recording is partial (``complete: false``: the recorder's time limit was hit)
has no known optimum: it is reported separately, labelled partial, against its best *recorded* time, and
left out of the verdict. The tuner keeps the family's DEFAULT whatever the factor, so this does too.

    python benchmarks/probes/prune_analysis.py                       # the H200 implicit_gemm_tc recording
    python benchmarks/probes/prune_analysis.py --factors 1.5 2 4 --out-stem /tmp/prune

Writes ``<out-stem>.json`` and ``<out-stem>.md`` (default ``benchmarks/results/prune_h200_tc``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from bagf_torch import iobound  # noqa: E402
from bagf_torch.kernels.space import config_key  # noqa: E402
from bagf_torch.problem import ConvProblem  # noqa: E402
from bagf_torch.tuning.replay import load_recording  # noqa: E402

FACTORS = (1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
BAR = 0.02  # lose < 2% against the optimum


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def _modelled(rp) -> bool:
    """Whether iobound has a traffic model for this problem's family *and* the family computes the problem
    (winograd's model, like its kernel, takes only 3x3 stride-1 convolutions and raises on others)."""
    if not iobound.has_model(rp.family):
        return False
    applies = getattr(importlib.import_module(f"bagf_torch.kernels.{rp.family}"), "applies", None)
    return applies is None or applies(ConvProblem.from_dict(rp.conv)) is None


def analyse(rp, factors) -> dict:
    problem = ConvProblem.from_dict(rp.conv)
    records = rp.records(cutoff="time")  # a cut-off row is one sample >= 3x the best so far: never the optimum
    timed = [r for r in records if r["status"] == "ok"]
    # Prune the family's whole valid space (not just what was recorded), so that for a partial recording
    # "best traffic" is still the space's minimum; every recorded configuration must belong to that space.
    family = importlib.import_module(f"bagf_torch.kernels.{rp.family}")
    configs = family.space().valid_configs()
    in_space = {config_key(c) for c in configs}
    stray = [r["config"] for r in records if config_key(r["config"]) not in in_space]
    if stray:
        raise SystemExit(f"{rp.key}: {len(stray)} recorded configurations are not in today's {rp.family} space "
                         f"(e.g. {stray[0]}); the recording is for other kernel sources")
    times = {config_key(r["config"]): r["time_us"] for r in timed}
    totals = {config_key(c): iobound.traffic(rp.family, problem, c).total for c in configs}
    min_traffic = min(totals.values())
    opt_key = min(times, key=times.get)
    opt_us = times[opt_key]
    keys = list(times)
    t_arr = np.array([times[k] for k in keys])
    q_arr = np.array([totals[k] for k in keys], dtype=float)
    default = [rp.default] if rp.default else []
    rows = []
    for f in factors:
        kept, pruned = iobound.prune(rp.family, configs, problem, factor=f, always=default)
        kept_times = [times[config_key(c)] for c in kept if config_key(c) in times]
        best_kept = min(kept_times) if kept_times else None
        rows.append({
            "factor": f, "kept": len(kept), "of": len(configs), "cut": len(pruned) / len(configs),
            "optimum_kept": any(config_key(c) == opt_key for c in kept),
            "best_kept_us": best_kept,
            "loss": None if best_kept is None else best_kept / opt_us - 1.0,
        })
    opt = dict(opt_key)
    min_key = min(totals, key=totals.get)
    return {
        "name": rp.name, "family": rp.family, "complete": rp.complete, "problem": problem.short(),
        "recorded": len(records), "timed": len(timed), "valid": rp.valid,
        "optimum": {"config": opt, "us": opt_us, "traffic_words": totals[opt_key],
                    "traffic_ratio": totals[opt_key] / min_traffic},
        "min_traffic": {"config": dict(min_key), "words": min_traffic, "us": times.get(min_key)},
        "optimum_is_default": bool(rp.default) and opt_key == config_key(rp.default),
        "default": {"config": rp.default, "us": times.get(config_key(rp.default)) if rp.default else None},
        "spearman_traffic_time": _spearman(q_arr, t_arr),
        "factors": rows,
    }


def _fmt_loss(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(doc: dict) -> str:
    meta = doc["recording_meta"]
    out = [f"# Bound-guided pruning on {doc['recording']}", "",
           f"Recording: {meta.get('gpu')} (sm {meta.get('compute_capability')}), recorded {meta.get('date')}, "
           f"torch {meta.get('versions', {}).get('torch')}. Analysis run {doc['date']} on a CPU "
           "(times are the recording's medians; traffic is bagf_torch.iobound's model).", "",
           f"Per factor, over the {doc.get('summary_over', 'complete')} problems: share of the space cut (the family "
           "DEFAULT is always kept), and the loss of the best kept configuration against the recorded optimum.", "",
           "| factor | cut (mean) | cut (min-max) | optimum kept | worst loss | mean loss | problems within 2% |",
           "|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        out.append(f"| {s['factor']:g} | {100 * s['cut_mean']:.1f}% | {100 * s['cut_min']:.1f}-"
                   f"{100 * s['cut_max']:.1f}% | {s['optimum_kept']}/{s['problems']} | {_fmt_loss(s['worst_loss'])} "
                   f"| {_fmt_loss(s['mean_loss'])} | {s['within_bar']}/{s['problems']} |")
    out += ["", "Per problem (complete ones first): the optimum's traffic / the minimum traffic is the smallest "
            "factor that keeps the optimum; Spearman is the rank correlation of modelled traffic and time "
            "over all timed configurations.", "",
            "| problem | complete | optimum us | optimum config | optimum traffic / min | min-traffic config us "
            "| Spearman | " + " | ".join(f"loss x{f:g}" for f in doc["factors"]) + " |",
            "|---|---|---|---|---|---|---|" + "---|" * len(doc["factors"])]
    for p in sorted(doc["problems"], key=lambda p: not p["complete"]):
        o, m = p["optimum"], p["min_traffic"]
        cfg = "_".join(f"{k.lower()}{v}" for k, v in o["config"].items())
        label = "yes" if p["complete"] else f"PARTIAL ({p['recorded']}/{p['valid']})" + (
            ", best recorded = DEFAULT" if p["optimum_is_default"] else "")
        min_us = "-" if m["us"] is None else f"{m['us']:.1f}"
        out.append(f"| {p['name']} | {label} | {o['us']:.1f} | {cfg} | {o['traffic_ratio']:.2f} | "
                   f"{min_us} | {p['spearman_traffic_time']:.2f} | "
                   + " | ".join(_fmt_loss(r["loss"]) for r in p["factors"]) + " |")
    in_summary = ("they are in the summary only because no problem is complete (a sampled recording)"
                  if doc.get("summary_over", "complete") != "complete" else "they are not in the summary")
    out += ["", "For PARTIAL problems the 'optimum' is only the best recorded time (columns: recorded/valid "
            f"configurations); {in_summary}. Where that best recorded configuration is the "
            "DEFAULT (which pruning always keeps) their loss is 0 by construction and says nothing."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recording", default=str(ROOT / "benchmarks/data/implicit_gemm_tc_h200.json.gz"))
    ap.add_argument("--factors", type=float, nargs="+", default=list(FACTORS))
    ap.add_argument("--out-stem", default=str(ROOT / "benchmarks/results/prune_h200_tc"))
    args = ap.parse_args(argv)
    rec = load_recording(args.recording)
    if rec.synthetic:
        raise SystemExit(f"{args.recording} is SYNTHETIC; this analysis is for measured recordings only")
    problems = [analyse(rp, args.factors) for rp in rec.problems if _modelled(rp)]
    complete = [p for p in problems if p["complete"]]
    summary_over = "complete"
    if not complete:  # a sampled recording: the reference is the best of the sample, said so in the output
        complete, summary_over = problems, "partial (sampled): each problem's best recorded time is the reference"
    summary = []
    for i, f in enumerate(args.factors):
        rows = [p["factors"][i] for p in complete]
        losses = [r["loss"] for r in rows]
        summary.append({"factor": f, "problems": len(rows), "cut_mean": float(np.mean([r["cut"] for r in rows])),
                        "cut_min": min(r["cut"] for r in rows), "cut_max": max(r["cut"] for r in rows),
                        "optimum_kept": sum(r["optimum_kept"] for r in rows), "worst_loss": max(losses),
                        "mean_loss": float(np.mean(losses)), "within_bar": sum(x < BAR for x in losses)})
    doc = {"recording": str(Path(args.recording).relative_to(ROOT)) if Path(args.recording).is_relative_to(ROOT)
           else args.recording, "recording_meta": rec.meta, "date": dt.date.today().isoformat(),
           "bagf_command": " ".join(["benchmarks/probes/prune_analysis.py"] + (argv if argv is not None else sys.argv[1:])),
           "factors": args.factors, "bar": BAR, "summary_over": summary_over, "summary": summary,
           "problems": problems}
    stem = Path(args.out_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=lambda o: float(o)) + "\n")
    md = markdown(doc)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

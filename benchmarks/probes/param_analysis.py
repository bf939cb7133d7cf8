"""How much each knob moves the time, from recorded spaces (no GPU).

For every recorded problem, knob and value: the best recorded time with the knob fixed to that value,
divided by the problem's optimum (1.00 = this value can reach the optimum; 1.50 = fixing it costs 50%).
The "worst value" column of the summary is, per knob, the largest such ratio: how much a bad choice of
that knob alone costs when every other knob is tuned. Also the tuned-vs-default speedup per problem
(the family's default configuration's recorded time over the optimum) and the optimum against cuDNN
when the recording has cuDNN's time.

Only problems whose family record is complete are analysed by default (a partial recording's optimum is
unknown, so every ratio would be against the best of a subset); the excluded ones are listed with the
reason. --partial adds them, labelled PARTIAL, with ratios against the recorded subset's best.
A "cutoff" row (one sample, > 3x the recorder's best so far) counts with that sample, an upper bound of its
time; it can never be a problem's optimum nor a knob value's best unless every row with that value was cut.

    python benchmarks/probes/param_analysis.py                                   # benchmarks/data/*.json.gz
    python benchmarks/probes/param_analysis.py --data FILE.json.gz --md out.md --json out.json --png knobs.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


from bagf_torch.tuning.replay import RecordedProblem, load_recording, newest_complete  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"


def analyse(rp: RecordedProblem) -> dict:
    """Per-knob best-time ratios and the default/cuDNN comparison of one recorded problem."""
    ok = [(dict(zip(rp.knobs, r["config"])), float(r["median_us"])) for r in rp.rows
          if r["status"] in ("ok", "cutoff")]
    if not ok:
        return {"problem": rp.key, "error": "no configuration ran"}
    best_config, optimum = min(ok, key=lambda t: t[1])
    knobs = {}
    for k in rp.knobs:
        values = sorted({c[k] for c, _ in ok} | {v for v in (best_config[k],)})
        per = {}
        for v in values:
            times = [t for c, t in ok if c[k] == v]
            per[str(v)] = min(times) / optimum if times else None
        knobs[k] = per
    default_us = None
    if rp.default is not None:
        key = [rp.default[k] for k in rp.knobs]
        row = next((r for r in rp.rows if list(r["config"]) == key), None)
        if row is not None and row["status"] in ("ok", "cutoff"):
            default_us = float(row["median_us"])
    cudnn_us = float(rp.cudnn["median_us"]) if rp.cudnn else None
    return {"problem": rp.key if rp.complete else f"{rp.key} PARTIAL {len(rp.rows)}/{rp.valid}",
            "complete": rp.complete, "optimum_us": optimum, "best_config": best_config, "knobs": knobs,
            "default_us": default_us, "tuned_vs_default": default_us / optimum if default_us else None,
            "cudnn_us": cudnn_us, "tuned_vs_cudnn": cudnn_us / optimum if cudnn_us else None,
            "ok": len(ok), "rows": len(rp.rows)}


def markdown(results: list[dict], synthetic: bool, excluded: dict | None = None, source: str = "") -> str:
    tag = " **SYNTHETIC data (not GPU measurements)**" if synthetic else ""
    lines = [f"# Per-knob analysis of recorded spaces{tag}", ""]
    if source:
        lines += [source, ""]
    if excluded:
        lines += ["Excluded (--partial adds them, against the best of the recorded subset):", ""]
        lines += [f"- {k}: {why}" for k, why in excluded.items()] + [""]
    lines += [
             "Tuned vs default: the default configuration's time over the optimum (> 1: tuning pays). "
             "vs cuDNN: cuDNN's time over the optimum (> 1: our best beats cuDNN).", "",
             "| problem | optimum us | best configuration | default us | tuned vs default | cuDNN us | vs cuDNN |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    for r in results:
        if "error" in r:
            lines.append(f"| {r['problem']} | {r['error']} |||||| ")
            continue
        cfg = " ".join(f"{k}{v}" for k, v in r["best_config"].items())
        lines.append(f"| {r['problem']} | {r['optimum_us']:.1f} | {cfg} | {fmt(r['default_us'], '{:.1f}')} | "
                     f"{fmt(r['tuned_vs_default'], '{:.2f}x')} | {fmt(r['cudnn_us'], '{:.1f}')} | "
                     f"{fmt(r['tuned_vs_cudnn'], '{:.2f}x')} |")
    good = [r for r in results if "error" not in r]
    if good:
        knobs = list(good[0]["knobs"])
        lines += ["", "Best time with the knob fixed to a value / optimum: geometric mean over problems "
                  "(1.00 = that value loses nothing; \"-\" = that value never ran).", "",
                  "| knob | values | worst value costs (max over problems) |", "|---|---|---|"]
        for k in knobs:
            values = sorted({v for r in good for v in r["knobs"][k]}, key=lambda s: int(s))
            cells = []
            for v in values:
                ratios = [r["knobs"][k].get(v) for r in good]
                ratios = [x for x in ratios if x is not None]
                cells.append(f"{v}: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}" if ratios else f"{v}: -")
            worst = max((x for r in good for x in r["knobs"][k].values() if x is not None), default=None)
            lines.append(f"| {k} | {', '.join(cells)} | {fmt(worst, '{:.2f}x')} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install bagf_torch[plot]): no plot", file=sys.stderr)
        return False
    good = [r for r in results if "error" not in r]
    knobs = list(good[0]["knobs"])
    fig, axes = plt.subplots(1, len(knobs), figsize=(2.6 * len(knobs), 3.2), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], knobs):
        values = sorted({v for r in good for v in r["knobs"][k]}, key=int)
        for r in good:
            ys = [r["knobs"][k].get(v) for v in values]
            ax.plot(range(len(values)), [y if y is not None else float("nan") for y in ys], marker="o", lw=0.8,
                    alpha=0.6, label=r["problem"].split("/")[0])
        ax.set_xticks(range(len(values)), values)
        ax.set_title(k)
        ax.set_yscale("log")
    axes[0][0].set_ylabel("best time with knob fixed / optimum")
    axes[0][-1].legend(fontsize=5, loc="upper right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="*", help="recorded-space files (default: benchmarks/data/*.json.gz)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--png")
    ap.add_argument("--partial", action="store_true", help="also analyse partial recordings (labelled PARTIAL)")
    args = ap.parse_args(argv)
    files = [Path(p) for p in args.data] if args.data else sorted(DATA.glob("*.json.gz"))
    if not files:
        print(f"no recorded spaces under {DATA}; pass --data FILE", file=sys.stderr)
        return 2
    results, synthetic, excluded, sources = [], False, {}, []
    recordings = {Path(f): load_recording(f) for f in files}  # each file read once
    newest = newest_complete(files, recordings)  # a problem recorded again is analysed once, from its newest one
    for f in files:
        rec = recordings[Path(f)]
        synthetic = synthetic or rec.synthetic
        sources.append(f"{Path(f).name}: {rec.meta.get('gpu')}, recorded {rec.meta.get('date')}")
        for rp in rec.problems:
            if rp.key in newest and newest[rp.key] != Path(f):
                excluded[f"{rp.key} in {Path(f).name}"] = f"analysed from its recording in {newest[rp.key].name}"
            elif rp.complete or args.partial:
                results.append(analyse(rp))
            else:
                excluded[rp.key] = rp.partial_reason
    for k, why in excluded.items():
        print(f"excluded {k}: {why}" + (" (--partial analyses its recorded subset)" if why.startswith("partial") else ""),
              file=sys.stderr)
    if not results:
        print("no problem left to analyse", file=sys.stderr)
        return 2
    source = "From " + "; ".join(sources) + " (no GPU used here: an analysis of the recorded times)."
    md = markdown(results, synthetic, excluded, source)
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"synthetic": synthetic, "data": [str(f) for f in files],
                                               "sources": sources, "excluded": excluded, "problems": results},
                                              indent=1))
    if args.png:
        plot(results, args.png, ("SYNTHETIC data: " if synthetic else "") + "per-knob cost; " + "; ".join(sources))
    return 0


if __name__ == "__main__":
    sys.exit(main())

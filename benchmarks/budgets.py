"""What a shorter tuning budget costs in plan speed: the plans two pre-tunings picked, re-timed side by side.

    python -m bagf_torch tune --model alexnet --batch 1,32,128 --seconds 7 --json fast.json --cache DIR_A
    python -m bagf_torch tune --model alexnet --batch 1,32,128 --seconds 25 --json slow.json --cache DIR_B
    python benchmarks/budgets.py --fast fast.json --slow slow.json [--rounds 7] [--tag alexnet_h200]

Each JSON is a ``tune --json`` report, or a ``benchmarks/first_call.py --alexnet`` result (its ``tune_report``).
For every problem both tunings planned, the two plans (a tuned kernel, or cuDNN where the tuner kept it) and cuDNN
are timed in one process, interleaved round by round (each tuned kernel checked against float64 first, as the tuner
checks it): GPU time per call in a CUDA graph
(the same as ``host_floor.py``), cuDNN in benchmark mode in the problem's TF32 mode. Per problem: each tuning's
time (wall where the report has it), each plan's GPU time, and the fraction of the slow plan's speed the fast one
reaches (slow us / fast us). Summary: the geomean and the lowest fraction, how many problems reach
``--keep`` (0.97), each tuning's total time and its geomean speedup over cuDNN on these timings.
Writes ``budgets_<tag>.{json,md}`` under ``--out``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # this folder, for bench_overhead's helpers

from bench_overhead import command_line, geomean, git_commit, to_json  # noqa: E402


def tune_rows(path: Path) -> tuple[dict, list[dict]]:
    """(the report's summary fields, its rows) of a ``tune --json`` report or a first_call.py --alexnet result."""
    data = json.loads(Path(path).read_text())
    report = data.get("tune_report", data)
    meta = data.get("meta") or report.get("meta") or {}  # first_call.py's, or the tune command's own
    wall = data.get("summary", {}).get("command_wall_s") or meta.get("wall_seconds")
    summary = {"seconds": report.get("seconds"), "command_wall_s": wall, "meta": meta}
    return summary, list(report["rows"])


def problem_key(row: dict):
    """The row's problem as a ConvProblem (fields a report of another version lacks take their defaults)."""
    from bagf_torch.problem import ConvProblem

    return ConvProblem.from_dict(row["problem"])


def pair_rows(fast: list[dict], slow: list[dict]) -> list[tuple[dict, dict]]:
    """The rows of the problems both reports planned, in the fast report's order."""
    by_key = {problem_key(r): r for r in slow}
    return [(r, by_key[problem_key(r)]) for r in fast if problem_key(r) in by_key]


def summarise(rows: list[dict], keep: float) -> dict:
    """Geomean / lowest fraction of the slow plans' speed the fast plans reach, and each budget's speedup."""
    fractions = [r["fraction"] for r in rows]
    return {"problems": len(rows), "geomean_fraction": geomean(fractions), "min_fraction": min(fractions),
            "kept": sum(f >= keep for f in fractions), "keep": keep,
            "fast_geomean_speedup": geomean([r["cudnn_us"] / r["fast_us"] for r in rows]),
            "slow_geomean_speedup": geomean([r["cudnn_us"] / r["slow_us"] for r in rows]),
            "fast_tune_s": sum(r["fast_s"] for r in rows), "slow_tune_s": sum(r["slow_s"] for r in rows),
            "fast_max_s": max(r["fast_s"] for r in rows), "forward": forward_times(rows)}


def forward_times(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per batch size, every conv of one forward: each problem's us times its layers (a problem without layer
    names counts once), for cuDNN and each budget's plans -- the model's own speedup, which a geomean over
    problems weighs the 1x1 downsampling layers as much as the 3x3 ones that hold the time."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        acc = out.setdefault(str(r["problem"]["n"]), {"cudnn_us": 0.0, "fast_us": 0.0, "slow_us": 0.0})
        for k in acc:
            acc[k] += max(1, len(r.get("layers") or [])) * r[k]
    return out


def _seconds(row: dict) -> float:
    for key in ("wall_seconds", "tune_seconds"):
        if row.get(key) is not None:
            return float(row[key])
    return 0.0


def _plan_name(row: dict) -> str:
    return "cuDNN" if row.get("family") in (None, "aten") else row.get("plan") or row["family"]


def measure(pairs: list[tuple[dict, dict]], rounds: int) -> list[dict]:
    import torch

    from host_floor import interleaved_graph_us

    from bagf_torch import runtime
    from bagf_torch.kernels import FAMILIES, complete_config
    from bagf_torch.ops import ATEN
    from bagf_torch.problem import ConvProblem
    from bagf_torch.tuning.measure import CudaBenchmarker, CudaChecker, Workspace

    dev = runtime.get().device(0)
    bench, checker = CudaBenchmarker(), CudaChecker(dev.compiler.ext)
    out = []
    for fast, slow in pairs:
        p = ConvProblem.from_dict(fast["problem"])
        ws = Workspace(p, torch.device("cuda", 0))
        handles, loaded = {}, []
        for who, row in (("fast", fast), ("slow", slow)):
            if row.get("family") in (None, "aten"):
                handles[who] = ATEN
                continue
            # a report older than a knob of the family names its plan without it: the knob's LEGACY value is the
            # kernel that ran then
            config = complete_config(row["family"], row["config"])
            built = dev.compiler.compile(FAMILIES[row["family"]], [config])[0]
            if not hasattr(built, "handle"):
                raise SystemExit(f"{row['plan']} for {p.short()} did not build: {built.status} {built.detail}")
            bad = checker.check(ws, built.handle)
            if bad is not None:
                raise SystemExit(f"{row['plan']} for {p.short()} fails the check: {bad.detail}")
            handles[who] = built.handle
            loaded.append(built.handle)
        calls = {"cudnn": bench._call(ws, ATEN), "fast": bench._call(ws, handles["fast"]),
                 "slow": bench._call(ws, handles["slow"])}
        with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=p.tf32):
            us = interleaved_graph_us(calls, bench, rounds)
        row = {"problem": fast["problem"], "short": p.short(), "layers": fast.get("layers", []),
               "fast_plan": _plan_name(fast), "slow_plan": _plan_name(slow),
               "fast_s": _seconds(fast), "slow_s": _seconds(slow),
               "fast_evaluations": fast.get("evaluations"), "slow_evaluations": slow.get("evaluations"),
               "fast_phases": fast.get("phases"), "slow_phases": slow.get("phases"),
               "cudnn_us": us["cudnn"], "fast_us": us["fast"], "slow_us": us["slow"],
               "fraction": us["slow"] / us["fast"]}
        for h in loaded:
            dev.compiler.unload(h)
        out.append(row)
        print(json.dumps({k: row[k] for k in ("short", "fast_plan", "slow_plan", "cudnn_us", "fast_us", "slow_us",
                                              "fraction", "fast_s", "slow_s")}), flush=True)
    return out


def markdown(meta: dict, rows: list[dict], summary: dict) -> str:
    lines = [f"# Plan speed of a fast tuning budget against a slow one ({meta['gpu']})", "",
             f"{meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, Python "
             f"{meta['python']}; commit `{meta['commit']}`.", "", f"Command: `{meta['command']}`", "",
             f"Fast: `{meta['fast']}` ({meta['fast_source']}); slow: `{meta['slow']}` ({meta['slow_source']}).", "",
             f"Each problem's two plans and cuDNN re-timed in this run, interleaved over {meta['rounds']} rounds: GPU us "
             "per call in a CUDA graph (median over rounds), cuDNN in benchmark mode. fraction = slow us / fast us "
             "(1.00: the fast budget's plan is as fast). Tune s: the problem's wall time in the report where it has "
             "it, else the tuner's own.", "",
             "| problem | fast plan | slow plan | fast s | slow s | cuDNN us | fast us | slow us | fraction | "
             "fast x cuDNN | slow x cuDNN |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['short']} | {r['fast_plan']} | {r['slow_plan']} | {r['fast_s']:.1f} | {r['slow_s']:.1f} "
                     f"| {r['cudnn_us']:.1f} | {r['fast_us']:.1f} | {r['slow_us']:.1f} | {r['fraction']:.3f} | "
                     f"{r['cudnn_us'] / r['fast_us']:.2f} | {r['cudnn_us'] / r['slow_us']:.2f} |")
    s = summary
    lines += ["", f"{s['problems']} problems: fraction geomean {s['geomean_fraction']:.3f}, lowest "
              f"{s['min_fraction']:.3f}; {s['kept']} of {s['problems']} at >= {s['keep']:.2f}. Geomean over cuDNN: "
              f"fast {s['fast_geomean_speedup']:.2f}x, slow {s['slow_geomean_speedup']:.2f}x. Tuning time: fast "
              f"{s['fast_tune_s']:.1f} s in all (at most {s['fast_max_s']:.1f} s per problem), slow "
              f"{s['slow_tune_s']:.1f} s."]
    for n, t in (s.get("forward") or {}).items():
        fast, slow = t["cudnn_us"] / t["fast_us"], t["cudnn_us"] / t["slow_us"]
        lines.append(f"Every conv of one forward at N={n} (us x layers): cuDNN {t['cudnn_us']:.1f} us, fast "
                     f"{t['fast_us']:.1f} us ({fast:.2f}x), slow {t['slow_us']:.1f} us ({slow:.2f}x): the fast "
                     f"budget keeps {fast / slow:.3f} of the slow one's speedup.")
    for who in ("fast", "slow"):
        wall = meta.get(f"{who}_command_wall_s")
        if wall:
            lines.append(f"{who.capitalize()} command's whole wall time: {wall:.1f} s.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", type=Path, help="tune --json report (or first_call.py result), fast")
    ap.add_argument("--slow", type=Path, help="... of the slow budget")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    ap.add_argument("--keep", type=float, default=0.97, help="the fraction a problem must reach (0.97)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tag", help="file name tag: budgets_<tag> (default: alexnet_ and the GPU's, e.g. alexnet_h200)")
    ap.add_argument("--from-json", type=Path, help="write the Markdown of this earlier result again (no GPU)")
    args = ap.parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        summary = summarise(doc["rows"], doc["summary"].get("keep", args.keep))
        doc["summary"] = summary
        args.from_json.write_text(to_json(doc))
        text = markdown(doc["meta"], doc["rows"], summary)
        args.from_json.with_suffix(".md").write_text(text)
        print(text)
        return 0
    if args.fast is None or args.slow is None:
        ap.error("--fast and --slow are required (or --from-json)")
    import torch

    if not torch.cuda.is_available():
        print("budgets: needs a CUDA GPU")
        return 2
    if args.tag is None:
        from bagf_torch.bench import gpu_tag

        args.tag = f"alexnet_{gpu_tag()}"
    fast_summary, fast_rows = tune_rows(args.fast)
    slow_summary, slow_rows = tune_rows(args.slow)
    pairs = pair_rows(fast_rows, slow_rows)
    if not pairs:
        print("budgets: the two reports share no problem")
        return 2
    rows = measure(pairs, args.rounds)
    summary = summarise(rows, args.keep)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
            "commit": git_commit(), "command": command_line("budgets.py", sys.argv[1:] if argv is None else argv), "rounds": args.rounds,
            "fast": str(args.fast), "slow": str(args.slow),
            "fast_source": _source(fast_summary), "slow_source": _source(slow_summary),
            "fast_command_wall_s": fast_summary["command_wall_s"], "slow_command_wall_s": slow_summary["command_wall_s"]}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"budgets_{args.tag}"
    stem.with_suffix(".json").write_text(to_json({"meta": meta, "summary": summary, "rows": rows}))
    text = markdown(meta, rows, summary)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


def _source(summary: dict) -> str:
    m = summary["meta"]
    if not m:
        return "tune report"
    return f"commit {str(m.get('commit', '?'))[:7]}, {m.get('date', '?')}, `{m.get('tune_command', m.get('command', '?'))}`"


if __name__ == "__main__":
    sys.exit(main())

"""The same plans' speed under two versions of bagf_torch, in one run: did a refactor change what the kernels cost?

    python benchmarks/compare_versions.py --old DIR --plans <family name>@<layer>:<N> ... [--rounds 2]
    python benchmarks/compare_versions.py --old DIR --plans-from benchmarks/results/first_call_alexnet_h200_25s.json

``DIR`` is a checkout of the older version (``git worktree add DIR <commit>``, or ``git archive <commit> | tar -x
-C DIR``); the newer one is the ``bagf_torch`` this Python imports (the installed package). Each version runs
``benchmarks/host_floor.py`` (its own copy) over the same plans in its own process, with its own extension build
and cache; the versions alternate, round by round and in turn first, so drift of the GPU lands on both. Per plan:
GPU time in a CUDA graph, eager per-call time and host issue cost, the median over rounds, and new / old.
Pass: the geomean of new / old GPU time within ``--tolerance`` (3%) of 1.

Plans are named as bench_layers.py prints them; ``--plans-from`` takes every non-cuDNN winner of a
``first_call.py --alexnet`` JSON. Writes ``compare_versions_<tag>.{json,md}`` under ``--out``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # this folder, for bench_overhead's helpers (also when a test loads this file)

from bench_overhead import command_line, geomean, git_commit, to_json  # noqa: E402
ALEXNET_LAYERS = {"features.0": "conv1", "features.3": "conv2", "features.6": "conv3", "features.8": "conv4",
                  "features.10": "conv5"}
FIELDS = ("ours_graph_us", "ours_eager_us", "ours_issue_us", "cudnn_graph_us")


def plans_from(path: Path) -> list[str]:
    """``<plan>@<layer>:<N>`` for every winner of a ``first_call.py --alexnet`` JSON that is not cuDNN."""
    rows = json.loads(Path(path).read_text())["rows"]
    out = []
    for r in rows:
        plan = r.get("plan") or ""
        if not plan or plan.startswith("aten") or not r.get("layers"):
            continue
        out.append(f"{plan}@{ALEXNET_LAYERS[r['layers'][0]]}:{r['problem']['n']}")
    return out


def compare(runs: dict[str, list[list[dict]]], tolerance: float) -> dict:
    """``runs[version]`` is that version's rows per round (host_floor's rows). Per plan the median over rounds of
    each field and new / old; the summary's geomean of new / old GPU time and whether it is within ``tolerance``."""
    def medians(rounds: list[list[dict]]) -> dict[str, dict]:
        by_plan: dict[str, list[dict]] = {}
        for rows in rounds:
            for r in rows:
                by_plan.setdefault(f"{r['plan']}@{r['layer']}:{r['n']}", []).append(r)
        return {k: {f: statistics.median(r[f] for r in rs) for f in FIELDS} for k, rs in by_plan.items()}

    old, new = medians(runs["old"]), medians(runs["new"])
    missing = sorted(set(old) ^ set(new))  # a plan one version could not run must not vanish from the verdict
    rows = []
    for key in old:
        if key not in new:
            continue
        row = {"plan": key, **{f"old_{f}": old[key][f] for f in FIELDS}, **{f"new_{f}": new[key][f] for f in FIELDS}}
        row["ratio_graph"] = new[key]["ours_graph_us"] / old[key]["ours_graph_us"]
        row["ratio_eager"] = new[key]["ours_eager_us"] / old[key]["ours_eager_us"]
        rows.append(row)
    if not rows:
        raise SystemExit("no plan was measured by both versions")
    g = geomean([r["ratio_graph"] for r in rows])
    summary = {"plans": len(rows), "geomean_new_over_old_graph": g,
               "geomean_new_over_old_eager": geomean([r["ratio_eager"] for r in rows]),
               "worst_graph_ratio": max(r["ratio_graph"] for r in rows),
               "best_graph_ratio": min(r["ratio_graph"] for r in rows), "tolerance": tolerance,
               "measured_by_one_version_only": missing, "pass": bool(abs(g - 1.0) <= tolerance and not missing)}
    return {"summary": summary, "rows": rows}


def run_version(version: str, tree: Path, plans: list[str], out: Path, tag: str, env: dict) -> list[dict]:
    cmd = [sys.executable, str(tree / "benchmarks" / "host_floor.py"), "--plans", *plans, "--out", str(out),
           "--tag", tag]
    print(f"[{version}] {' '.join(cmd[:2])} ... --tag {tag}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    (out / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"[{version}] host_floor failed (rc {proc.returncode}); see {out / (tag + '.log')}:\n"
                         + (proc.stdout + proc.stderr)[-2000:])
    print(f"[{version}] {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads((out / f"host_floor_{tag}.json").read_text())["rows"]


def write(out: Path, tag: str, meta: dict, result: dict) -> Path:
    stem = out / f"compare_versions_{tag}"
    stem.with_suffix(".json").write_text(to_json({"meta": meta, **result}))
    s = result["summary"]
    lines = [f"# The same plans under two versions of bagf_torch ({meta['gpu']})", "",
             f"{meta['date']}; {meta['versions']}; old `{meta['old']}`, new `{meta['new']}`.", "",
             f"Command: `{meta['command']}`", "",
             f"benchmarks/host_floor.py of each version over the same plans, each version in its own process with its "
             f"own extension build and cache, alternating for {meta['rounds']} rounds; per plan the median over "
             "rounds. graph = GPU us per call in a CUDA graph; eager = per-call CUDA-event median; issue = host us "
             "per call while the GPU is busy.", "",
             "| plan | old graph | new graph | new/old graph | old eager | new eager | new/old eager | old issue | "
             "new issue | cuDNN graph (old / new) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['plan']} | {r['old_ours_graph_us']:.1f} | {r['new_ours_graph_us']:.1f} | "
                     f"{r['ratio_graph']:.3f} | {r['old_ours_eager_us']:.1f} | {r['new_ours_eager_us']:.1f} | "
                     f"{r['ratio_eager']:.3f} | {r['old_ours_issue_us']:.1f} | {r['new_ours_issue_us']:.1f} | "
                     f"{r['old_cudnn_graph_us']:.1f} / {r['new_cudnn_graph_us']:.1f} |")
    lines += ["", f"{s['plans']} plans: geomean new / old {s['geomean_new_over_old_graph']:.4f} on GPU time "
              f"(range {s['best_graph_ratio']:.3f}-{s['worst_graph_ratio']:.3f}), "
              f"{s['geomean_new_over_old_eager']:.4f} eager."]
    if s["measured_by_one_version_only"]:
        lines.append("Measured by one version only (fails the comparison): "
                     + ", ".join(s["measured_by_one_version_only"]) + ".")
    lines.append(f"Pass (GPU-time geomean within {s['tolerance']:.0%} of 1, every plan measured by both): "
                 f"{'yes' if s['pass'] else 'NO'}.")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return stem


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="a checkout of the older version")
    ap.add_argument("--old-commit", default=None, help="its commit, for the record (default: git rev-parse there)")
    ap.add_argument("--plans", nargs="*", default=[], help="<family name>@<layer>:<N>")
    ap.add_argument("--plans-from", type=Path, help="a first_call.py --alexnet JSON: its non-cuDNN winners")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs per version (2)")
    ap.add_argument("--tolerance", type=float, default=0.03, help="pass: |geomean new/old - 1| <= this (0.03)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tag", help="file name tag: compare_versions_<tag> (default: the GPU's, h200 or h100)")
    args = ap.parse_args(argv)
    plans = list(args.plans) + (plans_from(args.plans_from) if args.plans_from else [])
    if not plans:
        ap.error("no plans: give --plans or --plans-from")
    import torch

    if not torch.cuda.is_available():
        print("compare_versions: no CUDA GPU here")
        return 2
    from bagf_torch.bench import gpu_tag

    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on: an H100's run is not the H200's)
    work = Path(tempfile.mkdtemp(prefix="bagf_compare_"))
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # e.g. carried wheels
    envs = {
        # the older checkout first on the path, its own build and cache (their formats may differ)
        "old": dict(base, PYTHONPATH=os.pathsep.join([str(args.old.resolve()), *site]),
                    BAGF_BUILD_DIR=str(work / "old_build"), BAGF_CACHE_DIR=str(work / "old_cache")),
        "new": dict(base, PYTHONPATH=os.pathsep.join(site),
                    BAGF_BUILD_DIR=os.environ.get("BAGF_BUILD_DIR") or str(work / "new_build"),
                    BAGF_CACHE_DIR=str(work / "new_cache")),
    }
    trees = {"old": args.old.resolve(), "new": HERE.parent}
    runs: dict[str, list[list[dict]]] = {"old": [], "new": []}
    for rnd in range(args.rounds):
        order = ("old", "new") if rnd % 2 == 0 else ("new", "old")
        for version in order:
            runs[version].append(run_version(version, trees[version], plans, work, f"{version}_{rnd}", envs[version]))
    result = compare(runs, args.tolerance)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(0),
            "versions": f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                        f"cuDNN {torch.backends.cudnn.version()}, Python {sys.version.split()[0]}",
            "old": args.old_commit or git_commit(args.old.resolve()), "new": git_commit(), "rounds": args.rounds,
            "plans": plans, "command": command_line("compare_versions.py", sys.argv[1:] if argv is None else argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out, args.tag, meta, result)
    return 0 if result["summary"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

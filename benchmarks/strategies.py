"""Compare search strategies on recorded spaces, on a CPU (replay, no GPU).

For every recorded problem (benchmarks/data/*.json.gz by default, format bagf-recorded-space/1), every
strategy and every seed, the strategy tunes the replayed space with a budget of --budget evaluations. After
each evaluation we note the fraction of the optimum reached: best recorded median / recorded median of the
best configuration evaluated so far (the tuner re-measures its finalists, so the median is what it would
keep). From the curves: evaluations to reach 95% of the optimum (median over seeds; "never" when a run
does not get there within the budget), the fraction at 10/20/30/50 evaluations, and the wall time spent
in the strategy itself (its run minus the replay's time). A run stops once it has evaluated the optimum
(the fraction is 1 from then on), which saves Ax time and changes no number.

Ax runs with --ax-budget (default 50) and is compared up to that budget: the issue's bar looks at
budgets up to 50, and Ax's generations (1-2 s each on a 2-core CPU) dominate the run time.

With --noise the strategies see times drawn from the recorded spread (seeded per run); the fractions are
still computed from recorded medians.

Only problems whose family record is complete (every valid configuration recorded) are used by default:
a partial recording's optimum is unknown, so "fraction of the optimum" would be measured against the best
of a subset. The excluded ones are listed with the reason. --partial adds them, each restricted to its
recorded subset and labelled "PARTIAL" (and their optimum is the subset's best).

Start as the tuner starts (default): the problem-sized start point (``default_for``, for the recording's GPU:
its SMs and architecture) is evaluated first, then the family's second starts (``start_alternatives``), then the
warm-start seeds the tuner would measure (``warmstart.neighbour_seeds``, up to 3) from a cache
holding the recorded optimum of every OTHER complete recorded problem (leave-one-out: never the problem's
own), all through the replay (they count against the budget) and all handed to every strategy as prior.
--no-warm leaves the seeds out, --no-start both. Ax also gets the family's problem-aware inputs
(``tuner.search_features``: for implicit_gemm_tc blocks per SM, K-tiles per slice, resident blocks) as the
tuner passes them, and the family's ``warps_in_flight`` to rank the start point's neighbours in its initial
design (``tuner.search_initial_order``), and, for a search with nothing measured before it (--no-start), the
family's ``estimated_time`` to rank its first trials (``tuner.search_cold_order``);
``--ax-options '{"features": null, "initial_order": null, "cold_order": null}'`` leaves them out.

Cut-off: the replay cuts like the real tuner (Tuner.tune): a time above --cutoff-factor (the Tuner's
default, 4.0) x the best time of the run so far is answered "timeout". A row the recorder cut ("cutoff":
one sample > 3x the recorder's best so far, so never within 95% of the optimum) replays as that one
sample when it is not cut by this rule (benchmarks/data/README.md).

    python benchmarks/strategies.py --json out.json                     # every file under benchmarks/data/
    python benchmarks/strategies.py --data benchmarks/data/synthetic/SYNTHETIC-implicit_gemm-model.json.gz \\
        --seeds 20 --json /tmp/synthetic.json --png /tmp/synthetic.png
    python benchmarks/strategies.py --strategies random,anneal --seeds 5 --budget 50

Prints a Markdown table (also --md PATH); --png PATH draws one panel per problem (mean with a 25-75%
band) when matplotlib is installed (pip install bagf_torch[plot]).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np


from bagf_torch.kernels import FAMILIES  # noqa: E402
from bagf_torch.kernels.space import Space, config_key  # noqa: E402
from bagf_torch.problem import ConvProblem  # noqa: E402
from bagf_torch.tuning.common import Budget  # noqa: E402
from bagf_torch.tuning.replay import RecordedProblem, Recording, load_recording, newest_complete  # noqa: E402
from bagf_torch.tuning.strategies import STRATEGIES, run  # noqa: E402
from bagf_torch.tuning.tuner import Tuner, family_alternatives, search_options, sized_start  # noqa: E402
from bagf_torch.tuning.warmstart import neighbour_seeds  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
TARGET = 0.95
CHECKPOINTS = (10, 20, 30, 50, 100)
BOOTSTRAP = 4000
"""Bootstrap resamples of the paired comparison (``paired_comparison``)."""
PAIRED_SHOWN = (2, 3, 5, 7, 8, 10, 12, 15, 18, 20, 25, 30, 40, 50)
"""Budgets the Markdown table of the paired comparison shows (the JSON has every budget)."""
DEFAULT_STRATEGIES = ("ax", "random", "anneal", "genetic")
TUNER_CUTOFF = inspect.signature(Tuner.__init__).parameters["cutoff_factor"].default
"""The real tuner's early cut-off factor; the replay uses the same by default."""


def space_for(rp: RecordedProblem) -> Space:
    """The family's space restricted to what was recorded (an incomplete recording leaves configurations
    out: they count as invalid here, so no strategy can ask for a time the replay does not have)."""
    base = FAMILIES[rp.family].space()
    recorded = {config_key(dict(zip(rp.knobs, r["config"]))) for r in rp.rows}

    def recorded_rule(c):
        return None if config_key(c) in recorded else "not in the recording"

    return Space(base.family, base.params, tuple(base.rules) + (recorded_rule,))


def stale_reason(rp: RecordedProblem) -> str | None:
    """Why ``rp`` cannot be replayed against its family's space today, or None: a recording made before the family's
    knobs changed has configurations that are not in today's space, and every strategy would miss every one
    (a run that 'never' reaches 95% for that reason measures nothing)."""
    names = list(FAMILIES[rp.family].space().names)
    if list(rp.knobs) != names:
        return f"recorded with knobs {list(rp.knobs)}, the family's space has {names} today: record it again"
    space = space_for(rp)
    if not any(space.is_valid(dict(zip(rp.knobs, r["config"]))) for r in rp.rows if r.get("status") == "ok"):
        return "no recorded configuration is valid in the family's space today: record it again"
    return None


class _Tracker:
    """Evaluator wrapper: replays, records the recorded median of every evaluated configuration, and stops
    the run (through the fake clock) once the optimum has been evaluated."""

    def __init__(self, replay, optimum_key, median_of):
        self.replay, self.optimum_key, self.median_of = replay, optimum_key, median_of
        self.medians: list[float] = []
        self.found = False
        self.seconds = 0.0

    def __call__(self, configs):
        t = time.perf_counter()
        out = self.replay(configs)
        for c in configs:
            self.medians.append(self.median_of.get(config_key(c), math.inf))
            self.found = self.found or config_key(c) == self.optimum_key
        self.seconds += time.perf_counter() - t
        return out

    def clock(self) -> float:
        return 1e18 if self.found else 0.0


_LOADED: dict[tuple, tuple] = {}


def _problem(path: str, index: int) -> tuple:
    """(recorded problem, its space, recorded medians by config key, its GPU's ``recorded_gpu``), loaded once per
    process: parsing the file and enumerating the space cost more than a random-search run."""
    if (path, index) not in _LOADED:
        rec = load_recording(path)
        rp = rec.problems[index]
        median_of = {config_key(r["config"]): r["time_us"] for r in rp.records() if r["status"] == "ok"}
        space = space_for(rp)
        space.valid_configs()
        _LOADED[(path, index)] = (rp, space, median_of, recorded_gpu(rec.meta))
    return _LOADED[(path, index)]


def recorded_gpu(meta: dict) -> tuple[int | None, str | None]:
    """(SMs, architecture such as "sm_90") of the GPU a recording was made on, from its meta (None where it does
    not say): the start points depend on them as the tuner's do on the GPU it runs on."""
    cc = str(meta.get("compute_capability") or "").replace(".", "")
    return meta.get("sms"), "sm_" + cc if cc.isdigit() else None


def start_config(rp: RecordedProblem, sms: int | None = None, arch: str | None = None) -> dict | None:
    """The configuration the real tuner measures before any strategy runs (``Tuner.start_config``: the
    family's default sized to the problem and, given them, the GPU's ``sms`` and ``arch``), or None when the family
    has no problem-sized default."""
    family = FAMILIES.get(rp.family)
    return None if family is None else sized_start(family, conv_problem(rp), sms, arch)


def start_alternatives(rp: RecordedProblem, sms: int | None = None, arch: str | None = None) -> list[dict]:
    """The family's second start points (``Tuner.start_alternatives``), measured after the start point as the
    tuner measures them, before the warm-start seeds; none for a family without them."""
    family = FAMILIES.get(rp.family)
    return [] if family is None else family_alternatives(family, conv_problem(rp), sms, arch)


def conv_problem(rp: RecordedProblem) -> ConvProblem:
    """The recorded problem as a ConvProblem (a conv dict without dilation, e.g. a synthetic one, has 1)."""
    return ConvProblem.from_dict({"dilation": [1, 1], **rp.conv})


REPLAY_ENV = {"replay": True}
"""The environment of every plan in the replay's synthetic cache (one recording file = one GPU set-up)."""


def recorded_optima(files, recordings: dict[Path, Recording] | None = None) -> list[dict]:
    """The synthetic cache the warm start reads: one plan per COMPLETE recorded problem of ``files``, its
    recorded optimum as the winner (the cache row a tuner would have stored after tuning it). A partial
    problem's optimum is unknown, so it has no plan. Each plan also carries "key" (the problem's label)
    so that a problem's own plan can be left out. A problem recorded in several files has its plan from the
    newest complete recording (``newest_complete``), at the place of its first recording in the list: the
    warm start picks among equally near plans by their order, so a re-recording changes the plan, not the
    order the others are seen in. ``recordings``: the files as read already, by path."""
    recordings = recordings if recordings is not None else {Path(f): load_recording(f) for f in files}
    newest = newest_complete(files, recordings)
    plans, seen = [], set()
    for f in files:
        for rp in recordings[Path(f)].problems:
            if rp.key not in newest or rp.key in seen:
                continue
            seen.add(rp.key)
            rp = next(q for q in recordings[newest[rp.key]].problems if q.key == rp.key and q.complete)
            if not any(r["status"] in ("ok", "cutoff") for r in rp.rows):
                continue
            config, _ = rp.evaluator().best()
            plans.append({"key": rp.key, "problem": conv_problem(rp).as_dict(), "env": REPLAY_ENV,
                          "family": rp.family, "config": config})
    return plans


def warm_seeds(rp: RecordedProblem, plans: list[dict]) -> list[dict]:
    """The warm-start seeds the real tuner would measure for ``rp`` (``runtime._tune_and_store`` ->
    ``warmstart.neighbour_seeds``) from a cache holding every OTHER recorded problem's optimum
    (leave-one-out: the problem's own plan is never a source), restricted to ``rp``'s family."""
    others = [p for p in plans if p["key"] != rp.key]
    seeds = neighbour_seeds(conv_problem(rp), others, REPLAY_ENV)
    return [dict(c) for family, c in seeds if family == rp.family]


def one_run(job: tuple) -> dict:
    path, index, strategy, seed, budget, noise, cutoff_factor, options, start, seeds = job
    import torch

    torch.set_num_threads(1)
    rp, space, median_of, gpu = _problem(path, index)
    optimum_key = min(median_of, key=median_of.get)
    optimum = median_of[optimum_key]
    replay = rp.evaluator(deterministic=not noise, seed=seed, cutoff_factor=cutoff_factor or None)
    tracker = _Tracker(replay, optimum_key, median_of)
    stats: dict = {}
    options = dict(options)
    if strategy == "ax":
        options["stats"] = stats
    # the problem-aware inputs as the tuner gives them (--ax-options '{"features": null}' and the like: without)
    options = search_options(strategy, FAMILIES[rp.family], conv_problem(rp), options=options)
    t = time.perf_counter()
    prior = []
    first = start_config(rp, *gpu) if start else None
    if first is not None and space.is_valid(first):
        # as the real tuner does: the problem-sized default is measured first (evaluation 1 of the curve)
        # and every strategy gets it as prior knowledge
        prior = [(first, tracker([first])[0])]
    done = {config_key(c) for c, _ in prior}
    for c in seeds:
        # then the family's second starts and the warm-start seeds, as Tuner.tune measures them: skipped when
        # invalid here or already measured (e.g. equal to the start point); they count against the budget
        if not space.is_valid(c) or config_key(c) in done or len(prior) >= budget - 1:
            continue
        prior.append((c, tracker([c])[0]))
        done.add(config_key(c))
    run(strategy, space, tracker, Budget(budget - len(prior), seconds=1e12), seed, clock=tracker.clock,
        prior=prior, **options)
    wall = time.perf_counter() - t
    best, curve = math.inf, []
    for m in tracker.medians[:budget]:
        best = min(best, m)
        curve.append(optimum / best if best < math.inf else 0.0)
    curve += [1.0 if tracker.found else (curve[-1] if curve else 0.0)] * (budget - len(curve))
    reach = next((i + 1 for i, f in enumerate(curve) if f >= TARGET), None)
    return {"problem": label(rp), "strategy": strategy, "seed": seed, "budget": budget, "curve": curve,
            "evals_to_95": reach, "gen_seconds": float(np.mean(stats["gen_seconds"])) if stats.get("gen_seconds") else None,
            "evaluated": len(tracker.medians), "prior": len(prior), "strategy_seconds": wall - tracker.seconds,
            "generations": stats.get("generations"), "invalid_proposals": stats.get("invalid_proposals")}


def label(rp: RecordedProblem) -> str:
    return rp.key if rp.complete else f"{rp.key} PARTIAL {len(rp.rows)}/{rp.valid}"


def _median_evals(values: list, budget: int) -> float | None:
    """Median with "never" as +inf; None when the median itself is "never"."""
    m = float(np.median([v if v is not None else math.inf for v in values]))
    return None if math.isinf(m) else m


def summarise(runs: list[dict], budget: int) -> dict:
    by: dict[tuple, list] = {}
    for r in runs:
        by.setdefault((r["strategy"], r["problem"]), []).append(r)
    strategies = sorted({s for s, _ in by}, key=lambda s: (s not in DEFAULT_STRATEGIES, DEFAULT_STRATEGIES.index(s)
                                                           if s in DEFAULT_STRATEGIES else 0, s))
    problems = sorted({p for _, p in by})
    out: dict = {"per_strategy": {}, "per_problem": {}}
    for s in strategies:
        rs = [r for r in runs if r["strategy"] == s]
        s_budget = min(r.get("budget", budget) for r in rs)
        checkpoints = [c for c in CHECKPOINTS if c <= s_budget]
        for r in rs:  # a strategy run with a smaller budget (--ax-budget) is compared up to that budget
            r["curve"] = r["curve"][:s_budget]
        curves = np.array([r["curve"] for r in rs])
        per_problem_medians = [_median_evals([r["evals_to_95"] for r in by[(s, p)]], budget) for p in problems
                               if (s, p) in by]
        out["per_strategy"][s] = {
            "runs": len(rs), "budget": s_budget,
            "median_evals_to_95": _median_evals([r["evals_to_95"] for r in rs], budget),
            "median_over_problems_of_median_evals_to_95": _median_evals(per_problem_medians, budget),
            "never_95": sum(r["evals_to_95"] is None for r in rs) / len(rs),
            "fraction_at": {str(c): float(curves[:, c - 1].mean()) for c in checkpoints},
            "median_fraction_at": {str(c): float(np.median(curves[:, c - 1])) for c in checkpoints},
            "mean_curve": [float(v) for v in curves.mean(axis=0)],
            "strategy_seconds_per_run": float(np.mean([r["strategy_seconds"] for r in rs])),
            "seconds_per_generation": (float(np.mean(g)) if (g := [r["gen_seconds"] for r in rs
                                                                    if r.get("gen_seconds") is not None]) else None),
        }
        for p in problems:
            if (s, p) not in by:
                continue
            pr = by[(s, p)]
            c = np.array([r["curve"] for r in pr])
            out["per_problem"].setdefault(p, {})[s] = {
                "median_evals_to_95": _median_evals([r["evals_to_95"] for r in pr], budget),
                "never_95": sum(r["evals_to_95"] is None for r in pr) / len(pr),
                "fraction_at": {str(k): float(c[:, k - 1].mean()) for k in checkpoints},
                "mean": [float(v) for v in c.mean(axis=0)],
                "p25": [float(v) for v in np.percentile(c, 25, axis=0)],
                "p75": [float(v) for v in np.percentile(c, 75, axis=0)],
                "strategy_seconds_per_run": float(np.mean([r["strategy_seconds"] for r in pr])),
            }
    upto = min([50, budget] + [v["budget"] for v in out["per_strategy"].values()])
    out["issue_bar"] = issue_bar(out["per_strategy"], upto)
    if "ax" in strategies:
        out["paired"] = {o: paired_comparison(runs, "ax", o, upto) for o in ("anneal", "genetic") if o in strategies}
    return out


def paired_comparison(runs: list[dict], a: str, b: str, upto: int, n_boot: int = BOOTSTRAP, seed: int = 0) -> dict:
    """Strategy ``a`` against ``b`` run by run: for every (problem, seed) both ran, the difference of their
    fractions of the optimum at each budget 1..``upto``; the mean over problems of the per-problem mean
    difference (the difference of the two mean curves the issue's bar compares) with bootstrap confidence
    intervals that resample seeds within each problem (the problems are fixed, the seeds are the sample).

    Why: the mean curves of ax and annealing differ by less than their seed-to-seed spread at budgets 5-20
    (ax above on seeds 0-19, below at 7-18 on seeds 20-39, docs/strategies.md), so "ax at least as good" is
    only a statement with an interval. Returned per budget: ``mean`` and the pointwise 95% interval
    (``low``, ``high``); ``simultaneous_low``, a one-sided 95% lower band that holds at every budget at once
    (bootstrap of the largest standardised shortfall over budgets); ``significantly_below`` /
    ``significantly_above``: budgets whose pointwise interval lies wholly below / above 0. ``worst_case``
    is the largest amount by which ``a`` can be below ``b`` at some budget under the simultaneous band
    (0 when the band is above 0 everywhere): the non-inferiority margin these runs support."""
    ca = {(r["problem"], r["seed"]): r["curve"][:upto] for r in runs if r["strategy"] == a}
    cb = {(r["problem"], r["seed"]): r["curve"][:upto] for r in runs if r["strategy"] == b}
    keys = sorted(set(ca) & set(cb), key=str)
    if not keys:
        return {}
    n = min(min(len(ca[k]), len(cb[k])) for k in keys)
    problems = sorted({p for p, _ in keys})
    diffs = {p: np.array([np.subtract(ca[k][:n], cb[k][:n]) for k in keys if k[0] == p]) for p in problems}
    mean = np.mean([d.mean(axis=0) for d in diffs.values()], axis=0)
    rng = np.random.default_rng(seed)
    boot = np.zeros((n_boot, n))
    for p in problems:
        d = diffs[p]
        boot += d[rng.integers(0, len(d), size=(n_boot, len(d)))].mean(axis=1)
    boot /= len(problems)
    low, high = np.percentile(boot, [2.5, 97.5], axis=0)
    sd = boot.std(axis=0)
    live = sd > 1e-12  # budget 1 (the shared start point) and budgets every run has finished never differ
    shortfall = np.where(live, (mean - boot) / np.where(live, sd, 1.0), 0.0).max(axis=1)
    q = float(np.quantile(shortfall, 0.95))
    simultaneous = mean - q * sd
    i = int(np.argmin(np.where(live, mean, np.inf))) if live.any() else 0
    j = int(np.argmin(simultaneous))
    return {
        "pairs": len(keys), "problems": len(problems), "seeds": len({s for _, s in keys}), "bootstrap": n_boot,
        "mean": [float(v) for v in mean], "low": [float(v) for v in low], "high": [float(v) for v in high],
        "simultaneous_low": [float(v) for v in simultaneous],
        "min_mean": [float(mean[i]), i + 1],  # over the budgets where runs differ
        "min_simultaneous_low": [float(simultaneous[j]), j + 1],
        "worst_case": float(max(0.0, -simultaneous[j])),
        "significantly_below": [k + 1 for k in range(n) if high[k] < 0],
        "significantly_above": [k + 1 for k in range(n) if low[k] > 0],
    }


def issue_bar(per: dict, upto: int) -> dict:
    """The bar for BO, checked on these runs: within 95% of the optimum in 30 evaluations (median), 2x fewer
    than random, at least annealing and the GA at every budget up to 50 (None where a strategy was not run)."""
    if "ax" not in per:
        return {}
    ax = per["ax"]
    bar = {"ax_95_within_30": ax["median_evals_to_95"] is not None and ax["median_evals_to_95"] <= 30}
    if "random" in per:
        r = per["random"]["median_evals_to_95"]
        a = ax["median_evals_to_95"]
        # random's "never" means more than its budget: 2x is shown only if 2 * ax's median fits in that budget
        bar["ax_2x_fewer_than_random"] = a is not None and 2 * a <= (per["random"]["budget"] if r is None else r)
    for other in ("anneal", "genetic"):
        if other in per:
            worse = [i + 1 for i in range(upto) if ax["mean_curve"][i] < per[other]["mean_curve"][i] - 1e-12]
            bar[f"ax_at_least_{other}_up_to_{upto}"] = not worse
            bar[f"budgets_where_ax_below_{other}"] = worse
    return bar


def markdown(summary: dict, meta: dict) -> str:
    per = summary["per_strategy"]
    cps = [str(c) for c in CHECKPOINTS if any(str(c) in v["fraction_at"] for v in per.values())]
    synthetic = " **SYNTHETIC data (not GPU measurements)**" if meta.get("synthetic") else ""
    recs = "; ".join(f"{r['file']}: {r['gpu']}, recorded {r['date']}" for r in meta.get("recording", []))
    lines = [f"# Strategies on recorded spaces{synthetic}", "",
             f"Replays of GPU recordings on a CPU ({recs}). "
             f"{meta['problems']} problems x {meta['seeds']} seeds"
             + (f" ({meta['seed_range'][0]}-{meta['seed_range'][1]})" if meta.get("seed_range") else "")
             + f", budget {meta['budget']} evaluations"
             + (f" (ax: {meta['ax_budget']})" if meta.get("ax_budget", meta["budget"]) != meta["budget"] else "")
             + f", {'noisy' if meta['noise'] else 'median'} replay, tuner cut-off "
             f"{meta.get('cutoff_factor') or 'off'}x; ax options {json.dumps(meta.get('ax_options') or {})}; "
             f"run {meta['date']}, {meta['cpu']}.", ""]
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}` (commit `{meta.get('commit', '?')}`).", ""]
    if meta.get("excluded"):
        lines += ["Excluded (use --partial to add them, restricted to what was recorded):", ""]
        lines += [f"- {k}: {why}" for k, why in meta["excluded"].items()] + [""]
    if meta.get("partial_included"):
        lines += ["PARTIAL problems are included: their optimum is the best of the recorded subset only.", ""]
    lines += [
             "| strategy | median evals to 95% | never 95% | " + " | ".join(f"fraction @{c}" for c in cps)
             + " | strategy s / run | s / generation |",
             "|---|---|---|" + "---|" * len(cps) + "---|---|"]
    for s, v in per.items():
        m = v["median_evals_to_95"]
        lines.append(f"| {s} | {'never' if m is None else f'{m:g}'} | {100 * v['never_95']:.0f}% | "
                     + " | ".join(f"{v['fraction_at'][c]:.3f}" if c in v["fraction_at"] else "-" for c in cps)
                     + f" | {v['strategy_seconds_per_run']:.2f} | "
                     + (f"{v['seconds_per_generation']:.2f} |" if v.get("seconds_per_generation") else "- |"))
    lines += ["", "Per problem, median evaluations to 95% (never = not within the budget):", "",
              "| problem | " + " | ".join(per) + " |", "|---|" + "---|" * len(per)]
    for p, v in summary["per_problem"].items():
        cells = []
        for s in per:
            m = v.get(s, {}).get("median_evals_to_95")
            cells.append("never" if m is None else f"{m:g}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    if summary.get("issue_bar"):
        lines += ["", "The bar for BO on these runs: "
                  + ", ".join(f"{k}: {v}" for k, v in summary["issue_bar"].items()), ""]
    for other, c in (summary.get("paired") or {}).items():
        if not c:
            continue
        shown = [k for k in PAIRED_SHOWN if k <= len(c["mean"])]
        lines += ["", f"Paired: ax - {other}, fraction of the optimum, {c['pairs']} (problem, seed) pairs "
                  f"({c['problems']} problems x {c['seeds']} seeds); 95% bootstrap intervals over seeds within "
                  f"each problem ({c['bootstrap']} resamples); simultaneous = one-sided 95% lower band for every "
                  "budget at once:", "",
                  "| budget | " + " | ".join(map(str, shown)) + " |", "|---|" + "---|" * len(shown),
                  "| mean | " + " | ".join(f"{c['mean'][k - 1]:+.4f}" for k in shown) + " |",
                  "| 95% interval | " + " | ".join(f"{c['low'][k - 1]:+.3f}..{c['high'][k - 1]:+.3f}"
                                                   for k in shown) + " |",
                  "| simultaneous low | " + " | ".join(f"{c['simultaneous_low'][k - 1]:+.4f}" for k in shown) + " |",
                  "", f"Smallest mean difference {c['min_mean'][0]:+.4f} at budget {c['min_mean'][1]}; "
                  f"significantly below {other} at budgets {_ranges(c['significantly_below']) or 'none'}, significantly "
                  f"above at {_ranges(c['significantly_above']) or 'none'}; at every budget at once, ax is at most "
                  f"{c['worst_case']:.4f} below {other} (95%, lowest at budget {c['min_simultaneous_low'][1]}).", ""]
    return "\n".join(lines) + "\n"


def _ranges(budgets: list[int]) -> str:
    """[2, 3, 4, 9] -> "2-4, 9"."""
    out: list[str] = []
    for k in budgets:
        if out and out[-1].split("-")[-1] == str(k - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{k}"
        else:
            out.append(str(k))
    return ", ".join(out)


def plot(summary: dict, path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install bagf_torch[plot]): no plot", file=sys.stderr)
        return False
    probs = list(summary["per_problem"])
    cols = min(4, len(probs))
    rows = -(-len(probs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False, sharey=True)
    for ax, p in zip(axes.flat, probs):
        for s, v in summary["per_problem"][p].items():
            x = np.arange(1, len(v["mean"]) + 1)
            ax.plot(x, v["mean"], label=s)
            ax.fill_between(x, v["p25"], v["p75"], alpha=0.2)
        ax.axhline(TARGET, color="grey", lw=0.5, ls="--")
        ax.set_title(p, fontsize=8)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("evaluations")
    for ax in list(axes.flat)[len(probs):]:
        ax.axis("off")
    axes[0][0].set_ylabel("fraction of optimum")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _recording_meta(files, recordings: dict[Path, Recording] | None = None) -> list[dict]:
    """GPU and date of each recording (``recordings``: as read already, by path), for the report's label."""
    out = []
    for f in files:
        m = (recordings[Path(f)] if recordings is not None else load_recording(f)).meta
        out.append({"file": Path(f).name, "gpu": m.get("gpu"), "date": m.get("date"), "synthetic": bool(m.get("synthetic"))})
    return out


def _resummarise(args) -> int:
    """--from-json: the summary, issue bar and paired comparison of runs stored by earlier --json runs."""
    docs = [json.loads(Path(f).read_text()) for f in args.from_json]
    missing = [f for f, d in zip(args.from_json, docs) if "runs" not in d]
    if missing:
        print(f"no runs stored in {missing} (only a summary): re-run them with --json", file=sys.stderr)
        return 2
    runs, seen = [], set()
    for d in docs:
        for r in d["runs"]:
            if (r["strategy"], r["problem"], r["seed"]) not in seen:
                seen.add((r["strategy"], r["problem"], r["seed"]))
                runs.append(r)
    meta = dict(docs[0]["meta"])
    seeds = sorted({r["seed"] for r in runs})
    budget = max(r["budget"] for r in runs)
    meta.update(seeds=len(seeds), seed_range=[seeds[0], seeds[-1]], strategies=sorted({r["strategy"] for r in runs}),
                budget=budget, ax_budget=min((r["budget"] for r in runs if r["strategy"] == "ax"), default=budget),
                merged_from=[{"file": str(f), "date": d["meta"].get("date"), "ax_options": d["meta"].get("ax_options"),
                              "wall_seconds": d["meta"].get("wall_seconds")} for f, d in zip(args.from_json, docs)])
    options = {json.dumps(d["meta"].get("ax_options") or {}, sort_keys=True) for d in docs
               if "ax" in d["meta"].get("strategies", [])}
    if len(options) > 1:
        print(f"warning: the files ran ax with different options {sorted(options)}", file=sys.stderr)
    summary = summarise(runs, budget)
    md = markdown(summary, meta) + "\nMerged from " + ", ".join(
        f"{m['file']} ({m['date']})" for m in meta["merged_from"]) + ".\n"
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    if args.json:
        # the runs stay in the files they came from (merged_from): a merged file would only duplicate them
        Path(args.json).write_text(json.dumps({"meta": meta, **summary}, indent=1))
    if args.png:
        plot(summary, args.png, f"replay: fraction of optimum, seeds {seeds[0]}-{seeds[-1]}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="*", help="recorded-space files (default: benchmarks/data/*.json.gz)")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES), help=f"of {sorted(STRATEGIES)}")
    ap.add_argument("--problems", default="", help="comma-separated problem names (default: all)")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--seed-base", type=int, default=0,
                    help="first seed (seeds are BASE .. BASE+SEEDS-1): a held-out set for a setting chosen on 0..19")
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--ax-budget", type=int, default=50,
                    help="budget for ax only, default 50 (the issue's bar compares up to 50; Ax costs ~1-2 s per "
                         "generation on a CPU, so 100 would double the run); ax is compared up to that budget")
    ap.add_argument("--ax-options", default="{}", help="JSON dict of ax options (see ax_bo.OPTIONS)")
    ap.add_argument("--noise", action="store_true", help="replay with the recorded spread as noise")
    ap.add_argument("--no-start", action="store_true",
                    help="strategies start from nothing (default: as the tuner, the problem-sized default is "
                         "measured first, then the family's second starts and the warm-start seeds, and all of them "
                         "are given to every strategy)")
    ap.add_argument("--no-warm", action="store_true",
                    help="no warm-start seeds (cold start from neighbours; the start point is still measured "
                         "unless --no-start). Default: as the tuner, up to 3 winners of neighbouring problems "
                         "(warmstart.neighbour_seeds) from a cache holding every OTHER complete recorded "
                         "problem's optimum (leave-one-out) are measured after the start point")
    ap.add_argument("--partial", action="store_true",
                    help="also use problems whose recording is partial, restricted to the recorded subset (labelled)")
    ap.add_argument("--min-space", type=int, default=None,
                    help="leave out recorded spaces with at most this many valid configurations (default: --budget, "
                         "100: exhaustive search finishes such a space within the budget, so ranking strategies "
                         "on it says nothing; the 60-configuration winograd_gemm recordings are such spaces)")
    ap.add_argument("--cutoff-factor", type=float, default=TUNER_CUTOFF,
                    help=f"replay the tuner's early cut at this x the run's best (default: the Tuner's {TUNER_CUTOFF}; "
                         "0: off)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (one torch thread each)")
    ap.add_argument("--json", help="write the summary and every run here")
    ap.add_argument("--md", help="write the Markdown table here")
    ap.add_argument("--png", help="write the convergence plot here (needs matplotlib)")
    ap.add_argument("--from-json", nargs="+", metavar="JSON",
                    help="run nothing: summarise the runs stored in these --json outputs together (e.g. two seed "
                         "sets, or ax from one file and annealing from another; a (strategy, problem, seed) "
                         "present twice is kept once, from the first file), then --json (without the runs: they "
                         "stay in the source files)/--md/--png as usual")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder, for bench_overhead's helpers
    from bench_overhead import command_line, git_commit

    command = command_line("strategies.py", sys.argv[1:] if argv is None else argv)
    if args.from_json:
        return _resummarise(args)

    files = [Path(p) for p in args.data] if args.data else sorted(DATA.glob("*.json.gz"))
    if not files:
        print(f"no recorded spaces under {DATA}; record them on a GPU (benchmarks/record_space.py) or make a "
              "SYNTHETIC one for development (bagf_torch.tuning.replay.synthetic_recording) and pass it with --data",
              file=sys.stderr)
        return 2
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        ap.error(f"unknown strategies {unknown}; choose from {sorted(STRATEGIES)}")
    wanted = {p for p in args.problems.split(",") if p}
    ax_options = json.loads(args.ax_options)
    jobs, synthetic, used, excluded = [], False, [], {}
    warm = not (args.no_warm or args.no_start)
    recordings = {Path(f): load_recording(f) for f in files}  # each file read once
    plans = recorded_optima(files, recordings) if warm else []
    seeds_of: dict[str, list[dict]] = {}
    newest = newest_complete(files, recordings)
    for f in files:
        rec = recordings[Path(f)]
        synthetic = synthetic or rec.synthetic
        for i, rp in enumerate(rec.problems):
            if wanted and rp.name not in wanted:
                continue
            if rp.key in newest and newest[rp.key] != Path(f):
                other = f"{newest[rp.key].name} (recorded {recordings[newest[rp.key]].meta.get('date')})"
                excluded[f"{rp.key} in {Path(f).name}"] = (
                    f"superseded by its recording in {other}" if rp.complete
                    else f"{rp.partial_reason}; its complete recording in {other} is replayed")
                continue
            if not rp.complete and not args.partial:
                excluded[rp.key] = rp.partial_reason
                continue
            stale = stale_reason(rp)
            if stale:
                excluded[rp.key] = stale
                continue
            min_space = args.budget if args.min_space is None else args.min_space
            if len(rp.rows) <= min_space:
                excluded[rp.key] = (f"{len(rp.rows)} configurations, at most --min-space {min_space}: exhaustive "
                                    "search covers it within the budget")
                continue
            used.append(label(rp))
            seeds = ([] if args.no_start else start_alternatives(rp, *recorded_gpu(rec.meta))) + (
                warm_seeds(rp, plans) if warm else [])
            seeds_of[label(rp)] = seeds
            jobs += [(str(f), i, s, seed, min(args.ax_budget, args.budget) if s == "ax" else args.budget,
                      args.noise, args.cutoff_factor, ax_options if s == "ax" else {}, not args.no_start, seeds)
                     for s in strategies for seed in range(args.seed_base, args.seed_base + args.seeds)]
    for k, why in excluded.items():
        print(f"excluded {k}: {why}", file=sys.stderr)
    if not jobs:
        print("no problem left to run", file=sys.stderr)
        return 2
    # Ax first (its runs are the long ones, so the pool ends with short jobs), then by problem so that a
    # worker's loaded problem is reused
    jobs.sort(key=lambda j: (j[2] != "ax", j[0], j[1]))
    t = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            runs = list(pool.map(one_run, jobs, chunksize=1 if "ax" in strategies else 20))
    else:
        runs = [one_run(j) for j in jobs]
    wall = time.perf_counter() - t
    summary = summarise(runs, args.budget)
    meta = {"data": [str(f) for f in files], "synthetic": synthetic, "problems": len(used), "used": used,
            "excluded": excluded, "partial_included": args.partial, "seeds": args.seeds,
            "seed_range": [args.seed_base, args.seed_base + args.seeds - 1],
            "budget": args.budget, "ax_budget": min(args.ax_budget, args.budget), "ax_options": ax_options,
            "cutoff_factor": args.cutoff_factor, "recording": _recording_meta(files, recordings),
            "noise": args.noise, "start": not args.no_start, "warm_start": warm, "warm_seeds": seeds_of,
            "strategies": strategies, "workers": args.workers,
            "wall_seconds": round(wall, 1), "cpu": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores", "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "command": command}
    md = markdown(summary, meta) + f"\nWall time {wall:.0f} s with {args.workers} worker processes.\n"
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **summary, "runs": runs}, indent=1))
    if args.png:
        gpus = ", ".join(sorted({str(r["gpu"]) for r in meta["recording"]}))
        plot(summary, args.png, ("SYNTHETIC data: " if synthetic else f"replay of {gpus} recordings: ")
             + f"fraction of optimum, {args.seeds} seeds, run {meta['date'][:10]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compare how the Ax strategy reports invalid proposals (constraint / abandon / penalty), Ax's acquisition
cost (default 512 QMC samples vs 64), and Ax vs random search, on SYNTHETIC implicit_gemm landscapes
(bagf_torch.tuning.replay.synthetic_times: a roofline-style model, not GPU measurements).

For each variant and seed: evaluations until the best time found is within 95% of the landscape's optimum
(optimum / best >= 0.95), capped at --cap (a run that misses counts as "> cap"), invalid configurations
Ax proposed, and Ax's wall time per generation. Runs stop as soon as the target is reached.

    python benchmarks/probes/compare_invalid_handling.py                      # all variants, 10 seeds (~1.5 h, 1 CPU)
    python benchmarks/probes/compare_invalid_handling.py --variants constraint abandon penalty   # the main table
    python benchmarks/probes/compare_invalid_handling.py --variants constraint --seeds 3 --cap 60
    python benchmarks/probes/compare_invalid_handling.py --timing-only        # per-generation time on fixed data

Prints a Markdown table; --json PATH also writes every run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np


from bagf_torch.kernels import implicit_gemm  # noqa: E402
from bagf_torch.tuning.common import Budget, Objective  # noqa: E402
from bagf_torch.tuning.replay import ALEXNET_CONV2, ReplayEvaluator, synthetic_times  # noqa: E402
from bagf_torch.tuning.strategies import STRATEGIES  # noqa: E402

VARIANTS = {
    # name: (strategy, options)
    "penalty": ("ax", {"invalid": "penalty"}),
    "abandon": ("ax", {"invalid": "abandon"}),
    "constraint": ("ax", {"invalid": "constraint"}),
    "penalty+sobol": ("ax", {"invalid": "penalty", "initial": "sobol"}),
    "penalty+mc512": ("ax", {"invalid": "penalty", "mc_samples": None}),
    "penalty+raw": ("ax", {"invalid": "penalty", "log_time": False}),
    "constraint+batch8": ("ax", {"invalid": "constraint", "batch_size": 8}),
    "random": ("random", {}),
}

PROBLEMS = {
    "alexnet2": ALEXNET_CONV2,
    "alexnet1_n1": {"N": 1, "C": 3, "H": 224, "W": 224, "K": 64, "R": 11, "S": 11, "stride": 4, "pad": 2},
    "alexnet3": {"N": 128, "C": 192, "H": 13, "W": 13, "K": 384, "R": 3, "S": 3, "stride": 1, "pad": 1},
}


class _StopAtTarget:
    """Wraps an evaluator; once a time within ``target`` of the optimum is seen, the fake clock jumps past
    the seconds budget so the strategy stops at its next ``objective.remaining`` check."""

    def __init__(self, evaluate, optimum: float, target: float, stop: bool = True):
        self.evaluate, self.optimum, self.target_time, self.stop = evaluate, optimum, optimum / target, stop
        self.count = 0
        self.reached_at: int | None = None
        self.reached_90: int | None = None

    def __call__(self, configs):
        outcomes = self.evaluate(configs)
        for o in outcomes:
            self.count += 1
            if self.reached_90 is None and o.ok and o.time_us <= self.optimum / 0.9:
                self.reached_90 = self.count
            if self.reached_at is None and o.ok and o.time_us <= self.target_time:
                self.reached_at = self.count
        return outcomes

    def clock(self) -> float:
        return 2e9 if self.stop and self.reached_at is not None else 0.0


def one_run(variant: str, problem: str, landscape_seed: int, seed: int, cap: int, target: float,
            run_to_cap: bool = False) -> dict:
    space = implicit_gemm.space()
    replay = ReplayEvaluator(synthetic_times(space, PROBLEMS[problem], landscape_seed))
    optimum = replay.best()[1].time_us
    stop = _StopAtTarget(replay, optimum, target, stop=not run_to_cap)
    strategy, options = VARIANTS[variant]
    options = dict(options)
    stats: dict = {}
    if strategy == "ax":
        options["stats"] = stats
    objective = Objective(space, stop, Budget(cap, seconds=1e9), clock=stop.clock)
    start = time.perf_counter()
    STRATEGIES[strategy].tune(objective, seed, **options)
    wall = time.perf_counter() - start
    best = objective.best()
    return {
        "variant": variant, "problem": problem, "landscape_seed": landscape_seed, "seed": seed,
        "evals_to_target": stop.reached_at, "evals_to_90": stop.reached_90, "evaluations": objective.spent,
        "best_fraction": optimum / best[1].time_us if best else 0.0,
        "invalid_proposals": stats.get("invalid_proposals", 0), "repeats": stats.get("repeats", 0),
        "fallback": stats.get("fallback", 0), "generations": stats.get("generations", 0),
        "gen_seconds": stats.get("gen_seconds", []), "wall_s": wall,
    }


def random_expectation(problem: str, landscape_seed: int, target: float, cap: int, draws: int = 2000) -> dict:
    """Evaluations random search needs, from many cheap simulated runs (no Ax involved)."""
    space = implicit_gemm.space()
    records = synthetic_times(space, PROBLEMS[problem], landscape_seed)
    times = np.array([r["time_us"] if r["status"] == "ok" else np.inf for r in records])
    good = times <= times.min() / target
    rng = np.random.default_rng(0)
    firsts = np.array([np.argmax(good[rng.permutation(len(times))]) + 1 for _ in range(draws)])
    return {"n_good": int(good.sum()), "n_valid": len(times), "median": float(np.median(firsts)),
            "mean": float(firsts.mean()), "within_cap": float((firsts <= cap).mean())}


def timing(problem: str, n_data: int, reps: int) -> list[dict]:
    """Ax wall and CPU time per generation of 4 trials on fixed data, default vs cheap acquisition."""
    from ax import Client

    from bagf_torch.tuning.strategies import ax_bo

    space = implicit_gemm.space()
    replay = ReplayEvaluator(synthetic_times(space, PROBLEMS[problem], 0))
    codec = ax_bo._Codec(space)
    valid = space.valid_configs()
    rows = []
    for mc in (None, 128, 64, 32):
        rng = np.random.default_rng(0)
        with ax_bo._quiet_ax():
            client = Client(random_seed=0)
            client.configure_experiment(parameters=codec.parameters())
            client.configure_optimization(objective=f"-{ax_bo.METRIC}")
            client.set_generation_strategy(ax_bo._generation_strategy(0, 8, True, mc))
            for i in rng.choice(len(valid), n_data, replace=False):
                o = replay.median(valid[i])
                index = client.attach_trial(codec.encode(valid[i]))
                client.complete_trial(index, {ax_bo.METRIC: o.time_us if o.ok else 1e6})
            walls, cpus = [], []
            for _ in range(reps):
                w, c = time.perf_counter(), time.process_time()
                trials = client.get_next_trials(4)
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - c)
                for index in trials:  # keep the data fixed: nothing learned between repetitions
                    client.mark_trial_abandoned(index)
        rows.append({"mc_samples": mc or 512, "n_data": n_data, "wall_s": statistics.median(walls),
                     "cpu_s": statistics.median(cpus)})
    return rows


def _fmt_evals(values: list, cap: int) -> str:
    hits = [v for v in values if v is not None]
    miss = len(values) - len(hits)
    if not hits:
        return f"> {cap} (all {miss} missed)"
    med = statistics.median([v if v is not None else cap + 1 for v in values])
    med_s = f"> {cap}" if med > cap else f"{med:g}"
    return f"{med_s} (mean of hits {statistics.mean(hits):.1f}; {miss} of {len(values)} missed)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--problem", default="alexnet2", choices=list(PROBLEMS))
    ap.add_argument("--landscape-seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--cap", type=int, default=120)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings on a shared CPU)")
    ap.add_argument("--run-to-cap", action="store_true",
                    help="spend the whole --cap (best fraction after exactly CAP evaluations) instead of stopping")
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, problem {args.problem}, landscape seed {args.landscape_seed} (synthetic)")
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.timing_only:
        rows = timing(args.problem, 40, 3)
        out["timing"] = rows
        print("| QMC samples | wall s / generation of 4 | CPU s |\n|---|---|---|")
        for r in rows:
            print(f"| {r['mc_samples']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} |")
    else:
        rnd = random_expectation(args.problem, args.landscape_seed, args.target, args.cap)
        out["random_expectation"] = rnd
        print(f"landscape: {rnd['n_good']} of {rnd['n_valid']} valid configs within {args.target:.0%}; random search "
              f"needs median {rnd['median']:.0f} / mean {rnd['mean']:.0f} evaluations "
              f"({rnd['within_cap']:.0%} of runs within {args.cap})")
        runs = []
        print("| variant | evals to target: median | invalid proposals / run | best fraction at stop | "
              "s / generation |\n|---|---|---|---|---|")
        for variant in args.variants:
            rs = [one_run(variant, args.problem, args.landscape_seed, s, args.cap, args.target, args.run_to_cap)
                  for s in range(args.first_seed, args.first_seed + args.seeds)]
            runs += rs
            gens = [g for r in rs for g in r["gen_seconds"]]
            inv = [r["invalid_proposals"] for r in rs]
            print(f"| {variant} | {_fmt_evals([r['evals_to_target'] for r in rs], args.cap)} | "
                  f"{statistics.mean(inv):.1f} (max {max(inv)}) | "
                  f"{statistics.median(r['best_fraction'] for r in rs):.3f} | "
                  f"{statistics.median(gens):.2f} |" if gens else
                  f"| {variant} | {_fmt_evals([r['evals_to_target'] for r in rs], args.cap)} | - | "
                  f"{statistics.median(r['best_fraction'] for r in rs):.3f} | - |", flush=True)
        out["runs"] = runs
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Simulated annealing over the knobs' ordered values, on log(time).

A step looks at ``batch_size`` distinct, valid, not yet evaluated neighbours of the current configuration
(one knob moved to an adjacent value; with probability ``jump`` to any of its values) and evaluates them as
one batch, so the real evaluator compiles them in parallel. The best of the batch is the candidate move,
accepted if faster, else with probability exp(-(log t_new - log t_cur) / T). T falls geometrically from
``t_start`` to ``t_end`` over the evaluation budget; on log time, T = 0.1 accepts a move 10% slower with
probability 1/e. A failure (compile, resources, ...) is never moved to. When the neighbourhood holds
nothing new (every neighbour evaluated or invalid), or ``restart_after`` steps bring no new best, the walk
restarts from the best configuration so far, or from a random unevaluated one if the best's neighbourhood
is exhausted. Invalid configurations are filtered here and never reach the objective.
"""

from __future__ import annotations

import math

import numpy as np

from ...kernels.space import Config, Space
from ..common import Objective, unseen_random

OPTIONS = {"batch_size": 4, "t_start": 0.2, "t_end": 0.005, "jump": 0.1, "restart_after": 8}
"""batch_size: neighbours evaluated per step (compiled in parallel by the real evaluator).
t_start, t_end: temperature (in units of log time) at the first and at the last evaluation of the budget.
jump: probability that a neighbour moves its knob to any value rather than an adjacent one.
restart_after: steps without a new best before the walk goes back to the best configuration."""


def neighbours(space: Space, config: Config, rng: np.random.Generator, jump: float) -> list[Config]:
    """Every configuration one knob away (adjacent value; a random other value with probability ``jump``),
    in a seeded random order, valid ones only."""
    out = []
    for name in space.names:
        values = space.params[name]
        i = values.index(config[name])
        steps = [j for j in (i - 1, i + 1) if 0 <= j < len(values)]
        if rng.random() < jump and len(values) > 2:
            steps = [int(rng.choice([j for j in range(len(values)) if j != i]))]
        for j in steps:
            c = dict(config)
            c[name] = values[j]
            if space.is_valid(c):
                out.append(c)
    return [out[i] for i in rng.permutation(len(out))]




def tune(objective: Objective, seed: int, *, batch_size: int = OPTIONS["batch_size"],
         t_start: float = OPTIONS["t_start"], t_end: float = OPTIONS["t_end"], jump: float = OPTIONS["jump"],
         restart_after: int = OPTIONS["restart_after"]) -> None:
    if batch_size < 1 or restart_after < 1:
        raise ValueError(f"anneal batch_size={batch_size}, restart_after={restart_after}; both must be >= 1")
    if not (t_start > 0 and t_end > 0 and t_end <= t_start):
        raise ValueError(f"anneal t_start={t_start}, t_end={t_end}; need 0 < t_end <= t_start")
    if not 0.0 <= jump <= 1.0:
        raise ValueError(f"anneal jump={jump}; it must be in [0, 1]")
    space = objective.space
    valid = space.valid_configs()
    rng = np.random.default_rng(seed)
    budget = min(objective.budget.evaluations, len(valid))
    decay = (t_end / t_start) ** (1.0 / max(1, budget - 1))

    def log_time(c: Config) -> float:
        o = objective.seen(c)
        return math.log(o.time_us) if o is not None and o.ok else math.inf

    current: Config | None = None
    best: Config | None = None
    known_ok = [c for c, o in objective.prior if o.ok and space.is_valid(c)]
    if known_ok:  # start the walk at the best configuration measured before the search
        current = best = min(known_ok, key=log_time)
    stale = 0
    while objective.remaining > 0 and objective.spent < len(valid):
        n = min(batch_size, objective.remaining)
        restart = current is None
        if restart:
            batch = unseen_random(objective, valid, rng, n)
        else:
            batch = [c for c in neighbours(space, current, rng, jump) if objective.seen(c) is None][:n]
            if not batch:  # nothing new around here: back to the best, or anywhere new
                if best is not None and current != best:
                    current, stale = best, 0
                    continue
                batch = unseen_random(objective, valid, rng, n)
                restart = True
        if not batch:
            break
        objective(batch)
        temperature = t_start * decay ** max(0, objective.spent - 1)
        cand = min(batch, key=log_time)
        if math.isfinite(log_time(cand)):
            if best is None or log_time(cand) < log_time(best):
                best, stale = cand, 0
            else:
                stale += 1
            if restart:
                current = cand
            else:
                delta = log_time(cand) - log_time(current)
                if delta <= 0 or rng.random() < math.exp(-delta / temperature):
                    current = cand
        else:  # every configuration of the batch failed
            stale += 1
        if stale >= restart_after and best is not None:
            current, stale = best, 0


__all__ = ["OPTIONS", "neighbours", "tune", "unseen_random"]

"""A genetic algorithm: (mu + lambda) selection on log(time), tournament parents, uniform crossover,
per-knob mutation along the knobs' ordered values.

The first population is ``population`` valid configurations drawn uniformly (seeded). Each generation
breeds ``batch_size`` children, evaluated as one batch (the real evaluator compiles them in parallel):
two parents picked by tournaments of ``tournament``, each knob from either parent (uniform crossover),
then each knob mutated with probability ``mutation`` (an adjacent value, or with probability ``jump`` any
value). A child that is invalid or already evaluated is bred again (up to ``MAX_TRIES`` times), then
replaced by a random unevaluated valid configuration, so invalid configurations never reach the objective
and the loop always makes progress. The next population is the ``population`` fastest of parents and
children; failures rank last.
"""

from __future__ import annotations

import math

import numpy as np

from ...kernels.space import Config, config_key
from ..common import Objective, unseen_random

OPTIONS = {"population": 12, "batch_size": 8, "tournament": 3, "mutation": 0.3, "jump": 0.2}
"""population: configurations kept between generations (also the size of the random first one).
batch_size: children bred and evaluated per generation.
tournament: candidates per tournament when picking a parent.
mutation: probability that a knob of a child is changed after crossover.
jump: probability that a mutation picks any value rather than an adjacent one."""

MAX_TRIES = 50


def tune(objective: Objective, seed: int, *, population: int = OPTIONS["population"],
         batch_size: int = OPTIONS["batch_size"], tournament: int = OPTIONS["tournament"],
         mutation: float = OPTIONS["mutation"], jump: float = OPTIONS["jump"]) -> None:
    if population < 2 or batch_size < 1 or tournament < 1:
        raise ValueError(f"genetic population={population}, batch_size={batch_size}, tournament={tournament}; "
                         "need population >= 2, batch_size >= 1, tournament >= 1")
    if not (0.0 <= mutation <= 1.0 and 0.0 <= jump <= 1.0):
        raise ValueError(f"genetic mutation={mutation}, jump={jump}; both must be in [0, 1]")
    space = objective.space
    valid = space.valid_configs()
    rng = np.random.default_rng(seed)
    names = space.names

    def fitness(c: Config) -> float:
        o = objective.seen(c)
        return math.log(o.time_us) if o is not None and o.ok else math.inf

    def pick(pop: list[Config]) -> Config:
        entrants = [pop[i] for i in rng.choice(len(pop), size=min(tournament, len(pop)), replace=False)]
        return min(entrants, key=fitness)

    def breed(pop: list[Config], taken: set) -> Config | None:
        for _ in range(MAX_TRIES):
            a, b = pick(pop), pick(pop)
            child = {n: (a[n] if rng.random() < 0.5 else b[n]) for n in names}
            for n in names:
                values = space.params[n]
                if len(values) > 1 and rng.random() < mutation:
                    i = values.index(child[n])
                    if rng.random() < jump:
                        j = int(rng.choice([k for k in range(len(values)) if k != i]))
                    else:
                        j = i + (1 if i == 0 else -1 if i == len(values) - 1 else int(rng.choice((-1, 1))))
                    child[n] = values[j]
            if space.is_valid(child) and objective.seen(child) is None and config_key(child) not in taken:
                return child
        return None

    pop: list[Config] = [c for c, o in objective.prior if o.ok and space.is_valid(c)][:population]
    while objective.remaining > 0 and objective.spent < len(valid):
        # the first population is drawn in batches too, so a seconds budget stops it like any other
        n = min(batch_size if len(pop) >= population else min(batch_size, population - len(pop)),
                objective.remaining)
        batch: list[Config] = []
        taken: set = set()
        if len(pop) >= population:
            for _ in range(n):
                child = breed(pop, taken)
                if child is None:
                    break
                batch.append(child)
                taken.add(config_key(child))
        if len(batch) < n:  # first population, or breeding keeps hitting known configurations
            extra = [c for c in unseen_random(objective, valid, rng, n + len(batch))
                     if config_key(c) not in taken][: n - len(batch)]
            batch.extend(extra)
        if not batch:
            break
        objective(batch)
        pool = {config_key(c): c for c in pop + batch}
        pop = sorted(pool.values(), key=lambda c: (fitness(c), config_key(c)))[:population]


__all__ = ["OPTIONS", "tune"]

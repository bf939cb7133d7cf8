"""Random search: valid configurations drawn uniformly without replacement (the baseline every other
strategy must beat). Seeded with a numpy ``Generator``, so a seed gives the same sequence every time."""

from __future__ import annotations

import numpy as np

from ..common import Objective

OPTIONS = {"batch_size": 8}
"""batch_size: configurations handed to the evaluator at once (compiled in parallel by the real one)."""


def tune(objective: Objective, seed: int, *, batch_size: int = OPTIONS["batch_size"]) -> None:
    if batch_size < 1:
        raise ValueError(f"random search batch_size={batch_size}; it must be at least 1")
    valid = objective.space.valid_configs()
    order = np.random.default_rng(seed).permutation(len(valid))
    pos = 0
    while objective.remaining > 0 and pos < len(order):
        n = min(batch_size, objective.remaining)
        batch = [valid[i] for i in order[pos:pos + n]]
        pos += n
        objective(batch)

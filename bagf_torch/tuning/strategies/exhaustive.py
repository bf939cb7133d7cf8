"""Exhaustive search: every valid configuration, in batches, until the budget ends. The reference that
finds the true optimum when the budget covers the space, and the way GPU recordings for replay are made."""

from __future__ import annotations

import numpy as np

from ..common import Objective

OPTIONS = {"batch_size": 8, "order": "space"}
"""batch_size: configurations handed to the evaluator at once.
order: "space" (the space's fixed order, knobs varying last-fastest), "reverse", or "random" (a seeded
shuffle, so that a budget smaller than the space still samples all of it)."""

ORDERS = ("space", "reverse", "random")


def tune(objective: Objective, seed: int, *, batch_size: int = OPTIONS["batch_size"],
         order: str = OPTIONS["order"]) -> None:
    if batch_size < 1:
        raise ValueError(f"exhaustive batch_size={batch_size}; it must be at least 1")
    if order not in ORDERS:
        raise ValueError(f"exhaustive order={order!r}; expected one of {ORDERS}")
    configs = objective.space.valid_configs()
    if order == "reverse":
        configs.reverse()
    elif order == "random":
        configs = [configs[i] for i in np.random.default_rng(seed).permutation(len(configs))]
    pos = 0
    while objective.remaining > 0 and pos < len(configs):
        n = min(batch_size, objective.remaining)
        objective(configs[pos:pos + n])
        pos += n

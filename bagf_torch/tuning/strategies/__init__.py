"""Search strategies: one module each, with one function ``tune(objective, seed, **options)`` and the
options it accepts declared in ``OPTIONS`` (name -> default). Unknown strategies and options are rejected by
name before anything runs.

Every strategy loops ``while objective.remaining > 0``, hands ``objective`` batches of configurations
(a batch lets the real evaluator compile candidates in parallel) and proposes valid configurations only
where it can; ``Objective`` filters invalid ones for free and memoises repeats, so neither costs budget.

>>> from bagf_torch.kernels.space import Space
>>> from bagf_torch.tuning.common import Budget, Outcome
>>> space = Space("demo", {"a": (1, 2, 4), "b": (1, 2)})
>>> trials = run("exhaustive", space, lambda cs: [Outcome("ok", float(c["a"] * c["b"])) for c in cs],
...              Budget(evaluations=6), seed=0)
>>> min(trials, key=lambda t: t[1].time_us)[0]
{'a': 1, 'b': 1}
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any, Callable, Sequence

from ...kernels.space import Config, Space
from ..common import Budget, Evaluate, Objective, Outcome, tuning_context
from . import anneal, ax_bo, exhaustive, genetic, random_search

STRATEGIES: dict[str, ModuleType] = {"ax": ax_bo, "random": random_search, "anneal": anneal, "genetic": genetic,
                                     "exhaustive": exhaustive}
"""Strategy name -> module with ``OPTIONS`` and ``tune``. "ax" is the default."""

DEFAULT = "ax"


def check_options(name: str, options: dict[str, Any]) -> ModuleType:
    """The strategy module called ``name``, after checking that it accepts every key of ``options``."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown search strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    module = STRATEGIES[name]
    unknown = sorted(set(options) - set(module.OPTIONS))
    if unknown:
        known = ", ".join(f"{k}={v!r}" for k, v in module.OPTIONS.items()) or "none"
        raise ValueError(f"unknown option(s) {unknown} for search strategy {name!r}; "
                         f"its options (with defaults) are: {known}")
    return module


def preload(name: str) -> Callable[..., bool] | None:
    """Start loading what strategy ``name`` imports on its first use, in the background (Ax: seconds); returns
    ``wait(timeout=None) -> bool`` (True once loaded), or None when the strategy needs nothing or it is loaded."""
    module = STRATEGIES.get(name)
    start = getattr(module, "preload", None)
    return start() if start is not None else None


def run(name: str, space: Space, evaluate: Evaluate, budget: Budget, seed: int, *,
        clock: Callable[[], float] = time.monotonic, prior: Sequence[tuple[Config, Outcome]] = (),
        **options: Any) -> list[tuple[Config, Outcome]]:
    """Tune ``space`` with strategy ``name``; returns every trial in order (config, outcome), invalid
    proposals and memoised repeats excluded from the budget but invalid ones kept in the list.

    ``options`` are the strategy's own (see its ``OPTIONS``); ``clock`` is what the seconds budget is
    measured with (tests inject a fake one). ``prior`` are configurations measured before the search (the
    tuner's start point and warm-start seeds): every strategy knows them and never evaluates them again;
    Ax attaches them as completed trials, annealing starts from the best, the genetic algorithm puts them
    in its first population.

    The caller's grad mode does not matter: the strategy runs with autograd on and outside inference mode
    (``tuning_context``), so a call under ``torch.no_grad()`` makes the same trials as one without.
    """
    module = check_options(name, options)
    objective = Objective(space, evaluate, budget, clock=clock, prior=prior)
    with tuning_context(grad=True):
        module.tune(objective, seed, **options)
    return objective.trials


__all__ = ["DEFAULT", "STRATEGIES", "check_options", "run"]

"""Types shared by the tuner, the strategies and the evaluators: outcomes (defined in ``bagf_torch.outcome``,
re-exported here), budgets, the objective, and the trial events the tuner reports to its listeners."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Sequence

from ..kernels.space import Config, Space, config_key
from ..outcome import STATUSES, Outcome  # re-exported: the tuner, strategies and evaluators import them here


@contextlib.contextmanager
def tuning_context(grad: bool = False):
    """What tuning runs under, whatever the caller's context: outside inference mode, autocast off, autograd
    off (``grad=False``, the GPU work: nothing there needs a graph) or on (``grad=True``, the strategy: BoTorch
    fits its GP by gradient). A layer's first call usually arrives under ``torch.no_grad()`` or
    ``torch.inference_mode()``; under either, Ax's model fit raised "element 0 of tensors does not require
    grad" and every search ended after its initial design."""
    import torch

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
        for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


@dataclass(frozen=True)
class Budget:
    """How much a strategy may spend: evaluations that reach the GPU, and wall-clock seconds."""

    evaluations: int
    seconds: float = math.inf

    def __post_init__(self):
        if self.evaluations < 1:
            raise ValueError(f"budget of {self.evaluations} evaluations; it must be at least 1")
        if not self.seconds > 0:
            raise ValueError(f"budget of {self.seconds} seconds; it must be positive")


Phase = Literal["baseline", "start", "seed", "search"]
"""Where in a tuning a trial was made: cuDNN's first timing, a family's start point, a warm-start seed, or a
candidate its search proposed."""


@dataclass(frozen=True)
class TrialEvent:
    """One trial whose outcome is final, as the Tuner reports it to its listeners the moment it is known.

    A tuning's events come in the order of its ``TuneResult.trials``: cuDNN's baseline (family ``"aten"``, no
    config, name ``"cuDNN"``), each family's start point, the warm-start seeds, then the searches' candidates.
    The finalists' interleaved re-timing is not a trial and has no event."""

    family: str
    config: Config | None
    outcome: Outcome
    name: str  # the kernel's readable name (``family.name(config)``)
    phase: Phase

    def as_row(self) -> dict:
        """The trial as the cache stores it (``Cache.add_trials``)."""
        return {"family": self.family, "config": self.config, "status": self.outcome.status,
                "time_us": self.outcome.time_us, "detail": self.outcome.detail}

    def line(self) -> str:
        """One line for a log or a console: ``"<name>: <status>[ <time> us]"``."""
        time_us = "" if self.outcome.time_us is None else f" {self.outcome.time_us:.1f} us"
        return f"{self.name}: {self.outcome.status}{time_us}"


TrialListener = Callable[[TrialEvent], None]
"""What a Tuner calls with every ``TrialEvent``, on the tuner's thread: a function, or an object with
``__call__``. A listener that raises is logged once and does not stop the tuning."""


Evaluate = Callable[[Sequence[Config]], Sequence[Outcome]]
"""Evaluates a batch of valid configurations (compiling them in parallel where it can)."""


@dataclass
class Objective:
    """What a strategy calls. Filters invalid configurations (free, never sent to ``evaluate``), memoises
    repeats (free), counts the rest against the budget and keeps every trial in order.

    Strategies loop ``while objective.remaining > 0`` and pass batches of at most ``remaining`` configs.
    """

    space: Space
    evaluate: Evaluate
    budget: Budget
    clock: Callable[[], float] = time.monotonic
    prior: Sequence[tuple[Config, Outcome]] = ()  # measured before the search (the tuner's start point, warm
    #                                              start): known to the strategy, never re-evaluated, not counted
    trials: list[tuple[Config, Outcome]] = field(default_factory=list)
    _seen: dict = field(default_factory=dict)
    _spent: int = 0
    _start: float | None = None

    def __post_init__(self):
        self._start = self.clock()
        self.prior = [(dict(c), o) for c, o in self.prior]
        for c, o in self.prior:
            self._seen[config_key(c)] = o

    @property
    def spent(self) -> int:
        return self._spent

    @property
    def remaining(self) -> int:
        if self.clock() - self._start >= self.budget.seconds:
            return 0
        return max(0, self.budget.evaluations - self._spent)

    def seen(self, config: Mapping[str, int]) -> Outcome | None:
        return self._seen.get(config_key(config))

    def __call__(self, configs: Sequence[Config]) -> list[Outcome | None]:
        """Outcomes in the order of ``configs``; None for a config left unevaluated (budget exhausted)."""
        results: dict[tuple, Outcome] = {}
        todo: list[Config] = []
        queued: set[tuple] = set()  # a configuration twice in one batch is evaluated (and counted) once
        for c in configs:
            key = config_key(c)
            if key in self._seen or key in results or key in queued:
                continue
            reason = self.space.invalid_reason(c)
            if reason is not None:
                results[key] = Outcome("invalid", detail=reason)
                self._seen[key] = results[key]
                self.trials.append((dict(c), results[key]))
            elif len(todo) < self.remaining:
                todo.append(dict(c))
                queued.add(key)
        if todo:
            outcomes = list(self.evaluate(todo))
            if len(outcomes) != len(todo):
                raise RuntimeError(f"evaluator returned {len(outcomes)} outcomes for {len(todo)} configs")
            self._spent += len(todo)
            for c, o in zip(todo, outcomes):
                self._seen[config_key(c)] = o
                self.trials.append((c, o))
        return [self._seen.get(config_key(c)) for c in configs]

    def best(self, include_prior: bool = False) -> tuple[Config, Outcome] | None:
        """The fastest successful trial; with ``include_prior`` the prior (measured before the search) too."""
        ok = [(c, o) for c, o in (self.prior if include_prior else []) + self.trials if o.ok]
        return min(ok, key=lambda t: t[1].time_us) if ok else None


def unseen_random(objective: Objective, valid: list[Config], rng, n: int) -> list[Config]:
    """Up to ``n`` valid configurations the objective has not seen, in ``rng``'s random order (``rng``: a
    numpy Generator; one permutation of ``valid`` per call, so runs with one seed repeat exactly)."""
    out = []
    for i in rng.permutation(len(valid)):
        if objective.seen(valid[i]) is None:
            out.append(valid[i])
            if len(out) == n:
                break
    return out

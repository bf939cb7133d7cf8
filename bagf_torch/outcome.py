"""The result of evaluating one kernel configuration: a time, or a typed failure.

Neutral ground for the modules that produce outcomes (``jit.compiler``: compile and load failures;
``tuning.measure``: wrong results, launch failures, times) and those that consume them (the tuner, the
strategies, the cache). Imports nothing from the package; ``tuning.common`` re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STATUSES", "Outcome"]

STATUSES = ("ok", "invalid", "compile", "resources", "launch", "wrong", "timeout", "crashed")
"""Outcome kinds. Every one except "ok" is a typed failure that is recorded, never retried blindly.
"crashed": the candidate killed the isolated worker process or left its CUDA context unusable
(``tuning.isolated``, BAGF_ISOLATE=1)."""


@dataclass(frozen=True)
class Outcome:
    """The result of evaluating one configuration: a time in microseconds, or a typed failure."""

    status: str
    time_us: float | None = None
    detail: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown outcome status {self.status!r}; expected one of {STATUSES}")
        if (self.status == "ok") != (self.time_us is not None):
            raise ValueError(f"outcome {self.status!r} with time {self.time_us!r}: only 'ok' carries a time")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

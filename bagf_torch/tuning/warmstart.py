"""Warm start: the cache's winners of neighbouring problems as first candidates for a new problem.

A network's layers repeat shapes with small changes (another batch size, other channel counts, the same
3x3 geometry), and a configuration that won on a neighbour is usually near the top on the new problem. On
the H200 recording of ``implicit_gemm_tc`` (AlexNet at N=1), conv3's winner is also conv5's optimum, and
conv4 gets 88% of its optimum from conv3's or conv5's winner, where the problem-sized default reaches
72-83%. So the tuner measures up to ``limit`` neighbour winners right after each family's start point;
they count against the evaluation budget like any candidate, pass the same correctness check, and the
search then goes on as usual.

Neighbours are plans stored for the same environment (GPU, versions, kernel sources: plans of another GPU
are not comparable) whose winner is one of our kernels (an "aten" winner says nothing about our knobs).
Distance, in octaves: |log2 of the output pixels N*P*Q ratio| + 0.5 |log2 K ratio| + 0.5 |log2 C*R*S
ratio|, plus 3 when the filter size or stride differ; neighbours further than ``max_distance`` are ignored.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from ..problem import ConvProblem

MAX_DISTANCE = 4.0


def distance(a: ConvProblem, b: ConvProblem) -> float:
    """How far apart two problems are for sharing tuned configurations (0: the same shape)."""
    def octaves(x: float, y: float) -> float:
        return abs(math.log2(max(x, 1) / max(y, 1)))

    pa, qa = a.out_hw
    pb, qb = b.out_hw
    d = (octaves(a.n * pa * qa, b.n * pb * qb) + 0.5 * octaves(a.k, b.k)
         + 0.5 * octaves(a.c * a.r * a.s, b.c * b.r * b.s))
    if (a.r, a.s, tuple(a.stride)) != (b.r, b.s, tuple(b.stride)):
        d += 3.0
    return d


def neighbour_seeds(problem: ConvProblem, plans: Iterable[Mapping], env: Mapping, limit: int = 3,
                    max_distance: float = MAX_DISTANCE) -> list[tuple[str, dict]]:
    """Up to ``limit`` distinct ``(family, config)`` winners of the stored ``plans`` (cache rows with
    "problem", "env", "family", "config") nearest to ``problem``, nearest first.

    A warm start is an optimisation, so a plan that cannot serve as one is passed over, never raised
    about: ``Cache.plans()`` already checks every row against the cache schema, but ``plans`` may come from
    elsewhere, and one row with a stride of 0 or an env that is a list must not stop every later tuning of
    the machine (it did: ZeroDivisionError on each new problem)."""
    from ..cache_schema import SchemaError, check_config, check_problem

    ranked = []
    for plan in plans:
        try:
            if not isinstance(plan, Mapping) or not isinstance(plan.get("env"), Mapping):
                continue
            family = plan.get("family")
            if plan.get("config") is None or not isinstance(family, str) or family == "aten" \
                    or dict(plan["env"]) != dict(env):
                continue
            config = check_config(family, plan["config"])
            other = ConvProblem.from_dict(check_problem(plan["problem"]))
            if other == problem or other.dtype != problem.dtype or other.groups != problem.groups:
                continue
            d = distance(problem, other)
        except (SchemaError, KeyError, TypeError, ValueError, ArithmeticError):
            continue
        if d <= max_distance:
            ranked.append((d, family, config))
    ranked.sort(key=lambda t: t[0])
    out: list[tuple[str, dict]] = []
    for _, family, config in ranked:
        if (family, config) not in out:
            out.append((family, config))
        if len(out) >= limit:
            break
    return out

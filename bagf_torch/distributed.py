"""Pre-tuning on several GPUs (and hosts) with torch.distributed.

``torchrun --nproc-per-node=K -m bagf_torch tune --model alexnet --batch 1,32,128`` starts K ranks; each
discovers the same unique problems, tunes its share (``shard``) on its own GPU (``LOCAL_RANK``), and the
winners (key + plan + cubins + trials) are exchanged with ``all_gather_object``; rank 0 writes them all into
its cache (``write_records``), so its cache is complete even when the ranks run on different hosts with
different cache directories. Ranks of one host that share a cache directory write the same rows; the first
write wins and the rest are no-ops (the cache's ``put_plan`` is insert-or-ignore).

The process group uses gloo: only a few kilobytes of Python objects per problem (a cubin is ~10-100 KB)
cross it, once, so NCCL's device tensors and per-GPU communicators would buy nothing, and gloo works the
same on a CPU (the tests run 2-4 CPU processes through it).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

from .problem import ConvProblem

__all__ = ["Context", "init_from_env", "shard", "write_records"]

_T = TypeVar("_T")

TIMEOUT = datetime.timedelta(hours=4)
"""How long a rank waits for the others at the exchange. The fastest rank waits for the slowest one's whole
share (AlexNet at three batch sizes: 15 problems of up to BAGF_TIME_BUDGET each, 6 s by default but a user may set
hours, on one GPU); gloo's 30-minute default could cut that off. torchrun stops every rank when one fails, so a long wait never hangs."""


def shard(problems: Sequence[ConvProblem], world_size: int, rank: int) -> list[ConvProblem]:
    """The problems rank ``rank`` of ``world_size`` tunes: every problem goes to exactly one rank, counts differ
    by at most one, and the big ones are spread (sorted by FLOPs, dealt in snake order 0..K-1, K-1..0: the
    measuring part of tuning grows with a problem's FLOPs, compiling does not). Deterministic: every rank
    computes the same split from the same list, without talking to the others.

    >>> ps = [ConvProblem(n=n, c=3, h=8, w=8, k=4, r=3, s=3) for n in (1, 2, 3, 4, 5)]
    >>> [[p.n for p in shard(ps, 2, r)] for r in (0, 1)]
    [[5, 2, 1], [4, 3]]
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size} is not a valid rank")
    order = sorted(range(len(problems)), key=lambda i: (-problems[i].flops, i))
    mine = []
    for position, i in enumerate(order):
        lap, offset = divmod(position, world_size)
        owner = offset if lap % 2 == 0 else world_size - 1 - offset
        if owner == rank:
            mine.append(problems[i])
    return mine


@dataclass
class Context:
    """This process's place in the job: rank, world size and the group to exchange results in (None alone)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @classmethod
    def current(cls, group=None) -> "Context":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_gather(self, items: list[_T]) -> list[_T]:
        """Every rank's ``items``, concatenated in rank order (just ``items`` when alone)."""
        if self.world_size == 1:
            return list(items)
        import torch.distributed as dist

        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, list(items), group=self.group)
        return [item for part in parts for item in part]


def init_from_env() -> tuple[bool, int]:
    """Join the job torchrun describes (``WORLD_SIZE`` > 1 in the environment), with gloo; returns
    ``(initialised_here, local_rank)``. Alone (no torchrun) it does nothing and returns ``(False, 0)``."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world <= 1 or dist.is_initialized():
        return False, local_rank
    dist.init_process_group("gloo", timeout=TIMEOUT)
    return True, local_rank


def write_records(cache, records: Sequence[dict]) -> tuple[int, int]:
    """Store gathered winners in ``cache``: cubins first, then the plan, then (when the plan is new here) its
    trials. Returns ``(written, already_there)``."""
    written = already = 0
    for rec in records:
        for cubin in rec.get("cubins", ()):
            cache.put_cubin(cubin["digest"], cubin["name"], cubin["lowered_name"], cubin["cubin"])
        fields = {f: rec[f] for f in ("problem", "env", "family", "config", "time_us", "aten_us", "default_us",
                                      "evaluations", "tune_seconds", "cubin_digests")}
        if cache.put_plan(rec["key"], **fields):
            written += 1
            if rec.get("trials"):
                cache.add_trials(rec["key"], [{k: t[k] for k in ("family", "config", "status", "time_us", "detail")}
                                              for t in rec["trials"]])
        else:
            already += 1
    return written, already

"""Multi-GPU pre-tuning logic on a CPU: sharding, and torchrun with the gloo backend (2 and 3 ranks) running
tune_model with a replayed tuning step, each rank with its own cache directory (as on separate hosts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bagf_torch
from bagf_torch.distributed import shard, write_records
from bagf_torch.problem import ConvProblem

REPO = Path(__file__).resolve().parent.parent


def _problems(count: int) -> list[ConvProblem]:
    return [ConvProblem(n=1 + i % 4, c=3 + i, h=16, w=16, k=8, r=3, s=3) for i in range(count)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("count", [0, 1, 5, 15])
def test_shard_covers_every_problem_once_balanced(world, count):
    problems = _problems(count)
    shards = [shard(problems, world, r) for r in range(world)]
    flat = [p for s in shards for p in s]
    assert sorted(flat, key=problems.index) == problems  # each exactly once
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert shards == [shard(list(problems), world, r) for r in range(world)]  # deterministic


def test_shard_spreads_the_biggest_problems():
    problems = [ConvProblem(n=n, c=64, h=27, w=27, k=192, r=5, s=5) for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    firsts = [max(shard(problems, 4, r), key=lambda p: p.flops).n for r in range(4)]
    assert sorted(firsts) == [16, 32, 64, 128]  # each rank gets one of the four biggest


def test_shard_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        shard(_problems(3), 2, 2)


WORKER = """
import json, os, sys
sys.path[:0] = [{package_root!r}, {tests!r}]  # the bagf_torch the test run imported (installed or not)
import torch
from torch import nn
import bagf_torch
from bagf_torch import distributed
from replay_step import ReplayStep

class FakeCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True

started, local_rank = distributed.init_from_env()
rank = int(os.environ["RANK"])
os.environ["BAGF_CACHE_DIR"] = os.path.join({out!r}, "cache%d" % rank)  # one cache per rank: separate hosts
torch.manual_seed(0)
model = bagf_torch.convert(nn.Sequential(nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.ReLU(),
                                         nn.Conv2d(16, 24, 3, padding=1), nn.Conv2d(24, 24, 3, padding=1)))
xs = [torch.randn(n, 3, 20, 20).as_subclass(FakeCuda) for n in (1, 2, 4)]
step = ReplayStep()
report = bagf_torch.tune_model(model, xs, step=step, progress=False)
with open(os.path.join({out!r}, "rank%d.json" % rank), "w") as f:
    json.dump({{"started": started, "world": distributed.Context.current().world_size,
               "tuned": [p.short() for p in step.calls], "report": report.as_dict()}}, f)
torch.distributed.destroy_process_group()
"""


def _read_cache(directory: Path):
    from bagf_torch.cache import Cache

    with Cache.for_dir(directory) as cache:
        plans = {p["key"]: p for p in cache.plans()}
        cubins = {d: cache.get_cubin(d) for p in plans.values() for d in p["cubin_digests"]}
        trials = {k: len(cache.trials(k)) for k in plans}
    return plans, cubins, trials


def _single_process_reference(tmp_path, monkeypatch):
    """The same job in one process: what every rank count must reproduce."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from replay_step import ReplayStep
    finally:
        sys.path.remove(str(REPO / "tests"))
    import bagf_torch
    from torch import nn

    class FakeCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    monkeypatch.setenv("BAGF_CACHE_DIR", str(tmp_path / "single"))
    torch.manual_seed(0)
    model = bagf_torch.convert(nn.Sequential(nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.ReLU(),
                                             nn.Conv2d(16, 24, 3, padding=1), nn.Conv2d(24, 24, 3, padding=1)))
    xs = [torch.randn(n, 3, 20, 20).as_subclass(FakeCuda) for n in (1, 2, 4)]
    return bagf_torch.tune_model(model, xs, step=ReplayStep(), progress=False)


@pytest.mark.parametrize("world", [2, 3])
def test_torchrun_gloo_shards_gathers_and_rank0_writes_everything(world, tmp_path, monkeypatch):
    out = tmp_path / "job"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(package_root=str(Path(bagf_torch.__file__).resolve().parent.parent),
                                     tests=str(REPO / "tests"), out=str(out)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                          str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-5000:])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["started"] and r["world"] == world for r in ranks)

    # every unique problem (3 convs x 3 batch sizes) tuned exactly once across the ranks, shared fairly
    tuned = [p for r in ranks for p in r["tuned"]]
    assert len(tuned) == len(set(tuned)) == 9
    assert max(len(r["tuned"]) for r in ranks) - min(len(r["tuned"]) for r in ranks) <= 1
    # every rank got the whole report, which matches a single-process run of the same job
    reference = _single_process_reference(tmp_path, monkeypatch).as_dict()
    strip = lambda rows: [{k: v for k, v in row.items() if k != "rank"} for row in rows]  # noqa: E731
    for r in ranks:
        assert strip(r["report"]["rows"]) == strip(reference["rows"])
        assert r["report"]["world_size"] == world
    assert sorted({row["rank"] for row in ranks[0]["report"]["rows"]}) == list(range(world))

    # rank 0's cache holds every winner with its cubin and trials; the others only their own share
    plans0, cubins0, trials0 = _read_cache(out / "cache0")
    assert len(plans0) == 9 and cubins0 and all(c is not None for c in cubins0.values())
    assert all(n == 6 for n in trials0.values())
    for r in range(1, world):
        plans_r, _, _ = _read_cache(out / f"cache{r}")
        assert len(plans_r) == len(ranks[r]["tuned"])
        for key, plan in plans_r.items():
            assert plans0[key]["config"] == plan["config"] and plans0[key]["time_us"] == plan["time_us"]


def test_write_records_is_idempotent_and_carries_cubins(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from replay_step import ReplayStep
    finally:
        sys.path.remove(str(REPO / "tests"))
    from bagf_torch.cache import Cache

    monkeypatch.setenv("BAGF_CACHE_DIR", str(tmp_path / "tuner"))
    step = ReplayStep()

    class Quiet:
        def cudnn(self, us):
            pass

        def trial(self, status, us):
            pass

    records = [step(p, 0, Quiet()) for p in _problems(3)]
    with Cache.for_dir(tmp_path / "rank0") as cache:
        assert write_records(cache, records) == (3, 0)
        assert write_records(cache, records) == (0, 3)
        for rec in records:
            plan = cache.get_plan(rec["key"])
            assert plan["config"] == rec["config"] and len(cache.trials(rec["key"])) == 6
            assert cache.get_cubin(rec["cubin_digests"][0])[0] == rec["cubins"][0]["cubin"]

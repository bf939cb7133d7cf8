"""A tuning step for CPU tests of pre-tuning: the random strategy over a replayed (synthetic) recording of the
implicit_gemm space for each problem, instead of a GPU. Like the runtime, it stores its winner (and a stand-in
cubin) in the local cache at BAGF_CACHE_DIR, and returns the Record that tune_model gathers."""

from __future__ import annotations

import hashlib
import os

from bagf_torch.cache import Cache
from bagf_torch.kernels import implicit_gemm as ig
from bagf_torch.pretune import make_record
from bagf_torch.problem import fingerprint
from bagf_torch.tuning import strategies
from bagf_torch.tuning.common import Budget
from bagf_torch.tuning.replay import ReplayEvaluator, synthetic_times

ENV = {"gpu": "Replay GPU", "cc": "9.0", "driver": 1, "runtime": 1, "nvrtc": "13.0", "torch": "x",
       "bagf_torch": "0.1.0", "kernels": "k", "os": "posix"}


class ReplayStep:
    def __init__(self, budget: int = 6, seed: int = 0):
        self.budget = budget
        self.seed = seed
        self.calls = []

    def evaluations(self) -> int:
        return self.budget

    def __call__(self, problem, device, progress):
        self.calls.append(problem)
        dims = {"N": problem.n, "C": problem.c, "H": problem.h, "W": problem.w, "K": problem.k, "R": problem.r,
                "S": problem.s, "stride": problem.stride[0], "pad": problem.padding[0]}
        space = ig.space()
        evaluator = ReplayEvaluator(synthetic_times(space, dims, seed=self.seed))
        cudnn_us = evaluator.median(ig.DEFAULT).time_us  # the recording's default config stands in for cuDNN
        progress.cudnn(cudnn_us)

        def evaluate(configs):
            outcomes = evaluator(configs)
            for o in outcomes:
                progress.trial(o.status, o.time_us)
            return outcomes

        trials = strategies.run("random", space, evaluate, Budget(self.budget), self.seed)
        config, outcome = min(((c, o) for c, o in trials if o.ok), key=lambda t: t[1].time_us)
        key = fingerprint(problem, ENV)
        cubin = ig.name(config).encode()  # stand-in bytes: what matters is that they travel with the plan
        digest = hashlib.sha256(cubin).hexdigest()
        plan = dict(problem=problem.as_dict(), env=ENV, family=ig.FAMILY, config=config, time_us=outcome.time_us,
                    aten_us=cudnn_us, default_us=cudnn_us, evaluations=len(trials), tune_seconds=0.01,
                    cubin_digests=[digest])
        rows = [{"family": ig.FAMILY, "config": c, "status": o.status, "time_us": o.time_us, "detail": o.detail}
                for c, o in trials]
        with Cache.for_dir(os.environ["BAGF_CACHE_DIR"]) as cache:
            cached = cache.get_plan(key)
            if cached is None:
                cache.put_cubin(digest, ig.name(config), "_Z_" + ig.name(config), cubin)
                cache.put_plan(key, **plan)
                cache.add_trials(key, rows)
        return make_record(key, plan, cubins=[{"digest": digest, "name": ig.name(config),
                                               "lowered_name": "_Z_" + ig.name(config), "cubin": cubin}],
                           trials=rows, cached=cached is not None)

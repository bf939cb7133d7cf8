"""Search strategies on a CPU: every strategy against replayed or synthetic timings (no GPU involved)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from bagf_torch.kernels import implicit_gemm
from bagf_torch.kernels.space import Space, config_key
from bagf_torch.tuning.common import Budget, Outcome
from bagf_torch.tuning.replay import ALEXNET_CONV2, ReplayEvaluator, synthetic_times
from bagf_torch.tuning.strategies import STRATEGIES, check_options, run

@pytest.fixture(autouse=True)
def one_torch_thread():
    """Ax's GPs are tiny: on a 2-core CI machine shared with other jobs, torch's second thread only
    contends (seed 2 of the landscape test: 38.6 s with 1 thread, 86.6 s with 2, under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Ax spends 1-3 s per generation on this CPU (GP fitting), so the small-space tests use few, large batches.
FAST = {"ax": {"batch_size": 6, "initial_trials": 4}, "random": {}, "exhaustive": {}, "anneal": {}, "genetic": {}}


def small_space() -> Space:
    """24 raw configurations, 13 valid: enough invalid ones that Ax proposes some."""
    def product_limit(c):
        return "a*b too large" if c["a"] * c["b"] > 16 else None

    def parity(c):
        return "c=1 needs a >= 2" if c["c"] == 1 and c["a"] < 2 else None

    return Space("small", {"a": (1, 2, 4, 8), "b": (1, 2, 4), "c": (0, 1)}, (product_limit, parity))


def small_time(c) -> float:
    # A unique optimum at a=4, b=2, c=1 inside the valid region, with a second basin at a=1.
    return 10.0 + abs(c["a"] - 4) * 3 + abs(c["b"] - 2) * 2 + (0 if c["c"] else 1.5) - (4.0 if c["a"] == 1 else 0)


class StrictEvaluator:
    """Fails the test if a strategy sends an invalid configuration, or the same one twice."""

    def __init__(self, space: Space, time_of, fail=lambda c: None):
        self.space, self.time_of, self.fail = space, time_of, fail
        self.seen: set = set()
        self.calls = 0
        self.batches: list[int] = []

    def __call__(self, configs):
        self.batches.append(len(configs))
        out = []
        for c in configs:
            assert self.space.is_valid(c), f"strategy sent an invalid configuration {c}"
            key = config_key(c)
            assert key not in self.seen, f"strategy sent {c} twice"
            self.seen.add(key)
            self.calls += 1
            status = self.fail(c)
            out.append(Outcome(status, detail="injected") if status else Outcome("ok", self.time_of(c)))
        return out


def true_optimum(space, time_of):
    return min(space.valid_configs(), key=time_of)


@pytest.mark.parametrize("name", ["exhaustive", "random", "anneal", "genetic"])  # ax: the next test
def test_finds_true_optimum_when_budget_covers_space(name):
    space = small_space()
    n_valid = len(space.valid_configs())
    ev = StrictEvaluator(space, small_time)
    trials = run(name, space, ev, Budget(n_valid), seed=3, **FAST[name])
    best = min((t for t in trials if t[1].ok), key=lambda t: t[1].time_us)
    assert best[0] == true_optimum(space, small_time)
    assert ev.calls == n_valid


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_terminates_and_finds_optimum_when_budget_exceeds_space(name):
    # Ax keeps proposing invalid or seen configurations once the valid ones run out: the loop must end.
    space = small_space()
    ev = StrictEvaluator(space, small_time)
    trials = run(name, space, ev, Budget(1000), seed=0, **FAST[name])
    assert ev.calls == len(space.valid_configs())
    assert sum(o.status != "invalid" for _, o in trials) == ev.calls
    best = min((t for t in trials if t[1].ok), key=lambda t: t[1].time_us)
    assert best[0] == true_optimum(space, small_time)


@pytest.mark.parametrize("name", ["exhaustive", "random", "anneal", "genetic"])  # ax: see the slow test
def test_never_sends_invalid_and_respects_evaluation_budget(name):
    space = implicit_gemm.space()
    replay = ReplayEvaluator(synthetic_times(space, ALEXNET_CONV2, seed=0))
    ev = StrictEvaluator(space, lambda c: replay.median(c).time_us or 1e9,
                         fail=lambda c: None if replay.median(c).ok else "resources")
    trials = run(name, space, ev, Budget(14), seed=1, **FAST[name])
    assert ev.calls == 14
    assert all(n >= 1 for n in ev.batches)
    assert len([t for t in trials if t[1].status != "invalid"]) == 14


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_reproducible_for_a_seed(name):
    space = small_space()
    sequences = []
    for _ in range(2):
        trials = run(name, space, StrictEvaluator(space, small_time), Budget(10), seed=7, **FAST[name])
        sequences.append([(config_key(c), o) for c, o in trials])
    assert sequences[0] == sequences[1]


def test_random_search_seeds_differ():
    space = small_space()
    a = run("random", space, StrictEvaluator(space, small_time), Budget(6), seed=1)
    b = run("random", space, StrictEvaluator(space, small_time), Budget(6), seed=2)
    assert [c for c, _ in a] != [c for c, _ in b]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_respects_seconds_budget(name):
    space = small_space()
    clock = FakeClock()
    inner = StrictEvaluator(space, small_time)

    def slow(configs):  # every evaluation takes 1 fake second
        clock.now += len(configs)
        return inner(configs)

    run(name, space, slow, Budget(100, seconds=5.0), seed=0, clock=clock, batch_size=2, **{
        k: v for k, v in FAST[name].items() if k != "batch_size"})
    # The batch that crosses 5 s finishes; nothing starts after it.
    assert 5 <= inner.calls <= 6


def test_exhaustive_orders():
    space = small_space()
    valid = space.valid_configs()
    fwd = run("exhaustive", space, StrictEvaluator(space, small_time), Budget(len(valid)), seed=0)
    rev = run("exhaustive", space, StrictEvaluator(space, small_time), Budget(len(valid)), seed=0, order="reverse")
    rnd = run("exhaustive", space, StrictEvaluator(space, small_time), Budget(len(valid)), seed=0, order="random")
    assert [c for c, _ in fwd] == valid
    assert [c for c, _ in rev] == valid[::-1]
    assert sorted(config_key(c) for c, _ in rnd) == sorted(config_key(c) for c in valid)
    with pytest.raises(ValueError, match="order='sideways'"):
        run("exhaustive", space, StrictEvaluator(space, small_time), Budget(3), seed=0, order="sideways")


def test_unknown_strategy_rejected_by_name():
    with pytest.raises(ValueError, match=r"unknown search strategy 'tabu'.*'anneal', 'ax', 'exhaustive', 'genetic'"):
        run("tabu", small_space(), StrictEvaluator(small_space(), small_time), Budget(3), seed=0)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_unknown_option_rejected_by_name(name):
    ev = StrictEvaluator(small_space(), small_time)
    with pytest.raises(ValueError, match=rf"unknown option\(s\) \['populaton_size'\] for search strategy '{name}'"):
        run(name, small_space(), ev, Budget(3), seed=0, populaton_size=10)
    assert ev.calls == 0


def test_check_options_lists_the_valid_ones():
    with pytest.raises(ValueError, match="batch_size=8"):
        check_options("ax", {"bogus": 1})


@pytest.mark.parametrize("invalid", ["penalty", "abandon", "constraint"])
def test_ax_failures_are_reported_and_not_reproposed(invalid):
    # A third of the valid configurations fail with typed errors; the strict evaluator asserts no repeats.
    space = small_space()
    statuses = itertools.cycle([None, "compile", None, "resources", None, "timeout"])
    failing = {config_key(c): next(statuses) for c in space.valid_configs()}
    ev = StrictEvaluator(space, small_time, fail=lambda c: failing[config_key(c)])
    stats = {}
    trials = run("ax", space, ev, Budget(10), seed=0, invalid=invalid, stats=stats, **FAST["ax"])
    assert ev.calls == 10
    assert {o.status for _, o in trials} - {"ok", "invalid"}, "some failures should have been hit"
    assert stats["generations"] >= 1


# Measured with benchmarks/probes/compare_invalid_handling.py on this landscape (docs/strategies.md): with the
# default options Ax was within 95% of the optimum after a median of 16.5 evaluations (10 seeds, worst 27,
# seeds 0-2 needing 16, 21 and 27) and at the optimum after 40 for all 10; random search needs a median
# of 576. Runs stop once the target is reached. Only the first two seeds run here: each costs 13 s, and
# seed 2 alone 35 s (10 generations, two GP fits each), which would put this file past its 60 s.
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_ax_near_optimum_on_synthetic_landscape(seed):
    space = implicit_gemm.space()
    replay = ReplayEvaluator(synthetic_times(space, ALEXNET_CONV2, seed=0))
    optimum = replay.best()[1].time_us
    strict = StrictEvaluator(space, lambda c: replay.median(c).time_us,
                             fail=lambda c: None if replay.median(c).ok else "resources")
    clock = FakeClock()

    def evaluate(configs):
        out = strict(configs)
        if any(o.ok and o.time_us <= optimum / 0.95 for o in out):
            clock.now = 1e9  # target reached: the seconds budget ends the run
        return out

    trials = run("ax", space, evaluate, Budget(40, seconds=1e6), seed=seed, clock=clock)
    best = min(o.time_us for _, o in trials if o.ok)
    assert optimum / best >= 0.95, f"seed {seed}: best {best:.0f} us vs optimum {optimum:.0f} us"
    assert strict.calls <= 40


@pytest.mark.slow
@pytest.mark.parametrize("invalid", ["abandon", "constraint"])
def test_ax_completes_trials_directly_with_the_same_search(monkeypatch, invalid):
    """The direct completion (``ax_bo._completer``) leaves Ax with what ``Client.complete_trial`` would: the same
    seed proposes the same configurations in the same order, and Client.complete_trial is not called."""
    from ax import Client

    from bagf_torch.tuning.strategies import ax_bo

    space = implicit_gemm.space()
    replay = ReplayEvaluator(synthetic_times(space, ALEXNET_CONV2, seed=0))
    calls = []
    real = Client.complete_trial
    monkeypatch.setattr(Client, "complete_trial", lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])

    def search(fast: bool) -> list:
        monkeypatch.setattr(ax_bo, "FAST_COMPLETE", fast)
        calls.clear()
        strict = StrictEvaluator(space, lambda c: replay.median(c).time_us,
                                 fail=lambda c: None if replay.median(c).ok else "resources")
        trials = run("ax", space, strict, Budget(14), seed=3, invalid=invalid, initial_trials=4)
        return [config_key(c) for c, _ in trials], len(calls)

    direct, direct_calls = search(True)
    client, client_calls = search(False)
    assert direct == client and len(direct) >= 14
    assert direct_calls == 0 and client_calls > 0


def test_ax_option_values_checked():
    with pytest.raises(ValueError, match="invalid='ignore'"):
        run("ax", small_space(), StrictEvaluator(small_space(), small_time), Budget(3), seed=0, invalid="ignore")


# ---- replay ---------------------------------------------------------------------------------------------

RECORDS = [
    {"config": {"a": 1}, "status": "ok", "time_us": 10.0, "spread_us": 1.0},
    {"config": {"a": 2}, "status": "ok", "time_us": 20.0, "spread_us": 0.0},
    {"config": {"a": 4}, "status": "compile", "time_us": None, "spread_us": None},
]


def test_ax_console_stays_quiet_while_runs_overlap():
    """A search abandoned at its family's deadline winds up on its own thread while the next one runs: Ax's
    console level and the warning filters are restored when the last run ends, not when the first does."""
    pytest.importorskip("ax")
    import logging

    from ax.utils.common.logger import ROOT_STREAM_HANDLER

    from bagf_torch.tuning.strategies import ax_bo

    import warnings

    before, filters = ROOT_STREAM_HANDLER.level, list(warnings.filters)
    first, second = ax_bo._quiet_ax(), ax_bo._quiet_ax()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the abandoned search ends while the next one still generates
    assert ROOT_STREAM_HANDLER.level == logging.ERROR and warnings.filters[0][0] == "ignore"
    second.__exit__(None, None, None)
    assert ROOT_STREAM_HANDLER.level == before and warnings.filters == filters  # nothing left ignored


def test_replay_deterministic_returns_median_and_counts():
    ev = ReplayEvaluator(RECORDS)
    out = ev([{"a": 1}, {"a": 2}, {"a": 4}])
    assert [o.status for o in out] == ["ok", "ok", "compile"]
    assert [o.time_us for o in out[:2]] == [10.0, 20.0]
    assert ev([{"a": 1}])[0].time_us == 10.0
    assert ev.calls == 4 and ev.batches == 2
    assert ev.best() == ({"a": 1}, Outcome("ok", 10.0))


def test_replay_noisy_uses_spread_and_seed():
    draws = [ReplayEvaluator(RECORDS, deterministic=False, seed=s)([{"a": 1}] * 200) for s in (5, 5, 6)]
    times = [[o.time_us for o in d] for d in draws]
    assert times[0] == times[1]  # same seed, same noise
    assert times[0] != times[2]
    mean = sum(times[0]) / len(times[0])
    sd = (sum((t - mean) ** 2 for t in times[0]) / len(times[0])) ** 0.5
    assert abs(mean - 10.0) < 0.3 and 0.7 < sd < 1.3
    # zero spread stays exact, failures stay failures
    ev = ReplayEvaluator(RECORDS, deterministic=False, seed=0)
    assert ev([{"a": 2}])[0].time_us == 20.0
    assert ev([{"a": 4}])[0].status == "compile"


def test_replay_from_mapping_and_missing_config():
    ev = ReplayEvaluator({config_key({"a": 1}): Outcome("ok", 5.0)}, deterministic=False, seed=0)
    assert abs(ev([{"a": 1}])[0].time_us - 5.0) < 0.5  # default spread 1% of the time
    with pytest.raises(KeyError, match="not in the recording"):
        ev([{"a": 3}])


def test_synthetic_landscape_is_plausible_and_seeded():
    space = implicit_gemm.space()
    a = synthetic_times(space, ALEXNET_CONV2, seed=0)
    assert a == synthetic_times(space, ALEXNET_CONV2, seed=0)
    assert a != synthetic_times(space, ALEXNET_CONV2, seed=1)
    assert len(a) == len(space.valid_configs())
    ok = [r["time_us"] for r in a if r["status"] == "ok"]
    failed = [r for r in a if r["status"] != "ok"]
    assert 0 < len(failed) < 0.1 * len(a) and {r["status"] for r in failed} == {"resources"}
    assert max(ok) / min(ok) > 10  # rugged: a bad configuration is far slower than the best
    # AlexNet conv2 at N=128 is 28.7 GFMA: no configuration beats the H200's fp32 peak (33.8 TFMA/s).
    assert min(ok) > 28.7e9 / 33.8e12 * 1e6
    with pytest.raises(ValueError, match="lacks"):
        synthetic_times(space, {"N": 1}, seed=0)


# ---- recorded-space files and the benchmark scripts ------------------------------------------------------

def test_recording_round_trips(tmp_path):
    from bagf_torch.tuning.replay import FORMAT, load_recording, write_recording

    rows = [{"config": [1, 2], "status": "ok", "median_us": 10.0, "p20_us": 9.0, "p80_us": 11.0, "reps": 50},
            {"config": [2, 2], "status": "cutoff", "median_us": 99.0, "reps": 1, "detail": "first sample"},
            {"config": [4, 1], "status": "wrong", "detail": "relative error 1e-1"}]
    problems = [{"name": "p", "conv": {"n": 1}, "cudnn": {"median_us": 8.0},
                 "families": {"fam": {"knobs": ["a", "b"], "default": [1, 2], "complete": False, "records": rows}}}]
    path = tmp_path / "r.json.gz"
    write_recording(path, {"gpu": "test"}, problems)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    rec = load_recording(path)
    assert rec.meta == {"gpu": "test"} and not rec.synthetic
    (rp,) = rec.problems
    assert (rp.name, rp.family, rp.knobs, rp.default, rp.complete, rp.cudnn) == (
        "p", "fam", ["a", "b"], {"a": 1, "b": 2}, False, {"median_us": 8.0})
    assert rp.rows == rows
    recs = rp.records()
    assert recs[0]["config"] == {"a": 1, "b": 2} and recs[0]["time_us"] == 10.0
    assert abs(recs[0]["spread_us"] - 2.0 / 1.6832) < 1e-9
    assert recs[1]["status"] == "ok" and recs[1]["time_us"] == 99.0  # a cut-off replays as its one sample
    assert rp.records(cutoff="timeout")[1]["status"] == "timeout"
    assert [o.status for o in rp.evaluator()([{"a": 4, "b": 1}])] == ["wrong"]
    # an unchanged document writes the same bytes (no timestamp in the gzip header)
    first = path.read_bytes()
    write_recording(path, {"gpu": "test"}, problems)
    assert path.read_bytes() == first
    plain = tmp_path / "r.json"
    plain.write_text('{"format": "something-else/9", "problems": []}')
    with pytest.raises(ValueError, match=f"'something-else/9' is not '{FORMAT}'"):
        load_recording(plain)


def _tiny_recording(tmp_path, keep_whole: tuple = ()):
    """A SYNTHETIC recording of implicit_gemm cut down to the configurations with BM=BN=32, BK=8 (60 valid),
    so PARTIAL, except the problems named in ``keep_whole``."""
    import gzip
    import json

    from bagf_torch.tuning.replay import load_recording, synthetic_recording, write_recording

    conv = {"n": 1, "c": 64, "h": 27, "w": 27, "k": 192, "r": 5, "s": 5, "stride": [1, 1], "padding": [2, 2]}
    path = tmp_path / "SYNTHETIC-tiny.json.gz"
    synthetic_recording(path, {"tiny_a": conv, "tiny_b": dict(conv, n=8)}, seed=3)
    doc = json.loads(gzip.decompress(path.read_bytes()))
    for p in doc["problems"]:
        if p["name"] in keep_whole:
            continue
        fam = p["families"]["implicit_gemm"]
        fam["records"] = [r for r in fam["records"] if r["config"][:3] == [32, 32, 8]]
        fam["complete"] = False
    write_recording(path, doc["meta"], doc["problems"])
    return path, load_recording(path)


def _benchmark_module(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_recording_of_another_space_is_excluded_not_replayed_as_never(tmp_path):
    """A recording made before its family's knobs changed matches no configuration of today's space: every strategy
    would 'never' reach 95% for that reason alone, so strategies.py leaves it out and says why."""
    import gzip
    import json

    from bagf_torch.tuning.replay import load_recording, write_recording

    bench = _benchmark_module("strategies")
    path, rec = _tiny_recording(tmp_path, keep_whole=("tiny_a",))
    assert bench.stale_reason(rec.problems[0]) is None
    doc = json.loads(gzip.decompress(path.read_bytes()))
    fam = doc["problems"][0]["families"]["implicit_gemm"]
    fam["knobs"], fam["default"] = fam["knobs"][:-1], fam["default"][:-1]  # one knob fewer than today's space
    for r in fam["records"]:
        r["config"] = r["config"][:-1]
    write_recording(path, doc["meta"], doc["problems"])
    assert "record it again" in bench.stale_reason(load_recording(path).problems[0])
    fam["knobs"], fam["default"] = fam["knobs"] + ["VEC"], fam["default"] + [4]
    for r in fam["records"]:
        r["config"] = r["config"] + [3]  # the knobs match, but VEC=3 is no value of today's space
    write_recording(path, doc["meta"], doc["problems"])
    assert "no recorded configuration is valid" in bench.stale_reason(load_recording(path).problems[0])


@pytest.mark.parametrize("name", ["anneal", "genetic", "random", "ax"])
def test_every_strategy_finds_optimum_of_a_recorded_space_with_full_budget(tmp_path, name):
    bench = _benchmark_module("strategies")
    _, rec = _tiny_recording(tmp_path)
    rp = rec.problems[0]
    space = bench.space_for(rp)
    replay = rp.evaluator()
    n_valid = len(space.valid_configs())
    assert 30 < n_valid < 100
    ev = StrictEvaluator(space, lambda c: replay.median(c).time_us,
                         fail=lambda c: None if replay.median(c).ok else replay.median(c).status)
    trials = run(name, space, ev, Budget(n_valid), seed=4, **FAST[name])
    assert ev.calls == n_valid
    best = min((t for t in trials if t[1].ok), key=lambda t: t[1].time_us)
    assert best[0] == replay.best()[0]


def test_strategies_benchmark_end_to_end(tmp_path):
    import json

    bench = _benchmark_module("strategies")
    path, _ = _tiny_recording(tmp_path)
    out = tmp_path / "out.json"
    md = tmp_path / "out.md"
    rc = bench.main(["--data", str(path), "--strategies", "random,anneal,genetic,ax", "--seeds", "2",
                     "--budget", "12", "--workers", "1", "--json", str(out), "--md", str(md), "--partial"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["synthetic"] is True and "SYNTHETIC" in md.read_text()
    assert all("PARTIAL 60/3568" in p for p in doc["per_problem"]) and "PARTIAL problems are included" in md.read_text()
    assert set(doc["per_strategy"]) == {"random", "anneal", "genetic", "ax"}
    assert len(doc["runs"]) == 2 * 4 * 2
    for s, v in doc["per_strategy"].items():
        assert set(v["fraction_at"]) == {"10"}
        assert 0 < v["fraction_at"]["10"] <= 1
    for r in doc["runs"]:
        curve = r["curve"]
        assert len(curve) == 12 and all(a <= b + 1e-12 for a, b in zip(curve, curve[1:]))  # best-so-far
        assert r["evals_to_95"] is None or curve[r["evals_to_95"] - 1] >= 0.95
    assert set(doc["issue_bar"]) >= {"ax_95_within_30", "ax_2x_fewer_than_random"}


def test_strategies_benchmark_leaves_out_spaces_the_budget_exhausts(tmp_path, capsys):
    """A recorded space with at most --min-space configurations (default: --budget) ranks strategies on nothing
    (exhaustive search finishes it): it is listed as excluded, with the reason, and not run."""
    bench = _benchmark_module("strategies")
    path, _ = _tiny_recording(tmp_path)  # 60 recorded rows per problem (run with --partial)
    rc = bench.main(["--data", str(path), "--strategies", "random", "--seeds", "1", "--budget", "60",
                     "--workers", "1", "--partial"])
    err = capsys.readouterr().err
    assert rc == 2 and "no problem left" in err
    assert err.count("at most --min-space 60: exhaustive search covers it") == 2
    assert bench.main(["--data", str(path), "--strategies", "random", "--seeds", "1", "--budget", "6",
                       "--workers", "1", "--partial", "--min-space", "59"]) == 0


def test_param_analysis_end_to_end(tmp_path):
    bench = _benchmark_module("probes/param_analysis")
    _, rec = _tiny_recording(tmp_path)
    r = bench.analyse(rec.problems[0])
    ok = [row for row in rec.problems[0].rows if row["status"] == "ok"]
    optimum = min(row["median_us"] for row in ok)
    assert r["optimum_us"] == optimum
    for knob, per in r["knobs"].items():
        ratios = [v for v in per.values() if v is not None]
        assert min(ratios) == 1.0 and all(v >= 1.0 for v in ratios)  # the optimum's own value costs nothing
    assert r["knobs"]["BM"] == {"32": 1.0}  # only BM=32 was kept
    assert r["default_us"] is None  # the default (BM=64) is not in the cut-down recording
    assert "SYNTHETIC" in bench.markdown([r], synthetic=True)


def test_loader_flags_partial_problems(tmp_path):
    from bagf_torch.tuning.replay import load_recording, write_recording

    rows = [{"config": [a, 1], "status": "ok", "median_us": 10.0 + a} for a in (1, 2, 4)]

    def fam(complete, valid, n):
        return {"knobs": ["a", "b"], "default": [1, 1], "complete": complete, "valid": valid, "seconds": 18.2,
                "records": rows[:n]}

    problems = [{"name": "whole", "conv": {}, "families": {"f": fam(True, 3, 3)}},
                {"name": "stopped", "conv": {}, "families": {"f": fam(False, 3, 2)}},
                # the flag says complete but rows are missing: the loader must not believe the flag
                {"name": "lying", "conv": {}, "families": {"f": fam(True, 3, 2)}}]
    path = tmp_path / "r.json.gz"
    write_recording(path, {"gpu": "test"}, problems)
    whole, stopped, lying = load_recording(path).problems
    assert whole.complete and whole.partial_reason is None and whole.valid == 3
    for rp in (stopped, lying):
        assert not rp.complete
        assert "2 of 3 valid configurations" in rp.partial_reason and "18 s" in rp.partial_reason


def test_benchmarks_exclude_partial_problems_by_default(tmp_path):
    import json

    path, rec = _tiny_recording(tmp_path, keep_whole=("tiny_a",))
    assert [rp.complete for rp in rec.problems] == [True, False]
    bench = _benchmark_module("strategies")
    out = tmp_path / "s.json"
    args = ["--data", str(path), "--strategies", "random", "--seeds", "2", "--budget", "5", "--workers", "1",
            "--json", str(out)]
    assert bench.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["used"] == ["tiny_a/implicit_gemm"]
    assert list(doc["meta"]["excluded"]) == ["tiny_b/implicit_gemm"]
    assert "60 of 3568" in doc["meta"]["excluded"]["tiny_b/implicit_gemm"]
    assert {r["problem"] for r in doc["runs"]} == {"tiny_a/implicit_gemm"}
    assert bench.main(args + ["--partial"]) == 0
    doc = json.loads(out.read_text())
    assert {r["problem"] for r in doc["runs"]} == {"tiny_a/implicit_gemm", "tiny_b/implicit_gemm PARTIAL 60/3568"}

    analysis = _benchmark_module("probes/param_analysis")
    out = tmp_path / "p.json"
    assert analysis.main(["--data", str(path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["problem"] for r in doc["problems"]] == ["tiny_a/implicit_gemm"]
    assert list(doc["excluded"]) == ["tiny_b/implicit_gemm"]


def test_replay_cuts_like_the_tuner():
    bench = _benchmark_module("strategies")
    ev = ReplayEvaluator([{"config": {"a": a}, "status": "ok", "time_us": t, "spread_us": 0.0}
                          for a, t in ((1, 50.0), (2, 10.0), (3, 41.0), (4, 39.0), (5, 1000.0))], cutoff_factor=4.0)
    # the first time is never cut (no best yet); then anything above 4 x the best so far is a timeout
    assert [o.status for o in ev([{"a": 5}, {"a": 2}, {"a": 3}, {"a": 4}, {"a": 1}])] == [
        "ok", "ok", "timeout", "ok", "timeout"]
    assert ReplayEvaluator(ev.records)([{"a": 3}])[0].status == "ok"  # no cut-off unless asked
    # the benchmark replays the real tuner's cut-off; docs/strategies.md quotes 4.0
    assert bench.TUNER_CUTOFF == 4.0


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_prior_knowledge_is_used_and_never_re_evaluated(name):
    """The tuner hands every strategy what it measured before the search (start point, warm-start seeds):
    none of it is sent again, the budget counts only new configurations, and the best prior is kept."""
    space = small_space()
    prior_configs = [{"a": 4, "b": 1, "c": 1}, {"a": 1, "b": 1, "c": 0}]
    prior = [(c, Outcome("ok", small_time(c))) for c in prior_configs]
    ev = StrictEvaluator(space, small_time)
    ev.seen.update(config_key(c) for c in prior_configs)  # sending a prior again fails the test
    trials = run(name, space, ev, Budget(5), seed=0, prior=prior, **FAST[name])
    assert 0 < ev.calls <= 5
    assert all(config_key(c) not in {config_key(p) for p in prior_configs} for c, o in trials if o.status != "invalid")


def test_anneal_walks_from_the_best_prior():
    space = small_space()
    best = {"a": 4, "b": 1, "c": 1}  # one step from the optimum (b=2)
    prior = [(best, Outcome("ok", small_time(best))), ({"a": 8, "b": 2, "c": 0}, Outcome("ok", 30.0))]
    ev = StrictEvaluator(space, small_time)
    run("anneal", space, ev, Budget(4), seed=1, prior=prior, batch_size=4)
    first = [c for c in space.valid_configs() if config_key(c) in ev.seen]
    # its first batch is made of the prior best's one-knob neighbours (a random start would not be)
    assert first and all(sum(c[k] != best[k] for k in best) == 1 for c in first), first


def test_warm_start_seeds_are_leave_one_out():
    """The replay's warm start mirrors the tuner's (warmstart.neighbour_seeds over a cache) with a cache of
    every OTHER recorded problem's optimum: a problem's own optimum must never be a source of its seeds."""
    from bagf_torch.tuning.replay import load_recording

    bench = _benchmark_module("strategies")
    path = bench.DATA / "implicit_gemm_tc_h200.json.gz"
    rec = load_recording(path)
    plans = bench.recorded_optima([path])
    complete = [rp for rp in rec.problems if rp.complete]
    assert sorted(p["key"] for p in plans) == sorted(rp.key for rp in complete)  # partial ones have no optimum
    by_key = {p["key"]: p for p in plans}
    for rp in complete:
        seeds = bench.warm_seeds(rp, plans)
        others = {config_key(p["config"]) for p in plans if p["key"] != rp.key}
        assert len(seeds) <= 3 and all(config_key(c) in others for c in seeds), rp.key
        own = by_key[rp.key]
        # its own plan alone gives nothing, even disguised as a neighbour's problem
        assert bench.warm_seeds(rp, [own]) == []
        near = dict(own, problem=dict(own["problem"], n=own["problem"]["n"] * 2))
        assert bench.warm_seeds(rp, [near]) == []
    seeds_of = {rp.name: bench.warm_seeds(rp, plans) for rp in complete}
    # the N=1 AlexNet conv3-5 share their winners (conv3's optimum is conv5's); conv1 (11x11, stride 4) has
    # no neighbour within warmstart.MAX_DISTANCE
    assert seeds_of["alexnet_conv4_n1"] and seeds_of["alexnet_conv3_n1"] and not seeds_of["alexnet_conv1_n1"]
    assert config_key(by_key["alexnet_conv4_n1/implicit_gemm_tc"]["config"]) not in {
        config_key(c) for c in seeds_of["alexnet_conv4_n1"]}


def test_strategies_benchmark_warm_start_mirrors_the_tuner(tmp_path):
    import json

    bench = _benchmark_module("strategies")
    path, rec = _tiny_recording(tmp_path, keep_whole=("tiny_a", "tiny_b"))
    runs = {}
    for mode, extra in (("warm", []), ("cold", ["--no-warm"]), ("none", ["--no-start"])):
        out = tmp_path / f"{mode}.json"
        assert bench.main(["--data", str(path), "--strategies", "random,anneal", "--seeds", "1", "--budget", "6",
                           "--workers", "1", "--json", str(out)] + extra) == 0
        runs[mode] = json.loads(out.read_text())
    warm = runs["warm"]
    assert warm["meta"]["warm_start"] is True and runs["cold"]["meta"]["warm_start"] is False
    optima = {p["key"]: config_key(p["config"]) for p in bench.recorded_optima([path])}
    for rp in rec.problems:
        seeds = warm["meta"]["warm_seeds"][rp.key]
        # tiny_a (N=1) and tiny_b (N=8) are neighbours: each gets the other's optimum, never its own
        assert [config_key(c) for c in seeds] == [optima[k] for k in optima if k != rp.key]
    # the seed is measured after the start point (this synthetic family has no problem-sized start)
    starts = {rp.key: bench.start_config(rp) for rp in rec.problems}
    expect = {k: (v is not None) + (v not in warm["meta"]["warm_seeds"][k]) for k, v in starts.items()}
    assert all(r["prior"] == expect[r["problem"]] >= 1 for r in warm["runs"])
    assert all(r["prior"] == (starts[r["problem"]] is not None) for r in runs["cold"]["runs"])
    assert all(r["prior"] == 0 for r in runs["none"]["runs"])


@pytest.mark.parametrize("explore", [0, 2])
def test_ax_exploring_trials_are_the_last_of_each_generation(explore):
    """Ax generates a batch one trial at a time (n=1 per acquisition call); the exploring rule's candidate lists
    serve the last ``min(explore, n - 1)`` of them, and none without the option."""
    space = small_space()
    stats: dict = {}
    run("ax", space, StrictEvaluator(space, small_time), Budget(24), seed=1, stats=stats,
        **dict(FAST["ax"], explore=explore, explore_from="all"))
    gp = [r for r in stats["roles"] if r]  # generations the GP made (the initial design has none)
    assert gp, stats
    for roles in gp:
        m = min(explore, len(roles) - 1)
        assert roles == ["region"] * (len(roles) - m) + ["explore"] * m, roles
    assert stats["explored"] == sum(r.count("explore") for r in gp) and (stats["explored"] > 0) == (explore > 0)


def small_features(c):
    """Problem-aware inputs for the small space: the product a*b (log2) that its validity rule and
    ``small_time``'s second basin depend on."""
    return {"log2_ab": math.log2(c["a"] * c["b"]), "c": float(c["c"])}


@pytest.mark.parametrize("options", [{"trust_region": 2}, {"candidates": "raw"}, {"initial": "random"},
                                     {"initial_batch": 2, "trust_region": 1}, {"features": small_features},
                                     {"features": small_features, "candidates": "raw", "trust_region": 0},
                                     {"explore": 2, "explore_from": "outside", "trust_region": 1},
                                     {"explore": 2, "explore_from": "all"}, {"explore": 2, "explore_from": "far"},
                                     {"explore": 1, "explore_from": "uncertain", "explore_after": 2}])
def test_ax_set_ups_never_send_invalid_and_find_the_optimum(options):
    space = small_space()
    n_valid = len(space.valid_configs())
    ev = StrictEvaluator(space, small_time)
    stats: dict = {}
    trials = run("ax", space, ev, Budget(n_valid), seed=0, stats=stats, **dict(FAST["ax"], **options))
    assert ev.calls == n_valid
    assert min((t for t in trials if t[1].ok), key=lambda t: t[1].time_us)[0] == true_optimum(space, small_time)
    if options.get("candidates", "valid") == "valid":
        assert stats["invalid_proposals"] == 0  # Ax only ever scores valid configurations
    again = StrictEvaluator(space, small_time)
    run("ax", space, again, Budget(8), seed=0, **dict(FAST["ax"], **options))
    first = StrictEvaluator(space, small_time)
    run("ax", space, first, Budget(8), seed=0, **dict(FAST["ax"], **options))
    assert again.seen == first.seen  # reproducible for a seed


def test_ax_local_initial_design_walks_from_the_best_prior():
    space = small_space()
    best = {"a": 4, "b": 1, "c": 1}
    prior = [(best, Outcome("ok", small_time(best))), ({"a": 8, "b": 2, "c": 0}, Outcome("ok", 30.0))]
    ev = StrictEvaluator(space, small_time)
    run("ax", space, ev, Budget(3), seed=1, prior=prior, batch_size=3, initial_trials=5)
    first = [c for c in space.valid_configs() if config_key(c) in ev.seen]
    assert len(first) == 3 and all(sum(c[k] != best[k] for k in best) == 1 for c in first), first


def test_ax_trust_region_candidates():
    from bagf_torch.tuning.strategies.ax_bo import _Codec, _trust_region

    space = small_space()
    codec = _Codec(space)
    valid = space.valid_configs()
    ranks = {config_key(c): __import__("numpy").array(codec.ranks(c)) for c in valid}
    centre = {"a": 4, "b": 1, "c": 1}
    inside, r = _trust_region(ranks, centre, {config_key(centre)}, 1, 1, valid)
    assert r == 1 and inside and all(sum(c[k] != centre[k] for k in centre) == 1 for c in inside)
    assert config_key(centre) not in {config_key(c) for c in inside}
    grown, r = _trust_region(ranks, centre, {config_key(centre)}, len(valid) - 1, 1, valid)
    assert len(grown) == len(valid) - 1 and r > 1  # grown until a batch fits


def test_ax_far_picks_spread_from_what_was_evaluated():
    import numpy as np

    from bagf_torch.tuning.strategies.ax_bo import _Codec, _far

    space = small_space()
    codec = _Codec(space)
    valid = space.valid_configs()
    ranks = {config_key(c): np.array(codec.ranks(c)) for c in valid}
    done = [{"a": 8, "b": 2, "c": 1}]
    pool = [c for c in valid if c not in done]
    picked = _far(ranks, pool, done, 2, np.random.default_rng(0))
    dist = {config_key(c): int(np.abs(ranks[config_key(c)] - ranks[config_key(done[0])]).sum()) for c in pool}
    assert len(picked) == 2 and dist[config_key(picked[0])] == max(dist.values())
    # the second is spread from the first as well as from what was evaluated
    assert int(np.abs(ranks[config_key(picked[1])] - ranks[config_key(picked[0])]).sum()) >= 1
    assert _far(ranks, [], done, 2, np.random.default_rng(0)) == []


def test_ax_explore_options_checked():
    space = small_space()
    for bad in ({"explore": -1}, {"explore_after": -1}, {"explore_from": "nowhere"}):
        with pytest.raises(ValueError, match="explore"):
            run("ax", space, StrictEvaluator(space, small_time), Budget(4), seed=0, **bad)


def test_ax_features_reach_the_gp_scaled_next_to_the_knobs():
    import torch

    from bagf_torch.tuning.strategies.ax_bo import _Codec, _feature_table, _feature_transform

    space = small_space()
    codec = _Codec(space)
    levels, table = _feature_table(codec, small_features)
    valid = space.valid_configs()
    assert table.shape == (space.size, 2)  # every raw combination (an invalid one may fall outside [0, 1])
    transform = _feature_transform((levels, table), None)
    names = list(codec.ax_values)
    x = torch.tensor([[float(codec.encode(c)[n]) for n in names] for c in valid], dtype=torch.float64)
    out = transform.transform(x)
    assert out.shape == (len(valid), len(names) + 2) and torch.equal(out[:, :len(names)], x)
    ab = [math.log2(c["a"] * c["b"]) for c in valid]  # scaled to [0, 1] over the valid configurations
    # features in name order: "c", then "log2_ab"
    assert out[:, len(names)].tolist() == [float(c["c"]) for c in valid]
    assert out[:, len(names) + 1].tolist() == pytest.approx([(v - min(ab)) / (max(ab) - min(ab)) for v in ab])
    assert transform.transform(x[None]).shape == (1, *out.shape)  # batched as the acquisition asks


def test_ax_features_option_checked():
    with pytest.raises(ValueError, match="features"):
        run("ax", small_space(), StrictEvaluator(small_space(), small_time), Budget(4), seed=0, features=3)


def test_ax_initial_order_tries_the_best_ranked_neighbours_first():
    space = small_space()
    best = {"a": 4, "b": 1, "c": 1}  # valid neighbours: (2,1,1), (8,1,1), (4,2,1), (4,1,0)
    prior = [(best, Outcome("ok", small_time(best)))]

    def rank(c):
        return 100 * c["a"] + 10 * c["b"] + c["c"]

    top2 = {config_key({"a": 8, "b": 1, "c": 1}), config_key({"a": 4, "b": 2, "c": 1})}
    unranked = []
    for seed in range(4):
        ev = StrictEvaluator(space, small_time)
        run("ax", space, ev, Budget(2), seed=seed, prior=prior, batch_size=3, initial_trials=5,
            initial_order=rank, initial_ranked=2)
        assert ev.seen == top2, seed
        ev = StrictEvaluator(space, small_time)
        run("ax", space, ev, Budget(2), seed=seed, prior=prior, batch_size=3, initial_trials=5,
            initial_order=rank, initial_ranked=0)
        assert all(sum(c[k] != best[k] for k in best) == 1 for c in space.valid_configs() if config_key(c) in ev.seen)
        unranked.append(ev.seen)
    assert any(s != top2 for s in unranked)  # without the ranking the seeded random order decides


def test_ax_initial_order_options_checked():
    space = small_space()
    with pytest.raises(ValueError, match="initial_order"):
        run("ax", space, StrictEvaluator(space, small_time), Budget(4), seed=0, initial_order=3)
    with pytest.raises(ValueError, match="initial_ranked"):
        run("ax", space, StrictEvaluator(space, small_time), Budget(4), seed=0, initial_ranked=-1)


def test_ax_cold_order_starts_a_cold_search_with_the_best_estimated():
    space = small_space()

    def estimate(c):  # higher first: the four configurations with a=1
        return -c["a"] * 10 - c["b"] - c["c"]

    top4 = {config_key(c) for c in sorted(space.valid_configs(), key=lambda c: -estimate(c))[:4]}
    assert len(top4) == 4
    for seed in range(3):
        ev = StrictEvaluator(space, small_time)
        run("ax", space, ev, Budget(4), seed=seed, initial_batch=4, cold_order=estimate, cold_trials=4)
        assert ev.seen == top4, seed  # nothing measured before: the best-estimated, not random ones
    randoms = []
    for seed in range(3):
        ev = StrictEvaluator(space, small_time)
        run("ax", space, ev, Budget(4), seed=seed, initial_batch=4, cold_order=estimate, cold_trials=0)
        randoms.append(ev.seen)
    assert any(s != top4 for s in randoms)  # cold_trials 0: the random cold design
    best = {"a": 4, "b": 1, "c": 1}
    ev = StrictEvaluator(space, small_time)
    run("ax", space, ev, Budget(4), seed=0, prior=[(best, Outcome("ok", small_time(best)))], initial_batch=4,
        cold_order=estimate, cold_trials=4)
    assert ev.seen != top4  # with a prior the design walks from its best as before
    failed = {"a": 4, "b": 2, "c": 1}
    ev = StrictEvaluator(space, small_time)
    run("ax", space, ev, Budget(4), seed=0, prior=[(failed, Outcome("compile", detail="NVRTC failed"))],
        initial_batch=4, cold_order=estimate, cold_trials=4)
    assert ev.seen == top4  # a start point that failed is no centre: the best-estimated again
    with pytest.raises(ValueError, match="cold_order"):
        run("ax", space, StrictEvaluator(space, small_time), Budget(4), seed=0, cold_order=3)
    with pytest.raises(ValueError, match="cold_trials"):
        run("ax", space, StrictEvaluator(space, small_time), Budget(4), seed=0, cold_trials=-1)


def test_tc_estimated_time_ranks_the_recorded_spaces_better_than_chance():
    """On the complete H200 recordings of implicit_gemm_tc the 8 best-estimated configurations hold clearly more of
    the optimum than 8 random ones do in expectation, among the configurations timed in full (measured: 0.873
    against 0.775 in the mean over the 7 problems, more on 5 of them; AlexNet conv2 and conv5 at N=1 are the
    exceptions)."""
    from pathlib import Path

    from bagf_torch.kernels import implicit_gemm_tc as tc
    from bagf_torch.problem import ConvProblem
    from bagf_torch.tuning.replay import load_recording
    from bagf_torch.tuning.tuner import search_cold_order

    rec = load_recording(Path(__file__).resolve().parent.parent / "benchmarks/data/implicit_gemm_tc_h200.json.gz")
    ranked, chance = [], []
    for p in rec.problems:
        if p.family != tc.FAMILY or not p.complete:
            continue
        problem = ConvProblem.from_dict({"dilation": [1, 1], **p.conv})
        times = {tuple(r["config"]): r["median_us"] for r in p.rows if r["status"] == "ok"}
        opt = min(times.values())
        order = search_cold_order(tc, problem)
        configs = [dict(zip(p.knobs, k)) for k in times]
        top = sorted(configs, key=lambda c: -order(c))[:8]
        ranked.append(max(opt / times[tuple(c[k] for k in p.knobs)] for c in top))
        fractions = sorted(opt / t for t in times.values())  # E[best of 8 drawn without replacement]
        n = len(fractions)
        chance.append(sum(f * (math.comb(i, 7) / math.comb(n, 8)) for i, f in enumerate(fractions)))
        assert order(configs[0]) == -tc.estimated_time(problem, configs[0])
    assert len(ranked) >= 7
    assert sum(r > c for r, c in zip(ranked, chance)) >= len(ranked) - 2, (ranked, chance)
    assert sum(ranked) / len(ranked) > sum(chance) / len(chance) + 0.05, (ranked, chance)
    assert search_cold_order(implicit_gemm, ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5)) is None


def test_tc_warps_in_flight_counts_what_the_grid_can_fill():
    from bagf_torch.kernels import implicit_gemm_tc as tc
    from bagf_torch.problem import ConvProblem
    from bagf_torch.tuning.tuner import search_initial_order

    conv2 = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))  # N*P*Q = 729
    start = dict(tc.DEFAULT, SPLIT=8)  # 12 x 3 x SPLIT 8 = 288 blocks, 4 of 128 threads resident per SM
    assert tc.blocks_per_sm(start) == 4
    assert tc.warps_in_flight(conv2, start) == pytest.approx(288 / 132 * 4)  # the grid, not residency, limits
    assert tc.warps_in_flight(conv2, start, sms=66) == pytest.approx(4 * 4)  # residency limits
    assert tc.warps_in_flight(conv2, dict(start, WM=1)) == pytest.approx(288 / 132 * 2)  # half the warps
    assert tc.warps_in_flight(conv2, dict(start, SPLIT=4)) == pytest.approx(144 / 132 * 4)  # half the grid
    order = search_initial_order(tc, conv2)
    assert order(start) == tc.warps_in_flight(conv2, start)
    assert search_initial_order(implicit_gemm, conv2) is None  # a family without the function


def test_paired_comparison_intervals_and_merge(tmp_path):
    """The paired bootstrap of benchmarks/strategies.py: the mean difference is the difference of the mean
    curves, a constant lead is significant at every budget where the runs differ, a pure seed-noise
    difference is not, and --from-json re-summarises stored runs."""
    import json

    bench = _benchmark_module("strategies")
    rng = np.random.default_rng(0)
    runs = []
    for p in ("p1", "p2"):
        for seed in range(30):
            base = np.minimum(1.0, 0.5 + 0.05 * np.arange(10) + rng.normal(0, 0.02, 10))
            base[0] = 0.5
            lead = base + np.r_[0.0, np.full(9, 0.01) + rng.normal(0, 0.005, 9)]
            noise = base + np.r_[0.0, rng.normal(0, 0.05, 9)]
            for s, c in (("ax", lead), ("anneal", base), ("genetic", noise)):
                runs.append({"problem": p, "strategy": s, "seed": seed, "budget": 10, "curve": list(c),
                             "evals_to_95": None, "strategy_seconds": 0.0, "gen_seconds": None})
    c = bench.paired_comparison(runs, "ax", "anneal", 10, n_boot=500)
    assert c["pairs"] == 60 and c["problems"] == 2 and c["seeds"] == 30
    assert c["mean"][0] == 0 and np.allclose(c["mean"][1:], 0.01, atol=0.003)
    assert c["significantly_above"] == list(range(2, 11)) and c["significantly_below"] == []
    assert c["worst_case"] == 0.0 and c["min_mean"][1] >= 2
    g = bench.paired_comparison(runs, "ax", "genetic", 10, n_boot=500)
    assert all(lo <= m <= hi for lo, m, hi in zip(g["low"], g["mean"], g["high"]))
    assert all(s <= lo + 1e-12 for s, lo in zip(g["simultaneous_low"], g["low"]))  # the band is the wider
    assert bench._ranges([2, 3, 4, 9, 11, 12]) == "2-4, 9, 11-12"

    meta = {"problems": 2, "seeds": 30, "budget": 10, "ax_budget": 10, "noise": False, "cutoff_factor": 4.0,
            "ax_options": {}, "date": "d", "cpu": "c", "strategies": ["ax", "anneal", "genetic"]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"meta": meta, "runs": [r for r in runs if r["strategy"] == "ax"]}))
    b.write_text(json.dumps({"meta": meta, "runs": [r for r in runs if r["strategy"] != "ax"]}))
    out, md = tmp_path / "m.json", tmp_path / "m.md"
    assert bench.main(["--from-json", str(a), str(b), "--json", str(out), "--md", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["paired"]) == {"anneal", "genetic"} and "runs" not in doc
    assert [m["file"] for m in doc["meta"]["merged_from"]] == [str(a), str(b)]
    assert "Paired: ax - anneal" in md.read_text()


def test_ax_batches_small_while_early():
    """ax's local design runs in batches of ``initial_batch``, its GP generations ask for
    ``min(early_batch, batch_size)`` trials until ``early_until`` evaluations (prior included), then
    ``batch_size``."""
    space = Space("grid", {"a": (1, 2, 4, 8, 16, 32), "b": (1, 2, 4, 8, 16)})

    def time_of(c):
        return 5.0 + abs(c["a"] - 8) + abs(c["b"] - 4)

    sizes = []
    ev = StrictEvaluator(space, time_of)

    def evaluate(configs):
        sizes.append(len(configs))
        return ev(configs)

    start = {"a": 1, "b": 1}
    prior = [(start, Outcome("ok", time_of(start)))]
    run("ax", space, evaluate, Budget(19), seed=0, prior=prior, batch_size=6, initial_trials=5,
        initial_batch=2, early_batch=3, early_until=11)
    # prior 1 + local design 2, 2 (5 before the GP) + GP 3, 3 (11) + GP 6, then the budget's last 3 (the
    # budget counts the search's own evaluations, not the prior)
    assert sizes == [2, 2, 3, 3, 6, 3]


def test_device_scripts_name_plans_by_family_name_layer_and_batch():
    """host_floor.py, probes/ncu_plan.py and probes/ab_macro.py take plans as ``<family name>@<layer>:<N>``: the name must map
    back to its configuration (a specialised direct kernel included) and the layer to bench_layers' problem, in the
    plan's dtype and memory format."""
    hf = _benchmark_module("host_floor")
    fam, cfg, p = hf.parse_plan("direct_th8_tw16_bk64_bc1_tk8_px8_db0_s1_w11u4_sm90@conv1:128")
    assert fam.FAMILY == "direct" and cfg["G"] == 1 and cfg["PX"] == 8 and cfg["DB"] == 0
    assert (p.n, p.c, p.k, p.r, tuple(p.stride)) == (128, 3, 64, 11, (4, 4)) and fam.problem_rule(cfg, p) is None
    fam, cfg, p = hf.parse_plan("winograd_gemm_f5_tb64_vl0_ml0_sm90@r3x3_256:32")
    assert cfg == {"MT": 5, "TB": 64, "VL": 0, "ML": 0, "GE": 0, "SO": 0, "DT": 0, "NHWC": 0} and (
        p.n, p.c, p.h, p.k) == (32, 256, 56, 256)
    fam, cfg, p = hf.parse_plan("winograd_gemm_f5_tb64_vl0_ml0_ge2_sm90@conv4:128")
    assert cfg == {"MT": 5, "TB": 64, "VL": 0, "ML": 0, "GE": 2, "SO": 0, "DT": 0, "NHWC": 0} and fam.name_expression(
        cfg).endswith(
        "bagf::gemm_tf32x3<64, 128, 32, 1, 4, 2, 1>")
    fam, cfg, p = hf.parse_plan("winograd_gemm_f5_tb64_vl0_ml0_ge6_so1_sm90@conv4:32")
    assert cfg == {"MT": 5, "TB": 64, "VL": 0, "ML": 0, "GE": 6, "SO": 1, "DT": 0, "NHWC": 0} and fam.name_expression(
        cfg) == "bagf::winograd_gemm_stage<5, 64, 0, 0, 0, 0, 1, 1>;bagf::gemm_wgmma<128, 1, 2, 4>"
    assert (p.dtype, p.layout) == ("float32", "nchw")
    # a 16-bit plan runs in its own dtype and memory format (the check refuses a plan's dtype on another problem)
    fam, cfg, p = hf.parse_plan("implicit_gemm_tma_h16_bf16_wn128_mi1_wg2_st4_c2_sm90@r3x3_256:1")
    assert cfg["CR"] == 1 and cfg["SPLIT"] == 2 and (p.n, p.dtype, p.layout) == (1, "bfloat16", "nhwc")
    fam, cfg, p = hf.parse_plan("implicit_gemm_tma_h16_fp16_nchw_wn64_mi1_wg1_st5_c4_sm90@r3x3_128:1")
    assert (p.dtype, p.layout) == ("float16", "nchw") and fam.problem_rule(cfg, p) is None
    # a family without a memory-format knob that computes one format in that dtype: that format
    fam, cfg, p = hf.parse_plan("implicit_gemm_wgmma_h16_bf16_wn128_mi1_wg2_st4_ks1_s1_sm90@conv3:32")
    assert "NHWC" not in cfg and (p.dtype, p.layout) == ("bfloat16", "nhwc") and fam.applies(p) is None
    with pytest.raises(SystemExit, match="no configuration"):
        hf.parse_plan("direct_th3_tw16_bk64_bc1_tk8_px8_db0_s1_sm90@conv1:1")


def test_recorded_optima_complete_to_valid_configurations_of_todays_spaces():
    """bench_layers re-times each recording's optimum: each must be a valid configuration of today's space, and
    one recorded before a family gained a knob (winograd_gemm's GE) must come back with the knob at the value that
    was measured (GE = 0, cuBLAS's GEMM); on the H200 a missing knob crashed the benchmark at this step."""
    from bagf_torch.kernels import FAMILIES, complete_config

    bl = _benchmark_module("bench_layers")
    optima = bl.recorded_optima(sorted(bl.DATA.glob("*.json.gz")))
    assert optima, "no recordings in benchmarks/data"
    for prob, (family, config, _) in optima.items():
        assert FAMILIES[family].space().invalid_reason(config) is None, (family, config)
    assert any(f == "winograd_gemm" for f, _, _ in optima.values())
    for family, config, _ in optima.values():
        assert set(config) == set(FAMILIES[family].space().names), (family, config)
    # a configuration recorded before winograd_gemm gained GE (and SO, DT, NHWC) comes back with the value measured
    old = complete_config("winograd_gemm", {"MT": 5, "TB": 64, "VL": 0, "ML": 0})
    assert old["GE"] == 0 and FAMILIES["winograd_gemm"].space().invalid_reason(old) is None
    assert complete_config("winograd_gemm", {"MT": 5, "TB": 64, "VL": 0, "ML": 0, "GE": 3})["GE"] == 3
    assert complete_config("direct", {"TH": 8}) == {"TH": 8}


def test_gemm_probe_and_family_agree_on_the_gemm_tiles():
    """benchmarks/probes/gemm_tf32x3_probe.py and gemm_wgmma_probe.py measured the tiles winograd_gemm's GE picks from:
    each GEMMS and WGMMA_GEMMS tile is one a probe times, with the same shared memory and grid (the host launches
    with the family's numbers); the wgmma probe's A carries its small parts as stage 0 writes them; and the
    probes' products are the family's E x K x C x T for AlexNet's 3x3 layers."""
    from bagf_torch.kernels import winograd_gemm as wgg

    probe = _benchmark_module("probes/gemm_tf32x3_probe")
    emul = _benchmark_module("probes/cublas_emulation")
    for ge, tile in wgg.GEMMS.items():
        assert tile in probe.CONFIGS, tile
        assert probe.smem_bytes(tile) == wgg.gemm_smem_bytes(dict(wgg.DEFAULT, GE=ge))
        assert wgg.name_expression(dict(wgg.DEFAULT, GE=ge)).split(";")[1].replace(" ", "") == probe.expr(tile)
    wprobe = _benchmark_module("probes/gemm_wgmma_probe")
    for ge, tile in wgg.WGMMA_GEMMS.items():
        assert tile in wprobe.CONFIGS, tile
        c = dict(wgg.DEFAULT, GE=ge)
        assert wgg.name_expression(c).split(";")[1].replace(" ", "") == wprobe.expr(tile)
        geo = wgg.launch(c)
        assert geo.gemm_smem == wgg.wgmma_smem_bytes(tile) <= 227 * 1024
        assert wprobe.geometry(tile, 256, 512, 36) == ((512 // geo.gemm_bn, 256 // geo.gemm_bm, 36),
                                                       (geo.gemm_threads,))
    import torch

    a = torch.randn(3, 5, 7) * torch.logspace(-3, 3, 7)
    both = wprobe.with_small_parts(a)
    truncated = (a.view(torch.int32) & -8192).view(torch.float32)  # what the tensor cores read of an fp32 A
    assert torch.equal(both[0], a) and torch.equal(truncated + both[1], a)  # big + small is A, exactly
    assert (both[1].abs() < a.abs() * 2.0 ** -10).all() and (both[1] != 0).any()  # below one TF32 ulp of A
    bl = _benchmark_module("bench_layers")
    for s in emul.shapes([32]):
        layer = next(lay for lay in bl.ALEXNET if lay[0] == s["layer"])
        p = bl.problem(layer, 32)
        c = dict(wgg.DEFAULT, MT=s["MT"])
        assert (s["E"], s["K"], s["C"], s["T"]) == (wgg.points(c), p.k, p.c, wgg.tiles(c, p))


def test_a_configuration_twice_in_one_batch_is_evaluated_once():
    """The evaluator (and the tuner's listeners and cache journal behind it) sees each configuration once, also
    when a strategy proposes it twice in one batch; both places get its outcome."""
    from bagf_torch.kernels.space import Space
    from bagf_torch.tuning.common import Budget, Objective, Outcome

    asked = []

    def evaluate(cs):
        asked.extend(dict(c) for c in cs)
        return [Outcome("ok", float(c["a"])) for c in cs]

    objective = Objective(Space("demo", {"a": (1, 2, 4)}), evaluate, Budget(10))
    out = objective([{"a": 2}, {"a": 4}, {"a": 2}])
    assert asked == [{"a": 2}, {"a": 4}] and objective.spent == 2
    assert [o.time_us for o in out] == [2.0, 4.0, 2.0]


def test_a_problem_recorded_again_supersedes_its_older_recording(tmp_path):
    """Two files with a complete recording of the same problem: the replay and the warm start's synthetic cache take
    the newer file's (by its meta date), whose optimum is another configuration; a newer PARTIAL recording
    supersedes nothing; of two recordings with the same date the first file's is kept."""
    import gzip
    import json

    from bagf_torch.kernels.space import config_key
    from bagf_torch.tuning.replay import load_recording, write_recording

    st = _benchmark_module("strategies")
    old, _ = _tiny_recording(tmp_path, keep_whole=("tiny_a", "tiny_b"))
    doc = json.loads(gzip.decompress(old.read_bytes()))
    write_recording(old, dict(doc["meta"], date="2026-01-01T00:00:00+00:00"), doc["problems"])
    old_best = {rp.key: rp.evaluator().best()[0] for rp in load_recording(old).problems}
    problems = json.loads(json.dumps(doc["problems"]))
    for p in problems:  # tiny_a again, complete, with its slowest configuration now the fastest; tiny_b again, partial
        fam = p["families"]["implicit_gemm"]
        if p["name"] == "tiny_a":
            ok = [r for r in fam["records"] if r["status"] == "ok"]
            slowest = max(ok, key=lambda r: r["median_us"])
            for k in ("median_us", "p20_us", "p80_us"):
                slowest[k] = min(r["median_us"] for r in ok) / 2
        else:
            fam["records"] = fam["records"][:10]
            fam["complete"] = False
    new = tmp_path / "SYNTHETIC-tiny-again.json.gz"
    write_recording(new, dict(doc["meta"], date="2026-02-01T00:00:00+00:00"), problems)
    new_best = dict(zip(load_recording(new).problems[0].knobs, slowest["config"]))
    assert config_key(new_best) != config_key(old_best["tiny_a/implicit_gemm"])

    assert st.newest_complete([old, new]) == {"tiny_a/implicit_gemm": new, "tiny_b/implicit_gemm": old}
    plans = {p["key"]: p for p in st.recorded_optima([old, new])}
    assert sorted(plans) == ["tiny_a/implicit_gemm", "tiny_b/implicit_gemm"]  # one plan per problem
    assert config_key(plans["tiny_a/implicit_gemm"]["config"]) == config_key(new_best)  # the newer file's optimum
    assert config_key(plans["tiny_b/implicit_gemm"]["config"]) == config_key(old_best["tiny_b/implicit_gemm"])
    same_day = tmp_path / "SYNTHETIC-tiny-same-day.json.gz"
    write_recording(same_day, dict(doc["meta"], date="2026-01-01T00:00:00+00:00"), problems)
    assert st.newest_complete([old, same_day])["tiny_a/implicit_gemm"] == old
    out = tmp_path / "r.json"
    assert st.main(["--strategies", "random", "--seeds", "1", "--budget", "5", "--workers", "1", "--data", str(old),
                    str(new), "--json", str(out), "--md", str(tmp_path / "r.md")]) == 0
    md = (tmp_path / "r.md").read_text()
    assert "tiny_a/implicit_gemm in SYNTHETIC-tiny.json.gz: superseded by its recording in SYNTHETIC-tiny-again" in md
    assert "tiny_b/implicit_gemm in SYNTHETIC-tiny-again.json.gz: partial" in md

"""The fault matrix: run every row's tests and print the matrix with pass/fail and counts.

    python benchmarks/faults.py                     # CPU rows; GPU rows say "not run (no GPU ...)"
    python benchmarks/faults.py --json out.json     # also write the rows and counts as JSON
    python benchmarks/faults.py --noise             # GPU: also the noise row (two tunings, within 3%)

Each row is one or more pytest tests (tests/test_faults.py, and the rows tests/test_cache.py, test_tuner.py
and test_gpu.py already covered); they are run in this process through pytest with a small plugin that
collects each test's outcome and the counts it records (faults injected, user processes crashed, wrong
results cached, entries lost; see the ``counts`` fixture in tests/test_faults.py). A row passes when every
test of it that ran passed; it is "not run" when all of its tests were skipped (the reason is shown).

The noise row is a measurement, not a test: the same problem is tuned twice from empty caches, then both
winners are timed interleaved in one process; it passes when their times are within 3%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (row of the fault matrix, required behaviour in short, pytest node id prefixes)
ROWS = [
    ("candidate fails to compile (NVRTC error)", "typed failure with the log; tuning goes on",
     ["tests/test_tuner.py::test_typed_failures_recorded_and_never_win",
      "tests/test_faults.py::test_row_gpu_compile_and_resource_failures_are_typed"]),
    ("candidate needs too many resources / launch fails", "typed failure; tuning goes on",
     ["tests/test_tuner.py::test_typed_failures_recorded_and_never_win",
      "tests/test_faults.py::test_row_gpu_compile_and_resource_failures_are_typed"]),
    ("candidate writes out of bounds (illegal address)", "isolated worker: 'crashed', parent context usable",
     ["tests/test_faults.py::test_row_isolated_worker_survives",
      "tests/test_faults.py::test_row_gpu_faulty_kernels_isolated",
      "tests/test_faults.py::test_row_gpu_tuner_goes_on_past_faulty_candidates",
      "tests/test_faults.py::test_row_gpu_isolated_runtime_loads_only_the_winner"]),
    ("candidate returns wrong numbers", "rejected by the check; never cached",
     ["tests/test_faults.py::test_row_wrong_results_are_never_cached",
      "tests/test_gpu.py::test_checker_rejects_wrong_results",
      "tests/test_faults.py::test_row_gpu_faulty_kernels_isolated"]),
    ("candidate hangs / far slower than the best", "cut off by a time limit; typed failure",
     ["tests/test_faults.py::test_row_isolated_worker_survives", "tests/test_tuner.py::test_hopeless_candidates",
      "tests/test_faults.py::test_row_gpu_tuner_goes_on_past_faulty_candidates"]),
    ("8 processes tune one problem with one cache", "one winner, no corruption, others wait for it",
     ["tests/test_faults.py::test_row_8_processes", "tests/test_faults.py::test_row_claim_",
      "tests/test_cache.py::test_processes_write_concurrently"]),
    ("DDP / torchrun ranks on one node", "one rank tunes, all use its plan",
     ["tests/test_faults.py::test_row_ddp_ranks"]),
    ("kill -9 in the middle of tuning, then restart", "cache opens, trials kept, tuning restarts",
     ["tests/test_faults.py::test_row_kill_9", "tests/test_cache.py::test_kill_9_mid_write"]),
    ("cache file truncated or garbage", "moved aside with a warning, fresh cache",
     ["tests/test_cache.py::test_damaged_file", "tests/test_cache.py::test_damaged_cubin",
      "tests/test_cache.py::test_damaged_plan", "tests/test_cache.py::test_schema_version",
      "tests/test_cache.py::test_someone_elses"]),
    ("cache file copied over another, its old -wal left beside it", "the copy is what is read; -wal empty at rest",
     ["tests/test_cache.py::test_a_cache_copied_over", "tests/test_cache.py::test_the_wal_is_empty_at_rest",
      "tests/test_cache.py::test_a_checkpoint_blocked", "tests/test_cache.py::test_a_failed_checkpoint"]),
    ("cache from another GPU / torch / bagf / kernel source", "not used, re-tuned; import says why",
     ["tests/test_faults.py::test_row_stale_env", "tests/test_cache.py::test_export_import"]),
    ("read-only or full cache directory", "tuning works in memory, one warning",
     ["tests/test_cache.py::test_read_only", "tests/test_cache.py::test_directory_that_cannot",
      "tests/test_cache.py::test_failed_write", "tests/test_cache.py::test_read_failure"]),
    ("unsupported inputs", "correct result via ATen, one log line per reason",
     ["tests/test_faults.py::test_row_unsupported", "tests/test_gpu.py::test_fallbacks_are_correct_on_gpu",
      "tests/test_faults.py::test_row_gpu_huge_batch"]),
    ("dynamic shapes", "each problem tuned once in budget; BAGF_TUNE=0 never stalls",
     ["tests/test_faults.py::test_row_dynamic_shapes", "tests/test_faults.py::test_row_tune_disabled",
      "tests/test_runtime.py::test_tune_disabled"]),
    ("serve-while-tuning (BAGF_BACKGROUND=1)", "ATen at once, then the winner; thread-safe",
     ["tests/test_faults.py::test_row_serve_while_tuning", "tests/test_faults.py::test_row_background_failure"]),
    # Import tampering (docs/cache.md): an export file is another party's input. Each test asserts that no
    # byte of the file's cubins is stored under a digest our compiler uses (0 foreign code run), that the
    # valid entries beside the bad ones are imported (0 entries lost), and that nothing raises (0 crashes).
    ("import: foreign cubin under a real kernel's digest", "file's bytes never stored there; rebuilt from our sources",
     ["tests/test_cache_trust.py::test_a_foreign_cubin_under_a_real_digest",
      "tests/test_cache_trust.py::test_trusted_cubins_live_in_their_own_namespace",
      "tests/test_cache_trust.py::test_trust_mode_rebuilds", "tests/test_cache_trust.py::test_a_plan_whose_kernel",
      "tests/test_cache_trust.py::test_gpu_import_rebuilds_with_nvrtc"]),
    ("import: a plan that computes wrongly here",
     "skipped by the float64 check every tuned plan passes; the rest imported",
     ["tests/test_cache_trust.py::test_a_plan_that_fails_its_check_here",
      "tests/test_faults.py::test_row_gpu_import_of_a_plan_that_computes_wrongly_here"]),
    ("import: config outside the family's space", "entry skipped with the field named; ints only in NVRTC names",
     ["tests/test_cache_trust.py::test_configurations_outside_the_space",
      "tests/test_cache_trust.py::test_the_name_expression_takes_integers_only",
      "tests/test_cache_trust.py::test_cache_check_runs_without_a_gpu"]),
    ("import: wrong key or malformed entries", "key recomputed, mismatch refused; the rest imported",
     ["tests/test_cache_trust.py::test_a_key_that_is_not_its_problems", "tests/test_cache.py::test_import_",
      "tests/test_cache_fuzz.py::test_import_of_any_file"]),
    ("bad DB rows (wrong types, stride 0, foreign tables)", "row skipped with one log line; tuning, list, report go on",
     ["tests/test_cache_trust.py::test_rows_of_the_wrong_shape", "tests/test_cache_trust.py::test_warm_start_survives",
      "tests/test_cache_trust.py::test_a_file_of_our_version", "tests/test_cache_fuzz.py::test_rows_of_any_shape",
      "tests/test_cache_trust.py::test_read_only_copy", "tests/test_cache_trust.py::test_clear_and_import_say",
      "tests/test_cache_trust.py::test_import_into_a_cache_that_falls_back",
      "tests/test_cache_trust.py::test_disk_full_while_creating"]),
    ("parent killed while the isolated worker is busy (orphan worker)",
     "worker gone within seconds (PR_SET_PDEATHSIG + watchdog), also when started from a short-lived thread",
     ["tests/test_isolated_orphan.py::"]),
    ("another process's claim held by a stuck tuner", "bounded wait (BAGF_CLAIM_WAIT), ATen meanwhile, one line",
     ["tests/test_user_path.py::test_a_claim_held_by_a_stuck_tuner",
      "tests/test_user_path.py::test_claim_liveness_by_pid_only_inside_one_pid_namespace"]),
    ("a strategy step stalls (Ax's generation)", "abandoned at its deadline; the tuning ends in budget",
     ["tests/test_user_path.py::test_a_stalled_strategy_step", "tests/test_user_path.py::test_the_time_budget_holds"]),
    ("bad BAGF_* values", "one line naming the variable; a forward runs ATen, the CLI exits 2",
     ["tests/test_user_path.py::test_a_bad_", "tests/test_user_path.py::test_the_cli_reports_a_bad_setting",
      "tests/test_user_path.py::test_absurd_settings"]),
]
COUNTS = ("faults", "crashed", "wrong_cached", "lost")


class Collector:
    """pytest plugin: outcome, skip reason and recorded counts per test node id."""

    def __init__(self):
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "reason": "", "props": {}})
        entry["props"].update(dict(report.user_properties))
        if report.failed:
            entry["outcome"] = "failed"
        elif report.skipped and entry["outcome"] != "failed":
            entry["outcome"] = "skipped"
            entry["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)


def run_tests(extra: list[str]) -> dict[str, dict]:
    import pytest

    files = sorted({prefix.split("::")[0] for _, _, prefixes in ROWS for prefix in prefixes})
    collector = Collector()
    os.chdir(ROOT)
    code = pytest.main(["-q", "-p", "no:cacheprovider", *files, *extra], plugins=[collector])
    if code not in (0, 1):  # 1: some tests failed (reported in the matrix); anything else: pytest itself failed
        raise SystemExit(f"pytest could not run the matrix (exit code {code})")
    return collector.results


def matrix(results: dict[str, dict]) -> list[dict]:
    rows = []
    for fault, behaviour, prefixes in ROWS:
        tests = {nid: r for nid, r in results.items() if any(nid.startswith(p) for p in prefixes)}
        ran = {nid: r for nid, r in tests.items() if r["outcome"] != "skipped"}
        failed = [nid for nid, r in ran.items() if r["outcome"] == "failed"]
        skipped = sorted({r["reason"] for r in tests.values() if r["outcome"] == "skipped"})
        if not tests:
            status = "NO TESTS"
        elif failed:
            status = "FAIL"
        elif not ran:
            status = "not run (" + "; ".join(s.replace("Skipped: ", "") for s in skipped)[:60] + ")"
        else:
            status = "pass"
            if len(ran) < len(tests):
                why = "no GPU" if any("GPU" in s for s in skipped) else "; ".join(skipped)[:40]
                status += f" ({len(tests) - len(ran)} not run: {why})"
        row = {"fault": fault, "behaviour": behaviour, "status": status, "tests": len(tests), "ran": len(ran),
               "failed": failed}
        for c in COUNTS:
            row[c] = sum(int(r["props"].get(c, 0)) for r in ran.values())
        row["props_by_test"] = {nid: {c: int(r["props"].get(c, 0)) for c in COUNTS} for nid, r in ran.items()}
        row["nodeids"] = sorted(ran)
        rows.append(row)
    return rows


def noise_row(budget: int, seed: int) -> dict:
    """GPU: tune AlexNet conv3 (N=1) twice from empty caches; time both winners interleaved.

    conv3 at N=1 is a problem our kernels win (implicit_gemm_tc beats cuDNN ~1.8x there), so the two runs'
    winners are kernels picked from noisy timings, not both "aten" (the first run of this row used conv2 at
    N=32, where both runs kept cuDNN and the row said nothing about our own choice)."""
    import torch

    from bagf_torch import runtime
    from bagf_torch.kernels import FAMILIES
    from bagf_torch.problem import ConvProblem
    from bagf_torch.ops import ATEN
    from bagf_torch.tuning.measure import CudaBenchmarker, Workspace

    problem = ConvProblem(n=1, c=192, h=13, w=13, k=384, r=3, s=3, padding=(1, 1))
    os.environ["BAGF_BUDGET"] = str(budget)
    winners = []
    for run in (1, 2):
        os.environ["BAGF_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"bagf_noise{run}_")
        os.environ["BAGF_SEED"] = str(seed + run)  # two independent searches, as two machines would run
        runtime.reset()
        rt = runtime.get()
        rt.plan_handle(problem, 0)
        result = rt.results[-1]
        winners.append((result.family, result.config))
    rt = runtime.get()
    dev = rt.device(0)
    handles = [ATEN if fam == "aten" else dev.compiler.compile(FAMILIES[fam], [cfg])[0].handle
               for fam, cfg in winners]
    ws = Workspace(problem, torch.device("cuda", 0))
    times = CudaBenchmarker().remeasure(ws, handles, rounds=9)
    diff = abs(times[0] - times[1]) / min(times)
    names = [fam if cfg is None else FAMILIES[fam].name(cfg) for fam, cfg in winners]
    return {"fault": "noise: two tunings of one problem", "behaviour": "winners within 3% in time",
            "status": "pass" if diff <= 0.03 else "FAIL", "detail": f"{names[0]} {times[0]:.1f} us vs "
            f"{names[1]} {times[1]:.1f} us: {100 * diff:.2f}% apart", "tests": 1, "ran": 1, "failed": [],
            **{c: 0 for c in COUNTS}}


def render(rows: list[dict]) -> str:
    lines = ["| fault | required behaviour | status | tests | faults | crashed | wrong cached | lost |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] + (f": {r['detail']}" if r.get("detail") else "")
        lines.append(f"| {r['fault']} | {r['behaviour']} | {status} | {r['ran']}/{r['tests']} | {r['faults']} | "
                     f"{r['crashed']} | {r['wrong_cached']} | {r['lost']} |")
    # Totals over distinct tests: a test that serves two rows (the isolated worker: crash and hang) counts once.
    seen: dict[str, dict] = {}
    for r in rows:
        for nid in r.get("nodeids", []):
            seen[nid] = r["props_by_test"][nid]
    total = {c: sum(p.get(c, 0) for p in seen.values()) + sum(r[c] for r in rows if "nodeids" not in r)
             for c in COUNTS}
    passed = sum(r["status"].startswith("pass") for r in rows)
    failed = sum(r["status"] in ("FAIL", "NO TESTS") for r in rows)
    lines.append("")
    lines.append(f"rows: {passed} pass, {failed} fail, {len(rows) - passed - failed} not run; faults injected "
                 f"{total['faults']}, processes crashed {total['crashed']}, wrong results cached "
                 f"{total['wrong_cached']}, entries lost {total['lost']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--noise", action="store_true", help="GPU: also run the noise row (tunes twice)")
    parser.add_argument("--noise-budget", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -x, -k expr)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    rows = matrix(run_tests(args.pytest_args))
    if args.noise:
        import torch

        if torch.cuda.is_available():
            rows.append(noise_row(args.noise_budget, args.seed))
        else:
            rows.append({"fault": "noise: two tunings of one problem", "behaviour": "winners within 3% in time",
                         "status": "not run (no GPU)", "tests": 1, "ran": 0, "failed": [],
                         **{c: 0 for c in COUNTS}})
    table = render(rows)
    print()
    print(table)
    print(f"\n({time.monotonic() - t0:.0f} s)")
    if args.json:
        import platform

        import torch

        from bench_overhead import command_line, git_commit  # (a sibling script: its run metadata helpers)

        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "python": platform.python_version(), "commit": git_commit(),
                "command": command_line("faults.py", sys.argv[1:] if argv is None else argv)}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0 if all(not r["status"].startswith(("FAIL", "NO")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Property-based tests of the cache's boundary (hypothesis): import files and database rows of any JSON shape.

Whatever an export file or a row holds, no exception escapes ``import_`` (other than ValueError for a file
that is not an export at all), ``plans()``, the warm start or the report, and every valid entry mixed in
with the bad ones still gets through. Bounded to a few seconds (``max_examples``)."""

from __future__ import annotations

import json
import sqlite3

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bagf_torch import report  # noqa: E402
from bagf_torch.cache import SCHEMA_VERSION, Cache, default_cache_path  # noqa: E402
from bagf_torch.kernels import implicit_gemm as ig  # noqa: E402
from bagf_torch.problem import ConvProblem, fingerprint  # noqa: E402
from bagf_torch.tuning.warmstart import neighbour_seeds  # noqa: E402

ENV = {"gpu": "NVIDIA H200", "cc": "9.0", "nvrtc": "13.0", "kernels": "abc"}
FIELDS = ("key", "problem", "env", "family", "config", "time_us", "aten_us", "default_us", "evaluations",
          "tune_seconds", "cubin_digests", "created")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def valid_entry(n: int) -> dict:
    problem = ConvProblem(n=n, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
    return {"key": fingerprint(problem, ENV), "problem": problem.as_dict(), "env": dict(ENV), "family": "implicit_gemm",
            "config": dict(ig.DEFAULT), "time_us": 30.0, "aten_us": 45.0, "default_us": None, "evaluations": 20,
            "tune_seconds": 8.0, "cubin_digests": [], "created": 1.7e9}


def mutated(entry: dict, data) -> object:
    """``entry`` with some fields replaced by arbitrary JSON, some dropped, or something else altogether."""
    how = data.draw(st.sampled_from(["fields", "drop", "nested", "whole"]))
    if how == "whole":
        return data.draw(json_values)
    out = dict(entry)
    for name in data.draw(st.lists(st.sampled_from(FIELDS + ("problem.stride", "config.BM", "env.gpu")),
                                   min_size=1, max_size=3, unique=True)):
        top, _, sub = name.partition(".")
        if how == "drop" and not sub:
            out.pop(top, None)
        elif sub and isinstance(out.get(top), dict):
            out[top] = dict(out[top], **{sub: data.draw(json_values)})
        else:
            out[top] = data.draw(json_values)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_import_of_any_file_raises_nothing_and_keeps_every_valid_entry(tmp_path, data):
    good = [valid_entry(n) for n in range(1, data.draw(st.integers(0, 3)) + 1)]
    bad = [mutated(valid_entry(100 + i), data) for i in range(data.draw(st.integers(0, 5)))]
    plans = good + bad
    order = data.draw(st.permutations(range(len(plans))))
    document = {"format": "bagf_torch.cache", "schema": SCHEMA_VERSION, "plans": [plans[i] for i in order],
                "cubins": data.draw(st.lists(json_values, max_size=2))}
    damaged = data.draw(st.booleans())
    if damaged:  # sometimes the top level itself is damaged (then the good entries may be gone with it)
        document[data.draw(st.sampled_from(["plans", "cubins", "schema", "format"]))] = data.draw(json_values)
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps(document))
    with Cache(None) as cache:
        try:
            imported, skipped = cache.import_(path, ENV)
        except ValueError as e:  # the file as a whole is not an export: one line, nothing imported
            assert str(e).startswith("cannot import") and cache.plans() == []
            return
        stored = {p["key"] for p in cache.plans()}
        # a mutation may leave an entry valid (an equal value drawn): then it is the valid entry of that key
        if not damaged:
            assert {e["key"] for e in good} <= stored, skipped
        assert imported == len(stored) and all(isinstance(line, str) for line in skipped)


column_values = st.none() | st.integers(min_value=-2**63, max_value=2**63 - 1) \
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.binary(max_size=8) \
    | json_values.map(json.dumps)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rows_of_any_shape_never_break_reading_warm_starts_or_reports(tmp_path_factory, data):
    path = default_cache_path(tmp_path_factory.mktemp("fuzzdb"))
    with Cache(path) as cache:
        good = valid_entry(2)
        cache.put_plan(good["key"], **{k: v for k, v in good.items() if k not in ("key", "created")})
    rows = data.draw(st.lists(st.lists(column_values, min_size=len(FIELDS), max_size=len(FIELDS)), max_size=4))
    with sqlite3.connect(path) as raw:
        for n, row in enumerate(rows):
            row[0] = f"bad{n}"
            try:
                raw.execute(f"INSERT INTO plans VALUES ({', '.join('?' * len(FIELDS))})", row)
            except sqlite3.IntegrityError:  # NOT NULL: SQLite itself refuses that row
                pass
    problem = ConvProblem(n=1, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
    with Cache(path) as cache:
        plans = cache.plans()
        assert good["key"] in {p["key"] for p in plans}
        for n in range(len(rows)):
            cache.get_plan(f"bad{n}")
        assert neighbour_seeds(problem, plans, ENV) == [("implicit_gemm", ig.DEFAULT)]
        report.plans_table(plans)
        report.points_from_plans(plans)
        cache.export(path.with_name("e.json"))

"""The one schema of a cache row: every plan read from the SQLite file, taken from an export file, or about
to be written is checked here, field by field, before anything else looks at it.

Why one typed boundary: a cache is shared by every process of a machine and, through ``cache export`` and
``cache import``, by other machines. A row with valid JSON but the wrong shape (a text ``time_us``, a float
``evaluations``, a ``stride`` of 0, an ``env`` that is a list, a configuration with a knob outside the
family's space) would otherwise travel into the warm start, the report, ``cache list`` and the NVRTC name
expression, where one such row can stop every later tuning on the machine. Here it fails with a
``SchemaError`` naming the field; callers skip the row with one log line and go on.

Only the standard library (dataclasses and explicit checks): pydantic is not a dependency of bagf_torch.

>>> rec = PlanRecord.from_mapping({"key": "k", "problem": {"n": 1, "c": 3, "h": 8, "w": 8, "k": 4, "r": 3,
...     "s": 3, "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1]}, "env": {"gpu": "X"},
...     "family": "aten", "config": None, "time_us": 5.0, "aten_us": 5.0, "default_us": None,
...     "evaluations": 3, "tune_seconds": 0.5, "cubin_digests": [], "created": 1.0})
>>> rec.problem["stride"], rec.evaluations
([1, 1], 3)
>>> PlanRecord.from_mapping(dict(rec.as_dict(), evaluations="3"))
Traceback (most recent call last):
...
bagf_torch.cache_schema.SchemaError: evaluations: must be a whole number, got '3'
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["PLAN_FIELDS", "PlanRecord", "SchemaError", "check_config", "check_env", "check_problem",
           "check_trial_row", "check_cubin_row"]

PLAN_FIELDS = ("key", "problem", "env", "family", "config", "time_us", "aten_us", "default_us", "evaluations",
               "tune_seconds", "cubin_digests", "created")
"""The columns of the ``plans`` table, in order (also the fields of an export file's plan entry)."""

MAX_DIM = 2**31 - 1
"""Largest shape or count accepted: what a CUDA launch and the kernels' 32-bit index arithmetic can hold. It
also keeps FLOP counts within a float (a report divides them)."""
MAX_TEXT = 256
MAX_ENV_FIELDS = 64
MAX_DIGESTS = 16
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}\Z")
_PROBLEM_INTS = ("n", "c", "h", "w", "k", "r", "s")
_PROBLEM_PAIRS = {"stride": 1, "padding": 0, "dilation": 1}  # name -> smallest allowed value
_PROBLEM_OPTIONAL = {"groups", "bias", "dtype", "layout", "tf32"}


class SchemaError(ValueError):
    """A row or entry field that is not what the cache stores; ``field`` names it (``problem.stride``...)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _whole(field: str, value: Any, lo: int = 0, hi: int = MAX_DIM) -> int:
    """An integer in [lo, hi]. A float holding a whole number (3.0) is accepted: JSON and SQLite do not keep
    the difference, and refusing it would lose a valid row; bool, text and 3.5 are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(field, f"must be a whole number, got {_short(value)}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise SchemaError(field, f"must be a whole number, got {_short(value)}")
    if not lo <= value <= hi:
        raise SchemaError(field, f"must be in [{lo}, {hi}], got {_short(value)}")
    return int(value)


def _seconds(field: str, value: Any, *, optional: bool = False, infinite: bool = False) -> float | None:
    """A number >= 0 (finite unless ``infinite``); None allowed when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(field, f"must be a number{' or null' if optional else ''}, got {_short(value)}")
    value = float(value)
    if math.isnan(value) or value < 0 or (math.isinf(value) and not infinite):
        raise SchemaError(field, f"must be {'' if infinite else 'finite and '}>= 0, got {_short(value)}")
    return value


def _text(field: str, value: Any, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise SchemaError(field, f"must be a non-empty string of at most {limit} characters, got {_short(value)}")
    return encodable(field, value)


def encodable(field: str, value: str) -> str:
    """``value`` if it is text UTF-8 can hold; SchemaError for one with a lone surrogate (JSON's "\\ud800"), which
    SQLite, a terminal and a log file all refuse."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(field, f"is not valid text (a lone surrogate): {ascii(value)[:60]}") from None
    return value


def check_problem(value: Any) -> dict:
    """The problem as ``ConvProblem.as_dict()`` writes it, or SchemaError: positive shapes within
    ``MAX_DIM``, strides and dilations >= 1, padding >= 0, groups dividing the channels, a non-empty
    output. A stride of 0 would divide by zero in every later warm start and report. (Checked without
    importing ``problem``, which imports torch: the cache module and this one need only the stdlib.)"""
    if not isinstance(value, dict):
        raise SchemaError("problem", f"must be an object, got {type(value).__name__}")
    unknown = sorted(str(k) for k in set(value) - set(_PROBLEM_INTS) - set(_PROBLEM_PAIRS) - _PROBLEM_OPTIONAL)
    if unknown:
        raise SchemaError(f"problem.{unknown[0][:32]}", "is not a field of a conv problem")
    out: dict[str, Any] = {}
    for name in _PROBLEM_INTS:
        if name not in value:
            raise SchemaError(f"problem.{name}", "is missing")
        out[name] = _whole(f"problem.{name}", value[name], lo=1)
    for name, lo in _PROBLEM_PAIRS.items():
        if name not in value:
            raise SchemaError(f"problem.{name}", "is missing")
        pair = value[name]
        if isinstance(pair, (int, float)) and not isinstance(pair, bool):
            pair = [pair, pair]  # ConvProblem accepts one number for both dimensions
        elif isinstance(pair, list) and len(pair) == 1:
            pair = pair * 2
        if not isinstance(pair, list) or len(pair) != 2:
            raise SchemaError(f"problem.{name}", f"must be a pair of whole numbers, got {_short(value[name])}")
        out[name] = [_whole(f"problem.{name}", v, lo=lo) for v in pair]
    out["groups"] = _whole("problem.groups", value.get("groups", 1), lo=1)
    if out["c"] % out["groups"] or out["k"] % out["groups"]:
        raise SchemaError("problem.groups", f"{out['groups']} does not divide c={out['c']} and k={out['k']}")
    for name, default in (("bias", True), ("tf32", False)):
        flag = value.get(name, default)
        if not isinstance(flag, bool):
            raise SchemaError(f"problem.{name}", f"must be true or false, got {_short(flag)}")
        out[name] = flag
    for name, default in (("dtype", "float32"), ("layout", "nchw")):
        out[name] = _text(f"problem.{name}", value.get(name, default), limit=32)
    # The output size, as ConvProblem.out_hw computes it.
    for axis, (size, kernel) in enumerate(((out["h"], out["r"]), (out["w"], out["s"]))):
        span = size + 2 * out["padding"][axis] - out["dilation"][axis] * (kernel - 1) - 1
        if span < 0:
            raise SchemaError("problem", f"the {kernel}-wide filter does not fit the padded input of {size}: "
                                         f"the output is empty")
    return out


def check_env(value: Any) -> dict:
    """The environment: an object of at most ``MAX_ENV_FIELDS`` names to strings, numbers, booleans or null
    (GPU name, versions, kernel source hash). Nested values are refused: nothing in an env is one."""
    if not isinstance(value, dict):
        raise SchemaError("env", f"must be an object, got {type(value).__name__}")
    if len(value) > MAX_ENV_FIELDS:
        raise SchemaError("env", f"has {len(value)} fields, at most {MAX_ENV_FIELDS} expected")
    for name, item in value.items():
        _text("env name", name, limit=64)
        if isinstance(item, float) and not math.isfinite(item):
            raise SchemaError(f"env.{name}", f"must be finite, got {item!r}")
        if isinstance(item, int) and not isinstance(item, bool) and abs(item) >= 2**63:
            raise SchemaError(f"env.{name}", f"is out of range: {_short(item)}")
        if isinstance(item, str) and len(item) > MAX_TEXT:
            raise SchemaError(f"env.{name}", f"is longer than {MAX_TEXT} characters")
        if item is not None and not isinstance(item, (str, int, float, bool)):
            raise SchemaError(f"env.{name}", f"must be a string, number, boolean or null, got "
                                             f"{type(item).__name__}")
    return dict(value)


def check_config(family: str, config: Any, *, rules: bool = False) -> dict | None:
    """The configuration of a plan of ``family``: None for "aten" (torch's own conv), else an object of knob
    names to whole numbers. For a family this bagf_torch has, every knob (after ``complete_config`` adds
    those a family gained later, which the configuration returned has) must be one of the family's and each value
    one of its allowed values;
    ``rules`` also applies the family's validity rules (``family.space()``; imports do). The values end up
    in an NVRTC name expression, so nothing but ints of the space gets through. A family this bagf_torch
    does not know (another version's, sharing the file) is checked for types only: its plans are never
    launched here (the runtime uses torch's conv for them)."""
    from .kernels import FAMILIES, complete_config

    if family == "aten":
        if config is not None:
            raise SchemaError("config", "must be null for family 'aten' (torch's own conv)")
        return None
    if config is None:
        raise SchemaError("config", f"is null, but only family 'aten' may have no configuration, not {family!r}")
    if not isinstance(config, dict) or len(config) > 32:
        raise SchemaError("config", f"must be an object of at most 32 knobs, got {type(config).__name__}")
    for name, value in config.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise SchemaError("config", f"knob name {_short(name)} is not an identifier")
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_DIM:
            raise SchemaError(f"config.{name}", f"must be an integer, got {_short(value)}")
    module = FAMILIES.get(family)
    if module is None:
        return dict(config)
    full = complete_config(family, config)
    params = module.PARAMS
    missing = sorted(set(params) - set(full))
    extra = sorted(set(full) - set(params))
    if missing or extra:
        raise SchemaError("config", f"knobs {sorted(full)} do not match {family}'s {sorted(params)}")
    for name, value in full.items():
        if value not in params[name]:
            raise SchemaError(f"config.{name}", f"{value} is not one of {family}'s {list(params[name])}")
    if rules:
        reason = module.space().invalid_reason(full)
        if reason is not None:
            raise SchemaError("config", f"outside {family}'s space: {reason}")
    return dict(full)  # with the knobs it lacked at the values it stands for: what compiles and launches


def _digests(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIGESTS:
        raise SchemaError("cubin_digests", f"must be a list of at most {MAX_DIGESTS} digests, got {_short(value)}")
    return tuple(_text("cubin_digests", d, limit=128) for d in value)


@dataclass(frozen=True)
class PlanRecord:
    """One plan, every field checked: what ``Cache.plans()``/``get_plan`` return (as ``as_dict()``), what
    ``put_plan`` writes (``row()``), and what an export file's plan entry must be."""

    key: str
    problem: dict
    env: dict
    family: str
    config: dict | None
    time_us: float
    aten_us: float | None
    default_us: float | None
    evaluations: int
    tune_seconds: float
    cubin_digests: tuple[str, ...]
    created: float

    @classmethod
    def from_mapping(cls, entry: Any, *, rules: bool = False) -> "PlanRecord":
        """Check a plan given as a dict of Python values (an export entry, ``put_plan``'s arguments)."""
        if not isinstance(entry, dict):
            raise SchemaError("plan", f"must be an object, got {type(entry).__name__}")
        missing = [f for f in PLAN_FIELDS if f not in entry]
        if missing:
            raise SchemaError(missing[0], "is missing")
        family = entry["family"]
        if not isinstance(family, str) or not _NAME.match(family):
            raise SchemaError("family", f"must be a family name (an identifier), got {_short(family)}")
        created = entry["created"]
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
            raise SchemaError("created", f"must be a finite timestamp, got {_short(created)}")
        return cls(key=_text("key", entry["key"]), problem=check_problem(entry["problem"]),
                   env=check_env(entry["env"]), family=family,
                   config=check_config(family, entry["config"], rules=rules),
                   time_us=_seconds("time_us", entry["time_us"]),
                   aten_us=_seconds("aten_us", entry["aten_us"], optional=True),
                   default_us=_seconds("default_us", entry["default_us"], optional=True),
                   evaluations=_whole("evaluations", entry["evaluations"]),
                   tune_seconds=_seconds("tune_seconds", entry["tune_seconds"]),
                   cubin_digests=_digests(entry["cubin_digests"]), created=float(created))

    @classmethod
    def from_row(cls, row: Sequence) -> "PlanRecord":
        """Check a row of the ``plans`` table (columns in ``PLAN_FIELDS`` order, JSON columns as text)."""
        if len(row) != len(PLAN_FIELDS):
            raise SchemaError("plan", f"row has {len(row)} columns, expected {len(PLAN_FIELDS)}")
        entry = dict(zip(PLAN_FIELDS, row))
        for name in ("problem", "env", "config", "cubin_digests"):
            text = entry[name]
            if text is None and name == "config":
                continue
            if not isinstance(text, str):
                raise SchemaError(name, f"must be JSON text, got {type(text).__name__}")
            try:
                entry[name] = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise SchemaError(name, f"is not valid JSON ({type(e).__name__}: {str(e)[:60]})") from None
        return cls.from_mapping(entry)

    def as_dict(self) -> dict:
        """The plan as the cache's callers see it: JSON types (lists, not tuples), fresh objects."""
        return {"key": self.key, "problem": dict(self.problem), "env": dict(self.env), "family": self.family,
                "config": None if self.config is None else dict(self.config), "time_us": self.time_us,
                "aten_us": self.aten_us, "default_us": self.default_us, "evaluations": self.evaluations,
                "tune_seconds": self.tune_seconds, "cubin_digests": list(self.cubin_digests),
                "created": self.created}

    def row(self) -> tuple:
        """The ``plans`` row: canonical JSON (sorted keys, no spaces) for the JSON columns."""
        def dumps(value):
            return json.dumps(value, sort_keys=True, separators=(",", ":"))

        return (self.key, dumps(self.problem), dumps(self.env), self.family,
                None if self.config is None else dumps(self.config), self.time_us, self.aten_us, self.default_us,
                self.evaluations, self.tune_seconds, dumps(list(self.cubin_digests)), self.created)


def check_trial_row(row: Sequence) -> dict:
    """A ``trials`` row (family, config, status, time_us, detail, created) as a dict, or SchemaError. Trials
    are history (what was measured, including failures), so their configuration is checked for type only:
    a trial may name a configuration the space refused."""
    if len(row) != 6:
        raise SchemaError("trial", f"row has {len(row)} columns, expected 6")
    family, config, status, time_us, detail, created = row
    _text("trial family", family, limit=64)
    _text("trial status", status, limit=64)
    if config is not None:
        if not isinstance(config, str):
            raise SchemaError("trial config", f"must be JSON text, got {type(config).__name__}")
        try:
            config = json.loads(config)
        except (ValueError, RecursionError) as e:
            raise SchemaError("trial config", f"is not valid JSON ({type(e).__name__})") from None
        if config is not None and not isinstance(config, dict):
            raise SchemaError("trial config", f"must be an object or null, got {type(config).__name__}")
    time_us = _seconds("trial time_us", time_us, optional=True, infinite=True)
    if not isinstance(detail, str):
        raise SchemaError("trial detail", f"must be text, got {type(detail).__name__}")
    created = _seconds("trial created", created)
    return {"family": family, "config": config, "status": status, "time_us": time_us, "detail": detail,
            "created": created}


_LOWERED = re.compile(r"[A-Za-z0-9_$.;]{1,4096}\Z")


def check_cubin_row(cubin: Any, lowered_name: Any, sha256: Any) -> tuple[bytes, str, str]:
    """A ``cubins`` row's payload: bytes, a lowered (mangled) kernel name of identifier characters (it is
    handed to ``cuModuleGetFunction``), and the sha256 hex text. SchemaError otherwise."""
    if not isinstance(cubin, (bytes, bytearray, memoryview)):
        raise SchemaError("cubin", f"must be bytes, got {type(cubin).__name__}")
    if not isinstance(lowered_name, str) or not _LOWERED.match(lowered_name):
        raise SchemaError("lowered_name", f"must be a mangled kernel name, got {_short(lowered_name)}")
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise SchemaError("sha256", f"must be 64 hex digits, got {_short(sha256)}")
    return bytes(cubin), lowered_name, sha256


def entry_label(entry: Any, n: int) -> str:
    """How a skipped entry is named in reports: the first 16 characters of its key and its family, or its
    position in the file when even those are unusable."""
    if isinstance(entry, Mapping):
        key, family = entry.get("key"), entry.get("family")
        if isinstance(key, str) and key:
            label = f"{key[:16]} ({family if isinstance(family, str) else '?'})"[:80]
            return label.encode("utf-8", "backslashreplace").decode("utf-8")  # (printable whatever the file holds)
    return f"entry {n}"

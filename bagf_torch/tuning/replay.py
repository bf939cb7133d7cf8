"""Evaluators that answer from recorded outcomes instead of a GPU, for tests and strategy benchmarks.

``ReplayEvaluator`` replays a recording (every configuration's median time and spread, or its typed
failure): deterministic by default, or with seeded Gaussian noise of the recorded spread, so a strategy can
be run many times over the same space on a CPU (Kernel Tuner's simulation mode does the same with its cache
files).

``synthetic_times`` makes such a recording without a GPU. It is SYNTHETIC: a roofline-style model of the
implicit_gemm kernel on an H200-like device plus seeded noise. Its numbers are plausible in shape (waves,
tile waste, occupancy cliffs, a rugged surface, a few resource failures) but they are not measurements and
must never be reported as kernel performance; they exist so that strategies can be tested and compared
before GPU recordings exist.

``replay_backend`` runs the whole Tuner on a recording (a ``TrialBackend`` whose compiler, checker and
benchmarker answer from it).

``load_recording`` / ``write_recording`` read and write the recorded-space file format
``bagf-recorded-space/1`` (gzip-compressed JSON, written by benchmarks/record_space.py on a GPU and
documented in benchmarks/data/README.md); ``RecordedProblem.evaluator`` replays one problem of one family.

>>> from bagf_torch.kernels import implicit_gemm
>>> space = implicit_gemm.space()
>>> records = synthetic_times(space, ALEXNET_CONV2, seed=0)
>>> ev = ReplayEvaluator(records)
>>> [o.status for o in ev([implicit_gemm.DEFAULT])]
['ok']
>>> ev.calls
1
"""

from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..kernels import implicit_gemm
from ..kernels.space import Config, Space, config_key
from ..ops import ATEN
from .common import Outcome

Record = dict
"""One recorded configuration: {"config": {...}, "status": str, "time_us": float | None, "spread_us": float}."""

ALEXNET_CONV2: dict[str, int] = {"N": 128, "C": 64, "H": 27, "W": 27, "K": 192, "R": 5, "S": 5, "stride": 1, "pad": 2}
"""AlexNet's second convolution at batch 128, a convenient default problem for synthetic landscapes."""


class ReplayEvaluator:
    """An ``Evaluate`` that answers from a recording; counts the configurations it was asked about.

    ``recording`` is either a mapping ``config_key(config) -> Outcome`` (spread taken as
    ``default_spread`` times the time) or a list of record dicts
    ``{"config": {...}, "status": ..., "time_us": ..., "spread_us": ...}`` (``time_us`` the median).
    With ``deterministic=True`` an "ok" configuration always returns its median; otherwise the median
    plus Gaussian noise with the recorded spread as standard deviation (seeded, clipped to stay positive).
    With ``cutoff_factor`` the replay cuts like the real tuner does: a time above ``cutoff_factor`` x the
    best time this evaluator has answered so far comes back as a "timeout" failure.
    A configuration missing from the recording is a ``KeyError`` naming it: a replay cannot invent times.

    >>> ev = ReplayEvaluator([{"config": {"a": 1}, "status": "ok", "time_us": 10.0, "spread_us": 1.0}])
    >>> ev([{"a": 1}])[0].time_us
    10.0
    >>> noisy = ReplayEvaluator(ev.records, deterministic=False, seed=1)
    >>> noisy([{"a": 1}])[0].time_us != 10.0
    True
    """

    def __init__(self, recording: Mapping[tuple, Outcome] | Iterable[Record], *, deterministic: bool = True,
                 seed: int = 0, default_spread: float = 0.01, cutoff_factor: float | None = None):
        self._outcomes: dict[tuple, Outcome] = {}
        self._spread: dict[tuple, float] = {}
        if isinstance(recording, Mapping):
            for key, outcome in recording.items():
                key = config_key(key) if isinstance(key, Mapping) else tuple(key)
                self._outcomes[key] = outcome
                self._spread[key] = default_spread * outcome.time_us if outcome.ok else 0.0
        else:
            for r in recording:
                key = config_key(r["config"])
                status = r["status"]
                time_us = r.get("time_us") if status == "ok" else None
                self._outcomes[key] = Outcome(status, time_us, r.get("detail", ""))
                spread = r.get("spread_us")
                self._spread[key] = float(spread) if spread is not None else (
                    default_spread * time_us if time_us is not None else 0.0)
        self.deterministic = deterministic
        self.cutoff_factor = cutoff_factor
        self._best = math.inf
        self._rng = np.random.default_rng(seed)
        self.calls = 0
        """How many configurations were evaluated (batch members count one each)."""
        self.batches = 0

    def __len__(self) -> int:
        return len(self._outcomes)

    @property
    def records(self) -> list[Record]:
        """The recording as record dicts (JSON-ready)."""
        return [{"config": dict(k), "status": o.status, "time_us": o.time_us, "spread_us": self._spread[k],
                 "detail": o.detail} for k, o in self._outcomes.items()]

    def median(self, config: Mapping[str, int]) -> Outcome:
        """The recorded outcome (median time) of ``config``, without noise and without counting a call."""
        key = config_key(config)
        if key not in self._outcomes:
            raise KeyError(f"configuration {dict(config)} is not in the recording ({len(self)} configurations); "
                           "record it on the GPU or replay a space that matches the recording")
        return self._outcomes[key]

    def recorded(self, config: Mapping[str, int]) -> Outcome | None:
        """The recorded outcome of ``config``, or None when the recording does not have it (its time is then asked
        of the recording only if it is timed, which raises: a replay cannot invent times)."""
        return self._outcomes.get(config_key(config))

    def best(self) -> tuple[Config, Outcome]:
        """The fastest recorded configuration and its outcome (the true optimum of the recording)."""
        key, outcome = min(((k, o) for k, o in self._outcomes.items() if o.ok), key=lambda t: t[1].time_us)
        return dict(key), outcome

    def __call__(self, configs: Sequence[Config]) -> list[Outcome]:
        self.batches += 1
        out = []
        for c in configs:
            outcome = self.median(c)
            self.calls += 1
            if outcome.ok and not self.deterministic:
                spread = self._spread[config_key(c)]
                t = outcome.time_us + spread * self._rng.standard_normal()
                outcome = Outcome("ok", max(t, 0.05 * outcome.time_us), outcome.detail)
            if outcome.ok and self.cutoff_factor is not None:
                # The tuner's early cut (Tuner.tune: cutoff = cutoff_factor x the best time so far): a
                # candidate that slow is answered "timeout" and never becomes the best.
                if outcome.time_us > self.cutoff_factor * self._best:
                    outcome = Outcome("timeout", detail=f"replayed {outcome.time_us:.1f} us > cut-off "
                                                        f"{self.cutoff_factor * self._best:.1f} us")
                else:
                    self._best = min(self._best, outcome.time_us)
            out.append(outcome)
        return out


# ---- the Tuner on a recording ---------------------------------------------------------------------------

_COMPILE_FAILURES = ("invalid", "compile", "resources")  # what KernelCompiler.compile returns instead of a kernel
_CHECK_FAILURES = ("launch", "wrong", "crashed")  # what the checker reports (crashed: an isolated worker died)


class ReplayCompiler:
    """A compiler whose kernels are recorded configurations: each loads as a new handle, or comes back as its
    recorded compile-time failure (one the recording lacks loads too: a subclass or a patched benchmarker may
    time it). ``configs`` maps handle -> configuration; ``compile_s`` per configuration is
    charged to ``clock`` (a fake clock with ``advance``), so a budget in seconds can be replayed."""

    def __init__(self, evaluator: ReplayEvaluator, *, clock=None, compile_s: float = 0.0, workers: int = 4):
        self.evaluator, self.clock, self.compile_s, self.workers = evaluator, clock, compile_s, workers
        self.configs: dict[int, Config] = {}
        self.unloaded: set[int] = set()

    def compile(self, family, configs: Sequence[Config]) -> list:
        out = []
        for c in configs:
            if self.clock is not None and self.compile_s:
                self.clock.advance(self.compile_s)
            recorded = self.evaluator.recorded(c)
            if recorded is not None and recorded.status in _COMPILE_FAILURES:
                out.append(recorded)
                continue
            h = len(self.configs)
            self.configs[h] = dict(c)
            # compile_seconds None: "compiled now, cost not known" (the Tuner counts it a compile; 0 would be a
            # cubin-cache hit and teach its deadline that compiles are free)
            out.append(SimpleNamespace(handle=h, compile_seconds=self.compile_s or None))
        return out

    def unload(self, handle: int) -> None:
        self.unloaded.add(handle)


class ReplayChecker:
    """Reports a configuration's recorded check failure ("wrong", "launch"), else passes it."""

    def __init__(self, compiler: ReplayCompiler):
        self.compiler = compiler

    def check(self, ws, handle: int) -> Outcome | None:
        recorded = self.compiler.evaluator.recorded(self.compiler.configs[handle])
        return recorded if recorded is not None and recorded.status in _CHECK_FAILURES else None


class ReplayBenchmarker:
    """Times from the recording (the evaluator's: median, or with its seeded noise), cuDNN at ``aten_us``;
    ``measure_s`` per timing (x rounds x handles per re-timing) charged to ``clock``."""

    def __init__(self, compiler: ReplayCompiler, aten_us: float, *, clock=None, measure_s: float = 0.0):
        self.compiler, self.aten_us, self.clock, self.measure_s = compiler, aten_us, clock, measure_s

    def _t(self, handle: int) -> Outcome:
        if handle == ATEN:
            return Outcome("ok", time_us=self.aten_us)
        return self.compiler.evaluator([self.compiler.configs[handle]])[0]

    def measure(self, ws, handle: int, cutoff_us: float | None = None) -> Outcome:
        if self.clock is not None and self.measure_s:
            self.clock.advance(self.measure_s)
        return self._t(handle)

    def remeasure(self, ws, handles: Sequence[int], rounds: int = 5) -> list[float]:
        if self.clock is not None and self.measure_s:
            self.clock.advance(self.measure_s * rounds * len(handles))
        # a failure (a cut-off of an evaluator with cutoff_factor) re-times as infinitely slow, never as a time
        return [o.time_us if o.ok else math.inf for o in (self._t(h) for h in handles)]


def replay_backend(evaluator: ReplayEvaluator, aten_us: float, *, clock=None, compile_s: float = 0.0,
                   measure_s: float = 0.0, compiler: ReplayCompiler | None = None):
    """A ``TrialBackend`` that answers from ``evaluator``'s recording, with cuDNN at ``aten_us``: the whole Tuner
    (families, budget, finalists, listeners) on a CPU. ``clock``, ``compile_s`` and ``measure_s`` replay the cost
    of compiles and timings on a fake clock; ``compiler``, a ReplayCompiler (or subclass: compile waves, a cubin
    cache) of the same evaluator, replaces the default one. The backend's ``compiler.configs`` maps handles to
    configurations.

    >>> from bagf_torch.kernels import implicit_gemm
    >>> from bagf_torch.problem import ConvProblem
    >>> from bagf_torch.tuning.common import Budget
    >>> from bagf_torch.tuning.tuner import Tuner
    >>> ev = ReplayEvaluator(synthetic_times(implicit_gemm.space(), ALEXNET_CONV2, seed=0))
    >>> best, _ = ev.best()
    >>> problem = ConvProblem(n=128, c=64, h=27, w=27, k=192, r=5, s=5, padding=(2, 2))
    >>> tuner = Tuner(replay_backend(ev, aten_us=1e6), implicit_gemm, strategy="exhaustive", budget=Budget(10**6))
    >>> tuner.tune(problem).config == best
    True
    """
    from .backend import TrialBackend

    compiler = compiler or ReplayCompiler(evaluator, clock=clock, compile_s=compile_s)
    return TrialBackend(compiler, ReplayChecker(compiler),
                        ReplayBenchmarker(compiler, aten_us, clock=clock, measure_s=measure_s), lambda problem: None)


# ---- synthetic landscape --------------------------------------------------------------------------------

# An H200-like device: the numbers a roofline of an fp32 CUDA-core kernel needs.
_SMS = 132
_FMA_PER_CLK_PER_SM = 128  # fp32 FMA lanes per SM
_CLOCK_GHZ = 1.98
_SMEM_PER_SM = 233472  # 228 KiB
_MAX_THREADS_PER_SM = 2048
_MAX_BLOCKS_PER_SM = 32
_DRAM_GBPS = 4800.0
_L2_GBPS = 12000.0
_LAUNCH_US = 3.0
_ISSUE_EFFICIENCY = 0.8  # a well-tuned fp32 SGEMM on CUDA cores reaches ~75-80% of peak FMA rate


def _gemm_dims(dims: Mapping[str, int]) -> tuple[int, int, int]:
    """(M, N, K) of the implicit GEMM for conv dims {N, C, H, W, K, R, S[, stride, pad]}."""
    u, pad = dims.get("stride", 1), dims.get("pad", 0)
    p = (dims["H"] + 2 * pad - dims["R"]) // u + 1
    q = (dims["W"] + 2 * pad - dims["S"]) // u + 1
    return dims["K"], dims["N"] * p * q, dims["C"] * dims["R"] * dims["S"]


def _implicit_gemm_model(c: Mapping[str, int], m: int, n: int, k: int) -> tuple[float | None, str]:
    """Modelled time in us of one implicit_gemm configuration, or (None, reason) for a resource failure."""
    t = implicit_gemm.threads(c)
    regs = implicit_gemm.estimated_registers(c)
    # The estimate misses the compiler's own temporaries; a block that is already at the register file's
    # limit by the estimate fails to launch for real, like a cudaErrorLaunchOutOfResources would.
    real_regs = int(regs * 1.1) + 4
    if real_regs > 255 or real_regs * t > implicit_gemm.REGISTERS_PER_SM:
        return None, f"about {real_regs} registers x {t} threads exceeds the register file"
    smem = implicit_gemm.smem_bytes(c)
    per_sm = min(_MAX_THREADS_PER_SM // t, _SMEM_PER_SM // smem, 65536 // (real_regs * t), _MAX_BLOCKS_PER_SM)
    blocks_m, blocks_n = -(-m // c["BM"]), -(-n // c["BN"])
    blocks = blocks_m * blocks_n
    waves = -(-blocks // (_SMS * per_sm))  # the last, partly empty wave costs a full one (tail effect)
    k_steps = -(-k // c["BK"])

    # Compute per block: the padded tile, at a rate limited by shared-memory reads per FMA (a thread reads
    # TM + TN words per TM*TN FMAs; the SM reads 32 words/clk and issues 128 FMA/clk).
    fma_per_load = c["TM"] * c["TN"] / (c["TM"] + c["TN"])
    smem_eff = min(1.0, fma_per_load / 4.0)
    warps = per_sm * t / 32
    # Latency hiding: few warps and little ILP leave the pipes idle; double buffering overlaps loads.
    ilp = min(c["TM"] * c["TN"], 16)
    hide = min(1.0, (warps * ilp * (1.6 if c["DB"] else 1.0)) / 96.0) ** 0.6
    sync_overhead = 1.0 + (2.0 if c["DB"] else 3.5) / c["BK"]
    clk_per_block = (c["BM"] * c["BN"] * k_steps * c["BK"]) / (_FMA_PER_CLK_PER_SM * smem_eff * hide)
    clk_per_block *= sync_overhead / _ISSUE_EFFICIENCY
    # Blocks resident on one SM share it: a wave takes as long as per_sm blocks in sequence on one SM
    # divided by the concurrency the SM actually achieves (already in `hide`).
    compute_us = waves * per_sm * clk_per_block / (_CLOCK_GHZ * 1e3)
    # Memory: every block streams its BM rows of weights and BN columns of im2col input through L2;
    # unique data comes from DRAM once. Scalar weight loads waste transactions.
    vec_eff = 1.0 if (c["VEC"] == 4 and k % 4 == 0) else 0.7
    l2_bytes = blocks * (c["BM"] / vec_eff + c["BN"] * 1.3) * k * 4
    dram_bytes = (m * k + n * k / 3 + m * n) * 4
    mem_us = max(l2_bytes / (_L2_GBPS * 1e3), dram_bytes / (_DRAM_GBPS * 1e3))
    overlap = 0.85 if c["DB"] else 0.5
    time_us = max(compute_us, mem_us) + (1 - overlap) * min(compute_us, mem_us) + _LAUNCH_US
    return time_us, ""


def synthetic_times(space: Space, problem_dims: Mapping[str, int], seed: int, *, noise: float = 0.05,
                    spread: float = 0.01) -> list[Record]:
    """A SYNTHETIC recording for every valid configuration of ``space`` (not a measurement).

    Times come from a roofline-style model of the implicit_gemm kernel on an H200-like GPU (132 SMs,
    waves of blocks, tile waste at the edges, occupancy from threads / shared memory / registers,
    shared-memory-bound inner product, latency hiding from warps, ILP and double buffering), multiplied by
    seeded log-normal noise (``noise`` = sigma) that makes the surface rugged. Configurations whose modelled
    registers overflow the register file fail with status "resources". ``spread`` is the relative
    run-to-run spread recorded for each time (used by ``ReplayEvaluator(deterministic=False)``).

    ``problem_dims`` holds the convolution: N, C, H, W, K, R, S and optionally stride and pad.
    Only the implicit_gemm family is modelled; other spaces raise ``ValueError``.

    >>> from bagf_torch.kernels import implicit_gemm
    >>> rec = synthetic_times(implicit_gemm.space(), ALEXNET_CONV2, seed=0)
    >>> len(rec) == len(implicit_gemm.space().valid_configs())
    True
    """
    if space.family != implicit_gemm.FAMILY:
        raise ValueError(f"synthetic_times models only the {implicit_gemm.FAMILY!r} family, not {space.family!r}; "
                         "record the space on a GPU instead")
    missing = {"N", "C", "H", "W", "K", "R", "S"} - set(problem_dims)
    if missing:
        raise ValueError(f"problem_dims lacks {sorted(missing)}; give N, C, H, W, K, R, S (and stride, pad)")
    m, n, k = _gemm_dims(problem_dims)
    rng = np.random.default_rng(seed)
    records = []
    for c in space.valid_configs():
        time_us, reason = _implicit_gemm_model(c, m, n, k)
        factor = math.exp(noise * rng.standard_normal())  # drawn for every config: stable across edits
        if time_us is None:
            records.append({"config": c, "status": "resources", "time_us": None, "spread_us": 0.0,
                            "detail": f"synthetic: {reason}"})
            continue
        time_us *= factor
        records.append({"config": c, "status": "ok", "time_us": time_us, "spread_us": spread * time_us,
                        "detail": "synthetic"})
    return records


# ---- recorded-space files (benchmarks/data/README.md) ---------------------------------------------------

FORMAT = "bagf-recorded-space/1"
"""The ``format`` field of a recorded-space file; another value is refused with a message."""

IQR_TO_SIGMA = 1.0 / 1.6832
"""p80 - p20 of a normal distribution is 1.6832 sigma: the recorded p20/p80 spread as a standard deviation."""

CUTOFF_MODES = ("time", "timeout")


@dataclass
class RecordedProblem:
    """One problem and one kernel family of a recording: every configuration's outcome, plus cuDNN."""

    name: str
    conv: dict[str, Any]
    family: str
    knobs: list[str]
    rows: list[dict[str, Any]]
    cudnn: dict[str, Any] | None = None
    default: dict[str, int] | None = None
    complete: bool = True
    """Every valid configuration of the family has a row: the file says ``"complete": true`` AND the rows
    cover its ``"valid"`` count (``load_recording`` checks both). A partial problem's optimum is unknown."""
    valid: int | None = None
    """How many valid configurations the family's space had when recorded (None: the file does not say)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def partial_reason(self) -> str | None:
        """None for a complete problem; otherwise why it is partial, with the counts."""
        if self.complete:
            return None
        of = f" of {self.valid}" if self.valid is not None else ""
        why = f" (recording stopped after {self.extra['seconds']:.0f} s)" if "seconds" in self.extra else ""
        return (f"partial: {len(self.rows)}{of} valid configurations recorded{why}, so its optimum is unknown")

    def records(self, cutoff: str = "time") -> list[Record]:
        """The rows as ``ReplayEvaluator`` records. A "cutoff" row (one sample, already slower than the
        recorder's cut-off) replays as an "ok" time of that one sample with ``cutoff="time"``, or as the
        tuner's "timeout" failure with ``cutoff="timeout"``."""
        if cutoff not in CUTOFF_MODES:
            raise ValueError(f"cutoff={cutoff!r}; expected one of {CUTOFF_MODES}")
        out = []
        for row in self.rows:
            config = dict(zip(self.knobs, (int(v) for v in row["config"])))
            status = row["status"]
            if status == "cutoff":
                status = "ok" if cutoff == "time" else "timeout"
            if status == "ok":
                t = float(row["median_us"])
                p20, p80 = row.get("p20_us"), row.get("p80_us")
                spread = (float(p80) - float(p20)) * IQR_TO_SIGMA if p20 is not None and p80 is not None else 0.0
                out.append({"config": config, "status": "ok", "time_us": t, "spread_us": spread,
                            "detail": row.get("detail", "")})
            else:
                out.append({"config": config, "status": status, "time_us": None, "spread_us": 0.0,
                            "detail": row.get("detail", "")})
        return out

    def evaluator(self, *, deterministic: bool = True, seed: int = 0, cutoff: str = "time",
                  cutoff_factor: float | None = None) -> ReplayEvaluator:
        """A replay of this problem; ``cutoff_factor`` (e.g. the tuner's 4.0) cuts like the tuner does."""
        return ReplayEvaluator(self.records(cutoff), deterministic=deterministic, seed=seed,
                               cutoff_factor=cutoff_factor)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.family}"


@dataclass
class Recording:
    meta: dict[str, Any]
    problems: list[RecordedProblem]

    @property
    def synthetic(self) -> bool:
        return bool(self.meta.get("synthetic"))


def write_recording(path: str | os.PathLike, meta: Mapping[str, Any], problems: Sequence[Mapping[str, Any]]) -> None:
    """Write a recorded-space file atomically (temp file, then ``os.replace``); gzip when ``path`` ends in .gz.

    ``problems`` are dicts in the file's layout: {"name", "conv", "cudnn", "families": {family: {"knobs",
    "default", "complete", "records": [...]}}}.
    """
    path = Path(path)
    doc = {"format": FORMAT, "meta": dict(meta), "problems": list(problems)}
    data = json.dumps(doc, separators=(",", ":"), sort_keys=False).encode()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        if path.suffix == ".gz":
            # mtime=0: the same content gives the same bytes, so an unchanged file is not a git change
            with gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as g:
                g.write(data)
        else:
            f.write(data)
    os.replace(tmp, path)


def load_recording(path: str | os.PathLike) -> Recording:
    """Read a recorded-space file (gzip or plain JSON) written by ``write_recording``."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path}: format {got!r} is not {FORMAT!r}; re-record it with benchmarks/record_space.py "
                         "or convert it (benchmarks/data/README.md describes the format)")
    problems = []
    for p in doc["problems"]:
        for family, fam in p["families"].items():
            knobs = list(fam["knobs"])
            default = fam.get("default")
            rows = list(fam["records"])
            valid = fam.get("valid")
            # Complete only if the file says so and the rows cover every valid configuration: a file whose
            # flag was left true by an interrupted writer must not pass as complete.
            distinct = len({tuple(r["config"]) for r in rows})
            complete = bool(fam.get("complete", True)) and (valid is None or distinct >= int(valid))
            problems.append(RecordedProblem(
                name=p["name"], conv=dict(p["conv"]), family=family, knobs=knobs, rows=rows,
                cudnn=p.get("cudnn"), default=dict(zip(knobs, default)) if default is not None else None,
                complete=complete, valid=int(valid) if valid is not None else None,
                extra={k: v for k, v in fam.items() if k not in ("knobs", "default", "complete", "records", "valid")}))
    return Recording(dict(doc.get("meta", {})), problems)


def conv_dims(conv: Mapping[str, Any]) -> dict[str, int]:
    """``synthetic_times``'s problem_dims from a recorded ``conv`` (``ConvProblem.as_dict`` layout)."""
    return {"N": conv["n"], "C": conv["c"], "H": conv["h"], "W": conv["w"], "K": conv["k"], "R": conv["r"],
            "S": conv["s"], "stride": conv["stride"][0], "pad": conv["padding"][0]}


def synthetic_recording(path: str | os.PathLike, problems: Mapping[str, Mapping[str, Any]], seed: int = 0,
                        meta: Mapping[str, Any] | None = None) -> Recording:
    """Write a SYNTHETIC recorded-space file (``synthetic_times`` for implicit_gemm, one landscape seed per
    problem, ``seed + index``) and return it loaded. ``problems`` maps a name to a ``conv`` dict
    (``ConvProblem.as_dict`` layout). The file's meta says ``"synthetic": true``; never name it as if it
    were measured. The spread is 1% of each time, as ``synthetic_times`` makes it (p20/p80 = t -+ 0.84%)."""
    space = implicit_gemm.space()
    out = []
    for i, (name, conv) in enumerate(problems.items()):
        rows = []
        for r in synthetic_times(space, conv_dims(conv), seed=seed + i):
            values = [r["config"][k] for k in space.names]
            if r["status"] == "ok":
                half = 0.5 * r["spread_us"] / IQR_TO_SIGMA
                rows.append({"config": values, "status": "ok", "median_us": r["time_us"],
                             "p20_us": r["time_us"] - half, "p80_us": r["time_us"] + half})
            else:
                rows.append({"config": values, "status": r["status"], "detail": r["detail"]})
        out.append({"name": name, "conv": dict(conv), "cudnn": None, "families": {implicit_gemm.FAMILY: {
            "knobs": list(space.names), "default": [implicit_gemm.DEFAULT[k] for k in space.names],
            "raw_size": space.size, "valid": len(space.valid_configs()), "complete": True, "records": rows}}})
    info = {"synthetic": True, "generator": "bagf_torch.tuning.replay.synthetic_recording", "seed": seed,
            "note": "SYNTHETIC: a roofline-style model plus seeded noise, not GPU measurements"}
    info.update(meta or {})
    write_recording(path, info, out)
    return load_recording(path)


def newest_complete(files: Sequence[str | os.PathLike],
                    loaded: Mapping[Path, Recording] | None = None) -> dict[str, Path]:
    """{problem key: the file of its newest COMPLETE recording} over ``files`` (by each file's meta date; of equal
    dates, or none, the first file's): a problem recorded again (e.g. under a newer timing rule) supersedes its
    earlier recording wherever several recordings are read together (``benchmarks/strategies.py``'s replay and
    warm-start cache, ``benchmarks/bench_layers.py``'s reference, ``benchmarks/probes/param_analysis.py``).
    ``loaded``: recordings the caller has read already, by path (the others are read here)."""
    best: dict[str, tuple[str, Path]] = {}
    for f in files:
        rec = loaded[Path(f)] if loaded is not None and Path(f) in loaded else load_recording(f)
        date = str(rec.meta.get("date", ""))
        for rp in rec.problems:
            if rp.complete and (rp.key not in best or date > best[rp.key][0]):
                best[rp.key] = (date, Path(f))
    return {k: f for k, (_, f) in best.items()}

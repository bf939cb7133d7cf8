"""Bayesian optimisation with Ax 1.3: the default strategy (its example is skipped by doctest only
because fitting GPs takes seconds). The measurements behind each choice below are in docs/strategies.md.

Encoding. Knobs are ordered integer choices, power-of-two ones as exponents (BM 16..128 -> 4..7: the spacing that
matters), and Ax models log(time_us): times span 30x and effects multiply. Where Ax enumerates raw combinations, up
to 8 +-1 linear constraints that every valid configuration satisfies (``_linear_constraints``) drop most invalid ones.

Loop and initial design. The prior (start point, warm-start seeds) is attached as completed trials, then
``initial_trials`` (16) unseen one-knob neighbours of the best known ("local"), a walk in batches: random ones
throw away what the warm start found, Ax's Sobol start wastes 30% on invalid points, and from a start point near
the optimum the walk gets there before a GP would (8 trials: 12 evaluations to 95% in the median, 13% never within
50; 16: 8.5-11 and 2-6%, docs/strategies.md). Each Ax batch (qLogEI, pending points) is evaluated
as one batch. After 3 generations without a new evaluation, or with fewer unproposed raw combinations left than a
batch (Ax would rejection-sample for a minute), unseen valid configurations are drawn at random, so the loop ends.

Cold start (``cold_order``, ``cold_trials``). With nothing that ran before the search (no start point or one that
failed, no warm-start seed that ran) the local design has no centre: its first 8 trials are the configurations the family's analytical
estimate (``implicit_gemm_tc.estimated_time``) ranks fastest instead of random ones, and the walk starts from the
best of them (replay without start point: 14 evaluations to 95% in the median against 36.5, never within 50 in 25%
of the runs against 39%).

Small early batches (``initial_batch``, ``early_batch``, ``early_until``). The local design runs in batches of 4,
each centred on the best after the one before, and GP generations ask for 4 until evaluation 24, then 8
(``batch_size``): while the GP knows little, a short walk is what keeps up with simulated annealing.

Which neighbours first (``initial_order``, ``initial_ranked``). Before any time is known the 2 neighbours with the
most warps in flight per SM go first (a batch-1 layer leaves most SMs idle), the rest in seeded random order:
ranking them all would leave out the neighbours on the way to most optima (BM=128).

Problem-aware features (``features``). The knobs alone do not say how they combine on a problem (the best SPLIT
depends on BM and BN through the grid), so the GP also gets the family's features (e.g. log2 grid blocks per SM).

Candidates and trust region (``candidates``, ``trust_region``). Ax scores our list of the valid configurations it
has not seen (``candidate_set``: no invalid proposal is possible) within 3 one-knob steps of the incumbent, a
radius that grows after a generation without a new best: the same quality as scoring all, less Ax time.

Exploring trials (``explore``, ``explore_from``). The last 2 trials of each GP generation are the acquisition's
best over a seeded random sample of 512 of all unseen valid configurations instead of the trust region: runs that
failed circled one local optimum whose way out changes two coupled knobs at once (BM and WM), which the trust
region's acquisition never proposed.

Invalid proposals and failures (``invalid``; a failure is a typed status, never proposed again). "constraint": an
outcome constraint on ``excess`` (validity rules broken), learnt by a second GP, with qLogNEI; "abandon":
``mark_trial_abandoned``, nothing learnt; "penalty": 2x the slowest time seen, which steers the GP away from the
fastest configurations (they have more invalid neighbours than most). "abandon" is the default: with valid-only
candidates nothing invalid is proposed, so a second GP buys nothing. A "timeout" is a penalty time in every mode.

Generation cost (``mc_samples``, ``fit_maxiter``, ``acquisition``). qLogEI, a seeded 64-sample QMC sampler and at
most 20 L-BFGS fit iterations cost a fraction of BoTorch's defaults (qLogNEI, 512 samples, a full fit), same quality.

>>> from bagf_torch.kernels.space import Space
>>> from bagf_torch.tuning.common import Budget, Objective, Outcome
>>> space = Space("demo", {"a": (1, 2, 4, 8), "b": (1, 2, 4)})
>>> obj = Objective(space, lambda cs: [Outcome("ok", float(abs(c["a"] - 4) + c["b"])) for c in cs], Budget(8))
>>> tune(obj, seed=0, batch_size=2, initial_trials=4)  # doctest: +SKIP
>>> obj.best()[0]  # doctest: +SKIP
{'a': 4, 'b': 1}
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time
import warnings
from typing import Any, Mapping

import numpy as np

from ... import shutdown
from ...kernels.space import Config, Space, config_key
from ..common import Objective, Outcome, unseen_random
from .anneal import neighbours

OPTIONS: dict[str, Any] = {
    "batch_size": 8,
    "initial_trials": 16,
    "initial": "local",
    "initial_batch": 4,
    "early_batch": 4,
    "early_until": 24,
    "invalid": "abandon",
    "mc_samples": 64,
    "log_time": True,
    "linear_constraints": True,
    "acquisition": "qLogEI",
    "fit_maxiter": 20,
    "candidates": "valid",
    "trust_region": 3,
    "features": None,
    "initial_order": None,
    "initial_ranked": 2,
    "explore": 2,
    "explore_after": 0,
    "explore_from": "all",
    "cold_order": None,
    "cold_trials": 8,
    "stats": None,
}
"""batch_size: trials per Ax generation, evaluated as one batch.
initial_trials: configurations evaluated before the first model fit.
initial: "random" (uniform over valid configurations, ours), "local" (one-knob neighbours of the best
configuration known so far, the prior's best first; random while nothing has run) or "sobol" (Ax's Sobol,
may propose invalid). Prior trials count towards ``initial_trials``.
initial_batch: configurations per batch of the initial design (None: ``batch_size``); with "local" each
batch is centred on the best configuration known after the previous one, a short walk (default 4: the
start's neighbours, then the neighbours of the best of them, as annealing's first steps).
early_batch, early_until: a generation that starts before ``early_until`` evaluations (prior included) asks
Ax for ``min(early_batch, batch_size)`` trials instead of ``batch_size`` (None: always ``batch_size``): the GP is refitted
twice as often while it knows little, and the later generations keep the larger batch (fewer, and the real
evaluator compiles a batch in parallel).
invalid: "constraint", "abandon" or "penalty": how invalid proposals and failures are reported to Ax.
log_time: give Ax log(time_us) rather than time_us.
linear_constraints: give Ax the +-1 linear inequalities on the encoding that every valid configuration
satisfies (derived from the space, see ``_linear_constraints``), so it never proposes most invalid ones.
Only where Ax enumerates the raw combinations itself (``candidates="raw"`` without a trust region): our
own candidate list holds valid configurations only, so they change nothing there (identical replayed
curves) and cost half of a run's time (Ax re-parses every constraint with sympy whenever it copies the
search space, ~850 times in a run of 50 evaluations: 9.5 -> 4.3 s on conv3x3_256, docs/strategies.md).
acquisition: "qLogEI" (improvement over the best modelled value) or "qLogNEI" (Ax's default, noisy EI
integrated over the posterior at every observed point: dearer, see docs/strategies.md). invalid=
"constraint" always uses qLogNEI: BoTorch builds qLogEI only when every metric is observed at every
trial, and the constraint's trials carry no time.
fit_maxiter: L-BFGS iterations of each GP hyperparameter fit (None: BoTorch's default, up to 200).
mc_samples: quasi-MC samples of the acquisition function (None: Ax's default, 512).
candidates: what Ax's acquisition scores each generation: "valid" (the valid configurations Ax does not
hold as trials yet, handed to Ax's ``candidate_set`` path: no invalid proposal is possible, and fewer
points to score than "raw") or "raw" (Ax's own enumeration of every raw combination its linear
constraints allow).
trust_region: 0: off. r >= 1: only the candidates within ``r`` steps of the incumbent (best time so far), a step
being one knob moved to an adjacent value (L1 distance over the knobs' value indices); the radius grows
by one after each generation that brings no new best (and while fewer than a batch are inside it) and
falls back to ``r`` after one that does.
features: None, or a function config -> {name: float} of problem-aware inputs (the tuner passes the
family's ``features(problem, config)`` when it has one, e.g. ``implicit_gemm_tc.features``: blocks per SM,
K-tiles per slice, resident blocks); the GP then models time over the knobs AND these values
(``_gp_class``, ``_feature_transform``).
initial_order: None, or a function config -> float that ranks the incumbent's neighbours before any time is
known (higher: tried first): the tuner passes the family's ``warps_in_flight(problem, config)`` when it has
one (``implicit_gemm_tc.warps_in_flight``). Only with ``initial="local"``.
initial_ranked: how many of the local initial design's neighbours are the best-ranked by ``initial_order``;
the others follow in the seeded random order (0: all random).
explore: how many trials of a GP generation are chosen away from the incumbent (0: none), the last ones of the
batch (the others are pending for them): a way out of a local optimum that the trust region keeps circling.
Only with ``candidates="valid"`` or a trust region. explore_after: only once this many evaluations have brought
no new best (0: in every generation). explore_from: how they are chosen: "outside" (the acquisition over the
unseen valid configurations beyond the trust region's radius), "all" (the acquisition over every unseen valid
configuration), "uncertain" (the unseen valid configuration with the largest posterior variance), each over a seeded
sample of at most ``EXPLORE_POOL``, or "far" (without the model: the unseen valid configurations furthest, in
one-knob steps, from every configuration evaluated and from each other). With the default ``explore_after`` 0
this holds from the first GP generation, and ``min(explore, n - 1)`` of a short batch (the early batches of
``early_batch``, the last one) explore too: 2 of 4.
cold_order, cold_trials: when the search starts with nothing that ran (no start point or one that failed, no
warm-start seed that ran) and
``cold_order`` is a function config -> float (higher: tried first; the tuner passes minus the family's
``estimated_time(problem, config)`` when it has one, ``implicit_gemm_tc.estimated_time``), the first
``cold_trials`` trials of the local initial design are the best-ranked valid configurations (ties in the seeded
random order), in batches of ``initial_batch``, instead of random ones; the walk then starts from the best of them.
Without ``cold_order``, or with a prior that ran, nothing changes. Only with ``initial="local"``.
stats: a dict the run fills with counters: generations, invalid_proposals, repeats, fallback (configs
drawn at random after stalls), explored (trials chosen by the exploring rule), gen_seconds (wall time of each
Ax generation) and roles (per generation, what each trial Ax generated was chosen for, in order: "region"
or "explore", then "far")."""

INVALID_MODES = ("constraint", "abandon", "penalty")
ACQUISITIONS = ("qLogEI", "qLogNEI")
MAX_LINEAR_CONSTRAINTS = 8
INITIAL_MODES = ("random", "local", "sobol")
EXPLORE_FROM = ("outside", "all", "far", "uncertain")
EXPLORE_POOL = 512
"""At most this many configurations (a seeded random sample) are scored for one exploring trial: the acquisition
over every unseen valid configuration costs ~0.3 s per trial against ~0.03 s in a trust region."""
CANDIDATES = ("valid", "raw")
METRIC = "time_us"
EXCESS = "excess"
PENALTY_FACTOR = 2.0
MAX_STALLS = 3


def _is_power_of_two(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


class _Codec:
    """Config <-> Ax parameterization: power-of-two knobs as exponents, other knobs as values."""

    def __init__(self, space: Space):
        self.space = space
        self.fixed: dict[str, int] = {}
        self.log2: set[str] = set()
        self.ax_values: dict[str, list[int]] = {}
        for name, values in space.params.items():
            if len(values) == 1:
                self.fixed[name] = int(values[0])
            elif all(_is_power_of_two(int(v)) for v in values):
                self.log2.add(name)
                self.ax_values[name] = [int(v).bit_length() - 1 for v in values]
            else:
                self.ax_values[name] = [int(v) for v in values]

    def parameters(self) -> list:
        from ax import ChoiceParameterConfig

        return [ChoiceParameterConfig(name=n, values=v, parameter_type="int", is_ordered=True)
                for n, v in self.ax_values.items()]

    def encode(self, config: Mapping[str, int]) -> dict[str, int]:
        return {n: (int(config[n]).bit_length() - 1 if n in self.log2 else int(config[n])) for n in self.ax_values}

    def ranks(self, config: Mapping[str, int]) -> list[int]:
        """Each Ax knob's value index (its position among the knob's ordered values)."""
        enc = self.encode(config)
        return [sorted(self.ax_values[n]).index(enc[n]) for n in self.ax_values]

    def decode(self, params: Mapping[str, Any]) -> Config:
        c = dict(self.fixed)
        for n in self.ax_values:
            v = int(round(float(params[n])))
            c[n] = 1 << v if n in self.log2 else v
        return {n: c[n] for n in self.space.names}


def _linear_constraints(codec: _Codec, limit: int = MAX_LINEAR_CONSTRAINTS) -> list[str]:
    """Ax parameter constraints ``sum(a_i * x_i) <= b`` with every ``a_i`` in {-1, 0, 1} over the encoded
    knobs, each satisfied by every valid configuration (``b`` is the largest value any valid one takes),
    chosen greedily to exclude the most invalid raw combinations. In exponents most of implicit_gemm's
    rules are linear (TM <= BM; 32 <= threads <= 1024 is 5 <= BM - TM + BN - TN <= 10): five
    constraints exclude 1504 of its 1552 invalid combinations, and Ax's discrete optimiser drops what
    they exclude before scoring. A constraint can never exclude a valid configuration.
    """
    import itertools

    names = list(codec.ax_values)
    if len(names) < 2 or len(names) > 10:  # 3^10 candidate rows is the most worth enumerating
        return []
    space = codec.space
    raw = list(space.all_configs())
    x = np.array([[codec.encode(c)[n] for n in names] for c in raw], dtype=np.int64)
    valid = np.array([space.is_valid(c) for c in raw])
    if valid.all() or not valid.any():
        return []
    rows = np.array([a for a in itertools.product((-1, 0, 1), repeat=len(names)) if sum(map(abs, a)) >= 2])
    values = x @ rows.T
    bound = values[valid].max(axis=0)
    cuts = values > bound
    covered = np.zeros(len(raw), dtype=bool)
    out = []
    for _ in range(limit):
        gain = (cuts & ~covered[:, None]).sum(axis=0)
        j = int(gain.argmax())
        if gain[j] == 0:
            break
        covered |= cuts[:, j]
        terms = " ".join(f"{'+' if a > 0 else '-'} {n}" for a, n in zip(rows[j], names) if a)
        out.append(f"{terms.removeprefix('+ ')} <= {int(bound[j])}")
    return out


_CHEAP_GP: dict[tuple[int | None, bool], type] = {}


def _feature_transform(features, normalize):
    """A BoTorch input transform that appends problem-aware features to Ax's encoded knobs.

    ``features`` is ``(levels, table)``: each knob's sorted encoded values (Ax's columns, in ``_Codec``
    order) and one row of features, already scaled to [0, 1], per raw combination (mixed radix over the
    value indices, last knob fastest, as ``Space.all_configs`` enumerates). ``normalize`` is the transform Ax
    built for the knobs (scales them to [0, 1]), applied to the knob columns first."""
    import torch
    from botorch.models.transforms.input import InputTransform

    levels, table = features

    class FeatureInput(InputTransform, torch.nn.Module):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.transform_on_train = self.transform_on_eval = self.transform_on_fantasize = True
            self.normalize = normalize
            self.levels = [torch.as_tensor(v, dtype=torch.float64) for v in levels]
            self.table = torch.as_tensor(table, dtype=torch.float64)
            self.strides = [int(np.prod([len(v) for v in levels[j + 1:]])) for j in range(len(levels))]

        def transform(self, X):
            index = torch.zeros(X.shape[:-1], dtype=torch.long, device=X.device)
            for j, (vals, stride) in enumerate(zip(self.levels, self.strides)):
                v = vals.to(X)
                at = torch.searchsorted(v, X[..., j].round().contiguous()).clamp(max=len(v) - 1)
                index = index + at * stride
            knobs = self.normalize.transform(X) if self.normalize is not None else X
            return torch.cat([knobs, self.table.to(X)[index]], dim=-1)

        def equals(self, other):
            return type(self) is type(other) and torch.equal(self.table, other.table)

    return FeatureInput()


def _gp_class(maxiter: int | None, with_features: bool) -> type:
    """A SingleTaskGP subclass whose hyperparameter fit stops after ``maxiter`` L-BFGS iterations (None:
    BoTorch's default) and, ``with_features``, that takes ``features`` (see ``_feature_transform``) through
    Ax's ``model_options`` and models time over the knobs plus those features.

    Ax 1.3 fits through its ``fit_botorch_model`` dispatcher without optimiser options; registering a
    subclass is its extension point. On 40 trials BoTorch's default ran 258 iterations (3.1 s of an 8.5 s
    generation on the 2-core CI machine); the effect of the cap on search quality is measured in
    docs/strategies.md."""
    if (maxiter, with_features) not in _CHEAP_GP:
        from ax.generators.torch.botorch_modular.utils import fit_botorch_model
        from botorch.fit import fit_gpytorch_mll
        from botorch.models import SingleTaskGP
        from botorch.utils.types import DEFAULT

        body: dict = {}
        if with_features:
            def construct_inputs(cls, training_data, features=None):
                return {**SingleTaskGP.construct_inputs.__func__(cls, training_data), "features": features}

            def __init__(self, train_X, train_Y, train_Yvar=None, likelihood=None, covar_module=None,
                         mean_module=None, outcome_transform=DEFAULT, input_transform=None, features=None):
                if features is not None:
                    input_transform = _feature_transform(features, input_transform)
                SingleTaskGP.__init__(self, train_X, train_Y, train_Yvar, likelihood, covar_module, mean_module,
                                      outcome_transform, input_transform)

            body = {"construct_inputs": classmethod(construct_inputs), "__init__": __init__}
        cls = type(f"SingleTaskGP{'Features' if with_features else ''}Fit{maxiter or 'Default'}", (SingleTaskGP,), body)

        def fit(model, mll_class, mll_options=None):
            mll = mll_class(likelihood=model.likelihood, model=model, **(mll_options or {}))
            fit_gpytorch_mll(mll, optimizer_kwargs={"options": {"maxiter": maxiter}} if maxiter else {})

        fit_botorch_model.register(cls)(fit)
        _CHEAP_GP[(maxiter, with_features)] = cls
    return _CHEAP_GP[(maxiter, with_features)]


def _feature_table(codec: _Codec, features) -> tuple[list[list[int]], np.ndarray]:
    """``(levels, table)`` for ``_feature_transform``: ``features(config)`` for every raw combination of
    the encoded knobs (columns in feature-name order), each feature scaled to [0, 1] over the valid configurations (a combination the
    function cannot describe gets the valid configurations' mean)."""
    import itertools

    names = list(codec.ax_values)
    levels = [sorted(codec.ax_values[n]) for n in names]
    rows, ok = [], []
    keys: list[str] | None = None
    for combo in itertools.product(*levels):
        config = codec.decode(dict(zip(names, combo)))
        try:
            f = dict(features(config))
        except (ArithmeticError, KeyError, ValueError):
            f = None
        if f is not None and keys is None:
            keys = sorted(f)
        rows.append([float(f[k]) for k in keys] if f is not None else None)
        ok.append(f is not None and codec.space.is_valid(config))
    if keys is None or not any(ok):
        raise ValueError("ax features: the function described no valid configuration")
    ref = np.array([r for r, good in zip(rows, ok) if good])
    lo, hi = ref.min(axis=0), ref.max(axis=0)
    mean = ref.mean(axis=0)
    table = np.array([r if r is not None else mean for r in rows])
    table = (table - lo) / np.where(hi > lo, hi - lo, 1.0)
    return levels, table


_QUIET_LOCK = threading.Lock()
_QUIET_RUNS = 0  # runs inside _quiet_ax now
_QUIET_OLD: int | None = None  # Ax's console level before the first of them
_QUIET_FILTERS: list = []  # Python's warning filters before the first of them


@contextlib.contextmanager
def _quiet_ax():
    """Silence Ax's console and Python's warnings for one tuning run (importing Ax inside it too); both are
    restored after.

    Ax logs to its own handler (its "ax" logger does not propagate to the root logger), INFO per trial
    and WARNING for states this loop expects and handles: "trial completed without time_us" in constraint
    mode, "fewer trials generated than asked" before a fallback batch. Only ERROR gets through. Ax's and
    BoTorch's deprecation and numerical warnings are ignored.

    Runs overlap: a search the tuner abandoned at its family's deadline winds up on its own thread while the
    next family's starts. The handler's level and the warning filters are process-wide, so the first run in
    saves both and the last one out restores them. A save/restore per run let the abandoned run restore INFO
    in the middle of the next one, whose trials then went to the user's stderr (8 lines in a ResNet-18
    pre-tuning), and ``warnings.catch_warnings`` per run, left out of order, kept "ignore" for good.
    """
    global _QUIET_RUNS, _QUIET_OLD, _QUIET_FILTERS
    with _QUIET_LOCK:
        if _QUIET_RUNS == 0:
            _QUIET_FILTERS = list(warnings.filters)
            warnings.simplefilter("ignore")
        _QUIET_RUNS += 1
    try:
        from ax.utils.common.logger import ROOT_STREAM_HANDLER, set_stderr_log_level

        with _QUIET_LOCK:
            if _QUIET_OLD is None:
                _QUIET_OLD = ROOT_STREAM_HANDLER.level
                set_stderr_log_level(logging.ERROR)
        yield
    finally:
        with _QUIET_LOCK:
            _QUIET_RUNS -= 1
            if _QUIET_RUNS == 0:
                if _QUIET_OLD is not None:
                    from ax.utils.common.logger import set_stderr_log_level

                    set_stderr_log_level(_QUIET_OLD)
                    _QUIET_OLD = None
                warnings.filters[:] = _QUIET_FILTERS
                mutated = getattr(warnings, "_filters_mutated", None)  # what filterwarnings() calls after a change
                if mutated is not None:
                    mutated()


_PRELOAD: threading.Thread | None = None
_PRELOAD_LOCK = threading.Lock()


def preload() -> Any:
    """Start importing Ax in a daemon thread, once per process (nothing when Ax is imported already); returns
    ``wait(timeout=None) -> bool`` (True once the import has ended) or None when there is nothing to wait for.

    Why: Ax's import (with BoTorch, GPyTorch, pandas) took 5.8 s on the H200's host (``first_call.py``'s
    ``prewarm.ax_import_s``), inside the first tuning of a process, where it is search time lost. The tuner
    starts it before its first compile wave, during which the main thread mostly waits for NVRTC (which releases
    the GIL), and waits for it before it times anything: an import competing for the GIL would delay the launches
    of the timed calls. A failed import is left to ``tune``'s own import, which reports it. Unlike ``tune``'s import,
    this one runs outside ``_quiet_ax`` (``warnings.catch_warnings`` is process-wide, not safe on a second thread):
    Ax's import-time DeprecationWarnings are Python's default business (hidden outside ``__main__``), and a
    ``-W error`` process fails the import here and imports again in ``tune``."""
    global _PRELOAD
    with _PRELOAD_LOCK:
        if "ax.api.client" in sys.modules and _PRELOAD is None:
            return None
        if _PRELOAD is None:
            def load() -> None:
                try:
                    import ax.api.client  # noqa: F401  (what ``from ax import Client`` loads)
                except Exception:  # noqa: BLE001 - tune() imports again and reports the error
                    pass

            _PRELOAD = threading.Thread(target=load, name="bagf-ax-import", daemon=True)
            _PRELOAD.start()
            shutdown.track(_PRELOAD)  # (an import runs torch's bindings too: finished before the interpreter ends)
        thread = _PRELOAD

    def wait(timeout: float | None = None) -> bool:
        if timeout is not None and not 0 <= timeout < threading.TIMEOUT_MAX:  # an unbounded budget: to the end
            timeout = None
        thread.join(timeout)
        return not thread.is_alive()

    return wait


def _wait_preload() -> None:
    """Never import Ax on two threads at once: a preload in flight is waited for (the import is then free)."""
    thread = _PRELOAD
    if thread is not None:
        thread.join()


def _ax_at_least(major: int, minor: int) -> bool:
    import ax

    try:
        found = tuple(int(p) for p in ax.__version__.split(".")[:2])
    except (AttributeError, ValueError):
        return False
    return found >= (major, minor)


FAST_COMPLETE = True
"""Complete trials through ``_completer``'s direct path (tests compare it with ``Client.complete_trial``)."""


def _completer(client) -> Any:
    """``complete(index, raw_data)``: what ``Client.complete_trial`` does to the experiment (attach the trial's data,
    mark it completed), without the two pandas DataFrames it builds per call only to validate and to log
    (``Data.df`` of the new row, and the experiment's whole data filtered to the trial), which grow with the number
    of trials: 4.1 of 21.3 s in a profile of 4 replayed runs (python -m cProfile benchmarks/strategies.py
    --strategies ax --seeds 2 --problems alexnet_conv4_n1,conv3x3_256_56_n1 --workers 1). On the H200 recordings
    (benchmarks/strategies.py --strategies ax --seeds 3, 7 problems, 2-core VM, three interleaved pairs) the
    strategy's seconds per run were 3.89-4.27 against 4.27-5.97 through Client.complete_trial, with the same
    trials. Ax's internals differ between versions: whatever is missing here, or a metric the experiment does not
    know (Client would register it), takes ``Client.complete_trial`` instead."""
    slow = client.complete_trial
    if not FAST_COMPLETE or not _ax_at_least(1, 3):  # earlier 1.x Clients attach and mark trials differently
        return lambda index, raw_data: slow(index, raw_data=raw_data)
    try:
        experiment = client._experiment
        attach = experiment.attach_data
    except AttributeError:
        return lambda index, raw_data: slow(index, raw_data=raw_data)

    def complete(index: int, raw_data: dict) -> None:
        try:
            trial = experiment.trials[index]
            to_data, arm, mark = trial._raw_evaluations_to_data, trial.arm.name, trial.mark_completed
        except (AttributeError, KeyError):
            return slow(index, raw_data=raw_data)
        if not set(raw_data) <= set(experiment.metrics):
            return slow(index, raw_data=raw_data)
        try:  # nothing is changed until the data is built: any surprise here can still take the Client's way
            data = to_data(raw_data={arm: [(float("nan"), raw_data)]})  # Client.attach_data's form (no progression)
        except Exception:  # noqa: BLE001
            return slow(index, raw_data=raw_data)
        attach(data)
        mark()

    return complete


def _candidate_acquisition(codec: _Codec, candidates: list, per_call: list | None = None,
                           served: list | None = None):
    """An Ax ``Acquisition`` subclass that scores only ``candidates`` (a list of configurations the loop
    refills before each generation; empty: Ax's own enumeration of every raw combination), or, while
    ``per_call`` holds lists, the first of them (taken off: Ax generates a batch one trial at a time), through
    Ax's ``candidate_set`` path. Configurations are mapped into the model's space knob by knob through
    their value index: Ax's transforms keep each ordered choice parameter's order."""
    import torch
    from ax.generators.torch.botorch_modular.acquisition import Acquisition

    names = list(codec.ax_values)

    def optimize(self, n, search_space_digest, *args, **kwargs):
        how, role = "acquisition", "region"
        if per_call and n == 1:  # Ax 1.x generates a batch one trial at a time (GenerationStrategy.gen, n=1)
            chosen, how, role = per_call.pop(0)
            if served is not None:
                served.append(role)
        else:  # several trials in one call: each entry no longer matches one trial, so none is used
            per_call.clear()
            chosen = list(candidates)
        if not chosen or kwargs.get("candidate_set") is not None:
            return Acquisition.optimize(self, n, search_space_digest, *args, **kwargs)
        ssd = search_space_digest
        levels = []
        for name in names:
            i = ssd.feature_names.index(name)
            levels.append(sorted(ssd.discrete_choices[i]))
        rows = [[levels[j][r] for j, r in enumerate(codec.ranks(c))] for c in chosen]
        x = torch.tensor(rows, dtype=self.dtype, device=self.device)
        full = torch.zeros(len(rows), len(ssd.feature_names), dtype=self.dtype, device=self.device)
        for j, name in enumerate(names):
            full[:, ssd.feature_names.index(name)] = x[:, j]
        # Ax asks for a batch one arm at a time: the arms already generated in this batch are pending, and
        # must not be scored again (Ax's own enumeration avoids them through X_avoid)
        taken = [t for t in (self.X_observed, self.X_pending) if t is not None and len(t)]
        if taken:
            taken = torch.cat(taken).to(full)
            keep = ~(full[:, None, :] == taken[None, :, :]).all(-1).any(-1)
            full = full[keep]
        if not len(full):
            return Acquisition.optimize(self, n, search_space_digest, *args, **kwargs)
        if how == "uncertain":  # the candidate the model knows least about
            model = self.surrogate.model
            with torch.no_grad():
                var = model.posterior(full.unsqueeze(-2)).variance.reshape(len(full), -1).sum(-1)
            j = int(var.argmax())
            return full[j:j + 1], var[j:j + 1], torch.ones(1, dtype=self.dtype, device=self.device)
        kwargs["candidate_set"] = full
        return Acquisition.optimize(self, min(n, len(full)), search_space_digest, *args, **kwargs)

    return type("CandidateSetAcquisition", (Acquisition,), {"optimize": optimize})


def _generation_strategy(seed: int, initial_trials: int, own_initial: bool, mc_samples: int | None,
                         acquisition: str = "qLogNEI", fit_maxiter: int | None = None,
                         acquisition_class: type | None = None, features=None):
    """Ax's "fast" Sobol+MBM strategy (MBM alone when we attach the initial trials ourselves), with a
    seeded, smaller QMC sampler, the chosen acquisition function, a bounded GP fit and, with ``features``
    (``_feature_table``'s output), a GP over the knobs and those features."""
    from ax.api.utils.generation_strategy_dispatch import choose_generation_strategy
    from ax.api.utils.structs import GenerationStrategyDispatchStruct

    gs = choose_generation_strategy(GenerationStrategyDispatchStruct(
        method="fast",
        initialization_budget=0 if own_initial else initial_trials,
        initialization_random_seed=seed,
        initialize_with_center=False,
    ))
    import torch
    from botorch.acquisition.logei import qLogExpectedImprovement, qLogNoisyExpectedImprovement
    from botorch.sampling import SobolQMCNormalSampler

    for node in gs._nodes:
        for spec in node.generator_specs:
            if spec.generator_enum.name != "BOTORCH_MODULAR":
                continue
            if mc_samples is not None:
                spec.generator_kwargs["botorch_acqf_options"] = {
                    "sampler": SobolQMCNormalSampler(torch.Size([mc_samples]), seed=seed)}
            if acquisition_class is not None:
                spec.generator_kwargs["acquisition_class"] = acquisition_class
            spec.generator_kwargs["botorch_acqf_class"] = (
                qLogExpectedImprovement if acquisition == "qLogEI" else qLogNoisyExpectedImprovement)
            if fit_maxiter is not None or features is not None:
                from ax.generators.torch.botorch_modular.surrogate import SurrogateSpec
                from ax.generators.torch.botorch_modular.utils import ModelConfig

                spec.generator_kwargs["surrogate_spec"] = SurrogateSpec(model_configs=[ModelConfig(
                    botorch_model_class=_gp_class(fit_maxiter, features is not None),
                    model_options={"features": features} if features is not None else {})])
    return gs


def _trust_region(ranks: dict, centre: Config | None, known: set, n: int, radius: int,
                  valid: list[Config]) -> tuple[list[Config], int]:
    """The valid configurations Ax has not yet held as trials within ``radius`` steps (L1 over value
    indices) of ``centre``, with the radius grown until at least ``n`` are inside; all of them when
    there is no centre. Returns (candidates, radius used)."""
    fresh = [c for c in valid if config_key(c) not in known]
    if centre is None or not fresh:
        return fresh, radius
    at = ranks[config_key(centre)]
    dist = np.array([int(np.abs(ranks[config_key(c)] - at).sum()) for c in fresh])
    while (dist <= radius).sum() < n and radius < int(dist.max()):
        radius += 1
    return [c for c, d in zip(fresh, dist) if d <= radius], radius


def _far(ranks: dict, pool: list[Config], evaluated: list[Config], m: int, rng) -> list[Config]:
    """Up to ``m`` configurations of ``pool``, each the furthest (largest smallest L1 distance over value
    indices) from every evaluated configuration and every one picked before it; ties broken at random."""
    if not pool:
        return []
    x = np.array([ranks[config_key(c)] for c in pool])
    seen = [ranks[config_key(c)] for c in evaluated if config_key(c) in ranks]
    nearest = (np.abs(x[:, None, :] - np.array(seen)[None, :, :]).sum(-1).min(1) if seen
               else np.full(len(pool), np.inf))
    out: list[Config] = []
    for _ in range(min(m, len(pool))):
        top = np.flatnonzero(nearest == nearest.max())
        j = int(rng.choice(top))
        out.append(pool[j])
        nearest = np.minimum(nearest, np.abs(x - x[j]).sum(-1))
        nearest[j] = -1
    return out


def _excess(space: Space, config: Mapping[str, int]) -> float:
    """How many validity rules ``config`` breaks; at least 1 for any configuration that failed."""
    if any(v not in space.params[n] for n, v in config.items()):
        return float(len(space.rules) + 1)
    return float(max(1, sum(rule(config) is not None for rule in space.rules)))


def tune(objective: Objective, seed: int, *, batch_size: int = OPTIONS["batch_size"],
         initial_trials: int = OPTIONS["initial_trials"], initial: str = OPTIONS["initial"],
         initial_batch: int | None = OPTIONS["initial_batch"], early_batch: int | None = OPTIONS["early_batch"],
         early_until: int = OPTIONS["early_until"],
         invalid: str = OPTIONS["invalid"], mc_samples: int | None = OPTIONS["mc_samples"],
         log_time: bool = OPTIONS["log_time"], linear_constraints: bool = OPTIONS["linear_constraints"],
         acquisition: str = OPTIONS["acquisition"], fit_maxiter: int | None = OPTIONS["fit_maxiter"],
         candidates: str = OPTIONS["candidates"], trust_region: int = OPTIONS["trust_region"],
         features=OPTIONS["features"], initial_order=OPTIONS["initial_order"],
         initial_ranked: int = OPTIONS["initial_ranked"], explore: int = OPTIONS["explore"],
         explore_after: int = OPTIONS["explore_after"], explore_from: str = OPTIONS["explore_from"],
         cold_order=OPTIONS["cold_order"], cold_trials: int = OPTIONS["cold_trials"],
         stats: dict | None = None) -> None:
    if batch_size < 1 or initial_trials < 1:
        raise ValueError(f"ax batch_size={batch_size}, initial_trials={initial_trials}; both must be >= 1")
    if initial_batch is not None and initial_batch < 1:
        raise ValueError(f"ax initial_batch={initial_batch}; it must be >= 1 or None (batch_size)")
    if early_batch is not None and early_batch < 1:
        raise ValueError(f"ax early_batch={early_batch}; it must be >= 1 or None (always batch_size)")
    if early_until < 0:
        raise ValueError(f"ax early_until={early_until}; it must be >= 0 (0: always batch_size)")
    if invalid not in INVALID_MODES:
        raise ValueError(f"ax invalid={invalid!r}; expected one of {INVALID_MODES}")
    if initial not in INITIAL_MODES:
        raise ValueError(f"ax initial={initial!r}; expected one of {INITIAL_MODES}")
    if acquisition not in ACQUISITIONS:
        raise ValueError(f"ax acquisition={acquisition!r}; expected one of {ACQUISITIONS}")
    if fit_maxiter is not None and fit_maxiter < 1:
        raise ValueError(f"ax fit_maxiter={fit_maxiter}; it must be >= 1 or None (BoTorch's default)")
    if candidates not in CANDIDATES:
        raise ValueError(f"ax candidates={candidates!r}; expected one of {CANDIDATES}")
    if trust_region < 0:
        raise ValueError(f"ax trust_region={trust_region}; it must be >= 0 (0: off)")
    if mc_samples is not None and mc_samples < 1:
        raise ValueError(f"ax mc_samples={mc_samples}; it must be >= 1 or None (Ax's default)")
    if features is not None and not callable(features):
        raise ValueError(f"ax features={features!r}; expected None or a function config -> {{name: float}}")
    if initial_order is not None and not callable(initial_order):
        raise ValueError(f"ax initial_order={initial_order!r}; expected None or a function config -> float")
    if initial_ranked < 0:
        raise ValueError(f"ax initial_ranked={initial_ranked}; it must be >= 0 (0: neighbours in random order)")
    if explore < 0 or explore_after < 0:
        raise ValueError(f"ax explore={explore}, explore_after={explore_after}; both must be >= 0")
    if explore_from not in EXPLORE_FROM:
        raise ValueError(f"ax explore_from={explore_from!r}; expected one of {EXPLORE_FROM}")
    if cold_order is not None and not callable(cold_order):
        raise ValueError(f"ax cold_order={cold_order!r}; expected None or a function config -> float")
    if cold_trials < 0:
        raise ValueError(f"ax cold_trials={cold_trials}; it must be >= 0 (0: a random cold design)")

    space = objective.space
    codec = _Codec(space)
    if not codec.ax_values:  # a one-point space: nothing for Ax to choose
        objective(space.valid_configs()[:1])
        return
    valid = space.valid_configs()
    rng = np.random.default_rng(seed)
    stats = stats if stats is not None else {}
    for key in ("generations", "invalid_proposals", "repeats", "fallback", "explored"):
        stats.setdefault(key, 0)
    stats.setdefault("gen_seconds", [])
    stats.setdefault("roles", [])
    own_initial = initial in ("random", "local")
    own_candidates = candidates == "valid" or trust_region > 0
    explore = explore if own_candidates else 0
    ranks = {config_key(c): np.array(codec.ranks(c)) for c in valid} if trust_region or explore else {}
    # nothing that ran before the search (no start point or a failed one, no warm-start seed that ran): the local
    # design has no centre, so it begins with the best-estimated configurations instead of random ones
    cold_left = (cold_trials if cold_order is not None and initial == "local"
                 and objective.best(include_prior=True) is None else 0)
    chosen: list = []  # the configurations Ax's next generation scores (own_candidates)
    per_call: list = []  # (candidates, how, role) for the generation's next trials, one each (then ``chosen``)
    served: list = []  # the roles ("region", "explore") the generation's trials were chosen for, in order

    def incumbent() -> Config | None:
        best = objective.best(include_prior=True)
        return best[0] if best is not None else None

    estimates: dict = {}  # cold_order of every valid configuration, computed once

    def cold_initial(n: int) -> list[Config]:
        """The ``n`` best unseen valid configurations by ``cold_order`` (ties in the seeded random order)."""
        if not estimates:
            estimates.update((config_key(c), float(cold_order(c))) for c in valid)
        pool = unseen_valid(len(valid))
        return sorted(pool, key=lambda c: -estimates[config_key(c)])[:n]

    def local_initial(n: int) -> list[Config]:
        """Up to ``n`` unseen valid one-knob neighbours of the incumbent (random ones to fill up)."""
        centre = incumbent()
        out: list[Config] = []
        if centre is not None:
            around = neighbours(space, centre, rng, 0.0)
            if initial_order is not None and initial_ranked:
                # the best-ranked first, the rest in the seeded random order: the GP still gets a sample of
                # the whole neighbourhood (a fully ranked design left out the bigger tiles, docstring)
                ranked = sorted(around, key=lambda c: -initial_order(c))[:initial_ranked]
                around = ranked + [c for c in around if c not in ranked]
            for c in around:
                if objective.seen(c) is None and config_key(c) not in known and c not in out:
                    out.append(c)
                if len(out) >= n:
                    break
        return out + [c for c in unseen_valid(n) if c not in out][: n - len(out)]

    radius = trust_region
    last_best = math.inf

    def unseen_valid(n: int) -> list[Config]:
        return unseen_random(objective, valid, rng, n)

    _wait_preload()
    with _quiet_ax():
        from ax import Client
        from ax.exceptions.core import OptimizationComplete

        client = Client(random_seed=seed)
        client.configure_experiment(parameters=codec.parameters(), name=f"bagf_{space.family}",
                                    parameter_constraints=(_linear_constraints(codec) if linear_constraints
                                                           and not own_candidates else None))
        client.configure_optimization(objective=f"-{METRIC}",
                                      outcome_constraints=[f"{EXCESS} <= 0.5"] if invalid == "constraint" else None)
        client.set_generation_strategy(_generation_strategy(
            seed, initial_trials, own_initial, mc_samples,
            "qLogNEI" if invalid == "constraint" else acquisition, fit_maxiter,
            _candidate_acquisition(codec, chosen, per_call, served) if own_candidates else None,
            _feature_table(codec, features) if features is not None else None))

        worst_ok = -math.inf
        deferred: list[int] = []  # penalty trials waiting for a first time to scale the penalty

        finish = _completer(client)

        def complete(index: int, time_us: float) -> None:
            data = {METRIC: math.log(time_us) if log_time else time_us}
            if invalid == "constraint":
                data[EXCESS] = 0.0
            finish(index, data)

        def report(index: int, config: Config, outcome: Outcome) -> None:
            nonlocal worst_ok
            if outcome.ok:
                worst_ok = max(worst_ok, outcome.time_us)
                complete(index, outcome.time_us)
            elif outcome.status == "timeout" or invalid == "penalty":
                # A timeout is a valid configuration that is slow: a penalty time says exactly that.
                deferred.append(index)
            elif invalid == "abandon":
                client.mark_trial_abandoned(index)
            else:
                finish(index, {EXCESS: _excess(space, config)})

        attached = 0
        stalls = 0
        since_best = 0  # evaluations since the incumbent last improved
        known: set = set()  # configurations Ax holds as trials; it never proposes them again
        for c, o in objective.prior:  # measured before the search: Ax's first data, part of its initial design
            if space.is_valid(c) and config_key(c) not in known:
                report(client.attach_trial(codec.encode(c)), c, o)
                known.add(config_key(c))
                attached += 1
        # spent counts distinct valid configurations (Objective memoises): at len(valid), all are done.
        while objective.remaining > 0 and objective.spent < len(valid):
            early = early_batch is not None and len(objective.prior) + objective.spent < early_until
            n = min(min(early_batch, batch_size) if early else batch_size, objective.remaining)
            if own_initial and attached < initial_trials:
                m = min(n, initial_batch or n, initial_trials - attached)
                if cold_left:
                    configs = cold_initial(min(m, cold_left))
                    cold_left -= len(configs)
                else:
                    configs = local_initial(m) if initial == "local" else unseen_valid(m)
                attached += len(configs)
                indices = [client.attach_trial(codec.encode(c)) for c in configs]
            elif stalls >= MAX_STALLS or space.size - len(known) < n:
                # Ax keeps missing, or too few raw combinations are left for a batch (see the docstring).
                configs = unseen_valid(n)
                stats["fallback"] += len(configs)
                stalls = 0
                indices = [client.attach_trial(codec.encode(c)) for c in configs]
            else:
                if own_candidates and not trust_region:
                    chosen[:] = [c for c in valid if config_key(c) not in known]
                elif trust_region:
                    best = objective.best(include_prior=True)
                    best_t = best[1].time_us if best is not None else math.inf
                    radius = trust_region if best_t < last_best else radius + 1
                    last_best = min(last_best, best_t)
                    chosen[:], radius = _trust_region(ranks, incumbent(), known, n, radius, valid)
                far: list[Config] = []
                m = min(explore, n - 1) if explore and since_best >= explore_after else 0
                served.clear()
                if own_candidates:  # one entry per trial (the exploring ones, if any, replace the last below)
                    per_call[:] = [(list(chosen), "acquisition", "region")] * n
                if m:
                    inside = {config_key(c) for c in chosen} if trust_region else set()
                    pool = [c for c in valid if config_key(c) not in known
                            and (explore_from != "outside" or config_key(c) not in inside)]
                    if explore_from == "far":
                        far = _far(ranks, pool, [c for c, _ in list(objective.prior) + objective.trials], m, rng)
                        m = len(far)
                        per_call[:] = per_call[:n - m]
                    elif pool:
                        if len(pool) > EXPLORE_POOL:
                            pool = [pool[j] for j in sorted(rng.choice(len(pool), EXPLORE_POOL, replace=False))]
                        m = min(m, len(pool))
                        how = "uncertain" if explore_from == "uncertain" else "acquisition"
                        per_call[:] = [(list(chosen), "acquisition", "region")] * (n - m) + [(pool, how, "explore")] * m
                start = time.perf_counter()
                try:
                    trials = client.get_next_trials(max_trials=n - len(far))
                except OptimizationComplete:  # Ax has proposed every raw combination
                    trials = {}
                finally:
                    per_call.clear()
                if far:
                    trials = dict(trials)
                    for c in far:
                        trials[client.attach_trial(codec.encode(c))] = codec.encode(c)
                stats["explored"] += len(far) + served.count("explore")
                stats["roles"].append(list(served) + ["far"] * len(far))
                stats["gen_seconds"].append(time.perf_counter() - start)
                stats["generations"] += 1
                if not trials:
                    stalls = MAX_STALLS
                    continue
                indices, configs, keys = [], [], set()
                for i in trials:  # a repeat inside one batch is dropped (never sent twice in a batch)
                    c = codec.decode(trials[i])
                    if config_key(c) in keys:
                        client.mark_trial_abandoned(i)
                        continue
                    keys.add(config_key(c))
                    indices.append(i)
                    configs.append(c)
                stats["invalid_proposals"] += sum(not space.is_valid(c) for c in configs)
                stats["repeats"] += sum(objective.seen(c) is not None for c in configs)
            if not configs:
                break  # every valid configuration has been evaluated
            known.update(config_key(c) for c in configs)
            spent = objective.spent
            before = objective.best(include_prior=True)
            outcomes = objective(configs)
            after = objective.best(include_prior=True)
            improved = after is not None and (before is None or after[1].time_us < before[1].time_us)
            since_best = 0 if improved else since_best + len(configs)
            stalls = stalls + 1 if objective.spent == spent else 0
            for index, c, o in zip(indices, configs, outcomes):
                if o is None:  # budget ran out inside the batch
                    client.mark_trial_abandoned(index)
                else:
                    report(index, c, o)
            if deferred and worst_ok > -math.inf:
                for index in deferred:
                    complete(index, PENALTY_FACTOR * worst_ok)
                deferred.clear()

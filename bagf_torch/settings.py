"""Every ``BAGF_*`` environment variable, typed and documented, in one place.

Read at call time (not at import), so tests and users can change them with ``os.environ`` or
``monkeypatch.setenv`` in a running process. An empty value is the default. A value that cannot be parsed or
is out of range (non-finite, negative, over a day for seconds) raises ``SettingError`` naming the variable: the
command line prints it as one line (exit 2); inside a forward the layer logs it once and runs torch's conv.

=========================  ==========================================  ======================================
variable                   meaning                                     default
=========================  ==========================================  ======================================
BAGF_CACHE_DIR             directory of the tuning cache (SQLite),     $XDG_CACHE_HOME/bagf_torch or
                           the cubins in it, and the extension build   ~/.cache/bagf_torch
BAGF_BUILD_DIR             where the host extension is built           $BAGF_CACHE_DIR/build/<versions>
BAGF_TUNE                  1: tune a new problem on its first call;    1
                           0: use cached plans only, ATen otherwise
                           (serving never stalls on tuning)
BAGF_BUDGET                evaluations (candidates that reach the      80
                           GPU) per tuned problem
BAGF_TIME_BUDGET           seconds per tuned problem                   6
BAGF_STRATEGY              ax | random | anneal | genetic | exhaustive ax
BAGF_SEED                  seed of the search strategy                 0
BAGF_COMPILE_WORKERS       threads compiling candidates with NVRTC     min(16, usable CPUs)
BAGF_LOG                   log level of the "bagf_torch" logger        warning
                           (debug, info, warning, error)
BAGF_PRINT_TUNING          1: print one line per tuned problem         0
                           (time, evaluations, speedup) to stderr
BAGF_BACKGROUND            1: a new problem's first calls run ATen     0
                           while it is tuned in a background thread;
                           later calls switch to the winner
BAGF_CLAIM_LEASE           seconds a tuner's claim on a problem lasts  30
                           without a heartbeat: other processes (DDP
                           ranks, workers) wait for its winner; a
                           killed tuner's claim expires after this
                           (at once for a dead process on this host)
BAGF_CLAIM_WAIT            seconds a call waits for another process's  60
                           tuning of the same problem; then torch's
                           conv serves it until the winner is stored
BAGF_ISOLATE               1: compile, check and time candidates in a  0
                           child process with its own CUDA context;
                           a crashing candidate (illegal address,
                           abort) is recorded as "crashed" and the
                           child restarted, the user's process is safe
BAGF_ISOLATE_TIMEOUT       seconds one candidate's check or timing     20
                           may take in the child before it is killed
                           (recorded as "timeout"); needs BAGF_ISOLATE
BAGF_PRUNE_FACTOR          bound-guided pruning: before a family's     0 (off)
                           search, drop configurations whose modelled
                           global-memory traffic is more than this
                           factor above the best one (iobound.prune;
                           the DEFAULT is kept). 0 = off, else >= 1.
                           Off by default: on the H200 tc recording
                           only >= 4 kept every optimum, and that cut
                           15% (benchmarks/results/prune_h200_tc.md)
BAGF_CUBLASLT              1: also search cuBLASLt GEMM plans for 1x1  1
                           stride-1 unpadded convolutions
                           (kernels.cublaslt_1x1); 0: leave them out
=========================  ==========================================  ======================================
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingError(ValueError):
    """A BAGF_* variable holds a value that cannot be parsed, or one outside its range."""


def _raw(name: str) -> str | None:
    """The variable's value, stripped; None when it is unset or empty (an empty value means the default for
    every variable alike: ``BAGF_TUNE=`` is BAGF_TUNE unset, not "off")."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def get_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise SettingError(f"{name}={value!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def _check_range(name: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and not value >= minimum:
        raise SettingError(f"{name}={value:g} is below its minimum {minimum:g}")
    if maximum is not None and not value <= maximum:
        raise SettingError(f"{name}={value:g} is above its maximum {maximum:g}")


def get_int(name: str, default: int, minimum: int | None = None, maximum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise SettingError(f"{name}={value!r} is not a whole number") from None
    _check_range(name, parsed, minimum, maximum)
    return parsed


def get_float(name: str, default: float, minimum: float | None = None, maximum: float | None = None) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise SettingError(f"{name}={value!r} is not a number") from None
    if not math.isfinite(parsed):  # inf or nan: a lease or a timeout that never ends is no setting
        raise SettingError(f"{name}={value!r} is not a finite number")
    _check_range(name, parsed, minimum, maximum)
    return parsed


def get_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() not in choices:
        raise SettingError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value.lower()


def _path(name: str, value: str) -> Path:
    try:
        return Path(value).expanduser()
    except RuntimeError as e:  # "~nouser/x", or "~" with no home directory
        raise SettingError(f"{name}={value!r}: cannot expand '~' ({e}); give an absolute path") from None


DAY_S = 86400.0
"""The largest value any seconds setting takes: a day. Larger values are typos (1e23) or a wish for "never"."""


def cache_dir() -> Path:
    value = _raw("BAGF_CACHE_DIR")
    if value:
        return _path("BAGF_CACHE_DIR", value)
    base = _raw("XDG_CACHE_HOME")
    if base:
        return _path("XDG_CACHE_HOME", base) / "bagf_torch"
    try:
        return Path.home() / ".cache" / "bagf_torch"
    except RuntimeError as e:  # no HOME and no passwd entry (some containers)
        raise SettingError(f"no home directory to put the cache in ({e}); set BAGF_CACHE_DIR") from None


def build_dir() -> Path | None:
    value = _raw("BAGF_BUILD_DIR")
    return _path("BAGF_BUILD_DIR", value) if value else None


def tune_enabled() -> bool:
    return get_bool("BAGF_TUNE", True)


# The defaults bound a first call: a layer tuned in about 6 s of wall time (the time budget ends the search;
# the batch in flight and the finalists' re-timing follow it), with enough evaluations for every family that
# applies (up to ten on an H200: six strict fp32, four more in TF32 mode). 6 s rather than 25 or 7, measured on the H200
# (benchmarks/results/budgets_*_h200.md, each problem's plans re-timed beside the 25 s plans): one forward's
# convs kept 1.044 / 0.980 / 1.019 of the 25 s plans' speedup for AlexNet at N = 1 / 32 / 128 (74.8 s for its
# 15 problems), 0.995 for ResNet-18 at N = 32 (53.8 s, tune's split by share giving 2-6 s a problem; 62.6 s and
# 0.993 at 7 s on the same machine just before) and 0.990 for ResNet-50 (108.0 s).
DEFAULT_BUDGET = 80
DEFAULT_TIME_BUDGET = 6.0


def budget_evaluations() -> int:
    return get_int("BAGF_BUDGET", DEFAULT_BUDGET, minimum=1, maximum=1_000_000)


def budget_seconds() -> float:
    return get_float("BAGF_TIME_BUDGET", DEFAULT_TIME_BUDGET, minimum=1e-3, maximum=DAY_S)


STRATEGY_NAMES = ("ax", "random", "anneal", "genetic", "exhaustive")
"""The search strategies (``tuning.strategies.STRATEGIES``; named here so reading a setting imports no Ax)."""


def strategy() -> str:
    return get_choice("BAGF_STRATEGY", "ax", STRATEGY_NAMES)


def seed() -> int:
    return get_int("BAGF_SEED", 0, minimum=0)


MAX_DEFAULT_COMPILE_WORKERS = 16
"""The most NVRTC threads the default takes. Compiles are most of a first call's tuning (one NVRTC run of a
winograd_gemm configuration takes seconds of one core). A cap because a search batch holds at most 8 candidates
(every strategy's default) and a model's up-front wave of start points 19-25, so more threads would mostly
wait, while each running NVRTC holds memory. On the H200's 16-core host, ResNet-18's pre-tune at 7 s per
problem took 62.6 s with 16 threads and 63.6 s with 8 in another run: no gain end to end that the runs' spread
can show (``benchmarks/probes/compile_scaling.py`` times the pool itself)."""

CGROUP_ROOT = "/sys/fs/cgroup"
"""Where the cgroup hierarchy is mounted; ``/proc/self/cgroup`` names the process's own cgroup below it."""
PROC_SELF_CGROUP = "/proc/self/cgroup"


def _read_quota(directory: Path, v2: bool) -> int | None:
    """The CPUs one cgroup directory's quota allows (rounded up), None without one: cgroup v2's ``cpu.max``
    ("max 100000" or "<quota> <period>"), cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none)."""
    try:
        if v2:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            if quota == "max":
                return None
        else:
            quota, period = ((directory / name).read_text() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        q, p = int(quota), int(period)
    except (OSError, ValueError):  # no such file (no cgroup, another version, not Linux) or one we cannot read
        return None
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None


def _cgroup_cpu_quota() -> int | None:
    """The fewest CPUs that the CPU quota of the process's cgroup or of any cgroup above it allows, or None
    without a quota. Docker's ``--cpus``, Kubernetes' CPU limits and systemd's ``CPUQuota=`` set one, and leave the
    affinity mask at every host CPU. The process's cgroup is read from ``/proc/self/cgroup`` (cgroup v2's
    "0::<path>", v1's "<n>:...cpu...:<path>") below the hierarchy's mount (``CGROUP_ROOT``); inside a container
    whose cgroup namespace hides the path, that is the mount itself."""
    base = Path(CGROUP_ROOT)
    try:
        lines = Path(PROC_SELF_CGROUP).read_text().splitlines()
    except OSError:
        lines = []
    dirs: dict[tuple[Path, bool], None] = {}  # (directory, cgroup v2), each once, in order
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = [p for p in path.strip().split("/") if p]
        if controllers == "":  # cgroup v2
            mounts, v2 = [base], True
        elif "cpu" in controllers.split(","):  # cgroup v1's cpu controller
            mounts, v2 = [base / controllers, base / "cpu", base / "cpu,cpuacct"], False
        else:
            continue
        for mount in mounts:  # the cgroup and each one above it, below the mount
            dirs.update(((mount.joinpath(*rel[:i]), v2), None) for i in range(len(rel), 0, -1))
    dirs.update({(base, True): None, (base / "cpu", False): None, (base / "cpu,cpuacct", False): None})  # the mounts
    quotas = [q for q in (_read_quota(d, v2) for d, v2 in dirs) if q is not None]
    return min(quotas) if quotas else None


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity mask (``taskset``, a container's cpuset), not the host's
    count that ``os.cpu_count`` gives, and no more than its cgroup's CPU quota allows (``_cgroup_cpu_quota``)."""
    count = getattr(os, "process_cpu_count", None)  # Python 3.13+: the affinity mask's count
    if count is not None:
        cpus = count() or 1
    else:
        try:
            cpus = len(os.sched_getaffinity(0)) or 1
        except (AttributeError, OSError):  # no affinity call on this platform
            cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return min(cpus, quota) if quota is not None else cpus


def compile_workers() -> int:
    return get_int("BAGF_COMPILE_WORKERS", min(MAX_DEFAULT_COMPILE_WORKERS, usable_cpus()), minimum=1, maximum=1024)


def log_level() -> int:
    name = get_choice("BAGF_LOG", "warning", ("debug", "info", "warning", "error"))
    return getattr(logging, name.upper())


def print_tuning() -> bool:
    return get_bool("BAGF_PRINT_TUNING", False)


def background() -> bool:
    return get_bool("BAGF_BACKGROUND", False)


def claim_lease() -> float:
    return get_float("BAGF_CLAIM_LEASE", 30.0, minimum=0.05, maximum=DAY_S)


def claim_wait() -> float:
    """``BAGF_CLAIM_WAIT``: seconds a call waits for another process that is tuning the same problem before it
    runs torch's conv meanwhile (later calls take the winner once it is stored)."""
    return get_float("BAGF_CLAIM_WAIT", 60.0, minimum=0.0, maximum=DAY_S)


def cublaslt() -> bool:
    """``BAGF_CUBLASLT``: search the cuBLASLt plans of 1x1 convolutions (``kernels.cublaslt_1x1``; on by default)."""
    return get_bool("BAGF_CUBLASLT", True)


def isolate() -> bool:
    return get_bool("BAGF_ISOLATE", False)


def isolate_timeout() -> float:
    return get_float("BAGF_ISOLATE_TIMEOUT", 20.0, minimum=0.01, maximum=DAY_S)


def prune_factor() -> float:
    """``BAGF_PRUNE_FACTOR``: 0 (off) or a factor >= 1 for :func:`bagf_torch.iobound.prune`."""
    value = get_float("BAGF_PRUNE_FACTOR", 0.0, minimum=0.0, maximum=1e6)
    if 0 < value < 1:
        raise SettingError(f"BAGF_PRUNE_FACTOR={value} would prune every configuration, the best one too; use 0 "
                           "(off) or a factor >= 1 (4 kept every recorded optimum on the H200 tc recording)")
    return value

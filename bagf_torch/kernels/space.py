"""An explicit search space: ordered allowed values per knob plus validity rules, checked before compiling."""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

Config = dict[str, int]
"""One point of a space: knob name -> value."""

Rule = Callable[[Mapping[str, int]], "str | None"]
"""A validity rule: returns None for a valid configuration, or a sentence saying what is wrong."""


@dataclass(frozen=True)
class Space:
    """Knobs with their allowed values (in order) and the rules every configuration must satisfy.

    ``params`` maps each knob to its allowed values, smallest first (order matters to strategies that move
    to neighbouring values). ``rules`` are checked in order; the first failing one names the reason.

    >>> s = Space("demo", {"a": (1, 2, 4), "b": (1, 2)}, (lambda c: "too big" if c["a"] * c["b"] > 4 else None,))
    >>> s.invalid_reason({"a": 4, "b": 2})
    'too big'
    >>> len(s.valid_configs())
    5
    """

    family: str
    params: Mapping[str, tuple[int, ...]]
    rules: tuple[Rule, ...] = ()
    _valid: list[Config] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.params)

    @property
    def size(self) -> int:
        """Size of the raw Cartesian product (valid or not)."""
        return math.prod(len(v) for v in self.params.values())

    def invalid_reason(self, config: Mapping[str, int]) -> str | None:
        """None when ``config`` may be compiled and launched, else why not."""
        if set(config) != set(self.params):
            return f"knobs {sorted(config)} do not match the space's {sorted(self.params)}"
        for name, value in config.items():
            if value not in self.params[name]:
                return f"{name}={value} is not one of {list(self.params[name])}"
        for rule in self.rules:
            reason = rule(config)
            if reason is not None:
                return reason
        return None

    def is_valid(self, config: Mapping[str, int]) -> bool:
        return self.invalid_reason(config) is None

    def all_configs(self) -> Iterator[Config]:
        names = self.names
        for values in itertools.product(*(self.params[n] for n in names)):
            yield dict(zip(names, values))

    def valid_configs(self) -> list[Config]:
        """Every valid configuration, in a fixed order (computed once)."""
        if not self._valid:
            self._valid.extend(c for c in self.all_configs() if self.is_valid(c))
        return list(self._valid)

    def restrict(self, configs: "Iterable[Mapping[str, int]]", reason: str) -> "Space":
        """The same knobs and rules plus one more: a configuration must be one of ``configs`` (e.g. those
        bound-guided pruning kept); any other is invalid with ``reason``. Strategies see an ordinary Space.

        >>> s = Space("demo", {"a": (1, 2, 4)})
        >>> r = s.restrict([{"a": 2}, {"a": 4}], "pruned")
        >>> r.valid_configs(), r.invalid_reason({"a": 1})
        ([{'a': 2}, {'a': 4}], 'pruned')
        """
        allowed = frozenset(config_key(c) for c in configs)

        def member(c: Mapping[str, int]) -> str | None:
            return None if config_key(c) in allowed else reason

        return Space(self.family, self.params, tuple(self.rules) + (member,))


def config_key(config: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """A hashable, order-independent form of a configuration."""
    return tuple(sorted(config.items()))


# ------------------------------------------------------------------ rules every family shares
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
SM90_SMEM_PER_SM = 233472  # 228 KiB: what the resident blocks of one SM share
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32


def resident_blocks(threads: int, smem_bytes: int, registers: int) -> int:
    """Blocks one SM can hold at once (shared memory, registers, threads, the block limit), at least 1."""
    return max(1, min(SM90_SMEM_PER_SM // max(1, smem_bytes), REGISTERS_PER_SM // max(1, registers * threads),
                      MAX_THREADS_PER_SM // threads, MAX_BLOCKS_PER_SM))


def size_split(splits: Iterable[int], blocks: int, work: int, min_work: int, sms: int) -> int:
    """A start point's split of the reduction over grid.z: the smallest of ``splits`` (ascending) that gives
    at least 2 blocks per SM (``blocks`` unsplit), without going below ``min_work`` units of the reduction
    (``work`` in all) per slice; 1 when even the first split above 1 would."""
    chosen = 1
    for split in splits:
        if work / split < min_work:
            break
        chosen = split
        if blocks * split >= 2 * sms:
            break
    return chosen


def shared_memory_rule(smem_bytes: Callable[[Mapping[str, int]], int], limit: int) -> Rule:
    """A configuration's shared memory fits the device's opt-in per-block limit."""
    def shared_memory(c):
        need = smem_bytes(c)
        if need > limit:
            return f"needs {need} bytes of shared memory, device limit {limit}"
        return None
    return shared_memory


def register_rule(threads: Callable[[Mapping[str, int]], int],
                  estimated_registers: Callable[[Mapping[str, int]], int]) -> Rule:
    """The estimated registers per thread fit the per-thread and per-block limits (else it would spill)."""
    def registers(c):
        t, regs = threads(c), estimated_registers(c)
        if regs * t > REGISTERS_PER_SM or regs > MAX_REGISTERS_PER_THREAD:
            return (f"needs about {regs} registers per thread x {t} threads (limits: {REGISTERS_PER_SM} per "
                    f"block, {MAX_REGISTERS_PER_THREAD} per thread): it would spill to local memory")
        return None
    return registers


def thread_count_rule(threads: Callable[[Mapping[str, int]], int], minimum: int = 32) -> Rule:
    """Threads per block are a multiple of 32 (whole warps) in [``minimum``, 1024]."""
    def thread_count(c):
        t = threads(c)
        if t < minimum or t > 1024 or t % 32:
            return f"{t} threads per block; must be a multiple of 32 in [{minimum}, 1024]"
        return None
    return thread_count


def loader_rule(threads: Callable[[Mapping[str, int]], int]) -> Rule:
    """The input-tile loaders give each thread one fixed pixel column: threads must be a multiple of BN."""
    def loader(c):
        t = threads(c)
        if t % c["BN"]:
            return f"{t} threads is not a multiple of BN={c['BN']} (input-tile loader)"
        return None
    return loader


def template_expression(kernel: str, order: tuple[str, ...], c: Mapping[str, int]) -> str:
    """The C++ name NVRTC instantiates, e.g. ``bagf::implicit_gemm_conv2d<64, 64, 8, 4, 4, 1, 4>``.

    Every value must be an integer (numpy integers too; not bool, float or text): this string is compiled,
    and a configuration read from a cache or an import file must never put anything but numbers into it.

    >>> template_expression("k", ("A", "B"), {"A": 64, "B": 2})
    'k<64, 2>'
    >>> template_expression("k", ("A",), {"A": "1>(); evil<1"})
    Traceback (most recent call last):
    ...
    TypeError: knob A of k must be an integer, got '1>(); evil<1'
    """
    return f"{kernel}<{', '.join(str(_integer(kernel, k, c[k])) for k in order)}>"


def _integer(kernel: str, knob: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"knob {knob} of {kernel} must be an integer, got {value!r}")
    return int(value)

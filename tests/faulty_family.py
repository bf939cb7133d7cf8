"""A kernel "family" of deliberately faulty kernels (tests/faulty_kernels.cuh) for the fault-matrix GPU tests.

It has what KernelCompiler and the Tuner ask of a family (``bagf_torch.kernels.REQUIRED``) and is importable by module name, as the isolated worker needs.
MODE 0 is correct, 1 writes out of bounds (illegal address), 2 returns wrong numbers, 3 hangs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from bagf_torch.kernels.geometry import LaunchGeometry
from bagf_torch.kernels.space import Config, Space

FAMILY = "faulty_test"
SOURCE = str(Path(__file__).resolve().with_name("faulty_kernels.cuh"))  # absolute: not in the kernels folder
KERNEL = "bagf_test::faulty_conv2d"
MIN_ARCH = 50
CORRECT, OUT_OF_BOUNDS, WRONG, HANG = 0, 1, 2, 3
PARAMS = {"MODE": (CORRECT, OUT_OF_BOUNDS, WRONG, HANG), "BM": (16,), "BN": (16,)}
DEFAULT: Config = {"MODE": CORRECT, "BM": 16, "BN": 16}


def config(mode: int) -> Config:
    return dict(DEFAULT, MODE=mode)


def threads(c: Mapping[str, int]) -> int:
    return c["BM"] * c["BN"]


def smem_bytes(c: Mapping[str, int]) -> int:
    return 0


def launch(c: Mapping[str, int]) -> LaunchGeometry:
    return LaunchGeometry(bm=c["BM"], bn=c["BN"], threads=threads(c), smem=smem_bytes(c))


def name(c: Mapping[str, int], arch: str = "sm90") -> str:
    return f"{FAMILY}_mode{c['MODE']}_bm{c['BM']}_bn{c['BN']}_{arch}"


def name_expression(c: Mapping[str, int]) -> str:
    return f"{KERNEL}<{c['MODE']}, {c['BM']}, {c['BN']}>"


def space(smem_limit: int | None = None) -> Space:
    return Space(FAMILY, PARAMS)

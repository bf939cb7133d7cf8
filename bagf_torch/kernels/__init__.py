"""Kernel families: one module each with knobs, validity rules, default configuration and launch geometry."""

from . import implicit_gemm
from .space import Config, Space, config_key

FAMILIES = {implicit_gemm.FAMILY: implicit_gemm}

__all__ = ["Config", "FAMILIES", "Space", "config_key", "implicit_gemm"]

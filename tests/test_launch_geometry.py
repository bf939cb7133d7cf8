"""Each family hands the host exactly the launch values listed here, for a sample of its configurations.

``EXPECTED`` holds, for every family listed, its DEFAULT, ``random.Random(0).sample`` of 12 of
``space().valid_configs()`` (implicit_gemm_tma_h16 and implicit_gemm_tma_tf32: a few picked by hand, their NCHW,
split-K and stream-K ones among them),
and the configurations that set the rarer fields (winograd_gemm's GEMM kinds,
staging and layouts at MT = 5, TB = 128; direct's specialised geometries G = 1-4), each with the integers
the host's ``load_plan`` receives in its ``LaunchGeometry``, in ``FIELD_ORDER``. They are literals, computed
once from the families' launch rules (bm, bn, threads and smem always given; split and tile 1 and every other
field 0 unless a family sets them), so the comparison does not depend on the code under test. The tests below
check that the host receives those values: the compiler's one conversion (``LaunchGeometry.to_host``), and
csrc/bagf_ext.cpp's struct and pybind11 binding, read as text and compiled with the host C++ compiler.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from bagf_torch.kernels import FAMILIES
from bagf_torch.kernels.geometry import FIELDS, LaunchGeometry

EXPECTED: dict[str, list[tuple[dict[str, int], tuple[int, ...]]]] = {
    'implicit_gemm_tma_h16': [
        ({'DT': 1, 'NHWC': 1, 'WN': 128, 'MI': 1, 'WG': 2, 'STAGES': 5, 'SPLIT': 1, 'SK': 0, 'CR': 0, 'PP': 0},
         (128, 128, 384, 164864, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 1, 1, 0)),
        ({'DT': 0, 'NHWC': 0, 'WN': 128, 'MI': 1, 'WG': 2, 'STAGES': 4, 'SPLIT': 1, 'SK': 1, 'CR': 0, 'PP': 0},
         (128, 128, 384, 132096, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1)),
        ({'DT': 1, 'NHWC': 0, 'WN': 192, 'MI': 1, 'WG': 2, 'STAGES': 3, 'SPLIT': 1, 'SK': 0, 'CR': 0, 'PP': 0},
         (192, 128, 384, 123904, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 1, 0)),
        ({'DT': 0, 'NHWC': 1, 'WN': 64, 'MI': 1, 'WG': 1, 'STAGES': 3, 'SPLIT': 8, 'SK': 0, 'CR': 0, 'PP': 0},
         (64, 64, 256, 50176, 8, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0)),
        ({'DT': 1, 'NHWC': 1, 'WN': 256, 'MI': 1, 'WG': 2, 'STAGES': 3, 'SPLIT': 2, 'SK': 0, 'CR': 0, 'PP': 0},
         (256, 128, 384, 148480, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 1, 1, 0)),
    ],
    'implicit_gemm_tma_tf32': [
        ({'DT': 2, 'NHWC': 0, 'WN': 128, 'MI': 1, 'WG': 2, 'STAGES': 4, 'SPLIT': 1, 'SK': 0, 'CR': 0},
         (128, 128, 384, 132096, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0)),
        ({'DT': 2, 'NHWC': 1, 'WN': 192, 'MI': 1, 'WG': 2, 'STAGES': 4, 'SPLIT': 1, 'SK': 1, 'CR': 0},
         (192, 128, 384, 164864, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1)),
        ({'DT': 2, 'NHWC': 1, 'WN': 64, 'MI': 1, 'WG': 1, 'STAGES': 6, 'SPLIT': 4, 'SK': 0, 'CR': 0},
         (64, 64, 256, 99328, 4, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0)),
        ({'DT': 2, 'NHWC': 1, 'WN': 256, 'MI': 1, 'WG': 2, 'STAGES': 3, 'SPLIT': 1, 'SK': 0, 'CR': 0},
         (256, 128, 384, 148480, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0)),
    ],
    'implicit_gemm_tc': [
        ({'BM': 64, 'BN': 64, 'BK': 16, 'WM': 2, 'WN': 2, 'STAGES': 3, 'SPLIT': 1},
         (64, 64, 128, 29184, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 64, 'BK': 32, 'WM': 2, 'WN': 1, 'STAGES': 3, 'SPLIT': 32},
         (64, 64, 64, 55296, 32, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 128, 'BK': 8, 'WM': 2, 'WN': 4, 'STAGES': 4, 'SPLIT': 1},
         (64, 128, 256, 29696, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 32, 'BN': 32, 'BK': 16, 'WM': 2, 'WN': 1, 'STAGES': 2, 'SPLIT': 8},
         (32, 32, 64, 10240, 8, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 32, 'BK': 16, 'WM': 4, 'WN': 2, 'STAGES': 4, 'SPLIT': 16},
         (64, 32, 256, 30720, 16, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 128, 'BN': 32, 'BK': 8, 'WM': 4, 'WN': 2, 'STAGES': 3, 'SPLIT': 1},
         (128, 32, 256, 22272, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 128, 'BN': 32, 'BK': 8, 'WM': 1, 'WN': 2, 'STAGES': 3, 'SPLIT': 16},
         (128, 32, 64, 22272, 16, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 64, 'BK': 32, 'WM': 4, 'WN': 4, 'STAGES': 2, 'SPLIT': 4},
         (64, 64, 512, 36864, 4, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 64, 'BK': 8, 'WM': 1, 'WN': 2, 'STAGES': 2, 'SPLIT': 1},
         (64, 64, 64, 10752, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 128, 'BK': 32, 'WM': 4, 'WN': 2, 'STAGES': 3, 'SPLIT': 4},
         (64, 128, 256, 79872, 4, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 64, 'BK': 16, 'WM': 2, 'WN': 4, 'STAGES': 3, 'SPLIT': 4},
         (64, 64, 256, 29184, 4, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 128, 'BN': 32, 'BK': 32, 'WM': 4, 'WN': 2, 'STAGES': 4, 'SPLIT': 2},
         (128, 32, 256, 94208, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 32, 'BK': 8, 'WM': 4, 'WN': 2, 'STAGES': 4, 'SPLIT': 1},
         (64, 32, 256, 17408, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ],
    'winograd_tc': [
        ({'MT': 4, 'BK': 32, 'BT': 16, 'BC': 8, 'WK': 2, 'WT': 1, 'WE': 4, 'DB': 0, 'SPLIT': 1},
         (32, 16, 256, 78336, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 32, 'BC': 8, 'WK': 1, 'WT': 4, 'WE': 2, 'DB': 0, 'SPLIT': 8},
         (32, 32, 256, 40960, 8, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 4, 'BK': 16, 'BT': 32, 'BC': 16, 'WK': 1, 'WT': 2, 'WE': 4, 'DB': 0, 'SPLIT': 4},
         (16, 32, 256, 147456, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 32, 'BC': 16, 'WK': 1, 'WT': 1, 'WE': 8, 'DB': 0, 'SPLIT': 2},
         (32, 32, 256, 81920, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 16, 'BT': 16, 'BC': 16, 'WK': 1, 'WT': 1, 'WE': 2, 'DB': 0, 'SPLIT': 4},
         (16, 16, 64, 49152, 4, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 16, 'BC': 8, 'WK': 1, 'WT': 2, 'WE': 8, 'DB': 0, 'SPLIT': 1},
         (32, 16, 512, 32768, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 64, 'BT': 16, 'BC': 8, 'WK': 1, 'WT': 1, 'WE': 4, 'DB': 0, 'SPLIT': 4},
         (64, 16, 128, 69632, 4, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 64, 'BC': 8, 'WK': 2, 'WT': 2, 'WE': 2, 'DB': 0, 'SPLIT': 1},
         (32, 64, 256, 67584, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 32, 'BC': 8, 'WK': 2, 'WT': 2, 'WE': 2, 'DB': 0, 'SPLIT': 16},
         (32, 32, 256, 40960, 16, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 4, 'BK': 32, 'BT': 16, 'BC': 16, 'WK': 2, 'WT': 2, 'WE': 3, 'DB': 0, 'SPLIT': 16},
         (32, 16, 384, 147456, 16, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 16, 'BC': 16, 'WK': 1, 'WT': 1, 'WE': 8, 'DB': 0, 'SPLIT': 2},
         (32, 16, 256, 65536, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 64, 'BC': 8, 'WK': 1, 'WT': 2, 'WE': 4, 'DB': 0, 'SPLIT': 2},
         (32, 64, 256, 67584, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ],
    'winograd': [
        ({'MT': 2, 'BK': 32, 'BT': 32, 'BC': 8, 'TK': 4, 'TT': 4, 'EG': 4, 'DB': 0, 'SPLIT': 1},
         (32, 32, 256, 36864, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 32, 'BC': 4, 'TK': 4, 'TT': 2, 'EG': 2, 'DB': 0, 'SPLIT': 1},
         (32, 32, 256, 18432, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 4, 'BK': 32, 'BT': 16, 'BC': 4, 'TK': 4, 'TT': 8, 'EG': 18, 'DB': 1, 'SPLIT': 16},
         (32, 16, 288, 41472, 16, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 32, 'BC': 8, 'TK': 4, 'TT': 8, 'EG': 8, 'DB': 0, 'SPLIT': 1},
         (32, 32, 256, 36864, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 16, 'BT': 16, 'BC': 8, 'TK': 2, 'TT': 4, 'EG': 16, 'DB': 0, 'SPLIT': 2},
         (16, 16, 512, 20480, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 16, 'BT': 64, 'BC': 16, 'TK': 4, 'TT': 2, 'EG': 4, 'DB': 0, 'SPLIT': 2},
         (16, 64, 512, 90112, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 64, 'BT': 16, 'BC': 8, 'TK': 2, 'TT': 4, 'EG': 4, 'DB': 0, 'SPLIT': 8},
         (64, 16, 512, 45056, 8, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 64, 'BT': 16, 'BC': 4, 'TK': 2, 'TT': 8, 'EG': 4, 'DB': 1, 'SPLIT': 1},
         (64, 16, 256, 36864, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 32, 'BC': 8, 'TK': 2, 'TT': 2, 'EG': 2, 'DB': 1, 'SPLIT': 4},
         (32, 32, 512, 36864, 4, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 4, 'BK': 32, 'BT': 16, 'BC': 8, 'TK': 8, 'TT': 4, 'EG': 18, 'DB': 0, 'SPLIT': 1},
         (32, 16, 288, 64512, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 16, 'BC': 4, 'TK': 8, 'TT': 4, 'EG': 4, 'DB': 0, 'SPLIT': 16},
         (32, 16, 64, 14336, 16, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 64, 'BC': 16, 'TK': 8, 'TT': 2, 'EG': 2, 'DB': 0, 'SPLIT': 16},
         (32, 64, 256, 106496, 16, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 2, 'BK': 32, 'BT': 16, 'BC': 16, 'TK': 4, 'TT': 2, 'EG': 8, 'DB': 1, 'SPLIT': 8},
         (32, 16, 512, 57344, 8, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ],
    'winograd_gemm': [
        ({'MT': 4, 'TB': 256, 'VL': 0, 'ML': 0, 'GE': 1, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 256, 256, 0, 1, 4, 0, 0, 0, 1, 0, 0, 0, 64, 64, 128, 75776, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 1, 'ML': 0, 'GE': 0, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 256, 'VL': 0, 'ML': 0, 'GE': 7, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 256, 256, 0, 1, 5, 0, 0, 0, 1, 12, 0, 0, 64, 64, 128, 102400, 0, 0, 0, 0)),
        ({'MT': 2, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 0, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 4, 'TB': 256, 'VL': 0, 'ML': 0, 'GE': 6, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 256, 256, 0, 1, 4, 0, 0, 0, 1, 4, 0, 0, 128, 128, 256, 200704, 0, 0, 0, 0)),
        ({'MT': 6, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 5, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 6, 0, 0, 0, 1, 0, 0, 0, 128, 128, 256, 112128, 0, 0, 0, 0)),
        ({'MT': 6, 'TB': 64, 'VL': 1, 'ML': 0, 'GE': 0, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 64, 64, 0, 1, 6, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 256, 'VL': 0, 'ML': 0, 'GE': 3, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 256, 256, 0, 1, 5, 0, 0, 0, 1, 8, 0, 0, 128, 64, 128, 87552, 0, 0, 0, 0)),
        ({'MT': 4, 'TB': 512, 'VL': 0, 'ML': 0, 'GE': 7, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 512, 512, 0, 1, 4, 0, 0, 0, 1, 12, 0, 0, 64, 64, 128, 102400, 0, 0, 0, 0)),
        ({'MT': 6, 'TB': 64, 'VL': 0, 'ML': 0, 'GE': 6, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 64, 64, 0, 1, 6, 0, 0, 0, 1, 12, 0, 0, 128, 128, 256, 200704, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 1, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 8, 0, 0, 64, 64, 128, 75776, 0, 0, 0, 0)),
        ({'MT': 4, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 5, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 4, 0, 0, 0, 1, 8, 0, 0, 128, 128, 256, 112128, 0, 0, 0, 0)),
        ({'MT': 6, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 3, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 6, 0, 0, 0, 1, 8, 0, 0, 128, 64, 128, 87552, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 0, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 0, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 1, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 0, 0, 0, 64, 64, 128, 75776, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 2, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 0, 0, 0, 64, 128, 128, 54272, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 2, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 8, 0, 0, 64, 128, 128, 54272, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 3, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 0, 0, 0, 128, 64, 128, 87552, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 3, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 8, 0, 0, 128, 64, 128, 87552, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 4, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 0, 0, 0, 64, 128, 128, 108544, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 4, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 8, 0, 0, 64, 128, 128, 108544, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 5, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 0, 0, 0, 128, 128, 256, 112128, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 5, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 8, 0, 0, 128, 128, 256, 112128, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 6, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 4, 0, 0, 128, 128, 256, 200704, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 6, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 12, 0, 0, 128, 128, 256, 200704, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 7, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 4, 0, 0, 64, 64, 128, 102400, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 0, 'GE': 7, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 12, 0, 0, 64, 64, 128, 102400, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 0, 'ML': 1, 'GE': 0, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 1, 'ML': 0, 'GE': 0, 'SO': 1, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'MT': 5, 'TB': 128, 'VL': 1, 'ML': 1, 'GE': 0, 'SO': 0, 'DT': 0, 'NHWC': 0},
         (1, 128, 128, 0, 1, 5, 0, 0, 0, 1, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ],
    'implicit_gemm_h16': [
        ({'DT': 1, 'NHWC': 1, 'BM': 128, 'BN': 64, 'BK': 32, 'WM': 2, 'WN': 2, 'ST': 2, 'SPLIT': 1},
         (128, 64, 128, 30720, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 1, 0, 0)),
        ({'DT': 0, 'NHWC': 0, 'BM': 64, 'BN': 64, 'BK': 16, 'WM': 2, 'WN': 2, 'ST': 2, 'SPLIT': 1},
         (64, 64, 128, 12288, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0)),
        ({'DT': 1, 'NHWC': 0, 'BM': 32, 'BN': 128, 'BK': 64, 'WM': 1, 'WN': 4, 'ST': 2, 'SPLIT': 1},
         (32, 128, 128, 46080, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0)),
        ({'DT': 1, 'NHWC': 1, 'BM': 64, 'BN': 64, 'BK': 32, 'WM': 2, 'WN': 2, 'ST': 2, 'SPLIT': 8},
         (64, 64, 128, 20480, 8, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 1, 0, 0)),
        # the cp.async pipeline: ST stages of shared memory, ST * 2 * (BM + BN) * (BK + 8) bytes
        ({'DT': 1, 'NHWC': 1, 'BM': 128, 'BN': 64, 'BK': 32, 'WM': 2, 'WN': 2, 'ST': 3, 'SPLIT': 1},
         (128, 64, 128, 46080, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 1, 0, 0)),
        ({'DT': 0, 'NHWC': 1, 'BM': 64, 'BN': 64, 'BK': 32, 'WM': 2, 'WN': 2, 'ST': 4, 'SPLIT': 8},
         (64, 64, 128, 40960, 8, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0)),
    ],
    'implicit_gemm': [
        ({'BM': 64, 'BN': 64, 'BK': 8, 'TM': 4, 'TN': 4, 'DB': 1, 'VEC': 4},
         (64, 64, 256, 8256, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 128, 'BN': 64, 'BK': 32, 'TM': 8, 'TN': 2, 'DB': 1, 'VEC': 1},
         (128, 64, 512, 49408, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 32, 'BN': 64, 'BK': 32, 'TM': 4, 'TN': 2, 'DB': 0, 'VEC': 4},
         (32, 64, 256, 12416, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 128, 'BN': 32, 'BK': 4, 'TM': 1, 'TN': 8, 'DB': 0, 'VEC': 1},
         (128, 32, 512, 2576, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 32, 'BN': 128, 'BK': 16, 'TM': 4, 'TN': 2, 'DB': 1, 'VEC': 1},
         (32, 128, 512, 20608, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 16, 'BN': 32, 'BK': 4, 'TM': 1, 'TN': 2, 'DB': 0, 'VEC': 4},
         (16, 32, 256, 784, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 32, 'BN': 16, 'BK': 16, 'TM': 2, 'TN': 8, 'DB': 0, 'VEC': 1},
         (32, 16, 32, 3136, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 16, 'BK': 16, 'TM': 4, 'TN': 2, 'DB': 1, 'VEC': 1},
         (64, 16, 128, 10368, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 64, 'BN': 16, 'BK': 4, 'TM': 8, 'TN': 2, 'DB': 1, 'VEC': 1},
         (64, 16, 64, 2592, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 32, 'BN': 128, 'BK': 8, 'TM': 2, 'TN': 2, 'DB': 1, 'VEC': 1},
         (32, 128, 1024, 10304, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 128, 'BN': 32, 'BK': 16, 'TM': 1, 'TN': 8, 'DB': 1, 'VEC': 1},
         (128, 32, 512, 20608, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 128, 'BN': 64, 'BK': 16, 'TM': 2, 'TN': 8, 'DB': 1, 'VEC': 4},
         (128, 64, 512, 24704, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'BM': 32, 'BN': 32, 'BK': 8, 'TM': 4, 'TN': 8, 'DB': 1, 'VEC': 1},
         (32, 32, 32, 4160, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ],
    'direct': [
        ({'TH': 8, 'TW': 16, 'BK': 64, 'BC': 1, 'TK': 8, 'PX': 4, 'DB': 1, 'SPLIT': 1, 'G': 0},
         (64, 1, 256, 87976, 1, 8, 16, 8, 544, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 16, 'TW': 8, 'BK': 64, 'BC': 4, 'TK': 4, 'PX': 8, 'DB': 0, 'SPLIT': 8, 'G': 0},
         (64, 1, 256, 175952, 8, 16, 8, 16, 1088, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 8, 'TW': 4, 'BK': 64, 'BC': 1, 'TK': 4, 'PX': 4, 'DB': 1, 'SPLIT': 4, 'G': 1},
         (64, 1, 128, 73000, 4, 8, 4, 8, 544, 0, 0, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 16, 'TW': 8, 'BK': 16, 'BC': 2, 'TK': 8, 'PX': 2, 'DB': 1, 'SPLIT': 8, 'G': 3},
         (16, 1, 128, 83024, 8, 16, 8, 16, 320, 0, 0, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 16, 'TW': 16, 'BK': 32, 'BC': 1, 'TK': 8, 'PX': 8, 'DB': 1, 'SPLIT': 2, 'G': 0},
         (32, 1, 128, 75176, 2, 16, 16, 8, 288, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 8, 'TW': 8, 'BK': 32, 'BC': 1, 'TK': 4, 'PX': 4, 'DB': 1, 'SPLIT': 4, 'G': 0},
         (32, 1, 128, 47016, 4, 8, 8, 8, 288, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 2, 'TW': 16, 'BK': 64, 'BC': 2, 'TK': 4, 'PX': 4, 'DB': 1, 'SPLIT': 1, 'G': 3},
         (64, 1, 128, 148688, 1, 2, 16, 16, 1088, 0, 0, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 4, 'TW': 16, 'BK': 64, 'BC': 2, 'TK': 8, 'PX': 2, 'DB': 1, 'SPLIT': 1, 'G': 2},
         (64, 1, 256, 157776, 1, 4, 16, 16, 1088, 0, 0, 7, 2, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 16, 'TW': 32, 'BK': 16, 'BC': 4, 'TK': 8, 'PX': 2, 'DB': 0, 'SPLIT': 8, 'G': 3},
         (16, 1, 512, 192080, 8, 16, 32, 16, 320, 0, 0, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 8, 'TW': 16, 'BK': 16, 'BC': 4, 'TK': 8, 'PX': 4, 'DB': 0, 'SPLIT': 8, 'G': 1},
         (16, 1, 64, 83024, 8, 8, 16, 16, 320, 0, 0, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 8, 'TW': 16, 'BK': 16, 'BC': 1, 'TK': 4, 'PX': 8, 'DB': 0, 'SPLIT': 1, 'G': 1},
         (16, 1, 64, 20756, 1, 8, 16, 4, 80, 0, 0, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 8, 'TW': 8, 'BK': 16, 'BC': 1, 'TK': 8, 'PX': 2, 'DB': 0, 'SPLIT': 4, 'G': 4},
         (16, 1, 64, 15764, 4, 8, 8, 4, 80, 0, 0, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 16, 'TW': 16, 'BK': 64, 'BC': 1, 'TK': 8, 'PX': 8, 'DB': 0, 'SPLIT': 1, 'G': 0},
         (64, 1, 256, 53076, 1, 16, 16, 4, 272, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 8, 'TW': 16, 'BK': 64, 'BC': 1, 'TK': 8, 'PX': 4, 'DB': 1, 'SPLIT': 1, 'G': 1},
         (64, 1, 256, 87976, 1, 8, 16, 8, 544, 0, 0, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 8, 'TW': 16, 'BK': 64, 'BC': 1, 'TK': 8, 'PX': 4, 'DB': 1, 'SPLIT': 1, 'G': 2},
         (64, 1, 256, 87976, 1, 8, 16, 8, 544, 0, 0, 7, 2, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 8, 'TW': 16, 'BK': 64, 'BC': 1, 'TK': 8, 'PX': 4, 'DB': 1, 'SPLIT': 1, 'G': 3},
         (64, 1, 256, 87976, 1, 8, 16, 8, 544, 0, 0, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0)),
        ({'TH': 8, 'TW': 16, 'BK': 64, 'BC': 1, 'TK': 8, 'PX': 4, 'DB': 1, 'SPLIT': 1, 'G': 4},
         (64, 1, 256, 87976, 1, 8, 16, 8, 544, 0, 0, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0)),
    ],
}
"""Family -> [(configuration, the values load_plan received in that order)]."""


FIELD_ORDER = ("bm", "bn", "threads", "smem", "split", "tile", "tile_w", "smem_patch", "smem_taps", "gemm", "layout",
             "fix_s", "fix_u", "gemm_bm", "gemm_bn", "gemm_threads", "gemm_smem", "dtype", "nhwc", "tma", "stream_k",
             "blas", "blas_algo", "blas_ws", "split_cluster", "tf32", "polyphase")
"""The LaunchGeometry fields in the host's order: the tuples above hold the first ``len(RECORDED)``; the fields after
them belong to plan kinds the recorded families do not use (at their defaults there)."""

RECORDED = FIELD_ORDER[:21]

EXT_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "bagf_ext.cpp"


def _host_values(fam, config) -> tuple[int, ...]:
    """What the host receives for ``config``, in RECORDED order (the later fields at their defaults, but ``tf32``:
    1 in a family of TF32 products, test_tf32_marks_exactly_the_plans_of_tf32_products)."""
    geo = fam.launch(config)
    assert isinstance(geo, LaunchGeometry)
    defaults = dict(LaunchGeometry().as_dict(), tf32=int(getattr(fam, "TF32_PRODUCTS", False)))
    assert all(getattr(geo, name) == defaults[name] for name in FIELD_ORDER[len(RECORDED):]), geo
    return tuple(getattr(geo, name) for name in RECORDED)


def test_the_recording_covers_the_families_it_was_taken_from():
    """The nine families listed are all registered (a family added later has no entry here)."""
    assert set(EXPECTED) == {"implicit_gemm", "implicit_gemm_tc", "winograd", "winograd_tc", "winograd_gemm", "direct",
                             "implicit_gemm_h16", "implicit_gemm_tma_h16", "implicit_gemm_tma_tf32"}
    assert set(EXPECTED) <= set(FAMILIES)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_launch_geometry_is_unchanged(family):
    """DEFAULT first, then the sample: each still valid, each with the host values it had."""
    fam = FAMILIES[family]
    rows = EXPECTED[family]
    assert rows[0][0] == fam.DEFAULT
    space = fam.space()
    for config, want in rows:
        assert space.invalid_reason(config) is None, config
        assert _host_values(fam, config) == want, config


@pytest.mark.parametrize("family", ["implicit_gemm_tma_h16", "implicit_gemm_tma_tf32"])
def test_split_k_in_clusters_changes_only_split_cluster(family):
    """A TMA configuration with CR = 1 (split-K in clusters) hands the host its CR = 0 twin's values with
    split_cluster = 1; the space admits it only with SPLIT 2-8, without stream-K, and where the ring holds the tile's
    fp32 sums."""
    fam = FAMILIES[family]
    space = fam.space()
    clustered = [c for c in space.valid_configs() if c["CR"]]
    assert clustered and {c["SPLIT"] for c in clustered} == {2, 4, 8} and not any(c["SK"] for c in clustered)
    for c in clustered:
        geo = fam.launch(c)
        assert geo == dataclasses.replace(fam.launch(dict(c, CR=0)), split_cluster=1), c
        assert 4 * geo.bm * geo.bn <= geo.smem - 1024, c
    base = dict(EXPECTED[family][0][0], WN=64, MI=1, WG=1, STAGES=4, SPLIT=4)
    assert space.invalid_reason(dict(base, CR=1)) is None
    for bad in (dict(base, CR=1, SPLIT=1), dict(base, CR=1, SPLIT=16), dict(base, CR=1, SPLIT=1, SK=1)):
        assert space.invalid_reason(bad) is not None, bad


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tf32_marks_exactly_the_plans_of_tf32_products(family):
    """``tf32`` = 1 in every configuration of a family of TF32 products (cublaslt_1x1: those with TF = 1), 0 in every
    other: the op sends a call made with cuDNN's TF32 off to ATen by it, so a graph compiled in TF32 mode never
    serves strict-fp32 calls with TF32 products, and never sends a strict plan's call to ATen."""
    fam = FAMILIES[family]
    configs = list(fam.space().valid_configs())
    configs = configs[:: max(1, len(configs) // 200)]
    for c in configs:
        want = int(getattr(fam, "TF32_PRODUCTS", False) and c.get("TF", 1) == 1)
        assert fam.launch(c).tf32 == want, (family, c)


def test_launch_geometry_fields_defaults_and_types():
    """The fields are the host's, in their order, with the host's defaults; ints only."""
    assert FIELDS == FIELD_ORDER
    assert LaunchGeometry().as_dict() == {**dict.fromkeys(FIELD_ORDER, 0), "split": 1, "tile": 1}
    geo = LaunchGeometry(bm=np.int64(64), bn=32)
    assert type(geo.bm) is int and geo.bm == 64
    with pytest.raises(TypeError):
        LaunchGeometry(bm=64.0)
    with pytest.raises(TypeError):
        LaunchGeometry(64, 32)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        geo.bm = 1


class _FakeExt:
    """The extension's two names KernelCompiler._load uses, recording what load_plan received."""

    class LaunchGeometry:
        def __init__(self, **kw):
            self.kw = kw

    def __init__(self):
        self.calls = []

    def load_plan(self, *args):
        self.calls.append(args)
        return {"handle": 7, "registers": 32, "local_bytes": 0}


def test_the_compiler_hands_load_plan_the_geometry_whole():
    """``KernelCompiler._load`` converts the family's LaunchGeometry once (``to_host``) and passes it as
    load_plan's fourth argument."""
    from bagf_torch.jit.compiler import KernelCompiler, KernelSpec, Loaded
    from bagf_torch.kernels import winograd_gemm as wgg

    compiler = object.__new__(KernelCompiler)  # no device: only what _load reads
    compiler.ext, compiler.device = _FakeExt(), 0
    spec = KernelSpec(wgg, dict(wgg.DEFAULT), "sm_90")
    got = compiler._load(spec, b"cubin", "lowered", 0.0)
    assert isinstance(got, Loaded) and got.handle == 7
    (cubin, lowered, device, geometry), = compiler.ext.calls
    assert (cubin, lowered, device) == (b"cubin", "lowered", 0)
    assert isinstance(geometry, _FakeExt.LaunchGeometry) and geometry.kw == wgg.launch(wgg.DEFAULT).as_dict()


def _cpp_struct_fields(src: str) -> dict[str, int]:
    body = re.search(r"struct LaunchGeometry \{(.*?)\n\};", src, re.S).group(1)
    return {m[0]: int(m[1]) for m in re.findall(r"^\s*int (\w+) = (-?\d+);", body, re.M)}


def test_the_host_struct_and_its_binding_match_the_dataclass():
    """csrc/bagf_ext.cpp's LaunchGeometry has the dataclass's fields and defaults, its Python constructor takes
    each by keyword with that default, every field is readable, and load_plan takes (cubin, lowered_name, device,
    geometry). Static: no compiler needed."""
    src = EXT_SOURCE.read_text()
    code = "\n".join(line.split("//", 1)[0] for line in src.splitlines())
    assert _cpp_struct_fields(src) == LaunchGeometry().as_dict()
    block = code[code.index("py::class_<LaunchGeometry>"):code.index('m.def("load_plan"')]
    kwargs = dict(re.findall(r'py::arg\("(\w+)"\) = (-?\d+)', block))
    assert {k: int(v) for k, v in kwargs.items()} == LaunchGeometry().as_dict()
    assert list(kwargs) == list(FIELDS) and "py::kw_only()" in block
    assert re.findall(r'def_readwrite\("(\w+)", &LaunchGeometry::(\w+)\)', block) == [(f, f) for f in FIELDS]
    init_args = re.search(r"py::init\(\[\]\((.*?)\)", block, re.S).group(1)
    assert re.findall(r"int (\w+)", init_args) == list(FIELDS)
    load = code[code.index('m.def("load_plan"'):]
    load = load[:load.index(";")]
    assert re.findall(r'py::arg\("(\w+)"\)', load) == ["cubin", "lowered_name", "device", "geometry"]
    assert re.search(r"py::dict load_plan\(py::bytes \w+, const std::string& \w+, int device, "
                     r"const LaunchGeometry& geo\)", code)


def _build_binding(tmp_path):
    """The extension's LaunchGeometry struct and binding, cut from csrc/bagf_ext.cpp as they are, in a small
    module with a function that returns what the host struct holds; None when no C++ compiler, Python headers or
    pybind11 headers are here."""
    from torch.utils import cpp_extension

    cxx = shutil.which("c++") or shutil.which("g++")
    py_include = sysconfig.get_paths()["include"]
    includes = cpp_extension.include_paths()
    if not cxx or not Path(py_include, "Python.h").is_file() or not any(
            Path(p, "pybind11", "pybind11.h").is_file() for p in includes):
        return None
    src = EXT_SOURCE.read_text()
    struct = re.search(r"struct LaunchGeometry \{.*?\n\};", src, re.S).group(0)
    binding = re.search(r"  py::class_<LaunchGeometry>.*?&LaunchGeometry::\w+\);\n", src, re.S).group(0)
    fields = ", ".join(f"g.{f}" for f in FIELDS)
    (tmp_path / "geo_binding.cpp").write_text(f"""#include <pybind11/pybind11.h>
namespace py = pybind11;
namespace {{
{struct}
py::tuple held(const LaunchGeometry& g) {{ return py::make_tuple({fields}); }}
}}  // namespace
PYBIND11_MODULE(geo_binding, m) {{
{binding}  m.def("held", &held, py::arg("geometry"));
}}
""")
    out = tmp_path / f"geo_binding{sysconfig.get_config_var('EXT_SUFFIX')}"
    res = subprocess.run([cxx, "-std=c++17", "-O0", "-shared", "-fPIC", *(f"-I{p}" for p in includes),
                          f"-I{py_include}", str(tmp_path / "geo_binding.cpp"), "-o", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    spec = importlib.util.spec_from_file_location("geo_binding", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_host_binding_receives_every_family_geometry_unchanged(tmp_path):
    """Compiled with the host C++ compiler: ``to_host`` builds the host struct, which holds exactly the
    dataclass's values, for every recorded configuration; the binding's defaults are the dataclass's; it refuses
    positional and unknown arguments."""
    ext = _build_binding(tmp_path)
    if ext is None:
        pytest.skip("no C++ compiler, Python headers or pybind11 headers here")
    for family, rows in EXPECTED.items():
        for config, want in rows:
            geo = FAMILIES[family].launch(config)
            held = ext.held(geo.to_host(ext))
            assert held == tuple(geo.as_dict().values()) and held[:len(RECORDED)] == want, (family, config)
    for family in ("implicit_gemm_tma_h16", "implicit_gemm_tma_tf32"):  # split_cluster: split-K in clusters
        config = dict(EXPECTED[family][-1 if family == "implicit_gemm_tma_h16" else 2][0], CR=1)
        geo = FAMILIES[family].launch(config)
        assert geo.split_cluster == 1 and ext.held(geo.to_host(ext)) == tuple(geo.as_dict().values()), config
    config = dict(EXPECTED["implicit_gemm_tma_h16"][0][0], PP=1)  # polyphase: a polyphase plan
    geo = FAMILIES["implicit_gemm_tma_h16"].launch(config)
    assert geo.polyphase == 1 and ext.held(geo.to_host(ext)) == tuple(geo.as_dict().values()), config
    lt = FAMILIES["cublaslt_1x1"]  # the fields after RECORDED: a cuBLASLt plan's
    for config in (lt.DEFAULT, dict(lt.DEFAULT, TF=1, ALG=7, WS=0), dict(lt.DEFAULT, DT=2, NHWC=1, ALG=3)):
        geo = lt.launch(config)
        assert ext.held(geo.to_host(ext)) == tuple(geo.as_dict().values()), config
    host = ext.LaunchGeometry()
    assert ext.held(host) == tuple(LaunchGeometry().as_dict().values())
    assert {f: getattr(host, f) for f in FIELDS} == LaunchGeometry().as_dict()
    with pytest.raises(TypeError):
        ext.LaunchGeometry(1, 2)
    with pytest.raises(TypeError):
        ext.LaunchGeometry(bx=1)


class _DictCache:
    """The two cubin methods of the cache KernelCompiler uses, in a dict."""

    def __init__(self):
        self.cubins = {}

    def get_cubin(self, digest):
        return self.cubins.get(digest)

    def put_cubin(self, digest, name, lowered, cubin):
        self.cubins[digest] = (cubin, lowered)


class _CompilingExt(_FakeExt):
    """_FakeExt with an NVRTC that always succeeds, recording the name expressions it compiled."""

    def __init__(self):
        super().__init__()
        self.compiled = []

    def nvrtc_compile(self, source, name_expression, options):
        self.compiled.append(name_expression)
        return True, b"cubin", "lowered", ""


def _bare_compiler(ext):
    """A KernelCompiler on ``ext`` and a _DictCache, no device (4 workers, sm_90)."""
    from bagf_torch.jit.compiler import KernelCompiler

    compiler = object.__new__(KernelCompiler)
    compiler.ext, compiler.device, compiler.cache, compiler.arch = ext, 0, _DictCache(), "sm_90"
    compiler.workers, compiler.source_hash, compiler.nvrtc_version, compiler._failures = 4, "src", "13.0", {}
    compiler._start_pool()
    return compiler


def test_configurations_that_differ_only_in_a_launch_parameter_share_one_compile_and_load_apart():
    """implicit_gemm_h16's SPLIT is grid.z, not a template parameter: a batch holding the same tile at several
    SPLIT values compiles one cubin (one digest) and loads one plan per configuration, each with its own split."""
    from bagf_torch.kernels import implicit_gemm_h16 as h16

    compiler = _bare_compiler(_CompilingExt())
    configs = [dict(h16.DEFAULT, SPLIT=s) for s in (1, 2, 8)] + [dict(h16.DEFAULT, BK=64, SPLIT=4)]
    got = compiler.compile(h16, configs)
    assert sorted(compiler.ext.compiled) == sorted({h16.name_expression(c) for c in configs})  # 2 compiles
    assert len(compiler.ext.compiled) == 2 and len(compiler.ext.calls) == 4
    assert [call[3].kw["split"] for call in compiler.ext.calls] == [1, 2, 8, 4]
    assert [g.spec.config["SPLIT"] for g in got] == [1, 2, 8, 4]
    # one NVRTC run is one compile for the tuner's estimate of a compile's cost: its seconds go to one config
    from bagf_torch.tuning.tuner import _compiles

    assert [g.compile_seconds > 0 for g in got] == [True, False, False, True] and _compiles(got) == 2
    compiler.prefetch([(h16, dict(h16.DEFAULT, SPLIT=16))])  # the cubin is cached: no compile
    assert len(compiler.ext.compiled) == 2


def test_a_compile_the_caller_stops_waiting_for_finishes_into_the_cache_and_is_joined_not_repeated():
    """``compile_within``: a cubin not ready within the seconds given is None (not loaded), while the ready ones load;
    the compile goes on, a second request for it meanwhile waits for that same NVRTC run, and once it is done the
    cubin is in the cache: NVRTC ran once for it in all."""
    import threading

    from bagf_torch.kernels import implicit_gemm_h16 as h16

    release = threading.Event()
    slow, fast = dict(h16.DEFAULT, BK=64), dict(h16.DEFAULT)

    class Ext(_CompilingExt):
        def nvrtc_compile(self, source, name_expression, options):
            done = super().nvrtc_compile(source, name_expression, options)  # (recorded as it starts)
            if name_expression == h16.name_expression(slow):
                assert release.wait(10), "the test never released the slow compile"
            return done

    compiler = _bare_compiler(Ext())
    try:
        got = compiler.compile_within(h16, [slow, fast], 0.3)
        assert got[0] is None and got[1].compile_seconds > 0 and len(compiler.ext.calls) == 1  # only fast loaded
        assert compiler.compile_within(h16, [slow], 0.05) == [None]
        assert compiler.ext.compiled.count(h16.name_expression(slow)) == 1  # joined, not started again
    finally:
        release.set()
    again = compiler.compile(h16, [slow])[0]
    assert again.spec.config == slow and compiler.ext.compiled.count(h16.name_expression(slow)) == 1
    assert compiler.digest(h16, slow) in compiler.cache.cubins


def test_a_cached_cubin_never_waits_behind_compiles_in_the_pool():
    """With every worker busy on a compile nobody waits for any more, a configuration whose cubin is in the cache
    loads at once (read on the calling thread), and a compile still queued when its caller stops waiting is
    dropped, not run later."""
    import threading
    import time

    from bagf_torch.kernels import implicit_gemm_h16 as h16

    release = threading.Event()
    cached = dict(h16.DEFAULT)

    class Ext(_CompilingExt):
        def nvrtc_compile(self, source, name_expression, options):
            done = super().nvrtc_compile(source, name_expression, options)
            if name_expression != h16.name_expression(cached):
                assert release.wait(10), "the test never released the compiles"
            return done

    compiler = _bare_compiler(Ext())
    compiler.compile(h16, [cached])  # now in the cache
    slow = [dict(h16.DEFAULT, BK=bk, WM=wm) for bk in (32, 64) for wm in (1, 2, 4)]
    slow = [c for c in slow if h16.name_expression(c) != h16.name_expression(cached)][:5]  # 4 workers: one queued
    try:
        assert compiler.compile_within(h16, slow, 0.2) == [None] * len(slow)
        t0 = time.perf_counter()
        assert compiler.compile(h16, [cached])[0].compile_seconds == 0
        assert time.perf_counter() - t0 < 1.0
    finally:
        release.set()
    time.sleep(0.2)
    assert len(compiler.ext.compiled) == 1 + 4  # the fifth, still queued at the timeout, never reached NVRTC


def test_the_compile_pool_runs_every_job_on_at_most_its_workers_and_lets_idle_threads_go():
    """More jobs than workers all run, never more than ``workers`` at once; threads idle for ``IDLE_S`` end, and a
    job submitted after that starts a thread again."""
    import threading
    import time

    from bagf_torch.jit.compiler import _CompilePool

    pool = _CompilePool(2)
    pool.IDLE_S = 0.2
    running, peak, lock = [0], [0], threading.Lock()

    def job(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return i

    futures = [pool.submit(job, i) for i in range(10)]
    assert [f.result(timeout=10) for f in futures] == list(range(10))
    assert peak[0] <= 2 and pool._threads <= 2
    deadline = time.monotonic() + 5
    while pool._threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool._threads == 0  # the idle threads ended
    assert pool.submit(job, 10).result(timeout=10) == 10  # and a new job still runs

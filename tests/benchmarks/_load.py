# SPDX-License-Identifier: Apache-2.0
"""Import the benchmark scripts (repo root on sys.path; no GPU needed)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    """``load("bench_tpot")`` or ``load("probes.kernel_resources")``."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"benchmarks.{name}")

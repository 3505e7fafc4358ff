"""Every benchmark module imports: `python -m benchmarks.<name>` broke once unseen, when a
helper it imported moved (benchmarks/console.py after the harness was split)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MODULES = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__main__")


@pytest.mark.parametrize("name", MODULES)
def test_the_benchmark_module_imports(name: str) -> None:
    importlib.import_module(f"benchmarks.{name}")

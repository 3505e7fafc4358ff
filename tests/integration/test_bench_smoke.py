"""The benchmark harness at tiny sizes, so that `make bench` keeps working; no timing is
asserted (speed is measured by `make bench`, not by tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_the_harness_runs_every_scenario_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    for name in (
        "drain",
        "hot_key",
        "idle",
        "writer_notify_cost",
        "baseline_kafka_only",
        "baseline_postgres_only",
        "baseline_handwritten",
        "scaling_2_processes",
        "sustained_2000_per_s_10_per_tx",
        "sustained_max_per_s_1_per_tx",
    ):
        assert name in results, name
    assert results["drain"]["events_per_second"] > 0
    assert results["sustained_2000_per_s_10_per_tx"]["p99_ms"] > 0
    assert all(v == v for v in report["ratios"].values()), "a ratio is NaN"
    assert report["machine"]["cores"] >= 1
    assert "| drain |" in result.stdout

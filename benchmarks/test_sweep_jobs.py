"""``hkvsim sweep --jobs 2`` against a serial sweep, side by side in one run: the Kimi-Linear
report sweep (32 production-geometry variants, timing-only), both through the command line so
that each pays its own process start.

    .venv/bin/python -m pytest benchmarks/test_sweep_jobs.py -q --benchmark-enable
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "scenarios/reports/kimi-linear.toml"


def _sweep(jobs: int) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hkvsim.cli", "sweep", str(SWEEP), "--json",
                           "--jobs", str(jobs)], capture_output=True, text=True, cwd=ROOT,
                          timeout=900)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    return elapsed, json.loads(proc.stdout)


@pytest.mark.timeout(1800)
def test_sweep_jobs_2_vs_serial(benchmark, figures) -> None:
    serial_seconds, serial = _sweep(1)
    parallel_seconds, parallel = benchmark.pedantic(_sweep, args=(2,), rounds=1, iterations=1)
    assert parallel == serial  # the same results, whatever the number of processes
    speedup = serial_seconds / parallel_seconds
    figures.add("sweep --jobs 2 vs serial: kimi-linear report sweep (32 variants)", speedup,
                "x", target=">= 1.3 on 2 idle cores", met=speedup >= 1.3,
                note=f"serial {serial_seconds:.1f} s, --jobs 2 {parallel_seconds:.1f} s, "
                     f"{os.cpu_count()} CPUs")

"""`hkvsim calibrate` end to end with a small sweep: real NIXL measurements, the fit, the
replay through the simulated fabric, the profile file and the report."""

from __future__ import annotations

import json

import pytest

from hkvsim.backends.calibrate import SweepPoint, calibrate, fit
from hkvsim.fabric.profile import load_profile

pytestmark = [pytest.mark.usefixtures("nixl_required")]


@pytest.mark.timeout(120)
def test_quick_calibration_writes_a_loadable_profile_and_report(tmp_path) -> None:
    profile = tmp_path / "profile.toml"
    summary = calibrate(quick=True, budget=4.0, profile_out=profile, force=True,
                        report_dir=tmp_path / "report", log_dir=str(tmp_path / "logs"))
    assert summary["points"] == 2 * 8  # 1 MiB x 1024 is over the byte cap
    assert summary["transport"] != "unknown", summary["transports"]
    # loose bound: the acceptance (< 15 %) is for the full sweep on a quiet machine
    assert summary["median_abs_error"] < 0.30, summary
    loaded = load_profile(profile)
    assert loaded.memory == "DRAM" and loaded.transport == summary["transport"]
    table = (tmp_path / "report" / "cpu-ucx-loopback.md").read_text()
    assert table.count("\n| READ ") == 8 and table.count("\n| WRITE ") == 8
    points = json.loads((tmp_path / "report" / "cpu-ucx-loopback.json").read_text())["points"]
    assert all(p["simulated_seconds"] > 0 and p["measured_seconds"] > 0 for p in points)


@pytest.mark.timeout(30)
def test_fit_recovers_a_linear_machine() -> None:
    """Synthetic points from launch 2 us + 1 us/descriptor + 10 GB/s: the fit and the
    simulator's replay give them back."""
    pts = [SweepPoint(op=op, size=s, count=n, reps=5, merged=n,
                      total_us=2 + n + s * n / 1e4, post_us=2 + n + s * n / 1e4,
                      wall_us=3 + n + s * n / 1e4)
           for s in (4096, 65536, 1 << 20) for n in (1, 16, 256) for op in ("READ", "WRITE")]
    numbers = fit(pts)
    assert numbers["per_descriptor"] == pytest.approx(1e-6, rel=1e-3)
    assert numbers["bandwidth"] == pytest.approx(1e10, rel=1e-3)
    assert numbers["intercept"] == pytest.approx(2e-6, rel=1e-2)

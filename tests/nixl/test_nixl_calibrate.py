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


@pytest.mark.timeout(120)
def test_gpu_check_transfer_sweep_on_dram(tmp_path) -> None:
    """hardware/gpu-check's step 3 (the calibration sweep on the lab's memory, VRAM on a GPU):
    on DRAM here. Every point moves bytes through real NIXL, the memory type is recorded, the
    fit has no infinity in it (JSON has none), and the table has a row per point."""
    from hkvsim.lab_check import _sweep_markdown, transfer_sweep

    sweep = transfer_sweep("DRAM", 1.0, quick=True)
    assert sweep["memory"] == "DRAM" and sweep["transports"]
    assert len(sweep["points"]) == 16 and all(p["total_us"] > 0 for p in sweep["points"])
    json.loads(json.dumps(sweep, allow_nan=False))
    text = "\n".join(_sweep_markdown(sweep))
    assert text.count("\n| READ |") == 8 and text.count("\n| WRITE |") == 8
    assert "## NIXL transfer sweep (DRAM, two processes)" in text
    # each point next to the shipped DRAM profile's prediction of it, with its error
    assert sweep["profile"] == "cpu-ucx-loopback"
    assert all(p["simulated_us"] > 0 for p in sweep["points"])
    first = sweep["points"][0]
    err = (first["simulated_us"] - first["total_us"]) / first["total_us"]
    assert f"| {first['simulated_us']:.1f} us | {100 * err:+.0f} % |" in text
    with pytest.raises(ValueError, match="memory must be DRAM or VRAM, got 'HBM'"):
        transfer_sweep("HBM", 1.0, quick=True)


def test_an_unresolved_bandwidth_is_written_as_null_and_said_in_words(monkeypatch) -> None:
    """What the one-H200 VRAM sweep gave (reports/gpu/): every point dominated by the
    per-descriptor cost, so the bytes term fits to zero and the bandwidth to infinity."""
    import hkvsim.backends.calibrate as cal
    from hkvsim.lab_check import _sweep_markdown, transfer_sweep

    pts = [dict(op="READ", size=s, count=n, reps=5, merged=n, total_us=5.6 + 6.3 * n,
                post_us=6.3 * n, wall_us=6 + 6.3 * n) for s in (4096, 1 << 20) for n in (1, 64)]
    monkeypatch.setattr(cal, "run_sweep", lambda **kw: {
        "points": [dict(p) for p in pts], "memory": "VRAM", "transports": ["cuda_ipc/cuda"], "wireup_s": 0.0018,
        "handshake_s": 0.0135, "memcpy_gbps": 529.0})
    sweep = transfer_sweep("VRAM", 1.0)
    assert sweep["fit"]["bandwidth"] is None and sweep["profile"] == "h200-nvlink"
    assert sweep["fit"]["per_descriptor"] == pytest.approx(6.3e-6, rel=1e-3)
    json.loads(json.dumps(sweep, allow_nan=False))
    assert ("6.300 us/descriptor, bandwidth not resolved (the per-descriptor cost dominates "
            "every point).") in "\n".join(_sweep_markdown(sweep))

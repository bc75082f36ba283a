"""`hkvsim calibrate`'s arithmetic without NIXL: the sweep is replaced by the measurements of a
known machine, so the fit, the profile it writes, the simulator's replay of that profile and the
acceptance can each be checked against numbers known exactly. (The sweep itself, on real NIXL:
tests/nixl/test_nixl_calibrate.py.)"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from hkvsim.backends import calibrate as cal
from hkvsim.fabric.profile import load_profile

pytestmark = pytest.mark.timeout(60)

# the machine: 2 us to launch a transfer, 1 us per descriptor, 10 GB/s copied inside the post
# call (UCX cma), then 5 us until the initiator sees it complete
LAUNCH_US, PER_DESC_US, GBPS, LATENCY_US = 2.0, 1.0, 10.0, 5.0


def _raw(points: list[cal.SweepPoint]) -> dict:
    return {"points": [asdict(p) for p in points], "transports": ["cma/memory"],
            "handshake_s": 1.5e-3, "add_remote_agent_s": 1e-3, "metadata_fetch_s": 5e-4,
            "wireup_s": 2e-3, "notif_oneway_s": 2.5e-5, "memcpy_gbps": 12.0,
            "sweep_seconds": 1.0, "log_dir": "unused"}


def _machine(skew: float = 1.0) -> list[cal.SweepPoint]:
    """Every (op, size, count) of the quick grid; ``skew`` scales every time measured."""
    out = []
    for size in cal.QUICK_SIZES:
        for count in cal.QUICK_COUNTS:
            post = LAUNCH_US + PER_DESC_US * count + size * count / (GBPS * 1e3)
            for op in ("READ", "WRITE"):
                out.append(cal.SweepPoint(op=op, size=size, count=count, reps=5, merged=count,
                                          total_us=skew * (post + LATENCY_US),
                                          post_us=skew * post, wall_us=skew * (post + 9.0)))
    return out


def test_the_fit_finds_the_machine_and_the_profile_states_it_in_us_and_gbps() -> None:
    numbers = cal.fit(_machine())
    assert numbers["latency"] == pytest.approx(LATENCY_US * 1e-6, rel=1e-6)
    assert numbers["transfer_launch"] == pytest.approx(LAUNCH_US * 1e-6, rel=1e-3)
    assert numbers["per_descriptor"] == pytest.approx(PER_DESC_US * 1e-6, rel=1e-3)
    assert numbers["bandwidth"] == pytest.approx(GBPS * 1e9, rel=1e-3)
    values = cal._profile_values(numbers, _raw(_machine()), "cma")
    assert values["intra_node_latency_us"] == values["inter_node_latency_us"] == LATENCY_US
    assert values["transfer_launch_us"] == pytest.approx(LAUNCH_US, abs=1e-3)
    assert values["per_descriptor_us"] == pytest.approx(PER_DESC_US, abs=1e-3)
    assert values["intra_node_bandwidth_gbps"] == pytest.approx(GBPS, abs=1e-3)
    assert values["notification_latency_us"] == 25.0
    assert values["handshake_latency_us"] == 1500.0
    assert values["local_bandwidth_gbps"] == 12.0


@pytest.mark.parametrize("skew,accepted", [(1.0, True), (1.5, False)])
def test_calibrate_replays_its_profile_and_writes_it_only_when_accepted(
        tmp_path: Path, monkeypatch, skew: float, accepted: bool) -> None:
    """The profile is replayed through the simulated fabric against the points measured:
    exact for a linear machine. Any linear machine is fit exactly (times 1.5x slower give a
    fit 1.5x slower), so a profile that misses is made by fitting the unskewed points and
    replaying them against times 1.5x slower: a median error of 1 - 1/1.5 = 33 %."""
    fitted_on = _machine()
    measured = _machine(skew)
    monkeypatch.setattr(cal, "run_sweep", lambda **kw: _raw(measured))
    real_fit = cal.fit
    monkeypatch.setattr(cal, "fit", lambda points: real_fit(fitted_on))
    out = tmp_path / "profile.toml"
    summary = cal.calibrate(quick=True, profile_out=out, report_dir=tmp_path / "report")
    assert summary["accepted"] is accepted
    expected_error = 0.0 if skew == 1.0 else 1 - 1 / skew
    assert summary["median_abs_error"] == pytest.approx(expected_error, abs=2e-3)
    assert summary["points"] == len(measured) and summary["transport"] == "cma"
    if accepted:
        profile = load_profile(out)
        assert profile.intra_node_latency == pytest.approx(LATENCY_US * 1e-6)
        assert profile.per_descriptor == pytest.approx(PER_DESC_US * 1e-6, rel=1e-3)
        assert profile.intra_node_bandwidth == pytest.approx(GBPS * 1e9, rel=1e-3)
        assert profile.transport == "cma" and profile.memory == "DRAM"
    else:
        assert not out.exists() and summary["profile_written"] is None
    assert (tmp_path / "report").is_dir()

"""Faults on the real NIXL backend: a poll fault still tells the peer, and a few hundred requests
with mixed faults keep the invariants (issue #6). The fault matrix files that both backends can
inject meet their expectations on NIXL in tests/nixl/test_backend_agreement.py, on the same real
runs that are compared with the simulator's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from hkvsim.drivers.nixl import NixlRunOptions, run_scenario_nixl
from hkvsim.results import result_json
from hkvsim.scenario import load_scenarios

ROOT = Path(__file__).resolve().parents[2]
KNOWN = {"transfer_setup_failed", "transfer_failed", "transfer_exception", "stall"}


@pytest.mark.timeout(240)
def test_a_poll_fault_still_tells_the_peer_on_nixl(nixl_required, tmp_path) -> None:
    """A transfer whose poll raises moved its data, so its peer is still told (after the
    sender's failure is reported: hkvsim/transport/faulty.py): in pull mode prefill frees
    request 2 on decode's notification, not by lease, on both backends; request 1 (its post
    failed, nothing moved, no notification) is freed by lease on both."""
    from hkvsim.cluster import run_scenario

    pulls = [s for s in load_scenarios(ROOT / "scenarios/faults/fail-setup-and-poll.toml")
             if s.connector.mode == "pull" and s.model.preset == "tiny-kimi-linear"]
    assert len(pulls) == 1
    sim = run_scenario(pulls[0])
    real = run_scenario_nixl(pulls[0], options=NixlRunOptions(log_dir=str(tmp_path / "logs")))
    expected = [False, True, False]  # request 0 ok, 1 setup failure, 2 poll failure
    assert [r.freed_by_lease for r in sim.records] == expected
    assert [r.freed_by_lease for r in real.records] == expected
    assert [r.status for r in real.records] == ["ok", "failed", "failed"]


@pytest.mark.timeout(240)
def test_real_backend_soak_keeps_the_invariants(nixl_required, tmp_path) -> None:
    (scenario,) = load_scenarios(ROOT / "scenarios/soak/mixed-faults-real-backend.toml")
    result = run_scenario_nixl(scenario, options=NixlRunOptions(log_dir=str(tmp_path / "logs")))
    data = result_json(result)
    assert data["requests"]["total"] == 200 and data["requests"]["hung"] == 0
    assert result.corrupted == 0 and data["requests"]["mismatched_bytes"] == 0
    assert {"prefill_blocks", "decode_blocks", "open_handles", "after_shutdown"} <= set(data["leaks"])
    assert not any(data["leaks"].values()), data["leaks"]
    classes = Counter(f["class"] for f in data["failures"])
    assert classes and set(classes) <= KNOWN, classes
    assert data["requests"]["completed"] + data["requests"]["failed"] == 200

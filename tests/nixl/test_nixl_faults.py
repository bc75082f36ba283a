"""Faults on the real NIXL backend: the fault matrix files that both backends can inject meet
the same expectations as on the simulator, and a few hundred requests with mixed faults keep
the invariants (issue #6)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from hkvsim.drivers.nixl import NixlRunOptions, run_scenario_nixl
from hkvsim.results import expectation_problems, result_json
from hkvsim.scenario import load_scenarios

ROOT = Path(__file__).resolve().parents[2]
KNOWN = {"transfer_setup_failed", "transfer_failed", "transfer_exception", "stall"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["fail-transfer", "stall-transfer", "drop-notification-pull",
                                  "drop-notification-push", "fail-setup-and-poll"])
def test_fault_matrix_on_nixl(nixl_required, tmp_path, name: str) -> None:
    for scenario in load_scenarios(ROOT / "scenarios" / "faults" / f"{name}.toml"):
        result = run_scenario_nixl(scenario, options=NixlRunOptions(
            log_dir=str(tmp_path / "logs")))
        assert expectation_problems(result) == [], (scenario.where, result_json(result)["leaks"])
        assert result.hung == 0 and result.corrupted == 0


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

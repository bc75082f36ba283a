"""Blocks under a live transfer are never reused, and late landings are caught (issue #10, item 1).

The watchdog fails a request whose transfer is slow rather than stuck; the transfer keeps moving
bytes. Decode must keep the request's blocks out of the pool until the transfer can no longer write
(quarantine), and the simulator's landing guard must flag any bytes that land in a block their
request does not own at landing time, even after the victim was verified.
"""

from __future__ import annotations

import pytest

from hkvsim.cluster import SimDriver, run_scenario
from hkvsim.pd.coordinator import Coordinator
from hkvsim.results import result_json
from hkvsim.scenario import parse_scenarios

SLOW = """
[scenario]
name = "slow transfers outlive the watchdog"
seed = 3
[model]
preset = "{preset}"
[prefill]
tp = 1
[decode]
tp = 2
num_blocks = {blocks}
[connector]
mode = "{mode}"
lease_seconds = 5.0
transfer_timeout_seconds = 0.01
[workload]
requests = 120
arrival = "poisson"
rate = 500.0
prompt_tokens = {{ min = 200, max = 1000, distribution = "loguniform" }}
max_inflight = 8
[[faults]]
kind = "slow-link"
probability = 0.3
factor = 3000.0
[expect]
outcome = "request-failure"
reason = "stall"
"""

CASES = [("tiny-llama", 64, "pull"), ("tiny-llama", 64, "push"),
         ("tiny-kimi-linear", 40, "pull"), ("tiny-kimi-linear", 40, "push")]


def _scenario(preset: str, blocks: int, mode: str):
    (scenario,) = parse_scenarios(SLOW.format(preset=preset, blocks=blocks, mode=mode))
    return scenario


@pytest.mark.parametrize(("preset", "blocks", "mode"), CASES)
def test_watchdog_quarantines_blocks_until_the_transfer_ends(preset, blocks, mode) -> None:
    result = run_scenario(_scenario(preset, blocks, mode))
    data = result_json(result)
    assert data["expectation_met"], data["expectation_problems"]
    assert data["counters"]["late_landings"] == 0
    assert data["counters"]["quarantined_blocks"] > 0  # the slow transfers were waited out
    assert result.corrupted == 0 and data["requests"]["mismatched_bytes"] == 0
    assert not any(data["leaks"].values()), data["leaks"]
    assert {f["class"] for f in data["failures"]} == {"stall"}


@pytest.mark.parametrize(("preset", "blocks", "mode"), CASES)
def test_landing_guard_catches_blocks_freed_under_a_live_transfer(
        monkeypatch: pytest.MonkeyPatch, preset, blocks, mode) -> None:
    """Plant the original bug (free decode's blocks while the transfer lives): the guard must
    report late landings and the run must be a corruption, never a success."""
    monkeypatch.setattr(Coordinator, "_writers_live", lambda *args, **kwargs: False)
    result = run_scenario(_scenario(preset, blocks, mode))
    data = result_json(result)
    assert data["counters"]["late_landings"] > 0
    assert data["outcome"] == "corruption"
    assert not data["expectation_met"]
    assert any("late landings" in p for p in data["expectation_problems"])
    assert data["misplaced_writes"] and "does not own" in data["misplaced_writes"][0]


def test_a_late_landing_on_a_verified_request_marks_it_corrupted() -> None:
    """Bytes of request 1 landing in blocks that request 0 holds after its verification: the
    guard counts a late landing and request 0 is no longer a success."""
    import numpy as np

    from hkvsim.results import expectation_problems

    (scenario,) = parse_scenarios(SLOW.format(preset="tiny-llama", blocks=64, mode="pull")
                                  .replace("requests = 120", "requests = 2")
                                  .replace('outcome = "request-failure"', 'outcome = "ok"')
                                  .replace('reason = "stall"', "")
                                  .replace("probability = 0.3", "probability = 0.0"))
    driver = SimDriver(scenario)
    result = driver.run()
    assert result.outcome == "ok" and all(r.status == "ok" for r in result.records)
    decode = driver.coord.engine("decode0")
    agent, base = "decode0.1", driver._base[("decode0", 1)]
    decode.pool.owner[[5, 6]] = 0  # request 0, already verified, holds blocks 5 and 6
    page = decode.layout.unified_page_bytes
    driver._on_landing(agent, np.array([base + 5 * page, base + 6 * page + 64]),
                       np.array([page, 8]), 1, True)
    assert driver.coord.counters["late_landings"] == 1
    assert result.records[0].overwritten_by == [1]
    assert result.corrupted == 1 and result.outcome == "corruption"
    assert any("wrong bytes" in p for p in expectation_problems(result))
    assert "late landing" in result.records[0].mismatches[-1]
    # bytes landing where the transfer's own request owns the blocks are not flagged
    decode.pool.owner[[7]] = 1
    driver._on_landing(agent, np.array([base + 7 * page]), np.array([page]), 1, True)
    assert driver.coord.counters["late_landings"] == 1

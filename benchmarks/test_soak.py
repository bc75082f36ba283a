"""The full soak (issues #6, #10): scenarios/soak/mixed-faults.toml (slow links past the transfer
watchdog, a tight decode pool, every fault kind) at 10,000 requests:

    .venv/bin/python -m pytest benchmarks/test_soak.py -q --benchmark-enable

With --benchmark-disable (CI's smoke pass) it runs 1,000 requests and checks the same invariants.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hkvsim.cluster import run_scenario
from hkvsim.results import result_json
from hkvsim.scenario import load_scenarios

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1800)
def test_soak_10000_requests_with_mixed_faults(benchmark) -> None:
    (scenario,) = load_scenarios(ROOT / "scenarios/soak/mixed-faults.toml")
    requests = 1_000 if benchmark.disabled else 10_000
    workload = scenario.workload.model_copy(update={"requests": requests})
    scenario = scenario.model_copy(update={"workload": workload})
    result = benchmark.pedantic(run_scenario, args=(scenario,), rounds=1, iterations=1)
    data = result_json(result)
    benchmark.extra_info.update({
        "requests": data["requests"]["total"], "failed": data["requests"]["failed"],
        "faults_injected": data["counters"]["faults_injected"],
        "corrupted": result.corrupted, "hung": data["requests"]["hung"], "leaks": data["leaks"]})
    assert data["requests"]["total"] == requests and data["requests"]["hung"] == 0
    assert result.corrupted == 0 and data["requests"]["mismatched_bytes"] == 0
    assert result.late_landings == 0 and result.stray_writes == 0
    # every leak counter the run reports (the set grows: after_shutdown was added) is zero
    assert {"prefill_blocks", "decode_blocks", "open_handles"} <= set(data["leaks"])
    assert not any(data["leaks"].values()), data["leaks"]
    assert data["requests"]["failed"] > 0

"""The full soak (issue #6): scenarios/soak/mixed-faults.toml at 10,000 requests.

    .venv/bin/python -m pytest benchmarks/test_soak.py -q --benchmark-enable
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
    workload = scenario.workload.model_copy(update={"requests": 10_000})
    scenario = scenario.model_copy(update={"workload": workload})
    result = benchmark.pedantic(run_scenario, args=(scenario,), rounds=1, iterations=1)
    data = result_json(result)
    benchmark.extra_info.update({
        "requests": data["requests"]["total"], "failed": data["requests"]["failed"],
        "faults_injected": data["counters"]["faults_injected"],
        "corrupted": result.corrupted, "hung": data["requests"]["hung"], "leaks": data["leaks"]})
    assert data["requests"]["hung"] == 0
    assert result.corrupted == 0 and data["requests"]["mismatched_bytes"] == 0
    assert data["leaks"] == {"prefill_blocks": 0, "decode_blocks": 0, "open_handles": 0}
    assert data["requests"]["failed"] > 0

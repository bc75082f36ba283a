"""The real NIXL backend records the prefix hit it reused, as the simulator does."""

from __future__ import annotations

import pytest

from hkvsim.drivers.nixl import NixlRunOptions, run_scenario_nixl
from hkvsim.results import result_json
from hkvsim.scenario import parse_scenarios

pytestmark = [pytest.mark.usefixtures("nixl_required")]

HITS = """
[scenario]
name = "tiny-qwen3-next hits on NIXL"
seed = 3
[model]
preset = "tiny-qwen3-next"
[decode]
prefix_caching = true
[connector]
lease_seconds = 10.0
transfer_timeout_seconds = 20.0
[fabric]
profile = "cpu-ucx-loopback"
[workload]
requests = 3
prompt_tokens = 2000
prefix_hit_tokens = [40, 700, 160]
"""


@pytest.mark.timeout(90)
def test_nixl_records_the_reused_hit_and_warns(tmp_path) -> None:
    (scenario,) = parse_scenarios(HITS, source="hits.toml")
    result = run_scenario_nixl(scenario, options=NixlRunOptions(log_dir=str(tmp_path / "logs")))
    data = result_json(result, requests=True)
    assert data["outcome"] == "ok" and data["requests"]["byte_exact"] == 3
    assert [(r["prefix_hit_tokens"], r["effective_prefix_hit_tokens"])
            for r in data["request_details"]] == [(40, 0), (700, 640), (160, 160)]
    (warning,) = data["warnings"]
    assert warning.startswith("hits.toml: workload.prefix_hit_tokens: 2 of 3 request(s) ")


TRACE_SCENARIO = """
[scenario]
name = "tiny-deepseek Mooncake trace on NIXL"
seed = 3
[model]
preset = "tiny-deepseek"
[decode]
prefix_caching = true
[connector]
lease_seconds = 10.0
transfer_timeout_seconds = 20.0
[fabric]
profile = "cpu-ucx-loopback"
[workload]
trace = "t.jsonl"
"""


@pytest.mark.timeout(90)
def test_nixl_replays_a_trace(tmp_path) -> None:
    from hkvsim.scenario import load_scenarios

    rows = [(0, 1100, [0, 1, 2]), (40, 1500, [0, 1, 3]), (60, 600, [0, 4])]
    (tmp_path / "t.jsonl").write_text("".join(
        f'{{"timestamp": {t}, "input_length": {n}, "output_length": 5, "hash_ids": {ids}}}\n'
        for t, n, ids in rows))
    (tmp_path / "s.toml").write_text(TRACE_SCENARIO)
    (scenario,) = load_scenarios(tmp_path / "s.toml")
    result = run_scenario_nixl(scenario, options=NixlRunOptions(log_dir=str(tmp_path / "logs")))
    data = result_json(result, requests=True)
    assert data["outcome"] == "ok" and data["requests"]["byte_exact"] == 3
    details = data["request_details"]
    assert [r["arrival"] for r in details] == [0.0, 0.04, 0.06]
    assert [r["prefix_hit_tokens"] for r in details] == [0, 1024, 512]
    assert [r["effective_prefix_hit_tokens"] for r in details] == [0, 1024, 512]

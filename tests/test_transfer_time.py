"""One definition of a request's transfer time across plan, run (sweep) and report: the span
from its first post to its transfer completing, with the handshake (and post wait) reported
apart, never inside it (#13: push used to carry its ~6 ms-262 ms reverse handshake in plan)."""

from __future__ import annotations

import json

import pytest

from hkvsim.cli import main
from hkvsim.cluster import run_scenario
from hkvsim.plan import plan_scenario
from hkvsim.report.data import breakdown, transfer_seconds, variant_from_result
from hkvsim.results import PHASES, result_json
from hkvsim.scenario import parse_scenarios

pytestmark = pytest.mark.timeout(120)

TEXT = """
[scenario]
name = "one definition"
seed = 4
[model]
preset = "tiny-llama"
[prefill]
tp = 2
[decode]
tp = 1
[connector]
mode = "{mode}"
[fabric]
profile = "pcie-host"
[workload]
requests = 3
prompt_tokens = [500, 129, 2000]
"""


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_plan_run_and_report_agree_on_every_request(mode: str, tmp_path, capsys) -> None:
    (scenario,) = parse_scenarios(TEXT.format(mode=mode))
    plan = plan_scenario(scenario)
    result = run_scenario(scenario)
    run = result_json(result, requests=True)
    variant = variant_from_result(result, family="f")
    path = tmp_path / "s.toml"
    path.write_text(TEXT.format(mode=mode))
    assert main(["sweep", str(path), "--json"]) == 0
    sweep = json.loads(capsys.readouterr().out)
    assert sweep["scenarios"][0]["time"] == run["time"]
    for p, r, v in zip(plan["requests"], run["request_details"], variant.requests):
        assert p["predicted_transfer_seconds"] == r["transfer_seconds"] == transfer_seconds(
            variant, v)
        assert p["predicted_phases"] == r["phases"] == {
            k.replace(" ", "_"): x for k, x in breakdown(variant, v).items()}
    first = run["request_details"][0]
    # the handshake is reported apart and is not inside the transfer time
    assert first["phases"]["handshake"] > first["transfer_seconds"]
    assert set(first["phases"]) == {k.replace(" ", "_") for k in PHASES}
    assert run["time"]["handshake_seconds"]["max"] == first["phases"]["handshake"]


def test_push_handshake_counts_both_of_its_handshakes() -> None:
    runs = {}
    for mode in ("pull", "push"):
        (scenario,) = parse_scenarios(TEXT.format(mode=mode))
        runs[mode] = result_json(run_scenario(scenario), requests=True)
    pull = runs["pull"]["request_details"][0]["phases"]["handshake"]
    push = runs["push"]["request_details"][0]["phases"]["handshake"]
    # push: decode's notification-only handshake, then prefill's reverse one (same profile
    # latency each); pull: decode's only
    assert push == pytest.approx(2 * pull, rel=1e-9)
    # and in push, the transfer is post + wire + notification of the critical transfer
    r = runs["push"]["request_details"][0]
    ph = r["phases"]
    assert r["transfer_seconds"] == pytest.approx(ph["post"] + ph["wire"] + ph["notification"],
                                                  rel=1e-9)

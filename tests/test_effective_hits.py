"""Prefix hits are reused in whole logical blocks of decode: every output shows the hit asked
for beside the hit reused, and a run warns once when requested hits were rounded down."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hkvsim.cli import main
from hkvsim.cluster import run_scenario
from hkvsim.plan import plan_scenario
from hkvsim.results import result_json
from hkvsim.scenario import parse_scenarios

# tiny-qwen3-next at TP1: logical block 80 tokens (kernel 16, ppl 5)
TINY = """
[scenario]
name = "tiny hits"
[model]
preset = "tiny-qwen3-next"
[decode]
prefix_caching = true
[workload]
requests = 4
prompt_tokens = 2000
prefix_hit_tokens = {hits}
"""


def _one(text: str):
    (scenario,) = parse_scenarios(text, source="hits.toml")
    return scenario


def test_plan_shows_requested_and_reused_hits() -> None:
    plan = plan_scenario(_one(TINY.format(hits="[0, 40, 700, 160]")))
    assert plan["decode"]["logical_block_size"] == 80
    pairs = [(r["prefix_hit_tokens"], r["effective_prefix_hit_tokens"]) for r in plan["requests"]]
    assert pairs == [(0, 0), (40, 0), (700, 640), (160, 160)]
    (warning,) = plan["warnings"]
    assert warning.startswith("hits.toml: workload.prefix_hit_tokens: 2 of 4 request(s) ")
    assert "(80 tokens at TP 1)" in warning
    assert "request 1 asked 40 and reused 0, request 2 asked 700 and reused 640" in warning


def test_the_warning_gives_three_examples_and_counts_the_rest() -> None:
    text = TINY.replace("requests = 4", "requests = 6").format(hits="[40, 41, 42, 43, 44, 160]")
    (warning,) = plan_scenario(_one(text))["warnings"]
    assert "5 of 6 request(s)" in warning
    assert warning.endswith("request 0 asked 40 and reused 0, request 1 asked 41 and reused 0, "
                            "request 2 asked 42 and reused 0 (and 2 more)")
    (exactly_three,) = plan_scenario(_one(TINY.format(hits="[40, 41, 42, 160]")))["warnings"]
    assert exactly_three.endswith("request 2 asked 42 and reused 0")  # none left to count


def test_the_issue_example_qwen3_next_512_of_1056_reuses_nothing() -> None:
    text = TINY.replace("tiny-qwen3-next", "qwen3-next-80b").replace("requests = 4",
                                                                     "requests = 1")
    plan = plan_scenario(_one(text.format(hits="512").replace("2000", "4096")))
    assert plan["decode"]["logical_block_size"] == 1056
    (req,) = plan["requests"]
    assert (req["prefix_hit_tokens"], req["effective_prefix_hit_tokens"]) == (512, 0)
    assert len(plan["warnings"]) == 1


def test_whole_block_hits_give_no_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hkvsim.workload"):
        result = run_scenario(_one(TINY.format(hits="[0, 80, 160, 1920]")))
    assert result.warnings == []
    assert [r.effective_prefix_hit_tokens for r in result.records] == [0, 80, 160, 1920]
    assert not [r for r in caplog.records if r.name == "hkvsim.workload"]


def test_run_json_and_details_carry_both_hits_and_warn_once(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hkvsim.workload"):
        result = run_scenario(_one(TINY.format(hits="[0, 40, 700, 160]")))
    data = result_json(result, requests=True)
    assert data["outcome"] == "ok" and data["requests"]["byte_exact"] == 4
    assert [(r["prefix_hit_tokens"], r["effective_prefix_hit_tokens"])
            for r in data["request_details"]] == [(0, 0), (40, 0), (700, 640), (160, 160)]
    assert data["warnings"] == result.warnings and len(data["warnings"]) == 1
    logged = [r for r in caplog.records if r.name == "hkvsim.workload"]
    assert len(logged) == 1 and logged[0].getMessage() == data["warnings"][0]


def test_cli_plan_table_has_both_columns(tmp_path: Path, capsys) -> None:
    path = tmp_path / "hits.toml"
    path.write_text(TINY.format(hits="[0, 40, 700, 160]"))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "hit asked" in out and "hit reused" in out
    row = next(line for line in out.splitlines() if line.strip("│ ").startswith("2 "))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[:4] == ["2", "2,000", "700", "640"]


def test_report_rows_carry_the_reused_hit(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "hits.toml"
    path.write_text(TINY.format(hits="[0, 40, 700, 160]"))
    out = tmp_path / "report"
    assert main(["report", str(path), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    (variant,) = report["variants"]
    assert [(r["prefix_hit_tokens"], r["effective_prefix_hit_tokens"])
            for r in variant["requests"]] == [(0, 0), (40, 0), (700, 640), (160, 160)]

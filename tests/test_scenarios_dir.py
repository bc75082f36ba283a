"""Every scenario file under scenarios/ runs in CI and meets its [expect]."""

from __future__ import annotations

from pathlib import Path

import pytest

from hkvsim.cluster import run_scenario
from hkvsim.results import expectation_problems
from hkvsim.scenario import load_scenarios

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "scenarios").rglob("*.toml"))


def test_scenarios_exist() -> None:
    assert len(FILES) >= 10
    assert any(f.name.startswith("xfail-") for f in FILES)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(ROOT / "scenarios")) for f in FILES])
def test_scenario_meets_its_expectation(path: Path) -> None:
    scenarios = load_scenarios(path)
    failures = []
    for s in scenarios:
        result = run_scenario(s)
        problems = expectation_problems(result)
        if problems:
            failures.append(f"{s.scenario.name}: {problems[0]}")
        if path.name.startswith("xfail-"):
            assert result.outcome != "ok", f"{s.scenario.name} did not fail"
        else:
            assert result.hung == 0
    assert not failures, "\n".join(failures[:10])

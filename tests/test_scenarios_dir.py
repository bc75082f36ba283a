"""Every scenario file under scenarios/ runs in CI, meets its [expect], and reproduces its golden
outputs (`plan --json` and `run --json --requests`, tests/golden/; see tests/golden_outputs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import golden_outputs as golden
from hkvsim.cluster import run_scenario
from hkvsim.results import expectation_problems
from hkvsim.scenario import load_scenarios

ROOT = Path(__file__).resolve().parents[1]
# scenarios/vllm runs vLLM's own connector: it needs a provisioned vLLM (scripts/with-vllm) and
# is tested by tests/vllm, not here
FILES = sorted(f for f in (ROOT / "scenarios").rglob("*.toml")
               if f.relative_to(ROOT / "scenarios").parts[0] != "vllm")


def test_scenarios_exist() -> None:
    assert len(FILES) >= 10
    assert any(f.name.startswith("xfail-") for f in FILES)


def test_every_golden_output_has_its_scenario_file() -> None:
    expected = {golden.golden_path(f).name for f in FILES}
    stale = sorted(p.name for p in golden.GOLDEN_DIR.glob("*.json.gz") if p.name not in expected)
    assert not stale, f"golden outputs without a scenario file: {stale}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(ROOT / "scenarios")) for f in FILES])
def test_scenario_meets_its_expectation(path: Path) -> None:
    want = golden.load(path)
    assert want is not None, f"no golden output for {path.name}: run scripts/update-golden {path}"
    scenarios = load_scenarios(path)
    assert len(want["run"]) == len(scenarios) == len(want["plan"])
    failures, diffs = [], []
    for i, s in enumerate(scenarios):
        result = run_scenario(s)
        problems = expectation_problems(result)
        if problems:
            failures.append(f"{s.scenario.name}: {problems[0]}")
        if path.name.startswith("xfail-"):
            assert result.outcome != "ok", f"{s.scenario.name} did not fail"
        else:
            assert result.hung == 0
        for kind, got in (("run", golden.run_output(result)), ("plan", golden.plan_output(s))):
            diff = golden.first_difference(want[kind][i], got)
            if diff:
                diffs.append(f"{s.scenario.name}: {kind} --json differs at {diff}")
    assert not failures, "\n".join(failures[:10])
    assert not diffs, ("output differs from the golden one (scripts/update-golden regenerates "
                       "it, on purpose only):\n" + "\n".join(diffs[:5]))

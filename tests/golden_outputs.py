"""Golden outputs: `hkvsim plan --json` and `hkvsim run --json --requests` of every scenario file.

Both are deterministic on the simulated fabric (same scenario and seed -> same bytes and the same
simulated times), so a refactor that must not change behaviour is checked against them exactly.
Regenerate them on purpose, after a change that is meant to alter an output, with::

    scripts/update-golden            # every file under scenarios/
    scripts/update-golden scenarios/faults/slow-link.toml

and say in the commit which outputs changed and why.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden"


def golden_path(scenario_file: Path) -> Path:
    rel = scenario_file.resolve().relative_to(ROOT / "scenarios")
    return GOLDEN_DIR / (str(rel.with_suffix("")).replace("/", "__") + ".json.gz")


def _portable(data: Any) -> Any:
    """Paths relative to the repository wherever they appear (sources, warnings, messages):
    checkouts live anywhere, and CI's is not this one."""
    if isinstance(data, dict):
        return {k: _portable(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_portable(v) for v in data]
    if isinstance(data, str) and str(ROOT) in data:
        return data.replace(str(ROOT) + "/", "").replace(str(ROOT), ".")
    return data


def plan_output(scenario: Any) -> Any:
    from hkvsim.plan import plan_scenario

    return _portable(json.loads(json.dumps(plan_scenario(scenario), default=str)))


def run_output(result: Any) -> Any:
    from hkvsim.results import result_json

    return _portable(json.loads(json.dumps(result_json(result, requests=True), default=str)))


def compute(scenario_file: Path) -> dict[str, Any]:
    from hkvsim.cluster import run_scenario
    from hkvsim.scenario import load_scenarios

    scenarios = load_scenarios(scenario_file)
    return {"plan": [plan_output(s) for s in scenarios],
            "run": [run_output(run_scenario(s)) for s in scenarios]}


def load(scenario_file: Path) -> dict[str, Any] | None:
    path = golden_path(scenario_file)
    if not path.exists():
        return None
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def save(scenario_file: Path, data: dict[str, Any]) -> Path:
    path = golden_path(scenario_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, sort_keys=True)
    with gzip.GzipFile(path, "wb", mtime=0) as fh:  # byte-stable: no timestamp in the header
        fh.write(text.encode())
    return path


def first_difference(want: Any, got: Any, where: str = "") -> str | None:
    """Where two JSON documents first differ, as a dotted path with both values."""
    if type(want) is not type(got):
        return f"{where or '<root>'}: {want!r} != {got!r}"
    if isinstance(want, dict):
        for k in sorted(set(want) | set(got)):
            if k not in want or k not in got:
                return f"{where}.{k}: only in {'golden' if k in want else 'this run'}"
            diff = first_difference(want[k], got[k], f"{where}.{k}")
            if diff:
                return diff
        return None
    if isinstance(want, list):
        if len(want) != len(got):
            return f"{where}: {len(want)} items in the golden output, {len(got)} now"
        for i, (a, b) in enumerate(zip(want, got)):
            diff = first_difference(a, b, f"{where}[{i}]")
            if diff:
                return diff
        return None
    return None if want == got else f"{where}: golden {want!r}, now {got!r}"

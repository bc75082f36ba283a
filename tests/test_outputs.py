"""What `hkvsim run` and `hkvsim sweep` print: which clock the times are on, a predictable JSON
shape, a sweep table readable at 80 columns, and progress only on a terminal (what they say
about verification: tests/test_trust.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hkvsim.cli import _sweep_table, main
from hkvsim.cluster import run_scenario
from hkvsim.scenario import load_scenarios, parse_scenarios

pytestmark = pytest.mark.timeout(120)

TINY = """
[scenario]
name = "{name}"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 1
[decode]
tp = 2
[workload]
requests = 2
prompt_tokens = 700
"""


def _file(tmp_path: Path, body: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def _run_json(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


# ---- issue #15 item 6: which clock, and a JSON shape that does not depend on luck ----------------
def test_times_say_which_clock(tmp_path, capsys) -> None:
    code, data = _run_json(capsys, "run", str(_file(tmp_path, TINY.format(name="t"))))
    assert code == 0 and data["backend"] == "sim"
    assert data["time"]["clock"] == "simulated" and data["time"]["elapsed_seconds"] > 0
    assert "simulated_seconds" not in data["time"]
    assert main(["run", str(_file(tmp_path, TINY.format(name="t")))]) == 0
    assert "s (simulated)" in capsys.readouterr().out


def test_time_to_terminal_is_measured_from_each_arrival(tmp_path) -> None:
    # requests arriving ~0.1 s apart: no arrival-to-end time can exceed the run's end
    from hkvsim.results import result_json

    (s,) = parse_scenarios(TINY.format(name="t").replace(
        "prompt_tokens = 700", 'prompt_tokens = 700\narrival = "poisson"\nrate = 10.0'))
    result = run_scenario(s)
    time = result_json(result)["time"]
    spans = [r.times["done"] - r.arrival for r in result.records]
    assert max(r.arrival for r in result.records) > 0.01
    assert time["max_seconds_to_terminal"] == max(spans)
    assert 0 < time["max_seconds_to_terminal"] <= time["elapsed_seconds"]


def test_run_json_is_flat_without_sweep_and_an_envelope_with_one(tmp_path, capsys) -> None:
    plain = _file(tmp_path, TINY.format(name="t"))
    code, data = _run_json(capsys, "run", str(plain))
    assert code == 0 and data["scenario"] == "t" and "scenarios" not in data
    one = _file(tmp_path, TINY.format(name="t") + "[sweep]\nprefill.tp = [1]\n", "one.toml")
    for command in ("run", "sweep"):
        code, data = _run_json(capsys, command, str(one))
        assert code == 0 and set(data) == {"source", "variants", "shard", "expectation_met",
                                           "verified", "scenarios"}
        assert data["variants"] == 1 and len(data["scenarios"]) == 1
        assert data["scenarios"][0]["sweep_index"] == 0


# ---- issue #15 item 7: the sweep table at 80 columns, progress ----------------------------------
def test_sweep_table_is_readable_at_80_columns(tmp_path, capsys) -> None:
    from rich.console import Console

    body = TINY.format(name="a long scenario name") + """
[sweep]
connector.mode = ["pull", "push"]
connector.descriptor_merge = ["off", "strided"]
prefill.tp = [1, 2]
decode.tp = [2]
model.preset = ["tiny-kimi-linear"]
"""
    path = _file(tmp_path, body)
    code, data = _run_json(capsys, "sweep", str(path))
    assert code == 0
    console = Console(file=io.StringIO(), width=80, highlight=False)
    console.print(_sweep_table(data["scenarios"], load_scenarios(path), shard=None))
    text = console.file.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text and "..." not in text
    cells = "".join(line.split("│")[1] for line in text.splitlines() if line.count("│") > 2)
    for token in ("mode=push", "merge=strided", "P.tp=2", "D.tp=2", "model=tiny-kimi-linear"):
        assert token in cells.replace(" ", "") or token in " ".join(cells.split()), token
    assert "P.tp = prefill.tp" in text and "merge = connector.descriptor_merge" in text


def test_progress_callback_sees_every_request_reach_its_end(tmp_path) -> None:
    (scenario,) = parse_scenarios(TINY.format(name="t").replace("requests = 2", "requests = 5"))
    seen = []
    result = run_scenario(scenario, progress=seen.append)
    assert [r.index for r in sorted(seen, key=lambda r: r.index)] == list(range(5))
    assert all(r.status != "pending" for r in seen) and len(seen) == len(result.records)


def test_no_progress_output_in_a_pipe(tmp_path) -> None:
    path = _file(tmp_path, TINY.format(name="t").replace("requests = 2", "requests = 6"))
    proc = subprocess.run([sys.executable, "-m", "hkvsim.cli", "run", str(path), "--json"],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0 and proc.stderr == ""
    json.loads(proc.stdout)
